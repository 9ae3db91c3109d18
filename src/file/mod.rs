//! Open files and what serves them: `OpenFile` (the data of one inode's daemon-path handles),
//! `NodeIo` (how the kernel inode behind a node id does I/O: its passthrough binding),
//! `FdReserve` (descriptors kept back from the limit). The requests themselves are in io.rs.
//!
//! Daemon-path handles open on one inode share one `OpenFile`, so they see one another's writes
//! across a copy-up. An `OpenFile` is in one of three states: `Lower` (untouched lower file),
//! `Partial` (some blocks in the upper layer, see file/partial/mark.rs), `Upper` (a complete upper
//! file). Its `RwLock` is the per-file lock: reads share it, writes and size changes take it
//! exclusively. A read-only passthrough handle opened on a lower file before its copy-up keeps
//! reading the lower file (the kernel cannot move it; README, "Known differences").

pub mod complete;
pub mod data;
pub mod partial;

pub use data::FileData;

use std::any::Any;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::error::{Result, errno};
use crate::file::partial::mark::PartialMark;
use crate::options::PassthroughPolicy;

use crate::file::partial::precontent::{FillOnAccess, PreContent};
use crate::sys::Attr;

/// Descriptors for open files stop short of the daemon's limit by a reserve, so that any
/// number of files held open cannot take from lookups, listings, creates and the directory
/// cache what they need (issue #10). Partial files (two descriptors each: upper and lower
/// file) stop a second reserve earlier, so that while writers hold as many as they can,
/// creates and read-only opens still work. The kernel hands out the lowest free descriptor
/// number, so the number an open file's descriptor got says how many are in use, without a
/// counter shared between threads: past the line, the open fails (ENFILE, for the opener
/// alone) and the log says why once.
pub struct FdReserve {
    /// Descriptor numbers from here up are kept for everything but open files.
    line: i32,
    /// ... and from here up for everything but open partial files.
    partial_line: i32,
    limit: u64,
    warned: std::sync::atomic::AtomicBool,
}

impl FdReserve {
    /// Lookups, listings and creates need a few transient descriptors per worker thread; the
    /// directory cache holds up to 1,024.
    const RESERVE: u64 = 2048;

    pub fn from_limit(limit: u64) -> Self {
        let reserve = Self::RESERVE.min(limit / 8);
        let at = |n: u64| limit.saturating_sub(n).min(i32::MAX as u64) as i32;
        FdReserve {
            line: at(reserve),
            partial_line: at(2 * reserve),
            limit,
            warned: Default::default(),
        }
    }

    /// From the daemon's RLIMIT_NOFILE (its soft limit, raised to the hard one at start).
    pub fn from_rlimit() -> Self {
        let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        Self::from_limit(lim.current.unwrap_or(1 << 20))
    }

    /// Refuses `data`, just opened, past its line. `writer`: it is opened for writing (a lower
    /// file then becomes partial at its first write).
    pub fn check(&self, data: &FileData, writer: bool) -> Result<()> {
        let line = match data {
            FileData::Partial(_) => self.partial_line,
            FileData::Lower(_) | FileData::Unopened(..) if writer => self.partial_line,
            _ => self.line,
        };
        if data.highest_fd() < line {
            return Ok(());
        }
        if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            log::warn!(
                "files open through the mount hold nearly all of the daemon's {} descriptors \
                 (RLIMIT_NOFILE): further opens fail with ENFILE until some are closed, while \
                 lookups, listings and creates go on; raise the daemon's RLIMIT_NOFILE to open more",
                self.limit
            );
        }
        Err(errno(libc::ENFILE))
    }
}

pub struct OpenFile {
    /// The object's inode number (its node's `st_ino`).
    pub ino: u64,
    data: RwLock<FileData>,
    /// Opens for writing since this state was made (completion follows use, file/complete.rs).
    pub(crate) writer_opens: std::sync::atomic::AtomicU32,
    /// Opened for writing when it already held blocks of its own, or after an earlier open
    /// for writing: in sustained use.
    pub(crate) reopened: std::sync::atomic::AtomicBool,
    /// Reads and writes of its data the daemon served: what passthrough would spare a complete
    /// file (completion's sustained-use rule). One relaxed add per request, on this file only.
    pub(crate) served: std::sync::atomic::AtomicU64,
    /// The current run of use, as the completion worker and `status` last saw it.
    run: Mutex<UseRun>,
}

/// A run of use ends after this long without a request through the daemon (completion's
/// sustained-use rule, file/complete.rs).
pub(crate) const BUSY_GAP: Duration = Duration::from_secs(10);

/// A run of use: requests through the daemon with no gap of `BUSY_GAP` between
/// the looks that saw them.
#[derive(Debug, Clone, Copy)]
struct UseRun {
    /// `served` when the run began.
    start: u64,
    /// `served` at the last look that found it changed, and when.
    seen: u64,
    changed: Instant,
}

/// How a handle does its I/O.
///
/// The kernel binds an inode to one backing file while any passthrough handle is open, and then
/// fails every open that is not passthrough on that backing file with EIO (fs/fuse/iomode.c).
/// So a complete upper file passes through for every open, and a read-only open of a plain
/// lower file passes through (`passthrough=all`, the default). An open that may not use the
/// lower file the kernel inode is bound to (a writer, or a reader after the file changed) gets
/// the object under a new node id instead: the daemon retires the old one and answers ESTALE,
/// the kernel looks the name up again and opens the new inode (`InodeTable::retire`). Readers
/// already open keep reading the lower file, as with fuse-overlayfs; `passthrough=upper`
/// serves lower files through the daemon, where every handle sees every write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// Reads and writes go from the kernel to the layer file, never through the daemon.
    Passthrough,
    /// Through the daemon, with the page cache kept across opens (every change to the data goes
    /// through the mount, so the cache is never stale) unless the object has two kernel inodes
    /// (`Opened::keep_cache`).
    Cached,
}

/// A passthrough registration as the session made it (a FUSE backing id), kept by the inode
/// while any of its handles passes through.
pub type Backing = Arc<dyn Any + Send + Sync>;

/// The I/O binding of one kernel inode (one node id, see `IoMode`). Its lock may be held while
/// the file's data lock is taken (`backing`), never the other way round.
///
/// A registration outlives its last passthrough handle (it is "idle"), so the next open
/// passes through without a `FUSE_DEV_IOC_BACKING_OPEN` and the close without a
/// `BACKING_CLOSE`: open + close 46-49 -> 36-39 µs here, of a complete upper file or of a lower
/// one (docs/PERFORMANCE.md). It goes with the node, when the kernel forgets the inode: right
/// after the last link is removed and nothing holds the file open (an unlinked file's blocks
/// are not kept), or when the kernel's inode cache lets go. It serves a new handle only if
/// that handle passes through on the same kind of file (`begin`): a complete upper file is
/// its node's data for the node's life, and a lower file's data until a copy-up, after which
/// no handle is of the lower kind again. At most `MAX_IDLE_BACKINGS` are idle at once: each
/// holds an open file in the kernel.
#[derive(Default)]
pub struct NodeIo {
    state: Mutex<IoState>,
    /// Signalled when the last passthrough handle goes, for an open waiting on it (`begin`).
    unbound: Condvar,
}

#[derive(Default)]
struct IoState {
    passthrough: usize,
    cached: usize,
    /// The FUSE adapter's registration of the backing file, shared by all passthrough handles
    /// of the kernel inode.
    backing: Option<Backing>,
    /// Whether the backing file is the upper file (else the lower file: read-only handles only).
    backing_upper: bool,
    /// `backing` is kept with no passthrough handle open (counted in `IDLE_BACKINGS`).
    idle: bool,
    /// Opens waiting for the last passthrough handle to go (`NodeIo::begin`): only then does
    /// `end` signal, so a close pays no wake-up call when nobody waits.
    waiting: usize,
}

/// How many upper registrations are idle in this daemon (`IoState::idle`).
static IDLE_BACKINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// The most idle registrations kept; past it a registration goes with its last handle.
const MAX_IDLE_BACKINGS: usize = 4096;

impl IoState {
    /// The registration is in use again, or goes: it is no longer counted as idle.
    fn wake(&mut self) {
        if std::mem::take(&mut self.idle) {
            IDLE_BACKINGS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Drop for IoState {
    fn drop(&mut self) {
        self.wake();
    }
}

/// Which file a handle's data lives in, as far as passthrough cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataKind {
    /// A complete upper file.
    Upper,
    /// An untouched lower file, not itself partial.
    PlainLower,
    /// A partial file whose writers pass through to its upper file (file/partial/precontent.rs): a
    /// passthrough handle only for an open that cannot read (mmap would bypass the events).
    MarkedPartial,
    /// Anything the daemon must merge.
    Merged,
}

impl IoState {
    /// Picks and counts the I/O mode of a new handle; None when the kernel inode is bound to a
    /// backing file this handle may not use.
    fn begin(
        &mut self,
        data: DataKind,
        writable: bool,
        readable: bool,
        policy: PassthroughPolicy,
        alias: bool,
    ) -> Option<IoMode> {
        // A marked partial file's backing file is its upper file, which it stays when the
        // file completes: such handles and a complete file's share the registration.
        // `readable` also stands for an appending handle (io.rs `open`); a second identity's
        // handles never pass through to a partial file (its readers could not rebind again).
        let upper =
            data == DataKind::Upper || (data == DataKind::MarkedPartial && !readable && !alias);
        // A second identity exists because a handle could not use the lower file: never bind
        // it to one (a writer may be on its way).
        let lower = data == DataKind::PlainLower && !writable && !alias;
        if self.passthrough > 0 {
            // The inode is bound to its backing file until the last passthrough handle closes.
            let fits = if self.backing_upper { upper } else { lower };
            if !fits {
                return None;
            }
            self.passthrough += 1;
            return Some(IoMode::Passthrough);
        }
        let eligible = match policy {
            PassthroughPolicy::Off => false,
            PassthroughPolicy::Upper => upper,
            PassthroughPolicy::All => upper || lower,
        };
        let passthrough = eligible && self.cached == 0;
        // An idle registration serves this handle only if the handle passes through on the
        // same kind of file: a lower file's registration ends with its copy-up.
        self.wake();
        if !(passthrough && upper == self.backing_upper) {
            self.backing = None;
        }
        if passthrough {
            self.passthrough += 1;
            self.backing_upper = upper;
            Some(IoMode::Passthrough)
        } else {
            self.cached += 1;
            Some(IoMode::Cached)
        }
    }
}

impl NodeIo {
    fn state(&self) -> std::sync::MutexGuard<'_, IoState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Picks and counts the I/O mode of a new handle; None when the kernel inode is bound to a
    /// backing file this handle may not use, and stays bound for `patience`.
    ///
    /// The kernel unbinds an inode when its last passthrough handle is closed, but tells the
    /// daemon only by the RELEASE it sends afterwards, which another worker thread may still be
    /// serving when an open that follows the close arrives: `patience` waits for it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin(
        &self,
        data: DataKind,
        writable: bool,
        readable: bool,
        policy: PassthroughPolicy,
        alias: bool,
        patience: Duration,
    ) -> Option<IoMode> {
        let mut io = self.state();
        let mut deadline = None;
        loop {
            if let Some(mode) = io.begin(data, writable, readable, policy, alias) {
                return Some(mode);
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + patience);
            let left = deadline.checked_duration_since(Instant::now())?;
            if left.is_zero() {
                return None;
            }
            io.waiting += 1;
            io = self
                .unbound
                .wait_timeout(io, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            io.waiting -= 1;
        }
    }

    pub(crate) fn end(&self, mode: IoMode) {
        let mut io = self.state();
        match mode {
            IoMode::Passthrough => {
                io.passthrough -= 1;
                if io.passthrough == 0 {
                    let keep = io.backing.is_some()
                        && IDLE_BACKINGS
                            .fetch_update(
                                std::sync::atomic::Ordering::Relaxed,
                                std::sync::atomic::Ordering::Relaxed,
                                |n| (n < MAX_IDLE_BACKINGS).then_some(n + 1),
                            )
                            .is_ok();
                    if keep {
                        io.idle = true;
                    } else {
                        io.backing = None;
                    }
                    if io.waiting > 0 {
                        self.unbound.notify_all();
                    }
                }
            }
            IoMode::Cached => io.cached -= 1,
        }
    }

    /// The backing registration for passthrough of `file`, made by `register` on first use.
    pub fn backing<E>(
        &self,
        file: &OpenFile,
        register: impl FnOnce(BorrowedFd<'_>) -> std::result::Result<Backing, E>,
        changed: impl FnOnce() -> E,
    ) -> std::result::Result<Backing, E> {
        let mut io = self.state();
        if let Some(b) = &io.backing {
            return Ok(b.clone());
        }
        let data = file.read_data();
        let fd = match (&*data, io.backing_upper) {
            (FileData::Upper(f), true) => f.disk_fd().ok(),
            (FileData::Partial(p), true) if p.by_events.is_some() => p.upper.disk_fd().ok(),
            (FileData::Lower(src), false) => src.fd(),
            _ => None,
        };
        // None: copied up since the handle chose passthrough.
        let fd = fd.ok_or_else(changed)?;
        let b = register(fd)?;
        io.backing = Some(b.clone());
        Ok(b)
    }
}

/// How far a partial file is from complete.
pub struct Progress {
    pub present: u64,
    pub total: u64,
    /// Bytes completion would copy from the lower file.
    pub missing_bytes: u64,
    /// Reads and writes served by the daemon in the current run of use.
    pub requests_in_run: u64,
    /// No handle has it open (`Completer::progress` sets it; `partial_progress` cannot know).
    pub closed: bool,
    pub last_write: Instant,
    pub unlinked: bool,
    /// Opens for writing so far.
    pub writer_opens: u32,
    /// Opened for writing after it was written.
    pub reopened: bool,
    /// Its writers pass through, told by pre-content events (else: the daemon path).
    pub events: bool,
}

/// A new open handle and how it does I/O.
pub struct Opened {
    pub fh: u64,
    pub io: IoMode,
    /// Whether its close must reach the daemon (FLUSH): a handle that writes through the
    /// daemon may leave copy-after-write blocks pending.
    pub flushes: bool,
    /// Whether the kernel may keep the inode's cached pages at this open. Not when the object
    /// has two kernel inodes (a passthrough reader of the lower file made the writers' opens
    /// move to a second one): writes through either leave the other's pages stale, and
    /// dropping them at each open gives at least close-to-open consistency.
    pub keep_cache: bool,
    /// Whether the kernel must send every read and write of this handle as it comes, past
    /// its page cache (FOPEN_DIRECT_IO): an append-only file under the writeback cache, whose
    /// writes the daemon must see in time to refuse one that does not append.
    pub direct: bool,
}

/// A file's data for reading (`Overlay::opened_data`).
pub(crate) enum DataRef<'a> {
    Held(RwLockReadGuard<'a, FileData>),
    /// Opened for one request, not kept.
    Transient(FileData),
}

impl std::ops::Deref for DataRef<'_> {
    type Target = FileData;

    fn deref(&self) -> &FileData {
        match self {
            DataRef::Held(guard) => guard,
            DataRef::Transient(data) => data,
        }
    }
}

impl FillOnAccess for OpenFile {
    fn fill_range(&self, off: u64, len: u64) -> Result<()> {
        match &mut *self.write_data() {
            FileData::Partial(p) => p.fill_range(off, len),
            // Complete meanwhile: nothing reads the lower file any more.
            _ => Ok(()),
        }
    }

    fn try_fill_range(&self, off: u64, len: u64) -> Option<Result<()>> {
        let mut data = match self.data.try_write() {
            Ok(data) => data,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(match &mut *data {
            FileData::Partial(p) => p.fill_range(off, len),
            _ => Ok(()),
        })
    }
}

impl crate::file::partial::caw::FillPending for OpenFile {
    fn fill_pending(&self, blk: u64) -> Result<bool> {
        OpenFile::fill_pending(self, blk)
    }

    fn ino(&self) -> u64 {
        self.ino
    }
}

impl OpenFile {
    /// The open state of the object numbered `ino`, holding `data`.
    pub fn new(ino: u64, data: FileData) -> OpenFile {
        OpenFile {
            ino,
            data: RwLock::new(data),
            writer_opens: Default::default(),
            reopened: Default::default(),
            served: Default::default(),
            run: Mutex::new(UseRun {
                start: 0,
                seen: 0,
                changed: Instant::now(),
            }),
        }
    }

    /// Counts a read or write of the data served by the daemon.
    pub(crate) fn served_one(&self) {
        self.served
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The requests of the current run of use: a look that finds none since `BUSY_GAP`
    /// ago ends the run, and the next request starts a new one.
    fn requests_in_run(&self, now: Instant) -> u64 {
        let served = self.served.load(std::sync::atomic::Ordering::Relaxed);
        let mut run = self.run.lock().unwrap_or_else(|e| e.into_inner());
        if served != run.seen {
            if now.duration_since(run.changed) >= BUSY_GAP {
                run.start = run.seen; // a gap: the requests since begin a new run
            }
            run.seen = served;
            run.changed = now;
        } else if now.duration_since(run.changed) >= BUSY_GAP {
            run.start = served;
        }
        served - run.start
    }

    pub(crate) fn read_data(&self) -> RwLockReadGuard<'_, FileData> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write_data(&self) -> RwLockWriteGuard<'_, FileData> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }

    /// `stat` of the upper file, when this file has one.
    pub fn fstat(&self) -> Result<Option<Attr>> {
        match &*self.read_data() {
            FileData::Lower(_) | FileData::Unopened(..) => Ok(None),
            FileData::Partial(p) => Ok(Some(p.upper.stat()?)),
            FileData::Upper(f) => Ok(Some(f.stat()?)),
        }
    }

    pub(crate) fn kind(&self) -> DataKind {
        match &*self.read_data() {
            // A memory upper file has no descriptor to pass through to.
            FileData::Upper(f) if f.disk_fd().is_ok() => DataKind::Upper,
            FileData::Lower(src) if src.is_plain() => DataKind::PlainLower,
            FileData::Partial(p) if p.by_events.is_some() => DataKind::MarkedPartial,
            _ => DataKind::Merged,
        }
    }

    /// Whether this is a lower file (opened or not), not copied up.
    pub fn is_lower(&self) -> bool {
        matches!(
            &*self.read_data(),
            FileData::Lower(_) | FileData::Unopened(..)
        )
    }

    pub fn is_partial(&self) -> bool {
        matches!(&*self.read_data(), FileData::Partial(_))
    }

    /// Whether this is a partial file whose writers pass through (file/partial/precontent.rs).
    pub fn is_marked(&self) -> bool {
        matches!(&*self.read_data(), FileData::Partial(p) if p.by_events.is_some())
    }

    /// Serves this partial file's writers by passthrough: its pending blocks go to the upper
    /// file, which gets the pre-content mark. Returns whether the file is so served now.
    pub fn serve_by_events(self: &Arc<Self>, events: &Arc<PreContent>) -> Result<bool> {
        let mut data = self.write_data();
        let FileData::Partial(p) = &mut *data else {
            return Ok(false);
        };
        if p.by_events.is_some() {
            return Ok(true);
        }
        if p.upper.disk_fd().is_err() {
            return Ok(false);
        }
        // Nothing of the file may stay only in memory: a writer passing through goes to the
        // upper file, and the file there must have its full size.
        p.flush_pending()?;
        let fd = p.upper.disk_fd()?;
        let me: std::sync::Weak<dyn FillOnAccess> = Arc::downgrade(self) as _;
        let mark = events.mark(fd, me, p.owner.number)?;
        p.by_events = Some(Box::new(crate::file::partial::ByEvents::new(mark)));
        Ok(true)
    }

    /// Reaches the upper file of this partial file through a descriptor whose own reads and
    /// writes raise no pre-content event (sys `open_unwatched`): for a file a daemon before
    /// this one marked, as a daemon's own descriptors opened before the mark are.
    pub fn unwatch_upper(&self) -> Result<()> {
        let mut data = self.write_data();
        if let FileData::Partial(p) = &mut *data
            && let crate::upper::UpperFile::Disk(fd) = &p.upper
        {
            p.upper = crate::upper::UpperFile::Disk(crate::sys::open_unwatched(
                std::os::fd::AsFd::as_fd(fd),
            )?);
        }
        Ok(())
    }

    /// A partial file that holds blocks written to it, not only the lower file's metadata.
    pub fn has_blocks_of_its_own(&self) -> bool {
        matches!(&*self.read_data(), FileData::Partial(p) if !p.blocks.is_empty())
    }

    /// How many bytes making this file a complete upper file would copy from the lower layer:
    /// all of a lower file, what a partial file still lacks; `None` for a complete file.
    pub fn bytes_to_copy(&self) -> Option<u64> {
        match &*self.read_data() {
            FileData::Upper(_) => None,
            FileData::Lower(src) => Some(src.size().unwrap_or(u64::MAX)),
            // Not known without a call to the store; only asked of files copied up.
            FileData::Unopened(..) => Some(u64::MAX),
            FileData::Partial(p) => {
                let blocks = p.fill_limit().div_ceil(p.block);
                Some(blocks.saturating_sub(p.blocks.block_count()) * p.block)
            }
        }
    }

    /// Blocks present and blocks that need the lower file, for a partial file.
    pub fn partial_progress(&self) -> Option<Progress> {
        match &*self.read_data() {
            FileData::Partial(p) => Some(Progress {
                present: p.blocks.block_count(),
                total: p.fill_limit().div_ceil(p.block),
                missing_bytes: (p.fill_limit().div_ceil(p.block))
                    .saturating_sub(p.blocks.block_count())
                    * p.block,
                requests_in_run: self.requests_in_run(Instant::now()),
                closed: false,
                last_write: p.last_write,
                unlinked: p.upper.stat().is_ok_and(|a| a.nlink == 0),
                writer_opens: self.writer_opens.load(std::sync::atomic::Ordering::Relaxed),
                reopened: self.reopened.load(std::sync::atomic::Ordering::Relaxed),
                events: p.by_events.is_some(),
            }),
            _ => None,
        }
    }

    /// Completion step: fills up to `n` missing blocks from block `from` on. Returns the block
    /// to continue at and how many were filled, or `None` when nothing is left to fill.
    pub fn fill_chunk(&self, from: u64, n: u64) -> Result<Option<(u64, u64)>> {
        let mut data = self.write_data();
        let FileData::Partial(p) = &mut *data else {
            return Ok(None);
        };
        let limit = p.fill_limit().div_ceil(p.block);
        if from >= limit {
            return Ok(None);
        }
        let end = (from + n).min(limit);
        let filled = p.fill_missing(from, end, true)?;
        Ok(Some((end, filled)))
    }

    /// Fills every pending block of this file (unmount).
    pub fn flush_pending(&self) -> Result<()> {
        match &mut *self.write_data() {
            FileData::Partial(p) => p.flush_pending(),
            _ => Ok(()),
        }
    }

    /// Writes the bytes a daemon before this one left pending in block `left.block`
    /// (file/partial/arena.rs). A file that is no longer partial was completed, and completion
    /// filled its pending blocks first.
    pub fn write_left(&self, left: &crate::file::partial::arena::LeftBlock) -> Result<()> {
        match &mut *self.write_data() {
            FileData::Partial(p) => p.write_left(left),
            _ => Ok(()),
        }
    }

    /// Copy-after-write worker step: fills block `blk` if it is still pending.
    pub fn fill_pending(&self, blk: u64) -> Result<bool> {
        let mut data = self.write_data();
        match &mut *data {
            FileData::Partial(p) if p.pending.contains_key(&blk) => {
                p.fill_block(blk)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Completion's last step: once no block below `valid` is missing, makes the data durable
    /// and removes the mark. Returns whether the file is now complete.
    pub fn finish_completion(
        &self,
        names: &crate::layers::XattrNames,
        skip_fsync: bool,
    ) -> Result<bool> {
        let mut data = self.write_data();
        let FileData::Partial(p) = &mut *data else {
            return Ok(false);
        };
        let limit = p.fill_limit().div_ceil(p.block);
        if (0..limit).any(|b| p.needs_fill(b)) {
            return Ok(false);
        }
        // Durable data before the mark goes: a hole must never lose its meaning "read lower"
        // while the block that replaced it is not yet on disk.
        if !skip_fsync {
            p.upper.datasync()?;
        }
        PartialMark::remove(&p.upper, names)?;
        let upper = p.upper.try_clone()?;
        *data = FileData::Upper(upper);
        Ok(true)
    }
}
