//! A layer's root: opened once, through a mount without access-time updates where it can,
//! with its file system checked and its ownership-override key found.

use super::*;

/// A lower layer's root (`what` names it in messages): its canonical path, an `O_PATH`
/// handle and its `stat`, refused on a file system no layer can be on.
pub(super) fn open_lower_root(dir: &Path, what: &str) -> Result<(PathBuf, OwnedFd, Attr)> {
    let path = canonical(dir, what)?;
    let (fd, attr) = open_layer_root(&path, what)?;
    if let Some(fs) = unsupported_fs(fd.as_fd()) {
        return Err(crate::message!(
            "{what} '{}' is on {fs}, which cannot be a layer",
            path.display()
        ));
    }
    Ok((path, fd, attr))
}

pub(super) fn open_layer_root(path: &Path, what: &str) -> Result<(OwnedFd, Attr)> {
    let fd = rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| {
        let e = std::io::Error::from(e);
        match e.raw_os_error() {
            Some(libc::ENOENT) => format!(
                "{what} '{}' does not exist: create it or fix the path",
                path.display()
            ),
            Some(libc::ENOTDIR) => format!("{what} '{}' is not a directory", path.display()),
            _ => format!("{what} '{}' cannot be opened: {e}", path.display()),
        }
    })?;
    let fd = through_atime_mount(path).unwrap_or(fd);
    let attr =
        sys::fstat(fd.as_fd()).map_err(|e| crate::message!("{what} '{}': {e}", path.display()))?;
    Ok((fd, attr))
}

/// The atime mode the mount asked for (`noatime`, `strictatime`, `nodiratime`), set once before
/// its layers are opened: they are then opened through detached copies of their mounts that
/// carry it (sys/mount.rs `AtimeMode`).
pub static ATIME_MODE: std::sync::OnceLock<sys::AtimeMode> = std::sync::OnceLock::new();

/// Detached copies of the layers' mounts, by mount point, while a stack is being opened: the
/// upper and work dirs must come through the same one (a rename between two mounts fails).
/// Emptied when the stack is open: the layers' descriptors keep the copies alive.
pub(super) static ATIME_MOUNTS: std::sync::Mutex<Vec<(PathBuf, OwnedFd)>> =
    std::sync::Mutex::new(Vec::new());

/// `path` opened through a copy of its mount with the mount's atime mode, or `None` (no mode
/// asked for, or the daemon may not copy mounts: rootless; said once).
pub(super) fn through_atime_mount(path: &Path) -> Option<OwnedFd> {
    let mode = *ATIME_MODE.get()?;
    let opened = (|| -> Result<OwnedFd> {
        let (point, rel) = sys::mount_point_of(path)?;
        let mut mounts = ATIME_MOUNTS.lock().unwrap_or_else(|e| e.into_inner());
        if !mounts.iter().any(|(p, _)| *p == point) {
            let fd = sys::detached_mount(&point, mode)?;
            mounts.push((point.clone(), fd));
        }
        let (_, root) = mounts
            .iter()
            .find(|(p, _)| *p == point)
            .expect("just added");
        sys::open_beneath(root.as_fd(), &rel, OFlags::PATH | OFlags::DIRECTORY, 0)
    })();
    match opened {
        Ok(fd) => Some(fd),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                log::warn!(
                    "the layers' mounts cannot be copied with the atime option asked for ({e}): \
                     reads served by passthrough update access times as the layers' own mounts \
                     say"
                )
            });
            None
        }
    }
}

/// The owner-and-mode xattr a layer's root carries, if any (stat_override.rs).
pub(super) fn override_key_of(root: BorrowedFd<'_>) -> Option<&'static str> {
    stat_override::KEYS
        .into_iter()
        .find(|k| sys::get_xattr_raw(root, None, OsStr::new(k)).is_ok())
}

/// Gives the upper root the key `xattr_permissions=` writes, so that the layer is read the
/// same way by later mounts and when stacked below another.
pub(super) fn mark_override_root(
    root: BorrowedFd<'_>,
    attr: &Attr,
    key: &str,
    path: &Path,
) -> Result<()> {
    if override_key_of(root) == Some(key) {
        return Ok(());
    }
    let value = stat_override::OverrideStat::of(attr).encode(libc::S_IFDIR);
    sys::set_xattr(root, None, key, value.as_bytes(), 0).map_err(|e| {
        crate::message!(
            "upperdir '{}': cannot set {key} ({e}), which xattr_permissions= keeps owners and \
             modes in: xattr_permissions=1 needs a privileged daemon; use xattr_permissions=2",
            path.display()
        )
    })
}

/// The file systems a layer may not sit on, with the reason.
pub(super) fn unsupported_fs(fd: BorrowedFd<'_>) -> Option<&'static str> {
    let st = rustix::fs::fstatfs(fd).ok()?;
    const PROC: i64 = 0x9fa0;
    const SYSFS: i64 = 0x6265_6572;
    match st.f_type as i64 {
        PROC => Some("procfs"),
        SYSFS => Some("sysfs"),
        _ => None,
    }
}
