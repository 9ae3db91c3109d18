//! The work dir: its lock against a second daemon or a tool on the same layers, who holds it
//! when it is taken, and preparing it at mount.

use super::*;

/// What opening a writable stack does when another process holds the work dir's lock.
///
/// One upper layer, one user: the daemon of a mount and the offline tools (tools.rs) each take
/// an exclusive `flock` on `WORKDIR/mosaicfs-work` for as long as they use the layers. Two
/// daemons on one upper layer would each empty the work dir at start, removing objects the
/// other is building, and a tool would complete or convert files under a live mount. Both wait
/// for the previous user, with a bound: `umount` returns before the daemon of the mount has
/// written its pending blocks back and exited, so a tool run right after it would otherwise
/// fail. Both fail at once when the holder is a daemon whose mount is still there.
#[derive(Debug, Clone, Copy)]
pub enum WorkLock {
    /// A mount: wait this long.
    Wait(std::time::Duration),
    /// A tool: wait `MOUNT_LOCK_WAIT` unless the holder serves a live mount.
    Tool,
}

/// How long a mount, or a tool, waits for the previous user of its work dir to let go.
pub const MOUNT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

pub fn lock_work_dir(work: BorrowedFd<'_>, path: &Path, how: WorkLock) -> Result<OwnedFd> {
    let fd = sys::open_beneath(
        work,
        Path::new(WORK_SUBDIR),
        OFlags::RDONLY | OFlags::DIRECTORY,
        0,
    )
    .map_err(|e| crate::message!("workdir '{}': {e}", path.display()))?;
    lock_dir(fd, "workdir", path, how)
}

/// Takes the exclusive `flock` on the open directory `fd` (`what` '`path`' in messages), as
/// `how` says.
pub(super) fn lock_dir(fd: OwnedFd, what: &str, path: &Path, how: WorkLock) -> Result<OwnedFd> {
    use rustix::fs::FlockOperation;
    let wait = match how {
        WorkLock::Wait(d) => d,
        WorkLock::Tool => MOUNT_LOCK_WAIT,
    };
    let deadline = std::time::Instant::now() + wait;
    let mut said = false;
    loop {
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(fd),
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let holders = lock_holders(fd.as_fd());
                let live = holders.iter().find_map(|h| h.mount.clone());
                if let Some(mnt) = &live {
                    return Err(crate::message!(
                        "{what} '{}' is in use by the mosaicfs daemon serving '{}' ({}): unmount it first",
                        path.display(),
                        mnt.display(),
                        described(&holders)
                    ));
                }
                if std::time::Instant::now() >= deadline {
                    return Err(in_use(what, path, wait, &holders, live.is_some()));
                }
                if !said {
                    let msg = format!(
                        "{what} '{}' is still used by {}; waiting up to {} s for it to let go",
                        path.display(),
                        described(&holders),
                        wait.as_secs()
                    );
                    match how {
                        WorkLock::Wait(_) => log::info!("{msg}"),
                        WorkLock::Tool => eprintln!("mosaicfs: {msg}"),
                    }
                    said = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => {
                return Err(crate::message!(
                    "{what} '{}': cannot lock it: {}",
                    path.display(),
                    std::io::Error::from(e)
                ));
            }
        }
    }
}

/// A process holding a work dir open: its pid, its command line, and the mount point of a
/// live mosaicfs mount (in this mount namespace) among its arguments.
pub(super) struct Holder {
    pid: u32,
    cmdline: String,
    mount: Option<PathBuf>,
}

/// The processes with the locked directory `locked` open: /proc/locks names the process that
/// took a lock, which for a daemon is its parent, gone after the fork, so the descriptors of
/// every process are looked at instead (only on this slow path).
pub(super) fn lock_holders(locked: BorrowedFd<'_>) -> Vec<Holder> {
    use std::os::fd::AsRawFd;
    // Nothing here stats what another process has open or names: a file on a FUSE mount whose
    // daemon is stopped would block the stat. /proc's fdinfo, links and mountinfo are read
    // instead. A file is the same when its inode number, its name and its file system are:
    // two file systems made alike (the images of a test and a scratch mount) give their work
    // dirs the same inode number, and blaming the daemon of the other one made a mount fail
    // at once instead of waiting for the real holder. The file system is the `major:minor`
    // the holder's own mountinfo gives the mount its fdinfo names: mount ids are the same in
    // every namespace, device numbers too.
    let Some(own) = open_file_of(Path::new("/proc/self"), &locked.as_raw_fd().to_string()) else {
        return Vec::new();
    };
    let Ok(name) = std::fs::read_link(format!("/proc/self/fd/{}", locked.as_raw_fd())) else {
        return Vec::new();
    };
    let name = name.file_name().map(OsStr::to_os_string);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let own_dev = mount_device(&mounts, own.mnt_id);
    let mosaicfs_mounts: Vec<PathBuf> = mounts
        .lines()
        .filter(|l| l.contains(" - fuse.mosaicfs "))
        .filter_map(|l| {
            l.split(' ')
                .nth(4)
                .map(|p| PathBuf::from(crate::sys::unescape_mountinfo(p)))
        })
        .collect();
    let own_pid = std::process::id();
    let mut out = Vec::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == own_pid {
            continue;
        }
        let mut their_mounts = None;
        let holds = std::fs::read_dir(p.path().join("fdinfo"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| {
                let fd = fd.file_name();
                let Some(theirs) = open_file_of(&p.path(), &fd.to_string_lossy()) else {
                    return false;
                };
                if theirs.ino != own.ino
                    || !std::fs::read_link(p.path().join("fd").join(&fd))
                        .is_ok_and(|l| l.file_name().map(OsStr::to_os_string) == name)
                {
                    return false;
                }
                let mounts = their_mounts.get_or_insert_with(|| {
                    std::fs::read_to_string(p.path().join("mountinfo")).unwrap_or_default()
                });
                // Unknown on either side (the process went away): the name and inode decide.
                match (&own_dev, mount_device(mounts, theirs.mnt_id)) {
                    (Some(a), Some(b)) => *a == b,
                    _ => true,
                }
            });
        if !holds {
            continue;
        }
        let raw = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
        let cwd = std::fs::read_link(p.path().join("cwd")).unwrap_or_default();
        let mount = args.iter().find_map(|a| {
            let path = lexically_normal(&cwd.join(OsStr::from_bytes(a)));
            mosaicfs_mounts.contains(&path).then_some(path)
        });
        let cmdline = args
            .iter()
            .map(|a| String::from_utf8_lossy(a))
            .collect::<Vec<_>>()
            .join(" ");
        out.push(Holder {
            pid,
            cmdline,
            mount,
        });
    }
    out
}

/// What a process's fdinfo says of one of its open files.
pub(super) struct OpenFile {
    ino: u64,
    mnt_id: u64,
}

/// The open file `fd` of the process whose /proc directory is `proc`, by its fdinfo.
pub(super) fn open_file_of(proc: &Path, fd: &str) -> Option<OpenFile> {
    let text = std::fs::read_to_string(proc.join("fdinfo").join(fd)).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(OpenFile {
        ino: field("ino:")?,
        mnt_id: field("mnt_id:")?,
    })
}

/// The `major:minor` of the file system of mount `mnt_id` in the mountinfo text `mounts`.
pub(super) fn mount_device(mounts: &str, mnt_id: u64) -> Option<String> {
    mounts.lines().find_map(|l| {
        let mut f = l.split(' ');
        (f.next()?.parse::<u64>().ok()? == mnt_id).then(|| f.nth(1).map(str::to_owned))?
    })
}

/// `path` without `.` and `..` components, by its text alone.
pub(super) fn lexically_normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

pub(super) fn described(holders: &[Holder]) -> String {
    if holders.is_empty() {
        return "another process (not visible from here: another PID namespace?)".into();
    }
    holders
        .iter()
        .map(|h| {
            let cmd: String = h.cmdline.chars().take(120).collect();
            format!("PID {} '{cmd}'", h.pid)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn in_use(
    what: &str,
    path: &Path,
    waited: std::time::Duration,
    holders: &[Holder],
    live: bool,
) -> Error {
    let why = if live || holders.is_empty() {
        "a mount of the same upper layer (with this or another workdir), or 'mosaicfs \
         complete', 'fsck' or 'export' on it: \
         unmount that mount or let the command finish, then try again"
    } else {
        "its mount is not in this mount namespace: a daemon whose mount lives on in another \
         namespace ('unshare -m' or a container taken while it was mounted), or one still \
         writing back after its unmount; unmount it in that namespace, or stop that process"
    };
    crate::message!(
        "{what} '{}' is in use by {} after waiting {} s ({why})",
        path.display(),
        described(holders),
        waited.as_secs()
    )
}

/// Creates `workdir/mosaicfs-work` and empties it: whatever is there is left from a crash.
pub(super) fn prepare_work_dir(
    work: BorrowedFd<'_>,
    path: &Path,
    lock: WorkLock,
) -> Result<(Arc<OwnedFd>, OwnedFd)> {
    let name = OsStr::new(WORK_SUBDIR);
    match crate::sys::mkdirat(work, name, rustix::fs::Mode::from_raw_mode(0o700)) {
        Ok(()) => {}
        Err(rustix::io::Errno::EXIST) => {}
        Err(rustix::io::Errno::ROFS)
        | Err(rustix::io::Errno::ACCESS)
        | Err(rustix::io::Errno::PERM) => {
            return Err(crate::message!(
                "workdir '{}' is not writable: mosaicfs needs to create '{WORK_SUBDIR}' in it",
                path.display()
            ));
        }
        Err(e) => {
            return Err(crate::message!(
                "workdir '{}': {}",
                path.display(),
                std::io::Error::from(e)
            ));
        }
    }
    let held = lock_work_dir(work, path, lock)?;
    let fd = sys::open_dir(work, Path::new(WORK_SUBDIR))
        .map_err(|e| crate::message!("workdir '{}': {e}", path.display()))?;
    let fd = Arc::new(fd);
    let dir = UpperDir::Disk(fd.clone());
    let entries = sys::read_dir(work, Path::new(WORK_SUBDIR))
        .map_err(|e| crate::message!("workdir '{}': {e}", path.display()))?;
    for e in entries {
        dir.remove_tree(&e.name).map_err(|err| {
            crate::message!(
                "cannot clean workdir '{0}': {err}; '{0}/{WORK_SUBDIR}/{1}' is left from an \
                 interrupted operation and never visible: remove it by hand (chattr -i if it \
                 is immutable) and mount again",
                path.display(),
                e.name.to_string_lossy()
            )
        })?;
    }
    Ok((fd, held))
}

/// Sets and removes one of mosaicfs' xattrs on the work dir itself: nothing is created (a
/// file costs an inode on the upper file system at every mount).
pub(super) fn probe_xattrs(work: BorrowedFd<'_>, names: &XattrNames) -> Result<()> {
    sys::set_xattr(work, None, &names.origin, b"probe", 0)
        .map_err(|e| Error::with_context(e.errno(), "setxattr"))?;
    let _ = sys::remove_xattr(work, None, &names.origin);
    Ok(())
}
