//! Partial files served by FUSE passthrough: fanotify pre-content events (Linux 6.14+) tell
//! the daemon of each read or write of a marked upper file before it happens, so a partial
//! file's sparse upper file can be the passthrough backing of a writer from its first open.
//!
//! How it holds the partial-file invariant (file/partial/mark.rs: a hole below `valid` means "read
//! the lower file"): while a partial file is served so, its upper file carries a `FAN_PRE_ACCESS`
//! mark of this mount's group. Every access of a range that still holds a hole waits until the
//! daemon has filled that range's blocks from the lower file (whole blocks, under the file's lock,
//! `FillOnAccess`), and only then goes on; an access of a range with no hole is let through at
//! once. So no access ever lands in, or reads, a hole that means "lower". When the file is complete
//! the mark goes, and every open of it, those already open included, runs natively from then on.
//!
//! Which opens are served so: writable opens that cannot map the file (`O_WRONLY`). A read or
//! write raises an event through passthrough, but mmap does not: the kernel raises the mmap
//! event on the FUSE file, not on the backing file, and page faults raise none (measured on
//! Linux 6.18: a mapping of a marked upper file through a stacked file read zeros where the
//! lower file has data; docs/KERNEL-NOTES.md). A readable open of a partial file therefore
//! stays on the daemon path, where the FUSE page cache serves mappings correctly.
//!
//! Threads: a reader takes events in batches and answers at once those that need nothing
//! (the range holds no hole, or the daemon itself is the accessor: its own descriptors of an
//! upper file were opened before the mark and raise no events, but a truncate raises one by
//! path); it never takes a file's lock, so the daemon's own truncate under that lock cannot
//! wait on it. The rest go to a filler thread, which takes the file's lock to fill. Events of
//! one file are filled one after another, so a range is never filled twice over a write.
//!
//! A daemon that dies: on a mount that survives its daemon (takeover.rs) the holder keeps the
//! group, so the marks stay and events wait for the next daemon, and keeps the table of what
//! the daemon was in the middle of (served.rs): which object each marked file belongs to, and
//! the events read and not answered. The next daemon fills and answers those before it reads
//! an event itself (`answer_left`), and opens the object of an event on a file it never
//! opened by its number (`resolve`), keeping it open, and so marked, until the file is
//! complete or the mount ends (`stand_ins`): a writer passing through may still hold it.
//!
//! Where no daemon follows (no holder, or a holder that gives up), the group is kept by a
//! guardian process (`mosaicfs __guardian`) that does nothing while the daemon lives. When
//! the daemon dies, the guardian answers every event the daemon left unanswered, and every
//! later one on a range that holds a hole, with EIO: a writer still holding a passthrough
//! descriptor gets an error instead of writing into a hole (which would make the rest of that
//! block read as zeros). Without the guardian the kernel would let those accesses through
//! when the group's last descriptor closed. A holder that gives up becomes the guardian.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak, mpsc};

use crate::error::{Error, Result};
use crate::file::partial::served::{Left, Recorded, Served};
use crate::sys::{self, AccessEvent};

/// What the filler needs of an open partial file.
pub trait FillOnAccess: Send + Sync {
    /// Fills every block of `[off, off + len)` that still reads the lower file, so that the
    /// range can be read and written in the upper file itself.
    fn fill_range(&self, off: u64, len: u64) -> Result<()>;

    /// `fill_range` if the file's lock is free now; `None` if another thread holds it.
    fn try_fill_range(&self, off: u64, len: u64) -> Option<Result<()>>;
}

/// Counters for `mosaicfs status`.
#[derive(Default)]
pub struct AccessStats {
    /// Events answered at once (no hole in the range, or the daemon's own access).
    pub answered_at_once: AtomicU64,
    /// Events that filled blocks first.
    pub filled: AtomicU64,
    /// Events refused (the file could not be filled).
    pub refused: AtomicU64,
}

/// Identity of an upper file: device and inode number.
type Key = crate::file::partial::served::Key;

/// How a daemon that took the mount over opens the partial file of an object its predecessor
/// marked, by the object's number, served by events (so marked and known by its key again):
/// `None` when the file is no partial file any more.
pub type Resolve = Box<dyn Fn(u64) -> Result<Option<Arc<dyn FillOnAccess>>> + Send + Sync>;

/// An event read and not answered yet, with where it is recorded.
struct InService {
    ev: AccessEvent,
    rec: Recorded,
}

/// This mount's pre-content group and the partial files marked in it.
pub struct PreContent {
    group: OwnedFd,
    files: Mutex<HashMap<Key, Weak<dyn FillOnAccess>>>,
    filler: Mutex<Option<mpsc::Sender<InService>>>,
    /// What this daemon is in the middle of, for the next one (a mount that may survive its
    /// daemon only).
    served: Option<Served>,
    /// Marked files of the daemons before that this one has not opened yet: key to number.
    left_files: Mutex<HashMap<Key, u64>>,
    /// What the daemon before left unanswered, until `answer_left`.
    left: Mutex<Left>,
    /// Files opened for events of the daemons before (`resolve`): kept until unmarked.
    stand_ins: Mutex<HashMap<Key, Arc<dyn FillOnAccess>>>,
    resolve: std::sync::OnceLock<Resolve>,
    /// The daemon hands the mount over (`mosaicfs upgrade`): files let go of keep their marks
    /// and records, for the next daemon and the writers still passing through.
    handing_over: AtomicBool,
    pid: i32,
    pub stats: AccessStats,
    guardian: Mutex<Option<Guardian>>,
    started: AtomicBool,
    /// The work dir's path: it names this mount's guardian among processes (`Guardian`).
    work: std::path::PathBuf,
    /// Tests only (`MOSAICFS_TEST_SLOW_FILL=ms`): each fill waits this long first, so that a
    /// test can kill the daemon while an access waits on an event.
    slow_fill: Option<std::time::Duration>,
    /// Tests only (`MOSAICFS_TEST_SLOW_RECORD=ms`): a batch read waits this long before its
    /// events are recorded, so that a test can kill the daemon while they are unrecorded.
    slow_record: Option<std::time::Duration>,
}

/// A mark on one upper file, removed by `remove` with a descriptor of that file (the file
/// complete, or closed for good). It holds no descriptor of its own: open partial files are
/// counted against the daemon's limit (file/mod.rs `FdReserve`), and a mark is not one more.
pub struct AccessMark {
    owner: Arc<PreContent>,
    key: Key,
}

impl AccessMark {
    pub fn remove(self, file: std::os::fd::BorrowedFd<'_>) {
        self.owner.unmark(self.key, file);
    }
}

impl PreContent {
    /// Makes the group and checks that the upper file system takes marks, on a scratch file
    /// in the work dir; or takes over the group and table a holder kept (`inherited`). With
    /// `survives` (the mount may outlive its daemon) a table of what is in service is kept.
    /// Err says why partial files stay on the daemon path.
    pub fn open(
        work: std::os::fd::BorrowedFd<'_>,
        inherited: Option<(OwnedFd, OwnedFd)>,
        survives: bool,
    ) -> std::result::Result<Arc<PreContent>, String> {
        let dir = work;
        let work = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .map_err(|e| format!("cannot name the work dir: {e}"))?;
        let (group, served, left) = match inherited {
            Some((group, table)) => {
                let (served, left) = Served::adopt(table)
                    .map_err(|e| format!("cannot read the pre-content table kept: {e}"))?;
                (group, Some(served), left)
            }
            None => {
                let group = Self::new_group(dir, &work)?;
                let served = survives
                    .then(Served::create)
                    .transpose()
                    .map_err(|e| format!("cannot make the pre-content table: {e}"))?;
                (group, served, Left::default())
            }
        };
        Ok(Arc::new(PreContent {
            work,
            slow_fill: std::env::var("MOSAICFS_TEST_SLOW_FILL")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map(std::time::Duration::from_millis),
            slow_record: std::env::var("MOSAICFS_TEST_SLOW_RECORD")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map(std::time::Duration::from_millis),
            group,
            files: Mutex::new(HashMap::new()),
            filler: Mutex::new(None),
            served,
            left_files: Mutex::new(left.files.clone()),
            left: Mutex::new(left),
            stand_ins: Mutex::new(HashMap::new()),
            resolve: std::sync::OnceLock::new(),
            handing_over: AtomicBool::new(false),
            pid: std::process::id() as i32,
            stats: AccessStats::default(),
            guardian: Mutex::new(None),
            started: AtomicBool::new(false),
        }))
    }

    /// A new group, checked on a scratch file of the work dir (`dir`, at `work`).
    fn new_group(
        dir: std::os::fd::BorrowedFd<'_>,
        work: &std::path::Path,
    ) -> std::result::Result<OwnedFd, String> {
        let group = sys::pre_content_group(true).map_err(|e| {
            if e.is(libc::EPERM) {
                "making a fanotify group needs CAP_SYS_ADMIN (a rootless mount)".to_string()
            } else if e.is(libc::EINVAL) {
                "the kernel has no fanotify pre-content events (Linux 6.14 or later)".to_string()
            } else {
                format!("fanotify_init failed: {e}")
            }
        })?;
        let probe = rustix::fs::openat(
            dir,
            ".",
            rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .map_err(|e| format!("cannot make a scratch file in the work dir: {e}"))?;
        sys::mark_pre_access(group.as_fd(), probe.as_fd(), true).map_err(|e| {
            format!(
                "the upper file system takes no pre-content marks ({e}); ext4, XFS and btrfs do"
            )
        })?;
        let _ = sys::mark_pre_access(group.as_fd(), probe.as_fd(), false);
        // A guardian left by a daemon of this work dir that died guards files this mount
        // will serve: its group would refuse their writers. It goes before the mount is up.
        Guardian::dismiss_stale(work);
        Ok(group)
    }

    /// The group and the table, for the holder to keep (a mount that survives its daemon).
    pub fn kept(&self) -> Option<(std::os::fd::BorrowedFd<'_>, std::os::fd::BorrowedFd<'_>)> {
        self.served.as_ref().map(|s| (self.group.as_fd(), s.fd()))
    }

    /// The work dir's path.
    pub fn work(&self) -> &std::path::Path {
        &self.work
    }

    /// Starts a guardian for the mount at `mountpoint` (mounted by now), unless a holder keeps
    /// the group (`held`).
    pub fn guard(&self, mountpoint: &std::path::Path, held: bool) -> Result<()> {
        let mut guardian = self.guardian.lock().unwrap_or_else(|e| e.into_inner());
        if !held && guardian.is_none() {
            *guardian = Some(Guardian::spawn(self.group.as_fd(), &self.work, mountpoint)?);
        }
        Ok(())
    }

    /// Starts the reader and filler threads (once). A daemon that took the mount over first
    /// answers what the daemon before left (`resolve` opens its files).
    pub fn start(self: &Arc<Self>, resolve: Resolve) -> Result<()> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let _ = self.resolve.set(resolve);
        self.answer_left();
        let (tx, rx) = mpsc::channel::<InService>();
        *self.filler.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        let me = self.clone();
        std::thread::Builder::new()
            .name("mosaicfs-fill".into())
            .spawn(move || {
                for ev in rx {
                    me.fill(ev);
                }
            })?;
        let me = self.clone();
        std::thread::Builder::new()
            .name("mosaicfs-events".into())
            .spawn(move || me.read_events())?;
        Ok(())
    }

    /// Marks the upper file `file` of the partial file `owner`; the mark lasts as long as the
    /// returned guard. `file` must have been opened before (the daemon's own descriptors of
    /// the file raise no events only if they were).
    /// `number`: the object's, for a daemon that takes the mount over.
    pub fn mark(
        self: &Arc<Self>,
        file: std::os::fd::BorrowedFd<'_>,
        owner: Weak<dyn FillOnAccess>,
        number: u64,
    ) -> Result<AccessMark> {
        let attr = sys::fstat(file)?;
        let key = (attr.dev, attr.ino);
        // Recorded before the mark: every event the group raises is of a recorded file.
        if let Some(served) = &self.served
            && !served.add_file(key, number)
        {
            return Err(Error::with_context(
                libc::ENFILE,
                "the table of marked files a next daemon reads is full",
            ));
        }
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, owner);
        if let Err(e) = sys::mark_pre_access(self.group.as_fd(), file, true) {
            self.files
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
            if let Some(served) = &self.served {
                served.remove_file(key);
            }
            return Err(e);
        }
        Ok(AccessMark {
            owner: self.clone(),
            key,
        })
    }

    /// The daemon is (`true`) or is no longer handing the mount over.
    pub fn hand_over(&self, on: bool) {
        self.handing_over.store(on, Ordering::SeqCst);
    }

    fn unmark(&self, key: Key, file: std::os::fd::BorrowedFd<'_>) {
        if self.handing_over.load(Ordering::SeqCst) {
            self.files
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
            return;
        }
        // The mark first: an event raised before it went still finds the file to fill.
        // ENOENT: the kernel dropped it already (the file was removed).
        if let Err(e) = sys::mark_pre_access(self.group.as_fd(), file, false)
            .or_else(|e| if e.is(libc::ENOENT) { Ok(()) } else { Err(e) })
        {
            log::warn!(
                "removing the pre-content mark of upper inode {}: {e}",
                key.1
            );
        }
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        if let Some(served) = &self.served {
            served.remove_file(key);
        }
        // Dropped out of the lock: the caller holds the file (it is completing it).
        let stand_in = self
            .stand_ins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        drop(stand_in);
    }

    /// The counters, as `name=N` words (the unmount log line, `mosaicfs status`).
    pub fn summary(&self) -> String {
        format!(
            "marked-files={} event-fills={} answered-at-once={} refused={}",
            self.marked(),
            self.stats.filled.load(Ordering::Relaxed),
            self.stats.answered_at_once.load(Ordering::Relaxed),
            self.stats.refused.load(Ordering::Relaxed)
        )
    }

    /// How many upper files carry a mark now.
    pub fn marked(&self) -> usize {
        self.files.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Answers the event, then clears its record, then closes its descriptor: its number is
    /// handed out again only after its record is gone.
    fn answer(&self, ev: InService, deny_with: Option<i32>) {
        if let Err(e) = sys::answer_access(self.group.as_fd(), ev.ev.fd.as_raw_fd(), deny_with) {
            log::error!("answering a pre-content event failed: {e}");
        }
        if let Some(served) = &self.served {
            served.answered(ev.rec);
        }
    }

    /// Reads a batch of events, each recorded for the next daemon before it is served.
    fn read_batch(&self, buf: &mut Vec<u8>) -> Result<Vec<InService>> {
        let Some(served) = &self.served else {
            let events = sys::read_access_events(self.group.as_fd(), buf)?;
            return Ok(events
                .into_iter()
                .map(|ev| InService {
                    ev,
                    rec: Recorded::Not,
                })
                .collect());
        };
        // Wait first, so that the read below returns at once: events read and not yet
        // recorded are unknown to a next daemon (served.rs).
        let mut fds = [rustix::event::PollFd::new(
            &self.group,
            rustix::event::PollFlags::IN,
        )];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        served.reading(true);
        let events = sys::read_access_events(self.group.as_fd(), buf);
        if let Some(pause) = self.slow_record {
            std::thread::sleep(pause);
        }
        let events = events.map(|events| {
            events
                .into_iter()
                .map(|ev| {
                    let rec = match sys::fstat(ev.fd.as_fd()) {
                        Ok(a) => served.add_event(ev.fd.as_raw_fd(), (a.dev, a.ino), ev.range),
                        // No file to name: a next daemon answers it without a fill.
                        Err(_) => served.add_event(ev.fd.as_raw_fd(), (0, 0), ev.range),
                    };
                    InService { ev, rec }
                })
                .collect()
        });
        served.reading(false);
        events
    }

    /// The reader: answers what needs no fill, hands the rest to the filler.
    fn read_events(&self) {
        let mut buf = Vec::new();
        loop {
            let events = match self.read_batch(&mut buf) {
                Ok(events) => events,
                Err(e) => {
                    log::error!("reading pre-content events failed, stopping: {e}");
                    return;
                }
            };
            for ev in events {
                if ev.ev.pid == self.pid || !self.holds_hole(&ev.ev) {
                    self.stats.answered_at_once.fetch_add(1, Ordering::Relaxed);
                    self.answer(ev, None);
                    continue;
                }
                // Filled here when the file's lock is free (no thread switch); a thread that
                // holds it may be waiting on an event of its own, so never wait for it here.
                let ev = match self.try_fill_here(ev) {
                    Ok(()) => continue,
                    Err(ev) => ev,
                };
                let sent = self
                    .filler
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|tx| tx.send(ev));
                if let Some(Err(mpsc::SendError(ev))) = sent {
                    self.answer(ev, Some(libc::EIO));
                }
            }
        }
    }

    /// Whether the event's range holds a hole before the end of the file (one `lseek`, and
    /// an `fstat` only when it finds one). An error counts as a hole: the filler decides.
    fn holds_hole(&self, ev: &AccessEvent) -> bool {
        let Some((off, len)) = ev.range else {
            return false;
        };
        sys::has_hole(ev.fd.as_fd(), off, len.max(1)).unwrap_or(true)
    }

    /// The open partial file an event's descriptor is of, if it is marked.
    fn file_of(&self, ev: &AccessEvent) -> Option<Arc<dyn FillOnAccess>> {
        let a = sys::fstat(ev.fd.as_fd()).ok()?;
        self.file_by_key((a.dev, a.ino))
    }

    fn file_by_key(&self, key: Key) -> Option<Arc<dyn FillOnAccess>> {
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .and_then(Weak::upgrade)
    }

    /// The open partial file of upper file `key`: this daemon's, or one a daemon before
    /// marked, opened now by its number (takes the file's lock: never from the reader).
    /// `None`: not marked (complete). Err: marked, and its file cannot be opened.
    fn resolve_key(&self, key: Key) -> Result<Option<Arc<dyn FillOnAccess>>> {
        if let Some(file) = self.file_by_key(key) {
            return Ok(Some(file));
        }
        let number = self
            .left_files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .copied();
        let (Some(number), Some(resolve)) = (number, self.resolve.get()) else {
            return Ok(None);
        };
        let file = resolve(number)?;
        self.left_files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        match &file {
            Some(f) => {
                self.stand_ins
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, f.clone());
            }
            // Complete: the daemon before ended between its unmark and the record's.
            None => {
                if let Some(served) = &self.served {
                    served.remove_file(key);
                }
            }
        }
        Ok(file)
    }

    /// Fills and answers what the daemon before left unanswered, before this daemon reads an
    /// event (a number of its own could equal one of those). With events no slot recorded,
    /// every marked file is filled whole and every number answered (served.rs).
    fn answer_left(&self) {
        let left = std::mem::take(&mut *self.left.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(served) = &self.served else { return };
        if left.events.is_empty() && !left.unknown {
            return;
        }
        log::info!(
            "answering the pre-content events the daemon before left: {}",
            if left.unknown {
                format!(
                    "some unrecorded, so every marked file ({}) is filled first",
                    left.files.len()
                )
            } else {
                format!("{}", left.events.len())
            }
        );
        let fill = |key: Key, range: Option<(u64, u64)>| -> Result<()> {
            let Some(file) = self.resolve_key(key)? else {
                return Ok(());
            };
            let (off, len) = range.unwrap_or((0, u64::MAX));
            file.fill_range(off, len.max(1))
        };
        let refusal = |e: &Error| match e.errno() {
            e @ (libc::ENOSPC | libc::EDQUOT | libc::EPERM | libc::EACCES) => e,
            _ => libc::EIO,
        };
        if left.unknown {
            let mut deny = None;
            for &key in left.files.keys() {
                if let Err(e) = fill(key, None) {
                    log::error!("filling a partial file whole for the events left failed: {e}");
                    deny = Some(refusal(&e));
                }
            }
            let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .maximum
                .unwrap_or(1 << 20)
                .min(1 << 20) as i32;
            for n in 0..limit {
                let _ = sys::answer_access(self.group.as_fd(), n, deny);
            }
        } else {
            // Every range first, then every number once: a number answered twice would
            // answer whatever event holds it next.
            let mut answers: HashMap<i32, Option<i32>> = HashMap::new();
            for ev in &left.events {
                let deny = fill(ev.key, ev.range).err().map(|e| {
                    log::error!("filling a range for an event left failed: {e}");
                    refusal(&e)
                });
                let slot = answers.entry(ev.fd).or_insert(None);
                *slot = slot.or(deny);
            }
            for (fd, deny) in answers {
                // ENOENT: answered by the daemon before after all.
                let _ = sys::answer_access(self.group.as_fd(), fd, deny);
            }
        }
        served.forget_left_events();
    }

    /// Fills and answers the event in the reader if its file's lock is free; else gives it
    /// back for the filler.
    fn try_fill_here(&self, ev: InService) -> std::result::Result<(), InService> {
        let (off, len) = ev.ev.range.unwrap_or((0, 0));
        let Some(file) = self.file_of(&ev.ev) else {
            return Err(ev);
        };
        if let Some(pause) = self.slow_fill {
            std::thread::sleep(pause);
        }
        match file.try_fill_range(off, len.max(1)) {
            None => Err(ev),
            Some(result) => {
                self.answer_filled(ev, result);
                Ok(())
            }
        }
    }

    fn answer_filled(&self, ev: InService, result: Result<()>) {
        match result {
            Ok(()) => {
                self.stats.filled.fetch_add(1, Ordering::Relaxed);
                self.answer(ev, None);
            }
            Err(e) => {
                let (off, len) = ev.ev.range.unwrap_or((0, 0));
                // The errnos a denial may carry (Linux 6.14 `fanotify_is_valid_errno`): a
                // full disk is ENOSPC to the writer, as a write of its own would be.
                let errno = match e.errno() {
                    e @ (libc::ENOSPC | libc::EDQUOT | libc::EPERM | libc::EACCES) => e,
                    _ => libc::EIO,
                };
                log::error!(
                    "filling {len} bytes at {off} of a partial file for process {} failed, \
                     refused with errno {errno}: {e}",
                    ev.ev.pid
                );
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                self.answer(ev, Some(errno));
            }
        }
    }

    /// The filler: fills the event's range in its partial file, then lets the access go on.
    fn fill(&self, ev: InService) {
        let (off, len) = ev.ev.range.unwrap_or((0, 0));
        let file = sys::fstat(ev.ev.fd.as_fd()).and_then(|a| self.resolve_key((a.dev, a.ino)));
        let result = match file {
            Ok(Some(f)) => f.fill_range(off, len.max(1)),
            // Unmarked meanwhile: complete, so its holes are the file's own.
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        self.answer_filled(ev, result);
    }

    /// At unmount, after every mark went: the guardian may go.
    pub fn stop(&self) {
        let stand_ins =
            std::mem::take(&mut *self.stand_ins.lock().unwrap_or_else(|e| e.into_inner()));
        drop(stand_ins);
        if let Some(g) = self
            .guardian
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            g.dismiss();
        }
    }
}

/// The guardian process: holds the group so that it outlives the daemon.
struct Guardian {
    child: std::process::Child,
    alive: OwnedFd,
}

/// What the daemon writes to the guardian before it exits cleanly.
const DISMISS: u8 = b'q';

impl Guardian {
    fn spawn(
        group: std::os::fd::BorrowedFd<'_>,
        work: &std::path::Path,
        mountpoint: &std::path::Path,
    ) -> Result<Guardian> {
        // After a crash the guardian stays while any process holds a file of this mount.
        let mount = sys::mount_id(mountpoint)?;
        let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // The two descriptors the guardian inherits (set inheritable only for the spawn: the
        // daemon starts no other process meanwhile).
        let inherit = |fd: std::os::fd::BorrowedFd<'_>, on: bool| {
            let flags = if on {
                rustix::io::FdFlags::empty()
            } else {
                rustix::io::FdFlags::CLOEXEC
            };
            rustix::io::fcntl_setfd(fd, flags)
        };
        inherit(group, true)?;
        inherit(read_end.as_fd(), true)?;
        let child = std::process::Command::new("/proc/self/exe")
            .arg(GUARDIAN_COMMAND)
            .arg(group.as_raw_fd().to_string())
            .arg(read_end.as_raw_fd().to_string())
            .arg(work)
            .arg(mount.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        inherit(group, false)?;
        drop(read_end);
        let child = child.map_err(|e| {
            Error::with_context(
                libc::EIO,
                format!("cannot start the pre-content guardian process: {e}"),
            )
        })?;
        Ok(Guardian {
            child,
            alive: write_end,
        })
    }

    /// Ends the guardians of `work` whose daemon died (their command line names the work
    /// dir), waiting up to 2 s for each to let go of its group.
    fn dismiss_stale(work: &std::path::Path) {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        let me = std::process::id();
        for pid in procs.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
            if pid == me {
                continue;
            }
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let ours = args.get(1) == Some(&GUARDIAN_COMMAND.as_bytes())
                && args.get(4) == Some(&work.as_os_str().as_encoded_bytes());
            if !ours {
                continue;
            }
            log::warn!(
                "ending guardian process {pid} of a daemon of this work dir that died: this \
                 mount serves its files now"
            );
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid as i32).expect("a pid above 0"),
                rustix::process::Signal::TERM,
            );
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            // Gone, or a zombie (PID 1 may not reap it): its descriptors are closed then.
            while std::time::Instant::now() < deadline
                && std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .is_ok_and(|mut d| d.next().is_some())
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }

    fn dismiss(mut self) {
        let _ = rustix::io::write(&self.alive, &[DISMISS]);
        drop(self.alive);
        let _ = self.child.wait();
    }
}

/// The hidden command line the guardian runs as.
pub const GUARDIAN_COMMAND: &str = "__guardian";

/// The guardian's main: waits for the daemon to go; if it went without dismissing it (a
/// crash), refuses every access of a hole in a marked file from then on.
pub fn guardian_main(args: &[std::ffi::OsString]) -> i32 {
    let fd = |i: usize| -> Option<OwnedFd> {
        let n: i32 = args.get(i)?.to_str()?.parse().ok()?;
        sys::inherited_fd(n)
    };
    let (Some(group), Some(alive)) = (fd(0), fd(1)) else {
        eprintln!("mosaicfs: {GUARDIAN_COMMAND} is started by the daemon, not by hand");
        return 2;
    };
    let _ = rustix::io::fcntl_setfd(&group, rustix::io::FdFlags::CLOEXEC);
    // Whatever else the daemon left inheritable (the pipe its parent waits on for the end of
    // the mount's start) is not the guardian's to hold.
    sys::close_other_fds(&[group.as_raw_fd(), alive.as_raw_fd()]);
    let mut byte = [0u8; 1];
    loop {
        match rustix::io::read(&alive, &mut byte) {
            Ok(1) if byte[0] == DISMISS => return 0,
            Ok(1) => continue,
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
    }
    // The daemon died. Events it read and never answered wait on their descriptor numbers,
    // which died with it: answer every number it could have held.
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .unwrap_or(1 << 20)
        .min(1 << 20) as i32;
    for n in 0..limit {
        let _ = sys::answer_access(group.as_fd(), n, Some(libc::EIO));
    }
    // To the system log: the guardian's standard streams are /dev/null (whoever reads the
    // daemon's would otherwise wait for the guardian to close them too).
    crate::logging::init(false);
    crate::logging::to_background(None);
    log::error!(
        "the daemon of work dir {} died: reads and writes of unfilled ranges of its partial \
         files fail with EIO until they are closed (remount the overlay)",
        args.get(2).map_or("?".into(), |a| a.to_string_lossy())
    );
    // Until no process holds a file of the dead mount: only those could reach the marked
    // files through passthrough (the next mount of the work dir ends the guardian earlier).
    let mount: Option<u64> = args.get(3).and_then(|a| a.to_str()?.parse().ok());
    let mut buf = Vec::new();
    let mut looked = std::time::Instant::now();
    loop {
        let mut fds = [rustix::event::PollFd::new(
            &group,
            rustix::event::PollFlags::IN,
        )];
        let timeout = rustix::event::Timespec {
            tv_sec: 2,
            tv_nsec: 0,
        };
        let ready = rustix::event::poll(&mut fds, Some(&timeout)).unwrap_or(0);
        if ready > 0 {
            let Ok(events) = sys::read_access_events(group.as_fd(), &mut buf) else {
                return 1;
            };
            for ev in events {
                let hole = match ev.range {
                    None => false,
                    Some((off, len)) => {
                        sys::has_hole(ev.fd.as_fd(), off, len.max(1)).unwrap_or(true)
                    }
                };
                let _ =
                    sys::answer_access(group.as_fd(), ev.fd.as_raw_fd(), hole.then_some(libc::EIO));
            }
        }
        if looked.elapsed() >= std::time::Duration::from_secs(2) {
            looked = std::time::Instant::now();
            if mount.is_some_and(|id| !sys::mount_in_use(id)) {
                return 0;
            }
        }
    }
}
