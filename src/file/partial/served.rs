//! What a daemon is in the middle of for pre-content events (precontent.rs), kept where the
//! next daemon of the mount finds it: a memfd mapped shared, which the mount's holder keeps
//! open along with the fanotify group itself (takeover.rs). With the group alive, the marks
//! stay on their upper files and events go on queueing while no daemon runs; what dies with a
//! daemon is what it knew:
//!
//! - which object each marked upper file belongs to (a file slot: the upper file's device and
//!   inode, the object's number), so that the next daemon can open the object and fill the
//!   ranges of events raised on a file it never opened itself;
//! - the events it read and had not answered yet (an event slot: the event's descriptor
//!   number in the dead daemon, the file, the range). The kernel keeps such an event waiting
//!   until someone answers its number on the group; the next daemon fills each range and
//!   answers each number, before it reads a single event itself (its own descriptor numbers
//!   could equal a dead one's).
//!
//! Between `read(2)` of a batch and the recording of its last event, and while an event could
//! not get a slot (more than `EVENTS` in service), the `unrecorded` word is above zero. A daemon
//! that finds it so cannot know which numbers wait: it fills every marked file whole, and then
//! answers every number the dead daemon could have held (`Left::unknown`). The reader polls
//! before it reads, so the word is raised only for the microseconds of a read that returns at
//! once.
//!
//! A slot is written before its state word says so (release), and cleared by its state word
//! first. Layout in docs/FORMAT.md, "Pre-content events in service".

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"MOSAEVT\0");
const VERSION: u64 = 1;
/// Marked files and events in service the table holds.
const FILES: usize = 4096;
const EVENTS: usize = 1024;
/// Words of the header, of a file slot, of an event slot.
const HEAD: usize = 8;
const FILE_WORDS: usize = 4;
const EVENT_WORDS: usize = 8;
/// Header words: magic, version, file slots, event slots, `unrecorded`.
const UNRECORDED: usize = 4;
const WORDS: usize = HEAD + FILES * FILE_WORDS + EVENTS * EVENT_WORDS;
const LEN: usize = WORDS * 8;

/// An upper file: device and inode number.
pub type Key = (u64, u64);

/// An event the daemon before read and did not answer (as far as its slot says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeftEvent {
    /// Its descriptor number in the dead daemon: what the answer names.
    pub fd: i32,
    pub key: Key,
    pub range: Option<(u64, u64)>,
}

/// What the daemon before left in the table.
#[derive(Debug, Default)]
pub struct Left {
    /// Marked upper files and the objects they belong to.
    pub files: HashMap<Key, u64>,
    pub events: Vec<LeftEvent>,
    /// Events may wait that no slot records: every marked file is to be filled whole, then
    /// every descriptor number answered.
    pub unknown: bool,
}

/// This daemon's table: which slots are free, and which file slot holds which key.
struct Slots {
    files: HashMap<Key, usize>,
    free_files: Vec<usize>,
    free_events: Vec<usize>,
}

pub struct Served {
    file: OwnedFd,
    /// The words, each reached through an atomic.
    map: crate::sys::SharedMap,
    slots: Mutex<Slots>,
}

impl Served {
    /// An empty table in a memfd of its own.
    pub fn create() -> std::io::Result<Served> {
        let file = rustix::fs::memfd_create("mosaicfs-events", rustix::fs::MemfdFlags::CLOEXEC)?;
        Self::lay_out(file)
    }

    /// The table the daemon before used (`file`, kept by the holder) and what it left there.
    /// A memfd this binary does not read is laid out anew, and counts as holding unrecorded
    /// events if it held anything: the safe side.
    pub fn adopt(file: OwnedFd) -> std::io::Result<(Served, Left)> {
        let size = rustix::fs::fstat(&file)?.st_size as usize;
        let mut head = [0u8; 32];
        let got = if size >= LEN {
            rustix::io::pread(&file, &mut head, 0)?
        } else {
            0
        };
        let word = |i: usize| u64::from_le_bytes(head[8 * i..8 * i + 8].try_into().unwrap());
        let known = got == head.len()
            && size == LEN
            && word(0) == MAGIC
            && word(1) == VERSION
            && word(2) == FILES as u64
            && word(3) == EVENTS as u64;
        if !known {
            let left = Left {
                unknown: size > 0,
                ..Left::default()
            };
            rustix::fs::ftruncate(&file, 0)?;
            return Ok((Self::lay_out(file)?, left));
        }
        let served = Self::map(file)?;
        let mut left = Left {
            unknown: served.word(UNRECORDED).load(Ordering::Acquire) > 0,
            ..Left::default()
        };
        let mut slots = served.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.free_files.clear();
        for i in (0..FILES).rev() {
            let w = |k: usize| {
                served
                    .word(HEAD + i * FILE_WORDS + k)
                    .load(Ordering::Acquire)
            };
            if w(0) == 0 {
                slots.free_files.push(i);
                continue;
            }
            let key = (w(1), w(2));
            left.files.insert(key, w(3));
            slots.files.insert(key, i);
        }
        for i in 0..EVENTS {
            let w = |k: usize| served.event_word(i, k).load(Ordering::Acquire);
            if w(0) == 0 {
                continue;
            }
            left.events.push(LeftEvent {
                fd: (w(0) - 1) as i32,
                key: (w(1), w(2)),
                range: (w(5) != 0).then(|| (w(3), w(4))),
            });
        }
        drop(slots);
        Ok((served, left))
    }

    fn lay_out(file: OwnedFd) -> std::io::Result<Served> {
        rustix::fs::ftruncate(&file, LEN as u64)?;
        // Every page now: no store into the mapping can then fail for memory (a SIGBUS).
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, LEN as u64)?;
        let mut head = [0u8; 32];
        for (i, w) in [MAGIC, VERSION, FILES as u64, EVENTS as u64]
            .iter()
            .enumerate()
        {
            head[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        rustix::io::pwrite(&file, &head, 0)?;
        Self::map(file)
    }

    fn map(file: OwnedFd) -> std::io::Result<Served> {
        let map = crate::sys::map_shared(file.as_fd(), LEN)?;
        Ok(Served {
            file,
            map,
            slots: Mutex::new(Slots {
                files: HashMap::new(),
                free_files: (0..FILES).rev().collect(),
                free_events: (0..EVENTS).rev().collect(),
            }),
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < WORDS);
        // SAFETY: `i` is within the mapping, which lives as long as `self`, and is aligned.
        unsafe { &*(self.map.ptr() as *const AtomicU64).add(i) }
    }

    fn event_word(&self, slot: usize, k: usize) -> &AtomicU64 {
        self.word(HEAD + FILES * FILE_WORDS + slot * EVENT_WORDS + k)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The memfd, for the holder to keep.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Records that upper file `key` is marked for object `number`. False when the table is
    /// full: the file is then not to be marked.
    pub fn add_file(&self, key: Key, number: u64) -> bool {
        let mut slots = self.lock();
        let slot = match slots.files.get(&key) {
            Some(&slot) => slot,
            None => {
                let Some(slot) = slots.free_files.pop() else {
                    return false;
                };
                slots.files.insert(key, slot);
                slot
            }
        };
        let w = |k: usize| self.word(HEAD + slot * FILE_WORDS + k);
        w(0).store(0, Ordering::Release);
        w(1).store(key.0, Ordering::Relaxed);
        w(2).store(key.1, Ordering::Relaxed);
        w(3).store(number, Ordering::Relaxed);
        w(0).store(1, Ordering::Release);
        true
    }

    /// Upper file `key` is marked no more.
    pub fn remove_file(&self, key: Key) {
        let mut slots = self.lock();
        if let Some(slot) = slots.files.remove(&key) {
            self.word(HEAD + slot * FILE_WORDS)
                .store(0, Ordering::Release);
            slots.free_files.push(slot);
        }
    }

    /// A `read(2)` of events is about to start (`true`) or its events are recorded.
    pub fn reading(&self, on: bool) {
        if on {
            self.word(UNRECORDED).fetch_add(1, Ordering::AcqRel);
        } else {
            self.word(UNRECORDED).fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Records an event read (descriptor `fd`, of upper file `key`): the slot to `answered`
    /// once it is answered. With no slot free, the event counts as unrecorded until then.
    pub fn add_event(&self, fd: i32, key: Key, range: Option<(u64, u64)>) -> Recorded {
        let Some(slot) = self.lock().free_events.pop() else {
            self.word(UNRECORDED).fetch_add(1, Ordering::AcqRel);
            return Recorded::Unrecorded;
        };
        let (off, len) = range.unwrap_or((0, 0));
        for (k, v) in [key.0, key.1, off, len, range.is_some() as u64]
            .into_iter()
            .enumerate()
        {
            self.event_word(slot, k + 1).store(v, Ordering::Relaxed);
        }
        self.event_word(slot, 0)
            .store(fd as u64 + 1, Ordering::Release);
        Recorded::Slot(slot)
    }

    /// The event recorded as `rec` was answered (its descriptor still open: its number is
    /// not handed out again before the slot is clear).
    pub fn answered(&self, rec: Recorded) {
        match rec {
            Recorded::Slot(slot) => {
                self.event_word(slot, 0).store(0, Ordering::Release);
                self.lock().free_events.push(slot);
            }
            Recorded::Unrecorded => {
                self.word(UNRECORDED).fetch_sub(1, Ordering::AcqRel);
            }
            Recorded::Not => {}
        }
    }

    /// Clears what the daemon before left, once this daemon answered it all: its events'
    /// slots, and `unrecorded`. Its file slots stay until those files are unmarked.
    pub fn forget_left_events(&self) {
        let mut slots = self.lock();
        slots.free_events = (0..EVENTS).rev().collect();
        for i in 0..EVENTS {
            self.event_word(i, 0).store(0, Ordering::Release);
        }
        self.word(UNRECORDED).store(0, Ordering::Release);
    }
}

/// Where an event in service is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    Slot(usize),
    /// No slot was free: counted in `unrecorded`.
    Unrecorded,
    /// Not recorded at all (no table: a mount without a holder).
    Not,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(s: &Served) -> OwnedFd {
        s.fd().try_clone_to_owned().unwrap()
    }

    #[test]
    fn files_and_events_outlive_the_table_in_its_memfd() {
        let s = Served::create().unwrap();
        assert!(s.add_file((1, 10), 100));
        assert!(s.add_file((1, 11), 110));
        s.remove_file((1, 11));
        let a = s.add_event(7, (1, 10), Some((4096, 1)));
        let b = s.add_event(8, (1, 10), None);
        s.answered(b);
        let fd = copy(&s);
        drop(s);
        let (s, left) = Served::adopt(fd).unwrap();
        assert_eq!(left.files, HashMap::from([((1, 10), 100)]));
        assert_eq!(
            left.events,
            vec![LeftEvent {
                fd: 7,
                key: (1, 10),
                range: Some((4096, 1))
            }]
        );
        assert!(!left.unknown);
        assert!(matches!(a, Recorded::Slot(_)));
        // The adopted table still knows the file, and gives its slot back on removal.
        s.forget_left_events();
        s.remove_file((1, 10));
        let (_, left) = Served::adopt(copy(&s)).unwrap();
        assert!(left.files.is_empty() && left.events.is_empty() && !left.unknown);
    }

    #[test]
    fn a_read_in_progress_or_an_event_without_a_slot_leaves_the_events_unknown() {
        let s = Served::create().unwrap();
        s.reading(true);
        let (_, left) = Served::adopt(copy(&s)).unwrap();
        assert!(left.unknown, "killed inside a read");
        s.reading(false);
        let recs: Vec<_> = (0..EVENTS + 1)
            .map(|i| s.add_event(i as i32, (1, 1), None))
            .collect();
        assert_eq!(recs[EVENTS], Recorded::Unrecorded);
        let (_, left) = Served::adopt(copy(&s)).unwrap();
        assert!(left.unknown, "an event no slot holds");
        assert_eq!(left.events.len(), EVENTS);
        s.answered(recs[EVENTS]);
        let (_, left) = Served::adopt(copy(&s)).unwrap();
        assert!(!left.unknown);
    }

    #[test]
    fn a_memfd_of_another_layout_counts_as_unknown_when_not_empty() {
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let (_, left) = Served::adopt(fd).unwrap();
        assert!(left.unknown);
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let (_, left) = Served::adopt(fd).unwrap();
        assert!(!left.unknown);
    }
}
