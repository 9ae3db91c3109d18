//! Which threads are waiting on which lower layer, and since when: what `lower_timeout=`
//! needs to tell a request blocked in a store that stopped answering (issue #16) from a slow
//! one of the upper layer.
//!
//! Code that is about to make syscalls on a lower layer holds a `Waiting` from `enter` for as
//! long as they take (only once `watch` was called: otherwise it is one load).
//! Each thread has one slot (layer, since) in a process-wide registry; a
//! `Waiting` sets it and puts the previous value back when dropped (calls nest), and counts
//! itself in the layer's number of waiters. That costs two atomic stores, an atomic add and a
//! thread-local access per lower access, and no lock. The daemon's watchdog (daemon.rs) reads
//! the slots: a request whose thread has waited on a layer for longer than the timeout is
//! answered EIO, and the layer counts as down — further entries fail with EIO at once, instead
//! of piling more threads into it — until no thread has waited on it that long any more (its
//! store answers again).
//!
//! Without `lower_timeout=` a layer on a store's client is watched too, for one thing: a store
//! that stopped answering must not take every worker thread of the mount while its client
//! waits (42 s for GlusterFS). A layer on which some thread has waited for `STUCK` is suspect;
//! a suspect layer takes at most `Limits::saturated` waiting threads (the worker pool less a
//! reserve), and entries past that fail with EIO at once, so the rest of the mount keeps the
//! reserve. The cap is checked at entry, against the live count: the pool grows by a worker
//! every 50 ms while all are stuck, faster than any periodic look could stop it.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Result, errno};
use crate::layers::LayerId;

/// The slot value for "not waiting on a lower layer".
const NONE: u32 = 0;
/// Layers past this many are tracked as one (`DATA`), without flags of their own.
const TRACKED: usize = 512;
/// A lower file's data read through the daemon: the layer is not known where it is read.
pub const DATA: LayerId = LayerId::MAX;

struct Slot {
    /// `layer + 1`, or `NONE`.
    layer: AtomicU32,
    /// When the wait began: ns since `Registry::epoch`.
    since: AtomicU64,
}

/// Per tracked layer.
#[derive(Default)]
struct LayerState {
    /// A wait on it passed the timeout: entries fail at once.
    down: AtomicBool,
    /// A wait on it passed `Limits::stuck`: entries past `saturated` waiters fail at once.
    suspect: AtomicBool,
    /// Threads waiting on it now.
    waiters: AtomicUsize,
}

struct Registry {
    epoch: Instant,
    slots: Mutex<Vec<(i32, Arc<Slot>)>>,
    layers: Vec<LayerState>,
    /// Whether any layer is down or suspect: one load on the fast path.
    any_flag: AtomicBool,
    /// `Limits::saturated` of the watchdog.
    saturated: AtomicUsize,
}

fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| Registry {
        epoch: Instant::now(),
        slots: Mutex::new(Vec::new()),
        layers: (0..TRACKED).map(|_| LayerState::default()).collect(),
        any_flag: AtomicBool::new(false),
        saturated: AtomicUsize::new(usize::MAX),
    })
}

thread_local! {
    static SLOT: OnceCell<Arc<Slot>> = const { OnceCell::new() };
}

/// Whether anything reads the slots (`watch`): otherwise nothing is marked.
static WATCHED: AtomicBool = AtomicBool::new(false);

/// Turns the marking on, for the watchdog (daemon.rs), with its limits.
pub fn watch(limits: Limits) {
    registry()
        .saturated
        .store(limits.saturated, Ordering::Relaxed);
    WATCHED.store(true, Ordering::Relaxed);
}

/// Whether lower accesses are marked.
pub fn watched() -> bool {
    WATCHED.load(Ordering::Relaxed)
}

/// A thread's wait on a lower layer; ends when dropped.
pub struct Waiting(Option<Entered>);

struct Entered {
    slot: Arc<Slot>,
    prev: (u32, u64),
    layer: LayerId,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(e) = &self.0 {
            e.slot.since.store(e.prev.1, Ordering::Relaxed);
            e.slot.layer.store(e.prev.0, Ordering::Release);
            if let Some(l) = registry().layers.get(e.layer as usize) {
                l.waiters.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Marks this thread as waiting on lower layer `layer` until the result is dropped; EIO at
/// once if the layer is down, or suspect and full (see the module doc). Nothing at all unless
/// `watch` was called.
pub fn enter(layer: LayerId) -> Result<Waiting> {
    if !watched() {
        return Ok(Waiting(None));
    }
    let r = registry();
    let state = r.layers.get(layer as usize);
    if let Some(l) = state {
        let n = l.waiters.fetch_add(1, Ordering::Relaxed);
        if r.any_flag.load(Ordering::Relaxed)
            && (l.down.load(Ordering::Relaxed)
                || l.suspect.load(Ordering::Relaxed) && n >= r.saturated.load(Ordering::Relaxed))
        {
            l.waiters.fetch_sub(1, Ordering::Relaxed);
            return Err(errno(libc::EIO));
        }
    }
    let slot = SLOT.with(|s| {
        s.get_or_init(|| {
            let slot = Arc::new(Slot {
                layer: AtomicU32::new(NONE),
                since: AtomicU64::new(0),
            });
            r.slots.lock().unwrap_or_else(|e| e.into_inner()).push((
                rustix::thread::gettid().as_raw_nonzero().get(),
                slot.clone(),
            ));
            slot
        })
        .clone()
    });
    let prev = (
        slot.layer.load(Ordering::Relaxed),
        slot.since.load(Ordering::Relaxed),
    );
    if prev.0 == NONE {
        // The outermost wait counts from its start.
        slot.since
            .store(r.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    slot.layer.store(layer as u32 + 1, Ordering::Release);
    Ok(Waiting(Some(Entered { slot, prev, layer })))
}

/// A wait this long makes its layer suspect (`Limits::stuck`): the time after which the
/// worker pool counts a worker as stuck and grows (vendored fuser `STUCK_AFTER`, 200 ms), and
/// a little more. Only a layer holding nearly the whole pool is refused anything, so a slow
/// store that answers loses nothing to it.
pub const STUCK: Duration = Duration::from_millis(250);

/// When a layer counts as down or suspect.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `lower_timeout=`: a wait this long ends in EIO, and its layer is down meanwhile.
    pub timeout: Option<Duration>,
    /// A layer with a wait this long (`STUCK`) is suspect ...
    pub stuck: Duration,
    /// ... and takes no more than this many waiting threads: the worker pool's size less a
    /// reserve for requests that do not need it.
    pub saturated: usize,
}

/// What `overdue` found.
#[derive(Debug, Default)]
pub struct Overdue {
    /// Threads (by thread id) that have waited on one layer for the timeout, with the layer.
    pub late: Vec<(i32, LayerId, Duration)>,
    /// Suspect layers that hold `saturated` waiting threads.
    pub saturated: Vec<LayerId>,
    /// Threads inside a lower access now.
    pub waiting: usize,
}

/// The waits past `limits`, with the layers' flags brought up to date with them.
pub fn overdue(limits: Limits) -> Overdue {
    let r = registry();
    let now = r.epoch.elapsed().as_nanos() as u64;
    let mut out = Overdue::default();
    let mut down = vec![false; TRACKED];
    let mut suspect = vec![false; TRACKED];
    for (tid, slot) in r.slots.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let layer = slot.layer.load(Ordering::Acquire);
        if layer == NONE {
            continue;
        }
        out.waiting += 1;
        let layer = (layer - 1) as LayerId;
        let i = layer as usize;
        let waited = Duration::from_nanos(now.saturating_sub(slot.since.load(Ordering::Relaxed)));
        if waited >= limits.stuck
            && let Some(s) = suspect.get_mut(i)
        {
            *s = true;
        }
        if limits.timeout.is_some_and(|t| waited >= t) {
            if let Some(d) = down.get_mut(i) {
                *d = true;
            }
            out.late.push((*tid, layer, waited));
        }
    }
    for (i, l) in r.layers.iter().enumerate() {
        l.down.store(down[i], Ordering::Relaxed);
        l.suspect.store(suspect[i], Ordering::Relaxed);
        if suspect[i] && l.waiters.load(Ordering::Relaxed) >= limits.saturated {
            out.saturated.push(i as LayerId);
        }
    }
    r.any_flag.store(
        down.contains(&true) || suspect.contains(&true),
        Ordering::Relaxed,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_nest_and_a_layer_with_an_overdue_wait_is_down_until_it_ends() {
        watch(Limits {
            timeout: None,
            stuck: STUCK,
            saturated: 2,
        });
        let outer = enter(3).unwrap();
        let inner = enter(4).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        let limits = Limits {
            timeout: Some(Duration::from_millis(20)),
            stuck: STUCK,
            saturated: usize::MAX,
        };
        let late = overdue(limits).late;
        assert!(late.iter().any(|&(t, l, _)| t == me && l == 4), "{late:?}");
        assert!(
            enter(4).is_err(),
            "a layer with an overdue wait takes no more"
        );
        assert!(enter(5).is_ok());
        drop(inner);
        let late = overdue(limits).late;
        assert!(late.iter().any(|&(t, l, _)| t == me && l == 3), "{late:?}");
        assert!(enter(4).is_ok(), "the layer is up again");
        drop(outer);
        assert!(!overdue(limits).late.iter().any(|&(t, ..)| t == me));

        // Without a timeout: two threads stuck on layer 6 fill it (limit 2), one does not.
        let no_timeout = Limits {
            timeout: None,
            stuck: Duration::from_millis(20),
            saturated: 2,
        };
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Arc::new(Mutex::new(rx));
        let stuck_thread = || {
            let rx = rx.clone();
            std::thread::spawn(move || {
                let _w = enter(6).unwrap();
                let _ = rx.lock().unwrap().recv();
            })
        };
        let one = stuck_thread();
        std::thread::sleep(Duration::from_millis(30));
        assert!(overdue(no_timeout).saturated.is_empty());
        assert!(enter(6).is_ok(), "one stuck thread leaves the layer up");
        let two = stuck_thread();
        std::thread::sleep(Duration::from_millis(30));
        let found = overdue(no_timeout);
        assert_eq!(found.saturated, [6]);
        assert!(found.late.is_empty(), "no timeout, nothing late");
        assert!(enter(6).is_err(), "a saturated layer takes no more");
        assert!(enter(7).is_ok());
        tx.send(()).unwrap();
        tx.send(()).unwrap();
        one.join().unwrap();
        two.join().unwrap();
        assert!(overdue(no_timeout).saturated.is_empty());
        assert!(enter(6).is_ok(), "the layer is up again");
    }
}
