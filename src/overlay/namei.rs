//! Lookup: finding a name through the layers, top down.
//!
//! The upper layer is asked first. A whiteout there (or a `.wh.NAME` file) hides the name; a
//! non-directory there is the answer; a directory there is merged with the lower directories of
//! the same name unless it is opaque or carries a redirect (then the lower directories are the
//! ones at the redirect's path). In the lower layers the first match wins for non-directories,
//! and directories merge downwards until an opaque one, a whiteout or a non-directory stops them.
//!
//! May call (dev/callgraph.py --check keeps it so): copy_up, metacopy, overlay, upper_meta.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Result, errno};
use crate::inode::{Found, Ino, LowerRef, Node};
use crate::layers::{DirFlags, LayerId, UPPER, is_reserved_name};
use crate::overlay::{DirView, Overlay};
use crate::sys::Attr;
use crate::upper::LayerDir;

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
    /// Looks `name` up in `parent` and records it for the kernel (one more reference). The
    /// LOOKUP request is `lookup` (by_number.rs): "." and ".." go there, every name comes here.
    pub(super) fn lookup_name(&self, parent: Ino, name: &OsStr) -> Result<(Arc<Node>, Attr)> {
        check_name(name)?;
        let pnode = self.node(parent)?;
        // Joins tried; a name that keeps answering EEXIST (another object made there between
        // the listing and the link, again and again) is looked up as it is after a few.
        let mut joins = 0;
        loop {
            // A change to the directory's entries that overtakes this lookup makes it look again.
            let seen = pnode.entries.read();
            let entry = self
                .resolve(&self.dir_view(&pnode)?, name)?
                .ok_or_else(|| errno(libc::ENOENT))?;
            if let Some(node) = self.copied_up_link_of(&entry).filter(|_| joins < 8) {
                joins += 1;
                match self.join_copied_up_link(&node, parent, name) {
                    // Joined, or joined by a lookup beside this one: look again.
                    Ok(()) => {
                        let mut st = node.state();
                        if st.rare().lower_names_unjoined > 0 {
                            st.rare_mut().lower_names_unjoined -= 1;
                        }
                        continue;
                    }
                    Err(e) if e.is(libc::EEXIST) => continue,
                    // The copied-up name was removed meanwhile: this one stays the lower file.
                    Err(e) if e.is(libc::ENOENT) => {}
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
            self.keep_store_attr(&node, entry.attr);
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
    pub(super) fn upper_slot(
        &self,
        dir: LayerDir<'_>,
        name: &OsStr,
        below: bool,
    ) -> Result<UpperSlot> {
        if let Some(attr) = dir.stat_opt(name)? {
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
            let dir = up.view();
            let slot = self.upper_slot(dir, name, view.lower.is_some())?;
            if let UpperSlot::Object(attr) = slot {
                if let Some(found) = self.known_upper_dir(&attr) {
                    return Ok(Some(Entry { found, attr }));
                }
                // The `.wh..wh..opq` file is looked for below only where it would hide
                // something: most directories a container makes have no lower part at all.
                let flags = if attr.is_dir() {
                    self.layers.dir_flags(dir, Some(name), false)?
                } else {
                    crate::layers::DirFlags::default()
                };
                // Only a copy-up carries an origin: in a directory without lower parts (and not
                // marked as holding moved copy-ups) there is nothing to read, nor in a
                // directory whose xattr names (`dir_flags`) hold none.
                let origin = if view.origins && (!attr.is_dir() || flags.origin) {
                    self.origin_ino(dir, name)?
                } else {
                    None
                };
                let ino = origin.unwrap_or_else(|| self.map_ino(UPPER, attr.ino));
                let lower = if !attr.is_dir() || flags.opaque {
                    None
                } else if let Some(redirect) = flags.redirect.as_deref().and_then(Redirect::parse) {
                    match (redirect, &view.lower) {
                        (Redirect::Absolute(target), _) => self.resolve_redirect(&target)?,
                        (Redirect::Sibling(other), Some(l)) => self
                            .resolve_lower(l, &other)?
                            .filter(|(a, _)| a.is_dir())
                            .map(|(_, r)| r),
                        (Redirect::Sibling(_), None) => None,
                    }
                } else {
                    match &view.lower {
                        Some(l) => self
                            .resolve_lower(l, name)?
                            .filter(|(a, _)| a.is_dir())
                            .map(|(_, r)| r),
                        None => None,
                    }
                };
                // (`dir_flags` has looked already where a redirect leads.)
                let lower = match lower {
                    Some(_)
                        if flags.redirect.is_none()
                            && self.layers.has_opaque_file(dir, name)? =>
                    {
                        None
                    }
                    lower => lower,
                };
                let found = Found {
                    ino,
                    kind: attr.file_type(),
                    upper: true,
                    lower,
                    origin: origin.is_some(),
                    origins: flags.origins,
                    upper_ino: Some(attr.ino),
                    generation: origin.is_none().then(|| attr.stable_generation()).flatten(),
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
                upper_ino: None,
                generation: None,
            },
            attr,
        }))
    }

    /// What a lookup would find for the upper directory `attr`, taken from its node when the
    /// node is live and numbered by the upper directory itself: a directory this mount made, or
    /// one only the upper layer has. Its node's state is what lookups inside it go by
    /// (`dir_view`), and every change the daemon makes to the directory's opaque, redirect and
    /// origins marks or to its lower part updates that state, so reading the marks and the lower
    /// layers again would find the same. That is two to three system calls fewer for each
    /// lookup that revalidates a known directory (one per path component once its kernel
    /// timeout has passed; every time with `timeout=0`). A number taken over by a new directory
    /// is not this node's while the node lives (`Pin`), and a directory with an origin is
    /// numbered by it, so never found here: it is read from the layers.
    fn known_upper_dir(&self, attr: &Attr) -> Option<Found> {
        if !attr.is_dir() {
            return None;
        }
        let node = self.inodes.get(self.map_ino(UPPER, attr.ino))?;
        if node.is_alias() {
            return None;
        }
        let st = node.state();
        let known = st.kind == libc::S_IFDIR
            && st.upper
            && !st.unlinked
            && !st.has_origin
            && st.rare().pin.is_none()
            && !st.links.is_empty();
        known.then(|| Found {
            ino: node.ino,
            kind: libc::S_IFDIR,
            upper: true,
            lower: st.lower.clone(),
            origin: false,
            origins: st.origins,
            upper_ino: Some(attr.ino),
            generation: None,
        })
    }

    /// Resolves `name` in the lower directories `dir` only.
    pub(super) fn resolve_lower(
        &self,
        dir: &LowerRef,
        name: &OsStr,
    ) -> Result<Option<(Attr, LowerRef)>> {
        let candidates = dir
            .layers()
            .iter()
            .map(|&l| (l, dir.path_in(l).join(name)))
            .collect();
        self.merge_lower(candidates)
    }

    /// The lower directories at `target`, for a renamed directory's redirect.
    pub(super) fn resolve_redirect(&self, target: &Path) -> Result<Option<LowerRef>> {
        let candidates = self
            .layers
            .lower_ids()
            .map(|l| (l, target.to_owned()))
            .collect();
        Ok(self
            .merge_lower(candidates)?
            .filter(|(a, _)| a.is_dir())
            .map(|(_, r)| r))
    }

    /// The object seen through `candidates` (layer, path in it), top down: the first
    /// non-directory, or the directories merged until an opaque one, a whiteout or a
    /// non-directory. A directory renamed in a lower layer (a redirect there, written by
    /// mosaicfs or kernel overlayfs when that layer was an upper one) sends the layers below it
    /// to the redirect's path.
    fn merge_lower(
        &self,
        mut candidates: Vec<(LayerId, PathBuf)>,
    ) -> Result<Option<(Attr, LowerRef)>> {
        let mut result: Option<(Attr, LowerRef)> = None;
        let mut i = 0;
        while let Some((layer, path)) = candidates.get(i).cloned() {
            i += 1;
            // Nothing lies below the last candidate (a redirect found there adds candidates,
            // and `dir_flags` follows one whatever it is told): what would hide the layers
            // below it, a `.wh.NAME` file or a `.wh..wh..opq` file, changes nothing there and
            // is not looked for. Most lookups of a name that does not exist end here.
            let below = i < candidates.len();
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                continue;
            };
            let _waiting = crate::lower_wait::enter(layer)?;
            let found = self.in_lower_dir(layer, parent, |fd| {
                let fd = LayerDir::from(fd);
                let Some(attr) = fd.stat_opt(name)? else {
                    return Ok(match below && self.layers.has_wh_file(fd, name)? {
                        true => InLayer::Hidden,
                        false => InLayer::Nothing,
                    });
                };
                if self.layers.is_whiteout(fd, name, &attr)? {
                    return Ok(InLayer::Hidden);
                }
                let flags = match attr.is_dir() {
                    true => self.layers.dir_flags(fd, Some(name), below)?,
                    false => DirFlags::default(),
                };
                Ok(InLayer::Object(attr, flags))
            });
            let (attr, flags) = match found {
                Ok(InLayer::Object(attr, flags)) => (attr, flags),
                Ok(InLayer::Hidden) => break,
                Ok(InLayer::Nothing) => continue,
                Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => continue,
                Err(e) => return Err(e),
            };
            match &mut result {
                None => {
                    let mut lower = LowerRef::new(path.clone(), layer);
                    if !attr.is_dir() {
                        if attr.is_reg() {
                            // A metadata-only file: its data lies below (metacopy.rs).
                            lower.set_data(self.lower_data(layer, &path)?);
                        }
                        return Ok(Some((attr, lower)));
                    }
                    result = Some((attr, lower));
                }
                Some((_, lower)) => {
                    if !attr.is_dir() {
                        break;
                    }
                    lower.push(layer, &path);
                }
            }
            if flags.opaque {
                break;
            }
            match flags.redirect.as_deref().and_then(Redirect::parse) {
                Some(Redirect::Absolute(target)) => {
                    candidates.truncate(i);
                    let below = self.layers.lower_ids().filter(|&l| l > layer);
                    candidates.extend(below.map(|l| (l, target.clone())));
                }
                Some(Redirect::Sibling(other)) => {
                    for (_, p) in &mut candidates[i..] {
                        p.set_file_name(&other);
                    }
                }
                None => {}
            }
        }
        Ok(result)
    }

    /// The inode number a copied-up object keeps from its origin, if it has one.
    pub(super) fn origin_ino(&self, dir: LayerDir<'_>, name: &OsStr) -> Result<Option<Ino>> {
        let Some(raw) = dir.get_xattr(Some(name), &self.layers.xattr.origin)? else {
            return Ok(None);
        };
        match origin_number(&raw) {
            Some(ino) => Ok(Some(ino)),
            None => {
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
    pub(super) fn lower_has(&self, dir: &Node, name: &OsStr) -> Result<bool> {
        let lower = dir.state().lower.clone();
        match lower {
            Some(l) => Ok(self.resolve_lower(&l, name)?.is_some()),
            None => Ok(false),
        }
    }
}

/// The inode number an origin xattr's value names; `None` for a damaged value.
pub(crate) fn origin_number(raw: &[u8]) -> Option<Ino> {
    let ino = std::str::from_utf8(raw).ok()?.parse::<u64>().ok()?;
    // Numbers from 2^63 up are second identities' (inode/mod.rs); clearing the top bit also reads
    // marks written before that rule as the number InoMap gives now.
    let ino = ino & (crate::inode::ALIAS_BASE - 1);
    (ino > 1).then_some(ino)
}

/// Where a renamed directory's lower part is, as its redirect xattr says.
pub enum Redirect {
    /// A path from the layer root (`/a/b`: mosaicfs always, kernel overlayfs for a move to
    /// another directory).
    Absolute(PathBuf),
    /// Another name in the same parent directory (kernel overlayfs, a rename within one
    /// directory).
    Sibling(std::ffi::OsString),
}

impl Redirect {
    /// `None` for a value no overlay writes (a relative path of several components, `..`):
    /// a damaged layer, read as if the directory had no redirect.
    pub fn parse(value: &[u8]) -> Option<Redirect> {
        let path = Path::new(OsStr::from_bytes(value));
        let mut plain = path.components().filter_map(|c| match c {
            std::path::Component::Normal(n) => Some(Ok(n)),
            std::path::Component::RootDir => None,
            _ => Some(Err(())),
        });
        if path.has_root() {
            let target: Option<PathBuf> = plain.map(|c| c.ok()).collect();
            return target
                .filter(|t| t.file_name().is_some())
                .map(Redirect::Absolute);
        }
        match (plain.next(), plain.next()) {
            (Some(Ok(name)), None) => Some(Redirect::Sibling(name.to_owned())),
            _ => None,
        }
    }
}

/// What one layer holds under a name (`merge_lower`).
enum InLayer {
    Nothing,
    /// A whiteout, or a `.wh.` file: hides the name in the layers below.
    Hidden,
    /// An object, with the overlay marks it has if it is a directory.
    Object(Attr, DirFlags),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &str) -> Option<String> {
        Redirect::parse(v.as_bytes()).map(|r| match r {
            Redirect::Absolute(p) => format!("abs {}", p.display()),
            Redirect::Sibling(n) => format!("sib {}", n.to_string_lossy()),
        })
    }

    #[test]
    fn redirect_values_of_every_overlay_and_damaged_ones() {
        assert_eq!(parse("/a/b").as_deref(), Some("abs a/b"));
        assert_eq!(parse("//a/./b/").as_deref(), Some("abs a/b"));
        assert_eq!(parse("d").as_deref(), Some("sib d"));
        for bad in ["", "/", "a/b", "..", "/a/../b", "./x"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
