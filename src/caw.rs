//! Copy-after-write (BAOverlay §4.2): taking the copy out of copy-on-write.
//!
//! A write that covers only part of a block that is not yet in the upper file, below `valid`,
//! would need the rest of the block from the lower file first. Instead its bytes go into an
//! in-memory `PendingBlock` and the write returns. Worker threads later read the lower block,
//! merge the written bytes over it and write the whole block. Until then reads overlay the
//! pending bytes on what they read (merge on the fly), and fsync, truncate, fallocate,
//! completion and the last close fill the file's pending blocks first.
//!
//! Nothing half-filled ever reaches disk, so the partial-file invariant holds and there is no
//! log to replay: a daemon crash loses only writes not yet fsynced, the page cache's contract.
//! Pending memory is bounded (`caw_memory=`); past the bound a writer fills synchronously.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use crate::file::OpenFile;
use crate::overlay::Overlay;

/// The bytes written so far into one block that is not yet in the upper file.
pub struct PendingBlock {
    data: Box<[u8]>,
    /// One bit per byte of `data`: set where a write put the byte.
    written: Box<[u64]>,
}

impl PendingBlock {
    pub fn new(block: usize) -> Self {
        PendingBlock {
            data: vec![0u8; block].into_boxed_slice(),
            written: vec![0u64; block.div_ceil(64)].into_boxed_slice(),
        }
    }

    /// Puts `bytes` at offset `at` of the block.
    pub fn put(&mut self, at: usize, bytes: &[u8]) {
        self.data[at..at + bytes.len()].copy_from_slice(bytes);
        for i in at..at + bytes.len() {
            self.written[i / 64] |= 1 << (i % 64);
        }
    }

    /// Copies the written bytes of block range `from..from + dst.len()` over `dst`.
    pub fn overlay(&self, from: usize, dst: &mut [u8]) {
        for (k, byte) in dst.iter_mut().enumerate() {
            let i = from + k;
            if self.written[i / 64] & (1 << (i % 64)) != 0 {
                *byte = self.data[i];
            }
        }
    }
}

/// What the pending blocks of the whole mount share: the memory bound and the work queue.
pub struct CawShared {
    pending_bytes: AtomicUsize,
    limit: usize,
    queue: Mutex<VecDeque<(Weak<OpenFile>, u64)>>,
    wake: Condvar,
    stop: AtomicBool,
}

impl CawShared {
    pub fn new(limit: usize) -> Self {
        CawShared {
            pending_bytes: AtomicUsize::new(0),
            limit,
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// Takes `n` bytes of pending memory, or says no when the bound is reached.
    pub fn reserve(&self, n: usize) -> bool {
        let mut cur = self.pending_bytes.load(Ordering::Relaxed);
        loop {
            if cur + n > self.limit {
                return false;
            }
            match self.pending_bytes.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    pub fn release(&self, n: usize) {
        self.pending_bytes.fetch_sub(n, Ordering::Relaxed);
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    /// Queues blocks of `file` for the workers.
    pub fn schedule(&self, file: &Arc<OpenFile>, blocks: &[u64]) {
        if blocks.is_empty() {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        for b in blocks {
            q.push_back((Arc::downgrade(file), *b));
        }
        drop(q);
        self.wake.notify_one();
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_all();
    }

    fn next(&self) -> Option<(Weak<OpenFile>, u64)> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(job) = q.pop_front() {
                return Some(job);
            }
            q = self
                .wake
                .wait_timeout(q, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Overlay {
    /// Starts the copy-after-write workers (`caw_workers=0`: blocks are filled only when
    /// something needs them, at fsync, truncate, completion or close).
    pub fn start_caw_workers(self: &Arc<Self>) {
        let Some(caw) = self.caw.clone() else { return };
        for i in 0..self.config.caw_workers {
            let me = self.clone();
            let caw = caw.clone();
            let _ = std::thread::Builder::new()
                .name(format!("mosaicfs-caw-{i}"))
                .spawn(move || {
                    while let Some((file, blk)) = caw.next() {
                        let Some(file) = file.upgrade() else { continue };
                        // A panic (logged by the hook) loses this job only: the block stays
                        // pending, and close, fsync or unmount fill it.
                        let filled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            file.fill_pending(blk)
                        }));
                        let Ok(filled) = filled else { continue };
                        match filled {
                            Ok(true) => me.stats.blocks_filled.add(1),
                            Ok(false) => {}
                            Err(e) => log::warn!(
                                "copy-after-write of inode {} block {blk}: {e}",
                                file.ino
                            ),
                        }
                    }
                });
        }
    }
}
