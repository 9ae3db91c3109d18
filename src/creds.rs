//! Per-thread credentials and umask of the FUSE worker threads (paper 001: a cached credential
//! instead of override/revert on every operation).
//!
//! Each worker thread gets its own file-system context (`unshare(CLONE_FS)`) the first time it
//! serves a request. It caches the umask and the fs uid/gid it last set, and switches only when
//! a caller's differ from the previous caller's — no syscall per request in the common case,
//! and no lock shared between threads. New objects are then born owned by the caller (and take
//! a setgid directory's group from the file system itself), with no chown afterwards.
//!
//! Changing the fsuid away from 0 drops the file-system capabilities from the thread's
//! effective set; they are raised again at once, because the daemon acts on the kernel's
//! permission checks (default_permissions) and must still reach every layer file.

use std::cell::Cell;

thread_local! {
    /// The umask this thread runs with, or `None` before its context was made private.
    static UMASK: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Sets this thread's umask to `mask`, switching only when it differs.
pub fn set_thread_umask(mask: u32) {
    UMASK.with(|cur| {
        if cur.get().is_none()
            && let Err(e) = crate::sys::unshare_fs_context()
        {
            log::warn!(
                "cannot give this thread its own umask ({e}); creation modes may be masked twice"
            );
        }
        if cur.get() != Some(mask) {
            crate::sys::set_umask(mask & 0o777);
            cur.set(Some(mask));
        }
    });
}

thread_local! {
    /// The (fsuid, fsgid) this thread runs as, once switched.
    static FS_IDS: Cell<Option<(u32, u32)>> = const { Cell::new(None) };
}

/// Makes this thread create files as `uid`/`gid`. Returns false if the switch is not possible
/// here (then the caller gives new objects their owner with chown).
pub fn act_as(uid: u32, gid: u32) -> bool {
    FS_IDS.with(|cur| {
        if cur.get() == Some((uid, gid)) {
            return true;
        }
        let ok = crate::sys::set_fs_ids(uid, gid);
        cur.set(if ok { Some((uid, gid)) } else { None });
        ok
    })
}

/// The daemon's own effective uid and gid, asked once: they never change while it runs, and
/// every object it makes for its own bookkeeping (a copy-up's temporary file, a whiteout)
/// needs them.
pub fn daemon_ids() -> (u32, u32) {
    static DAEMON: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *DAEMON.get_or_init(|| {
        (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        )
    })
}

/// Makes this thread create files as the daemon itself again. Whiteouts, opaque markers and
/// objects in the work directory belong to the layer's bookkeeping, not to a caller: without
/// this they would be owned by whoever this thread last created a file for (kernel overlayfs
/// makes them with the mounter's credentials). Like `act_as`, it switches only when needed.
pub fn act_as_daemon() {
    let (uid, gid) = daemon_ids();
    if FS_IDS.with(|cur| cur.get().is_some_and(|ids| ids != (uid, gid))) {
        act_as(uid, gid);
    }
}
