//! The completion worker and the completion of one file (the `impl Overlay` half of
//! file/complete.rs, which holds the policy and the queue).
//!
//! May call (dev/callgraph.py --check keeps it so): overlay, passthrough.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::file::OpenFile;
use crate::file::complete::CHUNK_BLOCKS;
use crate::overlay::Overlay;

/// How fast background completion copies from lower files: about what one disk of these
/// machines writes while leaving room for the writers in front of it.
const BACKGROUND_RATE: u64 = 256 << 20;

impl Overlay {
    /// Starts the completion worker; it ends when `shutdown` stops it.
    pub(super) fn start_completion(self: &Arc<Self>) {
        if !self
            .config
            .completion
            .completes_anything(self.passthrough_serves().is_ok())
        {
            return;
        }
        // Look often enough to honour short idle times, at most once a second otherwise.
        let tick = self
            .config
            .completion
            .after_idle
            .map_or(Duration::from_secs(1), |d| {
                (d / 2).clamp(Duration::from_millis(5), Duration::from_secs(1))
            });
        let me = self.clone();
        let _ = std::thread::Builder::new()
            .name("mosaicfs-complete".into())
            .spawn(move || {
                while !me.completer.stop.load(Ordering::Relaxed) {
                    me.completer.wait(tick);
                    // A panic (logged by the hook) ends this round only; the queue stays.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        me.complete_due()
                    }));
                }
            });
    }

    /// Completes every queued file that is due, and drops those no longer partial.
    pub(super) fn complete_due(&self) {
        let files: Vec<Arc<OpenFile>> = self
            .completer
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let now = Instant::now();
        let native = self.passthrough_serves().is_ok();
        for f in &files {
            if self.completer.stop.load(Ordering::Relaxed) {
                return;
            }
            let done = match crate::file::complete::progress(f) {
                None => true,
                Some(p) => {
                    if p.unlinked {
                        true // nobody can read it again: nothing to complete
                    } else if self.config.completion.due(&p, now, native).is_some() {
                        match self.complete_file_paced(f) {
                            Ok(()) => true,
                            Err(e) => {
                                log::warn!("completing inode {} failed, will retry: {e}", f.ino);
                                false
                            }
                        }
                    } else {
                        false
                    }
                }
            };
            if done {
                let mut q = self
                    .completer
                    .queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                q.retain(|g| !Arc::ptr_eq(g, f));
            }
        }
        // Files closed while a fill held them too (`Completer::release` let them be).
        self.completer
            .let_go_unused(&files, &self.config.completion, native);
    }

    /// Fills every hole of a partial file and removes its mark.
    pub fn complete_file(&self, f: &OpenFile) -> crate::error::Result<()> {
        self.complete_at_rate(f, None)
    }

    /// `complete_file` in the background: at most `BACKGROUND_RATE` bytes copied a second, so
    /// that completing a big file never takes the disk from the writers in front of it.
    fn complete_file_paced(&self, f: &OpenFile) -> crate::error::Result<()> {
        self.complete_at_rate(f, Some(BACKGROUND_RATE))
    }

    fn complete_at_rate(&self, f: &OpenFile, rate: Option<u64>) -> crate::error::Result<()> {
        let mut from = 0;
        let started = Instant::now();
        let mut copied = 0u64;
        while let Some((next, filled)) = f.fill_chunk(from, CHUNK_BLOCKS)? {
            self.stats.blocks_filled.add(filled);
            from = next;
            copied += filled * self.sparse.block;
            if let Some(rate) = rate {
                let due = Duration::from_secs_f64(copied as f64 / rate as f64);
                if let Some(ahead) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(ahead);
                }
            }
            if self.completer.stop.load(Ordering::Relaxed) {
                // Unmounting: the file stays a valid partial file; a later mount completes it.
                return Ok(());
            }
        }
        if f.finish_completion(&self.layers.xattr, self.config.skip_fsync)? {
            self.stats.completions.add(1);
        }
        Ok(())
    }
}
