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
//! Objects removed while open have no number to be found by once their daemon is gone: a
//! mount that survives its daemon (takeover.rs) records each in the work dir's
//! `mosaicfs-orphans` directory, named by its node id — the upper object hard-linked there before its last name
//! goes, and `ID.lower` a symlink to `LAYER/PATH` of its lower file — until the kernel
//! forgets it (`inode::Orphan`). A daemon that takes the mount over finds such a node there
//! (`orphan`): a process reading a file it opened and then removed (a running program that a
//! package upgrade replaced) reads on. Lower files' records stay until the next mount.
//!
//! Touches: the node table (counted references), lookups (namei.rs), listings (readdir.rs).
//!
//! May call (dev/callgraph.py --check keeps it so): namei, overlay, passthrough, readdir, upper_meta.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result, errno};
use crate::handles::DirEntry;
use crate::inode::{ALIAS_BASE, Found, Ino, LowerRef, Node, ROOT_INO, Seen};
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
                    None => self.scan_for(ino)?.ok_or_else(|| errno(libc::ESTALE))?,
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
                // A node whose FORGET is on its way outlived a directory above it, whose
                // FORGET a worker took first: found again by its name, as a forgotten node
                // is (without, `open_by_handle_at` right after `drop_caches` found the node
                // and answered ESTALE, its path leading nowhere: xfstests generic/467 under
                // the writeback cache, about one run in ten).
                let Some((parent, name)) = self.inodes.hold_up(&node) else {
                    break node;
                };
                self.inodes.forget(node.ino, 1);
                chain.push((cur, name));
                cur = parent;
                continue;
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
            match self.step_down(&dir, &name, want)? {
                Some(node) => dir = node,
                None => return Ok(None),
            }
        }
        Ok(Some(dir))
    }

    /// Walks the merged tree depth first until it meets `wanted`, recording where each name it
    /// passes lives (the whole listing of the directory holding `wanted` included), and gives
    /// `wanted`'s node, counted. A walk that meets it nowhere and could record everything tells
    /// the table so (`scanned_whole`).
    ///
    /// The node is looked up while the walk still holds every directory above it, not found
    /// again from the records afterwards: the records are bounded, and the names the walk
    /// recorded after a directory (a big directory's listing) may have pushed that directory's
    /// record out (tests/handles.rs, a directory of more names than the records hold).
    fn scan_for(&self, wanted: Ino) -> Result<Option<Arc<Node>>> {
        let epoch = self.inodes.begin_scan();
        // A directory moved or a name renamed meanwhile may have carried `wanted` from where
        // the scan had yet to look to where it had looked: such a scan says nothing of the
        // whole tree.
        let token = self.tree_token();
        let mut whole = true;
        let root = self.node(ROOT_INO)?;
        let mut stack = vec![(root.clone(), self.scan_listing(&root, &mut whole))];
        let mut found = None;
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
                found = Some(e.name);
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
        let mut chain: Vec<Arc<Node>> = stack.into_iter().map(|(dir, _)| dir).collect();
        let Some(name) = found else {
            if whole && self.tree_unchanged(token) {
                self.inodes.scanned_whole(epoch);
            }
            return Ok(None);
        };
        let dir = chain.pop().expect("the walk met it in a directory");
        let node = self.step_down(&dir, &name, wanted);
        if let Ok(Some(_)) = node {
            // Each directory keeps the reference the walk counted on its parent, as a node
            // found from the records does (`revive`).
            for pair in chain.windows(2) {
                self.inodes.hold_parent(&pair[1], pair[0].ino);
            }
            if let Some(parent) = chain.last() {
                self.inodes.hold_parent(&dir, parent.ino);
            }
        } else {
            for dir in &chain {
                self.inodes.forget(dir.ino, 1);
            }
        }
        node
    }

    /// One step down to the object numbered `want`: `name` in `dir`, counted and keeping the
    /// reference on `dir` the caller counted (`hold_parent`), if it is that object (possibly
    /// under a node id of its own, `fresh_file_ids`); otherwise `None`, with `dir`'s reference
    /// given back.
    fn step_down(&self, dir: &Node, name: &OsStr, want: Ino) -> Result<Option<Arc<Node>>> {
        match self.lookup_name(dir.ino, name) {
            Ok((node, _)) if node.st_ino() == want => {
                self.inodes.hold_parent(&node, dir.ino);
                Ok(Some(node))
            }
            Ok((other, _)) => {
                self.inodes.forget(other.ino, 1);
                self.inodes.forget(dir.ino, 1);
                Ok(None)
            }
            Err(e) => {
                self.inodes.forget(dir.ino, 1);
                not_there(e)
            }
        }
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

/// A lookup on the way to an object by its number failed: a name moved or went meanwhile,
/// which means "not found there", or something else went wrong, which is the answer.
fn not_there<T>(e: Error) -> Result<Option<T>> {
    let moved = [libc::ENOENT, libc::ENOTDIR, libc::ESTALE];
    match moved.iter().any(|&n| e.is(n)) {
        true => Ok(None),
        false => Err(e),
    }
}

impl Overlay {
    /// Makes node `ino` known when a daemon before this one gave it to the kernel
    /// (takeover.rs): found by its number, or by the record of a file removed while open, and
    /// counted once for all the references the kernel holds (its FORGET, which gives them all
    /// back at once, drops it again). Nothing to do in a daemon that mounted (one load).
    pub(crate) fn know_inherited(&self, ino: Ino) {
        if self.takeovers() == 0 || self.inodes.get(ino).is_some() {
            return;
        }
        if ino >= ALIAS_BASE {
            // A second identity an earlier daemon made: the object it names, recorded.
            let Some(object) = self.inodes.recorded_alias(ino) else {
                return;
            };
            self.know_inherited(object);
            if let Some(primary) = self.inodes.get(object) {
                self.inodes.adopt_alias(&primary, ino);
            }
            return;
        }
        let mut tries = 0;
        loop {
            let token = self.tree_token();
            match self.lookup_by_number(ino) {
                // Found under a node id of its own (`InodeTable::fresh_file_ids`): the object's
                // number stays the kernel's old inode, counted once for its references.
                Ok((node, _)) if node.ino != ino => {
                    if let Some(primary) = self.inodes.get_counted(ino) {
                        drop(primary);
                        self.inodes.forget(node.ino, 1);
                    }
                    return;
                }
                Ok(_) => return,
                // A name moved while the tree was searched: search it again.
                Err(e) if e.is(libc::ESTALE) && !self.tree_unchanged(token) && tries < 8 => {
                    tries += 1;
                }
                // Removed while open: the work dir's record of it.
                Err(e) if e.is(libc::ESTALE) => {
                    self.orphan(ino);
                    return;
                }
                // The request finds no node and answers for itself.
                Err(_) => return,
            }
        }
    }
}

/// The name of node `id`'s record in a memory upper's work root: the object itself, as the
/// layer holds it (its change log carries the name to a daemon that takes the mount over).
pub(crate) fn memory_orphan_name(id: &str) -> std::ffi::OsString {
    format!("mosaicfs-orphan-{id}").into()
}

/// The work dir's directory of records of removed objects still open (module comment): beside
/// `mosaicfs-work`, which every mount empties, this is emptied by a mount that does not take
/// another's over.
const ORPHANS: &str = "../mosaicfs-orphans";

impl Overlay {
    /// The orphans directory, made on first use; `None` where the mount does not survive its
    /// daemon. (With a memory upper it holds only records of node ids, of requests and of
    /// removed lower files: `record_orphan`.)
    fn orphans_dir(&self) -> Option<Arc<OwnedFd>> {
        self.orphans
            .get_or_init(|| {
                let survives = self.lineage().is_some_and(|l| l.holder.is_ok());
                let work = self.layers().work.as_ref().filter(|_| survives)?;
                let _ =
                    rustix::fs::mkdirat(&**work, ORPHANS, rustix::fs::Mode::from_raw_mode(0o700));
                let flags = rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC
                    | rustix::fs::OFlags::NOFOLLOW;
                match rustix::fs::openat(&**work, ORPHANS, flags, rustix::fs::Mode::empty()) {
                    Ok(fd) => Some(Arc::new(fd)),
                    Err(e) => {
                        log::warn!(
                            "cannot keep records of removed files in the work dir ({e}): a \
                             file removed while open cannot be read after a daemon takes the \
                             mount over"
                        );
                        None
                    }
                }
            })
            .clone()
    }

    /// Records second identities in the orphans directory from now on (`aliases`,
    /// `InodeTable::set_alias_records`) where the mount survives its daemon, and, in a daemon
    /// that took over a mount whose files pass through, gives regular files node ids of their
    /// own (`fresh_file_ids`): the kernel inodes under their numbers may be bound to backing
    /// files the daemon before registered. Called before the session serves.
    pub fn start_alias_records(&self) {
        let Some(dir) = self.orphans_dir() else {
            return;
        };
        let flags = rustix::fs::OFlags::RDWR
            | rustix::fs::OFlags::CREATE
            | rustix::fs::OFlags::CLOEXEC
            | rustix::fs::OFlags::NOFOLLOW;
        let records = match rustix::fs::openat(&*dir, "aliases", flags, 0o600.into()) {
            Ok(fd) => fd,
            Err(e) => {
                log::warn!("cannot record node ids in the work dir ({e})");
                return;
            }
        };
        let start = rustix::fs::fstat(&records).map_or(0, |st| st.st_size as u64 / 8);
        self.inodes.set_alias_records(Arc::new(records), start);
        if self.takeovers() > 0 && self.may_pass_through().is_ok() {
            self.inodes.fresh_file_ids();
        }
    }

    /// Records, from now on, what this daemon does of the requests that change the tree
    /// (resend.rs), where the mount survives its daemon; a daemon that took the mount over
    /// first reads what the one before it left. Called before the session serves.
    pub fn start_request_records(&self) {
        let Some(dir) = self.orphans_dir() else {
            return;
        };
        match crate::resend::Ledger::open(&*dir, self.takeovers() > 0) {
            Ok(ledger) => {
                let _ = self.requests.set(ledger);
            }
            Err(e) => log::warn!(
                "cannot keep the record of requests in progress in the work dir ({e}): a \
                 daemon that takes the mount over tells from the tree alone whether a request \
                 its predecessor held was done"
            ),
        }
    }

    /// Starts request `unique` in the record of requests in progress (`start_request_records`).
    pub fn request_starts(&self, unique: u64) -> crate::resend::Slot<'_> {
        match self.requests.get() {
            Some(ledger) => ledger.start(unique),
            None => crate::resend::Slot::unrecorded(unique),
        }
    }

    /// Whether regular files get node ids of their own (`start_alias_records`).
    pub fn fresh_file_ids(&self) -> bool {
        self.inodes.fresh_files()
    }

    /// Empties the orphans directory (a fresh mount: no kernel inode of an earlier one lives,
    /// and a record would keep a removed upper file's blocks).
    pub fn clear_orphans(&self) {
        let Some(work) = self.layers().work.as_ref() else {
            return;
        };
        let flags = rustix::fs::OFlags::DIRECTORY
            | rustix::fs::OFlags::CLOEXEC
            | rustix::fs::OFlags::NOFOLLOW;
        let Ok(dir) = rustix::fs::openat(&**work, ORPHANS, flags, rustix::fs::Mode::empty()) else {
            return;
        };
        let Ok(entries) = rustix::fs::Dir::read_from(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_bytes();
            if name != b"." && name != b".." {
                let _ = rustix::fs::unlinkat(&dir, e.file_name(), rustix::fs::AtFlags::empty());
            }
        }
    }

    /// Empties a memory upper's work root of what a daemon before left there: objects it was
    /// building when it died, and, unless this daemon takes the mount over (`keep_records`),
    /// the records of removed files still open (`memory_orphan_name`).
    pub fn empty_memory_work(&self, keep_records: bool) {
        if self.layers().memory.is_none() {
            return;
        }
        let Ok(work) = self.layers().work() else {
            return;
        };
        let Ok(entries) = work.read_dir() else {
            return;
        };
        for e in entries {
            let record = e.name.as_encoded_bytes().starts_with(b"mosaicfs-orphan-");
            if record && keep_records {
                continue;
            }
            if let Err(err) = work.remove_tree(&e.name) {
                log::warn!(
                    "memory upper: {:?} left in the layer's work root cannot be removed ({err})",
                    e.name
                );
            }
        }
    }

    /// In a daemon that takes the mount over: notes the records of removed files still open
    /// that the daemons before left (upper objects: `ID` in the orphans directory, or a
    /// memory upper's `memory_orphan_name`). A file such a daemon reached through its record
    /// keeps it until the kernel forgets the node (`inode::Orphan`); one the kernel forgets
    /// before this daemon ever needed it (its pages were cached) would keep it for good.
    pub fn note_left_records(&self) {
        let mut ids = std::collections::HashSet::new();
        if self.layers().memory.is_some() {
            if let Ok(work) = self.layers().work()
                && let Ok(entries) = work.read_dir()
            {
                ids.extend(entries.iter().filter_map(|e| {
                    e.name
                        .to_str()?
                        .strip_prefix("mosaicfs-orphan-")?
                        .parse::<Ino>()
                        .ok()
                }));
            }
        } else if let Some(dir) = self.orphans_dir()
            && let Ok(entries) = rustix::fs::Dir::read_from(&*dir)
        {
            ids.extend(
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().to_str().ok()?.parse::<Ino>().ok()),
            );
        }
        if !ids.is_empty() {
            *self.left_records.lock().unwrap() = ids;
            self.records_left
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The kernel forgot node `ino`, which this daemon never found: its record, if an earlier
    /// daemon left one, goes (`note_left_records`).
    pub(super) fn forget_left_record(&self, ino: Ino) {
        let mut left = self.left_records.lock().unwrap();
        if !left.remove(&ino) {
            return;
        }
        if left.is_empty() {
            self.records_left
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        drop(left);
        let name = ino.to_string();
        if self.layers().memory.is_some() {
            if let Ok(work) = self.layers().work() {
                let _ = work.unlink(&memory_orphan_name(&name));
            }
        } else if let Some(dir) = self.orphans_dir() {
            let _ = rustix::fs::unlinkat(&*dir, name.as_str(), rustix::fs::AtFlags::empty());
        }
    }

    /// Records `node`, whose last name is about to go while a handle has it open: its upper
    /// object `upper` (a name in a disk upper dir, still there) and its lower file. The
    /// record goes when the returned `Orphan` is dropped (with the node's pin); a lower-only
    /// object's stays until the next mount.
    pub(super) fn record_orphan(
        &self,
        node: &Node,
        upper: Option<(&crate::upper::UpperDir, &OsStr)>,
    ) -> Option<crate::inode::Orphan> {
        let lower = {
            let st = node.state();
            if st.kind != libc::S_IFREG || st.open.upgrade().is_none() {
                return None;
            }
            st.lower.clone()
        };
        if let Some((udir, entry)) = upper {
            // Another name keeps it: found by that one.
            let links = udir
                .object(entry)
                .and_then(|o| o.stat())
                .map_or(0, |a| a.nlink);
            if links != 1 {
                return None;
            }
        }
        let dir = self.orphans_dir()?;
        let name = node.ino.to_string();
        let mut orphan = crate::inode::Orphan {
            dir: dir.clone(),
            name: name.clone(),
            memory: None,
        };
        if let Some(lower) = lower {
            // Only a lower file at one place (no redirect, no metacopy data elsewhere).
            if lower.is_moved() || lower.data().is_some() {
                return None;
            }
            let target = format!("{}/{}", lower.top(), lower.path.display());
            let link = format!("{name}.lower");
            let _ = rustix::fs::unlinkat(&*dir, link.as_str(), rustix::fs::AtFlags::empty());
            rustix::fs::symlinkat(target.as_str(), &*dir, link.as_str()).ok()?;
        }
        match upper {
            Some((crate::upper::UpperDir::Disk(fd), entry)) => {
                let _ = rustix::fs::unlinkat(&*dir, name.as_str(), rustix::fs::AtFlags::empty());
                rustix::fs::linkat(
                    &**fd,
                    entry,
                    &*dir,
                    name.as_str(),
                    rustix::fs::AtFlags::empty(),
                )
                .ok()?;
            }
            Some((udir @ crate::upper::UpperDir::Memory(..), entry)) => {
                // A memory upper's object keeps a name in the layer's own work root, which
                // its change log and images carry to the next daemon.
                let work = self.layers().work().ok()?;
                let record = memory_orphan_name(&name);
                let _ = work.unlink(&record);
                udir.link(entry, &work, &record).ok()?;
                orphan.memory = Some(work);
            }
            None => {}
        }
        Some(orphan)
    }

    /// The node `ino` from its record in the orphans directory (after a takeover), counted.
    fn orphan(&self, ino: Ino) -> Option<Arc<Node>> {
        let dir = self.orphans_dir()?;
        let name = ino.to_string();
        let lower = rustix::fs::readlinkat(&*dir, format!("{name}.lower"), Vec::new())
            .ok()
            .and_then(|target| {
                let target = target.to_str().ok()?.to_owned();
                let (layer, path) = target.split_once('/')?;
                let layer: crate::layers::LayerId = layer.parse().ok()?;
                (layer != 0 && layer as usize <= self.layers().last_layer())
                    .then(|| LowerRef::new(std::path::Path::new(path), layer))
            });
        let flags =
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC;
        let memory_work = self
            .layers()
            .memory
            .as_ref()
            .and_then(|_| self.layers().work().ok());
        let upper = match &memory_work {
            Some(work) => work.object(&memory_orphan_name(&name)).ok(),
            None => rustix::fs::openat(&*dir, name.as_str(), flags, rustix::fs::Mode::empty())
                .ok()
                .map(crate::upper::UpperFile::Disk),
        };
        if upper.is_none() && lower.is_none() {
            return None;
        }
        let upper_attr = upper.as_ref().and_then(|f| f.stat().ok());
        // The record is the object's only name (it had one, and that went): else the object
        // has a name again, which a lookup finds.
        if upper_attr.as_ref().is_some_and(|a| a.nlink != 1) {
            return None;
        }
        let upper_ino = upper_attr.map(|a| a.ino);
        let found = Found {
            ino,
            kind: libc::S_IFREG,
            upper: upper.is_some(),
            origin: upper.is_some() && lower.is_some(),
            lower,
            origins: false,
            upper_ino,
            generation: None,
        };
        let node = self.inodes.remember_orphan(&found);
        if let Some(object) = upper {
            let orphan = crate::inode::Orphan {
                dir: dir.clone(),
                name,
                memory: memory_work,
            };
            let pin = crate::inode::Pin::take(&self.pins, || Some(object));
            if let Some(mut pin) = pin {
                pin.orphan = Some(orphan);
                node.state().rare_mut().pin = Some(pin);
            }
        }
        Some(node)
    }
}
