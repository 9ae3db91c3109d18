//! The change log: every change made to the tree since the last image or journal entry, kept
//! where a daemon that takes the mount over after a crash finds it — a memfd that the mount's
//! holder keeps open too (takeover.rs). The image and journal hold the tree as of the last
//! fsync; the log holds the rest, so that the next daemon serves the tree as it was at the
//! last change this one made, and a process on the mount sees nothing of the crash.
//!
//! **What a change logs.** Each change to the tree appends one entry (a `Txn`) of records
//! that give values, never differences: a node's attributes as they now are (`NEW` makes the
//! node, `META` changes one that exists), a name of a directory set or removed (`ENTRY`), a
//! file's size with the blocks mapped and unmapped (`FILE`), a node gone (`GONE`). Applied in
//! order over the image and journal they give the tree; applied over a tree that already holds
//! some of them (a daemon killed between a commit and the log's trimming) they give the same.
//! No record holds a directory's names whole: a create in a directory of a million names logs
//! one name.
//!
//! **Order and atomicity.** An entry is appended while the change still holds every lock of
//! what it records (a directory's names, a file's data, the nodes' attributes). So an entry
//! that follows another in the log never depends on a change the log does not hold yet, and a
//! change that a later one saw is in the log before it. An entry counts once the log's tail
//! word says so, written after the entry: a daemon killed in the middle of an append leaves
//! the entry out, and its change was never answered (the kernel sends the request again). A
//! block freed by a change goes back to the filestore only after the entry is in the log, so
//! no block the log still maps is written by another file.
//!
//! **Trimming.** An image or journal entry takes its snapshot with no change in flight (every
//! quiesce shard held) and notes the log's tail then (`mark`); once it is durable the log
//! starts there (`trim`). The log is a ring; past `COMMIT_AT` a change first makes the tree
//! durable (mod.rs `keep_log_short`), which trims it. A log that still fills (the upper dir's
//! file system refuses the commits) stops and says it lost changes: the next daemon then
//! refuses to serve a tree it cannot rebuild, and the mount ends as it would without a holder,
//! until a commit succeeds and the log goes on from its snapshot.
//!
//! Layout in docs/FORMAT.md, "Memory upper: the change log".

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::image::{
    self, ImageBody, ImageError, ImageNode, KIND_DIR, KIND_FILE, KIND_SYMLINK, Reader, crc,
    put_u32, put_u64,
};
use super::{Body, Ino, Meta, Node};
use crate::error::Result;
use crate::sys;

const MAGIC: u64 = u64::from_le_bytes(*b"MOSAICCL");
const VERSION: u64 = 1;
/// The header's words: magic, version, capacity, head, tail, lost, the durable state the
/// entries from the head on follow (`Durable`: generation, journal bytes), and the commit in
/// progress (its durable state, and the tail it took its snapshot at).
const HEAD_AT: u64 = 24;
const TAIL_AT: u64 = 32;
const LOST_AT: u64 = 40;
const FOLLOWS_AT: u64 = 48;
const NEXT_AT: u64 = 64;
const NEXT_MARK_AT: u64 = 80;
const HEADER_WORDS: u64 = 11;

/// A durable state of the layer: the image's generation and the bytes of journal entries
/// after it. The log's entries follow one; a log that follows none the layer has now was left
/// by a daemon before one of a binary that keeps no log served the layer, and is dropped.
pub(super) type Durable = (u64, u64);
/// Where the ring starts in the memfd.
const RING_AT: u64 = 4096;
/// The ring's size. The memfd is sparse: pages are taken as entries are written, and given
/// back as the ring goes round.
const CAPACITY: u64 = 256 << 20;
/// Past this much of the ring in use, a change first makes the tree durable: what bounds the
/// work of a daemon that takes the mount over (about 40,000 creates, read and applied in
/// 0.3 s here).
pub(super) const COMMIT_AT: u64 = 8 << 20;

const NEW: u8 = 1;
const META: u8 = 2;
const ENTRY: u8 = 3;
const FILE: u8 = 4;
const GONE: u8 = 5;

/// A change to a file's block map, in the order it was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MapChange {
    /// File block → filestore block.
    Set(u64, u64),
    /// File block `k` is a hole now.
    Unset(u64),
    /// Every block from `k` on is a hole now.
    Cut(u64),
}

/// One change's records, appended to the log as one entry (`ChangeLog::append`). One made
/// for a layer without a log (`Txn::off`) records nothing.
pub(super) struct Txn {
    on: bool,
    buf: Vec<u8>,
}

impl Txn {
    pub fn new(on: bool) -> Txn {
        Txn {
            on,
            buf: Vec::new(),
        }
    }

    /// Node `n` made, with attributes `m` (the caller holds its meta lock, or no other thread
    /// can reach it yet).
    pub fn made(&mut self, n: &Node, m: &Meta) {
        self.node(NEW, n, m);
    }

    /// Node `n`'s attributes are now `m` (the caller holds its meta lock).
    pub fn meta(&mut self, n: &Node, m: &Meta) {
        self.node(META, n, m);
    }

    fn node(&mut self, tag: u8, n: &Node, m: &Meta) {
        if !self.on {
            return;
        }
        let b = &mut self.buf;
        b.push(tag);
        image::put_attrs(n, m, b);
        match &n.body {
            Body::Dir(_, parent) => put_u64(b, parent.load(Ordering::Relaxed)),
            Body::Symlink(t) => image::put_bytes(b, t.as_bytes()),
            _ => {}
        }
    }

    /// `name` in directory `dir` now names `ino`, or nothing (the caller holds the directory's
    /// names).
    pub fn entry(&mut self, dir: Ino, name: &OsStr, ino: Option<Ino>) {
        if !self.on {
            return;
        }
        self.buf.push(ENTRY);
        put_u64(&mut self.buf, dir);
        image::put_bytes(&mut self.buf, name.as_bytes());
        put_u64(&mut self.buf, ino.unwrap_or(0));
    }

    /// File `ino` is `size` bytes long, its map changed by `changes` (the caller holds its
    /// data).
    pub fn file(&mut self, ino: Ino, size: u64, changes: &[MapChange]) {
        if !self.on {
            return;
        }
        let b = &mut self.buf;
        b.push(FILE);
        put_u64(b, ino);
        put_u64(b, size);
        put_u32(b, changes.len() as u32);
        for c in changes {
            match *c {
                MapChange::Set(k, block) => {
                    b.push(1);
                    put_u64(b, k);
                    put_u64(b, block);
                }
                MapChange::Unset(k) => {
                    b.push(2);
                    put_u64(b, k);
                }
                MapChange::Cut(k) => {
                    b.push(3);
                    put_u64(b, k);
                }
            }
        }
    }

    /// Node `ino` left the tree (its last name went).
    pub fn gone(&mut self, ino: Ino) {
        if !self.on {
            return;
        }
        self.buf.push(GONE);
        put_u64(&mut self.buf, ino);
    }
}

/// Where the log stands in this daemon.
struct Ends {
    head: u64,
    tail: u64,
    /// Ring positions below this have pages allocated (`fallocate`): a store there cannot
    /// fault for memory.
    allocated: u64,
    /// Appends stopped: the ring was full, or the memfd could not take more pages.
    stopped: bool,
    /// Where appends started again after a stop: the header says "lost" until a commit that
    /// took its snapshot there or later is durable.
    resumed_at: Option<u64>,
}

/// Pages of the ring are allocated this many bytes ahead of the tail at a time.
const ALLOCATE_AHEAD: u64 = 1 << 20;

pub(super) struct ChangeLog {
    file: OwnedFd,
    /// The whole memfd, mapped shared: entries are copied in and the header's words stored
    /// with no system call. Stores go through `ends`' lock (the only writer); the header words
    /// are atomics.
    map: sys::SharedMap,
    ends: Mutex<Ends>,
}

impl ChangeLog {
    /// A new, empty log in a memfd of its own.
    pub fn create() -> Result<ChangeLog> {
        let file = rustix::fs::memfd_create("mosaicfs-changes", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&file, RING_AT + CAPACITY)?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, RING_AT)?;
        let mut header = Vec::new();
        for w in [MAGIC, VERSION, CAPACITY] {
            put_u64(&mut header, w);
        }
        header.resize(HEADER_WORDS as usize * 8, 0);
        sys::pwrite_full(file.as_fd(), &header, 0)?;
        let map = sys::map_shared(file.as_fd(), (RING_AT + CAPACITY) as usize)?;
        Ok(ChangeLog {
            file,
            map,
            ends: Mutex::new(Ends {
                head: 0,
                tail: 0,
                allocated: 0,
                stopped: false,
                resumed_at: None,
            }),
        })
    }

    /// The log an earlier daemon of the mount kept, and its entries not yet trimmed: what it
    /// changed since the layer was last made durable, which is now `durable`. An error for a
    /// memfd of another layout, or a log that lost changes (they cannot be rebuilt).
    pub fn adopt(
        file: OwnedFd,
        durable: Durable,
    ) -> std::result::Result<(ChangeLog, Vec<Vec<u8>>), ImageError> {
        let word = |at: u64| -> std::result::Result<u64, ImageError> {
            let mut w = [0u8; 8];
            sys::pread_full(file.as_fd(), &mut w, at).map_err(ImageError::io)?;
            Ok(u64::from_le_bytes(w))
        };
        let len = rustix::fs::fstat(&file).map_err(ImageError::io)?.st_size as u64;
        if word(0)? != MAGIC || word(8)? != VERSION || word(16)? != CAPACITY {
            return damaged(
                "the change log the daemon before kept is not one this binary reads (another \
                 version)",
            );
        }
        if len != RING_AT + CAPACITY {
            return damaged("the change log's memfd is not the size of its ring");
        }
        let (head, tail) = (word(HEAD_AT)?, word(TAIL_AT)?);
        if tail < head || tail - head > CAPACITY {
            return damaged("the change log's ends do not fit its ring");
        }
        let follows = (word(FOLLOWS_AT)?, word(FOLLOWS_AT + 8)?);
        let next = (word(NEXT_AT)?, word(NEXT_AT + 8)?);
        let next_mark = word(NEXT_MARK_AT)?;
        // Where the entries that follow `durable` start: the head, or where a commit that
        // became durable before its daemon died took its snapshot.
        let start = if head == tail || durable == follows {
            Some(head)
        } else if durable == next && (head..=tail).contains(&next_mark) {
            Some(next_mark)
        } else {
            None
        };
        if start.is_some() && word(LOST_AT)? != 0 {
            return damaged(
                "the daemon before lost changes to the tree that its change log could not hold \
                 (the upper dir's file system refused its commits)",
            );
        }
        let map =
            sys::map_shared(file.as_fd(), (RING_AT + CAPACITY) as usize).map_err(ImageError::io)?;
        let log = ChangeLog {
            file,
            map,
            ends: Mutex::new(Ends {
                head,
                tail,
                allocated: tail,
                stopped: false,
                resumed_at: None,
            }),
        };
        let Some(start) = start else {
            log::warn!(
                "memory upper: the change log the holder kept follows another state of the \
                 layer (a daemon of a binary that keeps none served it since, and wrote what it \
                 changed as it handed over): its entries are dropped"
            );
            log.settle(tail, durable);
            return Ok((log, Vec::new()));
        };
        let now_follows = if head == tail {
            durable
        } else if start == head {
            follows
        } else {
            next
        };
        log.settle(start, now_follows);
        let mut ring = vec![0u8; (tail - start) as usize];
        log.read_ring(&mut ring, start).map_err(ImageError::io)?;
        let mut entries = Vec::new();
        let mut at = 0;
        while at < ring.len() {
            let Some(h) = ring.get(at..at + 8) else {
                return damaged("an entry of the change log runs past its tail");
            };
            let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
            let sum = u32::from_le_bytes(h[4..].try_into().unwrap());
            let Some(payload) = ring.get(at + 8..at + 8 + len) else {
                return damaged("an entry of the change log runs past its tail");
            };
            if crc(payload) != sum {
                return damaged("an entry of the change log does not match its checksum");
            }
            entries.push(payload.to_vec());
            at += padded(8 + len as u64) as usize;
        }
        Ok((log, entries))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The header word at byte `at`.
    fn word(&self, at: u64) -> &AtomicU64 {
        debug_assert!(at < RING_AT && at.is_multiple_of(8));
        // SAFETY: `at` is within the mapping's first page, which lives as long as `self`, and
        // is aligned.
        unsafe { &*(self.map.ptr().add(at as usize) as *const AtomicU64) }
    }

    /// The bytes of the ring in use.
    pub fn used(&self) -> u64 {
        let e = self.ends.lock().unwrap();
        e.tail - e.head
    }

    /// Appends `txn` as one entry. The caller still holds the locks of everything it records.
    pub fn append(&self, txn: &Txn) {
        if txn.buf.is_empty() {
            return;
        }
        let mut e = self.ends.lock().unwrap();
        if e.stopped {
            return;
        }
        let len = padded(8 + txn.buf.len() as u64);
        let floor = e.head.max(e.resumed_at.unwrap_or(0));
        let room = if e.tail + len - floor > CAPACITY {
            Err(crate::message!(
                "the change log is full ({CAPACITY} bytes since the last commit)"
            ))
        } else {
            let end = e.tail + len;
            self.allocate(&mut e, end, floor)
        };
        match room {
            Ok(()) => {
                let mut head = [0u8; 8];
                head[..4].copy_from_slice(&(txn.buf.len() as u32).to_le_bytes());
                head[4..].copy_from_slice(&crc(&txn.buf).to_le_bytes());
                self.write_ring(&head, e.tail);
                self.write_ring(&txn.buf, e.tail + 8);
                e.tail += len;
                // After the entry: a daemon killed before this store leaves it out.
                self.word(TAIL_AT).store(e.tail, Ordering::Release);
            }
            Err(err) => {
                e.stopped = true;
                self.word(LOST_AT).store(1, Ordering::Release);
                log::error!(
                    "memory upper: {err}: changes to the tree are no longer kept for a daemon \
                     that takes the mount over, until the next fsync or sync succeeds (a \
                     daemon that dies before that ends the mount)"
                );
            }
        }
    }

    /// Has the ring's pages allocated up to position `end` (and some way past it, never
    /// beyond `floor` + the capacity): a store into an unallocated page of a memfd would kill
    /// the daemon with SIGBUS where memory is short, where `fallocate` returns an error.
    fn allocate(&self, e: &mut Ends, end: u64, floor: u64) -> Result<()> {
        if end <= e.allocated {
            return Ok(());
        }
        let from = e.allocated.max(floor);
        let to = (end + ALLOCATE_AHEAD).min(floor + CAPACITY);
        self.ring_ranges(from, to - from, |at, len| {
            rustix::fs::fallocate(&self.file, rustix::fs::FallocateFlags::empty(), at, len)
        })?;
        e.allocated = to;
        Ok(())
    }

    /// Calls `f` with the memfd's byte ranges of the ring's `len` bytes from position `from`.
    fn ring_ranges(
        &self,
        from: u64,
        len: u64,
        mut f: impl FnMut(u64, u64) -> rustix::io::Result<()>,
    ) -> rustix::io::Result<()> {
        let len = len.min(CAPACITY);
        let start = from % CAPACITY;
        let first = len.min(CAPACITY - start);
        if first > 0 {
            f(RING_AT + start, first)?;
        }
        if len > first {
            f(RING_AT, len - first)?;
        }
        Ok(())
    }

    /// The log starts at `head` and follows `durable` (at adopt: before any append). The
    /// head first: a daemon killed between the two leaves a log the next one reads the same.
    fn settle(&self, head: u64, durable: Durable) {
        let mut e = self.ends.lock().unwrap();
        e.head = head;
        self.word(HEAD_AT).store(head, Ordering::Release);
        self.word(FOLLOWS_AT).store(durable.0, Ordering::Release);
        self.word(FOLLOWS_AT + 8)
            .store(durable.1, Ordering::Release);
        if head == e.tail {
            self.word(LOST_AT).store(0, Ordering::Release);
        }
    }

    /// A log with no entries follows `durable`, the layer as a mount found it.
    pub fn follow(&self, durable: Durable) {
        let (head, tail) = {
            let e = self.ends.lock().unwrap();
            (e.head, e.tail)
        };
        if head == tail {
            self.settle(head, durable);
        }
    }

    /// The log's tail now, for a commit taking its snapshot (no change in flight) that will
    /// leave the layer as `next` once durable. A log that stopped goes on from here.
    pub fn mark(&self, next: Durable) -> u64 {
        let mut e = self.ends.lock().unwrap();
        if e.stopped {
            e.stopped = false;
            e.resumed_at = Some(e.tail);
        }
        self.word(NEXT_AT).store(next.0, Ordering::Release);
        self.word(NEXT_AT + 8).store(next.1, Ordering::Release);
        self.word(NEXT_MARK_AT).store(e.tail, Ordering::Release);
        e.tail
    }

    /// A commit that took its snapshot at `mark` is durable, and the layer is `next`: the log
    /// starts there. (A daemon killed before this leaves a log whose `next` is the layer: the
    /// next one starts it at the mark.)
    pub fn trim(&self, mark: u64, next: Durable) {
        let mut e = self.ends.lock().unwrap();
        if mark < e.head {
            return;
        }
        let old = e.head;
        e.head = mark;
        self.word(HEAD_AT).store(mark, Ordering::Release);
        self.word(FOLLOWS_AT).store(next.0, Ordering::Release);
        self.word(FOLLOWS_AT + 8).store(next.1, Ordering::Release);
        if e.resumed_at.is_some_and(|r| r <= mark) && !e.stopped {
            e.resumed_at = None;
            self.word(LOST_AT).store(0, Ordering::Release);
        }
        // Whole pages of the ring behind the head go back to the system.
        let (from, to) = (old / 4096 * 4096, mark / 4096 * 4096);
        if to > from {
            let flags =
                rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
            let _ = self.ring_ranges(from, to - from, |at, len| {
                rustix::fs::fallocate(&self.file, flags, at, len)
            });
        }
    }

    /// Copies `bytes` into the ring at position `at`, whose pages are allocated.
    fn write_ring(&self, bytes: &[u8], at: u64) {
        let mut done = 0;
        let _ = self.ring_ranges(at, bytes.len() as u64, |to, len| {
            let part = &bytes[done..done + len as usize];
            // SAFETY: `to..to + len` lies within the mapping (`ring_ranges` keeps it inside
            // the ring), whose pages are allocated; only this daemon stores there, under
            // `ends`' lock.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    part.as_ptr(),
                    self.map.ptr().add(to as usize),
                    part.len(),
                );
            }
            done += len as usize;
            Ok(())
        });
    }

    fn read_ring(&self, buf: &mut [u8], at: u64) -> Result<()> {
        let mut done = 0;
        self.ring_ranges(at, buf.len() as u64, |from, len| {
            let part = &mut buf[done..done + len as usize];
            sys::pread_full(self.file.as_fd(), part, from).map_err(|_| rustix::io::Errno::IO)?;
            done += len as usize;
            Ok(())
        })?;
        Ok(())
    }
}

/// The log cannot be applied: why.
fn damaged<T>(why: impl Into<String>) -> std::result::Result<T, ImageError> {
    Err(ImageError::ChangeLog(why.into()))
}

fn padded(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// What the log's entries changed: the nodes to go into the next journal entry.
#[derive(Default)]
pub(super) struct Touched {
    pub nodes: std::collections::HashSet<Ino>,
    pub gone: Vec<Ino>,
}

/// Applies the log's `entries` in order to `nodes` (the tree as the image and journal hold
/// it); `next_ino` grows past every number made.
pub(super) fn apply(
    entries: &[Vec<u8>],
    nodes: &mut BTreeMap<Ino, ImageNode>,
    next_ino: &mut Ino,
) -> std::result::Result<Touched, ImageError> {
    let mut touched = Touched::default();
    for entry in entries {
        let mut r = Reader { b: entry };
        while !r.b.is_empty() {
            match r.u8()? {
                tag @ (NEW | META) => {
                    let (n, parent) = read_node(&mut r)?;
                    if tag == NEW {
                        *next_ino = (*next_ino).max(n.ino + 1);
                    }
                    touched.nodes.insert(n.ino);
                    apply_node(nodes, tag == NEW, n, parent);
                }
                ENTRY => {
                    let dir = r.u64()?;
                    let name = OsString::from_vec(r.bytes()?.to_vec());
                    let ino = r.u64()?;
                    if super::check_name(&name).is_err() {
                        return damaged(format!("the change log names {name:?}"));
                    }
                    touched.nodes.insert(dir);
                    if let Some(ImageNode {
                        body: ImageBody::Dir { entries, .. },
                        ..
                    }) = nodes.get_mut(&dir)
                    {
                        match ino {
                            0 => entries.remove(&name),
                            ino => entries.insert(name, ino),
                        };
                    }
                }
                FILE => {
                    let ino = r.u64()?;
                    let size = r.u64()?;
                    let count = r.u32()?;
                    let mut changes = Vec::new();
                    for _ in 0..count {
                        changes.push(match r.u8()? {
                            1 => MapChange::Set(r.u64()?, r.u64()?),
                            2 => MapChange::Unset(r.u64()?),
                            3 => MapChange::Cut(r.u64()?),
                            t => return damaged(format!("the change log has map change {t}")),
                        });
                    }
                    touched.nodes.insert(ino);
                    if let Some(ImageNode {
                        body: ImageBody::File { size: s, extents },
                        ..
                    }) = nodes.get_mut(&ino)
                    {
                        *s = size;
                        for c in changes {
                            match c {
                                MapChange::Set(k, b) => {
                                    extents.insert(k, b);
                                }
                                MapChange::Unset(k) => {
                                    extents.remove(&k);
                                }
                                MapChange::Cut(k) => {
                                    extents.split_off(&k);
                                }
                            }
                        }
                    }
                }
                GONE => {
                    let ino = r.u64()?;
                    nodes.remove(&ino);
                    touched.gone.push(ino);
                }
                t => return damaged(format!("the change log has a record of kind {t}")),
            }
        }
    }
    Ok(touched)
}

/// A node record: the node with an empty body, and its parent (a directory's).
fn read_node(r: &mut Reader<'_>) -> std::result::Result<(ImageNode, Ino), ImageError> {
    let attrs = image::read_attrs(r)?;
    let mut parent = 0;
    let body = match attrs.kind {
        KIND_DIR => {
            parent = r.u64()?;
            ImageBody::Dir {
                parent,
                entries: BTreeMap::new(),
            }
        }
        KIND_FILE => ImageBody::File {
            size: 0,
            extents: BTreeMap::new(),
        },
        KIND_SYMLINK => ImageBody::Symlink(OsString::from_vec(r.bytes()?.to_vec())),
        _ => ImageBody::Special,
    };
    Ok((attrs.with_body(body), parent))
}

/// A node record applied: `made` inserts the node where it is missing; either way the
/// attributes (and a directory's parent) are the record's, and a body the tree already holds
/// stays (its names and blocks have records of their own).
fn apply_node(nodes: &mut BTreeMap<Ino, ImageNode>, made: bool, n: ImageNode, parent: Ino) {
    match nodes.get_mut(&n.ino) {
        Some(old) if std::mem::discriminant(&old.body) == std::mem::discriminant(&n.body) => {
            old.mode = n.mode;
            old.uid = n.uid;
            old.gid = n.gid;
            old.nlink = n.nlink;
            old.rdev = n.rdev;
            old.atime = n.atime;
            old.mtime = n.mtime;
            old.ctime = n.ctime;
            old.xattrs = n.xattrs;
            if let ImageBody::Dir { parent: p, .. } = &mut old.body {
                *p = parent;
            }
        }
        Some(old) if made => *old = n,
        Some(_) => {}
        None if made => {
            nodes.insert(n.ino, n);
        }
        None => {}
    }
}
