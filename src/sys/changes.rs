//! Changes to a layer. Only the upper and work dirs are ever changed. Every change goes
//! through a wrapper of this module: those in the other files of sys/, and these, with
//! rustix' signatures so that call sites read as before. A failure the file system reports
//! is noted for the operator (`note_failure`). Faults are injected one level up, at the upper
//! seam (upper.rs), for both stores.

use super::*;

/// The upper file system failing a change (EIO, or read-only after errors: EROFS, or damaged:
/// EUCLEAN) is a fact the operator must hear about, not only the caller's errno: one log line
/// a second at most, saying what failed and where to look. The operation itself was refused
/// whole (docs/ROBUSTNESS.md, "Failures half way").
pub(crate) fn note_failure(op: Op, e: rustix::io::Errno) -> rustix::io::Errno {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    static QUIET: AtomicU64 = AtomicU64::new(0);
    if ![
        rustix::io::Errno::IO,
        rustix::io::Errno::ROFS,
        rustix::io::Errno::UCLEAN,
    ]
    .contains(&e)
    {
        return e;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) == now {
        QUIET.fetch_add(1, Ordering::Relaxed);
        return e;
    }
    let quiet = QUIET.swap(0, Ordering::Relaxed);
    let more = if quiet > 0 {
        format!(" ({quiet} more such failures in the last second)")
    } else {
        String::new()
    };
    log::error!(
        "the upper layer's file system failed a change ({op:?}): {}{more}; the operation was \
         refused and nothing of it shows; check that file system (dmesg, fsck)",
        std::io::Error::from_raw_os_error(e.raw_os_error())
    );
    e
}

/// A change made by `f`, for the wrappers that speak the crate's error type: its failure noted.
pub(super) fn change<T>(op: Op, f: impl FnOnce() -> Result<T>) -> Result<T> {
    f().inspect_err(|e| {
        note_failure(op, rustix::io::Errno::from_raw_os_error(e.errno()));
    })
}

pub fn mkdirat<P: Arg, Fd: AsFd>(dir: Fd, path: P, mode: Mode) -> rustix::io::Result<()> {
    rustix::fs::mkdirat(dir, path, mode).map_err(|e| note_failure(Op::Mkdir, e))
}

/// unlinkat, rmdir with `AtFlags::REMOVEDIR`.
pub fn unlinkat<P: Arg, Fd: AsFd>(dir: Fd, path: P, flags: AtFlags) -> rustix::io::Result<()> {
    rustix::fs::unlinkat(dir, path, flags).map_err(|e| note_failure(Op::Unlink, e))
}

pub fn symlinkat<P: Arg, Q: Arg, Fd: AsFd>(target: P, dir: Fd, path: Q) -> rustix::io::Result<()> {
    rustix::fs::symlinkat(target, dir, path).map_err(|e| note_failure(Op::Symlink, e))
}

pub fn linkat<P: Arg, Q: Arg, PFd: AsFd, QFd: AsFd>(
    old_dir: PFd,
    old: P,
    new_dir: QFd,
    new: Q,
    flags: AtFlags,
) -> rustix::io::Result<()> {
    rustix::fs::linkat(old_dir, old, new_dir, new, flags).map_err(|e| note_failure(Op::Link, e))
}

pub fn fchown<Fd: AsFd>(
    fd: Fd,
    uid: Option<rustix::fs::Uid>,
    gid: Option<rustix::fs::Gid>,
) -> rustix::io::Result<()> {
    rustix::fs::fchown(fd, uid, gid).map_err(|e| note_failure(Op::Chown, e))
}

pub fn fchmod<Fd: AsFd>(fd: Fd, mode: Mode) -> rustix::io::Result<()> {
    rustix::fs::fchmod(fd, mode).map_err(|e| note_failure(Op::Chmod, e))
}

pub fn fsetxattr<P: Arg, Fd: AsFd>(
    fd: Fd,
    name: P,
    value: &[u8],
    flags: rustix::fs::XattrFlags,
) -> rustix::io::Result<()> {
    rustix::fs::fsetxattr(fd, name, value, flags).map_err(|e| note_failure(Op::SetXattr, e))
}

pub fn fremovexattr<P: Arg, Fd: AsFd>(fd: Fd, name: P) -> rustix::io::Result<()> {
    rustix::fs::fremovexattr(fd, name).map_err(|e| note_failure(Op::RemoveXattr, e))
}

pub fn ftruncate<Fd: AsFd>(fd: Fd, length: u64) -> rustix::io::Result<()> {
    rustix::fs::ftruncate(fd, length).map_err(|e| note_failure(Op::Truncate, e))
}

pub fn fallocate<Fd: AsFd>(
    fd: Fd,
    mode: rustix::fs::FallocateFlags,
    offset: u64,
    len: u64,
) -> rustix::io::Result<()> {
    rustix::fs::fallocate(fd, mode, offset, len).map_err(|e| note_failure(Op::Fallocate, e))
}

/// openat; one that creates (O_CREAT, O_TMPFILE) is a change.
pub fn openat<P: Arg, Fd: AsFd>(
    dir: Fd,
    path: P,
    flags: OFlags,
    mode: Mode,
) -> rustix::io::Result<OwnedFd> {
    // (O_TMPFILE's bits include O_DIRECTORY: test for all of them.)
    if flags.contains(OFlags::CREATE) || flags.contains(OFlags::TMPFILE) {
        return rustix::fs::openat(dir, path, flags, mode).map_err(|e| note_failure(Op::Create, e));
    }
    let path = path.into_c_str()?;
    without_atime(flags, |flags| rustix::fs::openat(&dir, &*path, flags, mode))
}

/// FICLONE: a whole-file clone is a write of the destination.
pub fn ioctl_ficlone<Fd: AsFd, SrcFd: AsFd>(fd: Fd, src: SrcFd) -> rustix::io::Result<()> {
    rustix::fs::ioctl_ficlone(fd, src).map_err(|e| note_failure(Op::Write, e))
}

pub fn fsync<Fd: AsFd>(fd: Fd) -> rustix::io::Result<()> {
    rustix::fs::fsync(fd).map_err(|e| note_failure(Op::Fsync, e))
}

pub fn fdatasync<Fd: AsFd>(fd: Fd) -> rustix::io::Result<()> {
    rustix::fs::fdatasync(fd).map_err(|e| note_failure(Op::Fsync, e))
}
