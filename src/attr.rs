//! Attributes and extended attributes: getattr, setattr, readlink, the xattr calls.
//!
//! Changing anything about a lower object copies it up first — metadata only: a regular file
//! becomes a partial file without a single data block (chown -R of a tree of large files writes
//! no data). mosaicfs' and the overlays' own xattrs are hidden from the merged view; those of an
//! overlay nested on top are kept escaped (`layers::stored_xattr_name`).

use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use crate::error::{Result, errno};
use crate::inode::{Ino, Node};
use crate::layers::{merged_xattr_name, stored_xattr_name};
use crate::overlay::Overlay;
use crate::sys::{self, Attr, Time};

/// What a setattr asks to change.
#[derive(Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Time>,
    pub mtime: Option<Time>,
}

impl Overlay {
    pub fn getattr(&self, ino: Ino) -> Result<Attr> {
        let node = self.node(ino)?;
        let attr = self.settled(|| self.stat_layer(&node))?;
        Ok(self.present(&node, attr))
    }

    /// Changes attributes for `caller`. A size change by an unprivileged caller clears set-id
    /// bits and capabilities (the kernel leaves that to us under FUSE_HANDLE_KILLPRIV_V2; fuser
    /// does not pass its flag, so the caller's uid stands in for CAP_FSETID).
    pub fn setattr(&self, ino: Ino, set: SetAttr, caller: &crate::overlay::Caller) -> Result<Attr> {
        self.check_writable()?;
        let node: Arc<Node> = self.node(ino)?;
        if let Some(size) = set.size {
            match node.kind() {
                libc::S_IFDIR => return Err(errno(libc::EISDIR)),
                libc::S_IFREG => {
                    let file = self.truncate(&node, size)?;
                    if caller.uid != 0 && set.mode.is_none() {
                        self.kill_privs(&node, &file)?;
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
        let (dir, name) = (dir.as_fd(), name.as_deref());
        if set.uid.is_some() || set.gid.is_some() {
            let uid = set.uid.map(|u| self.config.uid_map.to_outside(u));
            let gid = set.gid.map(|g| self.config.gid_map.to_outside(g));
            sys::chown_at(dir, name, uid, gid)?;
        }
        if let Some(mode) = set.mode
            && node.kind() != libc::S_IFLNK
        {
            sys::chmod_at(dir, name, mode)?;
        }
        if set.atime.is_some() || set.mtime.is_some() {
            let (atime, mtime) = (
                set.atime.unwrap_or(Time::Omit),
                set.mtime.unwrap_or(Time::Omit),
            );
            sys::utimens_at(dir, name, atime, mtime)?;
        }
        Ok(())
    }

    pub fn readlink(&self, ino: Ino) -> Result<OsString> {
        let node = self.node(ino)?;
        self.settled(|| {
            let (dir, name) = self.top_entry(&node)?;
            sys::read_link_at(dir.as_fd(), name.as_deref().unwrap_or(OsStr::new(".")))
        })
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

    pub fn getxattr(&self, ino: Ino, name: &OsStr) -> Result<Vec<u8>> {
        self.check_xattr_name(name)?;
        let stored = stored_xattr_name(name.as_bytes());
        let name = OsStr::from_bytes(&stored);
        let node = self.node(ino)?;
        self.settled(|| {
            let (dir, file) = self.top_entry(&node)?;
            sys::get_xattr_raw(dir.as_fd(), file.as_deref(), name)
        })
    }

    pub fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        if !self.config.xattrs {
            return Ok(Vec::new());
        }
        let node = self.node(ino)?;
        let names = self.settled(|| {
            let (dir, file) = self.top_entry(&node)?;
            sys::list_xattr(dir.as_fd(), file.as_deref())
        })?;
        let mut out = Vec::new();
        for n in names {
            let Some(b) = merged_xattr_name(n.as_bytes()) else {
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

    pub fn setxattr(&self, ino: Ino, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
        self.check_xattr_name(name)?;
        self.check_writable()?;
        let stored = stored_xattr_name(name.as_bytes());
        let name = OsStr::from_bytes(&stored);
        let node = self.node(ino)?;
        self.copy_up(&node)?;
        self.settled(|| {
            let (dir, file) = self.upper_target(&node)?;
            sys::set_xattr(dir.as_fd(), file.as_deref(), name, value, flags)
        })
    }

    pub fn removexattr(&self, ino: Ino, name: &OsStr) -> Result<()> {
        self.check_xattr_name(name)?;
        self.check_writable()?;
        let node = self.node(ino)?;
        // Removing an xattr the file does not have must not copy it up.
        self.getxattr(ino, name)?;
        let stored = stored_xattr_name(name.as_bytes());
        let name = OsStr::from_bytes(&stored);
        self.copy_up(&node)?;
        self.settled(|| {
            let (dir, file) = self.upper_target(&node)?;
            sys::remove_xattr(dir.as_fd(), file.as_deref(), name)
        })
    }
}
