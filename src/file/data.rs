//! What serves an open file's data, and the operations the data requests (overlay/io.rs) ask
//! of it whatever serves it: read, write, set the size, preallocate, seek to data or a hole,
//! sync. The request files check permissions and copy a lower file up before they write;
//! they never look at which of the states below a file is in. A write into a partial file
//! returns the blocks it left to copy-after-write (partial/caw.rs), which the caller schedules.

use std::cell::RefCell;

use rustix::fs::FallocateFlags;

use crate::error::{Error, Result, errno};
use crate::file::partial::{PartialFile, Source};
use crate::layers::{LayerId, XattrNames};
use crate::lower_wait;
use crate::upper::{ReadData, UpperFile};

pub enum FileData {
    /// The lower file, untouched.
    Lower(Source),
    /// A lower file on a shared store's client (`Layer::on_store`) not opened yet: opened at
    /// the first request that needs its data (`Overlay::opened_data`). Its reads go through the
    /// daemon with the page cache kept, so a file read before is opened and read again from
    /// the cache with no call to the store: an open and a close there cost a network round
    /// trip each (bench/stores.sh), more than the read they would serve.
    Unopened(LayerId, std::path::PathBuf),
    /// Some blocks in the upper file, the rest still read from the lower file (partial/).
    Partial(Box<PartialFile>),
    /// A complete upper file.
    Upper(UpperFile),
}

/// How a write lands, from the flags of the handle it came through.
#[derive(Clone, Copy)]
pub struct WriteMode {
    /// O_APPEND: at the end of the file, whatever the offset.
    pub append: bool,
    /// O_SYNC or O_DSYNC (and fsync not skipped): on disk before the write returns.
    pub sync: bool,
}

/// A file that has no upper data yet cannot take a change of its data.
fn not_copied_up() -> Error {
    Error::with_context(libc::EIO, "change to a file not copied up")
}

impl FileData {
    pub(crate) fn highest_fd(&self) -> i32 {
        match self {
            FileData::Lower(s) => s.highest_fd(),
            FileData::Unopened(..) => -1,
            FileData::Partial(p) => p.upper.raw_fd().max(p.lower.highest_fd()),
            FileData::Upper(f) => f.raw_fd(),
        }
    }

    /// The upper file, complete or partial: where the file's metadata changes go.
    pub fn upper(&self) -> Option<&UpperFile> {
        match self {
            FileData::Upper(f) => Some(f),
            FileData::Partial(p) => Some(&p.upper),
            FileData::Lower(_) | FileData::Unopened(..) => None,
        }
    }

    /// The upper file of a file whose writes do not pass through the daemon where
    /// passthrough serves it: a complete file, or a partial one whose holes are filled on
    /// pre-content events.
    pub fn written_past_daemon(&self) -> Option<&UpperFile> {
        match self {
            FileData::Upper(f) => Some(f),
            FileData::Partial(p) if p.by_events.is_some() => Some(&p.upper),
            _ => None,
        }
    }

    pub fn is_partial(&self) -> bool {
        matches!(self, FileData::Partial(_))
    }

    /// The layer and path of a lower file whose opening was deferred (`Unopened`).
    pub fn unopened(&self) -> Option<(LayerId, &std::path::Path)> {
        match self {
            FileData::Unopened(layer, path) => Some((*layer, path)),
            _ => None,
        }
    }

    /// The lower file, while nothing of it is in the upper layer.
    pub fn lower(&self) -> Option<&Source> {
        match self {
            FileData::Lower(src) => Some(src),
            _ => None,
        }
    }

    /// Reads `size` bytes at `off` and hands them to `reply` (fewer only at end of file): a
    /// memory upper's file hands over its filestore mapping when `mapped` allows it
    /// (`ReadData::Mapped`), other files go into a buffer each thread reuses, never zeroed —
    /// no allocation and at most one copy on the daemon's read path.
    pub fn read<R>(
        &self,
        off: u64,
        size: u32,
        mapped: bool,
        reply: impl FnOnce(Result<ReadData<'_>>) -> R,
    ) -> R {
        thread_local! {
            static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let size = size as usize;
        match self {
            FileData::Upper(f) => BUF.with(|buf| {
                let mut buf = buf.borrow_mut();
                if mapped {
                    return f.read_for_reply(&mut buf, size, off, reply);
                }
                match f.read_into(&mut buf, size, off) {
                    Ok(()) => reply(Ok(ReadData::Bytes(&buf))),
                    Err(e) => reply(Err(e)),
                }
            }),
            FileData::Lower(src) => BUF.with(|buf| {
                let mut buf = buf.borrow_mut();
                let waiting = lower_wait::enter(lower_wait::DATA);
                match waiting.and_then(|_w| src.pread_into(&mut buf, size, off)) {
                    Ok(()) => reply(Ok(ReadData::Bytes(&buf))),
                    Err(e) => reply(Err(e)),
                }
            }),
            FileData::Partial(p) => {
                let read = lower_wait::enter(lower_wait::DATA).and_then(|_w| p.read(off, size));
                match read {
                    Ok(bytes) => reply(Ok(ReadData::Bytes(&bytes))),
                    Err(e) => reply(Err(e)),
                }
            }
            // `Overlay::opened_data` opens it before anything reads.
            FileData::Unopened(..) => reply(Err(errno(libc::EIO))),
        }
    }

    /// Writes `data` at `off` (at the end with `mode.append`). Returns the blocks of a partial
    /// file the write left pending for copy-after-write, which the caller schedules.
    pub fn write(&mut self, off: u64, data: &[u8], mode: WriteMode) -> Result<Vec<u64>> {
        match self {
            FileData::Upper(f) => {
                let off = if mode.append { f.stat()?.size } else { off };
                f.write_at(data, off)?;
                if mode.sync {
                    f.datasync()?;
                }
                Ok(Vec::new())
            }
            FileData::Partial(p) => {
                p.refresh()?; // writers passing through may have grown it
                let off = if mode.append { p.size } else { off };
                let pending = p.write(off, data, !mode.sync)?;
                if mode.sync {
                    p.upper.datasync()?;
                }
                Ok(pending)
            }
            FileData::Lower(_) | FileData::Unopened(..) => Err(not_copied_up()),
        }
    }

    /// Sets the size. A partial file cut to where nothing of the lower file is valid any more
    /// becomes a complete upper file.
    pub fn set_size(&mut self, size: u64, xattr: &XattrNames) -> Result<()> {
        match self {
            FileData::Upper(f) => f.truncate(size),
            FileData::Partial(p) => {
                if p.set_size(size, xattr)? {
                    *self = FileData::Upper(p.upper.try_clone()?);
                }
                Ok(())
            }
            FileData::Lower(_) | FileData::Unopened(..) => Err(not_copied_up()),
        }
    }

    /// fallocate(2) with `mode` over `len` bytes at `off`.
    pub fn fallocate(
        &mut self,
        mode: FallocateFlags,
        off: u64,
        len: u64,
        xattr: &XattrNames,
    ) -> Result<()> {
        match self {
            FileData::Upper(f) => f.fallocate(mode, off, len),
            FileData::Partial(p) => p.fallocate(off, len, mode, xattr),
            FileData::Lower(_) | FileData::Unopened(..) => Err(not_copied_up()),
        }
    }

    /// SEEK_DATA or SEEK_HOLE (`whence`) from `off` on the merged content; ENXIO where there
    /// is no data after `off`, or `off` is past the end.
    pub fn seek(&self, off: u64, whence: i32) -> Result<u64> {
        let enxio = || errno(libc::ENXIO);
        match (self, whence) {
            (FileData::Upper(f), libc::SEEK_DATA) => f.seek_data(off)?.ok_or_else(enxio),
            (FileData::Upper(f), libc::SEEK_HOLE) => f.seek_hole(off),
            (FileData::Lower(src), libc::SEEK_DATA) => src.seek_data(off)?.ok_or_else(enxio),
            (FileData::Lower(src), libc::SEEK_HOLE) => src.seek_hole(off),
            (FileData::Partial(p), libc::SEEK_DATA) => p.seek_data(off)?.ok_or_else(enxio),
            (FileData::Partial(p), libc::SEEK_HOLE) => {
                if off >= p.current_size()? {
                    return Err(enxio());
                }
                p.seek_hole(off)
            }
            _ => Err(errno(libc::EINVAL)),
        }
    }

    /// fsync(2) or fdatasync(2): a partial file's pending copy-after-write blocks first.
    /// Returns whether anything went to disk (a lower file has nothing to sync).
    pub fn sync(&mut self, datasync: bool) -> Result<bool> {
        let f = match self {
            FileData::Upper(f) => f,
            FileData::Partial(p) => {
                p.flush_pending()?;
                &p.upper
            }
            FileData::Lower(_) | FileData::Unopened(..) => return Ok(false),
        };
        if datasync {
            f.datasync()?
        } else {
            f.sync()?
        }
        Ok(true)
    }
}
