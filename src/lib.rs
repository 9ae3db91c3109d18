//! mosaicfs: a userspace overlay filesystem for container storage with block-level
//! copy-on-write. The overlay core (everything but `fuse` and `daemon`) knows nothing of FUSE.

pub mod acl;
pub mod attr;
pub mod by_number;
pub mod caw;
pub mod complete;
pub mod completion;
pub mod control;
pub mod copy_up;
pub mod creds;
pub mod daemon;
pub mod dir;
pub mod dircache;
pub mod error;
pub mod export;
pub mod fault;
pub mod file;
pub mod fileattr;
pub mod fuse;
#[doc(hidden)]
pub mod fuzzing;
pub mod handles;
pub mod help;
pub mod inode;
pub mod io;
pub mod layers;
pub mod logging;
pub mod lower_wait;
pub mod memory_upper;
pub mod metacopy;
pub mod namei;
pub mod options;
pub mod overlay;
pub mod partial;
pub mod partial_file;
pub mod precontent;
pub mod readdir;
pub mod seq;
pub mod sources;
pub mod stat_override;
pub mod stats;
pub mod sys;
pub mod tar;
pub mod tools;
pub mod upper;
pub mod upper_meta;
