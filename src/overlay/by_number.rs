//! Finding an object by its number: what a file handle needs once the kernel has forgotten
//! the inode (`open_by_handle_at` after `drop_caches` or a remount, an NFS server's handles).
//!
//! A FUSE file handle is the node id and generation the kernel had; decoding one whose inode
//! the kernel no longer holds sends LOOKUP of "." in that node id, and reconnecting a
//! directory sends LOOKUP of ".." (fs/fuse/inode.c `fuse_get_dentry`, `fuse_get_parent`).
//! Node ids are the objects' merged inode numbers, stable across remounts (inode/mod.rs), so the
//! daemon answers by finding the object with that number:
//!
//! 1. in the node table, where the kernel or a handle found earlier keeps it;
//! 2. by where it was last seen (`inode::Seen`): forgetting a node records its parent and
//!    name, and each step down from the nearest held ancestor is an ordinary lookup whose
//!    result must carry the number asked for;
//! 3. by a scan of the merged tree (`scan_for`), which records every name it passes, so that
//!    other handles of the same directories are found by step 2. After a remount this is how
//!    the first handle is found.
//!
//! A node found this way keeps a reference on its parent until the kernel forgets it
//! (`InodeTable::hold_parent`): the kernel holds the node without its parent (a disconnected
//! dentry), and paths are built from the parent chain.
//!
//! ESTALE answers a number that names nothing now. After a whole scan found a number nowhere
//! (and no record was dropped since) later handles of it are answered at once. Generations
//! tell a removed object from a new one made under its number; an object numbered by its
//! upper inode takes its generation from its birth time, the same in every mount
//! (docs/KERNEL-NOTES.md "File handles").
//!
//! Touches: the node table (counted references), lookups (namei.rs), listings (readdir.rs).
//!
//! May call (dev/callgraph.py --check keeps it so): namei, overlay, readdir, upper_meta.

use std::ffi::OsStr;
use std::sync::Arc;

use crate::error::{Result, errno};
use crate::handles::DirEntry;
use crate::inode::{ALIAS_BASE, Ino, Node, ROOT_INO, Seen};
use crate::overlay::Overlay;
use crate::sys::Attr;

impl Overlay {
    /// LOOKUP: `name` in `parent` (namei.rs), with one kernel reference counted. "." and ".."
    /// come only from the kernel decoding a file handle: the object by its number, or its
    /// parent.
    pub fn lookup(&self, parent: Ino, name: &OsStr) -> Result<(Arc<Node>, Attr)> {
        if name == "." {
            return self.lookup_by_number(parent);
        }
        if name == ".." {
            return self.lookup_parent(parent);
        }
        self.lookup_name(parent, name)
    }

    /// LOOKUP of "." in `ino`: the object numbered `ino`, with one kernel reference counted.
    pub fn lookup_by_number(&self, ino: Ino) -> Result<(Arc<Node>, Attr)> {
        let node = match self.revive(ino)? {
            Some(node) => node,
            // Second identities (inode/mod.rs `retire`) live only while the kernel holds them.
            None if ino >= ALIAS_BASE || self.inodes.surely_gone(ino) => {
                return Err(errno(libc::ESTALE));
            }
            None => {
                let _one = self.scanning.lock().unwrap_or_else(|e| e.into_inner());
                // A scan that ran while this one waited may have found it.
                match self.revive(ino)? {
                    Some(node) => node,
                    None => {
                        self.scan_for(ino)?;
                        self.revive(ino)?.ok_or_else(|| errno(libc::ESTALE))?
                    }
                }
            }
        };
        if node.state().unlinked {
            // The kernel asks by number only for an inode it no longer holds, and it lets go
            // of a nameless one only when nothing has it open: a node without a name found
            // here is one whose FORGET is still on its way (seen over io_uring under load).
            // Its handle is stale, as on a local file system once the inode is freed.
            self.inodes.forget(node.ino, 1);
            return Err(errno(libc::ESTALE));
        }
        match self.getattr_of(&node) {
            Ok(attr) => Ok((node, attr)),
            Err(e) => {
                self.inodes.forget(node.ino, 1);
                Err(e)
            }
        }
    }

    /// LOOKUP of ".." in the directory `ino`: its parent, one kernel reference counted.
    pub(super) fn lookup_parent(&self, ino: Ino) -> Result<(Arc<Node>, Attr)> {
        let node = self.node(ino)?;
        if !node.is_dir() {
            return Err(errno(libc::ENOTDIR));
        }
        let parent = match ino {
            ROOT_INO => ROOT_INO,
            _ => node
                .state()
                .links
                .first()
                .map(|l| l.0)
                .ok_or_else(|| errno(libc::ENOENT))?,
        };
        self.lookup_by_number(parent)
    }

    /// The node numbered `ino`, counted, from the table or by the records of where it and its
    /// ancestors were last seen; `None` if those do not lead to it.
    fn revive(&self, ino: Ino) -> Result<Option<Arc<Node>>> {
        // Up from `ino` to the nearest node the table holds...
        let mut chain = Vec::new();
        let mut cur = ino;
        let mut dir = loop {
            if let Some(node) = self.inodes.get_counted(cur) {
                break node;
            }
            let Seen::At(parent, name) = self.inodes.seen(cur) else {
                return Ok(None);
            };
            chain.push((cur, name));
            cur = parent;
            if chain.len() > 4096 {
                // Records that go round in circles are stale ones.
                return Ok(None);
            }
        };
        // ...and down again, one lookup per step.
        while let Some((want, name)) = chain.pop() {
            match self.lookup_name(dir.ino, &name) {
                Ok((node, _)) if node.ino == want => {
                    self.inodes.hold_parent(&node, dir.ino);
                    dir = node;
                }
                Ok((other, _)) => {
                    self.inodes.forget(other.ino, 1);
                    self.inodes.forget(dir.ino, 1);
                    return Ok(None);
                }
                Err(e) => {
                    self.inodes.forget(dir.ino, 1);
                    let moved = [libc::ENOENT, libc::ENOTDIR, libc::ESTALE];
                    return match moved.iter().any(|&n| e.is(n)) {
                        true => Ok(None),
                        false => Err(e),
                    };
                }
            }
        }
        Ok(Some(dir))
    }

    /// Walks the merged tree depth first until it meets `wanted`, recording where each name it
    /// passes lives (the whole listing of the directory holding `wanted` included). A walk that
    /// meets it nowhere and could record everything tells the table so (`scanned_whole`).
    fn scan_for(&self, wanted: Ino) -> Result<()> {
        let epoch = self.inodes.begin_scan();
        let mut whole = true;
        let root = self.node(ROOT_INO)?;
        let mut stack = vec![(root.clone(), self.scan_listing(&root, &mut whole))];
        let mut found = false;
        while let Some((dir, entries)) = stack.last_mut() {
            let Some(e) = entries.next() else {
                let (dir, _) = stack.pop().expect("not empty");
                self.inodes.forget(dir.ino, 1);
                continue;
            };
            whole &= self.inodes.note_seen(e.ino, dir.ino, &e.name);
            if e.ino == wanted {
                for e in entries {
                    self.inodes.note_seen(e.ino, dir.ino, &e.name);
                }
                found = true;
                break;
            }
            if e.kind == libc::S_IFDIR {
                match self.lookup_name(dir.ino, &e.name) {
                    Ok((sub, _)) => {
                        let listing = self.scan_listing(&sub, &mut whole);
                        stack.push((sub, listing));
                    }
                    // Removed or replaced since the listing.
                    Err(_) => whole = false,
                }
            }
        }
        for (dir, _) in stack {
            self.inodes.forget(dir.ino, 1);
        }
        if !found && whole {
            self.inodes.scanned_whole(epoch);
        }
        Ok(())
    }

    fn scan_listing(&self, dir: &Node, whole: &mut bool) -> std::vec::IntoIter<DirEntry> {
        match self.dir_view(dir).and_then(|v| self.list_view(&v)) {
            Ok(list) => list.into_iter(),
            Err(e) => {
                log::debug!(
                    "scan for a file handle: directory {} not listed: {e}",
                    dir.ino
                );
                *whole = false;
                Vec::new().into_iter()
            }
        }
    }
}
