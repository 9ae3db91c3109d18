//! The memory upper layer (issue #13, `upper=memory`): the writable layer's tree — names,
//! attributes, xattrs, whiteouts and marks — held by the daemon, and its file data in one host
//! filestore (filestore.rs). A lookup, create, rename, chmod or unlink of an upper object is
//! then no host syscall at all, and the layer's data is one compact file.
//!
//! The interface is a file system's, node by node (`Ino`), so that the overlay core can keep
//! its conventions — char 0/0 whiteouts, opaque and redirect xattrs, partial-file marks over a
//! sparse file whose allocated blocks are the blocks present — whichever store it talks to.
//! Semantics follow a local file system: the errors ext4 gives, link counts, setgid
//! directories and default ACLs, timestamps a write or a rename changes, holes that read as
//! zeros.
//!
//! **Durability** (docs/FORMAT.md, "Memory upper"): `sync` writes an image of the whole tree
//! next to the filestore; `sync_changes` (an fsync) appends the nodes changed since to a
//! journal (journal.rs); a new mount serves the image with the journal applied. Nothing else
//! of the tree reaches the disk, and the filestore never overwrites a block the image or
//! journal refers to, so a crash leaves the layer as it was at the last image or entry: never
//! a mix of two states. A daemon that dies loses nothing more than its machine would not:
//! each change is also logged in a memfd the mount's holder keeps (changes.rs), which the next
//! daemon applies over the image and journal.
//!
//! **Locks** (order in docs/ROBUSTNESS.md, "Lock order"): every change takes `quiesce` for
//! reading on its thread's shard (a writer of an image takes all shards, so an image sees no
//! change half made); then directory entries (an ancestor before its descendant; two unrelated
//! directories of a cross-directory rename by inode number, under `rename_lock`); then a
//! file's data; then a node's `meta` (several at once only in a change of names, by number:
//! names.rs `Metas`); the node table's shards, the filestore and the change log last, alone.
//! A change is logged before it lets go of any of its locks (changes.rs).

use crate::acl;

mod attrs;
mod changes;
mod data;
mod filestore;
mod image;
mod journal;
mod names;

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use filestore::{BLOCK, Filestore};
pub use image::{
    IMAGE_NAME, ImageError, MAGIC as IMAGE_MAGIC, fit_checksums as fit_image_checksums,
};
pub use journal::fit_checksums as fit_journal_checksums;

use crate::error::{Result, errno};
use crate::sys::Attr;

pub type Ino = u64;

/// The root directory's number: the upper layer's root.
pub const ROOT: Ino = 1;
/// The work directory's number: a second root, outside the layer's tree, where copy-up builds
/// an object before renaming it into place (as in the work dir of a disk upper).
pub const WORK: Ino = 2;

/// The two roots.
fn is_root(ino: Ino) -> bool {
    ino == ROOT || ino == WORK
}

/// Longest name in a directory, as on ext4.
const NAME_MAX: usize = 255;
/// Largest xattr value and name, as the kernel allows.
const XATTR_SIZE_MAX: usize = 65536;
const XATTR_NAME_MAX: usize = 255;
/// `st_dev` of every memory upper node: a memory upper is no device of the host.
const DEV: u64 = 0;

/// One object of the tree.
pub struct Node {
    ino: Ino,
    /// Changed since the last image or journal entry (journal.rs).
    dirty: AtomicBool,
    meta: Mutex<Meta>,
    body: Body,
}

enum Body {
    Dir(RwLock<DirBody>, AtomicU64),
    File(RwLock<data::FileBody>),
    Symlink(OsString),
    /// Devices, FIFOs, sockets: nothing but `meta`.
    Special,
}

struct DirBody {
    entries: BTreeMap<OsString, Ino>,
    /// Removed (rmdir, or renamed over): nothing may be made in it any more.
    dead: bool,
}

#[derive(Clone)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    rdev: u64,
    atime: (i64, u32),
    mtime: (i64, u32),
    ctime: (i64, u32),
    xattrs: BTreeMap<OsString, Vec<u8>>,
    /// An O_TMPFILE file never linked: `link` may give it its first name.
    unnamed: bool,
}

/// What `make` creates: the type is in `mode`'s S_IFMT bits.
pub struct NewNode<'a> {
    /// Type and permission bits asked for; the umask and a default ACL of the parent cut them.
    pub mode: u32,
    pub umask: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    /// A symlink's target.
    pub target: Option<&'a OsStr>,
}

/// The layer's size for statfs, in `BLOCK`s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub blocks: u64,
    pub free: u64,
    pub files: u64,
}

/// `renameat2` flags the store understands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
    /// RENAME_WHITEOUT: a whiteout (a char device 0/0 of this owner, uid and gid) takes the
    /// source's name in the same step, as on a disk file system: a rename that moves a name a
    /// lower layer also has never shows that lower object again, whatever fails.
    pub whiteout: Option<(u32, u32)>,
}

/// Where images are written: the upper directory, next to the filestore.
struct Persist {
    dir: OwnedFd,
}

pub struct MemoryUpper {
    nodes: NodeTable,
    next_ino: AtomicU64,
    store: Arc<Filestore>,
    quiesce: Quiesce,
    /// Held by a rename between two directories, so that no two of them change the tree's
    /// shape at once: the ancestor check and the order of the directory locks depend on it.
    rename_lock: Mutex<()>,
    /// One image or journal entry written at a time.
    commit_lock: Mutex<()>,
    /// Commits (images, journal entries) that took their snapshot of the tree, and the last of
    /// them known durable. An fsync needs a commit that took its snapshot after the fsync was
    /// called: fsyncs that arrive while one commit runs share the next (group commit).
    commits_started: AtomicU64,
    commits_durable: AtomicU64,
    persist: Option<Persist>,
    /// Set when the store is dropped: dropping the nodes then frees no blocks (they are the
    /// last image's data).
    closing: Arc<AtomicBool>,
    /// The last image's generation; the journal follows it.
    generation: AtomicU64,
    /// Nodes removed since the last image or journal entry.
    removed: Mutex<Vec<Ino>>,
    /// The journal's length; past `JOURNAL_LIMIT` an fsync writes a full image instead.
    journal_len: AtomicU64,
    /// The journal could not be reset after an image: the next fsync writes a full image.
    journal_stale: AtomicBool,
    /// What changed since the last image or journal entry, for a daemon that takes the mount
    /// over after this one dies (changes.rs); `None` where no daemon will.
    log: Option<changes::ChangeLog>,
}

/// Whether a memory upper keeps a change log (changes.rs), and which.
#[derive(Clone, Debug)]
pub enum ChangeLogPlace {
    /// None: no daemon takes the mount over after a crash.
    Off,
    /// A new one, in a memfd of its own.
    New,
    /// The one an earlier daemon of the mount kept: its changes are applied at the open.
    Kept(Arc<OwnedFd>),
}

/// Past this, an fsync writes a full image and starts the journal anew.
const JOURNAL_LIMIT: u64 = 16 << 20;

impl MemoryUpper {
    /// An empty layer whose data goes to `filestore` and which writes no image (the layer dies
    /// with the daemon: `filestore=memory`).
    pub fn new_volatile(filestore: OwnedFd, limit_blocks: Option<u64>) -> Result<MemoryUpper> {
        rustix::fs::ftruncate(&filestore, 0)?;
        let store = Filestore::open(filestore, &[], limit_blocks)?;
        let up = MemoryUpper::from_parts(store, None, WORK + 1, None);
        up.insert_roots();
        Ok(up)
    }

    /// The layer kept in directory `dir`: its last image (`IMAGE_NAME`), with data in
    /// `filestore`; an empty layer when no image was ever written (one is written at once).
    /// With a kept change log, the changes it holds are applied over image and journal; they
    /// stay in the log until the next commit.
    pub fn open(
        dir: OwnedFd,
        filestore: OwnedFd,
        limit_blocks: Option<u64>,
        log: ChangeLogPlace,
    ) -> std::result::Result<MemoryUpper, ImageError> {
        let store_len = rustix::fs::fstat(&filestore)
            .map_err(ImageError::io)?
            .st_size as u64;
        let taken_over = matches!(log, ChangeLogPlace::Kept(_));
        // The log, given the layer's durable state as image and journal hold it.
        let open_log = |durable: changes::Durable| match &log {
            ChangeLogPlace::Off => Ok((None, Vec::new())),
            ChangeLogPlace::New => {
                let log = changes::ChangeLog::create().map_err(ImageError::io)?;
                log.follow(durable);
                Ok((Some(log), Vec::new()))
            }
            ChangeLogPlace::Kept(fd) => {
                let fd = fd.try_clone().map_err(ImageError::io)?;
                let (log, changes) = changes::ChangeLog::adopt(fd, durable)?;
                Ok::<_, ImageError>((Some(log), changes))
            }
        };
        match image::read(&dir).map_err(ImageError::io)? {
            None => {
                // A layer no image was written for: any log follows another one.
                let (log, _) = open_log((u64::MAX, u64::MAX))?;
                rustix::fs::ftruncate(&filestore, 0).map_err(ImageError::io)?;
                let store =
                    Filestore::open(filestore, &[], limit_blocks).map_err(ImageError::io)?;
                let up = MemoryUpper::from_parts(store, Some(Persist { dir }), WORK + 1, log);
                up.insert_roots();
                up.sync().map_err(ImageError::io)?;
                Ok(up)
            }
            Some(bytes) => {
                let tree = image::decode_image(&bytes, store_len / BLOCK)?;
                let generation = tree.generation;
                let journal = journal::read(&dir, generation, store_len / BLOCK)?;
                let (deltas, journal_len) = match journal {
                    Some((deltas, len)) => (deltas, Some(len)),
                    None => (Vec::new(), None),
                };
                let (log, changes) = open_log((generation, journal_entries(journal_len)))?;
                let (nodes, next_ino) = replay(tree, deltas);
                // The blocks the durable tree holds. Checked whole when it is what is served;
                // under a change log, the tree the log gives is (below), and of the durable
                // tree's blocks only those within the filestore count, once each.
                let durable = if changes.is_empty() {
                    image::check_tree(&nodes, next_ino, store_len)?
                } else {
                    let mut blocks = image::blocks_of(&nodes);
                    blocks.retain(|&b| (b + 1) * BLOCK <= store_len);
                    blocks.dedup();
                    blocks
                };
                // The changes a daemon that died made since: the tree as it was at its last
                // one. Blocks the durable tree holds stay frozen; those it alone holds are
                // freed after the next image.
                let (nodes, next_ino, used, deferred, touched) = if changes.is_empty() {
                    let touched = changes::Touched::default();
                    (nodes, next_ino, durable.clone(), Vec::new(), touched)
                } else {
                    let mut tree: BTreeMap<Ino, image::ImageNode> =
                        nodes.into_iter().map(|n| (n.ino, n)).collect();
                    let mut next_ino = next_ino;
                    let touched = changes::apply(&changes, &mut tree, &mut next_ino)?;
                    let nodes: Vec<_> = tree.into_values().collect();
                    let now =
                        image::check_tree(&nodes, next_ino, store_len).map_err(|e| match e {
                            ImageError::Damaged(why) => ImageError::ChangeLog(format!(
                                "the tree the change log gives fails the checks of an image: {why}"
                            )),
                            other => other,
                        })?;
                    let deferred: Vec<u64> = durable
                        .iter()
                        .filter(|b| now.binary_search(b).is_err())
                        .copied()
                        .collect();
                    let mut used = [now, deferred.clone()].concat();
                    used.sort_unstable();
                    (nodes, next_ino, used, deferred, touched)
                };
                let store =
                    Filestore::open(filestore, &used, limit_blocks).map_err(ImageError::io)?;
                store.restore_deferred(deferred);
                // Entries go on after the last whole one (the image and the journal so far
                // are the tree as it is now).
                if let Some(len) = journal_len {
                    journal::truncate(&dir, len).map_err(ImageError::io)?;
                }
                let up = MemoryUpper::from_parts(store, Some(Persist { dir }), next_ino, log);
                up.generation.store(generation, Ordering::Relaxed);
                up.journal_len
                    .store(journal_len.unwrap_or(0), Ordering::Relaxed);
                up.journal_stale
                    .store(journal_len.is_none(), Ordering::Relaxed);
                let frozen = |b: u64| durable.binary_search(&b).is_ok();
                for node in nodes {
                    up.insert(up.node_from_image(node, frozen));
                }
                // The log's changes stay in it (they are the layer until the next commit) and
                // go into the next journal entry; this daemon appends its own after them.
                for ino in touched.nodes {
                    if let Ok(n) = up.node(ino) {
                        n.changed();
                    }
                }
                up.removed.lock().unwrap().extend(touched.gone);
                // A journal with entries (an unmount writes one) or none at all is folded
                // into a new image now, while nobody else uses the layer directory: the
                // journal starts each mount empty, and an unmount has one to append to.
                // Not a reason to refuse the mount (a full disk): the image and journal there
                // are the layer, and the failed image left every node to the next entry. A
                // daemon that takes a mount over leaves that to the next mount: it serves
                // sooner.
                if !taken_over && journal_len.is_none_or(|len| len > journal::HEADER as u64) {
                    let _one = up.commit_lock.lock().unwrap();
                    let persist = up.persist.as_ref().expect("opened with a directory");
                    if let Err(e) = up.write_image(persist) {
                        log::warn!(
                            "memory upper: the journal could not be folded into a new image \
                             ({e}); the layer is served as the image and journal hold it, and \
                             the unmount adds to the journal (free space in the upper dir's \
                             file system, then 'mosaicfs sync' or the next mount folds it)"
                        );
                    }
                }
                Ok(up)
            }
        }
    }

    /// The layer kept in `dir` as its last image and journal show it, for reading only
    /// (`mosaicfs export` of an unmounted layer): nothing in `dir` or `filestore` is changed,
    /// no image is written, and a layer without an image reads as an empty one.
    pub fn open_read_only(
        dir: OwnedFd,
        filestore: OwnedFd,
    ) -> std::result::Result<MemoryUpper, ImageError> {
        let Some(bytes) = image::read(&dir).map_err(ImageError::io)? else {
            let up = MemoryUpper::from_parts(Filestore::read_only(filestore), None, WORK + 1, None);
            up.insert_roots();
            return Ok(up);
        };
        let journal = journal::read_file(&dir)?;
        MemoryUpper::from_bytes(&bytes, journal.as_deref(), filestore)
    }

    /// The layer an image (`image`) and its journal (`journal`, if there is one) describe,
    /// for reading only, with its data in `filestore`: every check a mount makes of them, and
    /// nothing read from or written to a directory. `open_read_only` and the fuzz targets
    /// (`crate::fuzzing`) load layers through it.
    pub fn from_bytes(
        image: &[u8],
        journal: Option<&[u8]>,
        filestore: OwnedFd,
    ) -> std::result::Result<MemoryUpper, ImageError> {
        let store_len = rustix::fs::fstat(&filestore)
            .map_err(ImageError::io)?
            .st_size as u64;
        let tree = image::decode_image(image, store_len / BLOCK)?;
        let generation = tree.generation;
        let deltas = match journal {
            Some(j) => {
                journal::decode(j, generation, store_len / BLOCK)?.map_or_else(Vec::new, |(d, _)| d)
            }
            None => Vec::new(),
        };
        let (nodes, next_ino) = replay(tree, deltas);
        image::check_tree(&nodes, next_ino, store_len)?;
        let up = MemoryUpper::from_parts(Filestore::read_only(filestore), None, next_ino, None);
        for node in nodes {
            up.insert(up.node_from_image(node, |_| true));
        }
        // Nothing frees blocks: the store is never written.
        up.closing.store(true, Ordering::Relaxed);
        Ok(up)
    }

    fn from_parts(
        store: Filestore,
        persist: Option<Persist>,
        next_ino: Ino,
        log: Option<changes::ChangeLog>,
    ) -> MemoryUpper {
        MemoryUpper {
            nodes: NodeTable::default(),
            next_ino: AtomicU64::new(next_ino),
            store: Arc::new(store),
            quiesce: Quiesce::default(),
            rename_lock: Mutex::new(()),
            commit_lock: Mutex::new(()),
            commits_started: AtomicU64::new(0),
            commits_durable: AtomicU64::new(0),
            persist,
            closing: Arc::new(AtomicBool::new(false)),
            generation: AtomicU64::new(0),
            removed: Mutex::new(Vec::new()),
            journal_len: AtomicU64::new(0),
            journal_stale: AtomicBool::new(true),
            log,
        }
    }

    /// The change log's memfd, for the mount's holder to keep (changes.rs).
    pub fn change_log(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.log.as_ref().map(|l| l.fd())
    }

    /// The records of one change; appended with `log`.
    fn txn(&self) -> changes::Txn {
        changes::Txn::new(self.log.is_some())
    }

    /// Appends `txn` to the change log. The caller still holds the locks of what it records.
    fn log(&self, txn: &changes::Txn) {
        if let Some(log) = &self.log {
            log.append(txn);
        }
    }

    /// Before a change, outside every lock: a change log past `COMMIT_AT` is trimmed by making
    /// the tree durable (an fsync's journal entry).
    fn keep_log_short(&self) {
        if self
            .log
            .as_ref()
            .is_some_and(|l| l.used() > changes::COMMIT_AT)
            && let Err(e) = self.sync_changes()
        {
            log::warn!(
                "memory upper: the tree cannot be made durable to keep the change log short \
                 ({e}); free space in the upper dir's file system"
            );
        }
    }

    fn insert_roots(&self) {
        let t = now();
        self.insert(new_root(ROOT, t));
        self.insert(new_root(WORK, t));
    }

    fn insert(&self, node: Arc<Node>) {
        self.nodes
            .shard(node.ino)
            .write()
            .unwrap()
            .insert(node.ino, node);
    }

    /// The node numbered `ino`, while it has a name (or an open handle elsewhere keeps it).
    pub fn node(&self, ino: Ino) -> Result<Arc<Node>> {
        self.nodes
            .shard(ino)
            .read()
            .unwrap()
            .get(&ino)
            .cloned()
            .ok_or_else(|| errno(libc::ENOENT))
    }

    /// The `size=` cap, in `BLOCK`s.
    pub fn size_limit(&self) -> Option<u64> {
        self.store.limit()
    }

    /// Blocks of the filestore in use.
    pub fn live_blocks(&self) -> u64 {
        self.store.live_blocks()
    }

    /// What statfs reports for the layer, in `BLOCK`s: the `size=` limit when there is one,
    /// else the file system the filestore lives on (whose free space the layer competes for).
    pub fn usage(&self) -> Result<Usage> {
        let live = self.store.live_blocks();
        let files = self.node_count() as u64;
        Ok(match self.store.limit() {
            Some(limit) => Usage {
                blocks: limit,
                free: limit.saturating_sub(live),
                files,
            },
            None => {
                let host = rustix::fs::fstatvfs(self.store.fd())?;
                let scale = |n: u64| n.saturating_mul(host.f_frsize) / BLOCK;
                Usage {
                    blocks: scale(host.f_blocks),
                    free: scale(host.f_bavail),
                    files,
                }
            }
        })
    }

    /// Number of nodes with a name.
    pub fn node_count(&self) -> usize {
        self.nodes
            .shards
            .iter()
            .map(|s| s.read().unwrap().len())
            .sum()
    }

    // ---- durability --------------------------------------------------------------------

    /// Writes an image of the tree as it is now (`mosaicfs sync`); after it returns, a crash
    /// or an unmount leaves the layer as it was at this call. Nothing to do for a volatile
    /// layer, nor when nothing changed since the last image or journal entry: those already
    /// hold the tree.
    pub fn sync(&self) -> Result<()> {
        self.make_durable(false)
    }

    /// No change since the last durable image or journal entry: no node dirty, none removed,
    /// no freed block waiting for an image. Under the commit lock; the quiesce lock keeps a
    /// change from running half-seen.
    fn unchanged(&self) -> bool {
        let _all = self.quiesce.write_all();
        !self.changed_since_durable()
    }

    /// Each lock is let go before the next is taken (none nests in another here).
    fn changed_since_durable(&self) -> bool {
        let removed = !self.removed.lock().unwrap().is_empty();
        removed
            || self.store.has_deferred()
            || self.nodes.shards.iter().any(|shard| {
                shard
                    .read()
                    .unwrap()
                    .values()
                    .any(|n| n.dirty.load(Ordering::Relaxed))
            })
    }

    /// What a crash would lose now (`mosaicfs status`): `None` for a layer that is never
    /// written (`filestore=memory`), else whether anything changed since the last image or
    /// journal entry. A glance, not a commit: changes running meanwhile may or may not count.
    pub fn changes_pending(&self) -> Option<bool> {
        self.persist.as_ref()?;
        Some(self.changed_since_durable())
    }

    /// The journal's length in bytes: what the next mount replays and folds into an image.
    pub fn journal_bytes(&self) -> u64 {
        self.journal_len.load(Ordering::Relaxed)
    }

    fn write_image(&self, persist: &Persist) -> Result<()> {
        let generation = self.generation.load(Ordering::Relaxed) + 1;
        let (bytes, deferred, removed, commit) = {
            let _all = self.quiesce.write_all();
            let commit = self.commits_started.fetch_add(1, Ordering::SeqCst) + 1;
            for shard in &self.nodes.shards {
                for n in shard.read().unwrap().values() {
                    n.dirty.store(false, Ordering::Relaxed);
                }
            }
            let bytes = image::encode(self, generation);
            #[cfg(debug_assertions)]
            if let Err(e) = image::check_encoded(&bytes, self.store.fd()) {
                panic!("memory upper: the image about to be written is not a tree: {e}");
            }
            // Blocks freed before this image are not in it: they go when it is durable.
            let removed = std::mem::take(&mut *self.removed.lock().unwrap());
            // Once durable: the new image, and an empty journal after it.
            let next = (generation, 0);
            let mark = self.log.as_ref().map(|l| (l, l.mark(next), next));
            (bytes, self.store.take_deferred(), removed, (commit, mark))
        };
        let (commit, mark) = commit;
        let written = self
            .store
            .sync()
            .and_then(|()| image::write(&persist.dir, &bytes));
        if let Err(e) = written {
            self.store.restore_deferred(deferred);
            self.mark_all_dirty(removed);
            return Err(e);
        }
        self.generation.store(generation, Ordering::Relaxed);
        self.commits_durable.fetch_max(commit, Ordering::SeqCst);
        if let Some((log, mark, next)) = mark {
            log.trim(mark, next);
        }
        self.store.free(&deferred)?;
        // The journal of the old image is ignored from now on; a new one follows this image.
        match journal::reset(&persist.dir, generation) {
            Ok(()) => {
                self.journal_stale.store(false, Ordering::Relaxed);
                self.journal_len.store(0, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.journal_stale.store(true, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// What an fsync needs: every change so far durable, cheaply. Appends the nodes changed
    /// since the last image or entry to the journal (a full image when there is no usable
    /// journal or it has grown past `JOURNAL_LIMIT`) — unless, while this call waited for the
    /// commit lock, a commit that started after it was called became durable: that one holds
    /// every change this call must make durable.
    pub fn sync_changes(&self) -> Result<()> {
        let Some(persist) = &self.persist else {
            return Ok(());
        };
        // A commit numbered past the ones started now takes its snapshot after this point,
        // so after every change the caller made (its quiesce read ended before this call).
        let covering = self.commits_started.load(Ordering::SeqCst) + 1;
        let _one = self.commit_lock.lock().unwrap();
        if self.commits_durable.load(Ordering::SeqCst) >= covering {
            return Ok(());
        }
        if self.journal_stale.load(Ordering::Relaxed)
            || self.journal_len.load(Ordering::Relaxed) > JOURNAL_LIMIT
        {
            return self.write_image(persist);
        }
        self.append_entry(persist)
    }

    /// What an unmount needs: every change so far durable, without making a name in the upper
    /// dir. The daemon's last writes run after umount(2) has returned (FUSE sends no DESTROY
    /// but to fuseblk), when containers/storage may already be removing the layer directory:
    /// an image (`.mosaicfs-tree.new`, renamed) made in it then failed that removal with
    /// ENOTEMPTY. A journal entry is written into the journal that is there, whatever its
    /// length; the next mount folds it into an image (`open`). Nothing at all is written when
    /// nothing changed since the last image or entry.
    pub fn sync_at_unmount(&self) -> Result<()> {
        self.make_durable(true)
    }

    /// `sync` (`to_journal` false) and `sync_at_unmount` (true, unless the journal is unusable).
    /// Nothing at all is written when nothing changed since the last image or entry: the
    /// unmount of a layer mounted only to read it (containers/storage's diff) writes nothing.
    fn make_durable(&self, to_journal: bool) -> Result<()> {
        let Some(persist) = &self.persist else {
            return Ok(());
        };
        let _one = self.commit_lock.lock().unwrap();
        if self.unchanged() {
            return Ok(());
        }
        if to_journal && !self.journal_stale.load(Ordering::Relaxed) {
            return self.append_entry(persist);
        }
        self.write_image(persist)
    }

    /// Appends the nodes changed and removed since the last image or entry to the journal.
    /// Under the commit lock.
    fn append_entry(&self, persist: &Persist) -> Result<()> {
        let (entry, changed, removed, commit) = {
            let _all = self.quiesce.write_all();
            let commit = self.commits_started.fetch_add(1, Ordering::SeqCst) + 1;
            let mut changed = Vec::new();
            for shard in &self.nodes.shards {
                for n in shard.read().unwrap().values() {
                    if n.dirty.swap(false, Ordering::Relaxed) {
                        changed.push(n.clone());
                    }
                }
            }
            changed.sort_by_key(|n| n.ino);
            let removed = std::mem::take(&mut *self.removed.lock().unwrap());
            let next = self.next_ino.load(Ordering::Relaxed);
            let entry = journal::encode(next, &removed, &changed);
            // Once durable: this image's journal with the entry after what it holds.
            let after = journal_entries(Some(self.journal_len.load(Ordering::Relaxed)))
                + entry.len() as u64;
            let next = (self.generation.load(Ordering::Relaxed), after);
            let mark = self.log.as_ref().map(|l| (l, l.mark(next), next));
            (entry, changed, removed, (commit, mark))
        };
        let (commit, mark) = commit;
        let appended = self
            .store
            .sync()
            .and_then(|()| journal::append(&persist.dir, &entry));
        match appended {
            Ok(len) => {
                self.journal_len.store(len, Ordering::Relaxed);
                self.commits_durable.fetch_max(commit, Ordering::SeqCst);
                if let Some((log, mark, next)) = mark {
                    log.trim(mark, next);
                }
                Ok(())
            }
            Err(e) => {
                // Not durable: the next entry carries these changes again.
                for n in changed {
                    n.dirty.store(true, Ordering::Relaxed);
                }
                self.removed.lock().unwrap().extend(removed);
                Err(e)
            }
        }
    }

    /// After an image could not be written: every node goes into the next entry or image.
    fn mark_all_dirty(&self, removed: Vec<Ino>) {
        for shard in &self.nodes.shards {
            for n in shard.read().unwrap().values() {
                n.dirty.store(true, Ordering::Relaxed);
            }
        }
        self.removed.lock().unwrap().extend(removed);
    }

    /// `frozen`: whether the durable image or journal holds a filestore block.
    fn node_from_image(&self, n: image::ImageNode, frozen: impl Fn(u64) -> bool) -> Arc<Node> {
        let body = match n.body {
            image::ImageBody::Dir { parent, entries } => Body::Dir(
                RwLock::new(DirBody {
                    entries,
                    dead: false,
                }),
                AtomicU64::new(parent),
            ),
            image::ImageBody::File { size, extents } => {
                Body::File(RwLock::new(data::FileBody::from_image(
                    self.store.clone(),
                    self.closing.clone(),
                    size,
                    extents,
                    frozen,
                )))
            }
            image::ImageBody::Symlink(t) => Body::Symlink(t),
            image::ImageBody::Special => Body::Special,
        };
        Arc::new(Node {
            ino: n.ino,
            dirty: AtomicBool::new(false),
            meta: Mutex::new(Meta {
                mode: n.mode,
                uid: n.uid,
                gid: n.gid,
                nlink: n.nlink,
                rdev: n.rdev,
                atime: n.atime,
                mtime: n.mtime,
                ctime: n.ctime,
                xattrs: n.xattrs,
                unnamed: false,
            }),
            body,
        })
    }
}

impl Drop for MemoryUpper {
    fn drop(&mut self) {
        // The nodes dropped now keep their blocks: they are the last image's, or (volatile
        // layer) die with the filestore anyway.
        self.closing.store(true, Ordering::Relaxed);
    }
}

impl Node {
    pub fn ino(&self) -> Ino {
        self.ino
    }

    /// Changed: the next journal entry carries it. Called inside the change's quiesce read.
    fn changed(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    pub fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir(..))
    }

    fn dir(&self) -> Result<&RwLock<DirBody>> {
        match &self.body {
            Body::Dir(d, _) => Ok(d),
            _ => Err(errno(libc::ENOTDIR)),
        }
    }

    fn parent(&self) -> Option<&AtomicU64> {
        match &self.body {
            Body::Dir(_, p) => Some(p),
            _ => None,
        }
    }

    pub fn file_type(&self) -> u32 {
        self.meta.lock().unwrap().mode & libc::S_IFMT
    }

    pub fn attr(&self) -> Attr {
        let (size, blocks) = match &self.body {
            Body::File(f) => {
                let f = f.read().unwrap();
                (f.size(), f.blocks() * (BLOCK / 512))
            }
            Body::Dir(..) => (BLOCK, BLOCK / 512),
            Body::Symlink(t) => (t.len() as u64, 0),
            Body::Special => (0, 0),
        };
        let m = self.meta.lock().unwrap();
        Attr {
            dev: DEV,
            ino: self.ino,
            mode: m.mode,
            nlink: m.nlink,
            uid: m.uid,
            gid: m.gid,
            rdev: m.rdev,
            size,
            blocks,
            blksize: BLOCK as u32,
            atime: m.atime,
            mtime: m.mtime,
            ctime: m.ctime,
            // Numbers are never given twice here (`next_ino`): no generation needed.
            btime: None,
        }
    }
}

/// The bytes of entries in a journal `len` bytes long (`None`: none usable).
fn journal_entries(len: Option<u64>) -> u64 {
    len.map_or(0, |l| l.saturating_sub(journal::HEADER as u64))
}

/// The image's nodes with the journal's entries applied in order: the tree as of the last
/// entry.
fn replay(image: image::Image, deltas: Vec<journal::Delta>) -> (Vec<image::ImageNode>, Ino) {
    let mut next_ino = image.next_ino;
    let mut nodes: BTreeMap<Ino, image::ImageNode> =
        image.nodes.into_iter().map(|n| (n.ino, n)).collect();
    for d in deltas {
        for ino in d.removed {
            nodes.remove(&ino);
        }
        for n in d.nodes {
            nodes.insert(n.ino, n);
        }
        next_ino = next_ino.max(d.next_ino);
    }
    (nodes.into_values().collect(), next_ino)
}

/// An empty root directory numbered `ino` (its own parent).
fn new_root(ino: Ino, t: (i64, u32)) -> Arc<Node> {
    Arc::new(Node {
        ino,
        dirty: AtomicBool::new(true),
        meta: Mutex::new(Meta {
            mode: libc::S_IFDIR | 0o755,
            uid: 0,
            gid: 0,
            nlink: 2,
            rdev: 0,
            atime: t,
            mtime: t,
            ctime: t,
            xattrs: BTreeMap::new(),
            unnamed: false,
        }),
        body: Body::Dir(
            RwLock::new(DirBody {
                entries: BTreeMap::new(),
                dead: false,
            }),
            AtomicU64::new(ino),
        ),
    })
}

fn check_name(name: &OsStr) -> Result<()> {
    let b = name.as_bytes();
    if b.len() > NAME_MAX {
        return Err(errno(libc::ENAMETOOLONG));
    }
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') || b.contains(&0) {
        return Err(errno(libc::EINVAL));
    }
    Ok(())
}

fn now() -> (i64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

/// The nodes with a name, by number, in shards so that lookups of different nodes do not meet
/// on one lock.
struct NodeTable {
    shards: Vec<RwLock<HashMap<Ino, Arc<Node>>>>,
}

const TABLE_SHARDS: usize = 64;

impl Default for NodeTable {
    fn default() -> Self {
        NodeTable {
            shards: (0..TABLE_SHARDS).map(|_| RwLock::default()).collect(),
        }
    }
}

impl NodeTable {
    fn shard(&self, ino: Ino) -> &RwLock<HashMap<Ino, Arc<Node>>> {
        &self.shards[(ino as usize) % TABLE_SHARDS]
    }
}

/// A reader-writer lock split per thread: every change takes its own thread's shard for
/// reading (no cache line shared between threads on the hot path), the image writer takes all
/// of them. Readers never nest.
struct Quiesce {
    shards: Vec<Padded>,
}

#[repr(align(128))]
#[derive(Default)]
struct Padded(RwLock<()>);

const QUIESCE_SHARDS: usize = 16;

impl Default for Quiesce {
    fn default() -> Self {
        Quiesce {
            shards: (0..QUIESCE_SHARDS).map(|_| Padded::default()).collect(),
        }
    }
}

impl Quiesce {
    fn read(&self) -> RwLockReadGuard<'_, ()> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed) as usize % QUIESCE_SHARDS;
        }
        let slot = SLOT.with(|s| *s);
        self.shards[slot].0.read().unwrap()
    }

    fn write_all(&self) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.shards.iter().map(|s| s.0.write().unwrap()).collect()
    }
}

#[cfg(test)]
mod tests;
