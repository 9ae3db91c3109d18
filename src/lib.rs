//! mosaicfs: a userspace overlay filesystem for container storage with block-level
//! copy-on-write. The overlay core (everything but `fuse` and `daemon`) knows nothing of FUSE.

pub(crate) mod acl;
pub mod control;
pub(crate) mod control_socket;
pub(crate) mod creds;
pub mod daemon;
pub(crate) mod dircache;
pub mod error;
pub(crate) mod export;
pub mod fault;
pub(crate) mod file;
pub(crate) mod fuse;
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod handles;
pub(crate) mod help;
pub mod inode;
pub mod layers;
pub(crate) mod logging;
pub(crate) mod lower_wait;
pub(crate) mod memory_upper;
pub mod options;
pub mod overlay;
pub(crate) mod resend;
pub(crate) mod seq;
pub(crate) mod stat_override;
pub(crate) mod stats;
pub(crate) mod sys;
pub(crate) mod takeover;
pub(crate) mod tar;
pub(crate) mod tools;
pub mod upper;
