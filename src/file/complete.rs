//! Completion: turning partial files into ordinary upper files in the background.
//!
//! A partial file costs the blocks written, in time and in space, and by default it stays
//! that way: completion copies the rest of the file, so it is done only where that pays
//! (docs/PERFORMANCE.md, "When completion pays"):
//!
//! - **Sustained use** (`complete_busy=`, on where passthrough serves complete files): every
//!   read and write of a partial file goes through the daemon, a FUSE round trip that a
//!   complete file opened later is spared. Once the requests of one run of use (no gap of
//!   `BUSY_GAP`) have cost more than the copy would (`busy_threshold`), the file is completed
//!   once no handle has it open (a handle keeps the path it was opened with): the rent-or-buy
//!   rule, which never pays more than twice the better of the two.
//! - **Small files opened for writing** (`copy_whole=`, io.rs), where passthrough serves them.
//! - **Clones** cost no space: where the upper file system can clone the lower file's extents
//!   (XFS, btrfs), copy-up is a clone and there is no partial file at all (copy_up.rs).
//!
//! Where nothing passes through (a rootless mount, a kernel without FUSE passthrough,
//! `passthrough=off`, `upper=memory`) a complete file is served exactly as a partial one, so
//! completion would only cost: there, by default, it never happens. `complete_after=` (idle
//! time), `complete_ratio=` (share of blocks present) and `complete_on_reopen=` (a second
//! writable open) are explicit choices, off by default.
//!
//! Completion fills every hole below `valid` from the lower file — whole blocks only, a chunk
//! at a time under the file's lock, so readers and writers interleave and the partial-file
//! invariant holds at every step — then makes the data durable (fdatasync) and only then
//! removes the mark. A crash at any point leaves either a valid partial file or a complete
//! one. Afterwards the file is a plain upper file: kernel overlayfs reads it correctly and
//! mosaicfs serves it with passthrough.
//!
//! Every open file that is or becomes partial is registered once (not per write) in a queue;
//! it stays there while it is open, or while a rule can still make it due after its last
//! close (`release`). A worker thread looks at the queue every half idle time (at most once a
//! second). This file holds the policy and the queue, below the overlay that owns one; the
//! worker and the completion itself are completion.rs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::file::{BUSY_GAP, OpenFile, Progress};
use crate::options::CompletionPolicy;

/// At most this many partial files wait for completion at once (each holds two descriptors);
/// past it a file is completed when it is next opened and goes idle.
const MAX_QUEUED: usize = 512;
/// Blocks filled per lock hold.
pub(crate) const CHUNK_BLOCKS: u64 = 256;
/// How long a file must go without writes before the share-of-blocks trigger completes it.
const SETTLE: Duration = Duration::from_millis(250);
/// What a data request through the daemon costs beyond the same request passed through: a
/// FUSE round trip and the daemon's work (docs/PERFORMANCE.md, "When completion pays").
const REQUEST_COST: Duration = Duration::from_micros(20);
/// How fast a completion copies, to price it against requests (docs/PERFORMANCE.md).
const COPY_RATE: u64 = 1 << 30;
/// The fewest requests of a run that make a file busy, whatever its size: a few hundred
/// requests are a file being read or written once, not a file in sustained use.
const BUSY_MIN_REQUESTS: u64 = 1000;

/// The requests through the daemon at which a file with `missing` bytes to copy is busy:
/// where they have cost as much time as the copy would (rent or buy).
pub fn busy_threshold(missing: u64) -> u64 {
    // Tests (the fsx model) make the rule fire within a few operations.
    static FOR_TESTS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    if let Some(n) = FOR_TESTS.get_or_init(|| {
        std::env::var("MOSAICFS_TEST_BUSY_REQUESTS")
            .ok()
            .and_then(|v| v.parse().ok())
    }) {
        return *n;
    }
    let copy = missing as f64 / COPY_RATE as f64;
    ((copy / REQUEST_COST.as_secs_f64()).ceil() as u64).max(BUSY_MIN_REQUESTS)
}

impl CompletionPolicy {
    /// Why a partial file with progress `p` is to be completed now, if it is. `native`: this
    /// mount's complete files are served by passthrough.
    pub fn due(&self, p: &Progress, now: Instant, native: bool) -> Option<String> {
        let idle = now.duration_since(p.last_write);
        if p.unlinked {
            return Some("deleted, nothing to complete".into());
        }
        if self.after_idle.is_some_and(|d| idle >= d) {
            return Some(format!("no write for {:.1} s", idle.as_secs_f64()));
        }
        // A file whose writers pass through needs no completion to be fast: a second open
        // is no reason to copy it, nor are requests that never reach the daemon.
        if self.on_reopen_below > 0 && p.reopened && !p.events {
            return Some(format!(
                "opened for writing again after a write or an earlier writable open ({} opens)",
                p.writer_opens
            ));
        }
        if self.ratio > 0.0
            && p.present as f64 >= self.ratio * p.total.max(1) as f64
            && idle >= SETTLE
        {
            return Some(format!(
                "{:.0}% of its blocks present",
                100.0 * p.present as f64 / p.total.max(1) as f64
            ));
        }
        // Only once closed: a handle open now stays on the daemon path whatever becomes of the
        // file, so a copy made under it would slow it and serve only later opens.
        let threshold = busy_threshold(p.missing_bytes);
        if self.when_busy(native) && !p.events && p.closed && p.requests_in_run >= threshold {
            return Some(format!(
                "in sustained use: {} requests through the daemon in this run cost more than \
                 copying its {} missing bytes; later opens pass through",
                p.requests_in_run, p.missing_bytes
            ));
        }
        None
    }

    /// Whether a file that nobody has open can still become due: by a rule that does not wait
    /// for requests, or because its run of use goes on (it is opened again within `BUSY_GAP`:
    /// a log appended to by one command after another). A file that cannot leaves the queue
    /// at its last close, or once its run of use has ended.
    pub fn may_come_due_closed(&self, p: &Progress, native: bool) -> bool {
        self.when_busy(native) && p.requests_in_run > 0
            || self.after_idle.is_some()
            || self.ratio > 0.0 && p.present as f64 >= self.ratio * p.total.max(1) as f64
            || self.on_reopen_below > 0 && p.reopened && !p.events
    }

    /// Whether any rule can complete a file on such a mount.
    pub fn completes_anything(&self, native: bool) -> bool {
        self.after_idle.is_some()
            || self.ratio > 0.0
            || self.on_reopen_below > 0
            || self.when_busy(native)
    }

    /// What completes a file that is not due yet, on a mount where passthrough does or does
    /// not (`Err(why)`) serve complete files.
    fn waits_for(&self, p: &Progress, native: Result<(), &str>) -> String {
        let mut w = Vec::new();
        if let Some(d) = self.after_idle {
            w.push(format!("no write for {:.0} s", d.as_secs_f64()));
        }
        if self.on_reopen_below > 0 {
            w.push("an open for writing after a write or a writable open".to_string());
        }
        if self.ratio > 0.0 {
            w.push(format!(
                "{:.0}% of blocks present and {} ms without a write",
                self.ratio * 100.0,
                SETTLE.as_millis()
            ));
        }
        if self.when_busy(native.is_ok()) {
            w.push(format!(
                "sustained use: {} requests through the daemon with no {} s gap (now {}), then \
                 its last close",
                busy_threshold(p.missing_bytes),
                BUSY_GAP.as_secs(),
                p.requests_in_run
            ));
        }
        if w.is_empty() {
            return match native {
                Err(why) => format!(
                    "stays partial: complete files would not pass through here ({why}), so \
                     completing would only cost space; complete_after=, complete_ratio= or \
                     complete_busy=on at mount make it whole"
                ),
                Ok(()) => "stays partial: completion is off (complete_busy=off and no \
                           complete_after=, complete_ratio=, complete_on_reopen=)"
                    .into(),
            };
        }
        w.join(", or ")
    }
}

#[derive(Default)]
pub struct Completer {
    pub(crate) queue: Mutex<Vec<Arc<OpenFile>>>,
    wake: Condvar,
    pub(crate) stop: AtomicBool,
}

/// References to a queued file when nobody has it open: the queue's and the caller's copy.
const HELD: usize = 2;

/// The progress of queued file `f`, looked at through a copy of the queue: closed when only
/// the queue and that copy hold it.
pub(crate) fn progress(f: &Arc<OpenFile>) -> Option<Progress> {
    let mut p = f.partial_progress()?;
    p.closed = Arc::strong_count(f) <= HELD;
    Some(p)
}

impl Completer {
    /// Registers a file that is partial; it stays queued while it is open or can come due.
    /// Files whose last close found them still held elsewhere (a copy-after-write fill in
    /// flight) are let go here.
    pub fn register(&self, file: &Arc<OpenFile>, policy: &CompletionPolicy, native: bool) {
        let queued = self.queue.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.let_go_unused(&queued, policy, native);
        drop(queued);
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() < MAX_QUEUED && !q.iter().any(|f| Arc::ptr_eq(f, file)) {
            q.push(file.clone());
        }
    }

    /// After a handle of `file` closed: takes the file out of the queue if nobody has it open
    /// any more and nothing is left for completion to do (`let_go_unused`). Its descriptors
    /// and pending blocks go with it (the partial file's drop fills them); a later open
    /// registers it again.
    pub fn release(&self, file: Arc<OpenFile>, policy: &CompletionPolicy, native: bool) {
        self.let_go_unused(&[file], policy, native);
    }

    /// Takes out of the queue those of `files` that nobody holds but the queue and the caller
    /// (two references), and that are deleted, or neither due nor able to become due while
    /// closed. A deleted file goes whatever the rules: holding it would hold its blocks.
    pub(crate) fn let_go_unused(
        &self,
        files: &[Arc<OpenFile>],
        policy: &CompletionPolicy,
        native: bool,
    ) {
        let now = Instant::now();
        let mut due = false;
        // Progress is read without the queue's lock: a file's data lock may be held while the
        // queue's is taken (io.rs `open`), never the other way round.
        let idle: Vec<&Arc<OpenFile>> = files
            .iter()
            .filter(|f| {
                Arc::strong_count(f) == HELD
                    && progress(f).is_some_and(|p| {
                        if p.unlinked {
                            return true;
                        }
                        if policy.due(&p, now, native).is_some() {
                            due = true;
                            return false;
                        }
                        !policy.may_come_due_closed(&p, native)
                    })
            })
            .collect();
        if due {
            // Completed now rather than at the worker's next look: a mount may be short.
            self.nudge();
        }
        if idle.is_empty() {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        // Counted again under the queue's lock: `find`, the only other way to a queued file
        // that nobody holds, clones it under the same lock.
        q.retain(|f| {
            !idle
                .iter()
                .any(|g| Arc::ptr_eq(f, g) && Arc::strong_count(g) == HELD)
        });
    }

    /// Takes `file` out of the queue (its descriptors go with its last handle); a later open
    /// registers it again.
    pub fn forget(&self, file: &Arc<OpenFile>) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.retain(|f| !Arc::ptr_eq(f, file));
    }

    /// The queued file of the object numbered `ino`, unless it was deleted. A queued file is
    /// the object's open state even when the kernel has forgotten the inode: opening the object
    /// again must take it up, or two states of one partial file would race (completion filling
    /// a block from the lower file over a write made through the other).
    pub fn find(&self, ino: u64) -> Option<Arc<OpenFile>> {
        let q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let f = q.iter().find(|f| f.ino == ino)?.clone();
        drop(q);
        (!f.partial_progress().is_some_and(|p| p.unlinked)).then_some(f)
    }

    /// Partial files queued, their blocks present and their blocks in all.
    pub fn totals(&self) -> (u64, u64, u64) {
        let files = self.queue.lock().unwrap_or_else(|e| e.into_inner()).clone();
        files
            .iter()
            .filter_map(|f| f.partial_progress())
            .fold((0, 0, 0), |(n, p, t), g| {
                (n + 1, p + g.present, t + g.total)
            })
    }

    pub fn queued(&self) -> usize {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Wakes the worker: a file may have become due.
    pub fn nudge(&self) {
        self.wake.notify_all();
    }

    /// One line per queued file: how far it is and why it is or is not being completed.
    pub fn describe(&self, policy: &CompletionPolicy, native: Result<(), &str>) -> Vec<String> {
        let files = self.queue.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let now = Instant::now();
        files
            .iter()
            .filter_map(|f| {
                let p = progress(f)?;
                let why = match policy.due(&p, now, native.is_ok()) {
                    Some(reason) => format!("due: {reason}"),
                    None => format!("waiting: {}", policy.waits_for(&p, native)),
                };
                Some(format!(
                    "inode {}: {} of {} blocks present, last write {:.1} s ago, writable opens {}, \
                     writers served by {}; {why}",
                    f.ino,
                    p.present,
                    p.total,
                    now.duration_since(p.last_write).as_secs_f64(),
                    p.writer_opens,
                    if p.events {
                        "passthrough (pre-content events)"
                    } else {
                        "the daemon"
                    },
                ))
            })
            .collect()
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_all();
    }

    /// Empties the queue, returning what was in it.
    pub fn drain(&self) -> Vec<Arc<OpenFile>> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn wait(&self, tick: Duration) {
        let q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.wake.wait_timeout(q, tick);
    }
}
