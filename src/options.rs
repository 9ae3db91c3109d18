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
    /// Whether writers of partial files pass through, told of each access by fanotify
    /// pre-content events (`partial_passthrough=auto|on|off`, precontent.rs). Off by default:
    /// a splice into such a file raises no event (docs/KERNEL-NOTES.md), and on a VM slow at
    /// wake-ups an event costs more than a FUSE request (docs/PERFORMANCE.md).
    pub partial_passthrough: Switch,
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
    /// copying it would (`complete_busy=`; complete.rs `busy_threshold`). `Auto`: where
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

/// What the command line asks for.
#[derive(Debug)]
pub enum Command {
    Mount(Box<Options>),
    /// Change the flags of a live mount (read-only or read-write).
    Remount(Box<Options>),
    /// Print the counters of a live mount.
    Status(PathBuf, Format),
    /// `mosaicfs metrics --listen ADDR`: every mount's metrics at one address.
    Metrics(std::net::SocketAddr),
    /// `mosaicfs sync MNT`: write the memory upper's image now.
    Sync(PathBuf),
    /// `mosaicfs complete`: make an unmounted upper layer one any overlay reads (tools.rs).
    Complete(Box<ToolArgs>),
    /// `mosaicfs fsck`: check (and repair) an unmounted upper layer (tools.rs).
    Fsck(Box<ToolArgs>),
    /// `mosaicfs export`: the upper layer as an OCI layer tar (export.rs).
    Export(Box<ExportArgs>),
    /// `--help`, or the help of one command.
    Help(Option<String>),
    Version,
}

pub const USAGE: &str = "\
usage: mosaicfs [-f] [-d] -o lowerdir=LOWER[:LOWER...][,upperdir=UPPER,workdir=WORK][,OPTIONS] MOUNTPOINT
       mosaicfs SOURCE MOUNTPOINT -o lowerdir=...   (mount.fuse form)
       mosaicfs status MOUNTPOINT [--json|--prometheus]  (counters of a live mount)
       mosaicfs metrics --listen ADDR:PORT  (every mount's metrics, one Prometheus target)
       mosaicfs sync MOUNTPOINT  (upper=memory: the layer made durable as it is now)
       mosaicfs complete --lowerdir=L[:L...] --upperdir=U --workdir=W [--redirects=kernel|copy]
                         (offline: partial files made whole, redirects for kernel overlayfs)
       mosaicfs fsck --lowerdir=L[:L...] --upperdir=U [--workdir=W] [--repair]
                         (offline: check the layer's marks, redirects and work dir)
       mosaicfs export [-o FILE] [--gzip|--zstd] [-q] (MOUNTPOINT | --lowerdir=L[:L...] --upperdir=U [--workdir=W])
                         (the upper layer as an OCI layer tar, live or offline)
       mosaicfs --version | --help | help [CMD] | CMD --help

  -f            stay in the foreground
  -d, --debug   foreground, log every request to stderr
  -o OPTIONS    comma-separated mount options (below)

Without upperdir the overlay is read-only.";

/// What `complete` makes of a directory a rename gave a redirect (tools.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirects {
    /// `trusted.overlay.redirect` / `user.overlay.redirect`, which kernel overlayfs follows.
    Kernel,
    /// The lower tree copied into the directory, made opaque: for overlays without
    /// redirects (fuse-overlayfs).
    Copy,
}

/// The arguments of the offline commands: the layers as mount options, and the command's own.
#[derive(Debug)]
pub struct ToolArgs {
    pub opts: Options,
    pub repair: bool,
    pub redirects: Redirects,
}

fn parse_tool(command: &str, args: &[OsString]) -> Result<ToolArgs> {
    let usage = match command {
        "complete" => {
            "usage: mosaicfs complete --lowerdir=L[:L...] --upperdir=U --workdir=W [--redirects=kernel|copy]"
        }
        _ => "usage: mosaicfs fsck --lowerdir=L[:L...] --upperdir=U [--workdir=W] [--repair]",
    };
    let mut t = ToolArgs {
        opts: Options::default(),
        repair: false,
        redirects: Redirects::Kernel,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy();
        match s.as_ref() {
            "--repair" if command == "fsck" => t.repair = true,
            "--redirects=kernel" if command == "complete" => t.redirects = Redirects::Kernel,
            "--redirects=copy" if command == "complete" => t.redirects = Redirects::Copy,
            "-o" => {
                let v = args
                    .next()
                    .ok_or(format!("-o needs an argument\n{usage}"))?;
                for opt in split_options(&v.to_string_lossy()) {
                    t.opts.apply(&opt)?;
                }
            }
            // Any mount option as `--NAME=VALUE`, one value each (commas are not separators).
            a if a.starts_with("--") && a.contains('=') && !a.starts_with("--redirects=") => {
                t.opts.apply(&a[2..])?
            }
            a => return Err(crate::message!("unknown argument '{a}'\n{usage}")),
        }
    }
    if t.opts.lowerdirs.is_empty() {
        return Err(crate::message!(
            "no lower layers given: pass --lowerdir=DIR[:DIR...] as the layer is mounted\n{usage}"
        ));
    }
    if t.opts.upperdir.is_none() {
        return Err(crate::message!(
            "no upper layer given: pass --upperdir=DIR\n{usage}"
        ));
    }
    if t.opts.workdir.is_none() && (command == "complete" || t.repair) {
        return Err(crate::message!(
            "--workdir=DIR is needed: the work dir the layer is mounted with (scratch space on \
             the upper file system)\n{usage}"
        ));
    }
    Ok(t)
}

/// Where `mosaicfs export` reads the layer.
#[derive(Debug)]
pub enum ExportFrom {
    /// A live mount, through its daemon.
    Mount(PathBuf),
    /// Unmounted layers, as mount options (lowerdir, upperdir, optional workdir).
    Dirs(Box<Options>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

#[derive(Debug)]
pub struct ExportArgs {
    pub from: ExportFrom,
    /// The archive's file; standard output without it.
    pub output: Option<PathBuf>,
    pub compression: Compression,
    /// No progress bar and no summary.
    pub quiet: bool,
}

const EXPORT_USAGE: &str = "usage: mosaicfs export [-o FILE] [--gzip|--zstd] [-q] \
     (MOUNTPOINT | --lowerdir=L[:L...] --upperdir=U [--workdir=W])";

fn parse_export(args: &[OsString]) -> Result<ExportArgs> {
    let mut opts = Options::default();
    let mut mnt = None;
    let mut output = None;
    let mut compression = None;
    let mut quiet = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy();
        let mut compress = |c| match compression.replace(c) {
            Some(old) if old != c => Err(crate::message!("choose one compression\n{EXPORT_USAGE}")),
            _ => Ok(()),
        };
        match s.as_ref() {
            "-o" | "--output" => {
                let v = args
                    .next()
                    .ok_or(format!("{s} needs a file name\n{EXPORT_USAGE}"))?;
                output = Some(PathBuf::from(v));
            }
            a if a.starts_with("--output=") => output = Some(PathBuf::from(&a[9..])),
            "--gzip" | "-z" | "--compress=gzip" => compress(Compression::Gzip)?,
            "--zstd" | "--compress=zstd" => compress(Compression::Zstd)?,
            "--compress=none" => compress(Compression::None)?,
            "-q" | "--quiet" => quiet = true,
            a if a.starts_with("--") && a.contains('=') => opts.apply(&a[2..])?,
            a if a.starts_with('-') => {
                return Err(crate::message!("unknown argument '{a}'\n{EXPORT_USAGE}"));
            }
            _ if mnt.is_none() => mnt = Some(PathBuf::from(arg)),
            a => return Err(crate::message!("unexpected argument '{a}'\n{EXPORT_USAGE}")),
        }
    }
    let from = match (mnt, opts.lowerdirs.is_empty(), opts.upperdir.is_some()) {
        (Some(m), true, false) => ExportFrom::Mount(m),
        (None, false, true) => ExportFrom::Dirs(Box::new(opts)),
        (Some(_), _, _) => {
            return Err(crate::message!(
                "give a mount point or the layers' dirs, not both\n{EXPORT_USAGE}"
            ));
        }
        (None, true, _) => {
            return Err(crate::message!(
                "nothing to export: name a live mount, or the dirs of an unmounted layer with \
                 --lowerdir=L --upperdir=U\n{EXPORT_USAGE}"
            ));
        }
        (None, false, false) => {
            return Err(crate::message!(
                "no upper layer given: pass --upperdir=DIR (the layer to export)\n{EXPORT_USAGE}"
            ));
        }
    };
    // Compression follows the file name when not given; a name that asks for one mosaicfs does
    // not write is an error, not an uncompressed file under that name.
    let by_name = match output.as_ref().map(|p| p.to_string_lossy().into_owned()) {
        Some(n) if n.ends_with(".gz") || n.ends_with(".tgz") => Some(Compression::Gzip),
        Some(n) if n.ends_with(".zst") || n.ends_with(".tzst") => Some(Compression::Zstd),
        Some(n) if compression.is_none() => {
            let other = [".xz", ".txz", ".bz2", ".tbz2", ".lz4", ".lzma", ".Z"];
            if let Some(ext) = other.iter().find(|e| n.ends_with(*e)) {
                return Err(crate::message!(
                    "'{n}' names {ext} compression, which export does not write: use .gz or .zst, \
                     or --compress=none for a plain tar under that name\n{EXPORT_USAGE}"
                ));
            }
            None
        }
        _ => None,
    };
    Ok(ExportArgs {
        from,
        output,
        compression: compression.or(by_name).unwrap_or(Compression::None),
        quiet,
    })
}

/// Splits an option string at commas that are neither quoted nor escaped, keeping escapes in
/// place for the value parser.
fn split_options(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                cur.push(c);
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter().filter(|o| !o.is_empty()).collect()
}

/// Removes quotes and escapes from a value; with `split_colon`, unescaped colons separate items.
fn unescape(value: &str, split_colon: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            '"' => quoted = !quoted,
            ':' if split_colon && !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn parse_bool(name: &str, value: Option<&str>) -> Result<bool> {
    match value.map(|v| v.to_ascii_lowercase()) {
        None => Ok(true),
        Some(v) => match v.as_str() {
            "1" | "on" | "yes" | "true" | "y" => Ok(true),
            "0" | "off" | "no" | "false" | "n" => Ok(false),
            _ => Err(crate::message!(
                "option '{name}' takes 0/1 or on/off, not '{v}'"
            )),
        },
    }
}

fn parse_num<T: std::str::FromStr>(name: &str, value: Option<&str>) -> Result<T> {
    let v = value.ok_or_else(|| crate::message!("option '{name}' needs a value: {name}=N"))?;
    v.parse::<T>()
        .map_err(|_| crate::message!("option '{name}' takes a number, not '{v}'"))
}

/// A size in bytes, with an optional K, M or G suffix (powers of 1024).
fn parse_size(name: &str, value: Option<&str>) -> Result<u64> {
    let v =
        value.ok_or_else(|| crate::message!("option '{name}' needs a size: {name}=N[K|M|G]"))?;
    let (digits, shift) = match v.as_bytes().last().map(u8::to_ascii_uppercase) {
        Some(b'K') => (&v[..v.len() - 1], 10),
        Some(b'M') => (&v[..v.len() - 1], 20),
        Some(b'G') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| {
            crate::message!("option '{name}' takes a size such as 4096, 512K or 1M, not '{v}'")
        })
}

impl Options {
    fn apply(&mut self, opt: &str) -> Result<()> {
        let (name, value) = match opt.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (opt, None),
        };
        let need = |v: Option<&str>| -> Result<String> {
            let v =
                v.ok_or_else(|| crate::message!("option '{name}' needs a value: {name}=..."))?;
            Ok(unescape(v, false).concat())
        };
        match name {
            "lowerdir" => {
                let v = value.ok_or("option 'lowerdir' needs a value: lowerdir=DIR[:DIR...]")?;
                let parts = unescape(v, true);
                // `::` (an empty part) starts the data-only layers, as in kernel overlayfs.
                let split = parts.iter().position(|p| p.is_empty()).unwrap_or(parts.len());
                let dirs = |ps: &[String]| -> Vec<PathBuf> {
                    ps.iter().filter(|p| !p.is_empty()).map(PathBuf::from).collect()
                };
                self.lowerdirs = dirs(&parts[..split]);
                self.datadirs = dirs(&parts[split..]);
                if self.lowerdirs.is_empty() {
                    return Err(match self.datadirs.is_empty() {
                        true => "option 'lowerdir' names no directory".into(),
                        false => "option 'lowerdir' names only data-only layers (after '::'): \
                                  at least one regular lower layer must come first"
                            .into(),
                    });
                }
            }
            "metacopy" => self.metacopy = Some(parse_bool(name, value)?),
            "verity" => {
                self.verity = match value {
                    Some("off") => Verity::Off,
                    Some("on") => Verity::On,
                    Some("require") => Verity::Require,
                    _ => return Err("option 'verity' takes off, on or require".into()),
                }
            }
            "upperdir" => self.upperdir = Some(PathBuf::from(need(value)?)),
            "workdir" => self.workdir = Some(PathBuf::from(need(value)?)),
            "uidmapping" => self.uid_map = IdMap::parse(&need(value)?).map_err(|e| crate::message!("uidmapping: {e}"))?,
            "gidmapping" => self.gid_map = IdMap::parse(&need(value)?).map_err(|e| crate::message!("gidmapping: {e}"))?,
            "squash_to_root" => {
                self.squash_uid = Some(0);
                self.squash_gid = Some(0);
            }
            "squash_to_uid" => self.squash_uid = Some(parse_num(name, value)?),
            "squash_to_gid" => self.squash_gid = Some(parse_num(name, value)?),
            "static_nlink" => self.static_nlink = parse_bool(name, value)?,
            "noacl" => self.acl = !parse_bool(name, value)?,
            "acl" => self.acl = parse_bool(name, value)?,
            "noxattrs" => {
                self.xattrs = !parse_bool(name, value)?;
                if !self.xattrs {
                    self.acl = false;
                }
            }
            "timeout" | "entry_timeout" | "attr_timeout" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err(crate::message!("option '{name}' must be between 0 and one year"));
                }
                self.timeout = Duration::from_secs_f64(secs);
                self.timeout_given = true;
            }
            "threaded" => {
                if !parse_bool(name, value)? {
                    self.threads = 1;
                }
            }
            "fsync" => self.skip_fsync = !parse_bool(name, value)?,
            "reflink" => self.reflink = parse_bool(name, value)?,
            "partial_passthrough" => self.partial_passthrough = Switch::parse(name, value)?,
            "volatile" => self.skip_fsync = true,
            "max_write" => self.max_write = Some(parse_num(name, value)?),
            "fsname" => self.fsname = need(value)?,
            "remount" => self.remount = true,
            "copy_after_write" => {
                self.caw_always = value == Some("always");
                let on = self.caw_always
                    || parse_bool(name, value).map_err(|_| {
                        crate::message!(
                            "option 'copy_after_write' takes 1 (defer blocks the lower layer must \
                             read from disk), always (defer every block) or 0, not '{}'",
                            value.unwrap_or_default()
                        )
                    })?;
                if on {
                    self.caw_memory.get_or_insert(64 << 20);
                } else {
                    self.caw_memory = None;
                }
            }
            "caw_memory" => {
                // A size like every other (64M, 1G); a bare number is MiB, as it always was.
                let bare = value.is_some_and(|v| v.bytes().all(|b| b.is_ascii_digit()));
                let bytes = if bare {
                    parse_num::<u64>(name, value)?.checked_mul(1 << 20).ok_or_else(|| {
                        format!("option '{name}' is too large")
                    })?
                } else {
                    parse_size(name, value)?
                };
                self.caw_memory = Some(bytes as usize);
            }
            "read_ahead_kb" => self.read_ahead_kb = parse_num(name, value)?,
            "lower_cache" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err(crate::message!("option '{name}' must be between 0 and one year"));
                }
                self.lower_cache = Some(Duration::from_secs_f64(secs));
            }
            "lower_timeout" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0).contains(&secs) {
                    return Err("option 'lower_timeout' takes seconds between 0 (no timeout) and one day".into());
                }
                self.lower_timeout = (secs > 0.0).then(|| Duration::from_secs_f64(secs));
            }
            "metrics" => {
                let v = need(value)?;
                self.metrics = Some(v.parse().map_err(|_| {
                    crate::message!(
                        "option 'metrics' takes an address and port such as 127.0.0.1:9101, not '{v}'"
                    )
                })?);
            }
            "log_file" => self.log_file = Some(PathBuf::from(need(value)?)),
            "caw_workers" => {
                let n: usize = parse_num(name, value)?;
                if n > 64 {
                    return Err("option 'caw_workers' takes 0 to 64 threads".into());
                }
                self.caw_workers = n;
            }
            "complete_after" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err("option 'complete_after' takes seconds between 0 (never) and one year".into());
                }
                self.completion.after_idle = (secs > 0.0).then(|| Duration::from_secs_f64(secs));
            }
            "copy_whole" => self.completion.at_open_below = Some(parse_size(name, value)?),
            "complete_busy" => self.completion.busy = Switch::parse(name, value)?,
            "complete_on_reopen" => self.completion.on_reopen_below = parse_size(name, value)?,
            "complete_ratio" => {
                let pct: f64 = parse_num(name, value)?;
                if !(0.0..=100.0).contains(&pct) {
                    return Err("option 'complete_ratio' takes a percentage from 0 (never) to 100".into());
                }
                self.completion.ratio = pct / 100.0;
            }
            "uring" => {
                self.uring = Uring::parse(value).map_err(|e| crate::message!("option 'uring' {e}"))?;
            }
            "upper" => {
                self.upper_kind = match need(value)?.as_str() {
                    "disk" => UpperKind::Disk,
                    "memory" => UpperKind::Memory,
                    v => return Err(crate::message!("option 'upper' takes disk or memory, not '{v}'")),
                }
            }
            "filestore" => self.filestore = Some(FilestorePlace::parse(&need(value)?)?),
            "size" => {
                let bytes = parse_size(name, value)?;
                if bytes < 1 << 20 {
                    return Err("option 'size' takes at least 1M (a size such as 512M or 4G)".into());
                }
                self.size_limit = Some(bytes);
            }
            "passthrough" => {
                use self::PassthroughPolicy as P;
                self.passthrough = match value.map(|v| v.to_ascii_lowercase()).as_deref() {
                    None | Some("upper") | Some("1") | Some("on") => P::Upper,
                    Some("all") => P::All,
                    Some("off") | Some("0") => P::Off,
                    Some(v) => return Err(crate::message!("option 'passthrough' takes upper, all or off, not '{v}'")),
                };
            }
            "ro" => self.read_only = true,
            "rw" => self.read_only = false,
            "allow_other" | "allow_root" => self.allow_other = true,
            "default_permissions" => self.default_permissions = true,
            "suid" => self.suid = true,
            "nosuid" => self.suid = false,
            "dev" => self.dev = true,
            "nodev" => self.dev = false,
            "exec" => self.exec = true,
            "noexec" => self.exec = false,
            "noatime" => (self.noatime, self.strictatime) = (true, false),
            "strictatime" => (self.noatime, self.strictatime) = (false, true),
            "atime" | "relatime" => (self.noatime, self.strictatime) = (false, false),
            "nodiratime" => self.nodiratime = true,
            "diratime" => self.nodiratime = false,
            "lazytime" => {}
            "sync" => self.sync = true,
            "async" => self.sync = false,
            "dirsync" => self.dirsync = true,
            "debug" => {
                self.debug = true;
                self.foreground = true;
            }
            // Inode numbers are always stable and unique (see inode.rs), whatever is asked.
            "redirect_dir" => {
                self.redirect_dir = match value {
                    Some("on") => RedirectDir::On,
                    Some("follow") | Some("off") => RedirectDir::Follow,
                    Some("nofollow") => RedirectDir::NoFollow,
                    _ => {
                        return Err(
                            "option 'redirect_dir' takes on, follow, off or nofollow".into()
                        );
                    }
                }
            }
            "xino" | "fast_ino" | "index" | "userxattr" => {}
            // The kernel's own FUSE mount options, which mount(8) repeats on a remount.
            "user_id" | "group_id" | "rootmode" | "fd" => {}
            // Options that only mount(8) or fstab read.
            "defaults" | "auto" | "noauto" | "user" | "users" | "nouser" | "nofail" | "_netdev" | "owner" => {}
            _ if name.starts_with("x-") || name.starts_with("comment=") => {}
            // Options of libfuse's high-level API that have no meaning for a low-level daemon.
            "use_ino" | "readdir_ino" | "hard_remove" | "big_writes" | "kernel_cache" | "auto_cache"
            | "nonempty" | "max_read" | "negative_timeout" | "subtype" | "blkdev" | "blksize"
            | "clone_fd" | "max_idle_threads" | "max_threads" | "splice_read" | "splice_write"
            | "splice_move" | "no_splice_read" | "no_splice_write" | "no_splice_move" => {}
            "context" | "fscontext" | "defcontext" | "rootcontext" => {
                need(value)?;
                self.warn(format!(
                    "option '{name}' is accepted but SELinux labels are not applied by mosaicfs; it is ignored"
                ));
            }
            "ino32_t" => self.warn("option 'ino32_t' is ignored: inode numbers are 64-bit".into()),
            "writeback" => self.warn(
                "option 'writeback' is ignored: mosaicfs does not use the FUSE writeback cache".into(),
            ),
            "plugins" => {
                self.warn("option 'plugins' is ignored: mosaicfs has no layer plugins".into())
            }
            "xattr_permissions" => {
                self.xattr_permissions =
                    crate::stat_override::XattrPermissions::parse(&need(value)?)?
            }
            "auto_unmount" => self.warn(
                "option 'auto_unmount' is ignored: unmount with 'umount MNT' or 'fusermount3 -u MNT'".into(),
            ),
            _ => {
                return Err(crate::message!(
                    "unknown mount option '{opt}': see 'mosaicfs --help' and the README option table"
                ));
            }
        }
        Ok(())
    }

    fn warn(&mut self, w: String) {
        if !self.warnings.contains(&w) {
            self.warnings.push(w);
        }
    }
}

fn parse_listen(addr: &std::ffi::OsStr) -> Result<Command> {
    let a = addr.to_string_lossy();
    a.parse().map(Command::Metrics).map_err(|_| {
        crate::message!(
            "metrics --listen takes an address and port such as 127.0.0.1:9100, not '{a}'"
        )
    })
}

/// Parses the whole command line (without argv[0]).
pub fn parse_args<I: IntoIterator<Item = OsString>>(args: I) -> Result<Command> {
    let args: Vec<OsString> = args.into_iter().collect();
    let first = args.first().and_then(|a| a.to_str());
    if first == Some("help") {
        return match args.get(1).and_then(|a| a.to_str()) {
            None => Ok(Command::Help(None)),
            Some(cmd) if crate::help::command_help(cmd).is_some() => {
                Ok(Command::Help(Some(cmd.to_string())))
            }
            Some(other) => Err(crate::message!(
                "no help for '{other}': 'mosaicfs help' shows the mount options, and \
                 'mosaicfs help CMD' a command: {}",
                crate::help::COMMANDS.map(|(c, _)| c).join(", ")
            )),
        };
    }
    // `mosaicfs CMD --help` (a mount needs `-o`, so a subcommand word comes first).
    if let Some(cmd) = first
        && crate::help::command_help(cmd).is_some()
        && args[1..].iter().any(|a| a == "--help" || a == "-h")
    {
        return Ok(Command::Help(Some(cmd.to_string())));
    }
    if first == Some("metrics") {
        return match args.get(1..).unwrap_or_default() {
            [flag, addr] if flag == "--listen" => parse_listen(addr),
            [one] if one.to_str().is_some_and(|a| a.starts_with("--listen=")) => parse_listen(
                std::ffi::OsStr::new(&one.to_str().unwrap_or_default()["--listen=".len()..]),
            ),
            _ => Err(crate::help::COMMANDS[5].1.into()),
        };
    }
    if args.first().is_some_and(|a| a == "status") {
        return match args.get(1..) {
            Some([mnt]) => Ok(Command::Status(PathBuf::from(mnt), Format::Text)),
            Some([mnt, f]) | Some([f, mnt]) if f == "--json" || f == "--prometheus" => {
                let format = if f == "--json" {
                    Format::Json
                } else {
                    Format::Prometheus
                };
                Ok(Command::Status(PathBuf::from(mnt), format))
            }
            _ => Err("usage: mosaicfs status MOUNTPOINT [--json | --prometheus]".into()),
        };
    }
    match args.first().and_then(|a| a.to_str()) {
        // Two words only: `mosaicfs sync MNT -o ...` is the mount.fuse form with source "sync".
        Some("sync") if args.len() == 2 => return Ok(Command::Sync(PathBuf::from(&args[1]))),
        Some("complete") => {
            return Ok(Command::Complete(Box::new(parse_tool(
                "complete",
                &args[1..],
            )?)));
        }
        Some("fsck") => return Ok(Command::Fsck(Box::new(parse_tool("fsck", &args[1..])?))),
        Some("export") => return Ok(Command::Export(Box::new(parse_export(&args[1..])?))),
        _ => {}
    }
    let mut opts = Options {
        uring: Uring::from_env()?,
        ..Options::default()
    };
    let mut positional: Vec<OsString> = Vec::new();
    let mut option_strings: Vec<String> = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy().into_owned();
        match s.as_str() {
            "-h" | "--help" => return Ok(Command::Help(None)),
            "-V" | "--version" => return Ok(Command::Version),
            "-f" => opts.foreground = true,
            "-d" | "--debug" => {
                opts.debug = true;
                opts.foreground = true;
            }
            "-s" => {} // single-threaded libfuse flag: accepted, the daemon decides its threads
            "-o" => {
                let v = args
                    .next()
                    .ok_or("-o needs an argument: -o lowerdir=...,upperdir=...,workdir=...")?;
                option_strings.push(v.to_string_lossy().into_owned());
            }
            _ if s.starts_with("-o") => option_strings.push(s[2..].to_string()),
            _ if s.starts_with('-') && s.len() > 1 => {
                return Err(crate::message!(
                    "unknown argument '{s}': see 'mosaicfs --help'"
                ));
            }
            _ => positional.push(arg),
        }
    }
    for o in &option_strings {
        for opt in split_options(o) {
            opts.apply(&opt)?;
        }
    }
    match positional.len() {
        1 => opts.mountpoint = PathBuf::from(&positional[0]),
        2 => {
            opts.fsname = positional[0].to_string_lossy().into_owned();
            opts.mountpoint = PathBuf::from(&positional[1]);
        }
        0 => return Err(("no mount point given\n".to_string() + USAGE).into()),
        _ => {
            return Err(crate::message!(
                "too many arguments: {positional:?}\n{USAGE}"
            ));
        }
    }
    if opts.remount {
        return Ok(Command::Remount(Box::new(opts)));
    }
    if option_strings.is_empty()
        && let Some(word) = positional.first().and_then(|w| w.to_str())
        && !word.contains('/')
    {
        // A mount always has -o; a bare first word was meant as a command.
        return Err(not_a_command(word).into());
    }
    if opts.lowerdirs.is_empty() {
        return Err("no lowerdir given: pass -o lowerdir=DIR[:DIR...]".into());
    }
    if opts.upperdir.is_some() != opts.workdir.is_some() {
        return Err(
            "upperdir and workdir go together: give both, or neither for a read-only overlay"
                .into(),
        );
    }
    if opts.upperdir.is_none() {
        opts.read_only = true;
    }
    check_memory_upper(&opts)?;
    opts.check_metacopy()?;
    Ok(Command::Mount(Box::new(opts)))
}

/// What `mosaicfs WORD ...` says when WORD is no command: the commands, and the nearest one.
fn not_a_command(word: &str) -> String {
    let commands: Vec<&str> = crate::help::COMMANDS.iter().map(|(c, _)| *c).collect();
    let near = commands
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .min()
        .filter(|(d, _)| *d <= 2)
        .map_or(String::new(), |(_, c)| format!(" (did you mean '{c}'?)"));
    format!(
        "'{word}' is not a mosaicfs command{near}. Commands: {}, help.\n\
         To mount: mosaicfs -o lowerdir=DIR[:DIR...],upperdir=DIR,workdir=DIR MOUNTPOINT \
         (mosaicfs --help)",
        commands.join(", ")
    )
}

/// Levenshtein distance between two short words.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = here;
        }
    }
    row[b.len()]
}

/// The options of a memory upper (`upper=memory`) that must go with it, or not with it.
fn check_memory_upper(opts: &Options) -> Result<()> {
    if opts.upper_kind == UpperKind::Disk {
        return match (&opts.filestore, opts.size_limit) {
            (Some(_), _) => {
                Err("option 'filestore' is for a memory upper: add upper=memory".into())
            }
            (_, Some(_)) => Err("option 'size' is for a memory upper: add upper=memory".into()),
            _ => Ok(()),
        };
    }
    if opts.upperdir.is_none() {
        // No upper layer at all (a read-only mount of image layers: containers/storage passes
        // storage.conf's mountopt to those too): nothing for the option to change.
        return Ok(());
    }
    if opts.read_only {
        return Err(
            "upper=memory cannot be mounted read-only: its daemon writes the layer's image at \
             unmount; mount it read-write (nothing changes unless written)"
                .into(),
        );
    }
    if opts.xattr_permissions.key().is_some() {
        return Err(
            "xattr_permissions= is for a disk upper whose daemon may not chown; a memory upper \
             keeps owners and modes itself: drop xattr_permissions"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Options, String> {
        match parse_args(args.iter().map(OsString::from)).map_err(|e| e.to_string())? {
            Command::Mount(o) => Ok(*o),
            c => panic!("unexpected {c:?}"),
        }
    }

    #[test]
    fn fuse_overlayfs_form_parses() {
        let o = parse(&["-o", "lowerdir=/a:/b,upperdir=/u,workdir=/w", "/mnt"]).unwrap();
        assert_eq!(o.lowerdirs, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(o.upperdir, Some("/u".into()));
        assert_eq!(o.mountpoint, PathBuf::from("/mnt"));
        assert!(!o.read_only);
    }

    #[test]
    fn copy_after_write_is_on_off_or_always() {
        let o = |v: &str| parse(&["-o", &format!("lowerdir=/a,{v}"), "/mnt"]);
        let d = o("ro").unwrap();
        assert_eq!((d.caw_memory, d.caw_always), (Some(64 << 20), false));
        let a = o("copy_after_write=always").unwrap();
        assert_eq!((a.caw_memory, a.caw_always), (Some(64 << 20), true));
        let off = o("copy_after_write=0").unwrap();
        assert_eq!((off.caw_memory, off.caw_always), (None, false));
        let bad = o("copy_after_write=sometimes").unwrap_err();
        assert!(bad.contains("always") && bad.contains("sometimes"), "{bad}");
        // One size syntax: caw_memory takes 64M like copy_whole=4M; a bare number is MiB.
        for (v, bytes) in [
            ("64M", 64 << 20),
            ("1G", 1 << 30),
            ("512K", 512 << 10),
            ("32", 32 << 20),
        ] {
            let m = o(&format!("caw_memory={v}")).unwrap();
            assert_eq!(m.caw_memory, Some(bytes), "caw_memory={v}");
        }
        assert!(o("caw_memory=lots").is_err());
    }

    #[test]
    fn mount_fuse_form_takes_source_first() {
        let o = parse(&["overlay", "/mnt", "-o", "lowerdir=/a"]).unwrap();
        assert_eq!(o.fsname, "overlay");
        assert!(o.read_only, "no upperdir means read-only");
    }

    #[test]
    fn quoted_values_keep_commas() {
        let o = parse(&[
            "-o",
            "lowerdir=/a,context=\"system_u:object_r:x:s0:c1,c2\"",
            "/m",
        ])
        .unwrap();
        assert_eq!(o.warnings.len(), 1);
        assert_eq!(o.lowerdirs, vec![PathBuf::from("/a")]);
    }

    #[test]
    fn a_double_colon_starts_the_data_only_layers() {
        let o = parse(&["-o", "lowerdir=/a:/b::/d1::/d2", "/m"]).unwrap();
        assert_eq!(o.lowerdirs, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(o.datadirs, vec![PathBuf::from("/d1"), PathBuf::from("/d2")]);
        assert!(o.follows_metacopy(), "data-only layers imply metacopy");
        let e = parse(&["-o", "lowerdir=/a::/d,metacopy=off", "/m"]).unwrap_err();
        assert!(e.contains("need metacopy"), "{e}");
        let e = parse(&["-o", "lowerdir=::/d", "/m"]).unwrap_err();
        assert!(e.contains("only data-only layers"), "{e}");
        let o = parse(&["-o", "lowerdir=/a,verity=require", "/m"]).unwrap();
        assert_eq!(o.verity, Verity::Require);
        assert!(parse(&["-o", "lowerdir=/a,verity=maybe", "/m"]).is_err());
        assert!(
            !parse(&["-o", "lowerdir=/a", "/m"])
                .unwrap()
                .follows_metacopy()
        );
    }

    #[test]
    fn escaped_colon_stays_in_lower_path() {
        let o = parse(&["-o", r"lowerdir=/a\:b:/c", "/m"]).unwrap();
        assert_eq!(
            o.lowerdirs,
            vec![PathBuf::from("/a:b"), PathBuf::from("/c")]
        );
    }

    #[test]
    fn a_misspelled_command_is_named_with_the_commands() {
        let e = parse(&["statsu", "/mnt/x"]).unwrap_err();
        assert!(
            e.contains("'statsu' is not a mosaicfs command (did you mean 'status'?)")
                && e.contains("fsck"),
            "{e}"
        );
        let e = parse(&["frobnicate"]).unwrap_err();
        assert!(e.contains("not a mosaicfs command. Commands:"), "{e}");
        // mount.fuse's form, source then mount point then -o, is still a mount.
        assert!(parse(&["overlay", "/mnt", "-o", "lowerdir=/a"]).is_ok());
    }

    #[test]
    fn completion_pays_by_default_and_the_old_rules_are_choices() {
        let d = parse(&["-o", "lowerdir=/a", "/m"]).unwrap().completion;
        assert_eq!((d.after_idle, d.ratio, d.on_reopen_below), (None, 0.0, 0));
        assert_eq!((d.copy_whole(true), d.copy_whole(false)), (1 << 20, 0));
        assert!(d.when_busy(true) && !d.when_busy(false));
        let o = parse(&[
            "-o",
            "lowerdir=/a,complete_after=10,complete_busy=on,copy_whole=4M",
            "/m",
        ])
        .unwrap()
        .completion;
        assert_eq!(o.after_idle, Some(Duration::from_secs(10)));
        assert!(o.when_busy(false));
        assert_eq!(o.copy_whole(false), 4 << 20);
        let e = parse(&["-o", "lowerdir=/a,complete_busy=sometimes", "/m"]).unwrap_err();
        assert!(
            e.contains("complete_busy") && e.contains("auto, on or off"),
            "{e}"
        );
    }

    #[test]
    fn unknown_option_is_an_error_naming_it() {
        let e = parse(&["-o", "lowerdir=/a,frobnicate", "/m"]).unwrap_err();
        assert!(e.contains("frobnicate"), "{e}");
    }

    #[test]
    fn upper_without_work_is_an_error() {
        assert!(parse(&["-o", "lowerdir=/a,upperdir=/u", "/m"]).is_err());
    }

    #[test]
    fn every_fuse_overlayfs_option_is_accepted() {
        let all = "lowerdir=/a,upperdir=/u,workdir=/w,uidmapping=0:100000:65536,gidmapping=0:100000:65536,\
            squash_to_root,squash_to_uid=1,squash_to_gid=1,static_nlink,noacl,xino=auto,ino32_t,\
            redirect_dir=on,context=\"x\",timeout=5,threaded=1,fsync=0,volatile,fast_ino=1,writeback=1,\
            noxattrs=0,plugins=/p,xattr_permissions=1,allow_other,default_permissions,ro,max_write=131072,\
            nosuid,nodev,noexec,noatime";
        let o = parse(&["-o", all, "/m"]).unwrap();
        assert_eq!(o.uid_map.to_inside(5), 100005, "disk id 5 shows as 100005");
        assert_eq!(o.uid_map.to_outside(100005), 5);
        assert_eq!(
            o.uid_map.to_inside(70000),
            65534,
            "unmapped ids show as the overflow id"
        );
        assert!(o.skip_fsync && o.read_only && !o.acl);
        assert_eq!(
            o.xattr_permissions,
            crate::stat_override::XattrPermissions::Privileged
        );
        let e = parse(&["-o", "lowerdir=/a,xattr_permissions=3", "/m"]).unwrap_err();
        assert!(e.contains("xattr_permissions=3 is not valid"), "{e}");
    }

    #[test]
    fn containers_storage_mapping_syntax_parses() {
        let o = parse(&[
            "-o",
            "lowerdir=/a,,volatile,uidmapping=:0:100000:65536,gidmapping=:0:100000:65536",
            "/m",
        ])
        .unwrap();
        assert_eq!(o.uid_map.to_inside(0), 100000);
        assert_eq!(o.gid_map.to_outside(100001), 1);
        assert!(o.skip_fsync);
    }

    #[test]
    fn remount_needs_no_layers() {
        match parse_args(["-o", "remount,ro", "/m"].iter().map(OsString::from)).unwrap() {
            Command::Remount(o) => assert!(o.read_only),
            c => panic!("unexpected {c:?}"),
        }
    }

    #[test]
    fn bad_numbers_are_named() {
        let e = parse(&["-o", "lowerdir=/a,timeout=soon", "/m"]).unwrap_err();
        assert!(e.contains("timeout") && e.contains("soon"), "{e}");
        let e = parse(&["-o", "lowerdir=/a,uidmapping=0:1", "/m"]).unwrap_err();
        assert!(e.contains("uidmapping"), "{e}");
    }
}
