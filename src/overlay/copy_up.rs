//! Copy-up: giving a lower object a place in the upper layer.
//!
//! No operation ever copies a whole file. A regular file is copied up as a *partial file*: a sparse
//! upper file of the same size holding no blocks, marked with the lower file it patches
//! (file/partial/mark.rs) — or, where the upper file system can clone the lower file's extents (XFS
//! with reflink, btrfs; `reflink=` option), as a complete clone, which costs no more and needs the
//! daemon for none of its I/O afterwards. Directories, symlinks and special files are recreated.
//! Owner, mode, times and xattrs (ACLs included) come along; the origin's inode number is kept in
//! `mosaicfs.origin`.
//!
//! Every object is built in the work directory and renamed into place, so the upper layer never
//! holds a half-made object: after a crash the object is either absent (the lower one shows) or
//! complete with its mark.
//!
//! Its interface. Asked for: `copy_up` (a node and its parents get their upper objects; the
//! requests that change an object call it first), `copy_up_with` (a regular file copied up
//! empty and complete, for a truncate to zero), `upper_dir`, `copy_xattrs`,
//! `note_origin_moved_into`, and the joining of hard links (`join_copied_up_link`,
//! `join_other_links`). What it needs: the layers (the lower object, the work dir, the upper
//! directory), the inode table (a node's state: its lower part, links, kind; the parent
//! chain) and the upper seam. What it does to the rest once the object is in place: the
//! node's state says `upper`; the other lower names of a hard-linked file join the copied-up
//! inode (`join_other_links`); the files open on the node are re-pointed at their upper copy
//! (`refresh_open`, sources.rs). It calls nothing above itself.
//!
//! May call (dev/callgraph.py --check keeps it so): metacopy, overlay, sources, upper_meta.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::RenameFlags;
use rustix::io::Errno;

use crate::error::{Error, Result, errno};
use crate::file::partial::Source;
use crate::file::partial::mark::PartialMark;
use crate::inode::{Ino, Node, ROOT_INO};
use crate::layers::{LayerId, merged_xattr_name};
use crate::overlay::Overlay;
use crate::stat_override::OverrideStat;
use crate::sys::{self, Attr, Time};
use crate::upper::{Creation, LayerDir, UpperDir, UpperFile};

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Which xattrs `copy_xattrs` copies.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Xattrs {
    OfTheFile,
    All,
}

/// A fresh name in the work directory.
pub fn temp_name(tag: &str) -> OsString {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    OsString::from(format!("{tag}-{}-{n}", std::process::id()))
}

impl Overlay {
    /// Makes sure `node` exists in the upper layer; a regular file becomes a partial file.
    pub fn copy_up(&self, node: &Node) -> Result<()> {
        self.copy_up_with(node, false)
    }

    /// Copies `node` up; with `empty`, a regular file comes up empty and complete (for a
    /// truncate to zero), so not even a partial file is needed.
    pub(super) fn copy_up_with(&self, node: &Node, empty: bool) -> Result<()> {
        self.check_writable()?;
        if node.ino == ROOT_INO || node.state().upper {
            return Ok(());
        }
        // Its missing ancestors first, the topmost first, one after another: copying up each
        // parent from within its child's copy-up took a stack frame per level, and a layer
        // 4,000 directories deep ran a worker thread out of stack (the daemon died).
        let mut missing = Vec::new();
        let mut cur = self.parent_node(node)?;
        while let Some(p) = cur.filter(|p| p.ino != ROOT_INO && !p.state().upper) {
            cur = self.parent_node(&p)?;
            missing.push(p);
        }
        for p in missing.iter().rev() {
            self.copy_up_one(p, false)?;
        }
        self.copy_up_one(node, empty)
    }

    /// The upper directory of `parent`, copied up if needed.
    pub(crate) fn upper_dir(&self, parent: &Node) -> Result<UpperDir> {
        self.copy_up(parent)?;
        self.upper_fd(parent)
    }

    /// The node of `node`'s parent (its first name's), if it has a name.
    fn parent_node(&self, node: &Node) -> Result<Option<std::sync::Arc<Node>>> {
        let parent = node.state().links.first().map(|l| l.0);
        parent.map(|p| self.node(p)).transpose()
    }

    /// `copy_up_with` of a node whose parent is in the upper layer (else it copies the parent
    /// up first, which a rename between the two may call for).
    fn copy_up_one(&self, node: &Node, empty: bool) -> Result<()> {
        if node.ino == ROOT_INO {
            return Ok(());
        }
        let _serial = node.copy_up_lock();
        let (parent, name, lower) = {
            let st = node.state();
            if st.upper {
                return Ok(());
            }
            // No name left: removed or renamed over since the kernel looked it up. ESTALE, as
            // below, sends a call by path back to look the name up again.
            let (p, n) = st
                .links
                .first()
                .cloned()
                .ok_or_else(|| errno(libc::ESTALE))?;
            (p, n, st.lower.clone().ok_or_else(|| errno(libc::ENOENT))?)
        };
        let pnode = self.node(parent)?;
        self.copy_up(&pnode)?;
        let (ldir, lname, lattr) = self.lower_entry(lower.top(), &lower.path)?;
        let work = self.layers.work()?;
        let tmp = temp_name("copyup");
        // Built in the work dir as the daemon; the copy is given its owner explicitly.
        crate::creds::act_as_daemon();
        let built = self.build_copy(
            &work,
            &tmp,
            ldir.as_fd(),
            lname,
            &lattr,
            node,
            empty,
            &lower,
        );
        if let Err(e) = built {
            let _ = work.remove_tree(&tmp);
            return Err(e);
        }
        let udir = self.upper_fd(&pnode)?;
        {
            // Lookups in the parent that read the layers before this are not recorded after it.
            let _changing = pnode.entries.write();
            if let Err(e) = work.rename(&tmp, &udir, &name, RenameFlags::NOREPLACE) {
                let _ = work.remove_tree(&tmp);
                // Another object took the name since this one was looked up (renamed over
                // it, or made after its removal): this one has left the merged view. ESTALE
                // makes the kernel look the name up again for a call by path, so an open
                // finds what the name holds now, as on a local file system, not EEXIST.
                if e.is(libc::EEXIST) {
                    return Err(errno(libc::ESTALE));
                }
                return Err(e);
            }
            let mut st = node.state();
            st.upper = true;
            st.has_origin = true;
        }
        if !lattr.is_dir() && lattr.nlink > 1 {
            node.keep();
            self.join_other_links(node);
            // The names left are the lower file's, less those this mount removed; those it
            // knows are joined now, the others join at their lookup.
            let mut st = node.state();
            let known = st.links.len() as u64;
            let unjoined = lattr
                .nlink
                .saturating_sub(st.rare().lower_names_gone + known);
            if unjoined != st.rare().lower_names_unjoined {
                st.rare_mut().lower_names_unjoined = unjoined;
            }
        }
        self.stats.copy_ups.add(1);
        self.refresh_open(node)
    }

    /// Builds the upper copy of a lower object as `tmp` in the work directory.
    #[allow(clippy::too_many_arguments)]
    fn build_copy(
        &self,
        work: &UpperDir,
        tmp: &OsStr,
        ldir: BorrowedFd<'_>,
        lname: &OsStr,
        lattr: &Attr,
        node: &Node,
        empty: bool,
        lower: &crate::inode::LowerRef,
    ) -> Result<()> {
        match lattr.file_type() {
            libc::S_IFREG => {
                let file = work.create(tmp, &Creation::daemon(libc::S_IFREG | 0o600))?;
                if !empty && lattr.size > 0 {
                    let fd = &file;
                    // A metadata-only lower file's bytes are its data file's (metacopy.rs),
                    // checked against its digest before anything depends on them.
                    let (data_layer, data_path) = lower.data_at();
                    let data_attr = match lower.data() {
                        Some(data) => {
                            drop(self.open_lower_data(lower)?);
                            self.lower_data_attr(data)?
                        }
                        None => *lattr,
                    };
                    if self.clone_lower(fd, data_layer, data_path)? {
                        // A complete copy sharing the lower file's extents: no mark.
                    } else if self.sparse.sparse {
                        fd.truncate(lattr.size)?;
                        let block = self.sparse.block;
                        let mark = PartialMark::for_lower(
                            data_layer,
                            data_path.to_owned(),
                            &data_attr,
                            block,
                        );
                        self.guard_layer_for_partial_files()?;
                        match mark.store(fd, &self.layers.xattr) {
                            Ok(()) => {}
                            // The mark names the lower path, and a path deep enough does not
                            // fit in one xattr (ext4 holds about 4 KiB): copy the whole file.
                            Err(e) if e.is(libc::ENOSPC) || e.is(libc::E2BIG) => {
                                fd.truncate(0)?;
                                copy_all(&self.open_lower_data(lower)?, fd, lattr.size)?;
                            }
                            Err(e) => return Err(e),
                        }
                    } else {
                        // No sparse files on the upper file system (reported at mount): the
                        // only correct copy-up left is a whole one.
                        copy_all(&self.open_lower_data(lower)?, fd, lattr.size)?;
                    }
                }
            }
            libc::S_IFDIR => work.mkdir(tmp, &Creation::daemon(libc::S_IFDIR | 0o700))?,
            libc::S_IFLNK => {
                let target = sys::read_link_at(ldir, lname)?;
                work.symlink(&target, tmp, &Creation::daemon(libc::S_IFLNK | 0o777))?;
            }
            kind => {
                work.mknod(tmp, &Creation::daemon(kind | 0o600), lattr.rdev)?;
                if kind == libc::S_IFCHR && lattr.rdev == 0 {
                    let key = OsStr::new(&self.layers.xattr.device);
                    work.set_xattr(Some(tmp), key, b"y", 0)?;
                }
            }
        }
        self.copy_xattrs(ldir.into(), lname, work, tmp, Xattrs::OfTheFile)?;
        if lattr.is_reg() || lattr.is_dir() {
            // Immutable and append-only lower objects stay so (fileattr.rs).
            let protection = crate::overlay::fileattr::inode_protection(ldir.into(), Some(lname))?;
            if protection != 0 {
                self.store_protection(work, Some(tmp), protection)?;
            }
        }
        let origin = node.st_ino().to_string();
        let key = OsStr::new(&self.layers.xattr.origin);
        if let Err(e) = work.set_xattr(Some(tmp), key, origin.as_bytes(), 0) {
            // user.* xattrs cannot sit on symlinks or devices: their inode number then changes
            // on copy-up. Anything else is a real failure.
            if lattr.is_reg() || lattr.is_dir() {
                return Err(e);
            }
        }
        // An idmapped lower shows mount-space owners: the upper copy stores disk-space ones.
        let (uid, gid) = if self.layers.layer(lower.top()).idmapped {
            self.disk_ids(lattr.uid, lattr.gid)
        } else {
            (lattr.uid, lattr.gid)
        };
        // The copy shows what the lower object showed, which a lower layer may keep in an xattr.
        let shown = self
            .override_at(lower.top(), ldir.into(), Some(lname))
            .unwrap_or(OverrideStat {
                uid,
                gid,
                ..OverrideStat::of(lattr)
            });
        if self.upper_overrides() {
            self.set_override(work, Some(tmp), &shown, lattr.file_type())?;
            self.keep_reachable(work, Some(tmp), &work.stat_at(tmp)?)?;
        } else {
            work.chown(Some(tmp), Some(shown.uid), Some(shown.gid))?;
            if !lattr.is_symlink() {
                work.chmod(Some(tmp), lattr.file_type() | shown.mode)?;
            }
        }
        work.utimens(
            Some(tmp),
            Time::At(lattr.atime.0, lattr.atime.1),
            Time::At(lattr.mtime.0, lattr.mtime.1),
        )?;
        Ok(())
    }

    /// Whether lower files of `layer` are cloned on copy-up.
    pub fn reflinks_from(&self, layer: LayerId) -> bool {
        self.reflink
            .get(layer as usize)
            .is_some_and(|r| r.load(Ordering::Relaxed))
    }

    /// Clones the lower file `path` of `layer` into the empty upper file `dst` (FICLONE),
    /// where the layers allow it: O(1), and the copy is complete. False if they do not (the
    /// layer is not tried again) or if the lower file is itself a partial file (an upper layer
    /// reused as a lower one: its bytes are not its content); an error only for a clone that
    /// should have worked and failed (ENOSPC).
    fn clone_lower(&self, dst: &UpperFile, layer: LayerId, path: &Path) -> Result<bool> {
        if !self.reflinks_from(layer) {
            return Ok(false);
        }
        let Source::File(src) = self.open_lower_source(layer, path)? else {
            return Ok(false);
        };
        match dst.clone_from(src.as_fd()) {
            Ok(()) => {
                self.stats.reflinks.add(1);
                Ok(true)
            }
            Err(e)
                if [
                    Errno::XDEV,
                    Errno::OPNOTSUPP,
                    Errno::INVAL,
                    Errno::NOTTY,
                    Errno::PERM,
                ]
                .contains(&e) =>
            {
                if self.reflink[layer as usize].swap(false, Ordering::Relaxed) {
                    log::info!(
                        "lower layer {} cannot be cloned into the upper layer ({e}): its files \
                         are copied up as partial files",
                        self.layers.layer(layer).path.display()
                    );
                }
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Copies the xattrs of an object: with `Xattrs::OfTheFile` those that belong to the file,
    /// not to an overlay (escaped names of a nested overlay's bookkeeping belong to the file:
    /// they are copied as they are); with `Xattrs::All` mosaicfs' own too.
    pub(crate) fn copy_xattrs(
        &self,
        sdir: LayerDir<'_>,
        sname: &OsStr,
        ddir: &UpperDir,
        dname: &OsStr,
        which: Xattrs,
    ) -> Result<()> {
        for key in sdir.list_xattr(Some(sname))? {
            if which == Xattrs::OfTheFile && merged_xattr_name(key.as_encoded_bytes()).is_none() {
                continue;
            }
            let Ok(value) = sdir.get_xattr_raw(Some(sname), &key) else {
                continue;
            };
            match ddir.set_xattr(Some(dname), &key, &value, 0) {
                Ok(()) => {}
                // security.* labels the upper file system will not take are not file content.
                Err(e) if e.is(libc::EPERM) || e.is(libc::EOPNOTSUPP) || e.is(libc::EACCES) => {
                    log::debug!("xattr {key:?} not copied up: {e}");
                }
                Err(e) => {
                    return Err(Error::with_context(
                        e.errno(),
                        format!("copying xattr {key:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `name` in `parent` is a lower hard link of `node`, another name of which was copied up:
    /// links the upper file there too, so all names go on showing one file (as hard links do),
    /// after a remount as well. Kernel overlayfs does the same with `index=on`.
    pub(super) fn join_copied_up_link(&self, node: &Node, parent: Ino, name: &OsStr) -> Result<()> {
        let pnode = self.node(parent)?;
        self.copy_up(&pnode)?;
        let udir = self.upper_dir(&pnode)?;
        let (sdir, sname) = self.upper_entry(node)?;
        {
            let _changing = pnode.entries.write();
            sdir.link(&sname, &udir, name)?;
        }
        self.note_origin_moved_into(&pnode, true)
    }

    /// After `node`, a lower hard link, was copied up under its first name: links the upper
    /// file under the other names this mount knows. They are one inode to the kernel, so a
    /// change through one name already shows through all; this makes the upper layer agree.
    pub(super) fn join_other_links(&self, node: &Node) {
        let others: Vec<crate::inode::Link> = node.state().links.iter().skip(1).cloned().collect();
        for (p, n) in others {
            match self.join_copied_up_link(node, p, &n) {
                Ok(()) => {}
                Err(e) if e.is(libc::EEXIST) => {} // that name is in the upper layer already
                Err(e) => {
                    // ENOENT: the name (or its directory) was removed meanwhile.
                    if !e.is(libc::ENOENT) {
                        log::warn!("hard link {n:?} not kept on copy-up: {e}");
                    }
                    node.state().links.retain(|l| !(l.0 == p && l.1 == n));
                }
            }
        }
    }

    /// A copied-up object now sits in `dir`: if `dir` has no lower part, mark it, so lookups and
    /// listings there still read the object's origin (its inode number).
    pub(crate) fn note_origin_moved_into(&self, dir: &Node, origin: bool) -> Result<()> {
        let needs_mark = {
            let st = dir.state();
            origin && st.lower.is_none() && !st.origins
        };
        if needs_mark {
            let key = OsStr::new(&self.layers.xattr.origins);
            self.upper_fd(dir)?.set_xattr(None, key, b"y", 0)?;
            dir.state().origins = true;
        }
        Ok(())
    }
}

/// Copies `len` bytes, for upper file systems without sparse files only.
fn copy_all(src: &Source, dst: &UpperFile, len: u64) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < len {
        let n = src.pread_full(&mut buf, off)?;
        if n == 0 {
            break;
        }
        dst.write_at(&buf[..n], off)?;
        off += n as u64;
    }
    Ok(())
}
