//! Metadata mosaicfs keeps on upper objects beside what their inodes hold: owners and modes
//! kept in an xattr (`xattr_permissions=`, stat_override.rs) and the immutable and append-only
//! flags of `overlay.protattr` (fileattr.rs); and the attributes the merged view presents
//! (`present`, `getattr_of`), which apply them. Requests and copy-up write or read them, so
//! they sit below copy-up: nothing here calls a request or copy-up.
//!
//! May call (dev/callgraph.py --check keeps it so): metacopy, overlay.

use std::ffi::OsStr;

use crate::error::{Result, errno};
use crate::inode::Node;
use crate::layers::{LayerId, UPPER};
use crate::overlay::Overlay;
use crate::overlay::fileattr::{FS_APPEND_FL, FS_IMMUTABLE_FL};
use crate::stat_override::OverrideStat;
use crate::sys::Attr;
use crate::upper::{LayerDir, UpperDir};

impl Overlay {
    /// The merged view's attributes of `node`: its own inode number, overlay nlink rules, the
    /// id mapping and squashing options.
    pub fn present(&self, node: &Node, mut a: Attr) -> Attr {
        a.ino = node.st_ino();
        let (unlinked, merged_dir, lower_names_gone, unjoined, data) = {
            let st = node.state();
            let layers = st.upper as usize + st.lower.as_ref().map_or(0, |l| l.layers().len());
            let gone = if st.upper {
                0
            } else {
                st.rare().lower_names_gone
            };
            let unjoined = if st.upper {
                st.rare().lower_names_unjoined
            } else {
                0
            };
            let data = st.lower.as_ref().and_then(|l| l.data().cloned());
            let data = data.filter(|_| !st.upper);
            (
                st.unlinked,
                st.kind == libc::S_IFDIR && layers > 1,
                gone,
                unjoined,
                data,
            )
        };
        if let Some(data) = data {
            // A metadata-only file occupies what its data file does (as kernel overlayfs
            // shows it: `du` counts the data).
            if let Ok(d) = self.lower_data_attr(&data) {
                a.blocks = d.blocks;
            }
        }
        if unlinked {
            a.nlink = 0;
        } else if lower_names_gone > 0 && !a.is_dir() {
            a.nlink = a.nlink.saturating_sub(lower_names_gone).max(1);
        } else if unjoined > 0 && !a.is_dir() {
            a.nlink += unjoined;
        } else if a.is_dir() && self.config.static_nlink {
            a.nlink = 1;
        } else if a.is_dir() && merged_dir {
            // One layer's count misses the others' subdirectories: count the merged view (as
            // fuse-overlayfs does; kernel overlayfs says 1). `find` relies on it being exact.
            a.nlink = match self.merged_subdirs(node) {
                Ok(n) => n + 2,
                Err(e) => {
                    // A directory removed meanwhile has no count to give; anything else is odd.
                    if !node.state().unlinked {
                        log::warn!("counting subdirectories of inode {}: {e}", node.ino);
                    }
                    1
                }
            };
        }
        if let Some(v) = self.node_override(node) {
            v.apply(&mut a);
        }
        // Owners of an idmapped lower layer are already in the mount's id space.
        let idmapped = self.lower_only_layer(node).is_some_and(|l| l.idmapped);
        let (uid, gid) = if idmapped {
            (a.uid, a.gid)
        } else {
            (
                self.config.uid_map.to_inside(a.uid),
                self.config.gid_map.to_inside(a.gid),
            )
        };
        a.uid = self.config.squash_uid.unwrap_or(uid);
        a.gid = self.config.squash_gid.unwrap_or(gid);

        a
    }

    pub fn getattr_of(&self, node: &Node) -> Result<Attr> {
        let attr = self.settled(|| self.stat_layer(node))?;
        Ok(self.present(node, attr))
    }

    /// Whether owners and modes of upper objects are kept in an xattr (`xattr_permissions=`).
    pub(super) fn upper_overrides(&self) -> bool {
        self.layers.has_upper && self.layers.layer(UPPER).stat_override.is_some()
    }

    /// The owner and mode kept in an xattr for the object `name` in `dir` (`dir` itself for
    /// `None`) of `layer`, when the layer keeps them so and the object has a value.
    pub(super) fn override_at(
        &self,
        layer: LayerId,
        dir: LayerDir<'_>,
        name: Option<&OsStr>,
    ) -> Option<OverrideStat> {
        let key = self.layers.layer(layer).stat_override?;
        // ENODATA: no value (yet); symlinks and devices cannot hold user.* xattrs at all.
        let raw = dir.get_xattr_raw(name, OsStr::new(key)).ok()?;
        match OverrideStat::parse(&raw) {
            Ok(v) => Some(v),
            Err(e) => {
                log::warn!(
                    "{key} of {:?} in {} is damaged ({e}): showing the inode's own owner and \
                     mode; chown and chmod it through the mount to set a good value",
                    name.unwrap_or(OsStr::new(".")),
                    self.layers.layer(layer).path.display()
                );
                None
            }
        }
    }

    /// `override_at` for the object behind `node`.
    pub(super) fn node_override(&self, node: &Node) -> Option<OverrideStat> {
        if !self.layers.any_override {
            return None;
        }
        let layer = {
            let st = node.state();
            if st.upper {
                UPPER
            } else {
                st.lower.as_ref()?.top()
            }
        };
        self.layers.layer(layer).stat_override?;
        self.at_top_entry(node, |dir, name| Ok(self.override_at(layer, dir, name)))
            .ok()
            .flatten()
    }

    /// Keeps owner and mode `v` of the upper object `name` in `dir` (of type `kind`) in the
    /// upper layer's xattr.
    pub(super) fn set_override(
        &self,
        dir: &UpperDir,
        name: Option<&OsStr>,
        v: &OverrideStat,
        kind: u32,
    ) -> Result<()> {
        let key = self
            .layers
            .layer(UPPER)
            .stat_override
            .ok_or_else(|| errno(libc::EIO))?;
        match dir.set_xattr(name, OsStr::new(key), v.encode(kind).as_bytes(), 0) {
            // user.* xattrs cannot sit on symlinks and special files: those keep owner and mode
            // on the inode (a daemon that may not chown gets EPERM, as it would without this).
            Err(e) if e.is(libc::EPERM) && !matches!(kind, libc::S_IFREG | libc::S_IFDIR) => {
                let real = dir.view().stat(name)?;
                if (real.uid, real.gid) != (v.uid, v.gid) {
                    dir.chown(name, Some(v.uid), Some(v.gid))?;
                }
                if kind != libc::S_IFLNK {
                    dir.chmod(name, kind | v.mode)?;
                }
                Ok(())
            }
            r => r,
        }
    }

    /// Gives the new upper object `name` in `dir` (`dir` itself for `None`) its owner and mode
    /// in the upper layer's xattr: the caller, with the group of a setgid parent (`parent`, the
    /// parent's upper directory), and the mode it was made with. The inode stays the daemon's,
    /// which must keep reaching it whatever mode the creator asked for.
    pub(super) fn own_new_in_xattr(
        &self,
        dir: &UpperDir,
        name: Option<&OsStr>,
        caller: &crate::overlay::Caller,
        parent: &UpperDir,
    ) -> Result<()> {
        let real = dir.view().stat(name)?;
        let shown_parent = match self.override_at(UPPER, parent.view(), None) {
            Some(v) => v,
            None => OverrideStat::of(&parent.view().stat(None)?),
        };
        let setgid = shown_parent.mode & libc::S_ISGID != 0;
        let mut v = OverrideStat::of(&real);
        v.uid = self.config.uid_map.to_outside(caller.uid);
        v.gid = if setgid {
            shown_parent.gid
        } else {
            self.config.gid_map.to_outside(caller.gid)
        };
        if real.is_dir() && setgid {
            v.mode |= libc::S_ISGID;
        }
        self.set_override(dir, name, &v, real.file_type())?;
        self.keep_reachable(dir, name, &real)
    }

    /// Makes sure the daemon, which owns an inode whose owner and mode live in an xattr, can
    /// read and write it (and search a directory) whatever mode the merged view shows.
    pub(super) fn keep_reachable(
        &self,
        dir: &UpperDir,
        name: Option<&OsStr>,
        real: &Attr,
    ) -> Result<()> {
        let need = match real.file_type() {
            libc::S_IFDIR => 0o700,
            libc::S_IFREG => 0o600,
            _ => return Ok(()),
        };
        if real.mode & need != need {
            dir.chmod(name, (real.mode | need) & 0o7777)?;
        }
        Ok(())
    }

    /// Keeps `protection` in the upper object's `overlay.protattr` (removes it for none).
    pub(crate) fn store_protection(
        &self,
        dir: &UpperDir,
        name: Option<&OsStr>,
        protection: u32,
    ) -> Result<()> {
        let key = OsStr::new(self.layers.xattr.protattr);
        let mut value = Vec::new();
        if protection & FS_APPEND_FL != 0 {
            value.push(b'a');
        }
        if protection & FS_IMMUTABLE_FL != 0 {
            value.push(b'i');
        }
        if value.is_empty() {
            return match dir.remove_xattr(name, key) {
                Err(e) if e.is(libc::ENODATA) => Ok(()),
                r => r,
            };
        }
        dir.set_xattr(name, key, &value, 0)
    }
}
