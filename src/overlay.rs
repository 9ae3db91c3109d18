//! The overlay core: one mounted overlay, independent of FUSE.
//!
//! The operations live in files by concern under overlay/, like kernel overlayfs: `namei.rs`
//! (lookup), `readdir.rs` (merged listing), `dir.rs` (create, unlink, rename), `attr.rs`
//! (attributes and xattrs), `io.rs` (data), `copy_up.rs`. This file holds what they share.
//! They are its submodules so that the overlay's state stays private to them: the rest of the
//! crate sees the methods below marked `pub` and the requests (docs/ARCHITECTURE.md).
//!
//! May call (dev/callgraph.py --check keeps it so): by_number, passthrough.

// The request files: each holds one concern's `impl Overlay` block and sees the overlay's
// private state; everything outside `overlay` goes through the methods they make public.
mod attr;
mod by_number;
mod completion;
mod copy_up;
mod dir;
mod fileattr;
mod io;
mod metacopy;
mod namei;
mod passthrough;
mod readdir;
mod sources;
mod upper_meta;

pub use attr::SetAttr;
pub(crate) use by_number::memory_orphan_name;
pub(crate) use metacopy::parse_metacopy;
pub use namei::Redirect;
pub(crate) use namei::origin_number;

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, errno};
use crate::file::partial::mark::{self, SparseSupport};
use crate::handles::{DirHandleTable, HandleTable};
use crate::inode::{Ino, InoMap, InodeTable, LowerRef, Node, ROOT_INO};
use crate::layers::{LayerId, LayerStack, UPPER};
use crate::options::{IdMap, Options};
use crate::seq::ChangeSeq;
use crate::stats::Stats;
use crate::sys::{self, Attr};
use crate::upper::{LayerDir, UpperDir, UpperFile};
use passthrough::PassthroughState;

/// Who asks: the caller's credentials and umask, from the FUSE request.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub umask: u32,
}

impl Caller {
    pub fn root() -> Self {
        Caller {
            uid: 0,
            gid: 0,
            pid: 0,
            umask: 0o022,
        }
    }
}

/// The mount options the core needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub read_only: bool,
    /// Follow kernel overlayfs' metadata-only lower files (metacopy.rs).
    pub metacopy: bool,
    pub verity: crate::options::Verity,
    pub xattrs: bool,
    pub acl: bool,
    pub skip_fsync: bool,
    pub static_nlink: bool,
    pub squash_uid: Option<u32>,
    pub squash_gid: Option<u32>,
    pub uid_map: IdMap,
    pub gid_map: IdMap,
    pub timeout: Duration,
    /// The cache time of objects only lower layers hold (`lower_cache=`): layers do not change.
    pub lower_cache: Duration,
    pub completion: crate::options::CompletionPolicy,
    /// Bytes of pending blocks allowed for copy-after-write; `None`: copy-after-write off.
    pub caw_memory: Option<usize>,
    /// Threads that fill pending blocks (0: only when something needs them).
    pub caw_workers: usize,
    /// Defer blocks whose lower data is in the page cache too (`copy_after_write=always`).
    pub caw_always: bool,
    /// The memfd of pending blocks an earlier daemon of this mount left (file/partial/arena.rs,
    /// kept by the holder): written by `replay_pending`, then used by this daemon.
    pub pending_arena: Option<Arc<OwnedFd>>,
    /// The pre-content group and table an earlier daemon of this mount left (kept by the
    /// holder, file/partial/served.rs).
    pub precontent_kept: Option<Arc<(OwnedFd, OwnedFd)>>,
    /// The mount may outlive this daemon: what it is in the middle of is kept where the next
    /// one finds it (pre-content events).
    pub survives: bool,
    /// Which files FUSE passthrough serves (see file/mod.rs, IoMode).
    pub passthrough: crate::options::PassthroughPolicy,
    pub reflink: bool,
    pub partial_passthrough: crate::options::Switch,
    /// `writeback=`: the kernel's writeback cache where nothing passes through (fuse.rs `init`).
    pub writeback: crate::options::Switch,
    /// `xattr_permissions=`: how xattr names of the merged view are stored (stat_override.rs).
    pub xattr_permissions: crate::stat_override::XattrPermissions,
    /// A directory with lower parts may be renamed (a redirect records where they are);
    /// `redirect_dir=off|follow|nofollow`: EXDEV instead.
    pub redirect_create: bool,
}

impl Config {
    pub fn from_options(o: &Options) -> Self {
        Config {
            read_only: o.read_only,
            xattrs: o.xattrs,
            acl: o.acl,
            skip_fsync: o.skip_fsync,
            static_nlink: o.static_nlink,
            squash_uid: o.squash_uid,
            squash_gid: o.squash_gid,
            uid_map: o.uid_map.clone(),
            gid_map: o.gid_map.clone(),
            timeout: o.timeout,
            lower_cache: o.lower_cache.unwrap_or(if o.timeout_given {
                o.timeout
            } else {
                LOWER_CACHE
            }),
            xattr_permissions: o.xattr_permissions,
            redirect_create: o.redirect_dir.creates(),
            passthrough: o.passthrough,
            completion: o.completion,
            caw_memory: o.caw_memory,
            caw_workers: o.caw_workers,
            caw_always: o.caw_always,
            pending_arena: None,
            precontent_kept: None,
            survives: false,
            reflink: o.reflink,
            partial_passthrough: o.partial_passthrough,
            writeback: o.writeback,
            metacopy: o.follows_metacopy(),
            verity: o.verity,
        }
    }
}

/// How long the kernel caches entries and attributes of lower-only objects by default.
/// Lower layers do not change under a mount (as for kernel overlayfs, which caches them for as
/// long as it likes), and every change made through the mount reaches the kernel's caches
/// anyway: a lookup served from the cache needs no daemon and no lower store — which matters
/// when that store is slow or has stopped answering (issue #16).
pub const LOWER_CACHE: Duration = Duration::from_secs(60);

pub struct Overlay {
    layers: LayerStack,
    inodes: InodeTable,
    ino_map: InoMap,
    config: Config,
    sparse: SparseSupport,
    handles: HandleTable,
    dirs: DirHandleTable,
    /// The latest snapshot of each directory being listed (readdir.rs).
    listings: crate::overlay::readdir::Listings,
    /// Boxed: 19 KiB of striped counters, which would otherwise be copied on the stack each
    /// time the overlay moves while it is built (and stay in the daemon's stack pages).
    stats: Box<Stats>,
    completer: crate::file::complete::Completer,
    /// Copy-after-write's shared state; `None` when it is off.
    caw: Option<Arc<crate::file::partial::caw::CawShared>>,
    /// Where pending blocks live (file/partial/arena.rs); the holder keeps it too.
    arena: Option<Arc<crate::file::partial::arena::Arena>>,
    /// The control socket (control.rs): shut down and removed at shutdown.
    control_socket: std::sync::Mutex<Option<ControlSocket>>,
    /// Moves of upper directories (renames, removals), which change the upper paths of
    /// everything below them. Upper objects are reached by paths built from the inodes' links;
    /// `upper_fd` and `upper_entry` build and open one again when a move ran meanwhile, so a
    /// request never acts on a path that a concurrent rename of an ancestor made wrong.
    moves: ChangeSeq,
    /// Counts renames and links, at their start and at their end: a scan of the tree for a
    /// number that overlaps one may have missed a name moving past it (by_number.rs).
    names_moved: std::sync::atomic::AtomicU64,
    /// Pins of removed upper objects held now (inode/mod.rs `Pin`).
    pins: Arc<std::sync::atomic::AtomicUsize>,
    /// The descriptors open files may not take (file/mod.rs).
    fd_reserve: crate::file::FdReserve,
    /// Per layer id: copy-up may clone this lower layer's files into the upper layer
    /// (copy_up.rs). Turned off for a layer at the first clone the kernel refuses (EXDEV).
    reflink: Vec<std::sync::atomic::AtomicBool>,
    shut_down: std::sync::atomic::AtomicBool,
    /// Pre-content events for partial files whose writers pass through
    /// (file/partial/precontent.rs), or why there are none.
    precontent: std::result::Result<Arc<crate::file::partial::precontent::PreContent>, String>,
    /// How requests reach the daemon (`"io_uring"` or `"/dev/fuse"`), set once the session
    /// is up (`uring=`).
    transport: std::sync::OnceLock<&'static str>,
    /// Whether this mount may pass files through: a `PassthroughState`, set at INIT and when
    /// the kernel refuses a backing file.
    passthrough_state: std::sync::atomic::AtomicUsize,
    /// The kernel's writeback cache is on (passthrough.rs `set_writeback`).
    writeback: std::sync::atomic::AtomicBool,
    /// The kernel offered FUSE_NOTIFY_RESEND at INIT (passthrough.rs `set_kernel_resends`).
    resends: std::sync::atomic::AtomicBool,
    /// The background workers (copy-after-write, completion) start at the first job, not at
    /// mount: an idle mount holds no thread for them (`arm_workers`, `need_*`).
    me: std::sync::OnceLock<std::sync::Weak<Overlay>>,
    caw_started: std::sync::Once,
    completion_started: std::sync::Once,
    /// The upper layer's root carries `partial::LAYER_GUARD` (checked at the first partial
    /// file this mount makes).
    layer_guarded: std::sync::atomic::AtomicBool,
    /// Tells the kernel that an inode's attributes changed without a reply saying so, and with
    /// `true` its cached data too (a directory's listing) (the FUSE session's notifier, set by
    /// the daemon; tools that never mount have none).
    attrs_changed: std::sync::OnceLock<Box<dyn Fn(Ino, bool) + Send + Sync>>,
    /// One scan of the tree for a file handle's object at a time (by_number.rs).
    pub(crate) scanning: std::sync::Mutex<()>,
    /// This daemon's place in the mount's line of daemons (takeover.rs), set once at start.
    lineage: std::sync::OnceLock<Lineage>,
    /// Asks the mount's holder to start the daemon at a path in this one's place (the daemon
    /// sets it where the mount survives its daemon; `mosaicfs upgrade`).
    handover: std::sync::OnceLock<Handover>,
    /// The work dir's orphans directory, where a mount that survives its daemon records the
    /// removed objects still open (by_number.rs), once opened; `None` where it cannot be.
    pub(crate) orphans: std::sync::OnceLock<Option<Arc<OwnedFd>>>,
    /// Node ids whose records of removed files earlier daemons left, which this daemon has
    /// not found yet: a FORGET of one it never found removes the record (by_number.rs,
    /// `note_left_records`).
    pub(crate) left_records: std::sync::Mutex<std::collections::HashSet<Ino>>,
    pub(crate) records_left: std::sync::atomic::AtomicBool,
    /// What this daemon does of the requests that change the tree, for the next daemon
    /// (resend.rs), where the mount survives its daemon and has a work dir.
    pub(crate) requests: std::sync::OnceLock<crate::resend::Ledger>,
}

/// A rename or link in progress (`Overlay::name_moving`): counted again when it ends.
pub(crate) struct NameMoving<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for NameMoving<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How a daemon has its holder start another in its place (takeover.rs).
type Handover = Box<dyn Fn(&Path) -> Result<()> + Send + Sync>;

/// Where this daemon stands among the daemons that served its mount (takeover.rs).
#[derive(Debug, Clone)]
pub struct Lineage {
    /// How many daemons served the mount before this one (0: this one mounted it).
    pub takeovers: u32,
    /// The holder process that restarts the daemon (its pid: another replaces a holder that
    /// ends, takeover.rs `keep_a_holder`), or why the mount ends with its daemon.
    pub holder: std::result::Result<Arc<std::sync::atomic::AtomicI32>, String>,
    /// Why a daemon that dies ends the mount even with a holder: only a hand-over
    /// (`mosaicfs upgrade`) is followed by the next daemon (`takeover::Survival`).
    pub crash_ends: Option<String>,
    /// The binary this daemon was started from: what `mosaicfs upgrade` starts again when
    /// not told another.
    pub binary: PathBuf,
}

impl Lineage {
    /// `daemon:` and `restart:` lines of `mosaicfs status`.
    pub fn describe(&self) -> String {
        let restart = match (&self.holder, &self.crash_ends) {
            (Ok(pid), None) => format!(
                "yes, holder pid {}",
                pid.load(std::sync::atomic::Ordering::Relaxed)
            ),
            (Ok(pid), Some(why)) => format!(
                "upgrade only, holder pid {} ({why})",
                pid.load(std::sync::atomic::Ordering::Relaxed)
            ),
            (Err(why), _) => format!("no ({why})"),
        };
        format!(
            "daemon: pid {}, version {}, binary {}
restart: {restart}; daemons before this \
             one: {}
",
            std::process::id(),
            env!("CARGO_PKG_VERSION"),
            self.binary.display(),
            self.takeovers
        )
    }
}

/// A directory as the merged view sees it: its upper directory (if any) and its lower parts.
#[derive(Debug, Clone)]
pub struct DirView {
    /// The upper directory itself: it stays right whatever is renamed meanwhile.
    pub upper: Option<UpperDir>,
    pub lower: Option<LowerRef>,
    /// Upper entries may carry `mosaicfs.origin` (the directory has lower parts, or is marked).
    pub origins: bool,
}

impl Overlay {
    pub fn new(layers: LayerStack, config: Config) -> Result<Self> {
        let devices = {
            let mut devs: Vec<u64> = (0..=layers.lower_count())
                .map(|i| layers.layer(i as LayerId).dev)
                .collect();
            devs.sort_unstable();
            devs.dedup();
            devs.len() as u64
        };
        let sparse = match layers.work.as_ref() {
            // The store's files have holes at its block size (memory_upper/data.rs).
            Some(_) if layers.memory.is_some() => SparseSupport {
                block: crate::memory_upper::BLOCK,
                sparse: true,
            },
            Some(w) => mark::probe_sparse(w.as_fd()).map_err(|e| {
                crate::message!(
                    "cannot probe the upper file system for sparse files (a file \
                         probe-sparse in the work dir): {e}; check that the work dir is on the \
                         upper dir's file system and that it is writable and not full"
                )
            })?,
            None => SparseSupport {
                block: 4096,
                sparse: true,
            },
        };
        let mut root_layers = Vec::new();
        let opaque_root = layers.has_upper && layers_root_opaque(&layers);
        if !opaque_root {
            for l in layers.lower_ids() {
                root_layers.push(l);
                if lower_root_opaque(&layers, l) {
                    break;
                }
            }
        }
        let root_lower =
            (!root_layers.is_empty()).then(|| LowerRef::in_layers(Path::new(""), &root_layers));
        let clones = config.reflink
            && !config.read_only
            && layers.memory.is_none()
            && layers
                .work
                .as_ref()
                .is_some_and(|w| mark::probe_reflink(w.as_fd()));
        let reflink = (0..=layers.last_layer())
            .map(|i| std::sync::atomic::AtomicBool::new(clones && i as LayerId != UPPER))
            .collect();
        let precontent = Self::open_precontent(&layers, &config)?;
        let arena = Self::open_arena(&config, sparse.block as usize);
        let caw = arena
            .as_ref()
            .filter(|_| config.caw_memory.is_some() && layers.work.is_some())
            .map(|arena| {
                Arc::new(crate::file::partial::caw::CawShared::new(
                    arena.clone(),
                    config.caw_always,
                ))
            });
        let records = crate::inode::Records::new(layers.work.as_deref()).map_err(|e| {
            Error::with_context(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!(
                    "cannot make the table of forgotten inodes ({e}): raise the limit on open \
                     files or free memory"
                ),
            )
        })?;
        Ok(Overlay {
            inodes: InodeTable::new(
                layers.has_upper,
                root_lower,
                layers.has_upper
                    && layers.upper_root().is_ok_and(|root| {
                        layers
                            .dir_flags(root.view(), None, true)
                            .is_ok_and(|f| f.origins)
                    }),
                records,
            ),
            ino_map: InoMap { devices },
            config,
            sparse,
            handles: HandleTable::default(),
            dirs: DirHandleTable::default(),
            listings: Default::default(),
            stats: Box::default(),
            completer: Default::default(),
            caw,
            arena,
            control_socket: Default::default(),
            moves: ChangeSeq::default(),
            names_moved: Default::default(),
            pins: Default::default(),
            fd_reserve: crate::file::FdReserve::from_rlimit(),
            reflink,
            shut_down: Default::default(),
            precontent,
            transport: Default::default(),
            passthrough_state: std::sync::atomic::AtomicUsize::new(
                PassthroughState::NoSession as usize,
            ),
            writeback: Default::default(),
            resends: Default::default(),
            me: Default::default(),
            caw_started: std::sync::Once::new(),
            completion_started: std::sync::Once::new(),
            layer_guarded: std::sync::atomic::AtomicBool::new(false),
            attrs_changed: std::sync::OnceLock::new(),
            scanning: Default::default(),
            lineage: Default::default(),
            handover: Default::default(),
            orphans: Default::default(),
            left_records: Default::default(),
            records_left: Default::default(),
            requests: Default::default(),
            layers,
        })
    }

    // What the session, the control socket and the tools see of the overlay: views to read
    // and the hooks the daemon sets once. Everything else stays with the request files.

    pub fn layers(&self) -> &LayerStack {
        &self.layers
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The upper layer's block size, and whether partial files can be sparse on it.
    pub fn sparse(&self) -> &SparseSupport {
        &self.sparse
    }

    /// The queue of partial files waiting for completion.
    pub fn completer(&self) -> &crate::file::complete::Completer {
        &self.completer
    }

    /// The memfd of copy-after-write's pending blocks, for the mount's holder to keep.
    pub fn pending_arena(&self) -> Option<BorrowedFd<'_>> {
        self.arena.as_ref().map(|a| a.fd())
    }

    /// Copy-after-write's arena: the one an earlier daemon of this mount left
    /// (`Config::pending_arena`, written by `replay_pending` first), else a new one where
    /// copy-after-write is on. `None` where no memfd can be had: partial blocks are then filled
    /// before their writes return.
    fn open_arena(
        config: &Config,
        block: usize,
    ) -> Option<Arc<crate::file::partial::arena::Arena>> {
        use crate::file::partial::arena::Arena;
        let limit = config.caw_memory.unwrap_or(0);
        let made = match &config.pending_arena {
            Some(fd) => fd.try_clone().and_then(|fd| Arena::adopt(fd, limit, block)),
            None if limit > 0 => Arena::create(limit, block),
            None => return None,
        };
        match made {
            Ok(arena) => Some(Arc::new(arena)),
            Err(e) => {
                log::warn!(
                    "cannot map the shared memory of copy-after-write's pending blocks ({e}): \
                     partial blocks are filled before their writes return"
                );
                None
            }
        }
    }

    /// The bytes copy-after-write still has to fill; `None` when it is off.
    pub fn caw_pending_bytes(&self) -> Option<usize> {
        self.caw.as_ref().map(|c| c.pending_bytes())
    }

    /// This mount's pre-content group, or why partial files' writers go through the daemon.
    pub fn precontent(
        &self,
    ) -> std::result::Result<&crate::file::partial::precontent::PreContent, &str> {
        match &self.precontent {
            Ok(pc) => Ok(pc),
            Err(why) => Err(why),
        }
    }

    /// Inodes the kernel knows, and open file handles.
    pub fn open_counts(&self) -> (usize, usize) {
        (self.inodes.len(), self.handles.len())
    }

    /// The kernel forgot `n` lookups of `ino`.
    pub fn forget(&self, ino: Ino, n: u64) {
        if self.records_left.load(std::sync::atomic::Ordering::Relaxed)
            && self.inodes.get(ino).is_none()
        {
            self.forget_left_record(ino);
        }
        self.inodes.forget(ino, n);
    }

    /// A FORGET or a batch of them is done: memory the forgotten nodes held goes back to the
    /// system now when it is much, or once the kernel stops forgetting (inode/mod.rs
    /// `give_back_after_forgets`).
    pub fn forgets_done(&self) {
        crate::inode::give_back_after_forgets();
    }

    /// The access rules of `ino` changed (its mode or ACL): the kernel drops its entry when
    /// `ino` is a directory (`Node::entry_dropped`), to check access again at the next lookup.
    pub fn access_changed(&self, ino: Ino) {
        if let Some(node) = self.inodes.get(ino).filter(|n| n.is_dir()) {
            node.entry_dropped();
        }
    }

    /// How requests reach the daemon (`"io_uring"` or `"/dev/fuse"`).
    pub fn transport(&self) -> &'static str {
        self.transport.get().copied().unwrap_or("/dev/fuse")
    }

    /// Set once the session is up.
    pub fn set_transport(&self, transport: &'static str) {
        let _ = self.transport.set(transport);
    }

    /// How the daemon tells the kernel to drop what it caches of an inode (its attributes, or
    /// with `true` its data or listing too), for changes no reply carries. Set once.
    pub fn on_attrs_changed(&self, tell: impl Fn(Ino, bool) + Send + Sync + 'static) {
        let _ = self.attrs_changed.set(Box::new(tell));
    }

    /// The control socket, shut down at shutdown (its thread then ends) and removed while its
    /// path is still this socket.
    pub fn set_control_socket(&self, socket: ControlSocket) {
        *self
            .control_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(socket);
    }

    /// Has the kernel drop the cached attributes of `ino`, changed by the daemon where no reply
    /// carries them (a set-id bit cleared before a write, a mapped write's times).
    fn attrs_changed_behind(&self, ino: Ino) {
        if let Some(tell) = self.attrs_changed.get() {
            tell(ino, false);
        }
    }

    /// Has the kernel drop the listing it keeps of directory `ino` (and its attributes),
    /// changed where no change inside the directory tells it.
    fn listing_changed_behind(&self, ino: Ino) {
        if let Some(tell) = self.attrs_changed.get() {
            tell(ino, true);
        }
    }

    /// Makes sure the upper layer's root carries the guard that keeps fuse-overlayfs from
    /// reading partial files (`partial::LAYER_GUARD`): called before each partial-file mark
    /// is written, it costs one atomic load after the first.
    fn guard_layer_for_partial_files(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.layers.memory.is_some() || self.layer_guarded.load(Ordering::Acquire) {
            // No other overlay reads a memory upper's image.
            return Ok(());
        }
        let root = self.layers.upper_root()?;
        if !crate::file::partial::mark::layer_guarded(&root) {
            crate::file::partial::mark::guard_layer(&root)?;
        }
        self.layer_guarded.store(true, Ordering::Release);
        Ok(())
    }

    /// Lets this mount start its background workers when their first job comes (the daemon
    /// calls it once the overlay is shared; tools that never mount do not).
    pub fn arm_workers(self: &Arc<Self>) {
        let _ = self.me.set(Arc::downgrade(self));
    }

    /// The copy-after-write workers, started at the first deferred block.
    fn need_caw_workers(&self) {
        // On the write path: once started, one atomic load and nothing more.
        if self.caw_started.is_completed() {
            return;
        }
        if let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) {
            self.caw_started.call_once(|| me.start_caw_workers());
        }
    }

    /// Queues a partial file for completion; the worker starts with the first one.
    fn register_partial(&self, file: &Arc<crate::file::OpenFile>) {
        let native = self.passthrough_serves().is_ok();
        self.completer
            .register(file, &self.config.completion, native);
        if self.completion_started.is_completed()
            || !self.config.completion.completes_anything(native)
        {
            return;
        }
        if let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) {
            self.completion_started.call_once(|| me.start_completion());
        }
    }

    /// This mount's pre-content group, or why partial files stay on the daemon path. Err
    /// (the outer one) only for `partial_passthrough=on` where it cannot work.
    fn open_precontent(
        layers: &LayerStack,
        config: &Config,
    ) -> Result<std::result::Result<Arc<crate::file::partial::precontent::PreContent>, String>>
    {
        use crate::options::{PassthroughPolicy, Switch};
        let available = match (&layers.work, config.partial_passthrough) {
            (_, Switch::Off) => Err("partial_passthrough=off".to_string()),
            _ if config.read_only => Err("a read-only mount".to_string()),
            _ if layers.memory.is_some() => {
                Err("upper=memory (its files have no descriptor to pass through to)".to_string())
            }
            _ if config.passthrough == PassthroughPolicy::Off => Err("passthrough=off".to_string()),
            (None, _) => Err("no upper layer".to_string()),
            (Some(work), _) => {
                let kept = config
                    .precontent_kept
                    .as_ref()
                    .map(|k| Ok::<_, std::io::Error>((k.0.try_clone()?, k.1.try_clone()?)));
                match kept.transpose() {
                    Ok(kept) => crate::file::partial::precontent::PreContent::open(
                        work.as_fd(),
                        kept,
                        config.survives,
                    ),
                    Err(e) => Err(format!("cannot take the pre-content group kept: {e}")),
                }
            }
        };
        match available {
            // The group a holder kept carries marks whose accesses wait for this daemon: it
            // cannot serve the mount without it (the holder tries again, then gives up and
            // guards the group).
            Err(why) if config.precontent_kept.is_some() => Err(crate::message!(
                "cannot take over the pre-content events the daemon before served: {why}"
            )),
            Err(why) if config.partial_passthrough == Switch::On => Err(crate::message!(
                "partial_passthrough=on, but writers of partial files cannot pass through \
                 here: {why}; mount with partial_passthrough=auto to serve them through the \
                 daemon"
            )),
            Err(why) => {
                log::info!("partial files are served through the daemon: {why}");
                Ok(Err(why))
            }
            Ok(pc) => Ok(Ok(pc)),
        }
    }

    /// Starts the pre-content guardian where no holder keeps the group (after the daemon went
    /// to the background).
    pub fn start_precontent(&self, mountpoint: &std::path::Path) -> Result<()> {
        let Ok(pc) = &self.precontent else {
            return Ok(());
        };
        let held = self
            .lineage
            .get()
            .is_some_and(|l| l.holder.is_ok() && pc.kept().is_some());
        pc.guard(mountpoint, held)
            .map_err(|e| crate::message!("cannot start serving partial files by passthrough: {e}"))
    }

    /// Starts serving pre-content events, before any request: a daemon that took the mount
    /// over answers the events its predecessor left first, opening their files by number.
    /// Once the log goes where it is read, before the pending blocks are written (their files
    /// may be marked: the reader answers the daemon's own accesses).
    pub fn serve_precontent(&self) -> Result<()> {
        let Ok(pc) = &self.precontent else {
            return Ok(());
        };
        let me = self.me.get().cloned().unwrap_or_default();
        let resolve: crate::file::partial::precontent::Resolve = Box::new(move |number| {
            let me = me.upgrade().ok_or_else(|| errno(libc::ESHUTDOWN))?;
            let file = me.open_file_as(&me.node(number)?, true)?;
            let Ok(events) = &me.precontent else {
                return Ok(None);
            };
            // Its upper file is marked already: the fills must not raise events of their own.
            file.unwatch_upper()?;
            let served = file.serve_by_events(events)?;
            Ok(served.then_some(file as Arc<dyn crate::file::partial::precontent::FillOnAccess>))
        });
        pc.start(resolve)
            .map_err(|e| crate::message!("cannot start serving partial files by passthrough: {e}"))
    }

    /// The pre-content group and table, for the mount's holder to keep.
    pub fn precontent_kept(&self) -> Option<(BorrowedFd<'_>, BorrowedFd<'_>)> {
        self.precontent.as_ref().ok().and_then(|pc| pc.kept())
    }

    /// The work dir's path, where pre-content events are served (for the holder's guardian).
    pub fn precontent_work(&self) -> Option<&std::path::Path> {
        self.precontent.as_ref().ok().map(|pc| pc.work())
    }

    /// The node the kernel calls `ino`. A daemon that took the mount over (takeover.rs) is
    /// asked about objects the kernel got from the daemon before it — by node id, and by names
    /// in directories whose entries the kernel still holds — so an `ino` not in the table is
    /// looked for by its number (by_number.rs `know_inherited`), the one call from here to a
    /// request file: every request reaches its objects through here.
    pub fn node(&self, ino: Ino) -> Result<Arc<Node>> {
        if let Some(node) = self.inodes.get(ino) {
            return Ok(node);
        }
        if self.takeovers() > 0 {
            self.know_inherited(ino);
            if let Some(node) = self.inodes.get(ino) {
                return Ok(node);
            }
        }
        Err(errno(libc::ESTALE))
    }

    /// A rename or link is under way from now until the guard drops (`names_moved`).
    pub(crate) fn name_moving(&self) -> NameMoving<'_> {
        self.names_moved
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        NameMoving(&self.names_moved)
    }

    /// A token for `tree_unchanged`: directory moves and renames so far.
    pub(crate) fn tree_token(&self) -> (u64, u64) {
        (
            self.moves.read(),
            self.names_moved.load(std::sync::atomic::Ordering::SeqCst),
        )
    }

    /// Whether no directory moved and no name was renamed or linked since `token`.
    pub(crate) fn tree_unchanged(&self, token: (u64, u64)) -> bool {
        self.moves.unchanged(token.0)
            && self.names_moved.load(std::sync::atomic::Ordering::SeqCst) == token.1
    }

    /// Daemons that served this mount before this one.
    pub fn takeovers(&self) -> u32 {
        self.lineage.get().map_or(0, |l| l.takeovers)
    }

    pub fn lineage(&self) -> Option<&Lineage> {
        self.lineage.get()
    }

    /// Set once, before the session serves: handle numbers from now on are this daemon's.
    pub fn set_lineage(&self, lineage: Lineage) {
        self.handles.set_epoch(lineage.takeovers);
        self.dirs.set_epoch(lineage.takeovers);
        if lineage.takeovers > 0 {
            self.inodes.keep_directories();
        }
        let _ = self.lineage.set(lineage);
    }

    /// How `mosaicfs upgrade` reaches the holder (the daemon sets it).
    pub fn on_handover(&self, f: impl Fn(&Path) -> Result<()> + Send + Sync + 'static) {
        let _ = self.handover.set(Box::new(f));
    }

    /// Has the holder start the daemon at `binary` in this one's place; this one stops serving.
    pub fn hand_over(&self, binary: &Path) -> Result<()> {
        if self.precontent_kept().is_some() {
            match crate::takeover::takes_over_events(binary) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(crate::message!(
                        "'{}' does not take over the pre-content events of this mount's \
                         writers passing through (a binary from before 2026-12-01): they would \
                         wait for good; upgrade to a newer binary, or unmount the mount first",
                        binary.display()
                    ));
                }
                Err(e) => {
                    return Err(crate::message!(
                        "cannot read '{}' to check that it takes over the pre-content events of \
                         this mount's writers passing through: {e}",
                        binary.display()
                    ));
                }
            }
        }
        match self.handover.get() {
            Some(f) => {
                // Writers passing through stay: their marks go to the next daemon.
                if let Ok(pc) = &self.precontent {
                    pc.hand_over(true);
                }
                let r = f(binary);
                if let (Err(_), Ok(pc)) = (&r, &self.precontent) {
                    pc.hand_over(false);
                }
                r
            }
            None => Err(crate::message!(
                "this mount does not survive its daemon ({}), so it cannot be upgraded in \
                 place: unmount it and mount it again with the new binary",
                match self.lineage.get().map(|l| &l.holder) {
                    Some(Err(why)) => why.as_str(),
                    _ => "no holder",
                }
            )),
        }
    }

    /// The path of `ino` relative to the upper layer's root, built from its parent chain.
    fn upper_path(&self, ino: Ino) -> Result<PathBuf> {
        let mut names = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let node = self.node(cur)?;
            let (parent, name) = node
                .state()
                .links
                .first()
                .cloned()
                .ok_or_else(|| errno(libc::ENOENT))?;
            names.push(name);
            cur = parent;
            if names.len() > 4096 {
                return Err(Error::with_context(libc::ELOOP, "parent chain too deep"));
            }
        }
        let mut p = PathBuf::new();
        for n in names.iter().rev() {
            p.push(n);
        }
        Ok(p)
    }

    /// The merged view of directory `node`.
    pub fn dir_view(&self, node: &Node) -> Result<DirView> {
        let (upper, lower, origins) = {
            let st = node.state();
            if st.kind != libc::S_IFDIR {
                return Err(errno(libc::ENOTDIR));
            }
            (st.upper, st.lower.clone(), st.origins)
        };
        Ok(DirView {
            upper: if upper {
                Some(self.upper_fd(node)?)
            } else {
                None
            },
            origins: origins || lower.is_some(),
            lower,
        })
    }

    /// The upper directory of the directory `node`, which must have one. Its path comes from
    /// the links of its ancestors; when an upper directory moved while the path was built or
    /// opened, both are done again (seq.rs), so the descriptor is the directory `node` is.
    pub fn upper_fd(&self, node: &Node) -> Result<UpperDir> {
        loop {
            let moves = self.moves.read();
            let r = self
                .upper_path(node.ino)
                .and_then(|p| self.layers.upper_dir(&p, moves));
            if self.moves.unchanged(moves) {
                return r;
            }
        }
    }

    /// The upper directory holding `node`'s upper object, and its name there (`.` for the
    /// root), got as `upper_fd` gets a directory.
    pub fn upper_entry(&self, node: &Node) -> Result<(UpperDir, OsString)> {
        loop {
            let moves = self.moves.read();
            let r = self
                .upper_path(node.ino)
                .and_then(|p| match (p.parent(), p.file_name()) {
                    (Some(parent), Some(name)) => {
                        Ok((self.layers.upper_dir(parent, moves)?, name.to_os_string()))
                    }
                    _ => Ok((self.layers.upper_dir(Path::new(""), moves)?, ".".into())),
                });
            if self.moves.unchanged(moves) {
                return r;
            }
        }
    }

    /// Runs `op` again when it found its object missing while an upper directory moved: it
    /// reached the object by a name in its parent directory, and a concurrent rename of that
    /// very directory (which the kernel does not serialise against every call on it) changed
    /// the name under it. `op` must not have changed anything when it fails so.
    fn settled<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut tries = 0;
        loop {
            let moves = self.moves.read();
            match op() {
                Err(e)
                    if (e.is(libc::ENOENT) || e.is(libc::ENOTDIR))
                        && !self.moves.unchanged(moves)
                        && tries < 100 =>
                {
                    tries += 1;
                }
                r => return r,
            }
        }
    }

    /// Runs `op` on the directory `rel` of the lower layer `layer`. A shared store (GlusterFS,
    /// NFS) answers ESTALE on a descriptor of a directory that another client has replaced
    /// since it was opened — and the layer's descriptors are cached (dircache.rs): the cached
    /// one is dropped, the directory opened again by its path and `op` run once more. ESTALE
    /// twice (the layer's root itself was replaced, say) is answered EIO with the path in the
    /// log: no local file system answers ESTALE, and this one will not heal by retrying.
    fn in_lower_dir<T>(
        &self,
        layer: LayerId,
        rel: &Path,
        mut op: impl FnMut(BorrowedFd<'_>) -> Result<T>,
    ) -> Result<T> {
        match self.layers.dir(layer, rel).and_then(|fd| op(fd.as_fd())) {
            Err(e) if e.is(libc::ESTALE) => {
                self.stats.stale_retries.add(1);
                self.layers
                    .reopen_dir(layer, rel)
                    .and_then(|fd| op(fd.as_fd()))
                    .map_err(|e| self.stale(layer, rel, e))
            }
            r => r,
        }
    }

    /// `e` as the mount answers it when it came from `rel` in the lower layer `layer` after
    /// the retry (`in_lower_dir`): ESTALE becomes EIO, with the path for the log.
    fn stale(&self, layer: LayerId, rel: &Path, e: Error) -> Error {
        if !e.is(libc::ESTALE) {
            return e;
        }
        Error::with_context(
            libc::EIO,
            format!(
                "lower layer {layer} '{}': '{}' is stale on its store (ESTALE, also after \
                 opening it again): the layer was replaced or removed under the mount; remount \
                 to see the layer as it is now",
                self.layers.layer(layer).path.display(),
                rel.display()
            ),
        )
    }

    /// The object `rel` of the lower layer `layer`: its parent directory, its name there and
    /// its `stat`.
    fn lower_entry<'a>(
        &self,
        layer: LayerId,
        rel: &'a Path,
    ) -> Result<(Arc<OwnedFd>, &'a OsStr, Attr)> {
        let (Some(parent), Some(name)) = (rel.parent(), rel.file_name()) else {
            return Err(errno(libc::EINVAL));
        };
        let attr = self.in_lower_dir(layer, parent, |dir| sys::stat_at(dir, name))?;
        Ok((self.layers.dir(layer, parent)?, name, attr))
    }

    /// The layer directory holding the file the merged object `node` shows now (upper if it
    /// has an upper part), and its name there; no name for a layer's root.
    /// `node`'s upper object as a directory and a name in it, or as a descriptor of the object
    /// itself (`None`) for the root and for an unnamed open file (O_TMPFILE, or unlinked while
    /// open), which no name reaches.
    fn upper_target(&self, node: &Node) -> Result<(UpperDir, Option<OsString>)> {
        if let Some(f) = self.unnamed_upper_file(node) {
            return Ok((f.into_object(), None));
        }
        let (dir, name) = self.upper_entry(node)?;
        Ok((dir, (node.ino != ROOT_INO).then_some(name)))
    }

    /// Runs `op` on the layer object `node` shows now (upper if it has an upper part), as a
    /// directory and a name in it — no name for a layer's root or an unnamed upper file.
    fn at_top_entry<T>(
        &self,
        node: &Node,
        mut op: impl FnMut(LayerDir<'_>, Option<&OsStr>) -> Result<T>,
    ) -> Result<T> {
        let (upper, lower) = {
            let st = node.state();
            (st.upper, st.lower.clone())
        };
        if upper {
            let (dir, name) = self.upper_target(node)?;
            return op(dir.view(), name.as_deref());
        }
        let lower = lower.ok_or_else(|| errno(libc::ENOENT))?;
        match (lower.path.parent(), lower.path.file_name()) {
            (Some(parent), Some(name)) => {
                self.in_lower_dir(lower.top(), parent, |dir| op(dir.into(), Some(name)))
            }
            _ => self.in_lower_dir(lower.top(), Path::new(""), |dir| op(dir.into(), None)),
        }
    }

    /// A wait on the lower layer `node` lives in, if it is not in the upper layer
    /// (lower_wait.rs): for the syscalls of `at_top_entry`.
    fn waiting_on(&self, node: &Node) -> Result<Option<crate::lower_wait::Waiting>> {
        if !crate::lower_wait::watched() {
            return Ok(None);
        }
        let top = {
            let st = node.state();
            if st.upper {
                return Ok(None);
            }
            st.lower.as_ref().map(|l| l.top())
        };
        top.map(crate::lower_wait::enter).transpose()
    }

    /// The lower layer `node` shows, if it has no upper part.
    fn lower_only_layer(&self, node: &Node) -> Option<&crate::layers::Layer> {
        let st = node.state();
        match (&st.lower, st.upper) {
            (Some(l), false) => Some(self.layers.layer(l.top())),
            _ => None,
        }
    }

    /// `stat` of the layer file behind `node`, not yet adjusted for the merged view.
    pub fn stat_layer(&self, node: &Node) -> Result<Attr> {
        let (open, kept) = {
            let st = node.state();
            (st.open.upgrade(), self.store_attr(&st))
        };
        if let Some(open) = open
            && let Some(a) = open.fstat()?
        {
            return Ok(a);
        }
        if let Some(a) = kept {
            return Ok(a);
        }
        let _waiting = self.waiting_on(node)?;
        let attr = self.at_top_entry(node, |dir, name| dir.stat(name))?;
        if !self.is_upper_object_of(node, &attr) {
            // Removed, or another object moved there, since the kernel looked the name up
            // (ROBUSTNESS.md, "Calls racing the removal of their object").
            let pinned = self.pinned(&node.state());
            return pinned.map_or(Err(errno(libc::ESTALE)), |f| f.stat());
        }
        self.keep_store_attr(node, attr);
        Ok(attr)
    }

    /// Whether `attr`, found at the path of `node`, is `node`'s object: of its type, and with
    /// its number unless a copy-up gave the node its origin's. Always for lower-only nodes
    /// (lower layers do not change under a name).
    fn is_upper_object_of(&self, node: &Node, attr: &Attr) -> bool {
        let st = node.state();
        if !st.upper {
            return true;
        }
        attr.file_type() == st.kind
            && (st.has_origin
                || node.ino == ROOT_INO
                || self.map_ino(UPPER, attr.ino) == node.st_ino())
    }

    /// The `stat` of an object only a lower layer on a store's client holds, as taken within
    /// `lower_cache`: layers do not change, and the kernel asks again more often than its
    /// cache time says — a READ marks the file's atime stale, so the next `fstat` after a file
    /// was read sends a GETATTR, which would otherwise cost a call to the store per file
    /// (bench/stores.sh: 80 µs each on GlusterFS).
    fn store_attr(&self, st: &crate::inode::NodeState) -> Option<Attr> {
        match st.rare().store_attr {
            Some((attr, at)) if !st.upper && at.elapsed() < self.config.lower_cache => Some(attr),
            _ => None,
        }
    }

    /// Keeps `attr`, just taken of `node`'s layer object, for `store_attr`.
    fn keep_store_attr(&self, node: &Node, attr: Attr) {
        let mut st = node.state();
        let on_store = match (&st.lower, st.upper) {
            (Some(l), false) => self.layers.layer(l.top()).on_store,
            _ => false,
        };
        if on_store {
            st.rare_mut().store_attr = Some((attr, std::time::Instant::now()));
        }
    }

    /// Subdirectories in the merged view of directory `node`, counted once per change.
    fn merged_subdirs(&self, node: &Node) -> Result<u64> {
        let counted_at = {
            let st = node.state();
            if let Some(n) = st.subdirs() {
                return Ok(n.into());
            }
            st.subdirs_gen
        };
        let n = self.settled(|| {
            let view = self.dir_view(node)?;
            Ok(self
                .list_view(&view)?
                .iter()
                .filter(|e| e.kind == libc::S_IFDIR)
                .count() as u64)
        })?;
        // A count past u32 (no file system links that many) is not kept.
        node.state().counted_subdirs(counted_at, n);
        Ok(n)
    }

    pub fn map_ino(&self, layer: LayerId, st_ino: u64) -> Ino {
        self.ino_map.map(self.layers.layer(layer).dev_index, st_ino)
    }

    /// The on-disk owner for a merged-view owner.
    fn disk_ids(&self, uid: u32, gid: u32) -> (u32, u32) {
        (
            self.config.uid_map.to_outside(uid),
            self.config.gid_map.to_outside(gid),
        )
    }

    fn check_writable(&self) -> Result<()> {
        if self.config.read_only || !self.layers.has_upper {
            return Err(errno(libc::EROFS));
        }
        Ok(())
    }

    pub fn statfs(&self) -> Result<rustix::fs::StatVfs> {
        let mut s = rustix::fs::fstatvfs(self.layers.root(UPPER))?;
        if let Some(m) = &self.layers.memory
            && m.size_limit().is_some()
        {
            // The layer's own size (`size=`); without it, the file system its filestore
            // lives on, whose space the layer takes.
            let u = m.usage()?;
            let block = crate::memory_upper::BLOCK;
            s.f_bsize = block;
            s.f_frsize = block;
            s.f_blocks = u.blocks;
            s.f_bfree = u.free;
            s.f_bavail = u.free;
        }
        Ok(s)
    }

    /// Makes the memory upper durable as it is now: an image of the whole tree, after which a
    /// crash loses nothing before this moment (`mosaicfs sync MNT`, unmount). Nothing to do
    /// for a disk upper, whose every change is in the upper file system already.
    pub fn sync_layer(&self) -> Result<()> {
        let Some(m) = &self.layers.memory else {
            return Ok(());
        };
        // Bytes still waiting in copy-after-write buffers belong to the image too.
        for h in self.handles.values() {
            h.file.flush_pending()?;
        }
        m.sync()
    }

    /// Tells the daemon's own threads to end (the control socket's, completion's,
    /// copy-after-write's): as soon as the mount is gone (FUSE `unmounted`), and again at
    /// `shutdown`. The process's descriptors — the layers, whose file systems `umount` finds
    /// busy until then — close only when its last thread has exited, and a container engine
    /// unmounts a layer's file system right after the overlay.
    pub fn stop_threads(&self) {
        if let Some(socket) = &*self
            .control_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            crate::sys::shut_down_socket(socket.listener.as_fd());
        }
        self.completer.stop();
        if let Some(caw) = &self.caw {
            caw.stop();
        }
    }

    /// Completes what is pending and lets go of every open file (unmount). Runs once, on
    /// whichever exit path comes first (FUSE `destroy`, or the session ending without it).
    pub fn shutdown(&self) {
        if self
            .shut_down
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        // Files removed while open are found by the next daemon through their records.
        crate::inode::keep_orphan_records();
        self.stop_threads();
        // Pending copy-after-write blocks go to disk before the daemon exits.
        let files = self
            .completer
            .drain()
            .into_iter()
            .chain(self.handles.values().into_iter().map(|h| h.file.clone()));
        for f in files {
            if let Err(e) = f.flush_pending() {
                log::error!(
                    "filling pending blocks of inode {} at unmount failed: {e}",
                    f.ino
                );
            }
        }
        if let Some(m) = &self.layers.memory {
            // Before the work dir's lock goes with the daemon: the next mount waits for it.
            let started = std::time::Instant::now();
            match m.sync_at_unmount() {
                Ok(()) => log::info!(
                    "memory upper: layer durable ({} objects, {:.1} ms)",
                    m.node_count(),
                    started.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => log::error!(
                    "memory upper: the last changes could not be made durable at unmount \
                     ({e}); the next mount shows the layer as of the last sync or fsync"
                ),
            }
        }
        // Every partial file went with the queue and the handles: no mark is left to guard.
        match &self.precontent {
            Ok(pc) => {
                pc.stop();
                log::info!("pre-content events: {}", pc.summary());
            }
            Err(why) => log::info!("pre-content events: event-fills=0 (not used: {why})"),
        }
        log::info!("{}", self.stats.summary());
        if let Some(ControlSocket { path, ino, .. }) = self
            .control_socket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            // Under the lock a new daemon binds under: checked and removed in one step.
            let _locked = path.parent().and_then(lock_socket_dir);
            if std::fs::metadata(&path)
                .is_ok_and(|m| std::os::unix::fs::MetadataExt::ino(&m) == ino)
            {
                let _ = std::fs::remove_file(path);
            }
        }
        self.handles.clear();
        self.dirs.clear();
        self.listings.clear();
    }

    /// The pinned upper object of a node (inode/mod.rs `Pin`), if any.
    fn pinned(&self, st: &crate::inode::NodeState) -> Option<UpperFile> {
        st.rare().pin.as_ref()?.object.try_clone().ok()
    }

    /// `node`'s upper object when it has no name any more (or never had one: O_TMPFILE) and
    /// is still open or pinned (inode/mod.rs `Pin`): the only way left to reach it.
    fn unnamed_upper_file(&self, node: &Node) -> Option<UpperFile> {
        let file = {
            let st = node.state();
            if !st.links.is_empty() || !st.upper {
                return None;
            }
            match st.open.upgrade() {
                Some(file) => file,
                None => return self.pinned(&st),
            }
        };
        file.read_data().upper().and_then(|f| f.try_clone().ok())
    }
}

/// The daemon's control socket (control.rs), as the overlay holds it for shutdown.
pub struct ControlSocket {
    /// Removed at exit while it is still this socket (`ino`): device numbers of FUSE mounts
    /// are reused at once, so a newer mount may have bound its own socket at the same path.
    pub path: PathBuf,
    pub ino: u64,
    /// The listening socket (a duplicate of the served one): shutting it down ends the thread
    /// that accepts on it.
    pub listener: OwnedFd,
}

/// Locks the directory of the control sockets (flock on the directory itself) while held. A
/// socket is named by its mount's device number, and FUSE device numbers are reused at once:
/// a new mount's daemon may bind its socket while the daemon of an unmounted one on the same
/// number exits. The old daemon removes the path only while it is still its own socket; without
/// this lock, a bind between its check and its unlink lost the new mount its socket ("no
/// mosaicfs daemon answers", seen with mounts and unmounts in parallel).
pub fn lock_socket_dir(dir: &Path) -> Option<std::fs::File> {
    let f = std::fs::File::open(dir).ok()?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive).ok()?;
    Some(f)
}

fn layers_root_opaque(layers: &LayerStack) -> bool {
    // An opaque upper root hides every lower layer.
    layers
        .upper_root()
        .and_then(|root| root.view().get_xattr(None, layers.xattr.opaque))
        .ok()
        .flatten()
        .is_some_and(|v| v.first() == Some(&b'y'))
}

fn lower_root_opaque(layers: &LayerStack, l: LayerId) -> bool {
    [
        "trusted.overlay.opaque",
        "user.overlay.opaque",
        "user.fuseoverlayfs.opaque",
    ]
    .iter()
    .any(|k| {
        sys::get_xattr(layers.root(l), None, k)
            .ok()
            .flatten()
            .is_some_and(|v| v.first() == Some(&b'y'))
    })
}
