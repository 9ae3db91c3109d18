//! Per-thread credentials and umask of the FUSE worker threads.
//!
//! Each worker thread gets its own file-system context (`unshare(CLONE_FS)`) the first time it
//! serves a request, and caches the umask it last set, so the umask is switched only when the
//! caller's differs from the previous caller's — no syscall per request in the common case, and
//! no lock shared between threads. The daemon stays root; new objects are given to the caller
//! with chown right after they are made (see dir.rs).

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
