//! Request counters, striped per thread so that no cache line is shared on the hot path.
//!
//! Each counter is an array of cache-line-sized slots; a thread adds to the slot of its own
//! index and readers sum them. The numbers are for `mosaicfs status` and tests (they prove, for
//! instance, that no READ reaches the daemon for a file served by passthrough).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

const STRIPES: usize = 16;

#[repr(align(64))]
#[derive(Default)]
struct Slot(AtomicU64);

#[derive(Default)]
pub struct Counter {
    slots: [Slot; STRIPES],
}

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: Cell<usize> = Cell::new(NEXT_THREAD.fetch_add(1, Ordering::Relaxed) % STRIPES);
}

impl Counter {
    pub fn add(&self, n: u64) {
        let i = STRIPE.with(|s| s.get());
        self.slots[i].0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.slots.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }
}

/// What the daemon has served.
#[derive(Default)]
pub struct Stats {
    pub reads: Counter,
    pub writes: Counter,
    pub read_bytes: Counter,
    pub write_bytes: Counter,
    pub opens_passthrough: Counter,
    pub opens_daemon: Counter,
    /// Opens that found their kernel inode bound to a lower file and moved the object to a new
    /// node id (file.rs, `IoMode`).
    pub rebinds: Counter,
    pub copy_ups: Counter,
    /// Copy-ups that cloned the lower file's extents (a complete upper file at once).
    pub reflinks: Counter,
    pub blocks_filled: Counter,
    pub blocks_deferred: Counter,
    pub completions: Counter,
    /// Files made complete when opened for writing (`copy_whole=`).
    pub completions_at_open: Counter,
    /// fsync/fdatasync requests, and how many reached the disk (none with `volatile`).
    pub fsyncs: Counter,
    pub fsyncs_to_disk: Counter,
}

impl Stats {
    pub fn summary(&self) -> String {
        format!(
            "requests: read={} ({} bytes) write={} ({} bytes); opens: passthrough={} daemon={} rebinds={}; copy-ups={} reflinks={} blocks-deferred={} blocks-filled={} completions={} at-open={}; fsyncs={} to-disk={}",
            self.reads.get(),
            self.read_bytes.get(),
            self.writes.get(),
            self.write_bytes.get(),
            self.opens_passthrough.get(),
            self.opens_daemon.get(),
            self.rebinds.get(),
            self.copy_ups.get(),
            self.reflinks.get(),
            self.blocks_deferred.get(),
            self.blocks_filled.get(),
            self.completions.get(),
            self.completions_at_open.get(),
            self.fsyncs.get(),
            self.fsyncs_to_disk.get()
        )
    }
}
