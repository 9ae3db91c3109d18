//! Attributes and extended attributes: getattr, setattr, readlink, the xattr calls.
//!
//! Changing anything about a lower object copies it up first — metadata only: a regular file
//! becomes a partial file without a single data block (chown -R of a tree of large files writes
//! no data). mosaicfs' and the overlays' own xattrs are hidden from the merged view; those of an
//! overlay nested on top are kept escaped (`layers::stored_xattr_name`).
//!
//! May call (dev/callgraph.py --check keeps it so): copy_up, fileattr, io, overlay, upper_meta.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use crate::error::{Result, errno};
use crate::inode::{Ino, Node};
use crate::layers::{UPPER, merged_xattr_name, stored_xattr_name};
use crate::overlay::Overlay;
use crate::overlay::fileattr::Change;
use crate::stat_override::OverrideStat;
use crate::sys::{Attr, Time};

/// What a setattr asks to change.
#[derive(Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Time>,
    pub mtime: Option<Time>,
    /// The change time the kernel gives with new times under the writeback cache, where it
    /// keeps the times itself and sends them as values: a time equal to it is "now" (a touch,
    /// or the time of the writes it sends back), not a time the caller chose.
    pub ctime: Option<Time>,
    /// Times only, with a file handle: the kernel writing back the times of writes it let
    /// through under the writeback cache (at close or fsync), not a caller's utimes. Those
    /// writes were allowed when they were made, so the times pass an append-only file's check.
    pub written: bool,
}

impl Overlay {
    pub fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.getattr_of(&*self.node(ino)?)
    }

    /// The birth time of `node`'s object where it lives now (statx; as kernel overlayfs shows
    /// the real file's: a copied-up file's is its copy-up's), when its file system has one.
    /// Not asked of a lower layer on a shared store: every statx(STATX_ALL) (Rust's metadata
    /// is one) would then wait on the store, where a stat is answered from the kept
    /// attributes (tests/stores.rs: a stopped GlusterFS brick held such a call 80 s).
    pub fn birth_time_of(&self, node: &Node) -> Result<Option<(i64, u32)>> {
        let on_store = {
            let st = node.state();
            !st.upper
                && st
                    .lower
                    .as_ref()
                    .is_some_and(|l| self.layers.layer(l.top()).on_store)
        };
        if on_store {
            return Ok(None);
        }
        let _waiting = self.waiting_on(node)?;
        self.at_top_entry(node, |dir, name| dir.birth_time(name))
    }

    /// Changes attributes for `caller`. A size change by an unprivileged caller clears set-id
    /// bits and capabilities (the kernel leaves that to us under FUSE_HANDLE_KILLPRIV_V2; fuser
    /// does not pass its flag, so the caller's uid stands in for CAP_FSETID).
    pub fn setattr(&self, ino: Ino, set: SetAttr, caller: &crate::overlay::Caller) -> Result<Attr> {
        self.check_writable()?;
        let node: Arc<Node> = self.node(ino)?;
        // Immutable and append-only objects (fileattr.rs): times set to now are a touch.
        let now_only = |t: &Option<Time>| {
            matches!(t, None | Some(Time::Now)) || set.ctime.is_some() && *t == set.ctime
        };
        let touch = now_only(&set.atime) && now_only(&set.mtime);
        let any_time = set.atime.is_some() || set.mtime.is_some();
        if set.size.is_some() || set.mode.is_some() || set.uid.is_some() || set.gid.is_some() {
            self.check_change(&node, Change::Modify)?;
        } else if any_time && !set.written {
            let change = if touch { Change::Touch } else { Change::Modify };
            self.check_change(&node, change)?;
        }
        if let Some(size) = set.size {
            match node.kind() {
                libc::S_IFDIR => return Err(errno(libc::EISDIR)),
                libc::S_IFREG => {
                    let file = self.truncate(&node, size)?;
                    if caller.uid != 0 && set.mode.is_none() {
                        self.kill_privs(&node, &file, caller)?;
                    }
                }
                _ => return Err(errno(libc::EINVAL)),
            }
        }
        if set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
        {
            self.copy_up(&node)?;
            self.settled(|| self.set_upper_attr(&node, &set))?;
        }
        self.getattr(ino)
    }

    /// Sets owner, mode and times of `node`'s upper object.
    fn set_upper_attr(&self, node: &Node, set: &SetAttr) -> Result<()> {
        let (dir, name) = self.upper_target(node)?;
        let (dir, name) = (&dir, name.as_deref());
        if self.upper_overrides() && (set.uid.is_some() || set.gid.is_some() || set.mode.is_some())
        {
            // Owner and mode live in the xattr: the inode stays the daemon's.
            let real = dir.view().stat(name)?;
            let mut v = self
                .override_at(UPPER, dir.view(), name)
                .unwrap_or_else(|| OverrideStat::of(&real));
            if let Some(uid) = set.uid {
                v.uid = self.config.uid_map.to_outside(uid);
            }
            if let Some(gid) = set.gid {
                v.gid = self.config.gid_map.to_outside(gid);
            }
            if let Some(mode) = set.mode {
                v.mode = mode & 0o7777;
            }
            self.set_override(dir, name, &v, real.file_type())?;
        } else if set.uid.is_some() || set.gid.is_some() {
            let uid = set.uid.map(|u| self.config.uid_map.to_outside(u));
            let gid = set.gid.map(|g| self.config.gid_map.to_outside(g));
            dir.chown(name, uid, gid)?;
        }
        if let Some(mode) = set.mode
            && node.kind() != libc::S_IFLNK
            && !self.upper_overrides()
        {
            dir.chmod(name, mode)?;
        }
        if set.atime.is_some() || set.mtime.is_some() {
            let (atime, mtime) = (
                set.atime.unwrap_or(Time::Omit),
                set.mtime.unwrap_or(Time::Omit),
            );
            dir.utimens(name, atime, mtime)?;
        }
        Ok(())
    }

    pub fn readlink(&self, ino: Ino) -> Result<OsString> {
        let node = self.node(ino)?;
        let _waiting = self.waiting_on(&node)?;
        self.settled(|| self.at_top_entry(&node, |dir, name| dir.read_link(name)))
    }

    fn check_xattr_name(&self, name: &OsStr) -> Result<()> {
        if !self.config.xattrs {
            return Err(errno(libc::EOPNOTSUPP));
        }
        if !self.config.acl && name.as_bytes().starts_with(b"system.posix_acl_") {
            return Err(errno(libc::EOPNOTSUPP));
        }
        Ok(())
    }

    /// The name an xattr of the merged view is kept under on the layers, or `None` when the
    /// merged view may not have it.
    fn stored_name<'a>(&self, merged: &'a OsStr) -> Option<std::borrow::Cow<'a, [u8]>> {
        let perms = self.config.xattr_permissions;
        match stored_xattr_name(merged.as_bytes()) {
            std::borrow::Cow::Borrowed(b) => perms.stored_name(b),
            std::borrow::Cow::Owned(v) => perms.stored_name(&v).map(|c| c.into_owned().into()),
        }
    }

    pub fn getxattr(&self, ino: Ino, name: &OsStr) -> Result<Vec<u8>> {
        self.check_xattr_name(name)?;
        let stored = self.stored_name(name).ok_or_else(|| errno(libc::ENODATA))?;
        let name = OsStr::from_bytes(&stored);
        let node = self.node(ino)?;
        let _waiting = self.waiting_on(&node)?;
        self.settled(|| self.at_top_entry(&node, |dir, file| dir.get_xattr_raw(file, name)))
            .map_err(|e| {
                // A layer that cannot hold this kind of xattr (squashfs and ACLs) has none of
                // it: the merged view can. The kernel asks for the ACL at permission checks,
                // and EOPNOTSUPP there fails the open.
                if e.is(libc::EOPNOTSUPP) {
                    errno(libc::ENODATA)
                } else {
                    e
                }
            })
    }

    pub fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        if !self.config.xattrs {
            return Ok(Vec::new());
        }
        let node = self.node(ino)?;
        let _waiting = self.waiting_on(&node)?;
        let names = self.settled(|| self.at_top_entry(&node, |dir, file| dir.list_xattr(file)))?;
        let mut out = Vec::new();
        let perms = self.config.xattr_permissions;
        for n in names {
            let Some(n) = perms.merged_name(n.as_bytes()) else {
                continue;
            };
            let Some(b) = merged_xattr_name(&n) else {
                continue;
            };
            if !self.config.acl && b.starts_with(b"system.posix_acl_") {
                continue;
            }
            out.extend_from_slice(&b);
            out.push(0);
        }
        Ok(out)
    }

    /// Sets an xattr. `kill_sgid`: the caller, setting an access ACL, is neither in the
    /// object's group nor holds CAP_FSETID, so the set-group-ID bit goes, as the kernel's
    /// `posix_acl_update_mode` does for a local file system (the daemon's own credentials
    /// would keep it).
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        kill_sgid: bool,
    ) -> Result<()> {
        self.check_xattr_name(name)?;
        self.check_writable()?;
        let stored = self.stored_name(name).ok_or_else(|| errno(libc::EPERM))?;
        let stored = OsStr::from_bytes(&stored);
        let node = self.node(ino)?;
        self.check_change(&node, Change::Modify)?;
        self.copy_up(&node)?;
        self.settled(|| {
            let (dir, file) = self.upper_target(&node)?;
            dir.set_xattr(file.as_deref(), stored, value, flags)
        })?;
        if kill_sgid && name == crate::acl::ACCESS {
            let mode = self.getattr(ino)?.mode;
            if mode & libc::S_ISGID != 0 {
                let set = SetAttr {
                    mode: Some(mode & 0o7777 & !libc::S_ISGID),
                    ..Default::default()
                };
                self.setattr(ino, set, &crate::overlay::Caller::root())?;
            }
        }
        Ok(())
    }

    pub fn removexattr(&self, ino: Ino, name: &OsStr) -> Result<()> {
        self.check_xattr_name(name)?;
        self.check_writable()?;
        let node = self.node(ino)?;
        // Removing an xattr the file does not have must not copy it up.
        self.getxattr(ino, name)?;
        let stored = self.stored_name(name).ok_or_else(|| errno(libc::EPERM))?;
        let name = OsStr::from_bytes(&stored);
        self.check_change(&node, Change::Modify)?;
        self.copy_up(&node)?;
        self.settled(|| {
            let (dir, file) = self.upper_target(&node)?;
            dir.remove_xattr(file.as_deref(), name)
        })
    }
}
