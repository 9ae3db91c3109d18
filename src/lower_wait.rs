//! Which threads are waiting on which lower layer, and since when: what `lower_timeout=`
//! needs to tell a request blocked in a store that stopped answering (issue #16) from a slow
//! one of the upper layer.
//!
//! Code that is about to make syscalls on a lower layer holds a `Waiting` from `enter` for as
//! long as they take (only once `watch` was called: without `lower_timeout=` it is one load).
//! Each thread has one slot (layer, since) in a process-wide registry; a
//! `Waiting` sets it and puts the previous value back when dropped (calls nest). That costs two
//! atomic stores and a thread-local access per lower access, nothing more, and no lock. The
//! daemon's watchdog (daemon.rs) reads the slots: a request whose thread has waited on a layer
//! for longer than the timeout is answered EIO, and the layer counts as down — further entries
//! fail with EIO at once, instead of piling more threads into it — until no thread has waited on
//! it that long any more (its store answers again).

use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Result, errno};
use crate::layers::LayerId;

/// The slot value for "not waiting on a lower layer".
const NONE: u32 = 0;
/// Layers past this many are tracked as one (`DATA`), without a down flag of their own.
const TRACKED: usize = 512;
/// A lower file's data read through the daemon: the layer is not known where it is read.
pub const DATA: LayerId = LayerId::MAX;

struct Slot {
    /// `layer + 1`, or `NONE`.
    layer: AtomicU32,
    /// When the wait began: ns since `Registry::epoch`.
    since: AtomicU64,
}

struct Registry {
    epoch: Instant,
    slots: Mutex<Vec<(i32, Arc<Slot>)>>,
    down: Vec<AtomicBool>,
    /// Whether any layer is down: one load on the fast path.
    any_down: AtomicBool,
}

fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| Registry {
        epoch: Instant::now(),
        slots: Mutex::new(Vec::new()),
        down: (0..TRACKED).map(|_| AtomicBool::new(false)).collect(),
        any_down: AtomicBool::new(false),
    })
}

thread_local! {
    static SLOT: OnceCell<Arc<Slot>> = const { OnceCell::new() };
}

/// Whether anything reads the slots (`watch`): without `lower_timeout=` nothing is marked.
static WATCHED: AtomicBool = AtomicBool::new(false);

/// Turns the marking on, for the watchdog of `lower_timeout=` (daemon.rs).
pub fn watch() {
    WATCHED.store(true, Ordering::Relaxed);
}

/// Whether lower accesses are marked.
pub fn watched() -> bool {
    WATCHED.load(Ordering::Relaxed)
}

/// A thread's wait on a lower layer; ends when dropped.
pub struct Waiting(Option<(Arc<Slot>, (u32, u64))>);

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some((slot, prev)) = &self.0 {
            slot.since.store(prev.1, Ordering::Relaxed);
            slot.layer.store(prev.0, Ordering::Release);
        }
    }
}

/// Marks this thread as waiting on lower layer `layer` until the result is dropped; EIO at
/// once if the layer is down (see the module doc). Nothing at all unless `watch` was called.
pub fn enter(layer: LayerId) -> Result<Waiting> {
    if !watched() {
        return Ok(Waiting(None));
    }
    let r = registry();
    if r.any_down.load(Ordering::Relaxed)
        && r.down
            .get(layer as usize)
            .is_some_and(|d| d.load(Ordering::Relaxed))
    {
        return Err(errno(libc::EIO));
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
    Ok(Waiting(Some((slot, prev))))
}

/// Threads (by thread id) that have waited on one lower layer for at least `limit`, with the
/// layer; and the down flags brought up to date with them.
pub fn overdue(limit: Duration) -> Vec<(i32, LayerId, Duration)> {
    let r = registry();
    let now = r.epoch.elapsed().as_nanos() as u64;
    let mut out = Vec::new();
    let mut down = vec![false; TRACKED];
    for (tid, slot) in r.slots.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let layer = slot.layer.load(Ordering::Acquire);
        if layer == NONE {
            continue;
        }
        let waited = Duration::from_nanos(now.saturating_sub(slot.since.load(Ordering::Relaxed)));
        if waited >= limit {
            let layer = (layer - 1) as LayerId;
            if let Some(d) = down.get_mut(layer as usize) {
                *d = true;
            }
            out.push((*tid, layer, waited));
        }
    }
    for (flag, d) in r.down.iter().zip(&down) {
        flag.store(*d, Ordering::Relaxed);
    }
    r.any_down.store(down.contains(&true), Ordering::Relaxed);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_nest_and_a_layer_with_an_overdue_wait_is_down_until_it_ends() {
        watch();
        let outer = enter(3).unwrap();
        let inner = enter(4).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        let late = overdue(Duration::from_millis(20));
        assert!(late.iter().any(|&(t, l, _)| t == me && l == 4), "{late:?}");
        assert!(
            enter(4).is_err(),
            "a layer with an overdue wait takes no more"
        );
        assert!(enter(5).is_ok());
        drop(inner);
        let late = overdue(Duration::from_millis(20));
        assert!(late.iter().any(|&(t, l, _)| t == me && l == 3), "{late:?}");
        assert!(enter(4).is_ok(), "the layer is up again");
        drop(outer);
        assert!(
            !overdue(Duration::from_millis(20))
                .iter()
                .any(|&(t, ..)| t == me)
        );
    }
}
