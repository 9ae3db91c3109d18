//! Where a file's data comes from, opened: the data of a node in its current state (a lower
//! file, a partial file with the lower file it patches, a complete upper file), the lower files
//! of every layer (a partial file left in a layer stacked below included), and the move of an
//! open file's data to its upper file after a copy-up (`refresh_open`). Below copy-up and the
//! data requests (io.rs), which both open files through it; it calls neither.
//!
//! May call (dev/callgraph.py --check keeps it so): metacopy, overlay.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rustix::fs::OFlags;

use crate::error::{Error, Result, errno};
use crate::file::FileData;
use crate::file::partial::mark::{BlockMap, PartialMark};
use crate::file::partial::{PartialFile, Source};
use crate::inode::{LowerRef, Node};
use crate::layers::{LayerId, UPPER};
use crate::overlay::Overlay;
use crate::sys;
use crate::upper::UpperFile;

impl Overlay {
    /// Opens the data of `node` in its current state.
    pub(crate) fn open_data(&self, node: &Node) -> Result<FileData> {
        let (upper, lower) = {
            let st = node.state();
            if st.kind != libc::S_IFREG {
                return Err(errno(libc::EINVAL));
            }
            (st.upper, st.lower.clone())
        };
        if !upper {
            let lower = lower.ok_or_else(|| errno(libc::ENOENT))?;
            if self.layers.layer(lower.top()).on_store && lower.data().is_none() {
                return Ok(FileData::Unopened(lower.top(), lower.path.into()));
            }
            return Ok(FileData::Lower(self.open_lower_data(&lower)?));
        }
        let opened = self.settled(|| {
            let (dir, name) = self.upper_entry(node)?;
            dir.open_known_file(&name, !self.config.read_only, |a| {
                self.is_upper_object_of(node, a)
            })
        });
        let file = match opened {
            Ok(file) => file,
            // Removed, or another object renamed over it, since the kernel looked it up: a
            // pinned object is still there to open (inode/mod.rs `Pin`), as on a local file system.
            // Without a pin (the rename found the name still lower-only, and this open's
            // copy-up put the file there just before the rename took the name) ESTALE, as
            // copy-up answers that race: the kernel looks the name up again and opens what
            // it holds now, never ENOENT for a name that exists.
            Err(e) if e.is(libc::ESTALE) || e.is(libc::ENOENT) => match self.open_pinned(node)? {
                Some(file) => file,
                None if node.state().links.is_empty() => return Err(errno(libc::ESTALE)),
                None => return Err(e),
            },
            Err(e) => return Err(e),
        };
        // For messages only: a concurrent rename may change it, the descriptor stays right.
        let path = self
            .upper_path(node.ino)
            .unwrap_or_else(|_| std::path::PathBuf::from("(a removed file)"));
        match self.read_mark(&file, UPPER, &path)? {
            None => Ok(FileData::Upper(file)),
            Some(mark) => {
                if let Some(b) = mark.block.filter(|b| b % self.sparse.block != 0) {
                    // Writing one of its blocks would allocate (zero) neighbours that must
                    // stay holes, i.e. "read the lower file".
                    let msg = format!(
                        "partial file '{}' was made with {b}-byte blocks, but the upper file \
                         system allocates {} bytes at a time, so it cannot be written here \
                         without losing lower data: mount its layers where it was made, or \
                         complete it there (or read it from a layer stacked below)",
                        path.display(),
                        self.sparse.block
                    );
                    log::error!("{msg}");
                    return Err(Error::with_context(libc::EIO, msg));
                }
                let lower = self.open_partial_lower(UPPER, &mark, &path)?;
                Ok(FileData::Partial(Box::new(self.partial_file(
                    file,
                    lower,
                    mark,
                    self.caw.clone().map(|caw| (caw, node.ino)),
                )?)))
            }
        }
    }

    /// The upper file of `node` opened through its pin, if it has one.
    pub(crate) fn open_pinned(&self, node: &Node) -> Result<Option<UpperFile>> {
        let Some(object) = self.pinned(&node.state()) else {
            return Ok(None);
        };
        match object {
            UpperFile::Disk(fd) => {
                let access = if self.config.read_only {
                    OFlags::RDONLY
                } else {
                    OFlags::RDWR
                };
                let f = sys::reopen(fd.as_fd(), access | OFlags::CLOEXEC)?;
                Ok(Some(UpperFile::Disk(f)))
            }
            memory => Ok(Some(memory)),
        }
    }

    /// After `node` was copied up, moves its open state (if any) to the upper file.
    pub(super) fn refresh_open(&self, node: &Node) -> Result<()> {
        let Some(f) = node.state().open.upgrade() else {
            return Ok(());
        };
        let mut data = f.write_data();
        if data.upper().is_none() {
            *data = self.open_data(node)?;
            if data.is_partial() {
                drop(data);
                self.register_partial(&f);
            }
        }
        Ok(())
    }

    /// Opens file `path` of lower layer `layer` for reading: a plain file, or a partial file
    /// left there by an earlier mount whose upper dir is now stacked as a lower one.
    pub(super) fn open_lower_source(&self, layer: LayerId, path: &Path) -> Result<Source> {
        let _waiting = crate::lower_wait::enter(layer)?;
        self.stats.lower_opens.add(1);
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(errno(libc::EINVAL));
        };
        let fd = self.in_lower_dir(layer, parent, |dir| {
            sys::open_beneath(dir, Path::new(name), OFlags::RDONLY, 0)
        })?;
        self.layer_source(fd, layer, path)
    }

    pub(crate) fn layer_source(&self, fd: OwnedFd, layer: LayerId, path: &Path) -> Result<Source> {
        let file = UpperFile::Disk(fd);
        match self.read_mark(&file, layer, path)? {
            None => Ok(Source::File(file.into_disk_fd()?)),
            Some(mark) => {
                let lower = self.open_partial_lower(layer, &mark, path)?;
                Ok(Source::Partial(Box::new(
                    self.partial_file(file, lower, mark, None)?,
                )))
            }
        }
    }

    /// The partial-file mark of a file in `layer`, if it has one.
    pub(crate) fn read_mark(
        &self,
        file: &UpperFile,
        layer: LayerId,
        path: &Path,
    ) -> Result<Option<PartialMark>> {
        let Some(mark) = PartialMark::load(file, &self.layers.xattr.partial)? else {
            return Ok(None);
        };
        let mark = mark.map_err(|why| {
            let msg = format!(
                "damaged {} xattr on file '{}' in layer {layer}: {why}; \
                 restore the file from a backup or remove it",
                self.layers.xattr.partial,
                path.display()
            );
            log::error!("{msg}");
            Error::with_context(libc::EIO, msg)
        })?;
        Ok(Some(mark))
    }

    pub(crate) fn partial_file(
        &self,
        file: UpperFile,
        lower: Source,
        mark: PartialMark,
        caw: Option<(Arc<crate::file::partial::caw::CawShared>, u64)>,
    ) -> Result<PartialFile> {
        let attr = file.stat()?;
        // `caw`: copy-after-write's state, and the number of the object (by_number.rs) whose
        // pending blocks they are.
        let (caw, number) = caw.unzip();
        // The file's holes mean something at the grain it was written in (v1: this mount's).
        let block = mark.block.unwrap_or(self.sparse.block);
        let mark = PartialMark {
            block: Some(block),
            ..mark
        };
        let blocks = BlockMap::from_file(&file, attr.size, block)?;
        Ok(PartialFile {
            upper: file,
            lower,
            mark,
            blocks,
            size: attr.size,
            block,
            last_write: Instant::now(),
            pending: Default::default(),
            caw,
            owner: crate::file::partial::arena::Owner {
                number: number.unwrap_or(0),
                upper_ino: attr.ino,
            },
            disk_size: attr.size,
            by_events: None,
        })
    }

    /// Opens the lower file that a partial file in layer `holder` patches — `mark.layer`
    /// layers below it — refusing one that changed since.
    pub(crate) fn open_partial_lower(
        &self,
        holder: LayerId,
        mark: &PartialMark,
        path: &Path,
    ) -> Result<Source> {
        let refuse = |why: String| {
            let msg = format!(
                "partial file '{}' in layer {holder} cannot be read: its lower file '{}', \
                 {} layer(s) below, {why}; restore that layer or remove the partial file",
                path.display(),
                mark.path.display(),
                mark.layer
            );
            log::error!("{msg}");
            Error::with_context(libc::EIO, msg)
        };
        let layer = holder as usize + mark.layer as usize;
        if mark.layer == 0 || layer > self.layers.last_layer() {
            return Err(refuse("is not in this mount".into()));
        }
        let layer = layer as LayerId;
        let fd = sys::open_beneath(self.layers.root(layer), &mark.path, OFlags::RDONLY, 0)
            .map_err(|e| refuse(format!("cannot be opened ({e})")))?;
        let attr = sys::fstat(fd.as_fd())?;
        if !mark.matches(&attr) {
            return Err(refuse(
                "changed since the partial file was made (size or mtime differ)".into(),
            ));
        }
        self.layer_source(fd, layer, &mark.path)
    }

    /// Opens the data of the lower file `lower` for reading, its digest checked (`verity=`).
    pub(super) fn open_lower_data(&self, lower: &LowerRef) -> Result<Source> {
        let (layer, path) = lower.data_at();
        let src = self.open_lower_source(layer, path)?;
        if let (Some(data), Source::File(fd)) = (lower.data(), &src) {
            self.check_verity(data, fd.as_fd())?;
        }
        Ok(src)
    }
}
