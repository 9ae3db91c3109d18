//! The merged directory listing.
//!
//! Upper entries first, then each lower layer's entries not already seen, top to bottom. A
//! whiteout hides its name in the layers below the one holding it; an opaque directory ends the
//! listing (its view simply has no lower part). Whiteouts and `.wh.` names never show.
//!
//! Offsets given to the kernel are cookies made from each name (`cookie`), and a listing is
//! served in cookie order: a READDIR from offset N resumes after the entry whose cookie is N,
//! in whichever snapshot of the directory is at hand, so a name added or removed between two
//! READDIRs never makes another name be skipped or returned twice (POSIX leaves only the
//! added or removed name itself unspecified), and seekdir/telldir work across snapshots.
//! That is what lets listings be kept per directory rather than per open handle: the daemon
//! answers OPENDIR with ENOSYS where the kernel supports it (FUSE_NO_OPENDIR_SUPPORT), which
//! spares an OPENDIR and a RELEASEDIR per listing and has the kernel cache every directory's
//! listing (FOPEN_CACHE_DIR) until the directory changes through the mount (`fuse_dir_changed`
//! bumps its i_version; layers do not change under a mount). A read from offset 0 (opendir,
//! rewinddir) takes a fresh snapshot (`Listings`).
//!
//! May call (dev/callgraph.py --check keeps it so): io, namei, overlay.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::hash::Hasher;
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::handles::{DirEntry, DirHandle};
use crate::inode::{Ino, Node, ROOT_INO};
use crate::layers::{OPAQUE_WHITEOUT, UPPER, WHITEOUT_PREFIX};
use crate::overlay::{DirView, Overlay};
use crate::sys;
use crate::sys::Attr;
use crate::upper::LayerDir;

/// A snapshot of a directory's merged listing in cookie order: `.` and `..` first.
pub type Listing = Arc<Snapshot>;

/// The entries of a listing, each with its cookie, in two allocations: the entries and all
/// their names in one buffer. A listing lives while the READDIRPLUS replies made from it make
/// a node for each entry, so whatever it holds ends up below those nodes in the heap, and
/// names allocated one by one stayed resident after it went (freed chunks among pages in use):
/// 11 MiB, 110 bytes an inode, after `ls -l` of 100,000 files (docs/PERFORMANCE.md, "Memory
/// per inode"). Two big allocations are whole pages, which the allocator gives back.
pub struct Snapshot {
    slots: Vec<Slot>,
    names: Vec<u8>,
}

struct Slot {
    cookie: u64,
    ino: Ino,
    /// The name: `names[at..at + len]`.
    at: u32,
    len: u16,
    /// S_IFMT bits (they fit in 16).
    kind: u16,
}

/// One entry of a listing, borrowed from it.
#[derive(Clone, Copy)]
pub struct Entry<'a> {
    pub name: &'a OsStr,
    pub ino: Ino,
    /// S_IFMT bits.
    pub kind: u32,
}

/// Entries of a snapshot from which its going is followed by a trim of the heap: below this
/// the trim's millisecond (per 100 MiB of heap) is not worth it.
const TRIM_AFTER_ENTRIES: usize = 16_384;

impl Snapshot {
    /// A snapshot of `entries`, sorted by cookie with each cookie distinct.
    fn new(entries: Vec<(u64, DirEntry)>) -> Result<Snapshot> {
        let bytes: usize = entries.iter().map(|(_, e)| e.name.len()).sum();
        if u32::try_from(bytes).is_err() {
            return Err(crate::error::errno(libc::EOVERFLOW));
        }
        let mut names = Vec::with_capacity(bytes);
        let mut slots = Vec::with_capacity(entries.len());
        for (cookie, e) in entries {
            let name = e.name.as_bytes();
            slots.push(Slot {
                cookie,
                ino: e.ino,
                at: names.len() as u32,
                len: u16::try_from(name.len())
                    .map_err(|_| crate::error::errno(libc::ENAMETOOLONG))?,
                kind: e.kind as u16,
            });
            names.extend_from_slice(name);
        }
        Ok(Snapshot { slots, names })
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    /// The index of the first entry whose cookie is above `offset`.
    fn after(&self, offset: u64) -> usize {
        self.slots.partition_point(|s| s.cookie <= offset)
    }

    /// Entry `i` and its cookie.
    fn get(&self, i: usize) -> (Entry<'_>, u64) {
        let s = &self.slots[i];
        let at = s.at as usize;
        let name = OsStr::from_bytes(&self.names[at..at + s.len as usize]);
        (
            Entry {
                name,
                ino: s.ino,
                kind: u32::from(s.kind),
            },
            s.cookie,
        )
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if self.slots.len() >= TRIM_AFTER_ENTRIES {
            drop(std::mem::take(&mut self.slots));
            drop(std::mem::take(&mut self.names));
            crate::sys::give_back_free_memory();
        }
    }
}

/// The latest snapshot of each directory being listed. Bounded: when it holds more than
/// `MAX_DIRS` directories or `MAX_ENTRIES` entries it is emptied, and a READDIR that finds no
/// snapshot takes one (cookies make any snapshot right to resume in).
#[derive(Default)]
pub struct Listings {
    by_dir: Mutex<HashMap<Ino, Listing>>,
}

const MAX_DIRS: usize = 256;
const MAX_ENTRIES: usize = 1 << 18;

impl Listings {
    fn get(&self, ino: Ino) -> Option<Listing> {
        self.lock().get(&ino).cloned()
    }

    fn put(&self, ino: Ino, listing: Listing) {
        let mut by_dir = self.lock();
        let held: usize = by_dir.values().map(|l| l.len()).sum();
        if by_dir.len() >= MAX_DIRS || held + listing.len() > MAX_ENTRIES {
            by_dir.clear();
        }
        by_dir.insert(ino, listing);
    }

    /// Forgets the snapshot of `ino` if it is still `listing` (not one taken since).
    fn forget(&self, ino: Ino, listing: &Listing) {
        let mut by_dir = self.lock();
        if by_dir.get(&ino).is_some_and(|l| Arc::ptr_eq(l, listing)) {
            by_dir.remove(&ino);
        }
    }

    /// Forgets every snapshot (unmount).
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ino, Listing>> {
        self.by_dir.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The offset of the entry after `name` in a listing: 1 and 2 for `.` and `..`, else a hash
/// of the name above 2 and below 2^63 (the kernel's offsets are signed). Equal cookies of
/// two names in one directory (odds about n²/2^64) are told apart in the snapshot
/// (`take_listing`).
fn cookie(name: &OsStr) -> u64 {
    match name.as_bytes() {
        b"." => 1,
        b".." => 2,
        bytes => {
            // SipHash with the fixed keys every `DefaultHasher::new` has: the same cookie for
            // a name throughout the daemon's life, which is as long as an offset may be kept.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            h.write(bytes);
            3 + h.finish() % ((1u64 << 63) - 4)
        }
    }
}

impl Overlay {
    /// OPENDIR, for kernels that cannot do without it (fuse.rs answers ENOSYS where they can):
    /// a handle, and whether the kernel may keep the directory's listing across opens
    /// (FOPEN_CACHE_DIR with FOPEN_KEEP_CACHE). It may for a directory only lower layers hold:
    /// layers do not change under a mount, and every change through the mount (create, unlink,
    /// rename, link in it) makes the kernel drop its cached listing at the next open
    /// (`fuse_dir_changed`); the change copies the directory up, so that open gets no cache
    /// flags. A second listing — a shell's glob, a language runtime scanning its library
    /// directories — then costs no READDIRPLUS, whose lookup per entry reaches a store's
    /// client once its own short caches expired (bench/stores.sh).
    pub fn opendir(&self, ino: Ino) -> Result<(u64, bool)> {
        let node = self.node(ino)?;
        self.dir_view(&node)?;
        let cacheable = !node.state().upper;
        let fh = self.dirs.insert(DirHandle { ino });
        Ok((fh, cacheable))
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.remove(fh);
    }

    /// Entries of directory `ino` after the one whose cookie is `offset` (0: from the start),
    /// each with its own cookie, until `emit` says the reply is full. `fh` is 0 when the
    /// kernel sent no OPENDIR.
    pub fn readdir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        mut emit: impl FnMut(Entry<'_>, u64) -> bool,
    ) -> Result<()> {
        self.adopt_dir_handle(fh, ino);
        if fh != 0 && self.dirs.get(fh).is_none_or(|h| h.ino != ino) {
            return Err(crate::error::errno(libc::EBADF));
        }
        let listing = match (offset, self.listings.get(ino)) {
            (1.., Some(listing)) => listing,
            _ => {
                let listing = Arc::new(Snapshot::new(self.take_listing(ino)?)?);
                self.listings.put(ino, listing.clone());
                listing
            }
        };
        let from = listing.after(offset);
        if from == listing.len() {
            // The reader is at the end: its snapshot goes (a seekdir back takes a new one).
            self.listings.forget(ino, &listing);
        }
        for i in from..listing.len() {
            let (e, cookie) = listing.get(i);
            if emit(e, cookie) {
                break;
            }
        }
        Ok(())
    }

    /// The merged listing of `ino` in cookie order, each cookie distinct.
    fn take_listing(&self, ino: Ino) -> Result<Vec<(u64, DirEntry)>> {
        let mut listing: Vec<(u64, DirEntry)> = self
            .list_dir(ino)?
            .into_iter()
            .map(|e| (cookie(&e.name), e))
            .collect();
        listing.sort_unstable_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
        for i in 1..listing.len() {
            if listing[i].0 <= listing[i - 1].0 {
                listing[i].0 = listing[i - 1].0 + 1;
            }
        }
        Ok(listing)
    }

    /// READDIRPLUS: entries with their attributes, each looked up (one kernel reference each,
    /// except `.` and `..`, which the kernel does not take). `emit` returns true when the reply
    /// is full; that entry's reference is given back. An entry gone since the listing, and one
    /// the kernel holds fresh already (`kernel_holds_entry`), is passed without attributes.
    pub fn readdirplus(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        mut emit: impl FnMut(Entry<'_>, u64, Option<(&Node, &Attr)>) -> bool,
    ) -> Result<()> {
        self.readdir(ino, fh, offset, |e, next| {
            if e.name == "." || e.name == ".." || self.kernel_holds_entry(ino, &e) {
                return emit(e, next, None);
            }
            match self.lookup_name(ino, e.name) {
                Ok((node, attr)) => {
                    let full = emit(e, next, Some((&node, &attr)));
                    if full {
                        self.inodes.forget(node.ino, 1);
                    }
                    full
                }
                Err(_) => emit(e, next, None),
            }
        })
    }

    /// Whether the kernel holds `e` as an entry of `dir` that it was given moments ago
    /// (`Node::told_within`): a READDIRPLUS then passes only its name, as for `.` (nodeid 0:
    /// the kernel keeps what it has). Walking a tree made or looked at through the mount just
    /// before — `find` after an untar, `ls -l` after `ls` — costs no lookup per entry in the
    /// daemon and no relinking of each entry in the kernel, which is most of a READDIRPLUS
    /// (docs/PERFORMANCE.md, "The stat walk"). An entry given longer ago is looked up again,
    /// so that a listing still renews the kernel's caches before they expire.
    fn kernel_holds_entry(&self, dir: Ino, e: &Entry<'_>) -> bool {
        let Some(node) = self.inodes.get(e.ino) else {
            return false;
        };
        let st = node.state();
        let ttl = if st.upper {
            self.config.timeout
        } else {
            self.config.lower_cache
        };
        let named_here = st.links.iter().any(|(p, n)| *p == dir && **n == *e.name);
        drop(st);
        named_here && node.told_within(ttl)
    }

    /// The merged listing of directory `ino`, with `.` and `..` first.
    pub fn list_dir(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        let node = self.node(ino)?;
        let view = self.dir_view(&node)?;
        let parent = if ino == ROOT_INO {
            ROOT_INO
        } else {
            node.state().links.first().map_or(ROOT_INO, |l| l.0)
        };
        let mut out = vec![
            DirEntry {
                name: ".".into(),
                ino,
                kind: libc::S_IFDIR,
            },
            DirEntry {
                name: "..".into(),
                ino: parent,
                kind: libc::S_IFDIR,
            },
        ];
        out.extend(self.list_view(&view)?);
        Ok(out)
    }

    /// The merged entries of a directory view, without `.` and `..`.
    pub fn list_view(&self, view: &DirView) -> Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        let mut hidden: HashSet<OsString> = HashSet::new();
        if let Some(dir) = &view.upper {
            let (objects, whiteouts) = self.layer_entries(dir.view())?;
            hidden.extend(whiteouts);
            for (e, kind) in objects {
                let origin = if view.origins {
                    match self.origin_ino(dir.view(), &e.name) {
                        Ok(origin) => origin,
                        // Removed since the directory was read (see `entry_kind`).
                        Err(err) if err.is(libc::ENOENT) => continue,
                        Err(err) => return Err(err),
                    }
                } else {
                    None
                };
                let ino = origin.unwrap_or_else(|| self.map_ino(UPPER, e.ino));
                hidden.insert(e.name.clone());
                out.push(DirEntry {
                    name: e.name,
                    ino,
                    kind,
                });
            }
        }
        if let Some(lower) = &view.lower {
            let last = lower.layers().last().copied();
            for &layer in lower.layers() {
                let path = lower.path_in(layer);
                let _waiting = crate::lower_wait::enter(layer)?;
                let (objects, whiteouts) =
                    match self.in_lower_dir(layer, path, |dir| self.layer_entries(dir.into())) {
                        Ok(listed) => listed,
                        Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => continue,
                        Err(e) => return Err(e),
                    };
                // Below the last layer nothing is left to hide: its names are not copied into
                // the set (a 100,000-file lower directory made 100,000 allocations for it).
                let below = Some(layer) != last;
                out.reserve(objects.len());
                for (e, kind) in objects {
                    let shown = if below {
                        hidden.insert(e.name.clone())
                    } else {
                        !hidden.contains(&e.name)
                    };
                    if shown {
                        out.push(DirEntry {
                            ino: self.map_ino(layer, e.ino),
                            name: e.name,
                            kind,
                        });
                    }
                }
                if below {
                    hidden.extend(whiteouts);
                }
            }
        }
        Ok(out)
    }

    /// The entries of the layer directory `dir` itself: its objects with their types, and the
    /// names its whiteouts (in any format) hide. The opaque marker file is in neither.
    pub fn layer_entries(&self, dir: LayerDir<'_>) -> Result<LayerEntries> {
        let xwhiteouts = self.layers.dir_flags(dir, None, false)?.xwhiteouts;
        let mut objects = Vec::new();
        let mut whiteouts = Vec::new();
        for e in dir.read_dir()? {
            if let Some(target) = whiteout_target(&e.name) {
                whiteouts.extend(target);
                continue;
            }
            match self.entry_kind(dir, &e, xwhiteouts)? {
                Some(kind) => objects.push((e, kind)),
                None => whiteouts.push(e.name),
            }
        }
        Ok((objects, whiteouts))
    }

    /// The type of a listed entry, or `None` if it is a whiteout.
    /// Regular files are whiteouts only by xattr, which (as in kernel overlayfs) a listing
    /// honours only in a directory marked for them (`xwhiteouts`); lookup checks every one.
    fn entry_kind(
        &self,
        dir: LayerDir<'_>,
        e: &sys::RawDirEntry,
        xwhiteouts: bool,
    ) -> Result<Option<u32>> {
        match e.kind {
            libc::S_IFREG if !xwhiteouts => Ok(Some(libc::S_IFREG)),
            libc::S_IFCHR | libc::S_IFREG | 0 => {
                // An entry removed since the directory was read is left out, like a whiteout:
                // a listing taken while others change the directory is not an error.
                let Some(attr) = dir.stat_opt(&e.name)? else {
                    return Ok(None);
                };
                match self.layers.is_whiteout(dir, &e.name, &attr) {
                    Ok(false) => Ok(Some(attr.file_type())),
                    Ok(true) => Ok(None),
                    Err(err) if err.is(libc::ENOENT) => Ok(None),
                    Err(err) => Err(err),
                }
            }
            k => Ok(Some(k)),
        }
    }
}

/// A layer directory's objects with their types (`S_IFMT`), and the names it whites out.
pub type LayerEntries = (Vec<(sys::RawDirEntry, u32)>, Vec<OsString>);

/// For a `.wh.NAME` entry, the name it hides (none for the opaque marker).
fn whiteout_target(name: &OsStr) -> Option<Option<OsString>> {
    let b = name.as_bytes();
    if !b.starts_with(WHITEOUT_PREFIX) {
        return None;
    }
    if b == OPAQUE_WHITEOUT.as_bytes() {
        return Some(None);
    }
    Some(Some(
        OsStr::from_bytes(&b[WHITEOUT_PREFIX.len()..]).to_os_string(),
    ))
}

#[cfg(test)]
mod listing_tests {
    use super::*;

    fn entry(name: &str) -> (u64, DirEntry) {
        let name = OsString::from(name);
        (
            cookie(&name),
            DirEntry {
                name,
                ino: 5,
                kind: libc::S_IFREG,
            },
        )
    }

    #[test]
    fn cookies_put_dot_entries_first_and_stay_inside_the_kernels_offsets() {
        assert_eq!(cookie(OsStr::new(".")), 1);
        assert_eq!(cookie(OsStr::new("..")), 2);
        for n in ["a", "b", "file0001", "ünïcode", ".hidden", "..."] {
            let c = cookie(OsStr::new(n));
            assert!((3..1u64 << 63).contains(&c), "{n}: {c}");
            assert_eq!(c, cookie(OsStr::new(n)), "the same name, the same cookie");
        }
    }

    #[test]
    fn a_snapshot_gives_back_each_entry_as_it_was_given() {
        let long = "n".repeat(255);
        let mut given = [
            entry("."),
            entry(".."),
            entry("a"),
            entry(&long),
            entry("ü"),
        ];
        given[3].1.kind = libc::S_IFDIR;
        given[4].1.ino = u64::MAX - 1;
        given[4].1.kind = libc::S_IFSOCK;
        let s = Snapshot::new(given.iter().map(|(c, e)| (*c, e.clone())).collect()).unwrap();
        assert_eq!(s.len(), given.len());
        for (i, (cookie, e)) in given.iter().enumerate() {
            let (got, got_cookie) = s.get(i);
            assert_eq!(
                (got.name, got.ino, got.kind, got_cookie),
                (e.name.as_os_str(), e.ino, e.kind, *cookie)
            );
        }
        assert_eq!(s.after(0), 0);
        assert_eq!(s.after(2), 2, "after `..` comes the first name");
        assert_eq!(s.after(u64::MAX), given.len());
    }

    #[test]
    fn a_snapshot_read_to_its_end_goes_but_not_a_newer_one() {
        let l = Listings::default();
        let old: Listing = Arc::new(Snapshot::new(vec![entry("a")]).unwrap());
        let new: Listing = Arc::new(Snapshot::new(vec![entry("a"), entry("b")]).unwrap());
        l.put(7, old.clone());
        l.put(7, new.clone());
        l.forget(7, &old);
        assert!(l.get(7).is_some_and(|x| Arc::ptr_eq(&x, &new)));
        l.forget(7, &new);
        assert!(l.get(7).is_none());
    }
}
