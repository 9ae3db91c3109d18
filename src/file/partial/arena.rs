//! Where copy-after-write's pending blocks live: a memfd mapped shared, which the mount's holder
//! process keeps open too (takeover.rs), so that the bytes of a write that returned outlive a
//! daemon that is killed before it filled their block. The next daemon finds every block left
//! pending (`left`), writes its bytes into the file as a synchronous write would, and frees it
//! (`Overlay::replay_pending`) before it serves a request; it then uses the arena as it was
//! laid out.
//!
//! Layout (docs/FORMAT.md, "Pending copy-after-write blocks"): a header page (magic, version,
//! block size, slot count), then one record per slot — its state, the object's number, the
//! upper file's inode number, the block's index, and one bit per byte of the block saying
//! which bytes a write put there — then, page-aligned, the slots' data, a block each.
//!
//! A slot is live from `take` (its record written, then its state) to `free` (its state
//! cleared first). The file that owns it reaches it only under that file's lock, so its bytes
//! need no atomics; a daemon killed between a write's copy into a slot and its reply leaves a
//! slot the kernel's resent write completes. Pages are allocated ahead of use in chunks
//! (`fallocate`: no fault of a store can fail for memory), and given back once the arena has
//! had nothing pending for a while (`give_back_if_idle`).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::FallocateFlags;

const PAGE: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"MOSACAW\0");
const VERSION: u64 = 1;
/// A slot record's state word while a block is pending in it.
const LIVE: u64 = u64::from_le_bytes(*b"PENDING\0");
/// The fixed part of a slot's record: state, object number, upper inode, block index.
const RECORD_HEAD: usize = 32;
/// Slots whose pages are allocated at a time.
const CHUNK: usize = 64;
/// How long the arena stays unused before its pages are given back.
const IDLE: Duration = Duration::from_secs(1);

/// Who a pending block belongs to: enough for the next daemon to find the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The object's number (its `st_ino` in the merged view), found by number (by_number.rs).
    pub number: u64,
    /// The inode number of its upper file, checked before a left block is written there.
    pub upper_ino: u64,
}

/// A block left pending by an earlier daemon.
pub struct LeftBlock {
    pub slot: usize,
    pub owner: Owner,
    pub block: u64,
    /// The runs of bytes written into it: offset in the block, bytes.
    pub runs: Vec<(usize, Vec<u8>)>,
}

struct Layout {
    block: usize,
    slots: usize,
    /// Bytes of one slot's record (fixed part and written bits, rounded to 64).
    record: usize,
    /// Where slot 0's data starts.
    data_at: usize,
    len: usize,
}

impl Layout {
    fn new(block: usize, slots: usize) -> Layout {
        let record = (RECORD_HEAD + block.div_ceil(8)).next_multiple_of(64);
        let data_at = (PAGE + slots * record).next_multiple_of(PAGE);
        Layout {
            block,
            slots,
            record,
            data_at,
            len: data_at + slots * block,
        }
    }
}

/// Which slots are free; counts of those handed out.
struct Free {
    /// Freed slots, reused last-in first-out (their pages are warm).
    unused: Vec<u32>,
    /// Slots handed out at least once since the pages were last given back: `0..high`.
    high: usize,
    /// Slots whose pages are allocated: `0..allocated`.
    allocated: usize,
    used: usize,
    idle_since: Instant,
}

/// The shared memory of a mount's pending blocks.
pub struct Arena {
    file: OwnedFd,
    /// A slot's bytes are reached only by the file that holds the slot, under that file's
    /// lock, and the state words through atomics.
    map: crate::sys::SharedMap,
    layout: Layout,
    /// Taken briefly to hand out or take back a slot, and to give pages back.
    free: Mutex<Free>,
}

impl Arena {
    /// A new arena of `limit` bytes of blocks of `block` bytes, in a memfd of its own.
    pub fn create(limit: usize, block: usize) -> std::io::Result<Arena> {
        let file = rustix::fs::memfd_create("mosaicfs-pending", rustix::fs::MemfdFlags::CLOEXEC)?;
        Self::lay_out(file, limit, block)
    }

    /// The arena an earlier daemon of this mount used (`file`, kept by the holder), as it was
    /// laid out: its blocks are `left` until `replayed`, and no slot is handed out before.
    /// A memfd this binary cannot read is laid out anew for `limit` and `block`.
    pub fn adopt(file: OwnedFd, limit: usize, block: usize) -> std::io::Result<Arena> {
        let size = rustix::fs::fstat(&file)?.st_size as usize;
        let mut head = [0u8; 32];
        let got = if size >= PAGE {
            rustix::io::pread(&file, &mut head, 0)?
        } else {
            0
        };
        let word = |i: usize| u64::from_le_bytes(head[8 * i..8 * i + 8].try_into().unwrap());
        let (old_block, slots) = (word(2) as usize, word(3) as usize);
        let known = got == head.len()
            && word(0) == MAGIC
            && word(1) == VERSION
            && old_block.is_power_of_two()
            && Layout::new(old_block, slots).len == size;
        if !known {
            if size > 0 {
                log::error!(
                    "the pending copy-after-write blocks the daemon before left are in a layout \
                     this binary does not read: their writes are lost"
                );
            }
            rustix::fs::ftruncate(&file, 0)?;
            return Self::lay_out(file, limit, block);
        }
        let layout = Layout::new(old_block, slots);
        let map = crate::sys::map_shared(file.as_fd(), layout.len)?;
        let arena = Arena::from_parts(file, map, layout);
        arena.lock().high = arena.layout.slots;
        Ok(arena)
    }

    fn lay_out(file: OwnedFd, limit: usize, block: usize) -> std::io::Result<Arena> {
        let layout = Layout::new(block, limit / block);
        rustix::fs::ftruncate(&file, layout.len as u64)?;
        let mut head = [0u8; 32];
        for (i, w) in [MAGIC, VERSION, block as u64, layout.slots as u64]
            .iter()
            .enumerate()
        {
            head[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        rustix::io::pwrite(&file, &head, 0)?;
        let map = crate::sys::map_shared(file.as_fd(), layout.len)?;
        Ok(Arena::from_parts(file, map, layout))
    }

    fn from_parts(file: OwnedFd, map: crate::sys::SharedMap, layout: Layout) -> Arena {
        Arena {
            file,
            map,
            free: Mutex::new(Free {
                unused: Vec::new(),
                high: 0,
                allocated: 0,
                used: 0,
                idle_since: Instant::now(),
            }),
            layout,
        }
    }

    /// The memfd, for the holder to keep.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The size of a block a slot holds.
    pub fn block(&self) -> usize {
        self.layout.block
    }

    /// Bytes of the blocks pending now.
    pub fn pending_bytes(&self) -> usize {
        self.lock().used * self.layout.block
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn state(&self, slot: usize) -> &AtomicU64 {
        debug_assert!(slot < self.layout.slots);
        // SAFETY: the record of a slot inside the mapping, 64-byte aligned (the mapping is
        // page-aligned, PAGE and `record` are multiples of 64); AtomicU64 has u64's layout.
        unsafe { &*(self.map.ptr().add(PAGE + slot * self.layout.record) as *const AtomicU64) }
    }

    /// Word `i` (1..4) of a slot's record, or of its written bits (4..).
    fn word(&self, slot: usize, i: usize) -> *mut u64 {
        // SAFETY: inside the slot's record (`RECORD_HEAD` + the bits, within `record`).
        unsafe { (self.map.ptr().add(PAGE + slot * self.layout.record) as *mut u64).add(i) }
    }

    fn data(&self, slot: usize) -> *mut u8 {
        // SAFETY: slot `slot`'s block, inside the mapping.
        unsafe {
            self.map
                .ptr()
                .add(self.layout.data_at + slot * self.layout.block)
        }
    }

    /// A free slot for block `block` of `owner`'s file, with nothing written in it; `None`
    /// when every slot is taken or no memory can be had for one.
    pub fn take(&self, owner: Owner, block: u64) -> Option<usize> {
        let slot = {
            let mut free = self.lock();
            let slot = match free.unused.pop() {
                Some(s) => s as usize,
                None if free.high < self.layout.slots => {
                    if free.high == free.allocated {
                        let end = (free.allocated + CHUNK).min(self.layout.slots);
                        self.allocate(free.allocated, end).ok()?;
                        free.allocated = end;
                    }
                    free.high += 1;
                    free.high - 1
                }
                None => return None,
            };
            free.used += 1;
            slot
        };
        let bits = self.layout.block.div_ceil(64);
        // SAFETY: the slot is this caller's alone from here until `free`.
        unsafe {
            std::ptr::write_bytes(self.word(slot, RECORD_HEAD / 8), 0, bits);
            *self.word(slot, 1) = owner.number;
            *self.word(slot, 2) = owner.upper_ino;
            *self.word(slot, 3) = block;
        }
        self.state(slot).store(LIVE, Ordering::Release);
        Some(slot)
    }

    /// Allocates the pages of slots `from..to`, records and data.
    fn allocate(&self, from: usize, to: usize) -> std::io::Result<()> {
        let l = &self.layout;
        let records = (PAGE + from * l.record, (to - from) * l.record);
        let data = (l.data_at + from * l.block, (to - from) * l.block);
        for (at, len) in [records, data] {
            rustix::fs::fallocate(&self.file, FallocateFlags::KEEP_SIZE, at as u64, len as u64)?;
        }
        Ok(())
    }

    /// Gives slot `slot` back: its block was written to the file, or is no longer wanted.
    pub fn free(&self, slot: usize) {
        self.state(slot).store(0, Ordering::Release);
        let mut free = self.lock();
        free.unused.push(slot as u32);
        free.used -= 1;
        if free.used == 0 {
            free.idle_since = Instant::now();
        }
    }

    /// Puts `bytes` at offset `at` of slot `slot`'s block.
    pub fn put(&self, slot: usize, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= self.layout.block);
        // SAFETY: inside the slot's block and bits, which the caller holds (`take`).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data(slot).add(at), bytes.len());
            for i in at..at + bytes.len() {
                *self.word(slot, RECORD_HEAD / 8 + i / 64) |= 1 << (i % 64);
            }
        }
    }

    /// Copies the written bytes of slot `slot`'s block range `from..from + dst.len()` over
    /// `dst`.
    pub fn overlay(&self, slot: usize, from: usize, dst: &mut [u8]) {
        assert!(from + dst.len() <= self.layout.block);
        for (k, byte) in dst.iter_mut().enumerate() {
            let i = from + k;
            // SAFETY: inside the slot's block and bits, which the caller holds.
            unsafe {
                if *self.word(slot, RECORD_HEAD / 8 + i / 64) & (1 << (i % 64)) != 0 {
                    *byte = *self.data(slot).add(i);
                }
            }
        }
    }

    /// The runs of written bytes of slot `slot`.
    fn runs(&self, slot: usize) -> Vec<(usize, Vec<u8>)> {
        let written = |i: usize| {
            // SAFETY: a bit of the slot's record.
            unsafe { *self.word(slot, RECORD_HEAD / 8 + i / 64) & (1 << (i % 64)) != 0 }
        };
        let mut runs = Vec::new();
        let mut i = 0;
        while i < self.layout.block {
            if !written(i) {
                i += 1;
                continue;
            }
            let start = i;
            while i < self.layout.block && written(i) {
                i += 1;
            }
            // SAFETY: the slot's block, `start..i` inside it.
            let bytes =
                unsafe { std::slice::from_raw_parts(self.data(slot).add(start), i - start) };
            runs.push((start, bytes.to_vec()));
        }
        runs
    }

    /// The blocks an earlier daemon left pending (an adopted arena, before `replayed`).
    pub fn left(&self) -> Vec<LeftBlock> {
        (0..self.layout.slots)
            .filter(|&s| self.state(s).load(Ordering::Acquire) == LIVE)
            .map(|slot| {
                // SAFETY: words of a live slot's record, which no one else holds now.
                let word = |i| unsafe { *self.word(slot, i) };
                LeftBlock {
                    slot,
                    owner: Owner {
                        number: word(1),
                        upper_ino: word(2),
                    },
                    block: word(3),
                    runs: self.runs(slot),
                }
            })
            .collect()
    }

    /// Marks a left block done (its bytes are in the file now).
    pub fn forget_left(&self, slot: usize) {
        self.state(slot).store(0, Ordering::Release);
    }

    /// Every left block was written (`left`, `forget_left`): slots are handed out from now.
    pub fn replayed(&self) {
        let mut free = self.lock();
        free.high = 0;
        free.allocated = 0;
    }

    /// Gives the pages of the slots back once nothing was pending for `IDLE`.
    pub fn give_back_if_idle(&self) {
        let mut free = self.lock();
        if free.used > 0 || free.allocated == 0 || free.idle_since.elapsed() < IDLE {
            return;
        }
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        let len = self.layout.len - PAGE;
        if rustix::fs::fallocate(&self.file, flags, PAGE as u64, len as u64).is_ok() {
            free.unused.clear();
            free.high = 0;
            free.allocated = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: Owner = Owner {
        number: 77,
        upper_ino: 12,
    };

    #[test]
    fn a_pending_block_outlives_its_arena_in_the_memfd() {
        let arena = Arena::create(64 * 4096, 4096).unwrap();
        let slot = arena.take(OWNER, 9).unwrap();
        arena.put(slot, 10, b"abc");
        arena.put(slot, 4000, b"z");
        let free = arena.take(OWNER, 3).unwrap();
        arena.free(free);
        // What a daemon killed now leaves: the memfd, held by the holder.
        let kept = arena.fd().try_clone_to_owned().unwrap();
        drop(arena);
        let next = Arena::adopt(kept, 8 * 8192, 8192).unwrap();
        assert_eq!(next.block(), 4096, "the layout it was left in");
        let left = next.left();
        assert_eq!(left.len(), 1, "the freed slot is not left, the live one is");
        assert_eq!(left[0].owner, OWNER);
        assert_eq!(left[0].block, 9);
        assert_eq!(
            left[0].runs,
            vec![(10, b"abc".to_vec()), (4000, b"z".to_vec())]
        );
        assert!(
            next.take(OWNER, 1).is_none(),
            "no slot before the left ones are written"
        );
        next.forget_left(left[0].slot);
        next.replayed();
        assert!(next.left().is_empty());
        let slot = next.take(OWNER, 1).unwrap();
        let mut dst = [b'.'; 4];
        next.put(slot, 1, b"xy");
        next.overlay(slot, 0, &mut dst);
        assert_eq!(&dst, b".xy.");
    }

    #[test]
    fn slots_run_out_at_the_limit_and_come_back_when_freed() {
        let arena = Arena::create(2 * 4096, 4096).unwrap();
        let a = arena.take(OWNER, 0).unwrap();
        let b = arena.take(OWNER, 1).unwrap();
        assert!(arena.take(OWNER, 2).is_none());
        assert_eq!(arena.pending_bytes(), 2 * 4096);
        arena.free(a);
        let c = arena.take(OWNER, 2).unwrap();
        assert_eq!(c, a, "a freed slot is reused first");
        let mut dst = [7u8; 8];
        arena.overlay(c, 0, &mut dst);
        assert_eq!(
            dst, [7u8; 8],
            "a reused slot holds none of its last block's bytes"
        );
        arena.free(b);
        arena.free(c);
        assert_eq!(arena.pending_bytes(), 0);
    }

    #[test]
    fn a_memfd_of_another_layout_is_read_as_empty() {
        let file = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::pwrite(&file, &[1u8; 8192], 0).unwrap();
        let arena = Arena::adopt(file, 4 * 4096, 4096).unwrap();
        assert!(arena.left().is_empty());
        assert!(arena.take(OWNER, 0).is_some(), "laid out anew");
    }
}
