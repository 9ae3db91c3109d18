//! The layer stack and the on-disk conventions shared with kernel overlayfs and fuse-overlayfs.
//!
//! Layer 0 is the upper layer (when there is one), layers 1..=N the lower layers from top to
//! bottom. Lower layers are never written. Each layer is held by one `O_PATH` fd on its root; all
//! access below it goes through `sys::open_beneath`.
//!
//! Whiteouts read: char device 0/0, `.wh.NAME`, and a zero-size regular file carrying an overlay
//! whiteout xattr. Opaque dirs read: `trusted.overlay.opaque`, `user.overlay.opaque`,
//! `user.fuseoverlayfs.opaque` set to `y`, or a `.wh..wh..opq` file inside. Written: char 0/0
//! where mknod works, else `.wh.NAME` files — the rule of fuse-overlayfs.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rustix::fs::OFlags;

use crate::error::{Error, Result, errno};
pub use crate::memory_upper::ChangeLogPlace;
use crate::memory_upper::{IMAGE_NAME, ImageError, MemoryUpper};
use crate::options::FilestorePlace;
use crate::stat_override::{self, XattrPermissions};
use crate::sys::{self, Attr};
use crate::upper::{Creation, LayerDir, UpperDir};

mod memory;
mod roots;
mod work_dir;

pub use memory::*;
pub use roots::*;
pub use work_dir::*;

pub type LayerId = u16;
pub const UPPER: LayerId = 0;

pub const WHITEOUT_PREFIX: &[u8] = b".wh.";
pub const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";
/// The directory inside workdir that mosaicfs owns; everything in it is temporary.
pub const WORK_SUBDIR: &str = "mosaicfs-work";

const OPAQUE_XATTRS: [&str; 3] = [
    "trusted.overlay.opaque",
    "user.overlay.opaque",
    "user.fuseoverlayfs.opaque",
];
const WHITEOUT_XATTRS: [&str; 2] = ["trusted.overlay.whiteout", "user.overlay.whiteout"];
/// Redirects of directories renamed by kernel overlayfs (read after mosaicfs' own).
pub const REDIRECT_XATTRS: [&str; 2] = ["trusted.overlay.redirect", "user.overlay.redirect"];

pub struct Layer {
    pub root: OwnedFd,
    pub path: PathBuf,
    /// The layer sits on an idmapped mount: its owners are already in the mount's id space
    /// (containers/storage idmaps lower layers and passes uidmapping= as well).
    pub idmapped: bool,
    pub dev: u64,
    /// Index of this layer's device among the distinct devices of the stack (for inode numbers).
    pub dev_index: u64,
    /// The xattr holding owners and modes of this layer's objects, when they are kept in one
    /// (stat_override.rs): the key its root carries, or for the upper layer `xattr_permissions=`.
    pub stat_override: Option<&'static str>,
    /// The layer sits on a FUSE or network file system (`on_store`).
    pub on_store: bool,
}

/// Whether the file system of `fd` is a FUSE or network one: the client of a shared store
/// (GlusterFS, sshfs, squashfuse, NFS, SMB, CephFS, 9p, Lustre). Such clients decide
/// themselves what their page cache keeps — glusterfs' FUSE client drops it at every open —
/// so passing reads through to them loses the cache between opens (io.rs `open`).
fn on_store(fd: BorrowedFd<'_>) -> bool {
    const FUSE: i64 = 0x6573_5546;
    const NFS: i64 = 0x6969;
    const SMB2: i64 = 0xfe53_4d42;
    const CIFS: i64 = 0xff53_4d42;
    const CEPH: i64 = 0x00c3_6400;
    const V9FS: i64 = 0x0102_1997;
    const LUSTRE: i64 = 0x0bd0_0bd0;
    rustix::fs::fstatfs(fd)
        .is_ok_and(|s| matches!(s.f_type, FUSE | NFS | SMB2 | CIFS | CEPH | V9FS | LUSTRE))
}

/// Marks on a layer directory.
#[derive(Debug, Clone, Default)]
pub struct DirFlags {
    pub opaque: bool,
    /// Entries may be whiteouts marked by xattr (kernel overlayfs `opaque=x`).
    pub xwhiteouts: bool,
    /// Entries may carry `mosaicfs.origin` although the directory has no lower part (a
    /// copied-up object was moved in).
    pub origins: bool,
    /// The directory itself carries `mosaicfs.origin` (a copy-up keeping its lower inode
    /// number): only then is the value worth reading.
    pub origin: bool,
    /// The directory was renamed: where its lower part is (the value of `mosaicfs.redirect`,
    /// or of kernel overlayfs' `trusted.overlay.redirect` / `user.overlay.redirect`).
    pub redirect: Option<Vec<u8>>,
}

/// The names of mosaicfs' own xattrs, in the namespace chosen at mount.
#[derive(Debug, Clone)]
pub struct XattrNames {
    pub prefix: &'static str,
    pub origin: String,
    pub partial: String,
    pub redirect: String,
    /// On a char device 0/0: this is a real device made through the mount, not a whiteout.
    pub device: String,
    /// On an upper directory without lower parts: some entries carry `origin` (see DirFlags).
    pub origins: String,
    pub opaque: &'static str,
    /// Immutable and append-only flags of an upper object, as kernel overlayfs keeps them
    /// (fileattr.rs).
    pub protattr: &'static str,
}

impl XattrNames {
    pub fn new(trusted: bool) -> Self {
        let prefix = if trusted { "trusted." } else { "user." };
        XattrNames {
            prefix,
            origin: format!("{prefix}mosaicfs.origin"),
            partial: format!("{prefix}mosaicfs.partial"),
            redirect: format!("{prefix}mosaicfs.redirect"),
            device: format!("{prefix}mosaicfs.device"),
            origins: format!("{prefix}mosaicfs.origins"),
            opaque: if trusted {
                "trusted.overlay.opaque"
            } else {
                "user.overlay.opaque"
            },
            protattr: if trusted {
                "trusted.overlay.protattr"
            } else {
                "user.overlay.protattr"
            },
        }
    }
}

/// Namespaces of xattrs that belong to an overlay's bookkeeping: mosaicfs', kernel overlayfs'
/// and fuse-overlayfs'. Each is `NS.OWNER.`; see `stored_xattr_name`.
const OVERLAY_XATTRS: [(&[u8], &[u8]); 5] = [
    (b"trusted.mosaicfs.", b"mosaicfs."),
    (b"user.mosaicfs.", b"mosaicfs."),
    (b"trusted.overlay.", b"overlay."),
    (b"user.overlay.", b"overlay."),
    (b"user.fuseoverlayfs.", b"fuseoverlayfs."),
];

/// The name under which an xattr of the merged view is kept on the layers. An overlay mounted
/// on top of this one (nested containers) keeps its own bookkeeping in the same namespaces as
/// the layers' overlays do, so such a name is escaped by repeating its owner, as kernel
/// overlayfs does since 6.7: `trusted.overlay.opaque` of the merged view is
/// `trusted.overlay.overlay.opaque` on the layer, and a layer read by kernel overlayfs shows it
/// the same way. Every other name is kept as it is.
pub fn stored_xattr_name(merged: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    for (prefix, owner) in OVERLAY_XATTRS {
        if let Some(rest) = merged.strip_prefix(prefix) {
            return [prefix, owner, rest].concat().into();
        }
    }
    merged.into()
}

/// The merged view's name of an xattr found on a layer, or `None` when it is an overlay's
/// bookkeeping that the merged view hides (the inverse of `stored_xattr_name`).
pub fn merged_xattr_name(stored: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    for (prefix, owner) in OVERLAY_XATTRS {
        if let Some(rest) = stored.strip_prefix(prefix) {
            let escaped = rest.strip_prefix(owner)?;
            return Some([prefix, escaped].concat().into());
        }
    }
    Some(stored.into())
}

pub struct LayerStack {
    /// Index 0 is the upper layer when `has_upper`; otherwise a placeholder equal to lower 1.
    /// Then the lower layers, then the data-only ones (`data_only` of them, metacopy.rs).
    layers: Vec<Layer>,
    data_only: usize,
    pub has_upper: bool,
    /// `workdir/mosaicfs-work`, on the upper file system: copy-up builds objects here and renames
    /// them into place, so that a crash never leaves a half-made object in the upper layer.
    pub work: Option<Arc<OwnedFd>>,
    /// Holds the work dir's lock while the stack lives (`WorkLock`).
    _work_lock: Option<OwnedFd>,
    /// Holds the upper dir's lock while the stack lives (the same upper, another work dir).
    _upper_lock: Option<OwnedFd>,
    pub xattr: XattrNames,
    /// Whether whiteouts are char devices 0/0 (`chardev_whiteouts`).
    whiteout_chardev: std::sync::atomic::AtomicBool,
    /// Whether directories' redirects are followed (`redirect_dir=nofollow` turns it off).
    pub follow_redirects: bool,
    /// Whether any layer keeps owners and modes in an xattr (`Layer::stat_override`).
    pub any_override: bool,
    dirs: crate::dircache::DirCache,
    /// The upper layer when the daemon holds it (`upper=memory`): every upper handle is then
    /// a node of this store, and the upper dir on disk holds only its image and filestore.
    pub memory: Option<Arc<MemoryUpper>>,
}

impl LayerStack {
    /// Opens and checks every layer. Errors are one line naming the problem and what to do.
    /// One piece: the order of the steps is the point (the work dir's lock before anything is
    /// changed, the upper's checks before the lowers are opened), and it reads top to bottom.
    pub fn open(
        lowers: &[PathBuf],
        upper: Option<&Path>,
        work: Option<&Path>,
        read_only: bool,
        perms: XattrPermissions,
        lock: WorkLock,
        memory_spec: Option<&MemorySpec>,
    ) -> Result<LayerStack> {
        let mut layers = Vec::new();
        let mut devs: Vec<u64> = Vec::new();
        let idmaps = Idmaps::default();
        let mut add = |fd: OwnedFd, attr: Attr, path: PathBuf| {
            let dev_index = match devs.iter().position(|d| *d == attr.dev) {
                Some(i) => i,
                None => {
                    devs.push(attr.dev);
                    devs.len() - 1
                }
            } as u64;
            let stat_override = override_key_of(fd.as_fd());
            layers.push(Layer {
                on_store: on_store(fd.as_fd()),
                stat_override,
                root: fd,
                idmapped: idmaps.covers(&path),
                path,
                dev: attr.dev,
                dev_index,
            });
        };
        // trusted.* needs CAP_SYS_ADMIN in the initial user namespace: root in a user namespace
        // (rootless Podman) gets EPERM and uses user.* like an unprivileged user (probed below).
        let mut trusted = rustix::process::geteuid().is_root();
        let mut work_fd = None;
        let mut work_lock = None;
        let mut upper_lock = None;
        let mut has_upper = false;
        let mut memory = None;
        if let Some(upper) = upper.filter(|_| !read_only) {
            check_no_lower_inside(lowers, upper, work)?;
        }
        // Without a work dir an upper layer can only be read (`mosaicfs export` of unmounted
        // dirs); a mount always has both (options/).
        if let Some(upper) = upper.filter(|_| work.is_some() || read_only) {
            let upper = canonical(upper, "upperdir")?;
            let (ufd, uattr) = open_layer_root(&upper, "upperdir")?;
            if let Some(work) = work {
                let work = canonical(work, "workdir")?;
                let (wfd, wattr) = open_layer_root(&work, "workdir")?;
                if uattr.dev != wattr.dev {
                    return Err(crate::message!(
                        "upperdir '{}' and workdir '{}' are on different file systems: put both on one",
                        upper.display(),
                        work.display()
                    ));
                }
                if work.starts_with(&upper) || upper.starts_with(&work) {
                    return Err(crate::message!(
                        "workdir '{}' and upperdir '{}' must not contain one another: use sibling directories",
                        work.display(),
                        upper.display()
                    ));
                }
                if let Some(fs) = unsupported_fs(ufd.as_fd()) {
                    return Err(crate::message!(
                        "upperdir '{}' is on {fs}, which cannot hold an upper layer",
                        upper.display()
                    ));
                }
                if !read_only {
                    check_writable(ufd.as_fd(), &upper, "upperdir")?;
                    check_writable(wfd.as_fd(), &work, "workdir")?;
                    let (wsub, held) = prepare_work_dir(wfd.as_fd(), &work, lock)?;
                    work_lock = Some(held);
                    // The upper dir too: the same upper layer with another work dir would
                    // be two writers that do not see each other's work dir.
                    let ulock = rustix::fs::open(
                        &upper,
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                        rustix::fs::Mode::empty(),
                    )
                    .map_err(|e| crate::message!("upperdir '{}': {e}", upper.display()))?;
                    upper_lock = Some(lock_dir(ulock, "upperdir", &upper, lock)?);
                    let mut probed = probe_xattrs(wsub.as_fd(), &XattrNames::new(trusted));
                    if trusted && probed.as_ref().is_err_and(|e| e.is(libc::EPERM)) {
                        log::info!(
                            "trusted.* xattrs not permitted (user namespace?): using user.*"
                        );
                        trusted = false;
                        probed = probe_xattrs(wsub.as_fd(), &XattrNames::new(trusted));
                    }
                    probed.map_err(|e| {
                    crate::message!(
                        "upperdir '{}' does not support extended attributes ({e}), which mosaicfs needs \
                         to mark partial files: use ext4, xfs, btrfs or tmpfs",
                        upper.display()
                    )
                })?;
                    work_fd = Some(wsub);
                }
            }
            let mut uattr = uattr;
            match memory_spec {
                // After the work dir's lock: the daemon before may still be writing the image.
                Some(spec) if work_fd.is_some() => {
                    memory = Some(Arc::new(open_memory_upper(ufd.as_fd(), &upper, spec)?));
                    // Its inode numbers are the store's own: a device of their own, so that
                    // they never meet a lower layer's on the upper dir's file system.
                    uattr.dev = MEMORY_DEV;
                }
                Some(_) => return Err("upper=memory needs a workdir and a read-write mount".into()),
                // Read-only (an offline `mosaicfs export`): the layer as its image shows it.
                None if read_only && holds_memory_layer(ufd.as_fd()) => {
                    memory = Some(Arc::new(read_memory_upper(ufd.as_fd(), &upper)?));
                    uattr.dev = MEMORY_DEV;
                }
                None if holds_memory_layer(ufd.as_fd()) => {
                    return Err(crate::message!(
                        "upperdir '{}' holds a memory upper layer ({IMAGE_NAME}): mount it with \
                         upper=memory (and the filestore= it was made with)",
                        upper.display()
                    ));
                }
                None => {}
            }
            if let Some(key) = perms.key()
                && !read_only
            {
                mark_override_root(ufd.as_fd(), &uattr, key, &upper)?;
            }
            add(ufd, uattr, upper);
            has_upper = true;
        }
        for (i, lower) in lowers.iter().enumerate() {
            let what = format!("lowerdir #{}", i + 1);
            let (path, fd, attr) = open_lower_root(lower, &what)?;
            if has_memory_image(fd.as_fd()) {
                return Err(crate::message!(
                    "{what} '{}' is the upper dir of a memory upper layer (upper=memory): its \
                     files live in its image and filestore, not in the directory; use a mount \
                     of it, or 'mosaicfs export' it into a layer",
                    path.display()
                ));
            }
            if !has_upper && i == 0 {
                // Keep indices stable: layer 0 is the upper layer or a stand-in for it.
                let dup = fd.try_clone().map_err(|e| e.to_string())?;
                add(dup, attr, path.clone());
            }
            add(fd, attr, path);
        }
        if has_upper && perms.key().is_some() {
            layers[UPPER as usize].stat_override = perms.key();
        }
        let any_override = layers.iter().any(|l| l.stat_override.is_some());
        ATIME_MOUNTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        Ok(LayerStack {
            any_override,
            layers,
            data_only: 0,
            has_upper,
            work: work_fd,
            _work_lock: work_lock,
            _upper_lock: upper_lock,
            xattr: XattrNames::new(trusted),
            whiteout_chardev: std::sync::atomic::AtomicBool::new(true),
            follow_redirects: true,
            dirs: Default::default(),
            memory,
        })
    }

    /// The FUSE passthrough stacking depth the layers need: 2 when a layer sits on a stacking
    /// file system (overlayfs, FUSE), else 1.
    pub fn stack_depth(&self) -> u32 {
        const OVERLAYFS: i64 = 0x794c_7630;
        const FUSE: i64 = 0x6573_5546;
        let stacked = self.layers.iter().any(|l| {
            rustix::fs::fstatfs(&l.root).is_ok_and(|s| matches!(s.f_type, OVERLAYFS | FUSE))
        });
        if stacked { 2 } else { 1 }
    }

    pub fn root(&self, layer: LayerId) -> BorrowedFd<'_> {
        self.layers[layer as usize].root.as_fd()
    }

    pub fn layer(&self, layer: LayerId) -> &Layer {
        &self.layers[layer as usize]
    }

    /// The lower layers' ids, top to bottom.
    /// The lower layers whose names show, top down (not the data-only ones).
    pub fn lower_ids(&self) -> impl Iterator<Item = LayerId> + '_ {
        (1..=self.lower_count()).map(|i| i as LayerId)
    }

    pub fn lower_count(&self) -> usize {
        self.layers.len() - 1 - self.data_only
    }

    /// The data-only lower layers, top down (metacopy.rs).
    pub fn data_ids(&self) -> impl Iterator<Item = LayerId> + '_ {
        (self.lower_count() + 1..self.layers.len()).map(|i| i as LayerId)
    }

    /// The last layer a partial-file mark may name: a lower or a data-only one.
    pub fn last_layer(&self) -> usize {
        self.layers.len() - 1
    }

    /// Appends data-only lower layers (`lowerdir=A::DATA1::DATA2`): opened and checked as
    /// the lower layers are, numbered after them, and never looked up by name: they only
    /// serve the data of metadata-only files (metacopy.rs).
    pub fn add_data_layers(&mut self, dirs: &[PathBuf]) -> Result<()> {
        if dirs.is_empty() {
            return Ok(());
        }
        let idmaps = Idmaps::default();
        for (i, dir) in dirs.iter().enumerate() {
            let what = format!("data-only lowerdir #{}", i + 1);
            let (path, fd, attr) = open_lower_root(dir, &what)?;
            let mut devs: Vec<u64> = Vec::new();
            for l in &self.layers {
                if !devs.contains(&l.dev) {
                    devs.push(l.dev);
                }
            }
            let dev_index = devs
                .iter()
                .position(|d| *d == attr.dev)
                .unwrap_or(devs.len());
            self.layers.push(Layer {
                on_store: on_store(fd.as_fd()),
                stat_override: override_key_of(fd.as_fd()),
                root: fd,
                idmapped: idmaps.covers(&path),
                path,
                dev: attr.dev,
                dev_index: dev_index as u64,
            });
            self.data_only += 1;
        }
        Ok(())
    }

    /// The work directory: copy-up and creation build objects here and rename them in.
    pub fn work(&self) -> Result<UpperDir> {
        let work = self.work.as_ref().ok_or_else(|| errno(libc::EROFS))?;
        Ok(match &self.memory {
            Some(m) => UpperDir::Memory(m.clone(), m.node(crate::memory_upper::WORK)?),
            None => UpperDir::Disk(work.clone()),
        })
    }

    /// The upper layer's root directory.
    pub fn upper_root(&self) -> Result<UpperDir> {
        Ok(match &self.memory {
            Some(m) => UpperDir::Memory(m.clone(), m.node(crate::memory_upper::ROOT)?),
            None => UpperDir::Disk(Arc::new(self.root(UPPER).try_clone_to_owned()?)),
        })
    }

    /// The directory `rel` in the lower layer `layer` as an `O_PATH` handle, from the cache
    /// when it is there. Lower layers never change, so a path there always names one directory.
    pub fn dir(&self, layer: LayerId, rel: &Path) -> Result<Arc<OwnedFd>> {
        debug_assert!(
            layer != UPPER || !self.has_upper,
            "upper dirs go through upper_dir"
        );
        self.cached_dir(layer, rel, 0)
    }

    /// Opens the lower directory `rel` again, in place of a cached descriptor its store
    /// reported stale. Not `O_PATH`: that would give the directory the kernel still has under
    /// the name without asking the store. A real open asks it (FUSE OPENDIR); on ESTALE the
    /// kernel walks the path once more and revalidates every entry (LOOKUP_REVAL).
    pub fn reopen_dir(&self, layer: LayerId, rel: &Path) -> Result<Arc<OwnedFd>> {
        self.dirs.forget(layer, rel);
        let fd = Arc::new(sys::open_beneath(
            self.root(layer),
            rel,
            OFlags::RDONLY | OFlags::DIRECTORY,
            0,
        )?);
        self.dirs.insert(layer, rel, fd.clone(), 0);
        Ok(fd)
    }

    /// The upper directory `rel` as it was in generation `moves` of upper directory moves
    /// (`Overlay::upper_fd` gives a path and a generation that agree).
    pub fn upper_dir(&self, rel: &Path, moves: u64) -> Result<UpperDir> {
        let Some(m) = &self.memory else {
            return self.cached_dir(UPPER, rel, moves).map(UpperDir::Disk);
        };
        // A walk of the tree from the root: a lookup per name, no syscall.
        let mut dir = UpperDir::Memory(m.clone(), m.node(crate::memory_upper::ROOT)?);
        for name in rel.iter() {
            dir = dir.open_dir(name)?;
        }
        Ok(dir)
    }

    /// Records for the directory cache that upper directory move `change` changes what `rel`
    /// and the paths below it name (dircache.rs).
    pub fn note_move(&self, change: u64, rel: &Path) {
        self.dirs.moved(change, rel);
    }

    fn cached_dir(&self, layer: LayerId, rel: &Path, generation: u64) -> Result<Arc<OwnedFd>> {
        if let Some(fd) = self.dirs.get(layer, rel, generation) {
            return Ok(fd);
        }
        let fd = Arc::new(sys::open_dir(self.root(layer), rel)?);
        self.dirs.insert(layer, rel, fd.clone(), generation);
        Ok(fd)
    }

    /// Whether `name` in `dir` (whose stat is `attr`) is a whiteout in any format.
    pub fn is_whiteout(&self, dir: LayerDir<'_>, name: &OsStr, attr: &Attr) -> Result<bool> {
        match attr.file_type() {
            libc::S_IFCHR if attr.rdev == 0 => {
                Ok(dir.get_xattr(Some(name), &self.xattr.device)?.is_none())
            }
            libc::S_IFCHR => Ok(false),
            libc::S_IFREG if attr.size == 0 => {
                for key in WHITEOUT_XATTRS {
                    if dir.get_xattr(Some(name), key)?.is_some() {
                        return Ok(true);
                    }
                }
                Ok(false)
            }
            _ => Ok(false),
        }
    }

    /// Whether a `.wh.NAME` file in `dir` hides `name`.
    pub fn has_wh_file(&self, dir: LayerDir<'_>, name: &OsStr) -> Result<bool> {
        let wh = wh_name(name);
        if wh.len() > 255 {
            return Ok(false);
        }
        Ok(dir.stat_opt(&wh)?.is_some())
    }

    /// Whether the directory `name` in `dir` is opaque (hides the layers below it).
    pub fn is_opaque(&self, dir: LayerDir<'_>, name: &OsStr) -> Result<bool> {
        Ok(self.dir_flags(dir, Some(name), true)?.opaque)
    }

    /// The overlay marks of a directory (`name` in `dir`, or `dir` itself), read with one
    /// listxattr and a getxattr per mark present. `opaque_file`: also look for the
    /// `.wh..wh..opq` file (three more syscalls; only worth it where layers lie below).
    pub fn dir_flags(
        &self,
        dir: LayerDir<'_>,
        name: Option<&OsStr>,
        opaque_file: bool,
    ) -> Result<DirFlags> {
        let names = dir.list_xattr(name)?;
        let has = |key: &str| names.iter().any(|n| n.as_bytes() == key.as_bytes());
        let mut flags = DirFlags {
            origins: has(&self.xattr.origins),
            origin: has(&self.xattr.origin),
            ..DirFlags::default()
        };
        let own = [self.xattr.redirect.as_str()];
        for key in own.into_iter().chain(REDIRECT_XATTRS) {
            if has(key) && self.follow_redirects {
                flags.redirect = dir.get_xattr(name, key)?;
                break;
            }
        }
        for key in OPAQUE_XATTRS {
            if has(key) {
                match dir.get_xattr(name, key)?.as_deref().and_then(|v| v.first()) {
                    Some(b'y') => flags.opaque = true,
                    // Kernel overlayfs: "x" marks a directory whose entries may be xattr whiteouts.
                    Some(b'x') => flags.xwhiteouts = true,
                    _ => {}
                }
            }
        }
        // A redirect leads to lower layers even where none lie below the parent.
        if (opaque_file || flags.redirect.is_some()) && !flags.opaque {
            flags.opaque = dir.has_in(name, OsStr::new(OPAQUE_WHITEOUT))?;
        }
        Ok(flags)
    }

    /// Whether the directory `name` in `dir` holds the `.wh..wh..opq` file, the opaque mark of
    /// layers whose file system had no xattrs (`dir_flags` reads the xattr one).
    pub fn has_opaque_file(&self, dir: LayerDir<'_>, name: &OsStr) -> Result<bool> {
        dir.has_in(Some(name), OsStr::new(OPAQUE_WHITEOUT))
    }

    /// Whether whiteouts are char devices 0/0, kernel overlayfs' own kind, else `.wh.` files.
    /// Found at the first whiteout, not probed at mount (a probe costs an inode at every
    /// mount): a mknod that the file system or the daemon's privileges refuse turns them off
    /// for the rest of the mount (`mknod_whiteout`).
    pub fn chardev_whiteouts(&self) -> bool {
        self.whiteout_chardev.load(Ordering::Relaxed)
    }

    /// Turns char-device whiteouts off for the rest of the mount, as a refused mknod does.
    pub fn no_chardev_whiteouts(&self) {
        self.whiteout_chardev.store(false, Ordering::Relaxed);
    }

    /// Makes the char-device whiteout `name` in `dir`. Ok(false): the upper layer takes no
    /// char devices (EPERM, EOPNOTSUPP), now or since an earlier refusal; make a `.wh.` file.
    pub fn mknod_whiteout(&self, dir: &UpperDir, name: &OsStr) -> Result<bool> {
        if !self.chardev_whiteouts() {
            return Ok(false);
        }
        crate::creds::act_as_daemon();
        match dir.mknod(name, &Creation::daemon(libc::S_IFCHR), 0) {
            Ok(()) => Ok(true),
            Err(e) if e.is(libc::EPERM) || e.is(libc::EOPNOTSUPP) => {
                if self.whiteout_chardev.swap(false, Ordering::Relaxed) {
                    log::info!(
                        "the upper layer takes no char devices ({e}): whiteouts are .wh. files"
                    );
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Writes a whiteout for `name` in the upper directory `dir` (which must not hold `name`).
    pub fn make_whiteout(&self, dir: &UpperDir, name: &OsStr) -> Result<()> {
        if self.mknod_whiteout(dir, name)? {
            return Ok(());
        }
        self.make_wh_file(dir, name).map(drop)
    }

    /// Writes the `.wh.NAME` whiteout for `name` in the upper directory `dir`, which may still
    /// hold `name`: beside it, the whiteout hides nothing of its own layer, only the layers
    /// below. Ok(false): one was there already.
    pub fn make_wh_file(&self, dir: &UpperDir, name: &OsStr) -> Result<bool> {
        crate::creds::act_as_daemon();
        match dir.mknod(&wh_name(name), &Creation::daemon(libc::S_IFREG | 0o600), 0) {
            Ok(()) => Ok(true),
            Err(e) if e.is(libc::EEXIST) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Marks the upper directory `name` in `dir` opaque.
    pub fn make_opaque(&self, dir: &UpperDir, name: &OsStr) -> Result<()> {
        crate::creds::act_as_daemon();
        match dir.set_xattr(Some(name), OsStr::new(self.xattr.opaque), b"y", 0) {
            Ok(()) => Ok(()),
            Err(_) => {
                let sub = dir.open_dir(name)?;
                let opq = OsStr::new(OPAQUE_WHITEOUT);
                match sub.mknod(opq, &Creation::daemon(libc::S_IFREG | 0o600), 0) {
                    Err(e) if e.is(libc::EEXIST) => Ok(()),
                    r => r,
                }
            }
        }
    }
}

/// Which layers lie on idmapped mounts. The kernel is asked about each layer's own mount
/// (statmount); only where it cannot answer so is /proc/self/mountinfo read, once per stack
/// opened: a container's mount has a lower layer per image layer, and the table grows with
/// every mount on the host (each read makes the kernel print all of it).
#[derive(Default)]
struct Idmaps {
    table: std::cell::OnceCell<IdmapTable>,
}

/// Every mount point in /proc/self/mountinfo, with whether its mount is idmapped; empty when
/// none is.
struct IdmapTable {
    mounts: Vec<(PathBuf, bool)>,
}

impl Idmaps {
    fn covers(&self, path: &Path) -> bool {
        sys::on_idmapped_mount(path).unwrap_or_else(|| {
            self.table
                .get_or_init(|| {
                    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
                    IdmapTable::parse(&info)
                })
                .covers(path)
        })
    }
}

impl IdmapTable {
    fn parse(info: &str) -> IdmapTable {
        let mounts: Vec<(PathBuf, bool)> = info
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                let point = PathBuf::from(crate::sys::unescape_mountinfo(f.get(4)?));
                Some((point, f.get(5)?.split(',').any(|o| o == "idmapped")))
            })
            .collect();
        // The common case: no mount is idmapped, and no layer needs the table.
        let any = mounts.iter().any(|(_, idmapped)| *idmapped);
        IdmapTable {
            mounts: if any { mounts } else { Vec::new() },
        }
    }

    /// Whether `path` lies on an idmapped mount: the mount with the longest mount point that
    /// contains it (the last of equals: the newest, on top) carries the `idmapped` option.
    fn covers(&self, path: &Path) -> bool {
        let mut best: Option<(usize, bool)> = None;
        for (point, idmapped) in &self.mounts {
            let len = point.as_os_str().len();
            if path.starts_with(point) && best.is_none_or(|(l, _)| len >= l) {
                best = Some((len, *idmapped));
            }
        }
        best.is_some_and(|(_, idmapped)| idmapped)
    }
}

/// Refuses a lower layer that is the upper or work dir or lies inside one: it would change
/// under the mount with every copy-up (kernel overlayfs refuses it too: "overlapping lowerdir
/// path"). An upper dir inside a lower layer is allowed, as the kernel allows it (`lowerdir=/`).
/// A writable layer's dir (`what` '`path`'): on a read-write file system, and writable by the
/// daemon. Mounted otherwise, every write through the mount would fail (EROFS, EACCES).
fn check_writable(fd: BorrowedFd<'_>, path: &Path, what: &str) -> Result<()> {
    if let Ok(st) = rustix::fs::fstatvfs(fd)
        && st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY)
    {
        return Err(crate::message!(
            "{what} '{}' is on a read-only file system: remount it read-write, or mount the \
             overlay without upperdir and workdir (read-only)",
            path.display()
        ));
    }
    let access = rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK;
    match rustix::fs::accessat(rustix::fs::CWD, path, access, rustix::fs::AtFlags::EACCESS) {
        Err(rustix::io::Errno::ACCESS) | Err(rustix::io::Errno::PERM) => {
            let st = sys::fstat(fd).ok();
            Err(crate::message!(
                "{what} '{}' is not writable by uid {} (it belongs to uid {}, mode {:o}): \
                 mount as its owner, or give it to the user that mounts",
                path.display(),
                rustix::process::geteuid().as_raw(),
                st.as_ref().map_or(0, |a| a.uid),
                st.as_ref().map_or(0, |a| a.mode & 0o7777)
            ))
        }
        _ => Ok(()),
    }
}

fn check_no_lower_inside(lowers: &[PathBuf], upper: &Path, work: Option<&Path>) -> Result<()> {
    let mut writable = vec![("upperdir", canonical(upper, "upperdir")?)];
    if let Some(work) = work {
        writable.push(("workdir", canonical(work, "workdir")?));
    }
    for (i, lower) in lowers.iter().enumerate() {
        let what = format!("lowerdir #{}", i + 1);
        let path = canonical(lower, &what)?;
        for (name, dir) in &writable {
            if path.starts_with(dir) {
                return Err(crate::message!(
                    "{what} '{}' is inside {name} '{}' (or is it): the layer would change under \
                     the mount with every copy-up; use separate directories",
                    path.display(),
                    dir.display()
                ));
            }
            if dir.starts_with(&path) {
                return Err(crate::message!(
                    "{name} '{}' is inside {what} '{}': it would show inside the merged view, \
                     and change it with every write (kernel overlayfs refuses overlapping \
                     layers too); use separate directories",
                    dir.display(),
                    path.display()
                ));
            }
        }
    }
    Ok(())
}

pub fn wh_name(name: &OsStr) -> OsString {
    let mut v = WHITEOUT_PREFIX.to_vec();
    v.extend_from_slice(name.as_bytes());
    std::os::unix::ffi::OsStringExt::from_vec(v)
}

/// Names the merged view never shows and never lets a user create.
pub fn is_reserved_name(name: &OsStr) -> bool {
    name.as_bytes().starts_with(WHITEOUT_PREFIX)
}

fn canonical(p: &Path, what: &str) -> Result<PathBuf> {
    std::fs::canonicalize(p).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => crate::message!(
            "{what} '{}' does not exist: create it or fix the path",
            p.display()
        ),
        _ => crate::message!("{what} '{}' cannot be resolved: {e}", p.display()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idmapped_layers_are_told_by_the_innermost_mount_from_one_read_of_the_table() {
        let info = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 253:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:40 / /srv/id rw,relatime,idmapped - ext4 /dev/vdb rw
41 40 0:41 / /srv/id/plain rw,relatime - tmpfs tmpfs rw
42 27 0:42 / /srv/with\\040space rw,idmapped - tmpfs tmpfs rw
";
        let maps = IdmapTable::parse(info);
        assert!(maps.covers(Path::new("/srv/id/layer")));
        assert!(
            !maps.covers(Path::new("/srv/id/plain/layer")),
            "a mount inside wins"
        );
        assert!(!maps.covers(Path::new("/srv/identity")), "whole names only");
        assert!(
            maps.covers(Path::new("/srv/with space/l")),
            "escaped mount points"
        );
        assert!(!maps.covers(Path::new("/var/lib/layer")));
        // No idmapped mount: nothing is kept to look through.
        let plain = IdmapTable::parse("27 1 253:0 / / rw,relatime - ext4 /dev/vda rw\n");
        assert!(plain.mounts.is_empty() && !plain.covers(Path::new("/x")));
    }
}
