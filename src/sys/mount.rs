//! Mounts and the daemon process: the layers' detached mount and its access-time mode, which
//! mount a path is on, whether a mount is still in use, detaching the mount point on a
//! signal, descriptors inherited across a restart, and the daemon's privileges.

use super::*;

/// How reads through the mount change the layers' access times (`noatime`, `strictatime`,
/// `nodiratime`): set on a detached copy of each layer's mount (open_tree OPEN_TREE_CLONE,
/// then mount_setattr), from which the layers are opened. Passthrough reads need this: the
/// kernel reads the backing file the daemon opened, on the daemon's mount, whose atime mode
/// decides. `None`: the layers' own mounts as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtimeMode {
    /// One of `MOUNT_ATTR_NOATIME`, `MOUNT_ATTR_STRICTATIME`, `MOUNT_ATTR_RELATIME`.
    pub atime: u64,
    pub nodiratime: bool,
}

pub const MOUNT_ATTR_RELATIME: u64 = 0;
pub const MOUNT_ATTR_NOATIME: u64 = 0x10;
pub const MOUNT_ATTR_STRICTATIME: u64 = 0x20;
const MOUNT_ATTR_ATIME_MASK: u64 = 0x70;
const MOUNT_ATTR_NODIRATIME: u64 = 0x80;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A copy of the mount at `mount_point`, attached nowhere, with `mode`'s atime flags.
pub fn detached_mount(mount_point: &Path, mode: AtimeMode) -> Result<OwnedFd> {
    use rustix::mount::OpenTreeFlags;
    let fd = rustix::mount::open_tree(
        rustix::fs::CWD,
        mount_point,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )?;
    let mut attr = MountAttr {
        attr_set: mode.atime,
        attr_clr: MOUNT_ATTR_ATIME_MASK,
        propagation: 0,
        userns_fd: 0,
    };
    if mode.nodiratime {
        attr.attr_set |= MOUNT_ATTR_NODIRATIME;
    }
    // SAFETY: `fd` is a live descriptor, the path is a NUL-terminated empty string, and the
    // kernel reads `size_of::<MountAttr>()` bytes of `attr`, which has the layout of the
    // kernel's `struct mount_attr` (four u64).
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(fd)
}

/// The device (MAJ:MIN) of what `path` names, as the kernel has it cached: statx with
/// AT_STATX_DONT_SYNC, which a FUSE mount answers from its inode without a request — so a
/// daemon may ask it about its own mount before it serves any.
pub fn device_of(path: &Path) -> Option<String> {
    let sx = rustix::fs::statx(
        CWD,
        path,
        AtFlags::STATX_DONT_SYNC,
        rustix::fs::StatxFlags::TYPE,
    )
    .ok()?;
    Some(format!("{}:{}", sx.stx_dev_major, sx.stx_dev_minor))
}

/// Whether `path` lies on an idmapped mount, asked of the kernel for that one mount (statx
/// `STATX_MNT_ID_UNIQUE`, then statmount, Linux 6.8): the cost does not grow with the number
/// of mounts, as reading /proc/self/mountinfo does on a host with hundreds of overlays.
/// `None` where the kernel cannot answer so (older kernels): the caller reads mountinfo.
pub fn on_idmapped_mount(path: &Path) -> Option<bool> {
    const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
    const STATMOUNT_MNT_BASIC: u64 = 0x2;
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    // The same number on every architecture: statmount came after the tables were unified.
    const SYS_STATMOUNT: libc::c_long = 457;
    /// The kernel's `struct mnt_id_req`, first version.
    #[repr(C)]
    struct MntIdReq {
        size: u32,
        spare: u32,
        mnt_id: u64,
        param: u64,
    }
    let sx = rustix::fs::statx(
        CWD,
        path,
        AtFlags::empty(),
        rustix::fs::StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .ok()?;
    if sx.stx_mask & STATX_MNT_ID_UNIQUE == 0 {
        return None;
    }
    let req = MntIdReq {
        size: std::mem::size_of::<MntIdReq>() as u32,
        spare: 0,
        mnt_id: sx.stx_mnt_id,
        param: STATMOUNT_MNT_BASIC,
    };
    // `struct statmount` as u64 words: `mask` is word 1, `mnt_attr` word 8; the rest of the
    // buffer leaves room for the fields later kernels add.
    let mut sm = [0u64; 64];
    // SAFETY: `req` has the layout of the kernel's `struct mnt_id_req` and the size it
    // states; the kernel writes at most `size_of_val(&sm)` bytes into `sm`.
    let r = unsafe {
        libc::syscall(
            SYS_STATMOUNT,
            &req as *const MntIdReq,
            sm.as_mut_ptr(),
            std::mem::size_of_val(&sm),
            0,
        )
    };
    if r < 0 || sm[1] & STATMOUNT_MNT_BASIC == 0 {
        return None;
    }
    Some(sm[8] & MOUNT_ATTR_IDMAP != 0)
}

/// The mount point of the mount `path` lies on, and `path` relative to it (from
/// /proc/self/mountinfo by the mount id statx gives).
pub fn mount_point_of(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let sx = rustix::fs::statx(
        rustix::fs::CWD,
        path,
        AtFlags::empty(),
        rustix::fs::StatxFlags::MNT_ID,
    )?;
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let point = info
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let point = f.get(4)?;
            (f.first()?.parse::<u64>().ok()? == sx.stx_mnt_id)
                .then(|| PathBuf::from(unescape_mountinfo(point)))
        })
        .ok_or_else(|| errno(libc::ENOENT))?;
    let rel = path.strip_prefix(&point).map_err(|_| errno(libc::EXDEV))?;
    Ok((point.clone(), rel.to_path_buf()))
}

/// Set at mount by `noatime`: every open of a layer's file or directory takes O_NOATIME, so
/// that reads through the mount leave access times alone — passthrough reads too, since the
/// kernel reads the backing file the daemon opened, whose flags decide.
static NOATIME: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_noatime(on: bool) {
    NOATIME.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Runs `open` with O_NOATIME added where `noatime` asks for it, and again without it where
/// the caller may not use it (EPERM: not the file's owner, no CAP_FOWNER).
pub(super) fn without_atime(
    flags: OFlags,
    open: impl Fn(OFlags) -> rustix::io::Result<OwnedFd>,
) -> rustix::io::Result<OwnedFd> {
    if !NOATIME.load(std::sync::atomic::Ordering::Relaxed) || flags.contains(OFlags::PATH) {
        return open(flags);
    }
    match open(flags | OFlags::NOATIME) {
        Err(rustix::io::Errno::PERM) => open(flags),
        r => r,
    }
}

/// The id of the mount `path` is the root of (statx `STATX_MNT_ID`; `/proc/PID/fdinfo`
/// names each open file's mount by it).
pub fn mount_id(path: &Path) -> Result<u64> {
    let st = rustix::fs::statx(
        CWD,
        path,
        AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::MNT_ID,
    )?;
    Ok(st.stx_mnt_id)
}

/// Whether any process holds a file of mount `mnt_id` open (scans `/proc/*/fdinfo`).
pub fn mount_in_use(mnt_id: u64) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return true;
    };
    let want = format!("mnt_id:\t{mnt_id}\n");
    for pid in procs.filter_map(|e| e.ok()) {
        if !pid
            .file_name()
            .as_encoded_bytes()
            .iter()
            .all(u8::is_ascii_digit)
        {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(pid.path().join("fdinfo")) else {
            continue;
        };
        for fd in fds.filter_map(|e| e.ok()) {
            if std::fs::read_to_string(fd.path()).is_ok_and(|info| info.contains(&want)) {
                return true;
            }
        }
    }
    false
}

/// Makes SIGTERM, SIGINT and SIGHUP detach the mount at `mountpoint` (lazy unmount; the FUSE
/// session then ends as on umount). The handler makes two syscalls on a path prepared here, so
/// no thread has to wait for signals: an idle daemon holds one thread less.
///
/// It detaches only the daemon's own mount: what `mountpoint` showed when this was called
/// (device and mount id, taken right after mounting) must still be what the path leads to.
/// Once the mount was lazily unmounted, a file still open on it keeps the daemon serving, and a
/// newer overlay may be mounted at the same path meanwhile: a path alone would detach that one.
pub fn detach_on_signals(mountpoint: &Path) {
    static MOUNTED: std::sync::OnceLock<(CString, Option<MountIdentity>)> =
        std::sync::OnceLock::new();
    let Ok(path) = CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    let identity = MountIdentity::of(&path);
    if identity.is_none() {
        log::warn!(
            "cannot tell which mount {} is: a signal will detach whatever is mounted there",
            mountpoint.display()
        );
    }
    let _ = MOUNTED.set((path, identity));
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: the action is async-signal-safe: it reads a value set before registration
        // (an atomic load, no lock, no allocation) and calls statx and umount2.
        let registered = unsafe {
            signal_hook::low_level::register(sig, || {
                if let Some((path, identity)) = MOUNTED.get()
                    && identity.is_none_or(|id| MountIdentity::of(path) == Some(id))
                {
                    libc::umount2(path.as_ptr(), libc::MNT_DETACH);
                }
            })
        };
        if let Err(e) = registered {
            log::warn!("signal {sig} will not unmount: {e}");
        }
    }
}

/// Which mount a path leads to: its device and, where the kernel tells (Linux 5.8, unique
/// and never reused since 6.8), the mount's id. Asked with statx and no attribute, so a FUSE
/// mount (this daemon's own, or a hung one over it) is sent no request; async-signal-safe.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct MountIdentity {
    dev: (u32, u32),
    /// `STATX_MNT_ID` or `STATX_MNT_ID_UNIQUE`, whichever the kernel answered, and the id.
    mnt: (u32, u64),
}

impl MountIdentity {
    const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

    fn of(path: &CStr) -> Option<MountIdentity> {
        let ids = libc::STATX_MNT_ID | Self::STATX_MNT_ID_UNIQUE;
        // SAFETY: all-zero bytes are a valid `struct statx`.
        let mut sx: libc::statx = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `sx` is a `struct statx` the kernel fills.
        let r = unsafe {
            libc::statx(
                libc::AT_FDCWD,
                path.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT | libc::AT_STATX_DONT_SYNC,
                ids,
                &mut sx,
            )
        };
        (r == 0).then_some(MountIdentity {
            dev: (sx.stx_dev_major, sx.stx_dev_minor),
            mnt: (sx.stx_mask & ids, sx.stx_mnt_id),
        })
    }
}

/// Shuts a socket down both ways: a thread blocked in `accept` on a listening one returns
/// EINVAL.
pub fn shut_down_socket(fd: BorrowedFd<'_>) {
    // SAFETY: shutdown(2) on a descriptor the caller holds open; no memory is passed.
    unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
}

/// Takes ownership of descriptor `n`, which the parent passed to this process (by number on
/// its command line): `None` when no such descriptor is open.
pub fn inherited_fd(n: i32) -> Option<OwnedFd> {
    // SAFETY: F_GETFD reads a descriptor's flags and touches no memory.
    if n < 0 || unsafe { libc::fcntl(n, libc::F_GETFD) } < 0 {
        return None;
    }
    // SAFETY: `n` is open, and the parent handed it over for this process to own; nothing
    // else in the process holds it (it is taken once, at start).
    Some(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(n) })
}

/// Closes every descriptor above stderr but `keep`.
pub fn close_other_fds(keep: &[i32]) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2 && !keep.contains(fd))
        .collect();
    for fd in fds {
        // SAFETY: closing a descriptor this process holds and no Rust object owns (the
        // directory listing's own descriptor is closed already and fails harmlessly).
        unsafe { libc::close(fd) };
    }
}

/// Whether this process has CAP_SYS_ADMIN in the initial user namespace: what the kernel asks
/// of a FUSE daemon that registers a passthrough backing file (fs/fuse/passthrough.c,
/// `fuse_backing_open`). Root of a user namespace (a rootless mount) does not.
pub fn admin_of_initial_namespace() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    let initial = std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]);
    let effective = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        });
    initial && effective.is_some_and(|caps| caps & (1 << CAP_SYS_ADMIN) != 0)
}

/// A mountinfo path field, with its octal escapes (`\040` for a space) undone.
pub fn unescape_mountinfo(field: &str) -> std::ffi::OsString {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    std::ffi::OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path's mount identity names the mount it leads to: the same for the same mount,
    /// different for the mount beside it, none for a path that does not exist.
    #[test]
    fn mount_identity_tells_mounts_apart() {
        let root = MountIdentity::of(c"/").unwrap();
        assert_eq!(MountIdentity::of(c"/"), Some(root));
        let proc = MountIdentity::of(c"/proc").unwrap();
        assert_ne!(proc, root);
        assert_ne!(root.mnt.0, 0, "this kernel (5.8+) names mounts by id");
        assert_eq!(MountIdentity::of(c"/nonexistent/x"), None);
    }
}
