//! Copy-after-write (BAOverlay §4.2): taking the copy out of copy-on-write.
//!
//! A write that covers only part of a block that is not yet in the upper file, below `valid`,
//! would need the rest of the block from the lower file first. Instead its bytes go into an
//! in-memory `PendingBlock` and the write returns. Worker threads later read the lower block,
//! merge the written bytes over it and write the whole block. Until then reads overlay the
//! pending bytes on what they read (merge on the fly), and fsync, truncate, fallocate,
//! completion and the last close fill the file's pending blocks first.
//!
//! Nothing half-filled ever reaches disk, so the partial-file invariant holds. The pending bytes
//! live in shared memory the mount's holder keeps too (arena.rs): a daemon killed before it
//! filled a block leaves it to the next daemon, which writes it before it serves, so a write
//! that returned is never lost with the daemon. Pending memory is bounded (`caw_memory=`, the
//! arena's size); past the bound a writer fills synchronously.
//!
//! Only a block whose lower data is not in the page cache is deferred (file/partial/mod.rs
//! `write`; `copy_after_write=always` defers every one): filling a cached block costs a 4 KiB
//! copy, less than the hand-off (a worker's wake-up, two context switches, the file's lock
//! taken twice) — on 1 B written per 4 KiB of a 256 MiB file, 6.8 s deferred against 3.6 s
//! filled at once (docs/PERFORMANCE.md). The non-blocking probe (`RWF_NOWAIT`) starts the
//! lower file's readahead, so the blocks after a deferred one are usually cached by the time
//! they are written.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use super::arena::{Arena, Owner};

/// What a worker fills: an open file with pending blocks (file/mod.rs' `OpenFile`), seen only
/// through this, so that the queue sits below the open-file state that holds pending blocks.
pub trait FillPending: Send + Sync {
    /// Fills block `blk` if it is still pending; whether it was.
    fn fill_pending(&self, blk: u64) -> crate::error::Result<bool>;
    /// The file's inode number, for messages.
    fn ino(&self) -> u64;
}

type Job = (Weak<dyn FillPending>, u64);

/// The bytes written so far into one block that is not yet in the upper file: a slot of the
/// mount's arena (arena.rs), given back when this drops — after the block was written.
pub struct PendingBlock {
    arena: Arc<Arena>,
    slot: usize,
}

impl PendingBlock {
    /// Puts `bytes` at offset `at` of the block.
    pub fn put(&mut self, at: usize, bytes: &[u8]) {
        self.arena.put(self.slot, at, bytes);
    }

    /// Copies the written bytes of block range `from..from + dst.len()` over `dst`.
    pub fn overlay(&self, from: usize, dst: &mut [u8]) {
        self.arena.overlay(self.slot, from, dst);
    }
}

impl Drop for PendingBlock {
    fn drop(&mut self) {
        self.arena.free(self.slot);
    }
}

/// What the pending blocks of the whole mount share: their arena, which bounds their memory,
/// and the work queue.
pub struct CawShared {
    /// Defer a block whose lower data is in the page cache too (`copy_after_write=always`).
    pub always: bool,
    arena: Arc<Arena>,
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    stop: AtomicBool,
}

impl CawShared {
    pub fn new(arena: Arc<Arena>, always: bool) -> Self {
        CawShared {
            always,
            arena,
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// A pending block for block `block` (of `size` bytes) of `owner`'s file, or no when the
    /// bound is reached (or the file's blocks are not the arena's).
    pub fn take(&self, owner: Owner, block: u64, size: u64) -> Option<PendingBlock> {
        if size != self.arena.block() as u64 {
            return None;
        }
        let slot = self.arena.take(owner, block)?;
        Some(PendingBlock {
            arena: self.arena.clone(),
            slot,
        })
    }

    pub fn pending_bytes(&self) -> usize {
        self.arena.pending_bytes()
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
            let (guard, waited) = self
                .wake
                .wait_timeout(q, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner());
            q = guard;
            if waited.timed_out() {
                // Not under the queue's lock: the arena's is taken alone.
                drop(q);
                self.arena.give_back_if_idle();
                q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}
