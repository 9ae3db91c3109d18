//! The upper layer's one interface (issue #13; docs/ARCHITECTURE.md): a directory of the upper
//! layer and an open file of it, each on disk (descriptors, the syscalls of sys/) or in the
//! daemon (memory_upper), and `LayerDir`, the read-only view every layer shares. The overlay
//! core reaches the upper layer through nothing else; the only descriptor it ever asks for is
//! the one FUSE passthrough needs (`UpperFile::disk_fd`), which a memory file does not have.
//! Both implementations give the errors a local file system gives; the tests below hold them
//! to the same answers over random operations.
//!
//! Ownership of new objects: on disk the thread's credentials and umask (creds.rs, set by the
//! caller) decide it; the memory store takes `Creation`'s owner and umask instead. Both
//! implementations take the same `Creation`, and the caller sets the credentials to match.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};

use crate::error::{Result, errno};
use crate::fault::Op;
use crate::memory_upper::{self, MemoryUpper, NewNode, Node};
use crate::sys::{self, Attr, RawDirEntry, Time};

/// A directory of the upper (or work) layer. With no name, the calls below act on the handle's
/// own object — which is, for a file no name reaches (`UpperFile::object`), that file.
#[derive(Clone)]
pub enum UpperDir {
    Disk(Arc<OwnedFd>),
    Memory(Arc<MemoryUpper>, Arc<Node>),
}

impl std::fmt::Debug for UpperDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpperDir::Disk(fd) => write!(f, "UpperDir::Disk({fd:?})"),
            UpperDir::Memory(_, node) => write!(f, "UpperDir::Memory({})", node.ino()),
        }
    }
}

/// An open regular file of the upper layer.
pub enum UpperFile {
    Disk(OwnedFd),
    Memory(Arc<MemoryUpper>, Arc<Node>),
}

/// What a read hands to its reply: bytes in the daemon's memory, or iovecs into the memory
/// upper's filestore mapping, which only the kernel may copy (`ReplyData::data_mapped`).
pub enum ReadData<'a> {
    Bytes(&'a [u8]),
    Mapped(&'a [std::io::IoSlice<'a>]),
}

/// Who makes a new object, and with what mode (type bits included) and umask.
#[derive(Clone, Copy, Debug)]
pub struct Creation {
    pub mode: u32,
    pub umask: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Creation {
    /// An object of the daemon's own (a whiteout, a temporary in the work dir): its owner is
    /// the daemon, its mode exactly `mode`.
    pub fn daemon(mode: u32) -> Creation {
        let (uid, gid) = crate::creds::daemon_ids();
        Creation {
            mode,
            umask: 0,
            uid,
            gid,
        }
    }

    fn node<'a>(&self, rdev: u64, target: Option<&'a OsStr>) -> NewNode<'a> {
        NewNode {
            mode: self.mode,
            umask: self.umask,
            uid: self.uid,
            gid: self.gid,
            rdev,
            target,
        }
    }
}

/// A directory of any layer, borrowed: a lower layer's or a disk upper's as a descriptor, a
/// memory upper's as its store and node. The reads every layer shares (whiteouts, overlay
/// marks, listings, origins) take this view, so that lower call sites only wrap their
/// descriptor (`dir.into()`).
#[derive(Clone, Copy)]
pub enum LayerDir<'a> {
    Disk(BorrowedFd<'a>),
    Memory(&'a MemoryUpper, &'a Arc<Node>),
}

impl<'a> From<BorrowedFd<'a>> for LayerDir<'a> {
    fn from(fd: BorrowedFd<'a>) -> Self {
        LayerDir::Disk(fd)
    }
}

impl LayerDir<'_> {
    /// The attributes of `name` here, not following a symlink; `None` when there is none.
    pub fn stat_opt(&self, name: &OsStr) -> Result<Option<Attr>> {
        match *self {
            LayerDir::Disk(fd) => sys::stat_opt(fd, name),
            LayerDir::Memory(m, dir) => match m.lookup(dir.ino(), name)? {
                Some(ino) => Ok(Some(m.stat(ino)?)),
                None => Ok(None),
            },
        }
    }

    /// The attributes of `name` here, or of this directory with `None`.
    pub fn stat(&self, name: Option<&OsStr>) -> Result<Attr> {
        match (*self, name) {
            (LayerDir::Disk(fd), Some(name)) => sys::stat_at(fd, name),
            (LayerDir::Disk(fd), None) => sys::fstat(fd),
            (LayerDir::Memory(m, dir), name) => Ok(UpperDir::node_of(m, dir, name)?.attr()),
        }
    }

    /// The birth time of `name` here (this directory with `None`), where the file system
    /// records one; the memory store does not.
    pub fn birth_time(&self, name: Option<&OsStr>) -> Result<Option<(i64, u32)>> {
        match *self {
            LayerDir::Disk(fd) => sys::birth_time(fd, name),
            LayerDir::Memory(..) => Ok(None),
        }
    }

    /// An xattr of `name` here (of this directory with `None`); `None` when it is absent.
    pub fn get_xattr(&self, name: Option<&OsStr>, key: &str) -> Result<Option<Vec<u8>>> {
        match *self {
            LayerDir::Disk(fd) => sys::get_xattr(fd, name, key),
            LayerDir::Memory(m, dir) => {
                Ok(m.get_xattr(&*UpperDir::node_of(m, dir, name)?, OsStr::new(key)))
            }
        }
    }

    pub fn list_xattr(&self, name: Option<&OsStr>) -> Result<Vec<OsString>> {
        match *self {
            LayerDir::Disk(fd) => sys::list_xattr(fd, name),
            LayerDir::Memory(m, dir) => Ok(m.list_xattr(&*UpperDir::node_of(m, dir, name)?)),
        }
    }

    /// The names here (not `.` and `..`), in no particular order.
    pub fn read_dir(&self) -> Result<Vec<RawDirEntry>> {
        match *self {
            LayerDir::Disk(fd) => sys::read_dir(fd, Path::new("")),
            LayerDir::Memory(m, dir) => Ok(m
                .read_dir(dir.ino())?
                .into_iter()
                .map(|(name, ino, kind)| RawDirEntry { name, ino, kind })
                .collect()),
        }
    }

    /// An xattr of `name` here (of this directory with `None`), every error passed through
    /// (ENODATA when it is absent), for the merged view's getxattr.
    pub fn get_xattr_raw(&self, name: Option<&OsStr>, key: &OsStr) -> Result<Vec<u8>> {
        match *self {
            LayerDir::Disk(fd) => sys::get_xattr_raw(fd, name, key),
            LayerDir::Memory(m, dir) => m
                .get_xattr(&*UpperDir::node_of(m, dir, name)?, key)
                .ok_or_else(|| errno(libc::ENODATA)),
        }
    }

    /// The target of the symlink `name` here (of this object with `None`).
    pub fn read_link(&self, name: Option<&OsStr>) -> Result<OsString> {
        match *self {
            LayerDir::Disk(fd) => sys::read_link_at(fd, name.unwrap_or(OsStr::new("."))),
            LayerDir::Memory(m, dir) => m.read_link(UpperDir::node_of(m, dir, name)?.ino()),
        }
    }

    /// The inode flags `lsattr` shows (FS_IOC_GETFLAGS) of `name` here (this object with
    /// `None`); a memory upper sets none.
    pub fn inode_flags(&self, name: Option<&OsStr>) -> Result<u32> {
        match *self {
            LayerDir::Disk(fd) => {
                Ok(rustix::fs::ioctl_getflags(&Self::open_for_flags(fd, name)?)?.bits())
            }
            LayerDir::Memory(m, dir) => UpperDir::node_of(m, dir, name).map(|_| 0),
        }
    }

    /// Sets the inode flags (FS_IOC_SETFLAGS) of `name` here; the memory store keeps none.
    pub fn set_inode_flags(&self, name: Option<&OsStr>, flags: u32) -> Result<()> {
        match *self {
            LayerDir::Disk(fd) => {
                let flags = rustix::fs::IFlags::from_bits_retain(flags);
                Ok(rustix::fs::ioctl_setflags(
                    &Self::open_for_flags(fd, name)?,
                    flags,
                )?)
            }
            LayerDir::Memory(..) => Err(errno(libc::EOPNOTSUPP)),
        }
    }

    /// FS_IOC_FSGETXATTR of `name` here; the memory store has only zeros.
    pub fn fs_xattr(&self, name: Option<&OsStr>) -> Result<sys::FsXattr> {
        match *self {
            LayerDir::Disk(fd) => sys::fs_xattr(Self::open_for_flags(fd, name)?.as_fd()),
            LayerDir::Memory(m, dir) => UpperDir::node_of(m, dir, name).map(|_| [0; 28]),
        }
    }

    /// FS_IOC_FSSETXATTR of `name` here; the memory store keeps none.
    pub fn set_fs_xattr(&self, name: Option<&OsStr>, fsx: &sys::FsXattr) -> Result<()> {
        match *self {
            LayerDir::Disk(fd) => sys::set_fs_xattr(Self::open_for_flags(fd, name)?.as_fd(), fsx),
            LayerDir::Memory(..) => Err(errno(libc::EOPNOTSUPP)),
        }
    }

    /// The statx attributes of `name` here (`sys::attributes`); the memory store has none.
    pub fn attributes(&self, name: Option<&OsStr>) -> Result<u64> {
        match *self {
            LayerDir::Disk(fd) => sys::attributes(fd, name),
            LayerDir::Memory(m, dir) => UpperDir::node_of(m, dir, name).map(|_| 0),
        }
    }

    /// A descriptor the inode-flag ioctls take: a real open, not O_PATH, touching no atime.
    fn open_for_flags(fd: BorrowedFd<'_>, name: Option<&OsStr>) -> Result<OwnedFd> {
        let flags =
            OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::NOCTTY | OFlags::CLOEXEC;
        Ok(sys::openat(
            fd,
            name.unwrap_or(OsStr::new(".")),
            flags,
            Mode::empty(),
        )?)
    }

    /// Whether the directory `sub` here (this directory with `None`) holds `name`.
    pub fn has_in(&self, sub: Option<&OsStr>, name: &OsStr) -> Result<bool> {
        match (*self, sub) {
            (LayerDir::Disk(fd), None) => Ok(sys::stat_opt(fd, name)?.is_some()),
            // One openat2 of `sub/name` (an O_PATH handle, dropped at once): a name that is
            // not there, the common answer, costs that one call, not an open, a stat and a close.
            (LayerDir::Disk(fd), Some(sub)) => {
                let path = Path::new(sub).join(name);
                match sys::open_beneath(fd, &path, OFlags::PATH, 0) {
                    Ok(_) => Ok(true),
                    Err(e) if e.is(libc::ENOENT) => Ok(false),
                    Err(e) => Err(e),
                }
            }
            (LayerDir::Memory(m, dir), sub) => {
                let node = UpperDir::node_of(m, dir, sub)?;
                if !node.is_dir() {
                    return Err(errno(libc::ENOTDIR));
                }
                Ok(m.lookup(node.ino(), name)?.is_some())
            }
        }
    }
}

/// A change to the upper layer is about to be made, on either store: fault injection's check
/// (fault.rs: the seam is where a test fails a step of a copy-up, a rename or a write), a
/// failure it injects reported as the file system's own would be.
fn changing(op: Op) -> Result<()> {
    crate::fault::check(op).inspect_err(|e| {
        sys::note_failure(op, rustix::io::Errno::from_raw_os_error(e.errno()));
    })
}

impl UpperDir {
    /// This directory as the reads shared with lower layers take it.
    pub fn view(&self) -> LayerDir<'_> {
        match self {
            UpperDir::Disk(fd) => LayerDir::Disk(fd.as_fd()),
            UpperDir::Memory(m, node) => LayerDir::Memory(m, node),
        }
    }

    /// Makes this directory's entries durable (a journal entry for a memory upper).
    pub fn sync(&self) -> Result<()> {
        changing(Op::Fsync)?;
        match self {
            UpperDir::Disk(fd) => {
                // An O_PATH descriptor (the directory cache's) cannot be fsynced.
                let flags = OFlags::RDONLY | OFlags::DIRECTORY;
                let d = sys::open_beneath(fd.as_fd(), Path::new(""), flags, 0)?;
                Ok(sys::fsync(&d)?)
            }
            UpperDir::Memory(m, _) => m.sync_changes(),
        }
    }

    /// The attributes of `name` here, not following a symlink.
    pub fn stat_at(&self, name: &OsStr) -> Result<Attr> {
        self.view().stat(Some(name))
    }

    /// The directory `name` here.
    pub fn open_dir(&self, name: &OsStr) -> Result<UpperDir> {
        match self {
            UpperDir::Disk(fd) => {
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let d = sys::openat(fd.as_fd(), name, flags, Mode::empty())?;
                Ok(UpperDir::Disk(Arc::new(d)))
            }
            UpperDir::Memory(m, dir) => {
                let ino = m
                    .lookup(dir.ino(), name)?
                    .ok_or_else(|| errno(libc::ENOENT))?;
                let node = m.node(ino)?;
                if !node.is_dir() {
                    return Err(errno(libc::ENOTDIR));
                }
                Ok(UpperDir::Memory(m.clone(), node))
            }
        }
    }

    pub fn mkdir(&self, name: &OsStr, c: &Creation) -> Result<()> {
        changing(Op::Mkdir)?;
        match self {
            UpperDir::Disk(fd) => Ok(sys::mkdirat(
                fd.as_fd(),
                name,
                Mode::from_raw_mode(c.mode & 0o7777),
            )?),
            UpperDir::Memory(m, dir) => {
                let c = Creation {
                    mode: libc::S_IFDIR | (c.mode & 0o7777),
                    ..*c
                };
                m.make(dir.ino(), name, &c.node(0, None)).map(drop)
            }
        }
    }

    /// A device, FIFO, socket or empty regular file (the type in `c.mode`).
    pub fn mknod(&self, name: &OsStr, c: &Creation, rdev: u64) -> Result<()> {
        changing(Op::Mknod)?;
        match self {
            UpperDir::Disk(fd) => sys::mknod_at(fd.as_fd(), name, c.mode, rdev),
            UpperDir::Memory(m, dir) => m.make(dir.ino(), name, &c.node(rdev, None)).map(drop),
        }
    }

    pub fn symlink(&self, target: &OsStr, name: &OsStr, c: &Creation) -> Result<()> {
        changing(Op::Symlink)?;
        match self {
            UpperDir::Disk(fd) => Ok(sys::symlinkat(target, fd.as_fd(), name)?),
            UpperDir::Memory(m, dir) => {
                let c = Creation {
                    mode: libc::S_IFLNK | 0o777,
                    ..*c
                };
                m.make(dir.ino(), name, &c.node(0, Some(target))).map(drop)
            }
        }
    }

    /// A new regular file `name`, open for reading and writing (EEXIST if it exists).
    pub fn create(&self, name: &OsStr, c: &Creation) -> Result<UpperFile> {
        changing(Op::Create)?;
        match self {
            UpperDir::Disk(fd) => {
                let flags = OFlags::RDWR
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let f = sys::openat(
                    fd.as_fd(),
                    name,
                    flags,
                    Mode::from_raw_mode(c.mode & 0o7777),
                )?;
                Ok(UpperFile::Disk(f))
            }
            UpperDir::Memory(m, dir) => {
                let c = Creation {
                    mode: libc::S_IFREG | (c.mode & 0o7777),
                    ..*c
                };
                let ino = m.make(dir.ino(), name, &c.node(0, None))?;
                Ok(UpperFile::Memory(m.clone(), m.node(ino)?))
            }
        }
    }

    /// A new regular file without a name (O_TMPFILE), open for reading and writing.
    pub fn tmpfile(&self, c: &Creation) -> Result<UpperFile> {
        changing(Op::Create)?;
        match self {
            UpperDir::Disk(fd) => {
                let flags = OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC;
                let mode = Mode::from_raw_mode(c.mode & 0o7777);
                Ok(UpperFile::Disk(sys::openat(fd.as_fd(), ".", flags, mode)?))
            }
            UpperDir::Memory(m, dir) => {
                let c = Creation {
                    mode: libc::S_IFREG | (c.mode & 0o7777),
                    ..*c
                };
                Ok(UpperFile::Memory(
                    m.clone(),
                    m.make_unnamed(dir.ino(), &c.node(0, None))?,
                ))
            }
        }
    }

    /// Removes `name` here, a directory with everything in it; nothing there is fine.
    pub fn remove_tree(&self, name: &OsStr) -> Result<()> {
        match self.unlink(name) {
            Ok(()) => return Ok(()),
            Err(e) if e.is(libc::EISDIR) || e.is(libc::EPERM) => {}
            Err(e) if e.is(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        let sub = self.open_dir(name)?;
        for e in sub.read_dir()? {
            sub.remove_tree(&e.name)?;
        }
        drop(sub);
        self.rmdir(name)
    }

    /// Opens the regular file `name` for reading and writing. Anything else is refused before
    /// it is opened (a FIFO or device must never be opened by the daemon): EISDIR for a
    /// directory, ELOOP for a symlink, ENXIO for the rest.
    pub fn open_file(&self, name: &OsStr) -> Result<UpperFile> {
        let refuse = |kind: u32| match kind {
            libc::S_IFREG => Ok(()),
            libc::S_IFDIR => Err(errno(libc::EISDIR)),
            libc::S_IFLNK => Err(errno(libc::ELOOP)),
            _ => Err(errno(libc::ENXIO)),
        };
        match self {
            UpperDir::Disk(fd) => {
                refuse(sys::stat_at(fd.as_fd(), name)?.file_type())?;
                // NONBLOCK: should a FIFO have taken the name meanwhile, opening it does not wait.
                let flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
                let f = sys::openat(fd.as_fd(), name, flags, Mode::empty())?;
                refuse(sys::fstat(f.as_fd())?.file_type())?;
                rustix::fs::fcntl_setfl(&f, OFlags::empty())?;
                Ok(UpperFile::Disk(f))
            }
            UpperDir::Memory(m, dir) => {
                let ino = m
                    .lookup(dir.ino(), name)?
                    .ok_or_else(|| errno(libc::ENOENT))?;
                let node = m.node(ino)?;
                refuse(node.file_type())?;
                Ok(UpperFile::Memory(m.clone(), node))
            }
        }
    }

    /// Opens `name`, which the kernel knows as a regular file that `is_it` recognises by its
    /// attributes, for the data path: read-write, or read-only when `writable` is false. One
    /// openat and one fstat on disk.
    ///
    /// The kernel looked the name up before it sent the open, and nothing stops another
    /// caller from removing the file (leaving a whiteout, a char device) or renaming another
    /// object over it in between. What the name holds then is not the file asked for: the
    /// answer is ESTALE, on which the kernel looks the name up again and retries the open,
    /// as after a change on a network file system. (Opening the whiteout gave ENXIO; opening
    /// another file would have served its data under the old inode.)
    pub fn open_known_file(
        &self,
        name: &OsStr,
        writable: bool,
        is_it: impl Fn(&Attr) -> bool,
    ) -> Result<UpperFile> {
        // A device, a symlink or a directory where the file was.
        let not_the_file = |e: crate::error::Error| match e.errno() {
            libc::ENXIO | libc::ELOOP | libc::EISDIR => errno(libc::ESTALE),
            _ => e,
        };
        let file = match self {
            UpperDir::Disk(fd) => {
                let access = if writable {
                    OFlags::RDWR
                } else {
                    // A FIFO renamed over the name must not hold the open.
                    OFlags::RDONLY | OFlags::NONBLOCK
                };
                let flags = access | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                UpperFile::Disk(
                    sys::openat(fd.as_fd(), name, flags, Mode::empty())
                        .map_err(|e| not_the_file(e.into()))?,
                )
            }
            UpperDir::Memory(..) => self.open_file(name).map_err(not_the_file)?,
        };
        let attr = file.stat()?;
        if attr.file_type() != libc::S_IFREG || !is_it(&attr) {
            return Err(errno(libc::ESTALE));
        }
        if !writable && let UpperFile::Disk(f) = &file {
            rustix::fs::fcntl_setfl(f, OFlags::empty())?;
        }
        Ok(file)
    }

    /// The object `name` here, of any kind, held without being opened for I/O: an `O_PATH`
    /// descriptor on disk, the node in memory (a pin, inode/mod.rs `Pin`).
    pub fn object(&self, name: &OsStr) -> Result<UpperFile> {
        match self {
            UpperDir::Disk(fd) => {
                let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                Ok(UpperFile::Disk(sys::openat(
                    fd.as_fd(),
                    name,
                    flags,
                    Mode::empty(),
                )?))
            }
            UpperDir::Memory(m, dir) => {
                let ino = m
                    .lookup(dir.ino(), name)?
                    .ok_or_else(|| errno(libc::ENOENT))?;
                Ok(UpperFile::Memory(m.clone(), m.node(ino)?))
            }
        }
    }

    /// A new name `to` in `to_dir` for the object `name` here (no directories).
    pub fn link(&self, name: &OsStr, to_dir: &UpperDir, to: &OsStr) -> Result<()> {
        changing(Op::Link)?;
        match (self, to_dir) {
            (UpperDir::Disk(fd), UpperDir::Disk(to_fd)) => Ok(sys::linkat(
                fd.as_fd(),
                name,
                to_fd.as_fd(),
                to,
                AtFlags::empty(),
            )?),
            (UpperDir::Memory(m, dir), UpperDir::Memory(_, to_ino)) => {
                let ino = m
                    .lookup(dir.ino(), name)?
                    .ok_or_else(|| errno(libc::ENOENT))?;
                m.link(&m.node(ino)?, to_ino.ino(), to)
            }
            _ => Err(errno(libc::EXDEV)),
        }
    }

    pub fn unlink(&self, name: &OsStr) -> Result<()> {
        changing(Op::Unlink)?;
        match self {
            UpperDir::Disk(fd) => Ok(sys::unlinkat(fd.as_fd(), name, AtFlags::empty())?),
            UpperDir::Memory(m, dir) => m.unlink(dir.ino(), name),
        }
    }

    pub fn rmdir(&self, name: &OsStr) -> Result<()> {
        changing(Op::Unlink)?;
        match self {
            UpperDir::Disk(fd) => Ok(sys::unlinkat(fd.as_fd(), name, AtFlags::REMOVEDIR)?),
            UpperDir::Memory(m, dir) => m.rmdir(dir.ino(), name),
        }
    }

    /// renameat2 with NOREPLACE or EXCHANGE (or neither).
    pub fn rename(
        &self,
        name: &OsStr,
        to_dir: &UpperDir,
        to: &OsStr,
        flags: RenameFlags,
    ) -> Result<()> {
        changing(if flags.contains(RenameFlags::WHITEOUT) {
            Op::RenameWhiteout
        } else {
            Op::Rename
        })?;
        match (self, to_dir) {
            (UpperDir::Disk(fd), UpperDir::Disk(to_fd)) => {
                sys::rename_at(fd.as_fd(), name, to_fd.as_fd(), to, flags)
            }
            (UpperDir::Memory(m, dir), UpperDir::Memory(_, to_ino)) => {
                let known = RenameFlags::NOREPLACE | RenameFlags::EXCHANGE | RenameFlags::WHITEOUT;
                if !(flags - known).is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                // The whiteout is the daemon's, as RENAME_WHITEOUT's on disk (creds.rs).
                let owner = || {
                    let c = Creation::daemon(libc::S_IFCHR);
                    (c.uid, c.gid)
                };
                let f = memory_upper::RenameFlags {
                    noreplace: flags.contains(RenameFlags::NOREPLACE),
                    exchange: flags.contains(RenameFlags::EXCHANGE),
                    whiteout: flags.contains(RenameFlags::WHITEOUT).then(owner),
                };
                m.rename(dir.ino(), name, to_ino.ino(), to, f)
            }
            _ => Err(errno(libc::EXDEV)),
        }
    }

    pub fn read_link(&self, name: &OsStr) -> Result<OsString> {
        self.view().read_link(Some(name))
    }

    /// The names here (not `.` and `..`), in no particular order.
    pub fn read_dir(&self) -> Result<Vec<RawDirEntry>> {
        self.view().read_dir()
    }

    /// The memory node `name` names in `dir` (or `dir` itself), for the calls below.
    fn node_of(m: &MemoryUpper, dir: &Arc<Node>, name: Option<&OsStr>) -> Result<Arc<Node>> {
        match name {
            None => Ok(dir.clone()),
            Some(name) => m.node(
                m.lookup(dir.ino(), name)?
                    .ok_or_else(|| errno(libc::ENOENT))?,
            ),
        }
    }

    /// An xattr of `name` here (of this directory with `None`); `None` when it is absent.
    pub fn get_xattr(&self, name: Option<&OsStr>, key: &str) -> Result<Option<Vec<u8>>> {
        self.view().get_xattr(name, key)
    }

    pub fn set_xattr(
        &self,
        name: Option<&OsStr>,
        key: &OsStr,
        value: &[u8],
        flags: i32,
    ) -> Result<()> {
        changing(Op::SetXattr)?;
        match self {
            UpperDir::Disk(fd) => sys::set_xattr(fd.as_fd(), name, key, value, flags),
            UpperDir::Memory(m, dir) => {
                m.set_xattr(&*Self::node_of(m, dir, name)?, key, value, flags)
            }
        }
    }

    pub fn remove_xattr(&self, name: Option<&OsStr>, key: &OsStr) -> Result<()> {
        changing(Op::RemoveXattr)?;
        match self {
            UpperDir::Disk(fd) => sys::remove_xattr(fd.as_fd(), name, key),
            UpperDir::Memory(m, dir) => m.remove_xattr(&*Self::node_of(m, dir, name)?, key),
        }
    }

    pub fn list_xattr(&self, name: Option<&OsStr>) -> Result<Vec<OsString>> {
        self.view().list_xattr(name)
    }

    pub fn chown(&self, name: Option<&OsStr>, uid: Option<u32>, gid: Option<u32>) -> Result<()> {
        changing(Op::Chown)?;
        match self {
            UpperDir::Disk(fd) => sys::chown_at(fd.as_fd(), name, uid, gid),
            UpperDir::Memory(m, dir) => {
                m.set_owner(&*Self::node_of(m, dir, name)?, uid, gid);
                Ok(())
            }
        }
    }

    /// chmod of `name` here (this directory with `None`). A symlink has no mode of its own on
    /// Linux: EOPNOTSUPP, as fchmodat(AT_SYMLINK_NOFOLLOW) answers (the call never follows it).
    pub fn chmod(&self, name: Option<&OsStr>, mode: u32) -> Result<()> {
        changing(Op::Chmod)?;
        match self {
            UpperDir::Disk(fd) => sys::chmod_at(fd.as_fd(), name, mode),
            UpperDir::Memory(m, dir) => {
                let node = Self::node_of(m, dir, name)?;
                if node.file_type() == libc::S_IFLNK {
                    return Err(errno(libc::EOPNOTSUPP));
                }
                m.set_mode(&node, mode);
                Ok(())
            }
        }
    }

    pub fn utimens(&self, name: Option<&OsStr>, atime: Time, mtime: Time) -> Result<()> {
        changing(Op::Utimens)?;
        match self {
            UpperDir::Disk(fd) => sys::utimens_at(fd.as_fd(), name, atime, mtime),
            UpperDir::Memory(m, dir) => {
                m.set_times(&*Self::node_of(m, dir, name)?, atime, mtime);
                Ok(())
            }
        }
    }
}

impl UpperFile {
    /// The descriptor of a disk file (a layer file opened by the core as one).
    pub fn into_disk_fd(self) -> Result<OwnedFd> {
        match self {
            UpperFile::Disk(fd) => Ok(fd),
            UpperFile::Memory(..) => Err(errno(libc::EOPNOTSUPP)),
        }
    }

    /// This file as the object of the `UpperDir` calls that take no name (`dir.xxx(None, ..)`),
    /// for a file that no name reaches (O_TMPFILE, or unlinked while open).
    pub fn object(&self) -> Result<UpperDir> {
        Ok(self.try_clone()?.into_object())
    }

    /// `object`, taking this handle.
    pub fn into_object(self) -> UpperDir {
        match self {
            UpperFile::Disk(fd) => UpperDir::Disk(Arc::new(fd)),
            UpperFile::Memory(m, node) => UpperDir::Memory(m, node),
        }
    }

    /// Gives this file, which no name reaches (an O_TMPFILE, or unlinked while open), the
    /// name `name` in `dir`.
    pub fn link_into(&self, dir: &UpperDir, name: &OsStr) -> Result<()> {
        changing(Op::Link)?;
        match (self, dir) {
            (UpperFile::Disk(fd), UpperDir::Disk(d)) => {
                sys::link_open_file(fd.as_fd(), d.as_fd(), name)
            }
            (UpperFile::Memory(m, node), UpperDir::Memory(_, d)) => m.link(node, d.ino(), name),
            _ => Err(errno(libc::EXDEV)),
        }
    }

    /// Clones `src`'s extents into this empty file (FICLONE). A memory file cannot share
    /// extents: EXDEV, as the kernel answers across file systems.
    pub fn clone_from(&self, src: BorrowedFd<'_>) -> rustix::io::Result<()> {
        changing(Op::Write).map_err(|e| rustix::io::Errno::from_raw_os_error(e.errno()))?;
        match self {
            UpperFile::Disk(fd) => sys::ioctl_ficlone(fd, src),
            UpperFile::Memory(..) => Err(rustix::io::Errno::XDEV),
        }
    }

    /// This file as the reads every layer shares see it (no descriptor duplicated).
    pub fn view(&self) -> LayerDir<'_> {
        match self {
            UpperFile::Disk(fd) => LayerDir::Disk(fd.as_fd()),
            UpperFile::Memory(m, node) => LayerDir::Memory(m, node),
        }
    }

    /// The descriptor of a disk upper file, which FUSE passthrough needs; a memory file has
    /// none (EOPNOTSUPP): its I/O goes through the daemon.
    pub fn disk_fd(&self) -> Result<BorrowedFd<'_>> {
        match self {
            UpperFile::Disk(fd) => Ok(fd.as_fd()),
            UpperFile::Memory(..) => Err(errno(libc::EOPNOTSUPP)),
        }
    }

    pub fn try_clone(&self) -> Result<UpperFile> {
        match self {
            UpperFile::Disk(fd) => Ok(UpperFile::Disk(fd.try_clone()?)),
            UpperFile::Memory(m, node) => Ok(UpperFile::Memory(m.clone(), node.clone())),
        }
    }

    /// The descriptor number this file holds (for the descriptor reserve); -1 for none.
    pub fn raw_fd(&self) -> i32 {
        use std::os::fd::AsRawFd;
        match self {
            UpperFile::Disk(fd) => fd.as_raw_fd(),
            UpperFile::Memory(..) => -1,
        }
    }

    /// Reads up to `len` bytes at `off` into `buf` (cleared first; fewer only at the end of
    /// the file). `buf` is reused from call to call: no allocation once it is large enough.
    pub fn read_into(&self, buf: &mut Vec<u8>, len: usize, off: u64) -> Result<()> {
        match self {
            UpperFile::Disk(fd) => sys::pread_into(fd.as_fd(), buf, len, off),
            UpperFile::Memory(m, node) => {
                buf.resize(len, 0);
                let n = m.read(node, buf, off)?;
                buf.truncate(n);
                Ok(())
            }
        }
    }

    /// `read_into` for a reply to the kernel: a memory file whose filestore is mapped hands over
    /// iovecs into the mapping instead of copying into `buf`.
    pub fn read_for_reply<R>(
        &self,
        buf: &mut Vec<u8>,
        len: usize,
        off: u64,
        reply: impl FnOnce(Result<ReadData<'_>>) -> R,
    ) -> R {
        match self {
            UpperFile::Memory(m, node) if m.reads_mapped() => {
                m.read_mapped(node, off, len, |r| reply(r.map(ReadData::Mapped)))
            }
            _ => match self.read_into(buf, len, off) {
                Ok(()) => reply(Ok(ReadData::Bytes(buf))),
                Err(e) => reply(Err(e)),
            },
        }
    }

    /// fallocate(2) with `mode`: 0, KEEP_SIZE, or PUNCH_HOLE|KEEP_SIZE in memory (the modes
    /// mosaicfs' own files use); on disk whatever the upper file system takes.
    pub fn fallocate(&self, mode: rustix::fs::FallocateFlags, off: u64, len: u64) -> Result<()> {
        changing(Op::Fallocate)?;
        use rustix::fs::FallocateFlags as F;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fallocate(fd, mode, off, len)?),
            UpperFile::Memory(m, node) => {
                if mode == F::PUNCH_HOLE | F::KEEP_SIZE {
                    m.punch_hole(node, off, len)
                } else if mode - F::KEEP_SIZE == F::ZERO_RANGE {
                    // A hole reads as zeros in the store; without KEEP_SIZE the range may
                    // also extend the file, which an allocation does.
                    m.punch_hole(node, off, len)?;
                    if mode.contains(F::KEEP_SIZE) {
                        return Ok(());
                    }
                    m.allocate(node, off, len, false)
                } else if mode.is_empty() || mode == F::KEEP_SIZE {
                    m.allocate(node, off, len, mode == F::KEEP_SIZE)
                } else {
                    Err(errno(libc::EOPNOTSUPP))
                }
            }
        }
    }

    /// SEEK_HOLE: the end of the file when no hole lies at or past `off` before it.
    pub fn seek_hole(&self, off: u64) -> Result<u64> {
        match self {
            UpperFile::Disk(fd) => sys::seek_hole(fd.as_fd(), off),
            UpperFile::Memory(m, node) => m.seek_hole(node, off),
        }
    }

    /// Makes the file's data durable (fdatasync; a journal entry for a memory file).
    pub fn datasync(&self) -> Result<()> {
        changing(Op::Fsync)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fdatasync(fd)?),
            UpperFile::Memory(m, _) => m.sync_changes(),
        }
    }

    pub fn set_times(&self, atime: Time, mtime: Time) -> Result<()> {
        changing(Op::Utimens)?;
        match self {
            UpperFile::Disk(fd) => sys::futimens(fd.as_fd(), atime, mtime),
            UpperFile::Memory(m, node) => {
                m.set_times(node, atime, mtime);
                Ok(())
            }
        }
    }

    pub fn remove_xattr(&self, key: &str) -> Result<()> {
        changing(Op::RemoveXattr)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fremovexattr(fd, key)?),
            UpperFile::Memory(m, node) => m.remove_xattr(node, OsStr::new(key)),
        }
    }

    pub fn chown(&self, uid: Option<u32>, gid: Option<u32>) -> Result<()> {
        changing(Op::Chown)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fchown(
                fd,
                uid.map(rustix::fs::Uid::from_raw),
                gid.map(rustix::fs::Gid::from_raw),
            )?),
            UpperFile::Memory(m, node) => {
                m.set_owner(node, uid, gid);
                Ok(())
            }
        }
    }

    pub fn chmod(&self, mode: u32) -> Result<()> {
        changing(Op::Chmod)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fchmod(fd, Mode::from_raw_mode(mode & 0o7777))?),
            UpperFile::Memory(m, node) => {
                m.set_mode(node, mode);
                Ok(())
            }
        }
    }

    pub fn stat(&self) -> Result<Attr> {
        match self {
            UpperFile::Disk(fd) => sys::fstat(fd.as_fd()),
            UpperFile::Memory(_, node) => Ok(node.attr()),
        }
    }

    /// Reads up to `buf.len()` bytes at `off`; fewer only at the end of the file.
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> Result<usize> {
        match self {
            UpperFile::Disk(fd) => sys::pread_full(fd.as_fd(), buf, off),
            UpperFile::Memory(m, node) => m.read(node, buf, off),
        }
    }

    pub fn write_at(&self, data: &[u8], off: u64) -> Result<()> {
        changing(Op::Write)?;
        match self {
            UpperFile::Disk(fd) => sys::pwrite_full(fd.as_fd(), data, off),
            UpperFile::Memory(m, node) => m.write(node, data, off),
        }
    }

    pub fn truncate(&self, size: u64) -> Result<()> {
        changing(Op::Truncate)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::ftruncate(fd, size)?),
            UpperFile::Memory(m, node) => m.truncate(node, size),
        }
    }

    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE.
    pub fn punch_hole(&self, off: u64, len: u64) -> Result<()> {
        changing(Op::Fallocate)?;
        match self {
            UpperFile::Disk(fd) => {
                let mode =
                    rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
                Ok(sys::fallocate(fd, mode, off, len)?)
            }
            UpperFile::Memory(m, node) => m.punch_hole(node, off, len),
        }
    }

    /// SEEK_DATA: `None` where no data lies at or past `off` before the end (ENXIO).
    pub fn seek_data(&self, off: u64) -> Result<Option<u64>> {
        match self {
            UpperFile::Disk(fd) => match sys::seek_data(fd.as_fd(), off) {
                Err(e) if e.is(libc::ENXIO) => Ok(None),
                r => r,
            },
            UpperFile::Memory(m, node) => match m.seek_data(node, off) {
                Err(e) if e.is(libc::ENXIO) => Ok(None),
                r => r,
            },
        }
    }

    /// Makes the file's data and attributes durable (a journal entry for a memory file).
    pub fn sync(&self) -> Result<()> {
        changing(Op::Fsync)?;
        match self {
            UpperFile::Disk(fd) => Ok(sys::fsync(fd)?),
            UpperFile::Memory(m, _) => m.sync_changes(),
        }
    }

    pub fn get_xattr(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self {
            UpperFile::Disk(fd) => sys::fget_xattr(fd.as_fd(), key),
            UpperFile::Memory(m, node) => Ok(m.get_xattr(node, OsStr::new(key))),
        }
    }

    pub fn set_xattr(&self, key: &str, value: &[u8], flags: i32) -> Result<()> {
        changing(Op::SetXattr)?;
        match self {
            UpperFile::Disk(fd) => {
                let flags = rustix::fs::XattrFlags::from_bits_retain(flags as _);
                Ok(sys::fsetxattr(fd, key, value, flags)?)
            }
            UpperFile::Memory(m, node) => m.set_xattr(node, OsStr::new(key), value, flags),
        }
    }
}

#[cfg(test)]
mod tests;
