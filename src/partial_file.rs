//! The data path of an open partial file: block-by-block reads, writes that keep the
//! partial-file invariant (partial.rs), truncation, preallocation, SEEK_DATA/SEEK_HOLE, and the
//! filling of blocks from the lower file.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use rustix::fs::FallocateFlags;

use crate::error::{Result, errno};
use crate::partial::{BlockMap, PartialMark};
use crate::sys;

/// An open partial file: the upper sparse file, the lower file it patches, and its block map.
pub struct PartialFile {
    pub upper: OwnedFd,
    pub lower: OwnedFd,
    pub mark: PartialMark,
    pub blocks: BlockMap,
    pub size: u64,
    pub block: u64,
    /// When the content last changed, for completion of idle files.
    pub last_write: Instant,
}

impl PartialFile {
    /// Reads `len` bytes at `off`, block by block from the upper file or the lower file.
    pub fn read(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        let end = (off + len as u64).min(self.size);
        if off >= end {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (end - off) as usize];
        let bs = self.block;
        let mut cursor = off;
        for (s, e) in self.blocks.present_in(off / bs, end.div_ceil(bs)) {
            let (ps, pe) = ((s * bs).max(off), (e * bs).min(end));
            self.read_absent(&mut buf, off, cursor, ps)?;
            sys::pread_full(
                self.upper.as_fd(),
                &mut buf[(ps - off) as usize..(pe - off) as usize],
                ps,
            )?;
            cursor = pe;
        }
        self.read_absent(&mut buf, off, cursor, end)?;
        Ok(buf)
    }

    /// Fills `buf[a-base..b-base]`, a range with no upper block, from the lower file below
    /// `valid` (the buffer is zero past it).
    fn read_absent(&self, buf: &mut [u8], base: u64, a: u64, b: u64) -> Result<()> {
        let b = b.min(self.mark.valid);
        if a < b {
            sys::pread_full(
                self.lower.as_fd(),
                &mut buf[(a - base) as usize..(b - base) as usize],
                a,
            )?;
        }
        Ok(())
    }

    pub fn needs_fill(&self, blk: u64) -> bool {
        blk * self.block < self.mark.valid && !self.blocks.contains(blk)
    }

    /// Bytes below this still come from the lower file when absent.
    pub fn fill_limit(&self) -> u64 {
        self.mark.valid.min(self.size)
    }

    /// Writes block `blk` whole, as the merged view shows it.
    pub fn fill_block(&mut self, blk: u64) -> Result<()> {
        let start = blk * self.block;
        let end = ((blk + 1) * self.block).min(self.size);
        let data = self.read(start, (end - start) as usize)?;
        sys::pwrite_full(self.upper.as_fd(), &data, start)?;
        self.blocks.insert(blk, blk + 1);
        Ok(())
    }

    /// Writes `data` at `off`. An edge block not yet present is completed from the lower file
    /// first, so the upper file only ever receives whole, final blocks below `valid`.
    pub fn write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let bs = self.block;
        let end = off + data.len() as u64;
        let new_size = self.size.max(end);
        let head = off / bs;
        let tail = (end - 1) / bs;
        let mut start = off;
        let mut prefix = Vec::new();
        let mut suffix = Vec::new();
        if !off.is_multiple_of(bs) && self.needs_fill(head) {
            start = head * bs;
            prefix = self.read(start, (off - start) as usize)?;
            prefix.resize((off - start) as usize, 0);
        }
        if !end.is_multiple_of(bs) && self.needs_fill(tail) {
            let block_end = ((tail + 1) * bs).min(new_size);
            if block_end > end {
                suffix = self.read(end, (block_end - end) as usize)?;
                suffix.resize((block_end - end) as usize, 0);
            }
        }
        if prefix.is_empty() && suffix.is_empty() {
            sys::pwrite_full(self.upper.as_fd(), data, off)?;
        } else {
            let mut whole = Vec::with_capacity(prefix.len() + data.len() + suffix.len());
            whole.extend_from_slice(&prefix);
            whole.extend_from_slice(data);
            whole.extend_from_slice(&suffix);
            sys::pwrite_full(self.upper.as_fd(), &whole, start)?;
        }
        let written_end = end + suffix.len() as u64;
        self.blocks.insert(start / bs, written_end.div_ceil(bs));
        self.size = new_size;
        self.last_write = Instant::now();
        Ok(())
    }

    /// SEEK_DATA: where data starts at or after `off` — an upper block, or lower data below
    /// `valid`. `None` when only a hole follows.
    pub fn seek_data(&self, off: u64) -> Result<Option<u64>> {
        if off >= self.size {
            return Ok(None);
        }
        let bs = self.block;
        let upper = self
            .blocks
            .next_present(off / bs)
            .map(|b| (b * bs).max(off))
            .filter(|p| *p < self.size);
        let lower = if off < self.mark.valid {
            sys::seek_data(self.lower.as_fd(), off)?.filter(|p| *p < self.mark.valid)
        } else {
            None
        };
        Ok(match (upper, lower) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// SEEK_HOLE: where the next hole (or end of file) starts at or after `off`.
    pub fn seek_hole(&self, off: u64) -> Result<u64> {
        let bs = self.block;
        let mut pos = off;
        while pos < self.size {
            if let Some((_, end)) = self.blocks.range_of(pos / bs) {
                pos = end * bs;
                continue;
            }
            if pos < self.mark.valid && sys::seek_data(self.lower.as_fd(), pos)? == Some(pos) {
                let lower_hole = sys::seek_hole(self.lower.as_fd(), pos)?.min(self.mark.valid);
                // Lower data runs to its hole, unless an upper block takes over before that.
                let next_upper = self
                    .blocks
                    .next_present(pos / bs + 1)
                    .map_or(u64::MAX, |b| b * bs);
                pos = lower_hole.min(next_upper.max(pos + 1));
                continue;
            }
            return Ok(pos);
        }
        Ok(self.size)
    }

    fn save_mark(&self, names: &crate::layers::XattrNames) -> Result<()> {
        rustix::fs::fsetxattr(
            &self.upper,
            names.partial.as_str(),
            &self.mark.encode(),
            rustix::fs::XattrFlags::empty(),
        )?;
        Ok(())
    }

    /// Changes the size. Shrinking below `valid` shortens the valid lower prefix, so that bytes
    /// past the new end read as zeros if the file grows again. Returns true when the file no
    /// longer needs its lower file (nothing of it is valid any more).
    pub fn set_size(&mut self, new: u64, names: &crate::layers::XattrNames) -> Result<bool> {
        // Order: the size first, then the mark. A crash between leaves a mark whose `valid` is
        // larger than the file, which only matters if the file is later extended.
        rustix::fs::ftruncate(&self.upper, new)?;
        self.last_write = Instant::now();
        if new < self.size {
            self.blocks.truncate(new.div_ceil(self.block));
        }
        self.size = new;
        if new < self.mark.valid {
            self.mark.valid = new;
            if new == 0 {
                rustix::fs::fremovexattr(&self.upper, names.partial.as_str())?;
                return Ok(true);
            }
            self.save_mark(names)?;
        }
        Ok(false)
    }

    /// fallocate on a partial file, translated so that a hole below `valid` is never created
    /// where data must read as zeros, and no block below `valid` is allocated without its data.
    pub fn fallocate(
        &mut self,
        off: u64,
        len: u64,
        mode: FallocateFlags,
        names: &crate::layers::XattrNames,
    ) -> Result<()> {
        let end = off.checked_add(len).ok_or_else(|| errno(libc::EFBIG))?;
        let keep = mode.contains(FallocateFlags::KEEP_SIZE);
        let bs = self.block;
        if mode.intersects(
            FallocateFlags::COLLAPSE_RANGE
                | FallocateFlags::INSERT_RANGE
                | FallocateFlags::UNSHARE_RANGE,
        ) {
            return Err(errno(libc::EOPNOTSUPP));
        }
        if mode.intersects(FallocateFlags::PUNCH_HOLE | FallocateFlags::ZERO_RANGE) {
            if mode.contains(FallocateFlags::PUNCH_HOLE) && !keep {
                return Err(errno(libc::EINVAL));
            }
            let old_size = self.size;
            let zero_end = end.min(self.mark.valid).min(old_size);
            if off < self.mark.valid && end >= old_size {
                // Everything from `off` to the end reads as zeros now: shorten the valid prefix.
                self.mark.valid = off;
                self.save_mark(names)?;
            } else if off < zero_end {
                // Below `valid` a hole would read the lower file: write real zeros there.
                let zeros = vec![0u8; (bs as usize * 64).min((zero_end - off) as usize)];
                let mut pos = off;
                while pos < zero_end {
                    let n = zeros.len().min((zero_end - pos) as usize);
                    self.write(pos, &zeros[..n])?;
                    pos += n as u64;
                }
            }
            let from = off.max(self.mark.valid);
            if from < end {
                rustix::fs::fallocate(&self.upper, mode, from, end - from)?;
            }
            if !keep && end > self.size {
                self.size = end;
            }
            self.size = sys::fstat(self.upper.as_fd())?.size;
            self.blocks = BlockMap::from_file(self.upper.as_fd(), self.size, bs)?;
            return Ok(());
        }
        // Plain allocation: blocks below `valid` get their data first, so none is an empty
        // allocated block that would hide the lower data.
        let fill_end = end.min(self.mark.valid);
        let mut blk = off / bs;
        while blk * bs < fill_end {
            if self.needs_fill(blk) {
                self.fill_block(blk)?;
            }
            blk += 1;
        }
        rustix::fs::fallocate(&self.upper, mode, off, len)?;
        if !keep && end > self.size {
            self.size = end;
        }
        self.blocks = BlockMap::from_file(self.upper.as_fd(), self.size, bs)?;
        Ok(())
    }
}
