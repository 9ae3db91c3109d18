//! Records of forgotten nodes: where each object the kernel forgot was last seen, and its
//! generation (what a file handle of it needs after `drop_caches`, `Overlay::lookup_by_number`).
//!
//! They live in an unnamed file in the work directory, not in the daemon's heap: the kernel
//! forgets inodes when it wants their memory back, and records kept in the heap would hold on
//! to about a third of what the nodes held (docs/PERFORMANCE.md, "Memory per inode"). In a file
//! they are page cache, which the kernel writes back and reclaims like its own inode cache.
//! Mounts without a work directory (read-only, upper in memory) keep them in a memfd.
//!
//! The file is a direct-mapped table of 64-byte slots indexed by number (`slot`): numbers are
//! a layer's inode numbers, dense, so the records of one directory's files share pages. A
//! record displaces whatever held its slot (a number of another run of 2^20, or of another
//! layer); the table then knows less, which costs a scan of the tree for a handle of the
//! displaced object, never a wrong answer (the scan finds the object under the directories it
//! holds, not from the records it wrote, by_number.rs `scan_for`). A bit a slot, in memory, says which slots hold a record, so that a
//! number never forgotten costs no read.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{Ino, Seen};

/// Slots in the table: 64 MiB of file at most, sparse (only slots written take room).
pub(super) const SLOTS: u64 = 1 << 20;
const SLOT: usize = 64;
/// Name bytes a slot holds; a record of a longer name keeps the generation, not the place.
const NAME: usize = SLOT - 25;
/// The name-length byte of a record whose name did not fit.
const LONG: u8 = u8::MAX;
const LOCKS: usize = 64;

/// What the table keeps of a forgotten number.
#[derive(Debug, PartialEq, Eq)]
pub struct Record {
    pub seen: Seen,
    pub generation: u64,
    /// `InodeTable::scans` when recorded.
    pub epoch: u64,
}

pub struct Records {
    file: OwnedFd,
    /// One bit a slot: whether it holds a record. Mapped, not allocated, so that only the
    /// pages of slots in use are ever resident (128 KiB at most).
    present: Bits,
    /// A slot is read and written under `locks[slot % LOCKS]`: numbers of different shards
    /// may share a slot. Taken last, under a shard's lock, and nothing is taken under it.
    locks: [Mutex<()>; LOCKS],
    /// A write failed (a full disk): said once.
    failed: AtomicBool,
}

impl Records {
    /// An unnamed file in `work` (the work directory), or a memfd where there is none or the
    /// file system makes no unnamed files.
    pub fn new(work: Option<&OwnedFd>) -> std::io::Result<Records> {
        use rustix::fs::{Mode, OFlags};
        let flags = OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC;
        let file = match work.map(|w| rustix::fs::openat(w, ".", flags, Mode::RUSR | Mode::WUSR)) {
            Some(Ok(fd)) => fd,
            Some(Err(e)) => {
                log::info!(
                    "the work dir makes no unnamed files ({e}): records of forgotten inodes \
                     are kept in memory"
                );
                Self::memfd()?
            }
            None => Self::memfd()?,
        };
        Self::in_file(file)
    }

    fn in_file(file: OwnedFd) -> std::io::Result<Records> {
        Ok(Records {
            file,
            present: Bits::new((SLOTS / 64) as usize)?,
            locks: std::array::from_fn(|_| Mutex::new(())),
            failed: AtomicBool::new(false),
        })
    }

    fn memfd() -> std::io::Result<OwnedFd> {
        Ok(rustix::fs::memfd_create(
            "mosaicfs-records",
            rustix::fs::MemfdFlags::CLOEXEC,
        )?)
    }

    /// The record of `ino`, if the table has one.
    pub fn get(&self, ino: Ino) -> Option<Record> {
        let slot = slot(ino);
        if !self.present.get(slot) {
            return None;
        }
        let _locked = self.lock(slot);
        self.read(slot, ino)
    }

    /// The generation recorded for `ino`, the record dropped: the object lives again.
    pub fn take(&self, ino: Ino) -> Option<u64> {
        let slot = slot(ino);
        if !self.present.get(slot) {
            return None;
        }
        let _locked = self.lock(slot);
        let record = self.read(slot, ino)?;
        self.present.set(slot, false);
        Some(record.generation)
    }

    /// Records that `ino`, of `generation`, was last seen at `place` (`None`: its last known
    /// name was removed). False if that displaced the record of another number, or the record
    /// could not be written: the table then knows less than before.
    pub fn put(&self, ino: Ino, place: Option<(Ino, &OsStr)>, generation: u64, epoch: u64) -> bool {
        let slot = slot(ino);
        let _locked = self.lock(slot);
        let displaced = self.present.get(slot) && self.read(slot, ino).is_none();
        let mut buf = [0u8; SLOT];
        buf[0..8].copy_from_slice(&ino.to_le_bytes());
        buf[16..20].copy_from_slice(&(generation as u32).to_le_bytes());
        buf[20..24].copy_from_slice(&(epoch.min(u32::MAX as u64) as u32).to_le_bytes());
        if let Some((parent, name)) = place {
            buf[8..16].copy_from_slice(&parent.to_le_bytes());
            let name = name.as_bytes();
            if name.len() <= NAME {
                buf[24] = name.len() as u8;
                buf[25..25 + name.len()].copy_from_slice(name);
            } else {
                buf[24] = LONG;
            }
        }
        match rustix::io::pwrite(&self.file, &buf, slot * SLOT as u64) {
            Ok(n) if n == SLOT => {
                self.present.set(slot, true);
                !displaced
            }
            failed => {
                self.present.set(slot, false);
                if !self.failed.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "cannot write a record of a forgotten inode ({failed:?}; is the work \
                         dir's file system full?): file handles of forgotten files are found \
                         by scanning the tree"
                    );
                }
                false
            }
        }
    }

    fn lock(&self, slot: u64) -> std::sync::MutexGuard<'_, ()> {
        self.locks[slot as usize % LOCKS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The record in `slot` if it is `ino`'s. Called under the slot's lock.
    fn read(&self, slot: u64, ino: Ino) -> Option<Record> {
        let mut buf = [0u8; SLOT];
        match rustix::io::pread(&self.file, &mut buf, slot * SLOT as u64) {
            Ok(n) if n == SLOT => {}
            _ => return None,
        }
        let u64_at = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().unwrap());
        if u64_at(0) != ino {
            return None;
        }
        let parent = u64_at(8);
        let seen = match (parent, buf[24]) {
            (0, _) => Seen::Gone,
            (_, LONG) => Seen::Unknown,
            (_, len) => {
                let name = &buf[25..25 + (len as usize).min(NAME)];
                Seen::At(parent, OsStr::from_bytes(name).to_os_string())
            }
        };
        Some(Record {
            seen,
            generation: u32_at(16) as u64,
            epoch: u32_at(20) as u64,
        })
    }
}

/// The slot of `ino`: numbers side by side within each run of 2^20 (a directory's files share
/// pages), each run and each layer (inode/mod.rs `InoMap`'s tag) starting at a hashed place of
/// its own. File systems spread their numbers over such runs: XFS numbers the inodes of its
/// allocation group `k` from `k << n`, and taken bare, the low bits of a directory in one
/// group and of a file in another met in one slot, which pushed each other's records out.
fn slot(ino: Ino) -> u64 {
    let run = ino >> 20;
    let start = run.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 44;
    ino.wrapping_add(start) & (SLOTS - 1)
}

/// A number other than `ino` that takes its slot.
#[cfg(test)]
pub(super) fn rival_of(ino: Ino) -> Ino {
    (1..)
        .map(|run| (run << 20) | (ino & (SLOTS - 1)))
        .flat_map(|base| (0..SLOTS).map(move |i| base ^ i))
        .find(|&other| other != ino && slot(other) == slot(ino))
        .expect("every slot is shared")
}

/// Bits in an anonymous mapping: pages of zeros until written.
struct Bits {
    words: std::ptr::NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the words are atomics, shared like a `[AtomicU64]`.
unsafe impl Send for Bits {}
unsafe impl Sync for Bits {}

impl Bits {
    fn new(words: usize) -> std::io::Result<Bits> {
        let bytes = words * 8;
        // SAFETY: a fresh private anonymous mapping, unmapped in `drop`.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                bytes,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )?
        };
        Ok(Bits {
            words: std::ptr::NonNull::new(ptr.cast()).expect("mmap gives no null"),
            len: words,
        })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `len` zero-initialised words, mapped as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), self.len) }
    }

    fn get(&self, bit: u64) -> bool {
        self.words()[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
    }

    fn set(&self, bit: u64, on: bool) {
        let word = &self.words()[(bit / 64) as usize];
        match on {
            true => word.fetch_or(1 << (bit % 64), Ordering::Relaxed),
            false => word.fetch_and(!(1 << (bit % 64)), Ordering::Relaxed),
        };
    }
}

impl Drop for Bits {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer borrowed.
        unsafe {
            let _ = rustix::mm::munmap(self.words.as_ptr().cast(), self.len * 8);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn records() -> Records {
        Records::new(None).unwrap()
    }

    #[test]
    fn a_record_is_read_back_and_taken_once() {
        let r = records();
        assert_eq!(r.get(42), None);
        assert!(r.put(42, Some((7, OsStr::new("f"))), 3, 9));
        assert_eq!(
            r.get(42),
            Some(Record {
                seen: Seen::At(7, "f".into()),
                generation: 3,
                epoch: 9
            })
        );
        assert_eq!(r.take(42), Some(3));
        assert_eq!(r.take(42), None, "taken: the object lives again");
        assert_eq!(r.get(42), None);
    }

    #[test]
    fn a_removed_name_and_a_long_one_are_told_apart_from_a_place() {
        let r = records();
        assert!(r.put(5, None, 1, 0));
        assert_eq!(r.get(5).unwrap().seen, Seen::Gone);
        let long = "n".repeat(NAME + 1);
        assert!(r.put(6, Some((1, OsStr::new(&long))), 2, 0));
        let got = r.get(6).unwrap();
        assert_eq!(got.seen, Seen::Unknown, "no place rather than a cut name");
        assert_eq!(got.generation, 2, "the generation is kept");
        let fits = "m".repeat(NAME);
        assert!(r.put(7, Some((1, OsStr::new(&fits))), 0, 0));
        assert_eq!(r.get(7).unwrap().seen, Seen::At(1, fits.into()));
    }

    #[test]
    fn a_record_that_displaces_another_says_so_and_the_other_is_gone() {
        let r = records();
        let (a, b) = (100, rival_of(100));
        assert_eq!(slot(a), slot(b));
        assert!(r.put(a, Some((1, OsStr::new("a"))), 0, 0));
        assert!(
            r.put(a, Some((1, OsStr::new("a2"))), 0, 0),
            "its own record"
        );
        assert!(!r.put(b, Some((1, OsStr::new("b"))), 0, 0));
        assert_eq!(r.get(a), None);
        assert_eq!(r.get(b).unwrap().seen, Seen::At(1, "b".into()));
    }

    #[test]
    fn a_record_that_cannot_be_written_is_not_found_later() {
        // A file open only for reading stands for a full disk: every write fails.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("r"), b"").unwrap();
        let file = std::fs::File::open(dir.path().join("r")).unwrap();
        let r = Records::in_file(file.into()).unwrap();
        assert!(!r.put(42, Some((1, OsStr::new("f"))), 3, 0), "said lost");
        assert_eq!(r.get(42), None);
        assert_eq!(r.take(42), None);
    }

    #[test]
    fn records_go_to_an_unnamed_file_of_the_work_dir() {
        let dir = tempfile::tempdir().unwrap();
        let work: OwnedFd = std::fs::File::open(dir.path()).unwrap().into();
        let r = Records::new(Some(&work)).unwrap();
        assert!(r.put(42, Some((1, OsStr::new("f"))), 0, 0));
        let link = std::fs::read_link(format!("/proc/self/fd/{}", r.file.as_raw_fd())).unwrap();
        assert!(link.starts_with(dir.path()), "{link:?}");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "no name left behind"
        );
    }

    #[test]
    fn runs_of_numbers_far_apart_take_different_slots() {
        // XFS: the first inodes of two allocation groups.
        assert_ne!(slot((1 << 24) | 128), slot((3 << 24) | 128));
        assert_eq!(slot(128), 128, "the first run where it is");
    }

    #[test]
    fn numbers_of_two_layers_take_different_slots() {
        let (one, two) = ((1 << 56) | 1000, (2 << 56) | 1000);
        assert_ne!(slot(one), slot(two));
        assert_eq!(
            slot(one) + 1,
            slot(one + 1),
            "a layer's numbers side by side"
        );
    }
}
