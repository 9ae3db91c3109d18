//! File data of the memory upper layer: each regular file maps its blocks to filestore blocks,
//! like a sparse file on disk. An unmapped block is a hole and reads as zeros; SEEK_DATA finds
//! the mapped ones — which is what a partial file's "blocks present" means, so the overlay's
//! partial files work over this store unchanged.
//!
//! A block is written in place unless the last durable image refers to it (`frozen`): then the
//! write goes to a fresh block and the old one is released after the next image (filestore.rs).
//! A write allocates before it changes anything, so ENOSPC (the layer's `size=`) or a host I/O
//! error leaves the file as it was.

use std::collections::BTreeMap;
use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::changes::MapChange;
use super::filestore::{BLOCK, Filestore};
use super::{MemoryUpper, Node, now};
use crate::error::{Result, errno};
use crate::sys;

/// What holes of a file are read from by the kernel (`FileBody::read_mapped`).
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// The most parts a reply from the mapping has: one header more stays within IOV_MAX (1,024).
const MAX_PARTS: usize = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Extent {
    /// Block of the filestore.
    pub block: u64,
    /// The durable image refers to this block: never write it, free it only later.
    pub frozen: bool,
}

pub(super) struct FileBody {
    size: u64,
    /// File block → filestore block.
    extents: BTreeMap<u64, Extent>,
    store: Arc<Filestore>,
    closing: Arc<AtomicBool>,
    /// Changes to the map since `take_changes`, for the change log (changes.rs).
    changes: Vec<MapChange>,
    /// Blocks no image holds that the map let go of since `take_changes`: freed once the
    /// change is logged.
    released: Vec<u64>,
}

impl FileBody {
    pub fn new(store: Arc<Filestore>, closing: Arc<AtomicBool>) -> FileBody {
        FileBody {
            size: 0,
            extents: BTreeMap::new(),
            store,
            closing,
            changes: Vec::new(),
            released: Vec::new(),
        }
    }

    /// A file as the image has it: every extent frozen that `frozen` says the durable image
    /// or journal holds.
    pub fn from_image(
        store: Arc<Filestore>,
        closing: Arc<AtomicBool>,
        size: u64,
        extents: BTreeMap<u64, u64>,
        frozen: impl Fn(u64) -> bool,
    ) -> FileBody {
        let extents = extents
            .into_iter()
            .map(|(k, block)| {
                (
                    k,
                    Extent {
                        block,
                        frozen: frozen(block),
                    },
                )
            })
            .collect();
        FileBody {
            size,
            extents,
            store,
            closing,
            changes: Vec::new(),
            released: Vec::new(),
        }
    }

    /// What the map went through since the last call, and the blocks it let go of that are
    /// to be freed once that is logged.
    pub fn take_changes(&mut self) -> (Vec<MapChange>, Vec<u64>) {
        (
            std::mem::take(&mut self.changes),
            std::mem::take(&mut self.released),
        )
    }

    /// The whole map as changes to an empty one: a file joining the tree (changes.rs).
    pub fn whole_map(&self) -> Vec<MapChange> {
        std::iter::once(MapChange::Cut(0))
            .chain(
                self.extents
                    .iter()
                    .map(|(&k, e)| MapChange::Set(k, e.block)),
            )
            .collect()
    }

    fn map(&mut self, k: u64, e: Extent) {
        self.extents.insert(k, e);
        self.changes.push(MapChange::Set(k, e.block));
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Mapped blocks.
    pub fn blocks(&self) -> u64 {
        self.extents.len() as u64
    }

    /// For the image: the map, each extent now frozen (the image about to be written holds it).
    pub fn freeze(&mut self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.extents.iter_mut().map(|(&k, e)| {
            e.frozen = true;
            (k, e.block)
        })
    }

    /// Releases the extents of blocks `from..`: once logged if no image holds them, else
    /// after the next image.
    fn release_from(&mut self, from: u64) {
        let gone = self.extents.split_off(&from);
        if gone.is_empty() {
            return;
        }
        self.changes.push(MapChange::Cut(from));
        let (now, later): (Vec<&Extent>, Vec<&Extent>) = gone.values().partition(|e| !e.frozen);
        self.store
            .free_later(&later.iter().map(|e| e.block).collect::<Vec<_>>());
        self.released.extend(now.iter().map(|e| e.block));
    }

    fn release_one(&mut self, k: u64) {
        if let Some(e) = self.extents.remove(&k) {
            self.changes.push(MapChange::Unset(k));
            if e.frozen {
                self.store.free_later(&[e.block]);
            } else {
                self.released.push(e.block);
            }
        }
    }

    /// How many of `len` bytes at `off` lie within the file.
    fn within(&self, off: u64, len: usize) -> usize {
        if off >= self.size {
            0
        } else {
            len.min((self.size - off) as usize)
        }
    }

    /// Bytes `off..off + n` of the file as runs, in order: `(len, Some(pos))` for blocks mapped
    /// to neighbouring filestore blocks from filestore byte `pos` (one I/O each), `(len, None)`
    /// for a hole.
    fn runs(&self, off: u64, n: usize) -> Vec<(usize, Option<u64>)> {
        let mut runs = Vec::new();
        let mut done = 0;
        while done < n {
            let pos = off + done as u64;
            let k = pos / BLOCK;
            let inner = pos % BLOCK;
            let mut len = ((BLOCK - inner) as usize).min(n - done);
            let at = self.extents.get(&k).map(|e| {
                let mut next = k + 1;
                while done + len < n {
                    match self.extents.get(&next) {
                        Some(f) if f.block == e.block + (next - k) => {
                            len = (len + BLOCK as usize).min(n - done);
                            next += 1;
                        }
                        _ => break,
                    }
                }
                e.block * BLOCK + inner
            });
            runs.push((len, at));
            done += len;
        }
        runs
    }

    fn read(&self, buf: &mut [u8], off: u64) -> Result<usize> {
        let n = self.within(off, buf.len());
        let mut done = 0;
        for (len, at) in self.runs(off, n) {
            let dst = &mut buf[done..done + len];
            match at {
                Some(pos) => {
                    let got = sys::pread_full(self.store.fd(), dst, pos)?;
                    // Past the filestore's end reads as zeros (a block allocated, never written).
                    dst[got..].fill(0);
                }
                None => dst.fill(0),
            }
            done += len;
        }
        Ok(n)
    }

    /// `read` for the kernel: `reply` gets the iovecs of the file's bytes `off..off+len` (fewer
    /// at its end) while the caller holds the body, so no block can change or be freed under
    /// them — parts of the filestore's mapping for mapped blocks, zeros for holes. The daemon
    /// copies nothing (a block past the mapping is read into a buffer of its own).
    fn read_mapped<R>(
        &self,
        off: u64,
        len: usize,
        reply: impl FnOnce(Result<&[IoSlice<'_>]>) -> R,
    ) -> R {
        let n = self.within(off, len);
        let mut iov: Vec<libc::iovec> = Vec::new();
        // Buffers of blocks past the mapping; each Vec's heap data stays put as this grows.
        let mut read: Vec<Vec<u8>> = Vec::new();
        for (run, at) in self.runs(off, n) {
            let Some(at) = at else {
                for chunk in (0..run).step_by(ZEROS.len()) {
                    iov.push(libc::iovec {
                        iov_base: ZEROS.as_ptr().cast_mut().cast(),
                        iov_len: ZEROS.len().min(run - chunk),
                    });
                }
                continue;
            };
            match self.store.mapped(at) {
                Some((p, avail)) if avail >= run as u64 => iov.push(libc::iovec {
                    iov_base: p.cast_mut().cast(),
                    iov_len: run,
                }),
                _ => {
                    let mut buf = vec![0u8; run];
                    if let Err(e) = sys::pread_full(self.store.fd(), &mut buf, at) {
                        return reply(Err(e));
                    }
                    iov.push(libc::iovec {
                        iov_base: buf.as_mut_ptr().cast(),
                        iov_len: run,
                    });
                    read.push(buf);
                }
            }
        }
        if iov.len() > MAX_PARTS {
            // More parts than one writev takes: one buffer instead.
            let mut buf = vec![0u8; n];
            return match self.read(&mut buf, off) {
                Ok(_) => reply(Ok(&[IoSlice::new(&buf)])),
                Err(e) => reply(Err(e)),
            };
        }
        reply(Ok(sys::iovecs_as_io_slices(&iov)))
    }

    /// Writes `data` at `off`. Blocks not mapped, or frozen, get fresh filestore blocks, all
    /// allocated before anything is written; the map changes only once every write succeeded.
    fn write(&mut self, data: &[u8], off: u64) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = off
            .checked_add(data.len() as u64)
            .ok_or_else(|| errno(libc::EFBIG))?;
        let (first, last) = (off / BLOCK, (end - 1) / BLOCK);
        let fresh_needed = (first..=last)
            .filter(|k| self.extents.get(k).is_none_or(|e| e.frozen))
            .count() as u64;
        let fresh_blocks: Vec<u64> = (self.store.alloc(fresh_needed)?.into_iter())
            .flat_map(|(f, c)| f..f + c)
            .collect();
        match self.write_blocks(data, off, end, &fresh_blocks) {
            Ok(old_frozen) => {
                self.store.free_later(&old_frozen);
                self.size = self.size.max(end);
                Ok(())
            }
            Err(e) => {
                let _ = self.store.free(&fresh_blocks);
                Err(e)
            }
        }
    }

    /// `write`'s work once the fresh blocks are there: returns the frozen blocks replaced.
    fn write_blocks(&mut self, data: &[u8], off: u64, end: u64, fresh: &[u64]) -> Result<Vec<u64>> {
        let (first, last) = (off / BLOCK, (end - 1) / BLOCK);
        let mut fresh = fresh.iter().copied();
        let mut plan: Vec<(u64, Extent, Src)> = Vec::new();
        let mut old_frozen = Vec::new();
        for k in first..=last {
            let bstart = k * BLOCK;
            let lo = off.max(bstart);
            let hi = end.min(bstart + BLOCK);
            let (from, to) = ((lo - off) as usize, (hi - off) as usize);
            let whole = lo == bstart && hi == bstart + BLOCK;
            match self.extents.get(&k) {
                Some(e) if !e.frozen => {
                    plan.push((
                        k,
                        *e,
                        Src::Data {
                            from,
                            to,
                            inner: lo - bstart,
                        },
                    ));
                }
                old => {
                    let ext = Extent {
                        block: fresh.next().expect("allocated above"),
                        frozen: false,
                    };
                    if whole {
                        plan.push((k, ext, Src::Data { from, to, inner: 0 }));
                    } else {
                        // A fresh block is written whole: the old block's bytes, or zeros.
                        let mut buf = vec![0u8; BLOCK as usize];
                        if let Some(o) = old {
                            sys::pread_full(self.store.fd(), &mut buf, o.block * BLOCK)?;
                        }
                        buf[(lo - bstart) as usize..(hi - bstart) as usize]
                            .copy_from_slice(&data[from..to]);
                        plan.push((k, ext, Src::Own(buf)));
                    }
                    if let Some(o) = old {
                        old_frozen.push(o.block);
                    }
                }
            }
        }
        write_plan(&self.store, data, &plan)?;
        for (k, ext, _) in &plan {
            if self.extents.get(k) != Some(ext) {
                self.map(*k, *ext);
            }
        }
        Ok(old_frozen)
    }

    /// Zeros bytes `from..to` of block `k`, which is mapped: in place, or in a fresh block
    /// if the image holds it.
    fn zero_part(&mut self, k: u64, from: u64, to: u64) -> Result<()> {
        if self.extents.contains_key(&k) && from < to {
            self.write(&vec![0u8; (to - from) as usize], k * BLOCK + from)?;
        }
        Ok(())
    }

    fn truncate(&mut self, size: u64) -> Result<()> {
        if size < self.size {
            let keep = size.div_ceil(BLOCK);
            if !size.is_multiple_of(BLOCK) {
                let old = self.size;
                self.zero_part(size / BLOCK, size % BLOCK, BLOCK)?;
                self.size = old;
            }
            self.release_from(keep);
        }
        self.size = size;
        Ok(())
    }

    fn punch(&mut self, off: u64, len: u64) -> Result<()> {
        let size = self.size;
        // A hole punched past the end takes the last block whole, as ext4 does.
        let past_end = off.saturating_add(len) > size;
        let end = off.saturating_add(len).min(size);
        if off >= end {
            return Ok(());
        }
        let (first, last) = (off / BLOCK, (end - 1) / BLOCK);
        for k in first..=last {
            let lo = off.max(k * BLOCK) - k * BLOCK;
            let hi = end.min((k + 1) * BLOCK) - k * BLOCK;
            if lo == 0 && (hi == BLOCK || past_end) {
                self.release_one(k);
            } else {
                self.zero_part(k, lo, hi)?;
            }
        }
        self.size = size;
        Ok(())
    }

    /// Maps every block of `off..off+len` (zeros where nothing was), so that later writes there
    /// need no space the layer may no longer have.
    fn allocate(&mut self, off: u64, len: u64, keep_size: bool) -> Result<()> {
        let end = off.checked_add(len).ok_or_else(|| errno(libc::EFBIG))?;
        if len == 0 {
            return Err(errno(libc::EINVAL));
        }
        let missing: Vec<u64> = (off / BLOCK..end.div_ceil(BLOCK))
            .filter(|k| !self.extents.contains_key(k))
            .collect();
        let runs = self.store.alloc(missing.len() as u64)?;
        let blocks: Vec<u64> = runs.iter().flat_map(|&(f, c)| f..f + c).collect();
        for &(f, c) in &runs {
            if let Err(e) = zero_range(&self.store, f * BLOCK, c * BLOCK) {
                let _ = self.store.free(&blocks);
                return Err(e);
            }
        }
        for (k, block) in missing.into_iter().zip(blocks) {
            self.map(
                k,
                Extent {
                    block,
                    frozen: false,
                },
            );
        }
        if !keep_size {
            self.size = self.size.max(end);
        }
        Ok(())
    }

    fn seek_data(&self, off: u64) -> Result<Option<u64>> {
        if off >= self.size {
            return Err(errno(libc::ENXIO));
        }
        Ok(self
            .extents
            .range(off / BLOCK..)
            .next()
            .map(|(&k, _)| (k * BLOCK).max(off))
            .filter(|&p| p < self.size))
    }

    fn seek_hole(&self, off: u64) -> Result<u64> {
        if off >= self.size {
            return Err(errno(libc::ENXIO));
        }
        let mut k = off / BLOCK;
        for (&m, _) in self.extents.range(k..) {
            if m != k {
                break;
            }
            k += 1;
        }
        Ok((k * BLOCK).max(off).min(self.size))
    }
}

impl Drop for FileBody {
    fn drop(&mut self) {
        if self.closing.load(Ordering::Relaxed) {
            return;
        }
        // Its node left the tree in a logged change before the last reference went.
        self.release_from(0);
        if let Err(e) = self.store.free(&self.released) {
            log::warn!(
                "memory upper: blocks of a removed file not punched out of the filestore: {e}"
            );
        }
    }
}

/// Where the bytes of one planned block come from.
enum Src {
    /// `data[from..to]` of the caller's buffer, written at `inner` in the block.
    Data { from: usize, to: usize, inner: u64 },
    /// A whole block of its own.
    Own(Vec<u8>),
}

/// Writes the planned blocks, one pwrite per run of neighbouring filestore blocks whose bytes
/// lie side by side in the caller's buffer.
fn write_plan(store: &Filestore, data: &[u8], plan: &[(u64, Extent, Src)]) -> Result<()> {
    let mut i = 0;
    while i < plan.len() {
        let (_, ext, src) = &plan[i];
        let mut j = i + 1;
        match src {
            Src::Own(buf) => sys::pwrite_full(store.fd(), buf, ext.block * BLOCK)?,
            &Src::Data {
                from,
                mut to,
                inner,
            } => {
                while let Some((
                    _,
                    e2,
                    Src::Data {
                        from: f2,
                        to: t2,
                        inner: 0,
                    },
                )) = plan.get(j)
                {
                    if *f2 != to
                        || e2.block != plan[j - 1].1.block + 1
                        || (to - from) as u64 + inner != (j - i) as u64 * BLOCK
                    {
                        break;
                    }
                    to = *t2;
                    j += 1;
                }
                sys::pwrite_full(store.fd(), &data[from..to], ext.block * BLOCK + inner)?;
            }
        }
        i = j;
    }
    Ok(())
}

/// Zeros `len` bytes of the filestore at `pos` and makes sure they take space.
fn zero_range(store: &Filestore, pos: u64, len: u64) -> Result<()> {
    use rustix::fs::FallocateFlags;
    match rustix::fs::fallocate(store.fd(), FallocateFlags::ZERO_RANGE, pos, len) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
            let zeros = vec![0u8; BLOCK as usize];
            for p in (pos..pos + len).step_by(BLOCK as usize) {
                sys::pwrite_full(store.fd(), &zeros, p)?;
            }
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
impl FileBody {
    pub(super) fn write_for_test(&mut self, data: &[u8], off: u64) {
        self.write(data, off).unwrap();
    }

    pub(super) fn read_for_test(&self, buf: &mut [u8], off: u64) -> usize {
        self.read(buf, off).unwrap()
    }

    /// What `read_mapped` hands the kernel, copied out (the test's filestore is never
    /// truncated, so reading the mapping here is safe).
    pub(super) fn read_mapped_for_test(&self, off: u64, len: usize) -> Vec<u8> {
        self.read_mapped(off, len, |r| {
            r.unwrap().iter().flat_map(|p| p.to_vec()).collect()
        })
    }
}

/// Data operations on an open regular file of the layer (the handle is its `Node`).
impl MemoryUpper {
    pub fn read(&self, node: &Node, buf: &mut [u8], off: u64) -> Result<usize> {
        node.file()?.read().unwrap().read(buf, off)
    }

    /// Whether reads can be answered from the filestore's mapping (`read_mapped`).
    pub fn reads_mapped(&self) -> bool {
        self.store.mapped(0).is_some()
    }

    /// `read` for the kernel to copy: `reply` gets iovecs into the filestore's mapping (and
    /// zeros), valid while it runs; only the kernel may read them (filestore.rs, `Mapping`).
    pub fn read_mapped<R>(
        &self,
        node: &Node,
        off: u64,
        len: usize,
        reply: impl FnOnce(Result<&[IoSlice<'_>]>) -> R,
    ) -> R {
        match node.file() {
            Ok(f) => f.read().unwrap().read_mapped(off, len, reply),
            Err(e) => reply(Err(e)),
        }
    }

    /// pwrite: the whole of `data` or nothing (ENOSPC past the layer's size, EFBIG).
    pub fn write(&self, node: &Node, data: &[u8], off: u64) -> Result<()> {
        self.change_data(node, true, |f| f.write(data, off))
    }

    pub fn truncate(&self, node: &Node, size: u64) -> Result<()> {
        self.change_data(node, true, |f| f.truncate(size))
    }

    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE.
    pub fn punch_hole(&self, node: &Node, off: u64, len: u64) -> Result<()> {
        self.change_data(node, true, |f| f.punch(off, len))
    }

    /// fallocate mode 0, or FALLOC_FL_KEEP_SIZE.
    pub fn allocate(&self, node: &Node, off: u64, len: u64, keep_size: bool) -> Result<()> {
        self.change_data(node, !keep_size, |f| f.allocate(off, len, keep_size))
    }

    /// Runs `op` on `node`'s data; then, still holding the data and the attributes, sets
    /// mtime and ctime as a local file system does (`touch`, when `op` succeeded) and logs
    /// what changed (changes.rs); and only then frees the blocks the map let go of.
    fn change_data(
        &self,
        node: &Node,
        touch: bool,
        op: impl FnOnce(&mut FileBody) -> Result<()>,
    ) -> Result<()> {
        let file = node.file()?;
        self.keep_log_short();
        let _q = self.quiesce.read();
        node.changed();
        let mut f = file.write().unwrap();
        let done = op(&mut f);
        let (changes, released) = f.take_changes();
        let touch = touch && done.is_ok();
        if touch || !changes.is_empty() {
            let mut m = node.meta.lock().unwrap();
            if touch {
                let t = now();
                m.mtime = t;
                m.ctime = t;
            }
            let mut txn = self.txn();
            txn.file(node.ino, f.size(), &changes);
            txn.meta(node, &m);
            self.log(&txn);
        }
        drop(f);
        let freed = self.store.free(&released);
        done.and(freed)
    }

    /// lseek SEEK_DATA: `None` where the file has no data at or past `off` (ENXIO there).
    pub fn seek_data(&self, node: &Node, off: u64) -> Result<Option<u64>> {
        node.file()?.read().unwrap().seek_data(off)
    }

    /// lseek SEEK_HOLE: the end of the file when no hole lies before it.
    pub fn seek_hole(&self, node: &Node, off: u64) -> Result<u64> {
        node.file()?.read().unwrap().seek_hole(off)
    }
}

impl Node {
    pub(super) fn file(&self) -> Result<&std::sync::RwLock<FileBody>> {
        match &self.body {
            super::Body::File(f) => Ok(f),
            super::Body::Dir(..) => Err(errno(libc::EISDIR)),
            _ => Err(errno(libc::EINVAL)),
        }
    }
}
