//! Lookup: finding a name through the layers, top down.
//!
//! The upper layer is asked first. A whiteout there (or a `.wh.NAME` file) hides the name; a
//! non-directory there is the answer; a directory there is merged with the lower directories of
//! the same name unless it is opaque or carries a redirect (then the lower directories are the
//! ones at the redirect's path). In the lower layers the first match wins for non-directories,
//! and directories merge downwards until an opaque one, a whiteout or a non-directory stops them.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Result, errno};
use crate::inode::{Found, Ino, LowerRef, Node};
use crate::layers::{UPPER, is_reserved_name};
use crate::overlay::{DirView, Overlay};
use crate::sys::{self, Attr};

/// A name resolved in the merged view.
#[derive(Debug, Clone)]
pub struct Entry {
    pub found: Found,
    /// `stat` of the topmost layer file.
    pub attr: Attr,
}

/// What an upper directory holds at a name (`Overlay::upper_slot`).
pub enum UpperSlot {
    Object(Attr),
    /// A whiteout object at the name itself (char 0/0 or an xattr-marked file).
    Whiteout,
    /// A `.wh.NAME` file beside it.
    WhFile,
    Empty,
}

pub fn check_name(name: &OsStr) -> Result<()> {
    if name.len() > 255 {
        return Err(errno(libc::ENAMETOOLONG));
    }
    if name.as_bytes().contains(&b'/') || name.is_empty() {
        return Err(errno(libc::EINVAL));
    }
    Ok(())
}

impl Overlay {
    /// Looks `name` up in `parent` and records it for the kernel (one more reference).
    pub fn lookup(&self, parent: Ino, name: &OsStr) -> Result<(Arc<Node>, Attr)> {
        check_name(name)?;
        let pnode = self.node(parent)?;
        loop {
            // A change to the directory's entries that overtakes this lookup makes it look again.
            let seen = pnode.entries.read();
            let entry = self
                .resolve(&self.dir_view(&pnode)?, name)?
                .ok_or_else(|| errno(libc::ENOENT))?;
            if let Some(node) = self.copied_up_link_of(&entry) {
                match self.join_copied_up_link(&node, parent, name) {
                    Ok(()) => continue,
                    Err(e) => {
                        log::warn!("hard link {name:?} not joined to its copied-up inode: {e}")
                    }
                }
            }
            // A copied-up hard link found while the inode is known by lower names only (a
            // remount): those names join it.
            let rejoin = entry.found.upper
                && entry.found.origin
                && entry.found.kind != libc::S_IFDIR
                && !self.config.read_only
                && self.inodes.get(entry.found.ino).is_some_and(|n| {
                    let st = n.state();
                    !st.upper && !st.unlinked && st.kind == entry.found.kind
                });
            let Some(node) = self
                .inodes
                .remember_if(parent, name, &entry.found, || pnode.entries.unchanged(seen))
            else {
                continue;
            };
            if rejoin {
                self.join_other_links(&node);
            }
            let attr = self.present(&node, entry.attr);
            return Ok((node, attr));
        }
    }

    /// The inode a lower hard link found by a lookup belongs to, when another of its names was
    /// copied up in this mount (both carry the lower file's inode number).
    fn copied_up_link_of(&self, entry: &Entry) -> Option<Arc<Node>> {
        let f = &entry.found;
        if f.upper
            || f.kind == libc::S_IFDIR
            || entry.attr.nlink < 2
            || f.lower.is_none()
            || self.config.read_only
        {
            return None;
        }
        let node = self.inodes.get(f.ino)?;
        let st = node.state();
        let joins = st.upper && !st.unlinked && st.kind == f.kind;
        drop(st);
        joins.then_some(node)
    }

    /// What the upper directory `dir` holds at `name`. `below`: whether lower layers lie under
    /// it; only then can a `.wh.NAME` file matter (it hides nothing otherwise, and a stale one
    /// is harmless), so only then is it looked for.
    pub fn upper_slot(
        &self,
        dir: std::os::fd::BorrowedFd<'_>,
        name: &OsStr,
        below: bool,
    ) -> Result<UpperSlot> {
        if let Some(attr) = sys::stat_opt(dir, name)? {
            if self.layers.is_whiteout(dir, name, &attr)? {
                return Ok(UpperSlot::Whiteout);
            }
            return Ok(UpperSlot::Object(attr));
        }
        if below && self.layers.has_wh_file(dir, name)? {
            return Ok(UpperSlot::WhFile);
        }
        Ok(UpperSlot::Empty)
    }

    /// Resolves `name` in the directory `view` without recording anything.
    pub fn resolve(&self, view: &DirView, name: &OsStr) -> Result<Option<Entry>> {
        if is_reserved_name(name) {
            return Ok(None);
        }
        if let Some(up) = &view.upper {
            let dir = up.as_fd();
            let slot = self.upper_slot(dir, name, view.lower.is_some())?;
            if let UpperSlot::Object(attr) = slot {
                // Only a copy-up carries an origin: in a directory without lower parts (and not
                // marked as holding moved copy-ups) there is nothing to read.
                let origin = if view.origins {
                    self.origin_ino(dir, name)?
                } else {
                    None
                };
                let ino = origin.unwrap_or_else(|| self.map_ino(UPPER, attr.ino));
                let flags = if attr.is_dir() {
                    self.layers
                        .dir_flags(dir, Some(name), view.lower.is_some())?
                } else {
                    crate::layers::DirFlags::default()
                };
                let lower = if !attr.is_dir() || flags.opaque {
                    None
                } else if let Some(target) = flags
                    .redirect
                    .then(|| sys::get_xattr(dir, Some(name), &self.layers.xattr.redirect))
                    .transpose()?
                    .flatten()
                {
                    self.resolve_redirect(Path::new(OsStr::from_bytes(&target)))?
                } else {
                    match &view.lower {
                        Some(l) => self
                            .resolve_lower(l, name)?
                            .filter(|(a, _)| a.is_dir())
                            .map(|(_, r)| r),
                        None => None,
                    }
                };
                let found = Found {
                    ino,
                    kind: attr.file_type(),
                    upper: true,
                    lower,
                    origin: origin.is_some(),
                    origins: flags.origins,
                };
                return Ok(Some(Entry { found, attr }));
            }
            if !matches!(slot, UpperSlot::Empty) {
                return Ok(None);
            }
        }
        let Some(l) = &view.lower else {
            return Ok(None);
        };
        Ok(self.resolve_lower(l, name)?.map(|(attr, lower)| Entry {
            found: Found {
                ino: self.map_ino(lower.top(), attr.ino),
                kind: attr.file_type(),
                upper: false,
                lower: Some(lower),
                origin: false,
                origins: false,
            },
            attr,
        }))
    }

    /// Resolves `name` in the lower directories `dir` only.
    pub fn resolve_lower(&self, dir: &LowerRef, name: &OsStr) -> Result<Option<(Attr, LowerRef)>> {
        let mut result: Option<(Attr, LowerRef)> = None;
        for &layer in &dir.layers {
            let fd = match self.layers.dir(layer, &dir.path) {
                Ok(fd) => fd,
                Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => continue,
                Err(e) => return Err(e),
            };
            let fd = fd.as_fd();
            let Some(attr) = sys::stat_opt(fd, name)? else {
                if self.layers.has_wh_file(fd, name)? {
                    break;
                }
                continue;
            };
            if self.layers.is_whiteout(fd, name, &attr)? {
                break;
            }
            match &mut result {
                None => {
                    let lower = LowerRef {
                        path: dir.path.join(name),
                        layers: vec![layer],
                    };
                    if !attr.is_dir() {
                        return Ok(Some((attr, lower)));
                    }
                    result = Some((attr, lower));
                }
                Some((_, lower)) => {
                    if !attr.is_dir() {
                        break;
                    }
                    lower.layers.push(layer);
                }
            }
            if self.layers.is_opaque(fd, name)? {
                break;
            }
        }
        Ok(result)
    }

    /// The lower directories at `target`, for a renamed directory's redirect.
    pub fn resolve_redirect(&self, target: &Path) -> Result<Option<LowerRef>> {
        let target: PathBuf = target
            .components()
            .filter(|c| matches!(c, std::path::Component::Normal(_)))
            .collect();
        let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
            return Ok(None);
        };
        let mut lower = LowerRef {
            path: target.clone(),
            layers: Vec::new(),
        };
        for layer in self.layers.lower_ids() {
            let fd = match self.layers.dir(layer, parent) {
                Ok(fd) => fd,
                Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => continue,
                Err(e) => return Err(e),
            };
            match sys::stat_opt(fd.as_fd(), name)? {
                Some(a) if a.is_dir() => {
                    lower.layers.push(layer);
                    if self.layers.is_opaque(fd.as_fd(), name)? {
                        break;
                    }
                }
                Some(_) => break,
                None => {}
            }
        }
        Ok((!lower.layers.is_empty()).then_some(lower))
    }

    /// The inode number a copied-up object keeps from its origin, if it has one.
    pub fn origin_ino(
        &self,
        dir: std::os::fd::BorrowedFd<'_>,
        name: &OsStr,
    ) -> Result<Option<Ino>> {
        let Some(raw) = sys::get_xattr(dir, Some(name), &self.layers.xattr.origin)? else {
            return Ok(None);
        };
        match std::str::from_utf8(&raw)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        {
            // Numbers from 2^63 up are second identities' (inode.rs); clearing the top bit
            // also reads marks written before that rule as the number InoMap gives now.
            Some(ino) if ino & (crate::inode::ALIAS_BASE - 1) > 1 => {
                Ok(Some(ino & (crate::inode::ALIAS_BASE - 1)))
            }
            _ => {
                log::warn!(
                    "ignoring damaged {} xattr on {:?}: the inode number will change",
                    self.layers.xattr.origin,
                    name
                );
                Ok(None)
            }
        }
    }

    /// Whether `name` in the directory `node` is visible in a lower layer, so that removing it
    /// from the merged view needs a whiteout.
    pub fn lower_has(&self, dir: &Node, name: &OsStr) -> Result<bool> {
        let lower = dir.state().lower.clone();
        match lower {
            Some(l) => Ok(self.resolve_lower(&l, name)?.is_some()),
            None => Ok(false),
        }
    }
}
