//! Thin wrappers over the system calls mosaicfs needs, in one place.
//!
//! Every access to a layer is fd-relative: a path inside a layer is opened with `openat2` and
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, so neither a symlink nor `..` in a layer can lead the
//! daemon outside it. Paths we build never cross a symlink on purpose (the merged view resolves
//! symlinks in the kernel, not here), so refusing every symlink in the middle of a path is right.
//! Calls that take a final name use `AT_SYMLINK_NOFOLLOW` or the `l*` variants.

mod changes;
mod fanotify;
mod mount;
mod xattr;

pub use changes::*;
pub use fanotify::*;
pub use mount::*;
pub use xattr::*;

use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, CWD, Mode, OFlags, ResolveFlags};

use crate::error::{Result, errno};
use crate::fault::Op;
use rustix::path::Arg;

/// The attributes of one file in one layer, as `stat` gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Attr {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    pub blocks: u64,
    pub blksize: u32,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// When the object was made, where its file system records it (`statx` STATX_BTIME): what
    /// tells an object from another its file system later gives the same inode number.
    pub btime: Option<(i64, u32)>,
}

impl Attr {
    pub fn file_type(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type() == libc::S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.file_type() == libc::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type() == libc::S_IFLNK
    }
}

impl From<rustix::fs::Stat> for Attr {
    fn from(s: rustix::fs::Stat) -> Self {
        Attr {
            dev: s.st_dev,
            ino: s.st_ino,
            mode: s.st_mode,
            nlink: s.st_nlink,
            uid: s.st_uid,
            gid: s.st_gid,
            rdev: s.st_rdev,
            size: s.st_size.max(0) as u64,
            blocks: s.st_blocks.max(0) as u64,
            blksize: s.st_blksize.max(0) as u32,
            atime: (s.st_atime, s.st_atime_nsec as u32),
            mtime: (s.st_mtime, s.st_mtime_nsec as u32),
            ctime: (s.st_ctime, s.st_ctime_nsec as u32),
            btime: None,
        }
    }
}

impl From<rustix::fs::Statx> for Attr {
    fn from(s: rustix::fs::Statx) -> Self {
        let time = |t: rustix::fs::StatxTimestamp| (t.tv_sec, t.tv_nsec);
        let has_btime = s.stx_mask & rustix::fs::StatxFlags::BTIME.bits() != 0;
        Attr {
            dev: libc::makedev(s.stx_dev_major, s.stx_dev_minor),
            ino: s.stx_ino,
            mode: s.stx_mode as u32,
            nlink: s.stx_nlink as u64,
            uid: s.stx_uid,
            gid: s.stx_gid,
            rdev: libc::makedev(s.stx_rdev_major, s.stx_rdev_minor),
            size: s.stx_size,
            blocks: s.stx_blocks,
            blksize: s.stx_blksize,
            atime: time(s.stx_atime),
            mtime: time(s.stx_mtime),
            ctime: time(s.stx_ctime),
            btime: has_btime.then(|| time(s.stx_btime)),
        }
    }
}

impl Attr {
    /// A file handle generation for the object, the same in every mount: from its birth time,
    /// where its file system records one (inode/mod.rs `Found::generation`). Below 2^32: the
    /// kernel keeps an inode's generation in 32 bits.
    pub fn stable_generation(&self) -> Option<u64> {
        let (sec, nsec) = self.btime?;
        let x = (sec as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ nsec as u64;
        Some((x ^ (x >> 32)) & 0xffff_ffff)
    }
}

const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

fn rel_or_dot(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

/// Longest path one `openat2` is given. The kernel refuses a path of PATH_MAX bytes (4096,
/// counting the NUL) or more; a layer may hold a tree deeper than that (kernel overlayfs serves
/// one 2,000 levels deep), so longer paths are walked in steps.
const PATH_STEP: usize = 4000;

/// Opens `rel` below `root` without ever leaving it. `rel` is relative; empty means `root` itself.
/// A path longer than `PATH_STEP` is opened a run of directories at a time, each run beneath
/// the directory the previous one opened: every step is as confined as one call would be.
pub fn open_beneath(root: BorrowedFd<'_>, rel: &Path, flags: OFlags, mode: u32) -> Result<OwnedFd> {
    let mut rest = rel.as_os_str().as_bytes();
    let mut dir: Option<OwnedFd> = None;
    while rest.len() > PATH_STEP {
        // A name is at most NAME_MAX (255) bytes, so a run of whole names fits in a step.
        let cut = rest[..PATH_STEP]
            .iter()
            .rposition(|b| *b == b'/')
            .ok_or_else(|| errno(libc::ENAMETOOLONG))?;
        let run = Path::new(OsStr::from_bytes(&rest[..cut]));
        let at = dir.as_ref().map_or(root, |d| d.as_fd());
        dir = Some(openat2_beneath(
            at,
            run,
            OFlags::PATH | OFlags::DIRECTORY,
            0,
        )?);
        rest = &rest[cut + 1..];
    }
    let at = dir.as_ref().map_or(root, |d| d.as_fd());
    openat2_beneath(at, Path::new(OsStr::from_bytes(rest)), flags, mode)
}

fn openat2_beneath(root: BorrowedFd<'_>, rel: &Path, flags: OFlags, mode: u32) -> Result<OwnedFd> {
    Ok(without_atime(flags, |flags| {
        loop {
            match rustix::fs::openat2(
                root,
                rel_or_dot(rel),
                flags | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(mode),
                BENEATH,
            ) {
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => continue,
                r => return r,
            }
        }
    })?)
}

/// An `O_PATH` handle on the directory `rel` below `root`, to use with the `*at` calls.
pub fn open_dir(root: BorrowedFd<'_>, rel: &Path) -> Result<OwnedFd> {
    open_beneath(root, rel, OFlags::PATH | OFlags::DIRECTORY, 0)
}

/// What `stat_at` and `fstat` ask of `statx`: what stat(2) gives, and the birth time.
const STAT_MASK: rustix::fs::StatxFlags =
    rustix::fs::StatxFlags::BASIC_STATS.union(rustix::fs::StatxFlags::BTIME);

pub fn stat_at(dir: BorrowedFd<'_>, name: &OsStr) -> Result<Attr> {
    Ok(rustix::fs::statx(dir, name, AtFlags::SYMLINK_NOFOLLOW, STAT_MASK)?.into())
}

/// `stat_at` where a missing name is an answer, not an error.
pub fn stat_opt(dir: BorrowedFd<'_>, name: &OsStr) -> Result<Option<Attr>> {
    match stat_at(dir, name) {
        Ok(a) => Ok(Some(a)),
        Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A shared read-write mapping of the first `len` bytes of a file (the file is at least that
/// long): what a process stores there is in the file as soon as it is stored, so that a
/// process killed next leaves it to whoever maps the file after it. Unmapped when dropped.
/// Its owners reach the bytes through `ptr`, with the discipline each states (atomics, or a
/// lock of their own), and must not keep a pointer past the owner.
pub struct SharedMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory, valid until drop; every access goes through `ptr` in an
// unsafe block of its owner, which says how concurrent accesses are kept apart.
unsafe impl Send for SharedMap {}
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Where the mapping starts.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping `map_shared` made, of `len` bytes; its owner keeps no pointer
        // into it past this.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Maps the first `len` bytes of `file` shared (`SharedMap`).
pub fn map_shared(file: BorrowedFd<'_>, len: usize) -> std::io::Result<SharedMap> {
    // SAFETY: a fresh mapping at an address the kernel picks, overlapping nothing of Rust's.
    let map = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            file,
            0,
        )?
    };
    Ok(SharedMap {
        ptr: map.cast(),
        len,
    })
}

pub fn fstat(fd: BorrowedFd<'_>) -> Result<Attr> {
    let sx = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, STAT_MASK)?;
    Ok(sx.into())
}

/// The birth time of `name` in `dir` (of `dir` itself with `None`), not following a symlink;
/// `None` where the file system records none.
pub fn birth_time(dir: BorrowedFd<'_>, name: Option<&OsStr>) -> Result<Option<(i64, u32)>> {
    use rustix::fs::{AtFlags, StatxFlags};
    let (path, flags) = match name {
        Some(n) => (n, AtFlags::SYMLINK_NOFOLLOW),
        None => (OsStr::new(""), AtFlags::EMPTY_PATH),
    };
    let sx = rustix::fs::statx(dir, path, flags, StatxFlags::BTIME)?;
    Ok((sx.stx_mask & StatxFlags::BTIME.bits() != 0)
        .then_some((sx.stx_btime.tv_sec, sx.stx_btime.tv_nsec)))
}

/// The statx attributes (`STATX_ATTR_*`) of `name` in `dir` (of `dir` itself with `None`)
/// that its file system reports, not following a symlink: one call, no open.
pub fn attributes(dir: BorrowedFd<'_>, name: Option<&OsStr>) -> Result<u64> {
    use rustix::fs::{AtFlags, StatxFlags};
    let (path, flags) = match name {
        Some(n) => (n, AtFlags::SYMLINK_NOFOLLOW),
        None => (OsStr::new(""), AtFlags::EMPTY_PATH),
    };
    let sx = rustix::fs::statx(dir, path, flags, StatxFlags::empty())?;
    Ok((sx.stx_attributes & sx.stx_attributes_mask).bits())
}

/// ioctl(2) `cmd` on `fd` with the pointer argument `arg`.
///
/// # Safety
/// `arg` must point to memory of the size and layout `cmd` reads or writes.
unsafe fn ioctl_with(fd: BorrowedFd<'_>, cmd: u32, arg: *mut libc::c_void) -> Result<()> {
    // SAFETY: the caller vouches for `arg`; the descriptor is open for the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), cmd as _, arg) } < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// The fs-verity measurement of an open file: the hash algorithm (FS_VERITY_HASH_ALG_*) and
/// the digest (FS_IOC_MEASURE_VERITY). ENODATA when the file has no verity.
pub fn measure_verity(fd: BorrowedFd<'_>) -> Result<(u8, Vec<u8>)> {
    const FS_IOC_MEASURE_VERITY: u32 = 0xc004_6686;
    const MAX_DIGEST: usize = 64;
    // struct fsverity_digest: u16 algorithm, u16 size (in: room, out: used), the digest.
    let mut buf = [0u8; 4 + MAX_DIGEST];
    buf[2..4].copy_from_slice(&(MAX_DIGEST as u16).to_ne_bytes());
    // SAFETY: the buffer is a struct fsverity_digest with room for MAX_DIGEST digest bytes, as
    // its size field says; the kernel writes no more.
    unsafe { ioctl_with(fd, FS_IOC_MEASURE_VERITY, buf.as_mut_ptr().cast())? };
    let algorithm = u16::from_ne_bytes([buf[0], buf[1]]);
    let size = (u16::from_ne_bytes([buf[2], buf[3]]) as usize).min(MAX_DIGEST);
    Ok((algorithm as u8, buf[4..4 + size].to_vec()))
}

/// `struct fsxattr` (FS_IOC_FSGETXATTR), as bytes: xflags, extsize, nextents, projid,
/// cowextsize, 8 bytes of padding.
pub type FsXattr = [u8; 28];
pub const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
pub const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;

/// FS_IOC_FSGETXATTR of an open file or directory.
pub fn fs_xattr(fd: BorrowedFd<'_>) -> Result<FsXattr> {
    let mut fsx: FsXattr = [0; 28];
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr` (28 bytes) to the buffer given.
    unsafe { ioctl_with(fd, FS_IOC_FSGETXATTR, fsx.as_mut_ptr().cast())? };
    Ok(fsx)
}

/// FS_IOC_FSSETXATTR of an open file or directory.
pub fn set_fs_xattr(fd: BorrowedFd<'_>, fsx: &FsXattr) -> Result<()> {
    // SAFETY: FS_IOC_FSSETXATTR reads one `struct fsxattr` (28 bytes) from the buffer given.
    unsafe { ioctl_with(fd, FS_IOC_FSSETXATTR, fsx.as_ptr().cast_mut().cast()) }
}

/// A path through `/proc/self/fd` naming `name` inside the directory `dir`, and whether the
/// xattr calls are to follow its last component. The directory's magic link is then only an
/// intermediate component, and the `l*xattr` calls do not follow the final one, so this reaches
/// symlinks and devices too, which cannot be opened for `f*xattr`. With `name` `None` the path
/// is `dir`'s own magic link, followed: `dir` is then the object itself (a directory, or an
/// unnamed open file that no name reaches).
fn proc_path(dir: BorrowedFd<'_>, name: Option<&OsStr>) -> (CString, bool) {
    let mut p = format!("/proc/self/fd/{}", dir.as_raw_fd()).into_bytes();
    if let Some(n) = name {
        p.push(b'/');
        p.extend_from_slice(n.as_bytes());
    }
    (
        CString::new(p).expect("file names hold no NUL"),
        name.is_none(),
    )
}

/// Gives the open file `fd` the name `name` in `dir` (an O_TMPFILE, or a file unlinked while
/// open: no path reaches it). Through its /proc magic link, not AT_EMPTY_PATH: that needs
/// CAP_DAC_READ_SEARCH, which a rootless daemon lacks.
pub fn link_open_file(fd: BorrowedFd<'_>, dir: BorrowedFd<'_>, name: &OsStr) -> Result<()> {
    change(Op::Link, || {
        let (path, _) = proc_path(fd, None);
        Ok(rustix::fs::linkat(
            CWD,
            &path,
            dir,
            name,
            AtFlags::SYMLINK_FOLLOW,
        )?)
    })
}

/// Opens the object `fd` (an `O_PATH` descriptor, say) anew with `flags`, through its /proc
/// magic link: reaches an object no name leads to any more.
pub fn reopen(fd: BorrowedFd<'_>, flags: OFlags) -> Result<OwnedFd> {
    let (path, _) = proc_path(fd, None);
    Ok(rustix::fs::openat(CWD, &path, flags, Mode::empty())?)
}

/// One entry of a directory as `getdents` gives it.
#[derive(Debug, Clone)]
pub struct RawDirEntry {
    pub name: OsString,
    pub ino: u64,
    /// `S_IFMT` bits, or 0 when the file system did not say (then `stat` tells).
    pub kind: u32,
}

pub fn read_dir(root: BorrowedFd<'_>, rel: &Path) -> Result<Vec<RawDirEntry>> {
    let fd = open_beneath(root, rel, OFlags::RDONLY | OFlags::DIRECTORY, 0)?;
    let dir = rustix::fs::Dir::new(fd)?;
    let mut out = Vec::new();
    for ent in dir {
        let ent = ent?;
        let name = ent.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        use rustix::fs::FileType as T;
        let kind = match ent.file_type() {
            T::RegularFile => libc::S_IFREG,
            T::Directory => libc::S_IFDIR,
            T::Symlink => libc::S_IFLNK,
            T::Fifo => libc::S_IFIFO,
            T::Socket => libc::S_IFSOCK,
            T::CharacterDevice => libc::S_IFCHR,
            T::BlockDevice => libc::S_IFBLK,
            T::Unknown => 0,
        };
        out.push(RawDirEntry {
            name: OsString::from_vec(name.to_vec()),
            ino: ent.ino(),
            kind,
        });
    }
    Ok(out)
}

/// Where the next data at or after `offset` starts, or `None` if only a hole follows.
pub fn seek_data(fd: BorrowedFd<'_>, offset: u64) -> Result<Option<u64>> {
    match rustix::fs::seek(fd, rustix::fs::SeekFrom::Data(offset)) {
        Ok(p) => Ok(Some(p)),
        Err(rustix::io::Errno::NXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Where the hole at or after `offset` starts (end of file counts as a hole).
pub fn seek_hole(fd: BorrowedFd<'_>, offset: u64) -> Result<u64> {
    Ok(rustix::fs::seek(fd, rustix::fs::SeekFrom::Hole(offset))?)
}

/// Whether `process_vm_readv` on this process works (a seccomp filter may refuse it): the
/// io_uring transport copies replies out of the memory upper's filestore mapping with it.
pub fn kernel_can_copy_own_memory() -> bool {
    let src = [1u8];
    let mut dst = [0u8];
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: src.as_ptr().cast_mut().cast(),
        iov_len: 1,
    };
    // SAFETY: both iovecs describe one byte of this frame's own arrays.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == 1 && dst[0] == 1
}

/// `iovecs` as `IoSlice`s, without making a `&[u8]` of memory the daemon must not read (a
/// shared mapping of a file someone may truncate): `IoSlice` is an `iovec` on Unix.
pub fn iovecs_as_io_slices(iovecs: &[libc::iovec]) -> &[std::io::IoSlice<'_>] {
    // SAFETY: std guarantees `IoSlice` is ABI compatible with `iovec` on Unix platforms.
    unsafe { std::slice::from_raw_parts(iovecs.as_ptr().cast(), iovecs.len()) }
}

/// Whether `len` bytes at `offset` of `fd` (fewer at end of file) are in the page cache, so
/// that reading them costs no I/O: `preadv2(RWF_NOWAIT)`, which fails with EAGAIN (or reads
/// short) where a page is missing. A file system without non-blocking reads says no.
pub fn is_cached(fd: BorrowedFd<'_>, offset: u64, len: usize) -> bool {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.resize(len.max(1), 0);
        let mut done = 0;
        while done < len {
            let buf = [std::io::IoSliceMut::new(&mut s[done..len])];
            match rustix::io::preadv2(
                fd,
                &mut { buf },
                offset + done as u64,
                rustix::io::ReadWriteFlags::NOWAIT,
            ) {
                // End of file: what there is, is cached.
                Ok(0) => return true,
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return false,
            }
        }
        true
    })
}

/// Reads exactly `buf.len()` bytes at `offset`, or fewer at end of file.
pub fn pread_full(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(fd, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// Reads up to `len` bytes at `offset` into `buf` (replacing its contents) without zeroing it
/// first; fewer bytes only at end of file.
pub fn pread_into(fd: BorrowedFd<'_>, buf: &mut Vec<u8>, len: usize, offset: u64) -> Result<()> {
    buf.clear();
    buf.reserve(len.max(1));
    while buf.len() < len {
        let done = buf.len();
        let want = len - done;
        let spare = &mut buf.spare_capacity_mut()[..want];
        match rustix::io::pread(fd, spare, offset + done as u64) {
            Ok(([], _)) => break,
            Ok((filled, _)) => {
                let n = filled.len();
                // SAFETY: pread initialized `n` bytes of the spare capacity, which starts at
                // `done`; the length never exceeds the reserved capacity (`n <= want`).
                unsafe { buf.set_len(done + n) };
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub fn pwrite_full(fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> Result<()> {
    change(Op::Write, || {
        let mut done = 0;
        while done < buf.len() {
            match rustix::io::pwrite(fd, &buf[done..], offset + done as u64) {
                Ok(0) => return Err(errno(libc::EIO)),
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    })
}

pub fn mknod_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32, rdev: u64) -> Result<()> {
    change(Op::Mknod, || {
        let kind = rustix::fs::FileType::from_raw_mode(mode);
        rustix::fs::mknodat(dir, name, kind, Mode::from_raw_mode(mode & 0o7777), rdev)?;
        Ok(())
    })
}

pub fn rename_at(
    from_dir: BorrowedFd<'_>,
    from: &OsStr,
    to_dir: BorrowedFd<'_>,
    to: &OsStr,
    flags: rustix::fs::RenameFlags,
) -> Result<()> {
    change(Op::Rename, || {
        Ok(rustix::fs::renameat_with(
            from_dir, from, to_dir, to, flags,
        )?)
    })
}

/// chown of `name` in `dir`, or of `dir` itself when `name` is `None` (as for the calls below;
/// `dir` may be an `O_PATH` descriptor, so through its magic link rather than `fchown`).
pub fn chown_at(
    dir: BorrowedFd<'_>,
    name: Option<&OsStr>,
    uid: Option<u32>,
    gid: Option<u32>,
) -> Result<()> {
    change(Op::Chown, || {
        let uid = uid.map(rustix::fs::Uid::from_raw);
        let gid = gid.map(rustix::fs::Gid::from_raw);
        Ok(match name {
            Some(name) => rustix::fs::chownat(dir, name, uid, gid, AtFlags::SYMLINK_NOFOLLOW),
            None => rustix::fs::chownat(CWD, &proc_path(dir, None).0, uid, gid, AtFlags::empty()),
        }?)
    })
}

/// chmod of `name` in `dir` (of `dir` itself with `None`), never through a symlink: a symlink
/// has no mode of its own on Linux, and its name answers EOPNOTSUPP. One fchmodat2 with
/// AT_SYMLINK_NOFOLLOW (Linux 6.6+; rustix does not pass that flag); before 6.6, a stat first.
pub fn chmod_at(dir: BorrowedFd<'_>, name: Option<&OsStr>, mode: u32) -> Result<()> {
    change(Op::Chmod, || {
        let m = Mode::from_raw_mode(mode & 0o7777);
        let Some(name) = name else {
            return Ok(rustix::fs::chmodat(
                CWD,
                &proc_path(dir, None).0,
                m,
                AtFlags::empty(),
            )?);
        };
        match fchmodat2_nofollow(dir, name, mode & 0o7777) {
            Err(rustix::io::Errno::NOSYS) => {
                if stat_at(dir, name)?.is_symlink() {
                    return Err(errno(libc::EOPNOTSUPP));
                }
                Ok(rustix::fs::chmodat(dir, name, m, AtFlags::empty())?)
            }
            r => Ok(r?),
        }
    })
}

fn fchmodat2_nofollow(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> rustix::io::Result<()> {
    let name = CString::new(name.as_bytes()).map_err(|_| rustix::io::Errno::INVAL)?;
    // SAFETY: fchmodat2(2) reads the NUL-terminated path, which outlives the call, and uses
    // the descriptor only during it; it writes no memory of this process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            dir.as_raw_fd(),
            name.as_ptr(),
            mode as libc::mode_t,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    match r {
        0 => Ok(()),
        _ => Err(rustix::io::Errno::from_raw_os_error(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO),
        )),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Time {
    Now,
    Omit,
    At(i64, u32),
}

fn timespec(t: &Time) -> rustix::fs::Timespec {
    match t {
        Time::Now => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        },
        Time::Omit => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        Time::At(s, n) => rustix::fs::Timespec {
            tv_sec: *s,
            tv_nsec: *n as _,
        },
    }
}

pub fn utimens_at(
    dir: BorrowedFd<'_>,
    name: Option<&OsStr>,
    atime: Time,
    mtime: Time,
) -> Result<()> {
    change(Op::Utimens, || {
        let ts = rustix::fs::Timestamps {
            last_access: timespec(&atime),
            last_modification: timespec(&mtime),
        };
        Ok(match name {
            Some(name) => rustix::fs::utimensat(dir, name, &ts, AtFlags::SYMLINK_NOFOLLOW),
            None => rustix::fs::utimensat(CWD, &proc_path(dir, None).0, &ts, AtFlags::empty()),
        }?)
    })
}

/// Sets the atime and mtime of the open file `fd`.
pub fn futimens(fd: BorrowedFd<'_>, atime: Time, mtime: Time) -> Result<()> {
    change(Op::Utimens, || {
        let ts = rustix::fs::Timestamps {
            last_access: timespec(&atime),
            last_modification: timespec(&mtime),
        };
        Ok(rustix::fs::futimens(fd, &ts)?)
    })
}

pub fn read_link_at(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OsString> {
    let target = rustix::fs::readlinkat(dir, name, Vec::new())?;
    Ok(OsString::from_vec(target.into_bytes()))
}

/// The per-thread file-system context (cwd, root, umask) of FUSE worker threads is private, so
/// that each can set the umask of the request it serves without racing the others.
pub fn unshare_fs_context() -> Result<()> {
    // SAFETY: CLONE_FS only separates cwd, root and umask of this thread; no file descriptor
    // table is unshared, so every fd stays valid on every thread.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS)? };
    Ok(())
}

/// Sets this thread's fsuid and fsgid and keeps its file-system capabilities effective.
/// Returns whether the thread now runs with those ids.
pub fn set_fs_ids(uid: u32, gid: u32) -> bool {
    // SAFETY: setfsgid/setfsuid take plain integers and change only the calling thread's
    // credentials (the raw syscalls, not glibc's process-wide set*id broadcast).
    let (prev_gid, prev_uid) = unsafe {
        (
            libc::syscall(libc::SYS_setfsgid, gid as libc::c_long),
            libc::syscall(libc::SYS_setfsuid, uid as libc::c_long),
        )
    };
    let _ = (prev_gid, prev_uid);
    // setfs*id report the previous id and never fail loudly: read the result back.
    // SAFETY: as above; -1 is an invalid id, so these calls only query.
    let (now_gid, now_uid) = unsafe {
        (
            libc::syscall(libc::SYS_setfsgid, -1i64),
            libc::syscall(libc::SYS_setfsuid, -1i64),
        )
    };
    if now_uid as u32 != uid || now_gid as u32 != gid {
        return false;
    }
    // Leaving fsuid 0 cleared CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER... from the effective set.
    match rustix::thread::capabilities(None) {
        Ok(mut caps) => {
            caps.effective = caps.permitted;
            rustix::thread::set_capabilities(None, caps).is_ok()
        }
        Err(_) => false,
    }
}

pub fn set_umask(mask: u32) -> u32 {
    rustix::process::umask(Mode::from_raw_mode(mask)).as_raw_mode()
}

/// This process's memory: resident bytes (`VmRSS`), and the allocator's heap as glibc sees
/// it: bytes in use, bytes free but kept (not given back to the system), bytes in mappings of
/// their own. `status` shows them, so that a resident size can be told apart into what the
/// daemon holds and what it freed (docs/PERFORMANCE.md, "Memory per inode").
pub struct MemoryUse {
    pub resident: u64,
    pub heap_in_use: u64,
    pub heap_free: u64,
    pub mapped: u64,
}

pub fn memory_use() -> MemoryUse {
    let resident = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024);
    // SAFETY: mallinfo2 only reads the allocator's bookkeeping under its own locks.
    let m = unsafe { libc::mallinfo2() };
    MemoryUse {
        resident,
        heap_in_use: m.uordblks as u64,
        heap_free: m.fordblks as u64,
        mapped: m.hblkhd as u64,
    }
}

/// The threads of this process serving FUSE requests (named `fuser-N`, or `fuser-ringQ-N`
/// over io_uring), whose number grows while every one is stuck and shrinks again once they
/// are idle (vendored fuser `WorkerPool`).
pub fn fuse_workers() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| {
            let name = name.trim();
            name.starts_with("fuser-") && name != "fuser-pool" && name != "fuser-dev"
        })
        .count()
}

/// Asks the allocator to give every page no allocation uses back to the system (glibc's
/// `malloc_trim`, which also returns whole free pages between allocations in use): about a
/// millisecond per 100 MiB of heap. Called after the daemon freed much at once.
pub fn give_back_free_memory() {
    // SAFETY: malloc_trim only returns free memory to the system; it takes the allocator's
    // own locks and touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `fork(2)`. Only called before any thread is started.
pub fn fork() -> Result<Option<i32>> {
    // SAFETY: called from main() before any other thread exists (the FUSE session is mounted
    // but starts its threads in the child), so the
    // child inherits no lock held by another thread.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(std::io::Error::last_os_error().into()),
        0 => Ok(None),
        pid => Ok(Some(pid)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// statmount answers for a plain mount on kernels that have it (6.8+), so that opening
    /// layers never reads /proc/self/mountinfo there; the idmapped case is in tests/overlay.rs.
    #[test]
    fn statmount_tells_a_plain_mount_from_an_idmapped_one() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse::<u32>());
        let (major, minor) = (v.next(), v.next());
        let has_statmount =
            matches!((major, minor), (Some(Ok(a)), Some(Ok(b))) if (a, b) >= (6, 8));
        let got = on_idmapped_mount(Path::new("/"));
        if has_statmount {
            assert_eq!(got, Some(false), "kernel {release}");
        } else {
            assert_eq!(got, None, "kernel {release}");
        }
        assert_eq!(on_idmapped_mount(Path::new("/nonexistent/x")), None);
    }

    /// Every kind of object an xattr call reaches — a file by name, a directory by name, a
    /// directory itself, an unnamed regular file (its O_PATH handle) and a symlink by name,
    /// never followed — answers the same through the `*xattrat` calls and through /proc.
    #[test]
    fn xattr_calls_reach_the_same_objects_with_and_without_the_at_calls() {
        let tmp = std::env::temp_dir().join(format!("mosaicfs-xattr-{}", std::process::id()));
        std::fs::create_dir_all(tmp.join("sub")).unwrap();
        std::fs::write(tmp.join("file"), b"x").unwrap();
        std::os::unix::fs::symlink("file", tmp.join("link")).unwrap();
        let dir = rustix::fs::open(&tmp, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let file = rustix::fs::open(tmp.join("file"), OFlags::PATH, Mode::empty()).unwrap();
        let sub = rustix::fs::open(tmp.join("sub"), OFlags::PATH, Mode::empty()).unwrap();
        let targets: [(BorrowedFd, Option<&OsStr>); 4] = [
            (dir.as_fd(), Some(OsStr::new("file"))),
            (dir.as_fd(), Some(OsStr::new("sub"))),
            (sub.as_fd(), None),
            (file.as_fd(), None),
        ];
        for at_calls in [true, false] {
            XATTRAT.store(at_calls, Ordering::Relaxed);
            for (i, (d, name)) in targets.iter().enumerate() {
                let key = format!("user.t{i}");
                set_xattr(*d, *name, &key, b"v1", 0).unwrap();
                let e = set_xattr(*d, *name, &key, b"v2", libc::XATTR_CREATE).unwrap_err();
                assert!(
                    e.is(libc::EEXIST),
                    "{name:?}: XATTR_CREATE over a value: {e}"
                );
                set_xattr(*d, *name, &key, &[7u8; 2000], 0).unwrap();
                assert_eq!(get_xattr(*d, *name, &key).unwrap(), Some(vec![7u8; 2000]));
                assert!(
                    list_xattr(*d, *name)
                        .unwrap()
                        .contains(&OsString::from(&key))
                );
                remove_xattr(*d, *name, &key).unwrap();
                assert_eq!(get_xattr(*d, *name, &key).unwrap(), None, "{name:?}");
                assert!(
                    get_xattr_raw(*d, *name, OsStr::new(&key))
                        .unwrap_err()
                        .is(libc::ENODATA)
                );
            }
            // The file's own value is never read through the symlink naming it.
            set_xattr(dir.as_fd(), Some(OsStr::new("file")), "user.f", b"f", 0).unwrap();
            let link = Some(OsStr::new("link"));
            assert_eq!(get_xattr(dir.as_fd(), link, "user.f").unwrap(), None);
            assert!(list_xattr(dir.as_fd(), link).unwrap().is_empty());
            remove_xattr(dir.as_fd(), Some(OsStr::new("file")), "user.f").unwrap();
            let missing = Some(OsStr::new("missing"));
            assert!(
                list_xattr(dir.as_fd(), missing)
                    .unwrap_err()
                    .is(libc::ENOENT)
            );
        }
        XATTRAT.store(true, Ordering::Relaxed);
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
