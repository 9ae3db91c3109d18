//! What a daemon did of the requests that change the tree, for the daemon that takes its mount
//! over and gets them again (takeover.rs, FUSE_NOTIFY_RESEND).
//!
//! A request the kernel sends again was read by a daemon that ended before it answered: that
//! daemon may have done it or not. Looking at the tree tells only sometimes — a creation that
//! finds its name taken may have been made by the request, or have been there before it (an
//! exclusive create that must fail); a RENAME_EXCHANGE done once looks like one never done.
//! So every daemon of a mount that survives its daemon keeps, in one page of a file in the
//! work dir (`mosaicfs-orphans/requests`, mapped shared: what a killed process stored there
//! stays in the page cache), one word for each such request it is carrying out: the request's
//! number with `STARTED` before it changes anything, with `DONE` once it succeeded, cleared
//! once it failed or was answered. The next daemon reads the page before it serves
//! (`Ledger::open`) and leaves each word in place until it has answered that request itself:
//! a daemon that ends before the kernel sends it the request again leaves the word to the one
//! after it. A request sent again is then one of
//!
//! - done: answered as the first daemon would have, nothing changed again;
//! - started and not done: the daemon ended in the middle of it; the tree is looked at as
//!   before the ledger existed (fuse.rs `resent`);
//! - neither: not started, or failed (which changed nothing): done now, its error a real one.
//!
//! A request whose outcome the tree cannot tell keeps a note beside its word, written before
//! it changes anything: a RENAME_EXCHANGE notes the objects at its two names, so that the next
//! daemon, finding them swapped, knows the exchange was done even when the daemon before ended
//! between the swap and its mark (`Slot::note`, `Slot::noted`; fuse.rs `rename`).
//!
//! A word is busy from the request's start to its answer, so the page never holds more words
//! than requests in flight: 512, far above the workers a daemon runs. The file's blocks are
//! allocated when the file is made (a full file system then refuses the record, not a store
//! into the mapping later, which would be a SIGBUS). Without a work dir (no
//! place for the page), and after a daemon that kept none (an older binary), every resent
//! request is "started".

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The kernel's mark on a request it sends again (`FUSE_UNIQUE_RESEND`); the rest is the
/// number it had the first time.
const RESENT: u64 = 1 << 63;
const DONE: u64 = 1 << 62;
const STARTED: u64 = 1 << 61;
const NUMBER: u64 = STARTED - 1;
const WORDS: usize = 512;
/// The words, then two words of notes for each.
const SIZE: usize = WORDS * 8 * 3;

/// The file's name in the orphans directory.
pub const FILE: &str = "requests";

/// What the daemon before did of a request sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Before {
    /// Not sent again: this daemon is the first to see it.
    New,
    Done,
    /// Begun and maybe carried out, or no ledger to tell.
    Started,
    /// Not begun, or failed without a change.
    NotStarted,
}

impl Before {
    /// Whether the tree must be looked at to tell whether the request was carried out.
    pub fn may_be_done(self) -> bool {
        self == Before::Started
    }
}

pub struct Ledger {
    /// The words, reached only through atomics.
    map: crate::sys::SharedMap,
    _file: OwnedFd,
    /// Where the search for a free word starts.
    next: AtomicUsize,
    /// The words the daemons before left: request number to its word as left (number and
    /// state), notes and index; `None` where the daemon before kept no ledger (a binary before
    /// this one), and a resent request may have been done. The words stay in the page until
    /// the request they record is answered (`start`).
    before: Option<HashMap<u64, Inherited>>,
}

impl Ledger {
    /// The first word of the page.
    fn words(&self) -> *const AtomicU64 {
        self.map.ptr() as *const AtomicU64
    }

    /// The ledger file `FILE` in directory `dir`: read for what the daemon before left
    /// (`took_over`), then emptied for this daemon.
    pub fn open(dir: impl AsFd, took_over: bool) -> std::io::Result<Ledger> {
        use rustix::fs::{Mode, OFlags};
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW;
        let file = rustix::fs::openat(dir, FILE, flags, Mode::from_raw_mode(0o600))?;
        let kept = took_over && rustix::fs::fstat(&file)?.st_size == SIZE as i64;
        if !kept {
            rustix::fs::ftruncate(&file, 0)?;
        }
        rustix::fs::ftruncate(&file, SIZE as u64)?;
        // Its blocks are allocated now: a store into a hole of a shared mapping allocates at
        // the page fault, and on a full file system that fault is a SIGBUS.
        if let Err(e) =
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, SIZE as u64)
        {
            if e != rustix::io::Errno::OPNOTSUPP {
                return Err(e.into());
            }
            if !kept {
                rustix::io::pwrite(&file, &[0u8; SIZE], 0)?;
            }
            rustix::fs::fdatasync(&file)?;
        }
        // Reached only through the atomics below.
        let map = crate::sys::map_shared(file.as_fd(), SIZE)?;
        let words = map.ptr() as *const AtomicU64;
        let mut before: HashMap<u64, Inherited> = HashMap::new();
        for i in 0..WORDS {
            // SAFETY: `i` and its notes are inside the mapping; AtomicU64 has u64's layout, and
            // the page is aligned.
            let [word, a, b] = [i, note_at(i), note_at(i) + 1].map(|k| unsafe { &*words.add(k) });
            let w = word.load(Ordering::Relaxed);
            if w != 0 {
                let notes = [a.load(Ordering::Relaxed), b.load(Ordering::Relaxed)];
                before.insert(
                    w & NUMBER,
                    Inherited {
                        word: w,
                        notes,
                        at: i,
                    },
                );
            } else {
                // A free word's notes are zeros (a daemon may have ended while freeing one).
                a.store(0, Ordering::Relaxed);
                b.store(0, Ordering::Relaxed);
            }
        }
        // Left in place, so that a daemon after this one still finds them if this one ends
        // before the kernel sends it the request again. A word the kernel will not send again
        // (its answer was written, but the daemon ended before it freed the word) would stay
        // for good: beyond `INHERITED_KEPT`, the oldest go.
        if before.len() > INHERITED_KEPT {
            let mut numbers: Vec<u64> = before.keys().copied().collect();
            numbers.sort_unstable();
            for n in &numbers[..numbers.len() - INHERITED_KEPT] {
                let old = before.remove(n).expect("listed above");
                // SAFETY: as above.
                let [word, a, b] = [old.at, note_at(old.at), note_at(old.at) + 1]
                    .map(|k| unsafe { &*words.add(k) });
                for w in [a, b, word] {
                    w.store(0, Ordering::Relaxed);
                }
            }
        }
        Ok(Ledger {
            map,
            _file: file,
            next: AtomicUsize::new(0),
            before: (kept || !took_over).then_some(before),
        })
    }

    /// Records that request `unique` starts, and says what the daemon before did of it. The
    /// returned slot is to be told the outcome (`Slot::finish`) before the answer, and dropped
    /// after it. A request sent again keeps what the daemon before recorded of it, so that a
    /// third daemon knows it too.
    pub fn start(&self, unique: u64) -> Slot<'_> {
        let number = unique & NUMBER;
        let mut noted = [0; 2];
        let mut inherited = None;
        let before = if unique & RESENT == 0 {
            Before::New
        } else {
            match self.before.as_ref().map(|b| b.get(&number)) {
                Some(Some(old)) => {
                    inherited = Some(old);
                    if old.word & DONE != 0 {
                        Before::Done
                    } else {
                        noted = old.notes;
                        Before::Started
                    }
                }
                None => Before::Started,
                Some(None) => Before::NotStarted,
            }
        };
        let state = if before == Before::Done {
            DONE
        } else {
            STARTED
        };
        // The word a daemon before left for this request, while it is still there (a request
        // is sent again once per takeover, so only a stale copy of `before` could find it
        // taken); else a free one.
        let claim = |i: usize, from: u64| {
            // SAFETY: `i` is inside the mapping.
            let word = unsafe { &*self.words().add(i) };
            word.compare_exchange(from, number | state, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                .then_some((i, word))
        };
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let found = inherited
            .and_then(|old| claim(old.at, old.word))
            .or_else(|| (0..WORDS).find_map(|k| claim((start + k) % WORDS, 0)));
        if let Some((i, word)) = found {
            // SAFETY: the notes of word `i`, inside the mapping.
            let notes = unsafe { &*(self.words().add(note_at(i)) as *const [AtomicU64; 2]) };
            let slot = Slot {
                word: Some((word, notes)),
                number,
                before,
                noted,
            };
            // Kept for a daemon after this one, should it end before the answer too.
            if noted != [0; 2] {
                slot.note(noted);
            }
            return slot;
        }
        log::warn!("more requests in flight than the ledger holds: request {number} unrecorded");
        Slot {
            word: None,
            number,
            before,
            noted,
        }
    }
}

/// A word a daemon before left (`Ledger::before`).
struct Inherited {
    /// As it was left: the request's number and its state.
    word: u64,
    notes: [u64; 2],
    /// Its index in the page.
    at: usize,
}

/// The most words of daemons before that a daemon keeps (`Ledger::open`): far above the
/// requests in flight at a kill (at most one per worker), so that only words no request will
/// claim again go.
const INHERITED_KEPT: usize = 256;

/// Where the two notes of word `i` are.
fn note_at(i: usize) -> usize {
    WORDS + 2 * i
}

/// A request being carried out (`Ledger::start`).
pub struct Slot<'a> {
    word: Option<(&'a AtomicU64, &'a [AtomicU64; 2])>,
    number: u64,
    before: Before,
    /// What the daemon before noted of the request (`note`), zeros if nothing.
    noted: [u64; 2],
}

impl Slot<'_> {
    /// A request with no ledger to record it in: sent again, it is "started".
    pub fn unrecorded(unique: u64) -> Slot<'static> {
        Slot {
            word: None,
            number: unique & NUMBER,
            before: if unique & RESENT == 0 {
                Before::New
            } else {
                Before::Started
            },
            noted: [0; 2],
        }
    }

    pub fn before(&self) -> Before {
        self.before
    }

    /// Whether the request is in the record (a mount that survives its daemon).
    pub fn recorded(&self) -> bool {
        self.word.is_some()
    }

    /// Notes two numbers that tell, once the request is sent again, whether it was done;
    /// stored before the request changes anything.
    pub fn note(&self, notes: [u64; 2]) {
        if let Some((_, words)) = self.word {
            words[0].store(notes[0], Ordering::Release);
            words[1].store(notes[1], Ordering::Release);
        }
    }

    /// What a daemon before this one noted of the request it began (`note`), if anything.
    pub fn noted(&self) -> Option<[u64; 2]> {
        (self.noted != [0; 2]).then_some(self.noted)
    }

    /// The request succeeded (recorded as done) or failed (forgotten: it changed nothing,
    /// and sent again it is done again).
    pub fn finish(&self, ok: bool) {
        if let Some((word, _)) = self.word {
            let w = if ok { self.number | DONE } else { 0 };
            word.store(w, Ordering::Release);
        }
    }
}

impl Drop for Slot<'_> {
    /// Answered: the word is free.
    fn drop(&mut self) {
        if let Some((word, _)) = self.word {
            self.note([0; 2]);
            word.store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (tempfile::TempDir, OwnedFd) {
        let t = tempfile::tempdir().unwrap();
        let fd = rustix::fs::open(
            t.path(),
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        (t, fd)
    }

    #[test]
    fn the_next_daemon_knows_what_was_done_started_or_failed() {
        let (_t, d) = dir();
        let first = Ledger::open(&d, false).unwrap();
        let done = first.start(10);
        done.finish(true);
        let started = first.start(12);
        let failed = first.start(14);
        failed.finish(false);
        let answered = first.start(16);
        answered.finish(true);
        drop(answered);
        assert_eq!(done.before(), Before::New);
        // The daemon ends here, its slots never dropped.
        std::mem::forget((done, started, failed));
        drop(first);

        let second = Ledger::open(&d, true).unwrap();
        let again = |n: u64| second.start(n | RESENT).before();
        assert_eq!(again(10), Before::Done);
        assert_eq!(again(12), Before::Started);
        assert_eq!(again(14), Before::NotStarted);
        assert_eq!(again(16), Before::NotStarted, "answered: not sent again");
        assert_eq!(second.start(18).before(), Before::New);

        // A request sent again and held by the second daemon too is known to the third.
        let held = second.start(10 | RESENT);
        std::mem::forget(held);
        let third = Ledger::open(&d, true).unwrap();
        assert_eq!(third.start(10 | RESENT).before(), Before::Done);

        // A fresh mount forgets every daemon before it.
        drop((second, third));
        let fresh = Ledger::open(&d, false).unwrap();
        assert_eq!(fresh.start(10 | RESENT).before(), Before::NotStarted);

        // A daemon before that kept no ledger (an older binary) may have done anything.
        drop(fresh);
        rustix::fs::unlinkat(&d, FILE, rustix::fs::AtFlags::empty()).unwrap();
        let after_old = Ledger::open(&d, true).unwrap();
        assert_eq!(after_old.start(10 | RESENT).before(), Before::Started);
        let next = Ledger::open(&d, true).unwrap();
        assert_eq!(next.start(10 | RESENT).before(), Before::NotStarted);
    }

    /// A daemon that took over and ended before the kernel sent it the requests again leaves
    /// their words to the next one. Fails where a daemon empties the page as it reads it: the
    /// fsstress-style checker with a hundred kills saw a rename the first daemon had done
    /// told "not started" by the third and answered ENOENT.
    #[test]
    fn a_daemon_that_ends_before_its_resent_requests_leaves_them_to_the_next() {
        let (_t, d) = dir();
        let first = Ledger::open(&d, false).unwrap();
        let done = first.start(30);
        done.finish(true);
        let started = first.start(32);
        started.note([5, 6]);
        std::mem::forget((done, started));
        drop(first);
        // The second takes over, holds one request of its own, and ends before either of the
        // first's reaches it.
        let second = Ledger::open(&d, true).unwrap();
        std::mem::forget(second.start(34));
        drop(second);
        let third = Ledger::open(&d, true).unwrap();
        assert_eq!(third.start(30 | RESENT).before(), Before::Done);
        let again = third.start(32 | RESENT);
        assert_eq!(again.before(), Before::Started);
        assert_eq!(again.noted(), Some([5, 6]));
        assert_eq!(third.start(34 | RESENT).before(), Before::Started);
        // Answered by the third: their words are free, and a fourth daemon does not see them.
        drop(again);
        drop(third);
        let fourth = Ledger::open(&d, true).unwrap();
        assert_eq!(fourth.start(32 | RESENT).before(), Before::NotStarted);
        assert_eq!(fourth.start(30 | RESENT).before(), Before::NotStarted);
    }

    /// Words no request claims again (answered as the daemon ended) do not pile up across
    /// takeovers: beyond `INHERITED_KEPT`, the oldest go.
    #[test]
    fn only_the_newest_inherited_words_are_kept() {
        let (_t, d) = dir();
        let first = Ledger::open(&d, false).unwrap();
        let extra = 40;
        for n in 0..(INHERITED_KEPT + extra) as u64 {
            std::mem::forget(first.start(100 + n));
        }
        drop(first);
        let second = Ledger::open(&d, true).unwrap();
        assert_eq!(second.start(100 | RESENT).before(), Before::NotStarted);
        let newest = 100 + (INHERITED_KEPT + extra) as u64 - 1;
        assert_eq!(second.start(newest | RESENT).before(), Before::Started);
        let oldest_kept = 100 + extra as u64;
        assert_eq!(second.start(oldest_kept | RESENT).before(), Before::Started);
        assert_eq!(
            second.start((oldest_kept - 1) | RESENT).before(),
            Before::NotStarted
        );
    }

    #[test]
    fn notes_reach_the_daemons_after_while_the_request_is_unanswered() {
        let (_t, d) = dir();
        let first = Ledger::open(&d, false).unwrap();
        let started = first.start(20);
        started.note([7, 9]);
        let answered = first.start(22);
        answered.note([1, 2]);
        drop(answered);
        let reused = first.start(24);
        assert_eq!(reused.noted(), None);
        std::mem::forget((started, reused));
        drop(first);

        let second = Ledger::open(&d, true).unwrap();
        let again = second.start(20 | RESENT);
        assert_eq!(again.before(), Before::Started);
        assert_eq!(again.noted(), Some([7, 9]));
        assert_eq!(second.start(24 | RESENT).noted(), None, "nothing noted");
        std::mem::forget(again);
        drop(second);
        let third = Ledger::open(&d, true).unwrap();
        assert_eq!(
            third.start(20 | RESENT).noted(),
            Some([7, 9]),
            "kept for the third"
        );
    }

    /// On a full file system the record is refused when it is made; a store into a page
    /// without a block would be a SIGBUS at the first request.
    #[test]
    fn a_full_file_system_refuses_the_record_at_once() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let mnt = t.path();
        let opts = std::ffi::CString::new("size=64k").unwrap();
        rustix::mount::mount(
            "tmpfs",
            mnt,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            opts.as_c_str(),
        )
        .unwrap();
        let filler = mnt.join("filler");
        let _ = std::fs::write(&filler, vec![1u8; 1 << 20]);
        let d = rustix::fs::open(
            mnt,
            rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        let opened = Ledger::open(&d, false);
        let refused = opened.as_ref().err().map(|e| e.raw_os_error());
        if let Ok(l) = &opened {
            // What the fallocate spares: without it this store is the SIGBUS.
            l.start(2).finish(true);
        }
        drop((opened, d));
        rustix::mount::unmount(mnt, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(refused, Some(Some(libc::ENOSPC)));
    }

    #[test]
    fn a_word_is_held_from_start_to_answer_only() {
        let (_t, d) = dir();
        let l = Ledger::open(&d, false).unwrap();
        for n in 0..(WORDS as u64 * 3) {
            let s = l.start(n * 2);
            s.finish(true);
        }
        let held: Vec<_> = (0..WORDS as u64).map(|n| l.start(n * 2)).collect();
        assert!(held.iter().all(|s| s.word.is_some()));
        assert!(l.start(1 << 20).word.is_none(), "every word busy");
    }
}
