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
    /// Every request, by opcode, with its time in the daemon (shared with the transport,
    /// which counts each request just before its reply goes out).
    pub requests: std::sync::Arc<RequestMetrics>,
    pub reads: Counter,
    pub writes: Counter,
    pub read_bytes: Counter,
    pub write_bytes: Counter,
    pub opens_passthrough: Counter,
    pub opens_daemon: Counter,
    /// Backing files registered for passthrough (`FUSE_DEV_IOC_BACKING_OPEN`); a complete
    /// file's registration serves every open of its inode (file/mod.rs, `NodeIo`).
    pub backings: Counter,
    /// Opens that found their kernel inode bound to a lower file and moved the object to a new
    /// node id (file/mod.rs, `IoMode`).
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
    /// Requests answered EIO after waiting `lower_timeout` on a lower layer (lower_wait.rs).
    pub lower_timeouts: Counter,
    /// Lower directories opened again after their store answered ESTALE (`in_lower_dir`).
    pub stale_retries: Counter,
    /// Lower files opened for their data (an open of a file on a store's client waits for its
    /// first read: `FileData::Unopened`).
    pub lower_opens: Counter,
    /// Handles an earlier daemon of the mount opened, made known again after a takeover
    /// (takeover.rs).
    pub handles_adopted: Counter,
}

impl Stats {
    /// Every counter with its name (snake_case), for the report formats of control.rs.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("reads", self.reads.get()),
            ("read_bytes", self.read_bytes.get()),
            ("writes", self.writes.get()),
            ("write_bytes", self.write_bytes.get()),
            ("opens_passthrough", self.opens_passthrough.get()),
            ("opens_daemon", self.opens_daemon.get()),
            ("backings", self.backings.get()),
            ("rebinds", self.rebinds.get()),
            ("copy_ups", self.copy_ups.get()),
            ("reflinks", self.reflinks.get()),
            ("blocks_deferred", self.blocks_deferred.get()),
            ("blocks_filled", self.blocks_filled.get()),
            ("completions", self.completions.get()),
            ("completions_at_open", self.completions_at_open.get()),
            ("lower_timeouts", self.lower_timeouts.get()),
            ("stale_retries", self.stale_retries.get()),
            ("lower_opens", self.lower_opens.get()),
            ("fsyncs", self.fsyncs.get()),
            ("fsyncs_to_disk", self.fsyncs_to_disk.get()),
            ("handles_adopted", self.handles_adopted.get()),
        ]
    }

    pub fn summary(&self) -> String {
        format!(
            "requests: read={} ({} bytes) write={} ({} bytes); opens: passthrough={} daemon={} backings={} rebinds={} lower-opens={}; copy-ups={} reflinks={} blocks-deferred={} blocks-filled={} completions={} at-open={}; fsyncs={} to-disk={}",
            self.reads.get(),
            self.read_bytes.get(),
            self.writes.get(),
            self.write_bytes.get(),
            self.opens_passthrough.get(),
            self.opens_daemon.get(),
            self.backings.get(),
            self.rebinds.get(),
            self.lower_opens.get(),
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

/// FUSE opcodes up to this one are counted by name (52 is FUSE_STATX).
const OPCODES: usize = 64;
/// Latency buckets: below 1 µs, 2 µs, 4 µs ... 2^(BUCKETS-2) µs, and the rest.
const BUCKETS: usize = 26;

/// The kernel's names of FUSE opcodes (include/uapi/linux/fuse.h), by number.
pub fn opcode_name(op: usize) -> Option<&'static str> {
    const NAMES: [&str; 53] = [
        "",
        "LOOKUP",
        "FORGET",
        "GETATTR",
        "SETATTR",
        "READLINK",
        "SYMLINK",
        "",
        "MKNOD",
        "MKDIR",
        "UNLINK",
        "RMDIR",
        "RENAME",
        "LINK",
        "OPEN",
        "READ",
        "WRITE",
        "STATFS",
        "RELEASE",
        "",
        "FSYNC",
        "SETXATTR",
        "GETXATTR",
        "LISTXATTR",
        "REMOVEXATTR",
        "FLUSH",
        "INIT",
        "OPENDIR",
        "READDIR",
        "RELEASEDIR",
        "FSYNCDIR",
        "GETLK",
        "SETLK",
        "SETLKW",
        "ACCESS",
        "CREATE",
        "INTERRUPT",
        "BMAP",
        "DESTROY",
        "IOCTL",
        "POLL",
        "NOTIFY_REPLY",
        "BATCH_FORGET",
        "FALLOCATE",
        "READDIRPLUS",
        "RENAME2",
        "LSEEK",
        "COPY_FILE_RANGE",
        "SETUPMAPPING",
        "REMOVEMAPPING",
        "SYNCFS",
        "TMPFILE",
        "STATX",
    ];
    NAMES.get(op).copied().filter(|n| !n.is_empty())
}

/// Per FUSE opcode: requests served, their total time and a log2 histogram of their times
/// (dispatch to reply, in the daemon). One atomic add per field per request.
pub struct RequestMetrics {
    count: [AtomicU64; OPCODES],
    total_ns: [AtomicU64; OPCODES],
    hist: [[AtomicU64; BUCKETS]; OPCODES],
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            count: std::array::from_fn(|_| AtomicU64::new(0)),
            total_ns: std::array::from_fn(|_| AtomicU64::new(0)),
            hist: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
        }
    }
}

/// One opcode's figures.
pub struct OpFigures {
    pub name: &'static str,
    pub count: u64,
    pub total_ns: u64,
    /// (upper bound in µs, requests at most that long), cumulative; `None`: no bound.
    pub buckets: Vec<(Option<u64>, u64)>,
}

impl RequestMetrics {
    pub fn record(&self, opcode: u32, elapsed: std::time::Duration) {
        let op = opcode as usize;
        if op >= OPCODES {
            return;
        }
        let us = elapsed.as_micros() as u64;
        let bucket = ((u64::BITS - us.leading_zeros()) as usize).min(BUCKETS - 1);
        self.count[op].fetch_add(1, Ordering::Relaxed);
        self.total_ns[op].fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        self.hist[op][bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// Every opcode served at least once.
    pub fn figures(&self) -> Vec<OpFigures> {
        (0..OPCODES)
            .filter_map(|op| {
                let count = self.count[op].load(Ordering::Relaxed);
                let name = opcode_name(op)?;
                (count > 0).then(|| {
                    let mut sum = 0;
                    let buckets = (0..BUCKETS)
                        .map(|b| {
                            sum += self.hist[op][b].load(Ordering::Relaxed);
                            ((b < BUCKETS - 1).then_some(1u64 << b), sum)
                        })
                        .collect();
                    OpFigures {
                        name,
                        count,
                        total_ns: self.total_ns[op].load(Ordering::Relaxed),
                        buckets,
                    }
                })
            })
            .collect()
    }
}

/// Errors the daemon answered, by errno (one process serves one mount).
static ERRORS: [AtomicU64; 256] = [const { AtomicU64::new(0) }; 256];

pub fn count_error(errno: i32) {
    if let Some(c) = ERRORS.get(errno as usize) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// (errno, count) of every error answered at least once.
pub fn errors() -> Vec<(i32, u64)> {
    ERRORS
        .iter()
        .enumerate()
        .filter_map(|(e, c)| {
            let n = c.load(Ordering::Relaxed);
            (n > 0).then_some((e as i32, n))
        })
        .collect()
}

/// The symbolic name of an errno (ENOENT), or its number.
pub fn errno_name(e: i32) -> String {
    const KNOWN: [(i32, &str); 24] = [
        (libc::EPERM, "EPERM"),
        (libc::ENOENT, "ENOENT"),
        (libc::EIO, "EIO"),
        (libc::EBADF, "EBADF"),
        (libc::EAGAIN, "EAGAIN"),
        (libc::ENOMEM, "ENOMEM"),
        (libc::EACCES, "EACCES"),
        (libc::EBUSY, "EBUSY"),
        (libc::EEXIST, "EEXIST"),
        (libc::EXDEV, "EXDEV"),
        (libc::ENOTDIR, "ENOTDIR"),
        (libc::EISDIR, "EISDIR"),
        (libc::EINVAL, "EINVAL"),
        (libc::EMFILE, "EMFILE"),
        (libc::ENFILE, "ENFILE"),
        (libc::EFBIG, "EFBIG"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::EROFS, "EROFS"),
        (libc::EMLINK, "EMLINK"),
        (libc::ERANGE, "ERANGE"),
        (libc::ENAMETOOLONG, "ENAMETOOLONG"),
        (libc::ENOSYS, "ENOSYS"),
        (libc::ENOTEMPTY, "ENOTEMPTY"),
        (libc::ENODATA, "ENODATA"),
    ];
    KNOWN
        .iter()
        .find(|(n, _)| *n == e)
        .map_or_else(|| format!("errno{e}"), |(_, s)| s.to_string())
}
