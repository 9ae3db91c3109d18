//! Attributes and xattrs of memory upper nodes: chown, chmod, utimens and the xattr calls, with
//! the limits and flags of the kernel's xattr interface.

use std::ffi::{OsStr, OsString};

use super::{MemoryUpper, Meta, Node, XATTR_NAME_MAX, XATTR_SIZE_MAX, acl, now};
use crate::error::{Result, errno};
use crate::sys::Time;

impl MemoryUpper {
    /// chown; `None` leaves that id. Clears set-user-ID and (for group-executable files)
    /// set-group-ID bits of a non-directory, as a local file system does.
    pub fn set_owner(&self, node: &Node, uid: Option<u32>, gid: Option<u32>) {
        let _ = self.change_meta(node, |m| {
            set_owner(m, uid, gid);
            Ok(())
        });
    }

    /// Runs `change` on `node`'s attributes; when it succeeds, logs them as they are then,
    /// still under their lock (changes.rs).
    fn change_meta(&self, node: &Node, change: impl FnOnce(&mut Meta) -> Result<()>) -> Result<()> {
        self.keep_log_short();
        let _q = self.quiesce.read();
        node.changed();
        let mut m = node.meta.lock().unwrap();
        change(&mut m)?;
        let mut txn = self.txn();
        txn.meta(node, &m);
        self.log(&txn);
        Ok(())
    }

    /// chmod: the permission bits of `mode`; the type stays, and an access ACL follows the
    /// new bits (posix_acl_chmod).
    pub fn set_mode(&self, node: &Node, mode: u32) {
        let _ = self.change_meta(node, |m| {
            m.mode = (m.mode & libc::S_IFMT) | (mode & 0o7777);
            m.ctime = now();
            let name = OsStr::new(acl::ACCESS);
            if let Some(v) = m.xattrs.get(name).and_then(|v| acl::chmod(v, mode).ok()) {
                m.xattrs.insert(name.to_owned(), v);
            }
            Ok(())
        });
    }

    pub fn set_times(&self, node: &Node, atime: Time, mtime: Time) {
        let t = now();
        let _ = self.change_meta(node, |m| {
            let pick = |time: Time, old: (i64, u32)| match time {
                Time::Now => t,
                Time::Omit => old,
                Time::At(s, n) => (s, n),
            };
            m.atime = pick(atime, m.atime);
            m.mtime = pick(mtime, m.mtime);
            m.ctime = t;
            Ok(())
        });
    }

    pub fn get_xattr(&self, node: &Node, name: &OsStr) -> Option<Vec<u8>> {
        node.meta.lock().unwrap().xattrs.get(name).cloned()
    }

    pub fn list_xattr(&self, node: &Node) -> Vec<OsString> {
        node.meta.lock().unwrap().xattrs.keys().cloned().collect()
    }

    /// setxattr with XATTR_CREATE / XATTR_REPLACE in `flags`.
    pub fn set_xattr(&self, node: &Node, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(errno(libc::ERANGE));
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(errno(libc::E2BIG));
        }
        self.change_meta(node, |m| set_xattr(m, name, value, flags))
    }

    pub fn remove_xattr(&self, node: &Node, name: &OsStr) -> Result<()> {
        self.change_meta(node, |m| {
            m.xattrs.remove(name).ok_or_else(|| errno(libc::ENODATA))?;
            m.ctime = now();
            Ok(())
        })
    }
}

/// chown's change of `m`.
fn set_owner(m: &mut Meta, uid: Option<u32>, gid: Option<u32>) {
    if let Some(u) = uid {
        m.uid = u;
    }
    if let Some(g) = gid {
        m.gid = g;
    }
    if m.mode & libc::S_IFMT != libc::S_IFDIR && m.mode & libc::S_IFMT != libc::S_IFLNK {
        m.mode &= !libc::S_ISUID;
        if m.mode & libc::S_IXGRP != 0 {
            m.mode &= !libc::S_ISGID;
        }
    }
    m.ctime = now();
}

/// setxattr's change of `m`.
fn set_xattr(m: &mut Meta, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
    let present = m.xattrs.contains_key(name);
    if flags & libc::XATTR_CREATE != 0 && present {
        return Err(errno(libc::EEXIST));
    }
    if flags & libc::XATTR_REPLACE != 0 && !present {
        return Err(errno(libc::ENODATA));
    }
    m.ctime = now();
    if name == acl::ACCESS {
        // The mode follows the ACL, as on ext4: the kernel checks an ACL only where the
        // mode's group bits are set.
        let (mode, kept) = acl::set_access(value, m.mode)?;
        m.mode = mode;
        match kept {
            Some(v) => m.xattrs.insert(name.to_owned(), v),
            None => m.xattrs.remove(name),
        };
        return Ok(());
    }
    if name == acl::DEFAULT && m.mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(errno(libc::EACCES));
    }
    m.xattrs.insert(name.to_owned(), value.to_vec());
    Ok(())
}
