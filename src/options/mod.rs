//! The command line and `-o` mount options, compatible with fuse-overlayfs.
//!
//! Both forms work: `mosaicfs -o lowerdir=..,upperdir=..,workdir=.. MNT` and the mount.fuse form
//! `mosaicfs SOURCE MNT -o ...`. Option values may be double-quoted (`context="a,b"`), a backslash
//! escapes the next character (`\,` in any value, `\:` in a lower path). Every option
//! fuse-overlayfs accepts is accepted: it works, or one warning says it is ignored. An unknown
//! option is an error, as it is for fuse-overlayfs.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::Result;

mod command;
mod mount_options;
#[cfg(test)]
mod tests;

pub use command::*;
use mount_options::{check_memory_upper, split_options};

/// One range of an id mapping: `inside..inside+len` in the merged view is
/// `outside..outside+len` on disk. Written `OUTSIDE:INSIDE:LEN` in the option, the order of
/// fuse-overlayfs (containers/storage passes `uidmapping=0:100000:65536` to show an image's
/// unshifted ids 0.. as 100000.. to a user-namespaced container).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    pub inside: u32,
    pub outside: u32,
    pub len: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdMap(pub Vec<IdRange>);

impl IdMap {
    /// Disk id to the id shown in the merged view. Unmapped ids show as the overflow id.
    pub fn to_inside(&self, outside: u32) -> u32 {
        if self.0.is_empty() {
            return outside;
        }
        for r in &self.0 {
            if outside >= r.outside && outside - r.outside < r.len {
                return r.inside + (outside - r.outside);
            }
        }
        65534
    }

    /// Merged-view id to the id stored on disk.
    pub fn to_outside(&self, inside: u32) -> u32 {
        if self.0.is_empty() {
            return inside;
        }
        for r in &self.0 {
            if inside >= r.inside && inside - r.inside < r.len {
                return r.outside + (inside - r.inside);
            }
        }
        65534
    }

    fn parse(value: &str) -> Result<IdMap> {
        // Empty fields are skipped, as fuse-overlayfs' strtok does: containers/storage writes
        // "uidmapping=:0:100000:65536".
        let nums: std::result::Result<Vec<u32>, _> = value
            .split(':')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse::<u32>())
            .collect();
        let nums = nums.map_err(|_| crate::message!("'{value}' is not a list of numbers"))?;
        if nums.is_empty() || nums.len() % 3 != 0 {
            return Err(crate::message!(
                "'{value}' must be triples DISK:MOUNT:LENGTH separated by ':'"
            ));
        }
        Ok(IdMap(
            nums.chunks(3)
                .map(|c| IdRange {
                    outside: c[0],
                    inside: c[1],
                    len: c[2],
                })
                .collect(),
        ))
    }
}

/// `verity=`: how the fs-verity digests of metadata-only files are checked (metacopy.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verity {
    Off,
    /// A digest, where a metadata-only file has one, must match its data file's.
    On,
    /// Every metadata-only file must have a digest, and it must match.
    Require,
}

/// `redirect_dir=`, as kernel overlayfs takes it: whether the rename of a directory that has
/// lower parts records where they are (a redirect xattr, docs/FORMAT.md) and succeeds, or
/// fails with EXDEV (`mv` then copies the tree, as on fuse-overlayfs, which only has that);
/// and whether redirects already in the layers are followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RedirectDir {
    /// Made and followed (the default).
    #[default]
    On,
    /// Followed, not made (`follow`, and `off`: the kernel's default `redirect_always_follow`).
    Follow,
    /// Neither made nor followed: a renamed directory shows its upper part only.
    NoFollow,
}

impl RedirectDir {
    pub fn creates(self) -> bool {
        self == RedirectDir::On
    }

    pub fn follows(self) -> bool {
        self != RedirectDir::NoFollow
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub lowerdirs: Vec<PathBuf>,
    /// Data-only lower layers (`lowerdir=A:B::DATA1::DATA2`): they serve the data of
    /// metadata-only files and never show in the merged view (metacopy.rs).
    pub datadirs: Vec<PathBuf>,
    /// `metacopy=`: follow kernel overlayfs' metadata-only lower files (`None`: not given).
    pub metacopy: Option<bool>,
    /// `verity=off|on|require` (metacopy.rs).
    pub verity: Verity,
    /// `redirect_dir=on|follow|off|nofollow`.
    pub redirect_dir: RedirectDir,
    pub upperdir: Option<PathBuf>,
    pub workdir: Option<PathBuf>,
    pub mountpoint: PathBuf,
    /// The SOURCE of the mount.fuse form, shown as the mount's source in /proc/mounts.
    pub fsname: String,
    pub foreground: bool,
    pub debug: bool,
    pub read_only: bool,
    pub allow_other: bool,
    pub default_permissions: bool,
    pub suid: bool,
    pub dev: bool,
    pub exec: bool,
    pub noatime: bool,
    /// `strictatime`: every read updates the access time (applied to the layers' mounts).
    pub strictatime: bool,
    /// `nodiratime`: listing a directory leaves its access time alone.
    pub nodiratime: bool,
    pub sync: bool,
    pub dirsync: bool,
    pub acl: bool,
    pub xattrs: bool,
    /// `volatile` or `fsync=0`: fsync requests are not passed to the disk.
    pub skip_fsync: bool,
    pub static_nlink: bool,
    /// `xattr_permissions=`: owners and modes kept in an xattr (stat_override.rs).
    pub xattr_permissions: crate::stat_override::XattrPermissions,
    pub squash_uid: Option<u32>,
    pub squash_gid: Option<u32>,
    pub uid_map: IdMap,
    pub gid_map: IdMap,
    pub timeout: Duration,
    pub threads: usize,
    pub max_write: Option<u32>,
    /// FUSE passthrough: `upper` for complete upper files, `all` (default) also for read-only
    /// opens of lower files, `off`.
    pub passthrough: PassthroughPolicy,
    /// Copy-after-write memory bound in bytes; `None` turns it off.
    pub caw_memory: Option<usize>,
    pub caw_workers: usize,
    /// Copy-after-write also for blocks whose lower data is in the page cache
    /// (`copy_after_write=always`); by default those are filled at once.
    pub caw_always: bool,
    /// Readahead of the mount's FUSE bdi in KiB (`read_ahead_kb=`; 0 keeps the kernel's 128).
    pub read_ahead_kb: u32,
    /// Where the daemon serves Prometheus metrics over HTTP (`metrics=ADDR:PORT`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Where a daemon in the background logs (`log_file=PATH`); else the system log.
    pub log_file: Option<PathBuf>,
    /// How long a request may wait on a lower layer before it is answered EIO
    /// (`lower_timeout=S`; lower_wait.rs). None: as long as the layer's store takes.
    pub lower_timeout: Option<Duration>,
    /// How long the kernel may cache entries and attributes of objects that live only in lower
    /// layers (`lower_cache=S`); None: 60 s, or `timeout=` when that was given.
    pub lower_cache: Option<Duration>,
    /// Whether `timeout=` (or `entry_timeout=`, `attr_timeout=`) was given.
    pub timeout_given: bool,
    /// When partial files are completed in the background.
    pub completion: CompletionPolicy,
    /// Copy up a regular file by cloning its extents (FICLONE) where the upper file system
    /// can take them from the lower one: a complete upper file in O(1), opened for writing
    /// with passthrough. `reflink=0` keeps partial files everywhere.
    pub reflink: bool,
    /// Whether writers of partial files pass through, told of each access by fanotify pre-content
    /// events (`partial_passthrough=auto|on|off`, file/partial/precontent.rs). Off by default: a
    /// splice into such a file raises no event (docs/KERNEL-NOTES.md), and on a VM slow at wake-ups
    /// an event costs more than a FUSE request (docs/PERFORMANCE.md).
    pub partial_passthrough: Switch,
    /// The kernel's writeback cache for file data (`writeback=auto|on|off`; fuse.rs `init`):
    /// `auto` where nothing passes through (rootless, no passthrough in the kernel,
    /// `passthrough=off`), `on` also instead of passthrough, which it excludes; `off` (default:
    /// it costs every close of a written file and every unlink and rename a round trip more,
    /// docs/PERFORMANCE.md "The writeback cache").
    pub writeback: Switch,
    /// Whether the mount survives its daemon (`restart=auto|on|off`, takeover.rs): a holder
    /// process keeps the FUSE connection and starts a new daemon on it when the serving one
    /// ends. `auto` (default) where it can be done: in the background, over /dev/fuse, on a
    /// disk upper, without pre-content events; `on` refuses a mount where
    /// it cannot; `off` never.
    pub restart: Switch,
    /// Whether requests come over io_uring (`uring=on|auto|off`; daemon.rs `use_uring`).
    pub uring: Uring,
    /// Where the writable layer lives (`upper=disk|memory`).
    pub upper_kind: UpperKind,
    /// Where a memory upper keeps file data (`filestore=self|memory|PATH`); `None`: not given.
    pub filestore: Option<FilestorePlace>,
    /// The most a memory upper's file data may take, in bytes (`size=`).
    pub size_limit: Option<u64>,
    /// `-o remount,...` as mount(8) passes it for `mount -o remount,ro MNT`.
    pub remount: bool,
    pub warnings: Vec<String>,
}

impl Options {
    /// Whether metadata-only lower files are followed: asked for, or implied by data-only
    /// layers or `verity=` (as kernel overlayfs implies it). A contradiction is refused.
    pub fn follows_metacopy(&self) -> bool {
        self.metacopy
            .unwrap_or(!self.datadirs.is_empty() || self.verity != Verity::Off)
    }

    fn check_metacopy(&self) -> Result<()> {
        if self.metacopy == Some(false) && !self.datadirs.is_empty() {
            return Err(
                "data-only lower layers (after '::' in lowerdir) need metacopy: \
                        remove metacopy=off"
                    .into(),
            );
        }
        if self.metacopy == Some(false) && self.verity != Verity::Off {
            return Err("verity=on|require checks metadata-only files: remove metacopy=off".into());
        }
        if self.follows_metacopy() && !self.redirect_dir.follows() {
            return Err(
                "metadata-only files are found through redirects, which redirect_dir=nofollow \
                 turns off: use redirect_dir=follow (or off), or remove metacopy, verity and \
                 data-only layers"
                    .into(),
            );
        }
        Ok(())
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            lowerdirs: Vec::new(),
            datadirs: Vec::new(),
            metacopy: None,
            verity: Verity::Off,
            redirect_dir: RedirectDir::On,
            upperdir: None,
            workdir: None,
            mountpoint: PathBuf::new(),
            fsname: "mosaicfs".into(),
            foreground: false,
            debug: false,
            read_only: false,
            allow_other: true,
            default_permissions: true,
            suid: true,
            dev: true,
            exec: true,
            noatime: false,
            strictatime: false,
            nodiratime: false,
            sync: false,
            dirsync: false,
            acl: true,
            xattrs: true,
            skip_fsync: false,
            static_nlink: false,
            xattr_permissions: Default::default(),
            squash_uid: None,
            squash_gid: None,
            uid_map: IdMap::default(),
            gid_map: IdMap::default(),
            timeout: Duration::from_secs(60),
            threads: default_threads(),
            max_write: None,
            passthrough: PassthroughPolicy::All,
            completion: Default::default(),
            reflink: true,
            partial_passthrough: Switch::Off,
            writeback: Switch::Off,
            restart: Switch::Auto,
            read_ahead_kb: 4096,
            metrics: None,
            log_file: None,
            lower_timeout: None,
            lower_cache: None,
            timeout_given: false,
            caw_memory: Some(64 << 20),
            caw_workers: 2,
            caw_always: false,
            uring: Uring::Auto,
            upper_kind: UpperKind::Disk,
            filestore: None,
            size_limit: None,
            remount: false,
            warnings: Vec::new(),
        }
    }
}

/// Which files pass through (mount option `passthrough=`).
/// A feature that is used where it works (`Auto`), required (`On`: the mount fails without
/// it) or not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    Auto,
    On,
    Off,
}

impl Switch {
    /// The value of option `name`: auto, on (also 1, or no value) or off (also 0).
    fn parse(name: &str, value: Option<&str>) -> Result<Switch> {
        match value.map(|v| v.to_ascii_lowercase()).as_deref() {
            Some("auto") => Ok(Switch::Auto),
            None | Some("on") | Some("1") => Ok(Switch::On),
            Some("off") | Some("0") => Ok(Switch::Off),
            Some(v) => Err(crate::message!(
                "option '{name}' takes auto, on or off, not '{v}'"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassthroughPolicy {
    Off,
    /// Complete upper files.
    Upper,
    /// Complete upper files and read-only opens of lower files (the default).
    All,
}

/// Default `copy_whole=` where passthrough serves complete files: below this a whole copy at
/// open costs about what the first write to a partial file costs, and every later read and
/// write of the file skips the daemon (docs/PERFORMANCE.md, "Whole copies of small files").
/// Where nothing passes through, the copy would buy nothing and is not made by default.
pub const DEFAULT_COPY_WHOLE: u64 = 1 << 20;

/// When partial files are made complete. By default only where it pays (docs/PERFORMANCE.md,
/// "When completion pays"): a file in sustained use through the daemon, on a mount whose
/// complete files passthrough serves (`busy`), and small files opened for writing there
/// (`at_open_below`). Elsewhere a partial file stays partial, its upper holding the blocks
/// written and the mark. The other rules are explicit choices, off by default.
#[derive(Debug, Clone, Copy)]
pub struct CompletionPolicy {
    /// Complete a partial file idle this long; `None`: never for idleness (`complete_after=`).
    pub after_idle: Option<Duration>,
    /// Complete a partial file once this share (0..=1) of its blocks is present; 0: never
    /// (`complete_ratio=`).
    pub ratio: f64,
    /// A file with at most this many bytes to copy is made complete when it is opened for
    /// writing, so that the open is served by passthrough; 0: never (`copy_whole=`). `None`:
    /// `DEFAULT_COPY_WHOLE` where passthrough serves complete files, else 0.
    pub at_open_below: Option<u64>,
    /// A partial file that has been written (it holds blocks of its own) or opened for writing
    /// before, and is opened read-write again, is due for completion in the background at
    /// once unless this is 0 (`complete_on_reopen=`). No open waits for a copy.
    pub on_reopen_below: u64,
    /// Complete a file whose requests through the daemon in one run of use have cost more than
    /// copying it would (`complete_busy=`; file/complete.rs `busy_threshold`). `Auto`: where
    /// passthrough serves complete files.
    pub busy: Switch,
}

impl Default for CompletionPolicy {
    fn default() -> Self {
        CompletionPolicy {
            after_idle: None,
            ratio: 0.0,
            at_open_below: None,
            on_reopen_below: 0,
            busy: Switch::Auto,
        }
    }
}

impl CompletionPolicy {
    /// `copy_whole=` as it applies on a mount where passthrough does (`native`) or does not
    /// serve complete files.
    pub fn copy_whole(&self, native: bool) -> u64 {
        self.at_open_below
            .unwrap_or(if native { DEFAULT_COPY_WHOLE } else { 0 })
    }

    /// Whether the sustained-use rule is on, on such a mount.
    pub fn when_busy(&self, native: bool) -> bool {
        match self.busy {
            Switch::On => true,
            Switch::Auto => native,
            Switch::Off => false,
        }
    }
}

/// How a status report is written (`mosaicfs status --json`, `--prometheus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
    /// The Prometheus text exposition format (version 0.0.4).
    Prometheus,
}

/// The FUSE transport asked for with `uring=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uring {
    /// /dev/fuse only.
    Off,
    /// io_uring when the kernel has it on, /dev/fuse otherwise (the default).
    Auto,
    /// io_uring, or no mount.
    On,
}

impl Uring {
    /// The value of `uring=` or of `MOSAICFS_URING` (no value: `on`).
    fn parse(value: Option<&str>) -> Result<Uring> {
        match value.map(|v| v.to_ascii_lowercase()).as_deref() {
            None | Some("on") | Some("1") => Ok(Uring::On),
            Some("auto") => Ok(Uring::Auto),
            Some("off") | Some("0") => Ok(Uring::Off),
            Some(v) => Err(crate::message!("takes on, auto or off, not '{v}'")),
        }
    }

    /// The default: `MOSAICFS_URING=on|auto|off` in the environment (so that every mount of a
    /// container engine, or of a test run, can be switched at once), else `auto`: the kernel's
    /// parameter, which only root can set, is the switch (io_uring was faster on every row of
    /// bench/uring.py, README).
    fn from_env() -> Result<Uring> {
        match std::env::var("MOSAICFS_URING") {
            Ok(v) if !v.is_empty() => Uring::parse(Some(&v)).map_err(|e| {
                crate::message!("MOSAICFS_URING {e}: set it to one of those or unset it")
            }),
            _ => Ok(Uring::Auto),
        }
    }
}

/// Where the writable layer lives (`upper=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpperKind {
    /// Objects in the upper dir, as kernel overlayfs keeps them (the default).
    #[default]
    Disk,
    /// The tree held by the daemon, file data in one filestore, an image in the upper dir
    /// at unmount (src/memory_upper/, docs/FORMAT.md).
    Memory,
}

/// Where a memory upper keeps its file data (`filestore=`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FilestorePlace {
    /// `.mosaicfs-filestore` in the upper dir (`filestore=self`, the default), so that `du`
    /// of the upper dir counts the layer's data.
    #[default]
    InUpper,
    /// A file elsewhere (`filestore=PATH`), made if missing.
    File(PathBuf),
    /// Anonymous memory (`filestore=memory`): the layer lives as long as the daemon.
    Anonymous,
}

impl FilestorePlace {
    fn parse(value: &str) -> Result<FilestorePlace> {
        match value {
            "self" => Ok(FilestorePlace::InUpper),
            "memory" => Ok(FilestorePlace::Anonymous),
            p if p.starts_with('/') => Ok(FilestorePlace::File(PathBuf::from(p))),
            v => Err(crate::message!(
                "option 'filestore' takes self, memory or an absolute path, not '{v}'"
            )),
        }
    }
}

fn default_threads() -> usize {
    // The CPUs this process may run on (one syscall; `available_parallelism` also reads the
    // cgroup's CPU quota files, a dozen syscalls at every mount).
    let cpus = rustix::thread::sched_getaffinity(None).map_or(2, |set| set.count() as usize);
    (cpus * 2).clamp(2, 16)
}
