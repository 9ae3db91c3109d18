//! The journal: what an fsync makes durable between two full images (format in
//! docs/FORMAT.md, "Memory upper: the journal").
//!
//! An entry is a delta: the records of every node changed since the last image or entry, and
//! the numbers of the nodes removed since, taken at one instant (under all quiesce shards),
//! so the image followed by its entries in order is the tree exactly as it was at the last
//! entry. Entries are appended and fdatasynced; a torn or damaged entry ends the journal (its
//! fsync never returned). The journal names the image generation it follows; a journal of
//! another generation is ignored (a new image contains it all).

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{Mode, OFlags};

use super::image::{self, ImageError, ImageNode, Reader, crc, put_u32, put_u64};
use super::{Ino, Node};
use crate::error::Result;
use crate::sys;

pub(super) const JOURNAL_NAME: &str = ".mosaicfs-journal";
const JOURNAL_NEW: &str = ".mosaicfs-journal.new";
const MAGIC: &[u8; 8] = b"MOSAICJR";
const VERSION: u32 = 1;
pub(super) const HEADER: usize = 8 + 4 + 8;

/// One entry, decoded.
pub(super) struct Delta {
    pub next_ino: Ino,
    pub removed: Vec<Ino>,
    pub nodes: Vec<ImageNode>,
}

/// An empty journal following image `generation`, replacing the old one atomically.
pub(super) fn reset(dir: &OwnedFd, generation: u64) -> Result<()> {
    let mut header = MAGIC.to_vec();
    put_u32(&mut header, VERSION);
    put_u64(&mut header, generation);
    let flags =
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = sys::openat(dir, JOURNAL_NEW, flags, Mode::from_raw_mode(0o600))?;
    sys::pwrite_full(fd.as_fd(), &header, 0)?;
    sys::fsync(&fd)?;
    let (old, new) = (
        std::ffi::OsStr::new(JOURNAL_NEW),
        std::ffi::OsStr::new(JOURNAL_NAME),
    );
    sys::rename_at(
        dir.as_fd(),
        old,
        dir.as_fd(),
        new,
        rustix::fs::RenameFlags::empty(),
    )?;
    sys::fsync(dir)?;
    Ok(())
}

/// The entry for `nodes` (changed) and `removed`; their extents are frozen from now on. The
/// caller holds every quiesce shard.
pub(super) fn encode(next_ino: Ino, removed: &[Ino], nodes: &[std::sync::Arc<Node>]) -> Vec<u8> {
    let mut payload = Vec::new();
    put_u64(&mut payload, next_ino);
    put_u64(&mut payload, removed.len() as u64);
    for &ino in removed {
        put_u64(&mut payload, ino);
    }
    put_u64(&mut payload, nodes.len() as u64);
    for n in nodes {
        image::encode_node(n, &mut payload);
    }
    let mut entry = Vec::with_capacity(12 + payload.len());
    put_u64(&mut entry, payload.len() as u64);
    put_u32(&mut entry, crc(&payload));
    entry.extend_from_slice(&payload);
    entry
}

/// Appends `entry` and makes it durable. Returns the journal's length after it.
pub(super) fn append(dir: &OwnedFd, entry: &[u8]) -> Result<u64> {
    let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = sys::openat(dir, JOURNAL_NAME, flags, Mode::empty())?;
    let end = rustix::fs::fstat(&fd)?.st_size as u64;
    sys::pwrite_full(fd.as_fd(), entry, end)?;
    sys::fdatasync(&fd)?;
    Ok(end + entry.len() as u64)
}

/// The entries following image `generation`, up to the first torn or damaged one, and the
/// journal's length up to there; `None` when there is no journal of that generation.
pub(super) fn read(
    dir: &OwnedFd,
    generation: u64,
    store_blocks: u64,
) -> std::result::Result<Option<(Vec<Delta>, u64)>, ImageError> {
    match read_file(dir)? {
        Some(buf) => decode(&buf, generation, store_blocks),
        None => Ok(None),
    }
}

/// The journal file's bytes, `None` when there is none.
pub(super) fn read_file(dir: &OwnedFd) -> std::result::Result<Option<Vec<u8>>, ImageError> {
    let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = match rustix::fs::openat(dir, JOURNAL_NAME, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => return Err(ImageError::io(e)),
    };
    let len = rustix::fs::fstat(&fd).map_err(ImageError::io)?.st_size as usize;
    let mut buf = vec![0u8; len];
    let got = sys::pread_full(fd.as_fd(), &mut buf, 0).map_err(ImageError::io)?;
    buf.truncate(got);
    Ok(Some(buf))
}

/// `read`, of the journal's bytes `buf`.
pub(super) fn decode(
    buf: &[u8],
    generation: u64,
    store_blocks: u64,
) -> std::result::Result<Option<(Vec<Delta>, u64)>, ImageError> {
    if buf.len() < HEADER || &buf[..8] != MAGIC {
        return Ok(None);
    }
    let mut h = Reader { b: &buf[8..HEADER] };
    if h.u32()? != VERSION || h.u64()? != generation {
        return Ok(None);
    }
    let mut deltas = Vec::new();
    let mut rest = &buf[HEADER..];
    while rest.len() >= 12 {
        let mut h = Reader { b: &rest[..12] };
        let (len, sum) = (h.u64()? as usize, h.u32()?);
        let Some(payload) = rest.get(12..12usize.saturating_add(len)) else {
            break; // torn: its fsync never returned
        };
        if crc(payload) != sum {
            break;
        }
        let mut r = Reader { b: payload };
        let next_ino = r.u64()?;
        let removed = (0..r.u64()?)
            .map(|_| r.u64())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let count = r.u64()?;
        let nodes = image::read_nodes(&mut r, count, store_blocks)?;
        deltas.push(Delta {
            next_ino,
            removed,
            nodes,
        });
        rest = &rest[12 + len..];
    }
    Ok(Some((deltas, (buf.len() - rest.len()) as u64)))
}

/// Cuts a torn tail off the journal, so that entries appended after it are read.
pub(super) fn truncate(dir: &OwnedFd, len: u64) -> Result<()> {
    let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = sys::openat(dir, JOURNAL_NAME, flags, Mode::empty())?;
    if rustix::fs::fstat(&fd)?.st_size as u64 != len {
        sys::ftruncate(&fd, len)?;
        sys::fdatasync(&fd)?;
    }
    Ok(())
}

/// Makes every whole entry of `journal` fit its checksum: a forged journal that the checksums
/// no longer stop, so that a fuzzer reaches the decoder behind them (`crate::fuzzing`).
pub fn fit_checksums(journal: &mut [u8]) {
    let mut at = HEADER;
    while at + 12 <= journal.len() {
        let len = u64::from_le_bytes(journal[at..at + 8].try_into().unwrap());
        let Some(end) = (at + 12)
            .checked_add(len as usize)
            .filter(|e| *e <= journal.len())
        else {
            break;
        };
        let sum = crc(&journal[at + 12..end]);
        journal[at + 8..at + 12].copy_from_slice(&sum.to_le_bytes());
        at = end;
    }
}
