//! The merged directory listing.
//!
//! Upper entries first, then each lower layer's entries not already seen, top to bottom. A
//! whiteout hides its name in the layers below the one holding it; an opaque directory ends the
//! listing (its view simply has no lower part). Whiteouts and `.wh.` names never show.
//!
//! A listing is taken once per open directory handle and served from that snapshot, so the
//! offsets given to the kernel (index + 1) are stable for seekdir/telldir; a read from offset 0
//! (rewinddir) takes a fresh snapshot.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;

use crate::error::Result;
use crate::handles::{DirEntry, DirHandle};
use crate::inode::{Ino, Node, ROOT_INO};
use crate::layers::{OPAQUE_WHITEOUT, UPPER, WHITEOUT_PREFIX};
use crate::overlay::{DirView, Overlay};
use crate::sys;
use crate::sys::Attr;
use crate::upper::LayerDir;

impl Overlay {
    /// OPENDIR: a handle, and whether the kernel may keep the directory's listing across
    /// opens (FOPEN_CACHE_DIR with FOPEN_KEEP_CACHE). It may for a directory only lower layers
    /// hold: layers do not change under a mount, and every change through the mount (create,
    /// unlink, rename, link in it) makes the kernel drop its cached listing at the next open
    /// (`fuse_dir_changed`); the change copies the directory up, so that open gets no cache
    /// flags. A second listing — a shell's glob, a language runtime scanning its library
    /// directories — then costs no READDIRPLUS, whose lookup per entry reaches a store's
    /// client once its own short caches expired (bench/stores.sh).
    pub fn opendir(&self, ino: Ino) -> Result<(u64, bool)> {
        let node = self.node(ino)?;
        self.dir_view(&node)?;
        let cacheable = !node.state().upper;
        let fh = self.dirs.insert(DirHandle {
            ino,
            entries: Mutex::new(None),
        });
        Ok((fh, cacheable))
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.remove(fh);
    }

    /// Entries of the open directory `fh` from `offset` on, with the offset of the next one.
    pub fn readdir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        mut emit: impl FnMut(&DirEntry, u64) -> bool,
    ) -> Result<()> {
        let handle = match self.dirs.get(fh) {
            Some(h) if h.ino == ino => h,
            _ => return Err(crate::error::errno(libc::EBADF)),
        };
        let mut entries = handle.entries.lock().unwrap_or_else(|e| e.into_inner());
        if offset == 0 || entries.is_none() {
            *entries = Some(self.list_dir(ino)?);
        }
        let list = entries.as_ref().expect("listed above");
        for (i, e) in list.iter().enumerate().skip(offset as usize) {
            if emit(e, i as u64 + 1) {
                break;
            }
        }
        Ok(())
    }

    /// READDIRPLUS: entries with their attributes, each looked up (one kernel reference each,
    /// except `.` and `..`, which the kernel does not take). `emit` returns true when the reply
    /// is full; that entry's reference is given back. An entry gone since the listing is passed
    /// without attributes.
    pub fn readdirplus(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        mut emit: impl FnMut(&DirEntry, u64, Option<(&Node, &Attr)>) -> bool,
    ) -> Result<()> {
        self.readdir(ino, fh, offset, |e, next| {
            if e.name == "." || e.name == ".." {
                return emit(e, next, None);
            }
            match self.lookup(ino, &e.name) {
                Ok((node, attr)) => {
                    let full = emit(e, next, Some((&node, &attr)));
                    if full {
                        self.inodes.forget(node.ino, 1);
                    }
                    full
                }
                Err(_) => emit(e, next, None),
            }
        })
    }

    /// The merged listing of directory `ino`, with `.` and `..` first.
    pub fn list_dir(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        let node = self.node(ino)?;
        let view = self.dir_view(&node)?;
        let parent = if ino == ROOT_INO {
            ROOT_INO
        } else {
            node.state().links.first().map_or(ROOT_INO, |l| l.0)
        };
        let mut out = vec![
            DirEntry {
                name: ".".into(),
                ino,
                kind: libc::S_IFDIR,
            },
            DirEntry {
                name: "..".into(),
                ino: parent,
                kind: libc::S_IFDIR,
            },
        ];
        out.extend(self.list_view(&view)?);
        Ok(out)
    }

    /// The merged entries of a directory view, without `.` and `..`.
    pub fn list_view(&self, view: &DirView) -> Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        let mut hidden: HashSet<OsString> = HashSet::new();
        if let Some(dir) = &view.upper {
            let (objects, whiteouts) = self.layer_entries(dir.view())?;
            hidden.extend(whiteouts);
            for (e, kind) in objects {
                let origin = if view.origins {
                    match self.origin_ino(dir.view(), &e.name) {
                        Ok(origin) => origin,
                        // Removed since the directory was read (see `entry_kind`).
                        Err(err) if err.is(libc::ENOENT) => continue,
                        Err(err) => return Err(err),
                    }
                } else {
                    None
                };
                let ino = origin.unwrap_or_else(|| self.map_ino(UPPER, e.ino));
                hidden.insert(e.name.clone());
                out.push(DirEntry {
                    name: e.name,
                    ino,
                    kind,
                });
            }
        }
        if let Some(lower) = &view.lower {
            for &layer in &lower.layers {
                let path = lower.path_in(layer);
                let _waiting = crate::lower_wait::enter(layer)?;
                let (objects, whiteouts) =
                    match self.in_lower_dir(layer, path, |dir| self.layer_entries(dir.into())) {
                        Ok(listed) => listed,
                        Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => continue,
                        Err(e) => return Err(e),
                    };
                for (e, kind) in objects {
                    if hidden.insert(e.name.clone()) {
                        out.push(DirEntry {
                            ino: self.map_ino(layer, e.ino),
                            name: e.name,
                            kind,
                        });
                    }
                }
                hidden.extend(whiteouts);
            }
        }
        Ok(out)
    }

    /// The entries of the layer directory `dir` itself: its objects with their types, and the
    /// names its whiteouts (in any format) hide. The opaque marker file is in neither.
    pub fn layer_entries(&self, dir: LayerDir<'_>) -> Result<LayerEntries> {
        let xwhiteouts = self.layers.dir_flags(dir, None, false)?.xwhiteouts;
        let mut objects = Vec::new();
        let mut whiteouts = Vec::new();
        for e in dir.read_dir()? {
            if let Some(target) = whiteout_target(&e.name) {
                whiteouts.extend(target);
                continue;
            }
            match self.entry_kind(dir, &e, xwhiteouts)? {
                Some(kind) => objects.push((e, kind)),
                None => whiteouts.push(e.name),
            }
        }
        Ok((objects, whiteouts))
    }

    /// The type of a listed entry, or `None` if it is a whiteout.
    /// Regular files are whiteouts only by xattr, which (as in kernel overlayfs) a listing
    /// honours only in a directory marked for them (`xwhiteouts`); lookup checks every one.
    fn entry_kind(
        &self,
        dir: LayerDir<'_>,
        e: &sys::RawDirEntry,
        xwhiteouts: bool,
    ) -> Result<Option<u32>> {
        match e.kind {
            libc::S_IFREG if !xwhiteouts => Ok(Some(libc::S_IFREG)),
            libc::S_IFCHR | libc::S_IFREG | 0 => {
                // An entry removed since the directory was read is left out, like a whiteout:
                // a listing taken while others change the directory is not an error.
                let Some(attr) = dir.stat_opt(&e.name)? else {
                    return Ok(None);
                };
                match self.layers.is_whiteout(dir, &e.name, &attr) {
                    Ok(false) => Ok(Some(attr.file_type())),
                    Ok(true) => Ok(None),
                    Err(err) if err.is(libc::ENOENT) => Ok(None),
                    Err(err) => Err(err),
                }
            }
            k => Ok(Some(k)),
        }
    }
}

/// A layer directory's objects with their types (`S_IFMT`), and the names it whites out.
pub type LayerEntries = (Vec<(sys::RawDirEntry, u32)>, Vec<OsString>);

/// For a `.wh.NAME` entry, the name it hides (none for the opaque marker).
fn whiteout_target(name: &OsStr) -> Option<Option<OsString>> {
    let b = name.as_bytes();
    if !b.starts_with(WHITEOUT_PREFIX) {
        return None;
    }
    if b == OPAQUE_WHITEOUT.as_bytes() {
        return Some(None);
    }
    Some(Some(
        OsStr::from_bytes(&b[WHITEOUT_PREFIX.len()..]).to_os_string(),
    ))
}
