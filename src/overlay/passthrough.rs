//! Whether this mount's files may pass through to the kernel (FUSE passthrough), and why not:
//! the kernel's offer at INIT, the daemon's privilege, `passthrough=off`, a memory upper; and
//! where nothing passes through, whether the kernel caches written data (the writeback cache).
//!
//! May call (dev/callgraph.py --check keeps it so): nothing.

use super::Overlay;

/// Whether this mount may pass files through (FUSE passthrough), or why not: found at INIT
/// (`Overlay::set_passthrough`), and again when the kernel refuses a backing file. Stored as
/// its discriminant in an atomic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub(super) enum PassthroughState {
    Allowed,
    /// A tool's overlay: no FUSE session.
    NoSession,
    Off,
    NoKernel,
    NotAdmin,
    /// `writeback=on`: the kernel's writeback cache, which excludes passthrough.
    Writeback,
}

impl PassthroughState {
    const ALL: [PassthroughState; 6] = [
        PassthroughState::Allowed,
        PassthroughState::NoSession,
        PassthroughState::Off,
        PassthroughState::NoKernel,
        PassthroughState::NotAdmin,
        PassthroughState::Writeback,
    ];

    fn why_not(self) -> Option<&'static str> {
        match self {
            PassthroughState::Allowed => None,
            PassthroughState::NoSession => Some("no FUSE session: a tool, not a mount"),
            PassthroughState::Off => Some("passthrough=off"),
            PassthroughState::NoKernel => {
                Some("the kernel offers no FUSE passthrough (Linux 6.9 or later has it)")
            }
            PassthroughState::NotAdmin => Some(
                "registering a backing file needs CAP_SYS_ADMIN in the initial user namespace: \
                 a rootless mount",
            ),
            PassthroughState::Writeback => {
                Some("writeback=on: the kernel's writeback cache, which excludes passthrough")
            }
        }
    }
}

impl Overlay {
    pub(super) fn passthrough_state(&self) -> PassthroughState {
        PassthroughState::ALL[self
            .passthrough_state
            .load(std::sync::atomic::Ordering::Relaxed)]
    }

    /// Whether this mount may pass files through at all, or why not (its lower files'
    /// read-only opens included).
    pub fn may_pass_through(&self) -> std::result::Result<(), &'static str> {
        self.passthrough_state().why_not().map_or(Ok(()), Err)
    }

    /// Whether FUSE passthrough serves this mount's complete upper files, or why not. What
    /// makes completing a partial file pay (file/complete.rs): where they do not pass through, a
    /// complete file is served by the daemon exactly as a partial one.
    pub fn passthrough_serves(&self) -> std::result::Result<(), &'static str> {
        self.may_pass_through()?;
        match self.layers.memory {
            Some(_) => Err("upper=memory: its files live in the daemon"),
            None => Ok(()),
        }
    }

    /// What INIT found: `kernel_offers` FUSE passthrough, and this daemon may register backing
    /// files (`sys::admin_of_initial_namespace`).
    pub fn set_passthrough(&self, kernel_offers: bool, may_register: bool) {
        let state = if self.config.passthrough == crate::options::PassthroughPolicy::Off {
            PassthroughState::Off
        } else if self.config.writeback == crate::options::Switch::On {
            PassthroughState::Writeback
        } else if !kernel_offers {
            PassthroughState::NoKernel
        } else if !may_register {
            PassthroughState::NotAdmin
        } else {
            PassthroughState::Allowed
        };
        self.passthrough_state
            .store(state as usize, std::sync::atomic::Ordering::Relaxed);
    }

    /// The kernel refused a backing file for want of privilege: nothing passes through.
    pub(crate) fn passthrough_not_permitted(&self) {
        self.passthrough_state.store(
            PassthroughState::NotAdmin as usize,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Whether the kernel caches this mount's written data and sends it later (FUSE's
    /// writeback cache), decided at INIT: where nothing passes through, when `writeback=auto`
    /// or `on` asks for it (`kernel_offers` it: Linux 3.15 and later). docs/PERFORMANCE.md,
    /// "The writeback cache".
    pub fn set_writeback(&self, kernel_offers: bool) -> bool {
        let on = kernel_offers
            && self.config.writeback != crate::options::Switch::Off
            && self.may_pass_through().is_err();
        self.writeback
            .store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    /// Whether the kernel can queue again the requests a daemon that ended left unanswered
    /// (FUSE_NOTIFY_RESEND, offered as FUSE_HAS_RESEND at INIT: Linux 6.9+), which a daemon
    /// taking the mount over needs (takeover.rs).
    pub fn set_kernel_resends(&self, offered: bool) {
        self.resends
            .store(offered, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn kernel_resends(&self) -> bool {
        self.resends.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the kernel's writeback cache is on (`set_writeback`). Then the kernel owns the
    /// size and times of regular files, reads through write-only handles to fill the pages a
    /// write covers in part, and sends each write at the offset it chose, O_APPEND included.
    pub fn writeback_cache(&self) -> bool {
        self.writeback.load(std::sync::atomic::Ordering::Relaxed)
    }
}
