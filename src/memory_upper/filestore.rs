//! The filestore: one host file holding the data blocks of every file of a memory upper layer
//! (issue #13; gVisor's rootfs overlay keeps its tmpfs data the same way).
//!
//! Blocks are `BLOCK` bytes, handed out lowest first so the file stays compact; a freed block
//! is punched out (FALLOC_FL_PUNCH_HOLE), so the filestore's `st_blocks` is the layer's live
//! data and `du` of the upper directory counts what the layer really uses.
//!
//! Crash safety rests on one rule, kept together with the tree (mod.rs): **a block the last
//! durable tree image refers to is never written or reused until the next image is durable.**
//! Files mark such extents `frozen`; a write to a frozen block goes to a fresh block (shadow
//! paging), and freeing one only defers it (`free_later`). `release_deferred` frees those after
//! the next image is on disk. So after a crash the last image and the filestore always agree,
//! whatever the daemon was writing.
//!
//! `state` is the only lock here; it is taken for the allocation or release of blocks, never
//! around I/O, and always last (docs/ROBUSTNESS.md, "Lock order").
//!
//! Reads are answered from `Mapping`, one shared read-only mapping of the filestore's first
//! `MAP_SPAN` bytes made at open: the kernel copies the reply straight from it, the daemon
//! never touches it (a filestore truncated under the daemon by someone else would make such a
//! touch a SIGBUS that ends every container on the mount; the kernel's copy fails with EFAULT
//! instead, and the request with EIO). Every block a file maps lies below the file's end
//! (a fresh block is written whole or zeroed, an image's blocks are checked against the length
//! at mount), so an honest read never faults.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;

use rustix::fs::FallocateFlags;

use crate::error::{Result, errno};

/// Bytes per block of the filestore, and the grain a memory upper file is written in: a
/// block is there (SEEK_DATA) or a hole, as in a sparse file on a 4 KiB file system.
pub const BLOCK: u64 = 4096;

pub struct Filestore {
    fd: OwnedFd,
    /// Where reads are copied from; `None` if the kernel refused the mapping (or it is not
    /// needed: a read-only store of an export).
    map: Option<Mapping>,
    /// The most blocks the layer may hold (`size=`); `None`: as many as the disk takes.
    limit: Option<u64>,
    state: Mutex<Allocation>,
}

struct Allocation {
    /// Free blocks below `end`, lowest first.
    free: BTreeSet<u64>,
    /// Blocks below this have been handed out at some time; the file is this long.
    end: u64,
    /// Blocks in use: mapped by a file, or freed but still in the durable image.
    live: u64,
    /// Blocks freed while the durable image still refers to them.
    deferred: Vec<u64>,
}

impl Allocation {
    /// Every block below `end` is free or live, never both (the test build checks it).
    fn check(&self) {
        if cfg!(debug_assertions) && self.end != u64::MAX {
            assert_eq!(
                self.live + self.free.len() as u64,
                self.end,
                "filestore: live and free blocks do not add up to the file"
            );
        }
    }
}

impl Filestore {
    /// A filestore over `fd`, whose blocks `used` (sorted, no duplicates) hold live data; every
    /// other block below the highest used one is free, and is punched out now in case it holds
    /// data written after the last image (that write was lost with the daemon).
    pub fn open(fd: OwnedFd, used: &[u64], limit: Option<u64>) -> Result<Filestore> {
        Filestore::open_mapping(fd, used, limit, MAP_SPAN)
    }

    /// `open`, with the first `span` bytes mapped for reads.
    fn open_mapping(
        fd: OwnedFd,
        used: &[u64],
        limit: Option<u64>,
        span: usize,
    ) -> Result<Filestore> {
        let end = used.last().map_or(0, |b| b + 1);
        let mut free = BTreeSet::new();
        let mut next = 0;
        for &b in used {
            free.extend(next..b);
            next = b + 1;
        }
        let map = Mapping::new(fd.as_fd(), span);
        let store = Filestore {
            fd,
            map,
            limit,
            state: Mutex::new(Allocation {
                free,
                end,
                live: used.len() as u64,
                deferred: Vec::new(),
            }),
        };
        rustix::fs::ftruncate(&store.fd, end * BLOCK)?;
        let free: Vec<u64> = store.state.lock().unwrap().free.iter().copied().collect();
        store.punch(&free)?;
        Ok(store)
    }

    /// A filestore only read from (`MemoryUpper::open_read_only`): no block is free, so none
    /// is ever handed out, and the file is not trimmed.
    pub fn read_only(fd: OwnedFd) -> Filestore {
        Filestore {
            fd,
            map: None,
            limit: Some(0),
            state: Mutex::new(Allocation {
                free: BTreeSet::new(),
                end: u64::MAX,
                live: 0,
                deferred: Vec::new(),
            }),
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The address of filestore byte `pos` and how many bytes from there the mapping holds, if
    /// reads may be answered from it. Only for the kernel to read (`Mapping`).
    pub fn mapped(&self, pos: u64) -> Option<(*const u8, u64)> {
        let m = self.map.as_ref()?;
        (pos < m.len as u64).then(|| {
            // SAFETY: `pos` is within the mapping.
            (
                unsafe { m.base.add(pos as usize) }.cast_const(),
                m.len as u64 - pos,
            )
        })
    }

    /// The most blocks the layer may hold, if `size=` set one.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Blocks in use (mapped, or kept for the durable image).
    pub fn live_blocks(&self) -> u64 {
        self.state.lock().unwrap().live
    }

    /// `n` blocks for new data, as runs `(first, count)` lowest first. ENOSPC past the limit,
    /// with nothing allocated.
    pub fn alloc(&self, n: u64) -> Result<Vec<(u64, u64)>> {
        let mut s = self.state.lock().unwrap();
        if self.limit.is_some_and(|l| s.live + n > l) {
            return Err(errno(libc::ENOSPC));
        }
        s.check();
        s.live += n;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut left = n;
        while left > 0 {
            let b = match s.free.pop_first() {
                Some(b) => b,
                None => {
                    // Past the end: the rest in one run.
                    let first = s.end;
                    s.end += left;
                    push_run(&mut runs, first, left);
                    break;
                }
            };
            push_run(&mut runs, b, 1);
            left -= 1;
        }
        Ok(runs)
    }

    /// Frees blocks no file maps and no durable image refers to: their space goes back to the
    /// host at once. Punched first, free after: once free, another file may take a block and
    /// write it, and a punch then would zero that file's data.
    pub fn free(&self, blocks: &[u64]) -> Result<()> {
        if blocks.is_empty() {
            return Ok(());
        }
        let punched = self.punch(blocks);
        let mut s = self.state.lock().unwrap();
        if cfg!(debug_assertions) {
            let mut seen = BTreeSet::new();
            for b in blocks {
                assert!(
                    *b < s.end && !s.free.contains(b) && seen.insert(*b),
                    "filestore: block {b} freed twice or never handed out"
                );
            }
        }
        s.live -= blocks.len() as u64;
        s.free.extend(blocks.iter().copied());
        s.check();
        punched
    }

    /// Frees blocks the durable image still refers to once the next image is durable.
    pub fn free_later(&self, blocks: &[u64]) {
        self.state
            .lock()
            .unwrap()
            .deferred
            .extend_from_slice(blocks);
    }

    /// Whether freed blocks wait for an image (`take_deferred`).
    pub fn has_deferred(&self) -> bool {
        !self.state.lock().unwrap().deferred.is_empty()
    }

    /// The blocks freed while the image being written was the durable one's successor-to-be:
    /// taken when a new image is collected, so that blocks freed after it wait for the one after.
    pub fn take_deferred(&self) -> Vec<u64> {
        std::mem::take(&mut self.state.lock().unwrap().deferred)
    }

    /// Gives back blocks taken with `take_deferred` when the image could not be written: they
    /// wait for the next one.
    pub fn restore_deferred(&self, blocks: Vec<u64>) {
        self.state.lock().unwrap().deferred.extend(blocks);
    }

    /// Punches `blocks` (any order) out of the file, one call per run of neighbours.
    fn punch(&self, blocks: &[u64]) -> Result<()> {
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        let mut runs = Vec::new();
        for b in sorted {
            push_run(&mut runs, b, 1);
        }
        for (first, count) in runs {
            let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
            match rustix::fs::fallocate(&self.fd, mode, first * BLOCK, count * BLOCK) {
                Ok(()) => {}
                // A file system without hole punching keeps the space; the data is still free.
                Err(e) if e == rustix::io::Errno::OPNOTSUPP => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Makes every block written so far durable (before an image that refers to them is).
    pub fn sync(&self) -> Result<()> {
        Ok(rustix::fs::fdatasync(&self.fd)?)
    }
}

/// Bytes of the filestore the mapping covers: 1 TiB of address space (of 128 TiB; it shows in
/// the daemon's VSZ, not its memory), reserved once and never remapped as the file grows.
/// Blocks past it are read with `pread`.
const MAP_SPAN: usize = 1 << 40;

/// A shared read-only mapping of the filestore, for the kernel to copy replies from. Never
/// read through in the daemon (no `&[u8]` over it is ever dereferenced): pages past the
/// file's end would raise SIGBUS.
struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is read-only and only its address is shared between threads.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `None` where the kernel refuses the mapping (an address-space limit, a file system
    /// without mmap) or `process_vm_readv` (a seccomp filter), which the io_uring transport
    /// copies replies with: reads then go by `pread`.
    fn new(fd: BorrowedFd<'_>, span: usize) -> Option<Mapping> {
        // SAFETY: a fresh mapping of our own descriptor, at an address the kernel chooses.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                span,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED | rustix::mm::MapFlags::NORESERVE,
                fd,
                0,
            )
        };
        let base = match base {
            Ok(b) => b.cast::<u8>(),
            Err(e) => {
                log::info!("memory upper: filestore not mapped ({e}); reads use pread");
                return None;
            }
        };
        let map = Mapping { base, len: span };
        crate::sys::kernel_can_copy_own_memory()
            .then_some(map)
            .or_else(|| {
                log::info!("memory upper: process_vm_readv refused; reads use pread");
                None
            })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once; no reply refers to it any more (replies are
        // sent while the file's body is locked, and the store outlives every file).
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), self.len) };
    }
}

/// Appends block `b` (or a run starting at it) to `runs`, joining it to the last run if it
/// follows on.
fn push_run(runs: &mut Vec<(u64, u64)>, first: u64, count: u64) {
    match runs.last_mut() {
        Some((f, c)) if *f + *c == first => *c += count,
        _ => runs.push((first, count)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn store(used: &[u64], limit: Option<u64>) -> Filestore {
        let fd =
            rustix::fs::memfd_create("filestore-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        Filestore::open(fd, used, limit).unwrap()
    }

    #[test]
    fn blocks_are_handed_out_lowest_first_in_runs() {
        let s = store(&[0, 3], None);
        assert_eq!(s.alloc(4).unwrap(), vec![(1, 2), (4, 2)]);
        assert_eq!(s.live_blocks(), 6);
        s.free(&[2, 1]).unwrap();
        assert_eq!(s.alloc(3).unwrap(), vec![(1, 2), (6, 1)]);
    }

    #[test]
    fn the_limit_refuses_an_allocation_whole() {
        let s = store(&[], Some(4));
        s.alloc(3).unwrap();
        assert!(s.alloc(2).unwrap_err().is(libc::ENOSPC));
        assert_eq!(s.live_blocks(), 3, "a refused allocation takes nothing");
        s.alloc(1).unwrap();
    }

    #[test]
    fn deferred_blocks_stay_live_until_released() {
        let s = store(&[0, 1, 2], Some(3));
        s.free_later(&[1]);
        assert!(
            s.alloc(1).unwrap_err().is(libc::ENOSPC),
            "block 1 is still the image's"
        );
        let d = s.take_deferred();
        s.free(&d).unwrap();
        assert_eq!(s.alloc(1).unwrap(), vec![(1, 1)]);
    }

    /// Reads from the mapping hand the kernel the same bytes a pread gives: mapped blocks,
    /// blocks past the mapping (read into a buffer), holes (zeros), the end of the file.
    #[test]
    fn reads_from_the_mapping_and_past_it_give_the_file_s_bytes() {
        use crate::memory_upper::data::FileBody;
        let fd =
            rustix::fs::memfd_create("filestore-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        // Three blocks mapped: the file's blocks land below and above the mapping's end.
        let s = Arc::new(Filestore::open_mapping(fd, &[], None, 3 * BLOCK as usize).unwrap());
        let closing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut f = FileBody::new(s.clone(), closing);
        let data: Vec<u8> = (0..6 * BLOCK as usize).map(|i| (i % 251) as u8).collect();
        f.write_for_test(&data[..2 * BLOCK as usize], 0);
        f.write_for_test(&data[3 * BLOCK as usize..], 3 * BLOCK); // block 2 stays a hole
        f.write_for_test(b"tail", 6 * BLOCK + 10);
        let size = 6 * BLOCK as usize + 14;
        for (off, len) in [
            (0, size),
            (100, 3 * BLOCK as usize),
            (4 * BLOCK + 7, 9000),
            (0, 1 << 20),
        ] {
            let mut want = vec![0u8; len];
            let n = f.read_for_test(&mut want, off);
            want.truncate(n);
            let got = f.read_mapped_for_test(off, len);
            assert!(got == want, "{len} bytes at {off}");
        }
    }

    #[test]
    fn freed_blocks_are_punched_out() {
        let s = store(&[], None);
        let runs = s.alloc(8).unwrap();
        assert_eq!(runs, vec![(0, 8)]);
        crate::sys::pwrite_full(s.fd(), &vec![7u8; 8 * BLOCK as usize], 0).unwrap();
        s.free(&[2, 3, 4]).unwrap();
        assert_eq!(crate::sys::seek_hole(s.fd(), 0).unwrap(), 2 * BLOCK);
        assert_eq!(
            crate::sys::seek_data(s.fd(), 2 * BLOCK).unwrap(),
            Some(5 * BLOCK)
        );
    }
}
