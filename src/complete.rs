//! Completion: turning partial files into ordinary upper files in the background.
//!
//! A partial file is completed when it has been idle (no write) for `complete_after`, or as
//! soon as `complete_ratio` of its blocks are present. Completion fills every hole below
//! `valid` from the lower file — whole blocks only, a chunk at a time under the file's lock, so
//! readers and writers interleave and the partial-file invariant holds at every step — then
//! makes the data durable (fdatasync) and only then removes the mark. A crash at any point
//! leaves either a valid partial file or a complete one. Afterwards the file is a plain upper
//! file: kernel overlayfs reads it correctly and mosaicfs serves it with passthrough.
//!
//! Completion follows use: a partial file that has been written, or opened for writing
//! before, and is opened for writing again is in sustained use (a database, a log, an image
//! being edited) and is due at once,
//! since each later open of a complete file is served by passthrough; up to
//! `complete_on_reopen=` bytes to copy it is even completed before that open returns
//! (io.rs). The share-of-blocks trigger waits until the file has had no write for `SETTLE`,
//! so that completion does not copy from the lower file the blocks a writer (a sequential one,
//! above all) is about to overwrite. Small files are made complete when opened for writing (`copy_whole=`, io.rs).
//!
//! Every open file that is or becomes partial is registered once (not per write) in a queue
//! that keeps it open until it is completed; a worker thread looks at the queue every half idle
//! time (at most once a second). This file holds the policy and the queue, below the overlay
//! that owns one; the worker and the completion itself are completion.rs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::file::{OpenFile, Progress};
use crate::options::CompletionPolicy;

/// At most this many partial files wait for completion at once (each holds two descriptors);
/// past it a file is completed when it is next opened and goes idle.
const MAX_QUEUED: usize = 512;
/// Blocks filled per lock hold.
pub(crate) const CHUNK_BLOCKS: u64 = 256;
/// How long a file must go without writes before the share-of-blocks trigger completes it.
const SETTLE: Duration = Duration::from_millis(250);

impl CompletionPolicy {
    /// Why a partial file with progress `p` is to be completed now, if it is.
    pub fn due(&self, p: &Progress, now: Instant) -> Option<String> {
        let idle = now.duration_since(p.last_write);
        if p.unlinked {
            return Some("deleted, nothing to complete".into());
        }
        if self.after_idle.is_some_and(|d| idle >= d) {
            return Some(format!("no write for {:.1} s", idle.as_secs_f64()));
        }
        // A file whose writers pass through needs no completion to be fast: a second open
        // is no reason to copy it.
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
        None
    }

    /// What completes a file that is not due yet.
    fn waits_for(&self) -> String {
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
        if w.is_empty() {
            return "nothing: completion is off (complete_after=0, complete_ratio=0, complete_on_reopen=0)".into();
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

impl Completer {
    /// Registers a file that is partial; it stays open until completed.
    pub fn register(&self, file: &Arc<OpenFile>) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() < MAX_QUEUED && !q.iter().any(|f| Arc::ptr_eq(f, file)) {
            q.push(file.clone());
        }
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
    pub fn describe(&self, policy: &CompletionPolicy) -> Vec<String> {
        let files = self.queue.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let now = Instant::now();
        files
            .iter()
            .filter_map(|f| {
                let p = f.partial_progress()?;
                let why = match policy.due(&p, now) {
                    Some(reason) => format!("due: {reason}"),
                    None => format!("waiting: {}", policy.waits_for()),
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
