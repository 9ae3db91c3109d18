//! The data path of an open partial file: block-by-block reads, writes that keep the partial-file
//! invariant (file/partial/mark.rs), truncation, preallocation, SEEK_DATA/SEEK_HOLE, and the
//! filling of blocks from the lower file.

pub mod arena;
pub mod caw;
pub mod mark;
pub mod precontent;
pub mod served;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use rustix::fs::FallocateFlags;

use crate::error::{Result, errno};
use crate::sys;
use crate::upper::UpperFile;
use caw::{CawShared, PendingBlock};
use mark::{BlockMap, PartialMark};

/// Where a layer file's bytes come from: a plain file, or a partial file left in a layer that
/// is now a lower layer (an upper dir stacked as a lower one), read through its own lower file.
/// A chain is at most as long as the layers below it.
pub enum Source {
    File(OwnedFd),
    Partial(Box<PartialFile>),
}

impl Source {
    /// The highest descriptor number this source holds (for the descriptor reserve).
    pub fn highest_fd(&self) -> i32 {
        use std::os::fd::AsRawFd;
        match self {
            Source::File(fd) => fd.as_raw_fd(),
            Source::Partial(p) => p.upper.raw_fd().max(p.lower.highest_fd()),
        }
    }

    /// The layer file itself, which a plain source is (for passthrough and stat).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Source::File(fd) => Some(fd.as_fd()),
            Source::Partial(_) => None,
        }
    }

    /// `stat` of the layer file itself (for a partial one, of its sparse file).
    pub fn stat(&self) -> Result<sys::Attr> {
        match self {
            Source::File(fd) => sys::fstat(fd.as_fd()),
            Source::Partial(p) => p.upper.stat(),
        }
    }

    /// The size of the file's content.
    pub fn size(&self) -> Result<u64> {
        match self {
            Source::File(fd) => Ok(sys::fstat(fd.as_fd())?.size),
            Source::Partial(p) => Ok(p.size),
        }
    }

    pub fn is_plain(&self) -> bool {
        matches!(self, Source::File(_))
    }

    /// Whether reading `len` bytes at `off` now costs no I/O (sys::is_cached). A partial file
    /// below cannot tell cheaply: no.
    pub fn is_cached(&self, off: u64, len: usize) -> bool {
        match self {
            Source::File(fd) => sys::is_cached(fd.as_fd(), off, len),
            Source::Partial(_) => false,
        }
    }

    /// Reads exactly `buf.len()` bytes at `off`, or fewer at end of file.
    pub fn pread_full(&self, buf: &mut [u8], off: u64) -> Result<usize> {
        match self {
            Source::File(fd) => sys::pread_full(fd.as_fd(), buf, off),
            Source::Partial(p) => {
                let bytes = p.read(off, buf.len())?;
                buf[..bytes.len()].copy_from_slice(&bytes);
                Ok(bytes.len())
            }
        }
    }

    /// Reads up to `len` bytes at `off` into `buf`, replacing its contents.
    pub fn pread_into(&self, buf: &mut Vec<u8>, len: usize, off: u64) -> Result<()> {
        match self {
            Source::File(fd) => sys::pread_into(fd.as_fd(), buf, len, off),
            Source::Partial(p) => {
                *buf = p.read(off, len)?;
                Ok(())
            }
        }
    }

    pub fn seek_data(&self, off: u64) -> Result<Option<u64>> {
        match self {
            Source::File(fd) => sys::seek_data(fd.as_fd(), off),
            Source::Partial(p) => p.seek_data(off),
        }
    }

    pub fn seek_hole(&self, off: u64) -> Result<u64> {
        match self {
            Source::File(fd) => sys::seek_hole(fd.as_fd(), off),
            Source::Partial(p) if off < p.size => p.seek_hole(off),
            Source::Partial(p) => Ok(p.size.max(off)),
        }
    }
}

/// An open partial file: the upper sparse file, the lower file it patches, and its block map.
pub struct PartialFile {
    /// The partial file's own sparse file (in the upper layer, or in a lower layer that was
    /// an upper one), whose holes below `valid` read the lower file.
    pub upper: UpperFile,
    pub lower: Source,
    pub mark: PartialMark,
    pub blocks: BlockMap,
    pub size: u64,
    pub block: u64,
    /// When the content last changed, for completion of idle files.
    pub last_write: Instant,
    /// Blocks written in part and not yet filled from the lower file (file/partial/caw.rs). Never
    /// present in `blocks`, always below `valid`.
    pub pending: BTreeMap<u64, PendingBlock>,
    /// Copy-after-write's shared state, or `None` when writes fill synchronously.
    pub caw: Option<Arc<CawShared>>,
    /// Whose pending blocks these are, for a daemon that finds them left (arena.rs).
    pub owner: arena::Owner,
    /// The upper file's size on disk, which trails `size` while the last block is pending.
    pub disk_size: u64,
    /// The pre-content mark while writers pass through to the upper file
    /// (file/partial/precontent.rs). They write into it directly, growing it beyond `size` and
    /// `disk_size` and allocating blocks at or past `valid` that `blocks` does not know of: while
    /// marked, the upper file itself says the size (`current_size`), and bytes at or past `valid`
    /// are read from it.
    pub by_events: Option<Box<ByEvents>>,
}

/// A partial file whose writers pass through (`PartialFile::by_events`).
pub struct ByEvents {
    /// Its upper file's pre-content mark, removed when this goes.
    pub mark: crate::file::partial::precontent::AccessMark,
    /// Where a sequential run of pre-content fills would go on, and its fill-ahead window in
    /// blocks (`fill_range`).
    fill_ahead: (u64, u64),
}

impl ByEvents {
    pub fn new(mark: crate::file::partial::precontent::AccessMark) -> ByEvents {
        ByEvents {
            mark,
            fill_ahead: (0, 0),
        }
    }
}

/// The fill-ahead window of a sequential writer passing through: from 64 KiB up to 1 MiB
/// (with 4 KiB blocks).
const FILL_AHEAD_MIN: u64 = 16;
const FILL_AHEAD_MAX: u64 = 256;

impl Drop for PartialFile {
    fn drop(&mut self) {
        // The last close: nothing may stay only in memory.
        if let Err(e) = self.flush_pending() {
            log::error!("filling pending blocks of a partial file failed, writes lost: {e}");
        }
        // Complete, or closed for good: no writer passes through any more.
        if let (Some(events), Ok(fd)) = (self.by_events.take(), self.upper.disk_fd()) {
            events.mark.remove(fd);
        }
    }
}

impl PartialFile {
    /// Reads `len` bytes at `off`, block by block from the upper file or the lower file.
    pub fn read(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.read_sized(off, len, self.current_size()?)
    }

    /// `read` of a file whose content is `size` bytes long.
    fn read_sized(&self, off: u64, len: usize, size: u64) -> Result<Vec<u8>> {
        let end = (off + len as u64).min(size);
        if off >= end {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (end - off) as usize];
        let bs = self.block;
        let mut cursor = off;
        for (s, e) in self.blocks.present_in(off / bs, end.div_ceil(bs)) {
            let (ps, pe) = ((s * bs).max(off), (e * bs).min(end));
            self.read_absent(&mut buf, off, cursor, ps)?;
            self.upper
                .read_at(&mut buf[(ps - off) as usize..(pe - off) as usize], ps)?;
            cursor = pe;
        }
        self.read_absent(&mut buf, off, cursor, end)?;
        // Bytes written into blocks still pending (merge on the fly).
        for (&blk, pb) in self.pending.range(off / bs..end.div_ceil(bs)) {
            let (bs0, be) = ((blk * bs).max(off), ((blk + 1) * bs).min(end));
            pb.overlay(
                (bs0 - blk * bs) as usize,
                &mut buf[(bs0 - off) as usize..(be - off) as usize],
            );
        }
        Ok(buf)
    }

    /// Fills `buf[a-base..b-base]`, a range with no upper block in `blocks`, from the lower
    /// file below `valid` and from the upper file at or past it (where a hole reads as zeros;
    /// a writer passing through may have written there).
    fn read_absent(&self, buf: &mut [u8], base: u64, a: u64, b: u64) -> Result<()> {
        let valid = self.mark.valid.clamp(a, b.max(a));
        if a < valid {
            self.lower
                .pread_full(&mut buf[(a - base) as usize..(valid - base) as usize], a)?;
        }
        if valid < b && self.by_events.is_some() {
            self.upper.read_at(
                &mut buf[(valid - base) as usize..(b - base) as usize],
                valid,
            )?;
        }
        Ok(())
    }

    /// The size of the content: `size`, or the upper file's if a writer passing through
    /// made it larger (passthrough never shrinks a file: truncation comes to the daemon).
    pub fn current_size(&self) -> Result<u64> {
        if self.by_events.is_none() {
            return Ok(self.size);
        }
        Ok(self.size.max(self.upper.stat()?.size))
    }

    /// Takes in what writers passing through changed: the size. Returns the upper file's
    /// attributes when it looked at them.
    pub fn refresh(&mut self) -> Result<Option<sys::Attr>> {
        if self.by_events.is_none() {
            return Ok(None);
        }
        let attr = self.upper.stat()?;
        if attr.size > self.disk_size {
            self.disk_size = attr.size;
            self.size = self.size.max(attr.size);
        }
        Ok(Some(attr))
    }

    /// Fills every block of `[off, off + len)` that still reads the lower file (a
    /// pre-content event: a reader or writer passing through is about to touch the range).
    /// A run of events each starting where the last fill ended (a sequential writer) fills
    /// ahead, in a window that doubles up to `FILL_AHEAD_MAX` blocks, so that such a writer
    /// waits for one event per window rather than one per write.
    pub fn fill_range(&mut self, off: u64, len: u64) -> Result<()> {
        let bs = self.block;
        let limit = self.fill_limit().div_ceil(bs);
        let first = off / bs;
        let end = off.saturating_add(len).div_ceil(bs);
        let (next, window) = self.by_events.as_ref().map_or((0, 0), |e| e.fill_ahead);
        // Sequential: the range reaches the block where the last fill ended.
        let window = if next > 0 && first <= next && next <= end {
            (window * 2).clamp(FILL_AHEAD_MIN, FILL_AHEAD_MAX)
        } else {
            0
        };
        let ahead = if window > 0 {
            end.max(next + window)
        } else {
            end
        }
        .min(limit);
        if let Some(e) = &mut self.by_events {
            e.fill_ahead = (ahead, window);
        }
        self.fill_run(first, end.min(limit))?;
        // Ahead is a bet, not a need: a failure there (a full disk) fails no access.
        if let Err(e) = self.fill_run(end.min(limit), ahead) {
            log::debug!("filling ahead of a sequential writer stopped: {e}");
            if let Some(ev) = &mut self.by_events {
                ev.fill_ahead = (0, 0);
            }
        }
        self.last_write = Instant::now();
        Ok(())
    }

    fn fill_run(&mut self, first: u64, end: u64) -> Result<()> {
        self.fill_missing(first, end, false).map(|_| ())
    }

    /// Fills the blocks of `first..end` that still read the lower file, in runs; with
    /// `keep_holes`, as completion does (`fill_blocks_keeping_holes`). Returns how many.
    pub fn fill_missing(&mut self, first: u64, end: u64, keep_holes: bool) -> Result<u64> {
        let mut filled = 0;
        let mut blk = first;
        while blk < end {
            if !self.needs_fill(blk) {
                blk += 1;
                continue;
            }
            let run = (blk..end).take_while(|&b| self.needs_fill(b)).count() as u64;
            if keep_holes {
                self.fill_blocks_keeping_holes(blk, blk + run)?;
            } else {
                self.fill_blocks(blk, blk + run)?;
            }
            filled += run;
            blk += run;
        }
        Ok(filled)
    }

    /// The partial-file invariant (file/partial/mark.rs), checked in the test build before `len`
    /// bytes are written at `at` of a file `size` bytes long: a block below `valid` that the write
    /// covers only in part already holds its data.
    fn check_whole_blocks(&self, at: u64, len: u64, size: u64) {
        if !cfg!(debug_assertions) || len == 0 {
            return;
        }
        let (bs, end) = (self.block, at + len);
        for blk in [at / bs, (end - 1) / bs] {
            let (start, stop) = (blk * bs, ((blk + 1) * bs).min(size));
            let in_part = at > start || end < stop;
            assert!(
                !(start < self.mark.valid && in_part && !self.blocks.contains(blk)),
                "partial file: block {blk} below valid={} written in part ({at}..{end})",
                self.mark.valid
            );
        }
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
        self.fill_blocks(blk, blk + 1)
    }

    /// Writes blocks `first..end`, none of them present, as the merged view shows them: one
    /// read of the merged content and one write of the upper file for the whole run.
    ///
    /// A fill changes no content, so it keeps the file's atime and mtime: the user's write
    /// set them (a deferred one with `touch`), and completion or a whole copy at open must not
    /// make an untouched file look modified (make, rsync and containers/storage's naive diff
    /// compare mtimes).
    pub fn fill_blocks(&mut self, first: u64, end: u64) -> Result<()> {
        // Writers passing through may have made the file longer: a block cut at a stale end
        // would be allocated with zeros where the lower file has data.
        let seen = self.refresh()?;
        let start = first * self.block;
        let stop = (end * self.block).min(self.size);
        if start < stop {
            let data = self.read_sized(start, (stop - start) as usize, self.size)?;
            let before = match seen {
                Some(attr) => attr,
                None => self.upper.stat()?,
            };
            self.check_whole_blocks(start, data.len() as u64, self.size);
            self.upper.write_at(&data, start)?;
            let (a, m) = (before.atime, before.mtime);
            self.upper
                .set_times(sys::Time::At(a.0, a.1), sys::Time::At(m.0, m.1))?;
            self.disk_size = self.disk_size.max(stop);
        }
        self.blocks.insert(first, end);
        // Their bytes are in the upper file now: the slots go.
        let done: Vec<u64> = self.pending.range(first..end).map(|(&b, _)| b).collect();
        for blk in &done {
            self.pending.remove(blk);
        }
        Ok(())
    }

    /// Completion's fill of blocks `first..end`, none of them present: like `fill_blocks`,
    /// except that blocks wholly inside a hole of the lower file, with nothing pending, stay
    /// holes and are only counted as present. They read as zeros whether the hole means
    /// "lower" (a crash before the mark goes) or "zeros" (after), so a sparse lower file
    /// completes to a sparse upper one, as kernel overlayfs' copy-up keeps holes.
    pub fn fill_blocks_keeping_holes(&mut self, first: u64, end: u64) -> Result<()> {
        let bs = self.block;
        let mut blk = first;
        while blk < end {
            let pos = blk * bs;
            let data = if pos < self.mark.valid {
                self.lower.seek_data(pos)?.filter(|d| *d < self.mark.valid)
            } else {
                None
            };
            // The lower file's next data, as a block: every block before it is in a hole.
            let data_blk = data.map_or(end, |d| (d / bs).min(end));
            let mut b = blk;
            while b < data_blk {
                let run = (b..data_blk)
                    .take_while(|x| !self.pending.contains_key(x))
                    .count() as u64;
                self.blocks.insert(b, b + run);
                b += run;
                if b < data_blk {
                    self.fill_block(b)?;
                    b += 1;
                }
            }
            let Some(d) = data.filter(|_| data_blk < end) else {
                break;
            };
            // From there to the block holding the lower file's next hole: data to copy.
            let hole = self.lower.seek_hole(d)?;
            let stop = hole.div_ceil(bs).clamp(data_blk + 1, end);
            self.fill_blocks(data_blk, stop)?;
            blk = stop;
        }
        Ok(())
    }

    /// Fills every pending block (before fsync, truncate, fallocate, and at the last close).
    pub fn flush_pending(&mut self) -> Result<()> {
        let blocks: Vec<u64> = self.pending.keys().copied().collect();
        for blk in blocks {
            self.fill_block(blk)?;
        }
        Ok(())
    }

    /// Writes what an earlier daemon left pending in block `left.block` of this file, as a
    /// synchronous write (the block is filled from the lower file and written whole).
    pub fn write_left(&mut self, left: &arena::LeftBlock) -> Result<()> {
        if left.owner.upper_ino != self.owner.upper_ino {
            return Err(crate::error::Error::with_context(
                libc::ESTALE,
                format!(
                    "its upper file is inode {} now, not {}",
                    self.owner.upper_ino, left.owner.upper_ino
                ),
            ));
        }
        let base = left.block * self.block;
        for (at, bytes) in &left.runs {
            self.write(base + *at as u64, bytes, false)?;
        }
        Ok(())
    }

    /// Writes `data` at `off`, block by block. A block that is present, wholly covered, or at
    /// or past `valid` is written in place. A partial write to any other block would leave a
    /// half-filled block: with `defer` its bytes go to a pending block (returned, for the
    /// workers), otherwise the block is completed from the lower file and written whole.
    pub fn write(&mut self, off: u64, data: &[u8], defer: bool) -> Result<Vec<u64>> {
        self.refresh()?;
        let mut newly_pending = Vec::new();
        if data.is_empty() {
            return Ok(newly_pending);
        }
        let bs = self.block;
        let end = off + data.len() as u64;
        let new_size = self.size.max(end);
        // Runs to write in place: (file offset, bytes).
        let mut runs: Vec<(u64, Cow<'_, [u8]>)> = Vec::new();
        let mut pos = off;
        while pos < end {
            let blk = pos / bs;
            let (bstart, bend) = (blk * bs, (blk + 1) * bs);
            let seg_end = end.min(bend);
            let seg = &data[(pos - off) as usize..(seg_end - off) as usize];
            let covers = pos == bstart && seg_end >= bend.min(new_size);
            if covers {
                // Written whole below (a resent write if the daemon dies before).
                self.pending.remove(&blk);
                push_run(&mut runs, pos, Cow::Borrowed(seg));
            } else if self.blocks.contains(blk) || bstart >= self.mark.valid {
                push_run(&mut runs, pos, Cow::Borrowed(seg));
            } else if let Some(pb) = self.pending.get_mut(&blk) {
                pb.put((pos - bstart) as usize, seg);
            } else if let Some(mut pb) = defer
                .then_some(self.caw.as_ref())
                .flatten()
                .filter(|c| {
                    // A block in the page cache is filled at once below (file/partial/caw.rs).
                    c.always
                        || !self
                            .lower
                            .is_cached(bstart, (bend.min(self.mark.valid) - bstart) as usize)
                })
                .and_then(|c| c.take(self.owner, blk, bs))
            {
                pb.put((pos - bstart) as usize, seg);
                self.pending.insert(blk, pb);
                newly_pending.push(blk);
            } else {
                // The block as it reads now, with this write on top, written whole.
                let block_end = bend.min(new_size);
                let mut whole = self.read(bstart, (block_end - bstart) as usize)?;
                whole.resize((block_end - bstart) as usize, 0);
                whole[(pos - bstart) as usize..(seg_end - bstart) as usize].copy_from_slice(seg);
                push_run(&mut runs, bstart, Cow::Owned(whole));
            }
            pos = seg_end;
        }
        if runs.is_empty() && new_size <= self.disk_size {
            // Every byte went to pending blocks: the write still changes the file now.
            self.upper.set_times(sys::Time::Omit, sys::Time::Now)?;
        }
        for (at, bytes) in &runs {
            self.check_whole_blocks(*at, bytes.len() as u64, new_size);
            self.upper.write_at(bytes, *at)?;
            let run_end = at + bytes.len() as u64;
            self.blocks.insert(at / bs, run_end.div_ceil(bs));
            self.disk_size = self.disk_size.max(run_end);
        }
        if new_size > self.disk_size {
            // A pending last block: the upper file still shows the size (st_size, a remount).
            self.upper.truncate(new_size)?;
            self.disk_size = new_size;
        }
        self.size = new_size;
        self.last_write = Instant::now();
        Ok(newly_pending)
    }

    /// SEEK_DATA: where data starts at or after `off` — an upper block, or lower data below
    /// `valid`. `None` when only a hole follows.
    pub fn seek_data(&self, off: u64) -> Result<Option<u64>> {
        let size = self.current_size()?;
        if off >= size {
            return Ok(None);
        }
        let bs = self.block;
        let mut upper = self
            .blocks
            .next_present(off / bs)
            .map(|b| (b * bs).max(off))
            .filter(|p| *p < size);
        if self.by_events.is_some() && size > self.mark.valid {
            let past_valid = off.max(self.mark.valid);
            if let Some(p) = self.upper.seek_data(past_valid)?.filter(|p| *p < size) {
                upper = Some(upper.map_or(p, |u| u.min(p)));
            }
        }
        let lower = if off < self.mark.valid {
            self.lower.seek_data(off)?.filter(|p| *p < self.mark.valid)
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
        let size = self.current_size()?;
        let bs = self.block;
        let mut pos = off;
        while pos < size {
            if self.by_events.is_some() && pos >= self.mark.valid {
                // The upper file alone says what is there.
                return Ok(if pos >= self.upper.stat()?.size {
                    pos
                } else {
                    self.upper.seek_hole(pos)?.min(size)
                });
            }
            if let Some((_, end)) = self.blocks.range_of(pos / bs) {
                pos = end * bs;
                continue;
            }
            if pos < self.mark.valid && self.lower.seek_data(pos)? == Some(pos) {
                let lower_hole = self.lower.seek_hole(pos)?.min(self.mark.valid);
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
        Ok(size)
    }

    fn save_mark(&self, names: &crate::layers::XattrNames) -> Result<()> {
        self.mark.store(&self.upper, names)
    }

    /// Changes the size. Shrinking below `valid` shortens the valid lower prefix, so that bytes
    /// past the new end read as zeros if the file grows again. Returns true when the file no
    /// longer needs its lower file (nothing of it is valid any more).
    pub fn set_size(&mut self, new: u64, names: &crate::layers::XattrNames) -> Result<bool> {
        self.refresh()?;
        // Order: the size first, then the mark. A crash between leaves a mark whose `valid` is
        // larger than the file, which only matters if the file is later extended.
        self.flush_pending()?;
        self.upper.truncate(new)?;
        self.disk_size = new;
        self.last_write = Instant::now();
        if new < self.size {
            self.blocks.truncate(new.div_ceil(self.block));
        }
        self.size = new;
        if new < self.mark.valid {
            self.mark.valid = new;
            if new == 0 {
                PartialMark::remove(&self.upper, names)?;
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
        self.refresh()?;
        self.flush_pending()?;
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
                    self.write(pos, &zeros[..n], false)?;
                    pos += n as u64;
                }
            }
            let from = off.max(self.mark.valid);
            if from < end {
                self.upper.fallocate(mode, from, end - from)?;
            }
            if !keep && end > self.size {
                self.size = end;
            }
            self.size = self.upper.stat()?.size;
            self.disk_size = self.size;
            self.blocks = BlockMap::from_file(&self.upper, self.size, bs)?;
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
        self.upper.fallocate(mode, off, len)?;
        if !keep && end > self.size {
            self.size = end;
        }
        self.disk_size = self.disk_size.max(self.size);
        self.blocks = BlockMap::from_file(&self.upper, self.size, bs)?;
        Ok(())
    }
}

/// Adds bytes to write at `at`, joining them to the previous run when they continue it, so a
/// long write is one pwrite.
fn push_run<'a>(runs: &mut Vec<(u64, Cow<'a, [u8]>)>, at: u64, bytes: Cow<'a, [u8]>) {
    match runs.last_mut() {
        Some((start, prev)) if *start + prev.len() as u64 == at => {
            prev.to_mut().extend_from_slice(&bytes)
        }
        _ => runs.push((at, bytes)),
    }
}
