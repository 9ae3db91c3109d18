//! The memory upper layer (issue #13, `upper=memory`): the writable layer's tree — names,
//! attributes, xattrs, whiteouts and marks — held by the daemon, and its file data in one host
//! filestore (filestore.rs). A lookup, create, rename, chmod or unlink of an upper object is
//! then no host syscall at all, and the layer's data is one compact file.
//!
//! The interface is a file system's, node by node (`Ino`), so that the overlay core can keep
//! its conventions — char 0/0 whiteouts, opaque and redirect xattrs, partial-file marks over a
//! sparse file whose allocated blocks are the blocks present — whichever store it talks to.
//! Semantics follow a local file system: the errors ext4 gives, link counts, setgid
//! directories, timestamps a write or a rename changes, holes that read as zeros.
//!
//! **Durability** (docs/FORMAT.md, "Memory upper"): `sync` writes an image of the whole tree
//! next to the filestore; a new mount serves the last image. Between images nothing of the tree
//! reaches the disk, and the filestore never overwrites a block the last image refers to, so a
//! crash leaves the layer as it was at the last image: never a mix of two states.
//!
//! **Locks** (order in docs/ROBUSTNESS.md, "Lock order"): every change takes `quiesce` for
//! reading on its thread's shard (a writer of an image takes all shards, so an image sees no
//! change half made); then directory entries (an ancestor before its descendant; two unrelated
//! directories of a cross-directory rename by inode number, under `rename_lock`); then a
//! file's data; then a node's `meta`; the node table's shards and the filestore last, alone.

mod data;
mod filestore;
mod image;

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use filestore::{BLOCK, Filestore};
pub use image::{IMAGE_NAME, ImageError};

use crate::error::{Result, errno};
use crate::sys::{Attr, Time};

pub type Ino = u64;

/// The root directory's number.
pub const ROOT: Ino = 1;

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
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    /// A symlink's target.
    pub target: Option<&'a OsStr>,
}

/// `renameat2` flags the store understands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
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
    /// One image written at a time.
    commit_lock: Mutex<()>,
    persist: Option<Persist>,
    /// Set when the store is dropped: dropping the nodes then frees no blocks (they are the
    /// last image's data).
    closing: Arc<AtomicBool>,
}

impl MemoryUpper {
    /// An empty layer whose data goes to `filestore` and which writes no image (the layer dies
    /// with the daemon: `filestore=memory`).
    pub fn new_volatile(filestore: OwnedFd, limit_blocks: Option<u64>) -> Result<MemoryUpper> {
        rustix::fs::ftruncate(&filestore, 0)?;
        let store = Filestore::open(filestore, &[], limit_blocks)?;
        let up = MemoryUpper::from_parts(store, None, ROOT + 1);
        up.insert(up.new_root(now()));
        Ok(up)
    }

    /// The layer kept in directory `dir`: its last image (`IMAGE_NAME`), with data in
    /// `filestore`; an empty layer when no image was ever written (one is written at once).
    pub fn open(
        dir: OwnedFd,
        filestore: OwnedFd,
        limit_blocks: Option<u64>,
    ) -> std::result::Result<MemoryUpper, ImageError> {
        let store_len = rustix::fs::fstat(&filestore)
            .map_err(ImageError::io)?
            .st_size as u64;
        match image::read(&dir).map_err(ImageError::io)? {
            None => {
                rustix::fs::ftruncate(&filestore, 0).map_err(ImageError::io)?;
                let store =
                    Filestore::open(filestore, &[], limit_blocks).map_err(ImageError::io)?;
                let up = MemoryUpper::from_parts(store, Some(Persist { dir }), ROOT + 1);
                up.insert(up.new_root(now()));
                up.sync().map_err(ImageError::io)?;
                Ok(up)
            }
            Some(bytes) => {
                let tree = image::decode(&bytes, store_len)?;
                let store = Filestore::open(filestore, &tree.used_blocks, limit_blocks)
                    .map_err(ImageError::io)?;
                let up = MemoryUpper::from_parts(store, Some(Persist { dir }), tree.next_ino);
                for node in tree.nodes {
                    up.insert(up.node_from_image(node));
                }
                Ok(up)
            }
        }
    }

    fn from_parts(store: Filestore, persist: Option<Persist>, next_ino: Ino) -> MemoryUpper {
        MemoryUpper {
            nodes: NodeTable::default(),
            next_ino: AtomicU64::new(next_ino),
            store: Arc::new(store),
            quiesce: Quiesce::default(),
            rename_lock: Mutex::new(()),
            commit_lock: Mutex::new(()),
            persist,
            closing: Arc::new(AtomicBool::new(false)),
        }
    }

    fn new_root(&self, t: (i64, u32)) -> Arc<Node> {
        Arc::new(Node {
            ino: ROOT,
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
                AtomicU64::new(ROOT),
            ),
        })
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

    /// Blocks of the filestore in use.
    pub fn live_blocks(&self) -> u64 {
        self.store.live_blocks()
    }

    /// Number of nodes with a name.
    pub fn node_count(&self) -> usize {
        self.nodes
            .shards
            .iter()
            .map(|s| s.read().unwrap().len())
            .sum()
    }

    // ---- names -------------------------------------------------------------------------

    pub fn lookup(&self, dir: Ino, name: &OsStr) -> Result<Option<Ino>> {
        let d = self.node(dir)?;
        let entries = d.dir()?.read().unwrap();
        Ok(entries.entries.get(name).copied())
    }

    pub fn stat(&self, ino: Ino) -> Result<Attr> {
        Ok(self.node(ino)?.attr())
    }

    /// Makes `name` in `dir`: a file, directory, symlink, device, FIFO or socket. A directory
    /// with the setgid bit passes its group on, and the bit to subdirectories.
    pub fn make(&self, dir: Ino, name: &OsStr, new: &NewNode<'_>) -> Result<Ino> {
        check_name(name)?;
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        let mut entries = d.dir()?.write().unwrap();
        if entries.dead {
            return Err(errno(libc::ENOENT));
        }
        if entries.entries.contains_key(name) {
            return Err(errno(libc::EEXIST));
        }
        let t = now();
        let node = self.new_node(&d, new, t)?;
        let ino = node.ino;
        let is_dir = node.is_dir();
        self.insert(node);
        entries.entries.insert(name.to_owned(), ino);
        let mut m = d.meta.lock().unwrap();
        if is_dir {
            m.nlink += 1;
        }
        m.mtime = t;
        m.ctime = t;
        Ok(ino)
    }

    /// An O_TMPFILE file: no name, gone when the last handle is dropped unless `link` names it.
    pub fn make_unnamed(&self, dir: Ino, new: &NewNode<'_>) -> Result<Arc<Node>> {
        if new.mode & libc::S_IFMT != libc::S_IFREG {
            return Err(errno(libc::EINVAL));
        }
        let d = self.node(dir)?;
        if d.dir()?.read().unwrap().dead {
            return Err(errno(libc::ENOENT));
        }
        let node = self.new_node(&d, new, now())?;
        let mut m = node.meta.lock().unwrap();
        m.nlink = 0;
        m.unnamed = true;
        drop(m);
        Ok(node)
    }

    fn new_node(&self, parent: &Node, new: &NewNode<'_>, t: (i64, u32)) -> Result<Arc<Node>> {
        let kind = new.mode & libc::S_IFMT;
        let (pgid, pmode) = {
            let m = parent.meta.lock().unwrap();
            (m.gid, m.mode)
        };
        let mut mode = new.mode;
        let mut gid = new.gid;
        if pmode & libc::S_ISGID != 0 {
            gid = pgid;
            if kind == libc::S_IFDIR {
                mode |= libc::S_ISGID;
            }
        }
        let ino = self.next_ino.fetch_add(1, Ordering::Relaxed);
        let body = match kind {
            libc::S_IFDIR => Body::Dir(
                RwLock::new(DirBody {
                    entries: BTreeMap::new(),
                    dead: false,
                }),
                AtomicU64::new(parent.ino),
            ),
            libc::S_IFREG => Body::File(RwLock::new(data::FileBody::new(
                self.store.clone(),
                self.closing.clone(),
            ))),
            libc::S_IFLNK => {
                let target = new.target.ok_or_else(|| errno(libc::EINVAL))?;
                if target.is_empty() {
                    return Err(errno(libc::ENOENT));
                }
                if target.len() >= libc::PATH_MAX as usize {
                    return Err(errno(libc::ENAMETOOLONG));
                }
                Body::Symlink(target.to_owned())
            }
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK => Body::Special,
            _ => return Err(errno(libc::EINVAL)),
        };
        Ok(Arc::new(Node {
            ino,
            meta: Mutex::new(Meta {
                mode,
                uid: new.uid,
                gid,
                nlink: if kind == libc::S_IFDIR { 2 } else { 1 },
                rdev: if matches!(kind, libc::S_IFCHR | libc::S_IFBLK) {
                    new.rdev
                } else {
                    0
                },
                atime: t,
                mtime: t,
                ctime: t,
                xattrs: BTreeMap::new(),
                unnamed: false,
            }),
            body,
        }))
    }

    /// A new name `name` in `dir` for `node`, which is no directory; the first name of an
    /// O_TMPFILE file.
    pub fn link(&self, node: &Arc<Node>, dir: Ino, name: &OsStr) -> Result<()> {
        check_name(name)?;
        if node.is_dir() {
            return Err(errno(libc::EPERM));
        }
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        let mut entries = d.dir()?.write().unwrap();
        if entries.dead {
            return Err(errno(libc::ENOENT));
        }
        if entries.entries.contains_key(name) {
            return Err(errno(libc::EEXIST));
        }
        let t = now();
        {
            let mut m = node.meta.lock().unwrap();
            if m.nlink == 0 && !m.unnamed {
                return Err(errno(libc::ENOENT));
            }
            if m.nlink == 0 {
                m.unnamed = false;
                self.insert(node.clone());
            }
            m.nlink += 1;
            m.ctime = t;
        }
        entries.entries.insert(name.to_owned(), node.ino);
        let mut m = d.meta.lock().unwrap();
        m.mtime = t;
        m.ctime = t;
        Ok(())
    }

    /// Removes the name of a non-directory.
    pub fn unlink(&self, dir: Ino, name: &OsStr) -> Result<()> {
        self.remove(dir, name, false)
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, dir: Ino, name: &OsStr) -> Result<()> {
        self.remove(dir, name, true)
    }

    fn remove(&self, dir: Ino, name: &OsStr, want_dir: bool) -> Result<()> {
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        let mut entries = d.dir()?.write().unwrap();
        let ino = *entries
            .entries
            .get(name)
            .ok_or_else(|| errno(libc::ENOENT))?;
        let victim = self.node(ino)?;
        match (want_dir, victim.is_dir()) {
            (true, false) => return Err(errno(libc::ENOTDIR)),
            (false, true) => return Err(errno(libc::EISDIR)),
            (true, true) => kill_empty_dir(&victim)?,
            (false, false) => {}
        }
        entries.entries.remove(name);
        let t = now();
        self.drop_link(&victim, t);
        let mut m = d.meta.lock().unwrap();
        if want_dir {
            m.nlink -= 1;
        }
        m.mtime = t;
        m.ctime = t;
        Ok(())
    }

    /// One name of `node` is gone: its link count drops (a directory's to 0), and at 0 it
    /// leaves the table; its data goes when the last handle does.
    fn drop_link(&self, node: &Arc<Node>, t: (i64, u32)) {
        let mut m = node.meta.lock().unwrap();
        m.nlink = if node.is_dir() {
            0
        } else {
            m.nlink.saturating_sub(1)
        };
        m.ctime = t;
        if m.nlink == 0 {
            self.nodes
                .shard(node.ino)
                .write()
                .unwrap()
                .remove(&node.ino);
        }
    }

    /// `renameat2` within the layer.
    pub fn rename(
        &self,
        sdir: Ino,
        sname: &OsStr,
        ddir: Ino,
        dname: &OsStr,
        flags: RenameFlags,
    ) -> Result<()> {
        if flags.noreplace && flags.exchange {
            return Err(errno(libc::EINVAL));
        }
        check_name(dname)?;
        let _q = self.quiesce.read();
        let _shape = (sdir != ddir).then(|| self.rename_lock.lock().unwrap());
        let s = self.node(sdir)?;
        let d = self.node(ddir)?;
        s.dir()?;
        d.dir()?;
        // Lock the two directories: an ancestor first, else by number (rename_lock held).
        let (mut sg, mut dg) = if sdir == ddir {
            (s.dir()?.write().unwrap(), None)
        } else if self.is_ancestor(sdir, ddir) || (!self.is_ancestor(ddir, sdir) && sdir < ddir) {
            let sg = s.dir()?.write().unwrap();
            (sg, Some(d.dir()?.write().unwrap()))
        } else {
            let dg = d.dir()?.write().unwrap();
            (s.dir()?.write().unwrap(), Some(dg))
        };
        let src = *sg.entries.get(sname).ok_or_else(|| errno(libc::ENOENT))?;
        let dst = match &dg {
            Some(g) => g.entries.get(dname).copied(),
            None => sg.entries.get(dname).copied(),
        };
        if dg.as_ref().is_some_and(|g| g.dead) {
            return Err(errno(libc::ENOENT));
        }
        if sdir == ddir && sname == dname {
            return Ok(());
        }
        let src_node = self.node(src)?;
        let dst_node = dst.map(|i| self.node(i)).transpose()?;
        // A directory may not move below itself.
        if sdir != ddir {
            if src_node.is_dir() && (src == ddir || self.is_ancestor(src, ddir)) {
                return Err(errno(libc::EINVAL));
            }
            // Nor may the target be a directory above the source: not empty (it holds the
            // source), or for an exchange, a loop.
            if let Some(dn) = &dst_node
                && dn.is_dir()
                && (dn.ino == sdir || self.is_ancestor(dn.ino, sdir))
            {
                return Err(errno(if flags.exchange {
                    libc::EINVAL
                } else {
                    libc::ENOTEMPTY
                }));
            }
        }
        let t = now();
        if flags.exchange {
            let dn = dst_node.ok_or_else(|| errno(libc::ENOENT))?;
            let dst = dn.ino;
            match &mut dg {
                Some(g) => {
                    g.entries.insert(dname.to_owned(), src);
                    sg.entries.insert(sname.to_owned(), dst);
                }
                None => {
                    sg.entries.insert(dname.to_owned(), src);
                    sg.entries.insert(sname.to_owned(), dst);
                }
            }
            if sdir != ddir {
                if let Some(p) = src_node.parent() {
                    p.store(ddir, Ordering::Relaxed);
                }
                if let Some(p) = dn.parent() {
                    p.store(sdir, Ordering::Relaxed);
                }
                let delta = src_node.is_dir() as i64 - dn.is_dir() as i64;
                add_nlink(&s, -delta);
                add_nlink(&d, delta);
            }
            touch_ctime(&src_node, t);
            touch_ctime(&dn, t);
            touch_dirs(&s, &d, t);
            return Ok(());
        }
        if let Some(dn) = &dst_node {
            if flags.noreplace {
                return Err(errno(libc::EEXIST));
            }
            if dn.ino == src {
                return Ok(()); // two names of one file: nothing to do, as rename(2) says
            }
            match (src_node.is_dir(), dn.is_dir()) {
                (true, false) => return Err(errno(libc::ENOTDIR)),
                (false, true) => return Err(errno(libc::EISDIR)),
                (true, true) => kill_empty_dir(dn)?,
                (false, false) => {}
            }
        }
        sg.entries.remove(sname);
        match &mut dg {
            Some(g) => g.entries.insert(dname.to_owned(), src),
            None => sg.entries.insert(dname.to_owned(), src),
        };
        if let Some(dn) = &dst_node {
            self.drop_link(dn, t);
            if dn.is_dir() {
                add_nlink(&d, -1);
            }
        }
        if sdir != ddir && src_node.is_dir() {
            if let Some(p) = src_node.parent() {
                p.store(ddir, Ordering::Relaxed);
            }
            add_nlink(&s, -1);
            add_nlink(&d, 1);
        }
        touch_ctime(&src_node, t);
        touch_dirs(&s, &d, t);
        Ok(())
    }

    /// Whether directory `a` lies above directory `b`. Parents change only under `rename_lock`,
    /// which the caller holds.
    fn is_ancestor(&self, a: Ino, b: Ino) -> bool {
        let mut at = b;
        // A tree deeper than its node count has a loop: stop rather than spin.
        for _ in 0..=self.node_count() {
            if at == ROOT {
                return false;
            }
            let Ok(n) = self.node(at) else { return false };
            let Some(p) = n.parent() else { return false };
            at = p.load(Ordering::Relaxed);
            if at == a {
                return true;
            }
        }
        false
    }

    /// The names in `dir` with their numbers and file types (S_IFMT bits), sorted by name.
    pub fn read_dir(&self, dir: Ino) -> Result<Vec<(OsString, Ino, u32)>> {
        let d = self.node(dir)?;
        let entries = d.dir()?.read().unwrap();
        let mut out = Vec::with_capacity(entries.entries.len());
        for (name, &ino) in &entries.entries {
            let kind = self.node(ino).map(|n| n.file_type()).unwrap_or(0);
            out.push((name.clone(), ino, kind));
        }
        Ok(out)
    }

    pub fn read_link(&self, ino: Ino) -> Result<OsString> {
        match &self.node(ino)?.body {
            Body::Symlink(t) => Ok(t.clone()),
            _ => Err(errno(libc::EINVAL)),
        }
    }

    // ---- attributes and xattrs ---------------------------------------------------------

    /// chown; `None` leaves that id. Clears set-user-ID and (for group-executable files)
    /// set-group-ID bits of a non-directory, as a local file system does.
    pub fn set_owner(&self, node: &Node, uid: Option<u32>, gid: Option<u32>) {
        let _q = self.quiesce.read();
        let mut m = node.meta.lock().unwrap();
        if let Some(u) = uid {
            m.uid = u;
        }
        if let Some(g) = gid {
            m.gid = g;
        }
        if m.mode & libc::S_IFMT != libc::S_IFDIR && m.mode & libc::S_IFMT != libc::S_IFLNK {
            m.mode &= !libc::S_ISUID;
            if m.mode & libc::S_IXGRP != 0 {
                m.mode &= !libc::S_ISGID;
            }
        }
        m.ctime = now();
    }

    /// chmod: the permission bits of `mode`; the type stays.
    pub fn set_mode(&self, node: &Node, mode: u32) {
        let _q = self.quiesce.read();
        let mut m = node.meta.lock().unwrap();
        m.mode = (m.mode & libc::S_IFMT) | (mode & 0o7777);
        m.ctime = now();
    }

    pub fn set_times(&self, node: &Node, atime: Time, mtime: Time) {
        let _q = self.quiesce.read();
        let t = now();
        let mut m = node.meta.lock().unwrap();
        let pick = |time: Time, old: (i64, u32)| match time {
            Time::Now => t,
            Time::Omit => old,
            Time::At(s, n) => (s, n),
        };
        m.atime = pick(atime, m.atime);
        m.mtime = pick(mtime, m.mtime);
        m.ctime = t;
    }

    pub fn get_xattr(&self, node: &Node, name: &OsStr) -> Option<Vec<u8>> {
        node.meta.lock().unwrap().xattrs.get(name).cloned()
    }

    pub fn list_xattr(&self, node: &Node) -> Vec<OsString> {
        node.meta.lock().unwrap().xattrs.keys().cloned().collect()
    }

    /// setxattr with XATTR_CREATE / XATTR_REPLACE in `flags`.
    pub fn set_xattr(&self, node: &Node, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(errno(libc::ERANGE));
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(errno(libc::E2BIG));
        }
        let _q = self.quiesce.read();
        let mut m = node.meta.lock().unwrap();
        let present = m.xattrs.contains_key(name);
        if flags & libc::XATTR_CREATE != 0 && present {
            return Err(errno(libc::EEXIST));
        }
        if flags & libc::XATTR_REPLACE != 0 && !present {
            return Err(errno(libc::ENODATA));
        }
        m.xattrs.insert(name.to_owned(), value.to_vec());
        m.ctime = now();
        Ok(())
    }

    pub fn remove_xattr(&self, node: &Node, name: &OsStr) -> Result<()> {
        let _q = self.quiesce.read();
        let mut m = node.meta.lock().unwrap();
        m.xattrs.remove(name).ok_or_else(|| errno(libc::ENODATA))?;
        m.ctime = now();
        Ok(())
    }

    // ---- durability --------------------------------------------------------------------

    /// Writes an image of the tree as it is now; after it returns, a crash or an unmount
    /// leaves the layer as it was at this call. Nothing to do for a volatile layer.
    pub fn sync(&self) -> Result<()> {
        let Some(persist) = &self.persist else {
            return Ok(());
        };
        let _one = self.commit_lock.lock().unwrap();
        let (bytes, deferred) = {
            let _all = self.quiesce.write_all();
            let bytes = image::encode(self);
            // Blocks freed before this image are not in it: they go when it is durable.
            (bytes, self.store.take_deferred())
        };
        let written = self
            .store
            .sync()
            .and_then(|()| image::write(&persist.dir, &bytes));
        match written {
            Ok(()) => self.store.free(&deferred),
            Err(e) => {
                self.store.restore_deferred(deferred);
                Err(e)
            }
        }
    }

    fn node_from_image(&self, n: image::ImageNode) -> Arc<Node> {
        let body = match n.body {
            image::ImageBody::Dir { parent, entries } => Body::Dir(
                RwLock::new(DirBody {
                    entries,
                    dead: false,
                }),
                AtomicU64::new(parent),
            ),
            image::ImageBody::File { size, extents } => Body::File(RwLock::new(
                data::FileBody::from_image(self.store.clone(), self.closing.clone(), size, extents),
            )),
            image::ImageBody::Symlink(t) => Body::Symlink(t),
            image::ImageBody::Special => Body::Special,
        };
        Arc::new(Node {
            ino: n.ino,
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
        }
    }
}

/// Marks the empty directory `victim` dead (it is being removed or renamed over); ENOTEMPTY if
/// it holds anything. The caller holds its parent's entries: parent before child.
fn kill_empty_dir(victim: &Node) -> Result<()> {
    let mut v = victim.dir()?.write().unwrap();
    if !v.entries.is_empty() {
        return Err(errno(libc::ENOTEMPTY));
    }
    v.dead = true;
    Ok(())
}

fn add_nlink(dir: &Node, delta: i64) {
    let mut m = dir.meta.lock().unwrap();
    m.nlink = m.nlink.saturating_add_signed(delta);
}

fn touch_ctime(node: &Node, t: (i64, u32)) {
    node.meta.lock().unwrap().ctime = t;
}

fn touch_dirs(s: &Node, d: &Node, t: (i64, u32)) {
    for dir in [s, d] {
        let mut m = dir.meta.lock().unwrap();
        m.mtime = t;
        m.ctime = t;
    }
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
