//! The completion worker and the completion of one file (the `impl Overlay` half of
//! complete.rs, which holds the policy and the queue).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::complete::CHUNK_BLOCKS;
use crate::file::OpenFile;
use crate::overlay::Overlay;

impl Overlay {
    /// Starts the completion worker; it ends when `shutdown` stops it.
    pub fn start_completion(self: &Arc<Self>) {
        let policy = &self.config.completion;
        if policy.after_idle.is_none() && policy.ratio <= 0.0 && policy.on_reopen_below == 0 {
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
    pub fn complete_due(&self) {
        let files: Vec<Arc<OpenFile>> = self
            .completer
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let now = Instant::now();
        for f in files {
            if self.completer.stop.load(Ordering::Relaxed) {
                return;
            }
            let done = match f.partial_progress() {
                None => true,
                Some(p) => {
                    if p.unlinked {
                        true // nobody can read it again: nothing to complete
                    } else if self.config.completion.due(&p, now).is_some() {
                        match self.complete_file(&f) {
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
                q.retain(|g| !Arc::ptr_eq(g, &f));
            }
        }
    }

    /// Fills every hole of a partial file and removes its mark.
    pub fn complete_file(&self, f: &OpenFile) -> crate::error::Result<()> {
        let mut from = 0;
        while let Some((next, filled)) = f.fill_chunk(from, CHUNK_BLOCKS)? {
            self.stats.blocks_filled.add(filled);
            from = next;
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
