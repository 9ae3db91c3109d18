//! mosaicfs: a userspace overlay filesystem for container storage with block-level
//! copy-on-write. The overlay core (everything but `fuse` and `daemon`) knows nothing of FUSE.

pub mod acl;
pub mod caw;
pub mod complete;
pub mod control;
pub(crate) mod control_socket;
pub mod creds;
pub mod daemon;
pub mod dircache;
pub mod error;
pub mod export;
pub mod fault;
pub mod file;
pub mod fuse;
#[doc(hidden)]
pub mod fuzzing;
pub mod handles;
pub mod help;
pub mod inode;
pub mod layers;
pub mod logging;
pub mod lower_wait;
pub mod memory_upper;
pub mod options;
pub mod overlay;
pub mod partial;
pub mod partial_file;
pub mod precontent;
pub mod seq;
pub mod stat_override;
pub mod stats;
pub mod sys;
pub mod tar;
pub mod tools;
pub mod upper;
