//! Change sequences: how a reader that looks at several things without a lock learns that a
//! writer changed them meanwhile (the kernel's seqcount, as `rename_lock` guards `d_path`).
//!
//! A writer brackets its change with `write()`; a reader takes `read()` before it looks and asks
//! `unchanged()` after, and looks again if the answer is no. Readers never write the shared
//! word, so a sequence costs readers no cache-line traffic, and writers never wait for readers.
//! Unlike the kernel's seqcount, writers may overlap (copy-up into a directory can run beside a
//! create in it): the word counts writers in progress in its low bits and finished changes
//! above them.

use std::sync::atomic::{AtomicU64, Ordering};

const WRITER: u64 = 1;
const WRITERS: u64 = (1 << 20) - 1;
const CHANGE: u64 = 1 << 20;

#[derive(Default, Debug)]
pub struct ChangeSeq(AtomicU64);

/// How many changes had finished when `read` gave `token`.
pub fn changes(token: u64) -> u64 {
    token / CHANGE
}

/// A change in progress; it counts as done when dropped.
pub struct ChangeGuard<'a>(&'a ChangeSeq);

impl Drop for ChangeGuard<'_> {
    fn drop(&mut self) {
        // One more change, one writer fewer, in one step.
        self.0.0.fetch_add(CHANGE - WRITER, Ordering::SeqCst);
    }
}

impl ChangeSeq {
    pub fn write(&self) -> ChangeGuard<'_> {
        self.0.fetch_add(WRITER, Ordering::SeqCst);
        ChangeGuard(self)
    }

    /// Records a change that was made in one atomic step (an `rmdir`): no reader can have seen
    /// it half done, so none waits for it, but every token taken before it is no longer
    /// `unchanged`.
    pub fn record(&self) {
        self.0.fetch_add(CHANGE, Ordering::SeqCst);
    }

    /// A token for `unchanged`, taken when no change is in progress (waits for one to end).
    pub fn read(&self) -> u64 {
        let mut spins = 0u32;
        loop {
            let v = self.0.load(Ordering::SeqCst);
            if v & WRITERS == 0 {
                return v;
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                // A writer doing disk work: do not burn the CPU it needs.
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// The number of the change a writer holding a guard is making: one more than the changes
    /// finished so far (writers that overlap may get the same number; see dircache.rs).
    pub fn next_change(&self) -> u64 {
        changes(self.0.load(Ordering::SeqCst)) + 1
    }

    /// Whether nothing changed, and nothing started changing, since `read` gave `token`.
    pub fn unchanged(&self, token: u64) -> bool {
        self.0.load(Ordering::SeqCst) == token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_begun_or_finished_after_read_is_seen() {
        let s = ChangeSeq::default();
        let t = s.read();
        assert!(s.unchanged(t));
        let g = s.write();
        assert!(!s.unchanged(t), "a change in progress");
        drop(g);
        assert!(!s.unchanged(t), "a finished change");
        let t = s.read();
        assert!(s.unchanged(t));
    }

    #[test]
    fn a_recorded_change_is_seen_and_keeps_nobody_waiting() {
        let s = ChangeSeq::default();
        let t = s.read();
        s.record();
        assert!(!s.unchanged(t));
        let t = s.read();
        assert!(s.unchanged(t), "read returned: no change in progress");
    }

    #[test]
    fn overlapping_writers_keep_readers_waiting_until_both_end() {
        let s = std::sync::Arc::new(ChangeSeq::default());
        let a = s.write();
        let b = s.write();
        drop(a);
        let s2 = s.clone();
        let reader = std::thread::spawn(move || s2.read());
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!reader.is_finished(), "one writer is still in progress");
        drop(b);
        let t = reader.join().unwrap();
        assert!(s.unchanged(t));
    }
}
