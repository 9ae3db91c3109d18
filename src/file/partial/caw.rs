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
//!
//! Only a block whose lower data is not in the page cache is deferred (file/partial/mod.rs
//! `write`; `copy_after_write=always` defers every one): filling a cached block costs a 4 KiB
//! copy, less than the hand-off (a worker's wake-up, two context switches, the file's lock
//! taken twice) — on 1 B written per 4 KiB of a 256 MiB file, 6.8 s deferred against 3.6 s
//! filled at once (docs/PERFORMANCE.md). The non-blocking probe (`RWF_NOWAIT`) starts the
//! lower file's readahead, so the blocks after a deferred one are usually cached by the time
//! they are written.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// What a worker fills: an open file with pending blocks (file/mod.rs' `OpenFile`), seen only
/// through this, so that the queue sits below the open-file state that holds pending blocks.
pub trait FillPending: Send + Sync {
    /// Fills block `blk` if it is still pending; whether it was.
    fn fill_pending(&self, blk: u64) -> crate::error::Result<bool>;
    /// The file's inode number, for messages.
    fn ino(&self) -> u64;
}

type Job = (Weak<dyn FillPending>, u64);

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
    /// Defer a block whose lower data is in the page cache too (`copy_after_write=always`).
    pub always: bool,
    pending_bytes: AtomicUsize,
    limit: usize,
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    stop: AtomicBool,
}

impl CawShared {
    pub fn new(limit: usize, always: bool) -> Self {
        CawShared {
            always,
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
    pub fn schedule<F: FillPending + 'static>(&self, file: &Arc<F>, blocks: &[u64]) {
        if blocks.is_empty() {
            return;
        }
        let file: Arc<dyn FillPending> = file.clone();
        let weak = Arc::downgrade(&file);
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        for b in blocks {
            q.push_back((weak.clone(), *b));
        }
        drop(q);
        self.wake.notify_one();
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify_all();
    }

    pub(crate) fn next(&self) -> Option<Job> {
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
