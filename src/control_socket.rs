//! Where a mount's control socket lives, and how a client reaches it (the other half of
//! control.rs, which serves it): one Unix socket per mount at `DIR/MAJ-MIN.sock`, named after
//! the mount's device number so that a client finds it from the mount point alone. `DIR` is
//! `/run/mosaicfs` for root, and for any other user `$XDG_RUNTIME_DIR/mosaicfs`, or
//! `/run/user/UID/mosaicfs`, or `/tmp/mosaicfs-run-UID` where no runtime dir exists.
//!
//! Both the server (control.rs) and the clients (`mosaicfs status`, `sync`, export.rs) use
//! this; it uses neither, so that the server can hand a connection to the exporter and the
//! exporter's client can connect without the two importing each other.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::error::Result;

pub(crate) const ROOT_DIR: &str = "/run/mosaicfs";

pub(crate) fn socket_name(dev: &str) -> String {
    format!("{}.sock", dev.replace(':', "-"))
}

/// Where this user's daemons put their sockets, in the order a daemon tries them.
pub(crate) fn socket_dirs() -> Vec<PathBuf> {
    let uid = rustix::process::geteuid().as_raw();
    let mut dirs = Vec::new();
    if uid == 0 {
        dirs.push(PathBuf::from(ROOT_DIR));
    }
    if let Some(run) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        dirs.push(Path::new(&run).join("mosaicfs"));
    }
    dirs.push(PathBuf::from(format!("/run/user/{uid}/mosaicfs")));
    dirs.push(PathBuf::from(format!("/tmp/mosaicfs-run-{uid}")));
    dirs
}

/// The first of `socket_dirs` this daemon can make its own: created 0700 where missing, and
/// used only when it belongs to this user and no one else may write in it (a directory in
/// /tmp may have been made by someone else first).
pub(crate) fn own_socket_dir() -> Option<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let uid = rustix::process::geteuid().as_raw();
    socket_dirs().into_iter().find(|dir| {
        let parent_ok = dir.parent().is_some_and(|p| p.is_dir());
        if !parent_ok {
            return false;
        }
        let _ = std::fs::DirBuilder::new().mode(0o700).create(dir);
        std::fs::symlink_metadata(dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o022 == 0)
            && rustix::fs::access(dir, rustix::fs::Access::WRITE_OK).is_ok()
    })
}

/// The socket of the mount on device `dev`, wherever its daemon put it: this user's dirs
/// first, then (for root, who may ask about any user's mount) every user's runtime dir.
pub(crate) fn find_socket(dev: &str) -> Option<PathBuf> {
    let name = socket_name(dev);
    let mut dirs = socket_dirs();
    if rustix::process::geteuid().is_root() {
        for e in std::fs::read_dir("/run/user")
            .into_iter()
            .flatten()
            .flatten()
        {
            dirs.push(e.path().join("mosaicfs"));
        }
        for e in std::fs::read_dir("/tmp").into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("mosaicfs-run-") {
                dirs.push(e.path());
            }
        }
    }
    dirs.into_iter().map(|d| d.join(&name)).find(|p| {
        std::fs::symlink_metadata(p)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    })
}

/// The MAJ:MIN of the newest mount at `mountpoint`, from /proc/self/mountinfo (never stat(2):
/// a daemon asking about its own mount before it serves requests would wait for itself).
pub fn mount_device(mountpoint: &Path) -> Option<String> {
    let want = std::fs::canonicalize(mountpoint).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && Path::new(f[4]) == want).then(|| f[2].to_string())
    })
}

/// The file system type of the newest mount at `mountpoint` (e.g. "fuse.mosaicfs").
pub(crate) fn mount_fstype(mountpoint: &Path) -> Option<String> {
    let want = std::fs::canonicalize(mountpoint).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        if f.len() < 5 || Path::new(f[4]) != want {
            return None;
        }
        let sep = f.iter().position(|x| *x == "-")?;
        f.get(sep + 1).map(|t| t.to_string())
    })
}

/// What the daemon of the mount on device `dev` answers to `what`, within 2 s.
pub(crate) fn ask_socket(dev: &str, what: &str) -> Option<String> {
    let path = find_socket(dev)?;
    let mut conn = UnixStream::connect(path).ok()?;
    let limit = Some(std::time::Duration::from_secs(2));
    conn.set_read_timeout(limit).ok()?;
    conn.set_write_timeout(limit).ok()?;
    conn.write_all(format!("{what}\n").as_bytes()).ok()?;
    conn.shutdown(std::net::Shutdown::Write).ok()?;
    let mut out = String::new();
    conn.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Connects to the daemon of the mount at `mountpoint` and asks for `what`.
pub fn connect(mountpoint: &Path, what: &str) -> Result<UnixStream> {
    let dev = mount_device(mountpoint)
        .ok_or_else(|| crate::message!("'{}' is not a mount point", mountpoint.display()))?;
    // A daemon binds its socket just after its mount appears (`serve`): a tool run right after
    // a foreground mount (`-f`) waits for it, up to 2 s, rather than report no daemon.
    let mut path = find_socket(&dev);
    let since = std::time::Instant::now();
    while path.is_none()
        && since.elapsed() < std::time::Duration::from_secs(2)
        && mount_fstype(mountpoint).as_deref() == Some("fuse.mosaicfs")
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
        path = find_socket(&dev);
    }
    let path = path.ok_or_else(|| {
        format!(
            "no mosaicfs daemon answers for '{}' (no {} in {}); is it a mosaicfs mount, and \
             yours (a rootless mount's socket is in its user's runtime dir)?",
            mountpoint.display(),
            socket_name(&dev),
            socket_dirs()
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    // Refused: the socket's daemon has ended, and one that takes the mount over (takeover.rs)
    // binds it again in a moment.
    let mut connected = UnixStream::connect(&path);
    while connected
        .as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        && since.elapsed() < std::time::Duration::from_secs(2)
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
        connected = UnixStream::connect(&path);
    }
    let mut conn = connected.map_err(|e| {
        crate::message!(
            "no mosaicfs daemon answers for '{}' ({}: {e}); is it a mosaicfs mount?",
            mountpoint.display(),
            path.display()
        )
    })?;
    conn.write_all(format!("{what}\n").as_bytes())
        .and_then(|()| conn.shutdown(std::net::Shutdown::Write))
        .map_err(|e| e.to_string())?;
    Ok(conn)
}
