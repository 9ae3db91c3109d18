//! A memory upper layer found in, or made for, an upper dir (`upper=memory`): its image and
//! filestore files, and opening it.

use super::*;

/// How a memory upper is opened (`upper=memory`).
#[derive(Debug, Clone)]
pub struct MemorySpec {
    pub filestore: FilestorePlace,
    /// The most the layer's file data may take, in bytes (`size=`).
    pub size_limit: Option<u64>,
    /// The change log a daemon that takes the mount over after a crash rebuilds the tree
    /// from (memory_upper/changes.rs).
    pub change_log: ChangeLogPlace,
}

/// The device number a memory upper's objects are counted on (`InoMap`): no file system has it.
pub(super) const MEMORY_DEV: u64 = u64::MAX;

/// The filestore a memory upper keeps in its upper dir by default (`filestore=self`).
pub const FILESTORE_NAME: &str = ".mosaicfs-filestore";

/// Whether `name`, in an upper dir, is a file of a memory upper layer (docs/FORMAT.md).
pub(super) fn is_memory_layer_file(name: &OsStr) -> bool {
    let b = name.as_bytes();
    [IMAGE_NAME, FILESTORE_NAME, ".mosaicfs-journal"]
        .iter()
        .any(|n| {
            b.strip_prefix(n.as_bytes())
                .is_some_and(|r| r.is_empty() || r == b".new")
        })
}

/// Whether the directory `dir` holds a memory upper layer's image (its name and its magic: a
/// file of that name in an image layer is refused only when it is one).
pub(super) fn has_memory_image(dir: BorrowedFd<'_>) -> bool {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let Ok(fd) = sys::open_beneath(dir, Path::new(IMAGE_NAME), flags, 0) else {
        return false;
    };
    let mut magic = [0u8; 8];
    sys::pread_full(fd.as_fd(), &mut magic, 0).is_ok_and(|n| n == 8)
        && &magic == crate::memory_upper::IMAGE_MAGIC
}

/// Whether the upper dir `ufd` holds a memory upper layer (its image).
pub(super) fn holds_memory_layer(ufd: BorrowedFd<'_>) -> bool {
    sys::stat_opt(ufd, OsStr::new(IMAGE_NAME)).is_ok_and(|a| a.is_some())
}

/// The memory upper kept in the upper dir `upper`, opened for reading only: its image and
/// journal as they are, data from the filestore in the upper dir.
pub(super) fn read_memory_upper(ufd: BorrowedFd<'_>, upper: &Path) -> Result<MemoryUpper> {
    let at = |e: Error| crate::message!("upperdir '{}': {e}", upper.display());
    let flags = OFlags::RDONLY | OFlags::CLOEXEC;
    let filestore = match crate::sys::openat(ufd, FILESTORE_NAME, flags, rustix::fs::Mode::empty())
    {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => {
            return Err(crate::message!(
                "upperdir '{}' holds a memory upper layer whose filestore is elsewhere \
                 (filestore=PATH): mount it with those options and export the mount \
                 (mosaicfs export MOUNTPOINT)",
                upper.display()
            ));
        }
        Err(e) => return Err(at(e.into())),
    };
    let dir =
        sys::open_beneath(ufd, Path::new(""), OFlags::RDONLY | OFlags::DIRECTORY, 0).map_err(at)?;
    MemoryUpper::open_read_only(dir, filestore).map_err(|e| {
        crate::message!(
            "upperdir '{}': the memory layer cannot be read ({e}); mount it to see what the \
             mount says",
            upper.display()
        )
    })
}

/// Opens the memory upper kept in the upper dir `upper` (`ufd`), refusing a dir that holds
/// something else. Errors are one line naming the dir and what to do.
pub(super) fn open_memory_upper(
    ufd: BorrowedFd<'_>,
    upper: &Path,
    spec: &MemorySpec,
) -> Result<MemoryUpper> {
    let at = |e: Error| crate::message!("upperdir '{}': {e}", upper.display());
    let entries = sys::read_dir(ufd, Path::new("")).map_err(at)?;
    if let Some(e) = entries.iter().find(|e| !is_memory_layer_file(&e.name)) {
        return Err(crate::message!(
            "upperdir '{}' holds '{}', which is not a file of a memory upper layer: \
             upper=memory needs an empty upper dir or one a memory upper wrote; mount this \
             one with upper=disk",
            upper.display(),
            e.name.to_string_lossy()
        ));
    }
    let has_image = entries.iter().any(|e| e.name == IMAGE_NAME);
    let limit = spec
        .size_limit
        .map(|b| b.div_ceil(crate::memory_upper::BLOCK));
    let create = OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC;
    let mode = rustix::fs::Mode::from_raw_mode(0o600);
    let filestore = match &spec.filestore {
        FilestorePlace::Anonymous if has_image => {
            return Err(crate::message!(
                "upperdir '{}' holds a memory layer kept at an unmount; filestore=memory would \
                 start an empty layer that is never kept: mount with the filestore= it was \
                 made with (self or a path), or empty the upper dir",
                upper.display()
            ));
        }
        FilestorePlace::Anonymous => {
            let fd =
                rustix::fs::memfd_create("mosaicfs-filestore", rustix::fs::MemfdFlags::CLOEXEC)
                    .map_err(|e| at(e.into()))?;
            return MemoryUpper::new_volatile(fd, limit).map_err(at);
        }
        FilestorePlace::InUpper => {
            crate::sys::openat(ufd, FILESTORE_NAME, create, mode).map_err(|e| at(e.into()))?
        }
        FilestorePlace::File(p) => rustix::fs::open(p, create, mode).map_err(|e| {
            crate::message!(
                "filestore '{}' cannot be opened ({e}): give a file on a local file system \
                 the daemon may write, or filestore=self",
                p.display()
            )
        })?,
    };
    // Not O_PATH: images are fsynced through it.
    let dir =
        sys::open_beneath(ufd, Path::new(""), OFlags::RDONLY | OFlags::DIRECTORY, 0).map_err(at)?;
    MemoryUpper::open(dir, filestore, limit, spec.change_log.clone()).map_err(|e| match e {
        ImageError::Damaged(_) => crate::message!(
            "upperdir '{}': {e}; the layer was not changed. To start it empty, move \
             {IMAGE_NAME} and .mosaicfs-journal out of the upper dir; to keep it, restore the \
             upper dir from a copy",
            upper.display()
        ),
        ImageError::ChangeLog(_) => crate::message!(
            "upperdir '{}': {e}. The layer on disk was not changed and holds every change up \
             to the last fsync: unmount the mount and mount it again to serve it as that",
            upper.display()
        ),
        ImageError::Io(e) => crate::message!(
            "upperdir '{}': the memory layer cannot be read or written there ({e}): check \
             that its file system is writable and not full",
            upper.display()
        ),
    })
}
