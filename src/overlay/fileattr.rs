//! Inode flags (`lsattr`, `chattr`, `xfs_io -c chattr`: FS_IOC_GETFLAGS/SETFLAGS and
//! FS_IOC_FSGETXATTR/FSSETXATTR), and the immutable and append-only flags enforced.
//!
//! As kernel overlayfs does (fs/overlayfs/inode.c `ovl_fileattr_set`, `ovl_set_protattr`):
//! setting flags copies the object up (metadata only); immutable and append-only are kept in
//! the upper object's `overlay.protattr` xattr ("a", "i" or "ai", the kernel's format, so that
//! kernel overlayfs mounting the layers enforces them too), never on the upper inode itself,
//! where they would stop the daemon's own writes (copy-after-write fills, completion); every
//! other flag goes to the upper inode. A lower object shows its own inode's flags, and its
//! copy-up keeps its immutable and append-only flags in the xattr.
//!
//! The kernel enforces those two flags through the inode's S_IMMUTABLE and S_APPEND, which a
//! FUSE inode never has (no reply carries them), so the daemon checks every change itself, as
//! the VFS does for a local file system (`Change`):
//!
//! - open for writing or with O_TRUNC: refused on an immutable file, and on an append-only one
//!   without O_APPEND or with O_TRUNC (`may_open`); a write without O_APPEND on a handle of an
//!   append-only file (flags changed by fcntl) too — such handles never pass through;
//! - truncate, chmod, chown, times given: refused on either (`notify_change`); times set to
//!   now: refused on an immutable object;
//! - xattrs set or removed: refused on either (`xattr_permission`);
//! - fallocate: refused on an immutable file, and on an append-only one unless it keeps the
//!   size (`vfs_fallocate`);
//! - unlink, rmdir, rename of the object or over it, a hard link to it: refused on either
//!   (`may_delete`, `vfs_link`);
//! - in a directory: nothing made or moved in when it is immutable, nothing removed or moved
//!   out when it is immutable or append-only (`may_create`, `may_delete`).
//!
//! The flags of an object are read once per node, on its first change (one getxattr for an
//! upper object, one statx for a lower one) and known from the start for what the mount makes.
//!
//! Touches: the node's cached `protection`, copy-up, the upper object's flags and xattrs.
//!
//! May call (dev/callgraph.py --check keeps it so): copy_up, overlay, upper_meta.

use std::ffi::OsStr;

use crate::error::{Result, errno};
use crate::inode::{Ino, Node};
use crate::overlay::Overlay;
use crate::sys::FsXattr;
use crate::upper::LayerDir;

pub const FS_IMMUTABLE_FL: u32 = 0x10;
pub const FS_APPEND_FL: u32 = 0x20;
/// The flags kept in `overlay.protattr` and enforced by the daemon.
pub const PROTECTION: u32 = FS_IMMUTABLE_FL | FS_APPEND_FL;
const FS_XFLAG_IMMUTABLE: u32 = 0x8;
const FS_XFLAG_APPEND: u32 = 0x10;
/// DAX, which no FUSE file system but virtiofs serves: refused, not passed to the upper inode
/// where it would say something untrue of the mount.
const FS_DAX_FL: u32 = 0x0200_0000;
const FS_XFLAG_DAX: u32 = 0x8000;

/// A change that the immutable and append-only flags may forbid (the top of this file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Data written: an open for writing, or fallocate that keeps the size. `append`: only
    /// at the end (O_APPEND without O_TRUNC).
    Write { append: bool },
    /// Any other change of the object: its size, owner, mode or given times, its xattrs, a
    /// name removed or added.
    Modify,
    /// Its times set to now.
    Touch,
    /// A directory: an entry made or moved in.
    AddEntry,
    /// A directory: an entry removed or moved out.
    RemoveEntry,
}

impl Change {
    fn forbidden_by(self, protection: u32) -> bool {
        let immutable = protection & FS_IMMUTABLE_FL != 0;
        let append_only = protection & FS_APPEND_FL != 0;
        match self {
            Change::Write { append } => immutable || append_only && !append,
            Change::Modify | Change::RemoveEntry => immutable || append_only,
            Change::Touch | Change::AddEntry => immutable,
        }
    }
}

fn xflags(fsx: &FsXattr) -> u32 {
    u32::from_ne_bytes(fsx[..4].try_into().expect("4 bytes"))
}

fn set_xflags(fsx: &mut FsXattr, flags: u32) {
    fsx[..4].copy_from_slice(&flags.to_ne_bytes());
}

fn to_xflags(protection: u32) -> u32 {
    let mut x = 0;
    if protection & FS_IMMUTABLE_FL != 0 {
        x |= FS_XFLAG_IMMUTABLE;
    }
    if protection & FS_APPEND_FL != 0 {
        x |= FS_XFLAG_APPEND;
    }
    x
}

fn from_xflags(xflags: u32) -> u32 {
    let mut p = 0;
    if xflags & FS_XFLAG_IMMUTABLE != 0 {
        p |= FS_IMMUTABLE_FL;
    }
    if xflags & FS_XFLAG_APPEND != 0 {
        p |= FS_APPEND_FL;
    }
    p
}

/// The immutable and append-only flags a layer object's own inode has. statx reports them in
/// one call, but some file systems report every file immutable there (EROFS: read-only, not
/// S_IMMUTABLE, which is what kernel overlayfs copies), so a file statx calls immutable or
/// append-only is asked for its inode flags (FS_IOC_GETFLAGS), which say what chattr set.
pub(crate) fn inode_protection(dir: LayerDir<'_>, name: Option<&OsStr>) -> Result<u32> {
    let attributes = dir.attributes(name)?;
    let said = (libc::STATX_ATTR_IMMUTABLE | libc::STATX_ATTR_APPEND) as u64;
    if attributes & said == 0 {
        return Ok(0);
    }
    match dir.inode_flags(name) {
        Ok(flags) => Ok(flags & PROTECTION),
        // No inode flags to set there (EROFS, squashfs): nothing chattr could have set.
        Err(e) if e.is(libc::ENOTTY) || e.is(libc::EOPNOTSUPP) || e.is(libc::EINVAL) => Ok(0),
        Err(e) => Err(e),
    }
}

impl Overlay {
    /// EPERM when the immutable or append-only flag of `node` forbids `change`; else its
    /// flags (`protection`).
    pub(super) fn check_change(&self, node: &Node, change: Change) -> Result<u32> {
        let protection = self.protection(node)?;
        if change.forbidden_by(protection) {
            return Err(errno(libc::EPERM));
        }
        Ok(protection)
    }

    /// The immutable and append-only flags of `node`: its upper object's `overlay.protattr`,
    /// or its lower object's own. Read once per node.
    pub fn protection(&self, node: &Node) -> Result<u32> {
        let (known, upper, kind) = {
            let st = node.state();
            (st.protection(), st.upper, st.kind)
        };
        if let Some(p) = known {
            return Ok(p);
        }
        if !matches!(kind, libc::S_IFREG | libc::S_IFDIR) {
            return Ok(0);
        }
        let _waiting = self.waiting_on(node)?;
        let p = self.settled(|| {
            self.at_top_entry(node, |dir, name| match upper {
                true => self.protattr_at(dir, name),
                false => inode_protection(dir, name),
            })
        })?;
        let mut st = node.state();
        if st.protection().is_none() {
            st.set_protection(Some(p));
        }
        Ok(p)
    }

    /// `overlay.protattr` of an upper object.
    fn protattr_at(&self, dir: LayerDir<'_>, name: Option<&OsStr>) -> Result<u32> {
        let Some(value) = dir.get_xattr(name, self.layers.xattr.protattr)? else {
            return Ok(0);
        };
        let mut p = 0;
        for c in &value {
            match c {
                b'a' => p |= FS_APPEND_FL,
                b'i' => p |= FS_IMMUTABLE_FL,
                _ => {
                    log::warn!(
                        "{} of {name:?} is {:?}, which kernel overlayfs does not write either: \
                         only 'a' (append-only) and 'i' (immutable) are read; set the flags \
                         again with chattr to rewrite it",
                        self.layers.xattr.protattr,
                        String::from_utf8_lossy(&value)
                    );
                    break;
                }
            }
        }
        Ok(p)
    }

    fn flagged_node(&self, ino: Ino) -> Result<std::sync::Arc<Node>> {
        let node = self.node(ino)?;
        // Only regular files and directories can be opened for the ioctl (the kernel answers
        // ENOTTY for the others).
        if !matches!(node.kind(), libc::S_IFREG | libc::S_IFDIR) {
            return Err(errno(libc::ENOTTY));
        }
        Ok(node)
    }

    /// FS_IOC_GETFLAGS: the flags of the layer object, with its immutable and append-only
    /// flags from `overlay.protattr` for an upper one.
    pub fn inode_flags(&self, ino: Ino) -> Result<u32> {
        let node = self.flagged_node(ino)?;
        let _waiting = self.waiting_on(&node)?;
        let real = self.settled(|| self.at_top_entry(&node, |dir, name| dir.inode_flags(name)))?;
        if !node.state().upper {
            return Ok(real);
        }
        Ok(real & !PROTECTION | self.protection(&node)?)
    }

    /// FS_IOC_SETFLAGS. The kernel has checked ownership and CAP_LINUX_IMMUTABLE
    /// (`vfs_fileattr_set`).
    pub fn set_inode_flags(&self, ino: Ino, flags: u32) -> Result<()> {
        let node = self.flagged_node(ino)?;
        // What changes of the flags shown is applied to the upper inode's own: a copy-up may
        // land on another kind of file system, whose inode has flags of its own (ext4's
        // extents flag, for one) that the lower object showed otherwise.
        let changed = (flags ^ self.inode_flags(ino)?) & !PROTECTION;
        if changed & FS_DAX_FL != 0 {
            return Err(errno(libc::EOPNOTSUPP));
        }
        self.set_flags(&node, flags & PROTECTION, |dir, name| {
            if changed != 0 {
                let real = dir.inode_flags(name)?;
                dir.set_inode_flags(name, real ^ changed)?;
            }
            Ok(())
        })
    }

    /// FS_IOC_FSGETXATTR: as `inode_flags`, in `struct fsxattr`.
    pub fn fs_xattr(&self, ino: Ino) -> Result<FsXattr> {
        let node = self.flagged_node(ino)?;
        let _waiting = self.waiting_on(&node)?;
        let mut fsx = self.settled(|| self.at_top_entry(&node, |dir, name| dir.fs_xattr(name)))?;
        if node.state().upper {
            let protected = to_xflags(PROTECTION);
            let x = xflags(&fsx) & !protected | to_xflags(self.protection(&node)?);
            set_xflags(&mut fsx, x);
        }
        Ok(fsx)
    }

    /// FS_IOC_FSSETXATTR: as `set_inode_flags`; the extent size hints and project id given
    /// go to the upper inode.
    pub fn set_fs_xattr(&self, ino: Ino, fsx: &FsXattr) -> Result<()> {
        let node = self.flagged_node(ino)?;
        let old = self.fs_xattr(ino)?;
        let changed = (xflags(fsx) ^ xflags(&old)) & !to_xflags(PROTECTION);
        if changed & FS_XFLAG_DAX != 0 {
            return Err(errno(libc::EOPNOTSUPP));
        }
        // extsize (4..8), projid (12..16) and cowextsize (16..20); nextents is read-only.
        let hints = |f: &FsXattr| (f[4..8].to_vec(), f[12..20].to_vec());
        let hints_changed = hints(fsx) != hints(&old);
        self.set_flags(&node, from_xflags(xflags(fsx)), |dir, name| {
            if changed != 0 || hints_changed {
                let mut real = dir.fs_xattr(name)?;
                let x = xflags(&real) ^ changed;
                set_xflags(&mut real, x);
                real[4..8].copy_from_slice(&fsx[4..8]);
                real[12..20].copy_from_slice(&fsx[12..20]);
                dir.set_fs_xattr(name, &real)?;
            }
            Ok(())
        })
    }

    /// Copies `node` up and sets its flags: `protection` in the xattr, the rest by `set_real`
    /// on the upper inode.
    fn set_flags(
        &self,
        node: &Node,
        protection: u32,
        set_real: impl Fn(LayerDir<'_>, Option<&OsStr>) -> Result<()>,
    ) -> Result<()> {
        self.check_writable()?;
        self.copy_up(node)?;
        self.settled(|| {
            let (dir, name) = self.upper_target(node)?;
            set_real(dir.view(), name.as_deref())?;
            self.store_protection(&dir, name.as_deref(), protection)
        })?;
        node.state().set_protection(Some(protection));
        // The change moved the object's ctime, which no reply to an ioctl carries.
        self.attrs_changed_behind(node.ino);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immutable_forbids_every_change_and_append_only_all_but_appending_and_adding() {
        let all = [
            Change::Write { append: false },
            Change::Write { append: true },
            Change::Modify,
            Change::Touch,
            Change::AddEntry,
            Change::RemoveEntry,
        ];
        assert!(all.iter().all(|c| c.forbidden_by(FS_IMMUTABLE_FL)));
        assert!(all.iter().all(|c| !c.forbidden_by(0)));
        let allowed: Vec<_> = all
            .iter()
            .filter(|c| !c.forbidden_by(FS_APPEND_FL))
            .collect();
        assert_eq!(
            allowed,
            [
                &Change::Write { append: true },
                &Change::Touch,
                &Change::AddEntry
            ]
        );
    }

    #[test]
    fn xflags_carry_the_same_protection() {
        for p in [0, FS_IMMUTABLE_FL, FS_APPEND_FL, PROTECTION] {
            assert_eq!(from_xflags(to_xflags(p)), p);
        }
    }
}
