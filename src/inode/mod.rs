//! Merged-view inodes: what each inode number the kernel knows stands for, and the table of them.
//!
//! An inode holds no file descriptor (RLIMIT_NOFILE is a hard 20000 here): it is named by where
//! it sits in the merged tree (parent inode + name) and by where its lower part lives. Lower
//! layers never change, so a lower path stored here stays right for the inode's life; only the
//! upper path changes (on rename), and that is computed from the parent chain when needed.
//!
//! Inode numbers are stable for a file's life and unique in the mount: a file's number is derived
//! from the layer file it started as — `st_ino`, tagged with the index of its layer's device
//! when the layers span several devices — and a copied-up object keeps the number of its origin
//! through the `mosaicfs.origin` xattr, across unmount and remount. The root is always 1.
//!
//! An object can have two node ids at once: the kernel binds a FUSE inode to the backing file of
//! its passthrough handles, so an open that needs another gets the object under a second node id
//! (`retire`, and file/mod.rs `IoMode`). Both share the object's state and show its inode number;
//! the first leads lookups to the second while the second lives.
//!
//! A lookup reads the layers without a lock and records what it found afterwards; a change to
//! the directory it looked in (create, remove, rename, copy-up of an entry) may run in between,
//! since the kernel revalidates names without the directory's lock. Every such change is
//! bracketed by the directory's `entries` sequence (seq.rs), and a lookup records nothing that a
//! change overtook (`remember_if`): it looks again.
//!
//! Locking: the table is sharded, each shard behind its own `RwLock` held only to find, insert
//! or count an entry; a thread holds one shard lock at a time and takes no state lock under it.
//! Each inode's mutable state sits behind its own `Mutex`. A thread may take an ancestor's state
//! lock while holding a descendant's (path building walks upwards), never the other way round,
//! and never two unrelated inodes' locks at once.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use crate::file::{NodeIo, OpenFile};
use crate::layers::LayerId;
use crate::seq::ChangeSeq;

mod records;
pub use records::Records;

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;

/// Where the lower part of a merged object lives. For a directory, every lower layer that
/// contributes to it (top to bottom, stopping at an opaque one); for anything else, the one
/// topmost layer that has it. The path is the same in all those layers unless a directory
/// renamed in a lower layer (a redirect there) sent the layers below it elsewhere.
///
/// Every node of a lower object holds one, so it is kept small (docs/PERFORMANCE.md, "Memory
/// per inode"): 32 bytes, the path without spare capacity, the top layer inline and what
/// few objects have (more layers, redirects, metacopy data) in one box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowerRef {
    /// The path in the top layer.
    pub path: Box<Path>,
    /// The top layer holding it (`layers`: every one).
    top: LayerId,
    /// The layers below the top one, redirects and a metadata-only file's data: most objects
    /// have none of them (every lower file, most directories), and a pointer in every node is
    /// what they cost.
    rare: Option<Box<LowerRare>>,
}

/// Never empty: a `LowerRef` without any has none (equal parts compare equal).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct LowerRare {
    /// Every layer, top first, when there are more than one (empty otherwise).
    layers: Vec<LayerId>,
    /// `(layer, path)`: from `layer` down, the object is at `path` (redirects in lower layers).
    moved: Vec<(LayerId, PathBuf)>,
    /// For a metadata-only file of kernel overlayfs: where its data is (metacopy.rs).
    data: Option<Arc<LowerData>>,
}

/// Where the data of a metadata-only lower file is, and the fs-verity digest its metadata
/// asks of it (metacopy.rs).
#[derive(Debug, PartialEq, Eq)]
pub struct LowerData {
    pub layer: LayerId,
    pub path: PathBuf,
    /// `(FS_VERITY_HASH_ALG_*, digest)` from `overlay.metacopy`, where it carries one.
    pub digest: Option<(u8, Vec<u8>)>,
}

impl LowerRef {
    pub fn new(path: impl Into<Box<Path>>, layer: LayerId) -> LowerRef {
        LowerRef {
            path: path.into(),
            top: layer,
            rare: None,
        }
    }

    /// The lower part of a directory `layers` (top first, at least one) make at `path`.
    pub fn in_layers(path: impl Into<Box<Path>>, layers: &[LayerId]) -> LowerRef {
        let mut l = LowerRef::new(path, layers[0]);
        if layers.len() > 1 {
            l.rare = Some(Box::new(LowerRare {
                layers: layers.to_vec(),
                ..Default::default()
            }));
        }
        l
    }

    /// Every layer holding the object, top first.
    pub fn layers(&self) -> &[LayerId] {
        match &self.rare {
            Some(r) if !r.layers.is_empty() => &r.layers,
            _ => std::slice::from_ref(&self.top),
        }
    }

    /// Whether lower layers' redirects send some layers to another path.
    pub fn is_moved(&self) -> bool {
        self.rare.as_ref().is_some_and(|r| !r.moved.is_empty())
    }

    /// For a metadata-only file of kernel overlayfs: where its data is (metacopy.rs).
    pub fn data(&self) -> Option<&Arc<LowerData>> {
        self.rare.as_ref().and_then(|r| r.data.as_ref())
    }

    pub fn set_data(&mut self, data: Option<Arc<LowerData>>) {
        let rare = self.rare.get_or_insert_with(Default::default);
        rare.data = data;
        if *rare == Default::default() {
            self.rare = None;
        }
    }

    /// Where the object's data is: its own file, or a metadata-only file's data file.
    pub fn data_at(&self) -> (LayerId, &Path) {
        match self.data() {
            Some(d) => (d.layer, &d.path),
            None => (self.top(), &self.path),
        }
    }

    pub fn top(&self) -> LayerId {
        self.top
    }

    /// The object's path in `layer`.
    pub fn path_in(&self, layer: LayerId) -> &Path {
        self.rare
            .iter()
            .flat_map(|r| r.moved.iter())
            .rev()
            .find(|(from, _)| *from <= layer)
            .map_or(&self.path, |(_, p)| p)
    }

    /// Adds `layer`, below the others, where the object is at `path`.
    pub fn push(&mut self, layer: LayerId, path: &Path) {
        if path != self.path_in(layer) {
            self.rare
                .get_or_insert_with(Default::default)
                .moved
                .push((layer, path.to_owned()));
        }
        let top = self.top;
        let rare = self.rare.get_or_insert_with(Default::default);
        if rare.layers.is_empty() {
            rare.layers.push(top);
        }
        rare.layers.push(layer);
    }
}

/// One name of an inode: its parent and the name in it.
pub type Link = (Ino, Name);

/// A file name as nodes and the records of forgotten ones keep it: inline when it is short,
/// as nearly all are (no allocation of its own: a million-file tree holds a million of them,
/// and names freed between nodes would keep the heap's pages from being given back), boxed
/// when longer.
#[derive(Clone, PartialEq, Eq)]
pub enum Name {
    Short { len: u8, bytes: [u8; Name::SHORT] },
    Long(Box<OsStr>),
}

impl Name {
    const SHORT: usize = 22;

    pub fn new(name: &OsStr) -> Name {
        let b = name.as_bytes();
        if b.len() <= Name::SHORT {
            let mut bytes = [0; Name::SHORT];
            bytes[..b.len()].copy_from_slice(b);
            Name::Short {
                len: b.len() as u8,
                bytes,
            }
        } else {
            Name::Long(name.into())
        }
    }

    pub fn as_os_str(&self) -> &OsStr {
        match self {
            Name::Short { len, bytes } => OsStr::from_bytes(&bytes[..*len as usize]),
            Name::Long(b) => b,
        }
    }
}

impl std::ops::Deref for Name {
    type Target = OsStr;
    fn deref(&self) -> &OsStr {
        self.as_os_str()
    }
}

impl AsRef<OsStr> for Name {
    fn as_ref(&self) -> &OsStr {
        self.as_os_str()
    }
}

impl AsRef<std::path::Path> for Name {
    fn as_ref(&self) -> &std::path::Path {
        self.as_os_str().as_ref()
    }
}

impl From<&OsStr> for Name {
    fn from(name: &OsStr) -> Name {
        Name::new(name)
    }
}

impl PartialEq<OsStr> for Name {
    fn eq(&self, other: &OsStr) -> bool {
        self.as_os_str() == other
    }
}

impl PartialEq<&OsStr> for Name {
    fn eq(&self, other: &&OsStr) -> bool {
        self.as_os_str() == *other
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_os_str().fmt(f)
    }
}

/// The names of an inode, in order (the first builds its upper path). Every node holds one
/// and nearly all have one name, kept without an allocation of its own beside the name's;
/// two or more, for hard links, in a boxed vector (docs/PERFORMANCE.md, "Memory per inode").
/// The three cases fit in the 32 bytes of one name (the name's tag leaves room for the
/// others).
#[derive(Debug, Default)]
pub enum Links {
    #[default]
    None,
    One(Link),
    /// Never fewer than two.
    #[allow(clippy::box_collection)] // a pointer in every node rather than a vector's 24 bytes
    Many(Box<Vec<Link>>),
}

impl Links {
    fn as_slice(&self) -> &[Link] {
        match self {
            Links::None => &[],
            Links::One(l) => std::slice::from_ref(l),
            Links::Many(v) => v,
        }
    }

    pub fn first(&self) -> Option<&Link> {
        self.as_slice().first()
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, Links::None)
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Link> {
        self.as_slice().iter()
    }

    /// Adds a name after the others.
    pub fn push(&mut self, link: Link) {
        *self = match std::mem::take(self) {
            Links::None => Links::One(link),
            Links::One(l) => Links::Many(Box::new(vec![l, link])),
            Links::Many(mut v) => {
                v.push(link);
                Links::Many(v)
            }
        };
    }

    /// Adds a name before the others: the one to build the upper path from.
    pub fn push_first(&mut self, link: Link) {
        *self = match std::mem::take(self) {
            Links::None => Links::One(link),
            Links::One(l) => Links::Many(Box::new(vec![link, l])),
            Links::Many(mut v) => {
                v.insert(0, link);
                Links::Many(v)
            }
        };
    }

    /// Moves the name at `pos` (in `iter` order) to the front.
    pub fn make_first(&mut self, pos: usize) {
        if let Links::Many(v) = self
            && pos < v.len()
        {
            v.swap(0, pos);
        }
    }

    /// Keeps the names `keep` accepts, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&Link) -> bool) {
        *self = match std::mem::take(self) {
            Links::One(l) if keep(&l) => Links::One(l),
            Links::Many(mut v) => {
                v.retain(|l| keep(l));
                match v.len() {
                    0 => Links::None,
                    1 => Links::One(v.remove(0)),
                    _ => Links::Many(v),
                }
            }
            _ => Links::None,
        };
    }

    pub fn clear(&mut self) {
        *self = Links::None;
    }
}

#[derive(Debug)]
pub struct NodeState {
    /// S_IFMT bits.
    pub kind: u32,
    /// Names of this inode in the merged tree; the first is used to build its upper path.
    pub links: Links,
    /// Whether the object exists in the upper layer at its upper path.
    pub upper: bool,
    pub lower: Option<LowerRef>,
    /// Set when the last name was removed while the kernel still knows the inode.
    pub unlinked: bool,
    /// The upper object carries `mosaicfs.origin`.
    pub has_origin: bool,
    /// For a directory: entries may carry `mosaicfs.origin` without a lower part to explain it.
    pub origins: bool,
    /// The shared state of open handles on this regular file, while any is open.
    pub open: Weak<OpenFile>,
    /// For a merged directory: how many subdirectories its merged view has, plus one (its
    /// `st_nlink` is the count plus 2), once counted (`subdirs`). Reset by `subdirs_changed`.
    subdirs_plus_one: Option<std::num::NonZeroU32>,
    /// Bumped by every change to the subdirectories, so a count taken across one is not kept.
    pub subdirs_gen: u16,
    /// Changes to the subdirectories under way (`begin_subdirs_change`): no count taken
    /// while one is may be kept, since it may or may not see that change.
    subdirs_changing: u8,
    /// What few nodes need (`rare`, `rare_mut`): boxed, so that the rest pay a pointer for it
    /// (docs/PERFORMANCE.md, "Memory per inode").
    rare: Option<Box<Rare>>,
    /// Its immutable and append-only flags (fileattr.rs `protection`), once read: see
    /// `protection`.
    protection: u8,
}

/// The part of a node's state few nodes have (`NodeState::rare`).
#[derive(Debug, Default)]
pub struct Rare {
    /// Handles an execve(2) opened (`FMODE_EXEC`) and has not released: the file is a
    /// running program's text, which the kernel keeps from being written (`io.rs` `open`).
    pub executing: u32,
    /// For a lower non-directory: how many of its names (hard links in the lower layer) this
    /// mount removed while it stayed in the lower layer. The lower file's `st_nlink` still
    /// counts them; the merged view must not.
    pub lower_names_gone: u64,
    /// For a copied-up lower hard link: how many of the lower file's other names no lookup has
    /// joined to the copy yet (`copied_up_link_of`). They are names of this inode in the merged
    /// view, so `st_nlink` counts them beside the upper file's own.
    pub lower_names_unjoined: u64,
    /// For an object only a lower layer on a store's client holds (`Layer::on_store`): its
    /// layer `stat` and when it was taken (`Overlay::stat_layer`).
    pub store_attr: Option<(crate::sys::Attr, std::time::Instant)>,
    /// The upper object itself, held once a removal took its last known name while the kernel
    /// still knew the node (`Overlay::pin_removed`).
    pub pin: Option<Pin>,
}

/// `NodeState::protection`: the flags were read (the low four bits are flags 4-7).
const PROTECTION_KNOWN: u8 = 0x80;

/// What `NodeState::rare` reads for a node without any.
static NO_RARE: Rare = Rare {
    executing: 0,
    lower_names_gone: 0,
    lower_names_unjoined: 0,
    store_attr: None,
    pin: None,
};

/// A removed upper object whose node the kernel still holds, kept: an `O_PATH` descriptor of
/// it on a disk upper, its node on a memory upper. While it is kept the upper file system
/// cannot give the object's inode number to a new object: the number stays this node's, a new
/// object made meanwhile gets another (and so another node id), and the kernel never sees a
/// number come back as something else — which it would answer by failing every call still on
/// its way to the old inode with EIO. A call that looked the name up before the removal
/// reaches the object through it, as on a local file system. Dropped with the node, once the
/// kernel forgets it; at most `PINS_MAX` at a time. (ROBUSTNESS.md.)
pub struct Pin {
    pub object: crate::upper::UpperFile,
    /// The object's own inode number in the upper layer.
    pub upper_ino: u64,
    held: Arc<std::sync::atomic::AtomicUsize>,
    /// The object's record for a daemon that takes the mount over (by_number.rs, orphans),
    /// removed with the pin.
    pub orphan: Option<Orphan>,
}

/// A removed object's entries in the work dir's orphans directory (by_number.rs), which let a
/// daemon that takes the mount over find an object the kernel still has open: removed when
/// the kernel forgets the node.
pub struct Orphan {
    pub dir: Arc<std::os::fd::OwnedFd>,
    pub name: String,
    /// A memory upper's object is recorded in the layer itself: a name in its work root
    /// (by_number.rs `memory_orphan_name`), held here.
    pub memory: Option<crate::upper::UpperDir>,
}

/// Set as the daemon ends (`Overlay::shutdown`): the records of removed files still open stay
/// for the daemon that takes the mount over, whatever this one lets go of on its way out (an
/// upgrade; a mount that really ends has no such file open, and the next mount clears them).
static KEEP_RECORDS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on every `Orphan` record stays when dropped.
pub fn keep_orphan_records() {
    KEEP_RECORDS.store(true, Ordering::SeqCst);
}

impl Orphan {
    /// Leaves the record in place (until the next mount clears the directory).
    pub fn keep(mut self) {
        self.name.clear();
    }
}

impl Drop for Orphan {
    fn drop(&mut self) {
        if self.name.is_empty() || KEEP_RECORDS.load(Ordering::SeqCst) {
            return;
        }
        let lower = format!("{}.lower", self.name);
        for name in [self.name.as_str(), lower.as_str()] {
            let _ = rustix::fs::unlinkat(&*self.dir, name, rustix::fs::AtFlags::empty());
        }
        if let Some(work) = &self.memory {
            let _ = work.unlink(&crate::overlay::memory_orphan_name(&self.name));
        }
    }
}

/// Pins held at once, at most: far inside the descriptor reserve (file/mod.rs `FdReserve`).
pub const PINS_MAX: usize = 1024;

impl Pin {
    /// A pin of what `open` gives, unless `PINS_MAX` are held (`held` counts them).
    pub fn take(
        held: &Arc<std::sync::atomic::AtomicUsize>,
        open: impl FnOnce() -> Option<crate::upper::UpperFile>,
    ) -> Option<Pin> {
        if held.fetch_add(1, Ordering::Relaxed) >= PINS_MAX {
            held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let held = held.clone();
        let pinned = open().and_then(|object| Some((object.stat().ok()?.ino, object)));
        match pinned {
            Some((upper_ino, object)) => Some(Pin {
                object,
                upper_ino,
                held,
                orphan: None,
            }),
            None => {
                held.fetch_sub(1, Ordering::Relaxed);
                None
            }
        }
    }
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pin")
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl NodeState {
    /// The subdirectories of this directory changed in a way not known: the count goes.
    pub fn subdirs_changed(&mut self) {
        self.subdirs_plus_one = None;
        self.subdirs_gen = self.subdirs_gen.wrapping_add(1);
    }

    /// A change that may make, remove or move a subdirectory starts: counts under way are
    /// not kept (`counted_subdirs`); the count held stays right until the change is done.
    /// False when 255 changes are under way already: this one is not counted in, and its end
    /// (`end_subdirs_change` with `counted_in` false) drops the count.
    pub fn begin_subdirs_change(&mut self) -> bool {
        self.subdirs_gen = self.subdirs_gen.wrapping_add(1);
        match self.subdirs_changing.checked_add(1) {
            Some(n) => {
                self.subdirs_changing = n;
                true
            }
            None => {
                self.subdirs_plus_one = None;
                false
            }
        }
    }

    /// The change begun with `begin_subdirs_change` is over: it added `delta` subdirectories
    /// when known (`Some`), and the count held follows it; otherwise (it failed, perhaps half
    /// done) the count goes. A count held was taken with no change under way, and every
    /// change begun since adds its own delta once, so it stays exact without a recount.
    pub fn end_subdirs_change(&mut self, counted_in: bool, delta: Option<i64>) {
        self.subdirs_gen = self.subdirs_gen.wrapping_add(1);
        if counted_in {
            self.subdirs_changing -= 1;
        }
        let now = match (self.subdirs(), delta.filter(|_| counted_in)) {
            (Some(n), Some(d)) => u64::from(n).checked_add_signed(d),
            _ => None,
        };
        match now {
            Some(n) => self.set_subdirs(n),
            None => self.subdirs_plus_one = None,
        }
    }

    /// The directory's count of subdirectories, if counted since the last change.
    pub fn subdirs(&self) -> Option<u32> {
        self.subdirs_plus_one.map(|n| n.get() - 1)
    }

    /// Keeps `count`, taken from a listing begun at generation `counted_at`, as the
    /// directory's count of subdirectories, unless a change began since or is under way (not
    /// kept past `u32::MAX - 1` either).
    pub fn counted_subdirs(&mut self, counted_at: u16, count: u64) {
        if self.subdirs_gen == counted_at && self.subdirs_changing == 0 {
            self.set_subdirs(count);
        }
    }

    fn set_subdirs(&mut self, count: u64) {
        self.subdirs_plus_one = u32::try_from(count)
            .ok()
            .and_then(|n| n.checked_add(1))
            .and_then(std::num::NonZeroU32::new);
    }

    /// The immutable and append-only flags (`FS_IMMUTABLE_FL`, `FS_APPEND_FL`: bits 4 and
    /// 5), once known.
    pub fn protection(&self) -> Option<u32> {
        (self.protection & PROTECTION_KNOWN != 0).then(|| u32::from(self.protection & 0x0f) << 4)
    }

    pub fn set_protection(&mut self, flags: Option<u32>) {
        debug_assert!(flags.is_none_or(|f| f & !0xf0 == 0), "{flags:?}");
        self.protection = flags.map_or(0, |f| PROTECTION_KNOWN | ((f >> 4) & 0x0f) as u8);
    }

    /// What few nodes have: nothing, for most.
    pub fn rare(&self) -> &Rare {
        self.rare.as_deref().unwrap_or(&NO_RARE)
    }

    pub fn rare_mut(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Default::default)
    }
}

pub struct Node {
    /// The FUSE node id: the table's key and the kernel's name for this inode.
    pub ino: Ino,
    /// For an object's own node id, its generation (`generation`): bumped when the number is
    /// reused for a new object while the kernel may still hold the old one (upper file
    /// systems reuse inode numbers), as the kernel tells the two apart by (nodeid,
    /// generation) and would otherwise take the new directory for the dead one. For a second
    /// identity (see `retire`), whose generation is always 0: the object's own number, which
    /// `stat` shows (`st_ino`). One field for both: 8 bytes in every node.
    generation_or_number: AtomicU64,
    /// The state, and the lock serialising copy-up of the object, inline: the node is one
    /// allocation. A second identity uses its primary's (`primary`) and leaves its own unused.
    shared: Shared,
    /// For a second identity: the object's own node, whose state every identity shares.
    primary: Option<Arc<Node>>,
    lookups: AtomicU64,
    /// For a directory: changes to its entries (see the top of this file). A second identity
    /// (`retire`, regular files only) has its own, unused.
    pub entries: ChangeSeq,
    /// How the kernel inode behind this node id does I/O (its passthrough binding), made at
    /// its first open (`io`): most nodes are never opened (directories, files only looked at).
    io: once_cell::race::OnceBox<NodeIo>,
    /// `SELF`, `RETIRED` or the node id of this object's second identity. Changed only under
    /// the write lock of this node's shard.
    current: AtomicU64,
    /// The parent whose reference this node keeps (`InodeTable::hold_parent`), or 0.
    held_parent: AtomicU64,
    /// Kept in the table after the kernel forgets it (`keep`): the node knows what the layers
    /// do not say and a lookup by another name could not find again.
    kept: std::sync::atomic::AtomicBool,
    /// When the kernel was last given an entry for this node (`clock` seconds): a LOOKUP,
    /// CREATE or READDIRPLUS reply, each counted in `lookups`. A listing spares the lookup of
    /// an entry the kernel was given moments ago (`told_within`).
    told: AtomicU32,
}

/// `Node::told` of a node whose entry the kernel holds no longer.
const NOT_HELD: u32 = u32::MAX;

/// Whole seconds since the daemon's first call: the clock of `Node::told`.
fn clock() -> u32 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(std::time::Instant::now);
    u32::try_from(start.elapsed().as_secs()).map_or(NOT_HELD - 1, |s| s.min(NOT_HELD - 1))
}

/// Nodes the kernel forgot since the daemon started, and that count at the last trim
/// (`give_back_now_and_then`, `give_back_after_forgets`).
static FORGOTTEN: AtomicU64 = AtomicU64::new(0);
static FORGOTTEN_AT_TRIM: AtomicU64 = AtomicU64::new(0);

/// After every `TRIM_EVERY` forgotten nodes, asks the allocator to give the pages no
/// allocation uses any more back to the system (glibc's `malloc_trim`): when the kernel drops
/// its inodes (memory pressure, `drop_caches`), the daemon's memory falls with it rather than
/// staying at its high-water mark. Their records (`Records`) are kept out of the heap, so
/// whole pages come free. About a millisecond per 100 MiB of heap, once per 16,384 forgets.
fn give_back_now_and_then() {
    const TRIM_EVERY: u64 = 16_384;
    let n = FORGOTTEN.fetch_add(1, Ordering::Relaxed) + 1;
    if n - FORGOTTEN_AT_TRIM.load(Ordering::Relaxed) >= TRIM_EVERY {
        trim(n);
    }
}

/// At the end of a batch of FORGETs: trims when the nodes forgotten since the last trim are
/// many. The kernel forgets in bursts (memory pressure, `drop_caches`) of batches; counting
/// alone left up to 16,383 nodes' memory of a burst's tail resident until the next burst, so a
/// churning daemon's RSS a second after each `drop_caches` went 14.8 to 26 MiB depending on
/// where the count stood (bench/soak.py with `mosaicfs status` beside it).
///
/// Fewer than that are trimmed once the forgetting stops (`trim_when_quiet`): the nodes a
/// burst's last batches forget after its last trim lie scattered over the heap, and each
/// kept its page resident — up to a thousand pages. A churning daemon's private memory a
/// second after each `drop_caches` went from 0.6 to 4.7 MiB and back from one minute to
/// the next, depending on how many nodes the tail held (bench/soak.py, 2026-11-30).
pub fn give_back_after_forgets() {
    const TRIM_AFTER: u64 = 1_024;
    let n = FORGOTTEN.load(Ordering::Relaxed);
    let since = n - FORGOTTEN_AT_TRIM.load(Ordering::Relaxed);
    if since >= TRIM_AFTER {
        trim(n);
    } else if since > 0 {
        trim_when_quiet();
    }
}

/// Whether a thread of `trim_when_quiet` is waiting for the forgetting to stop.
static TRIM_WAITING: AtomicBool = AtomicBool::new(false);

/// Trims once no node has been forgotten for `QUIET`, from a thread that lives only that long
/// (an idle mount keeps no thread for it; one is started per burst of FORGETs, about 100 us).
/// A batch that ends while the thread is leaving may go untrimmed until the next burst: memory
/// given back later, never a wrong answer.
fn trim_when_quiet() {
    const QUIET: std::time::Duration = std::time::Duration::from_millis(250);
    if TRIM_WAITING.swap(true, Ordering::SeqCst) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("mosaicfs-trim".into())
        .stack_size(64 << 10)
        .spawn(|| {
            let mut seen = FORGOTTEN.load(Ordering::SeqCst);
            loop {
                std::thread::sleep(QUIET);
                let now = FORGOTTEN.load(Ordering::SeqCst);
                if now == seen {
                    break;
                }
                seen = now;
            }
            TRIM_WAITING.store(false, Ordering::SeqCst);
            let n = FORGOTTEN.load(Ordering::SeqCst);
            if n != FORGOTTEN_AT_TRIM.load(Ordering::Relaxed) {
                trim(n);
            }
        });
    if spawned.is_err() {
        // No thread now (a thread limit): the next batch tries again.
        TRIM_WAITING.store(false, Ordering::SeqCst);
    }
}

fn trim(forgotten: u64) {
    FORGOTTEN_AT_TRIM.store(forgotten, Ordering::Relaxed);
    crate::sys::give_back_free_memory();
}

/// What every identity of one object shares.
struct Shared {
    state: Mutex<NodeState>,
    copy_up: Mutex<()>,
}

/// `Node::current`: lookups name this node id.
const SELF: u64 = 0;
/// `Node::current`: lookups name a second identity, made on the next lookup.
const RETIRED: u64 = u64::MAX;
/// Second identities are numbered from here up; `InoMap` never makes a number this high.
pub const ALIAS_BASE: u64 = 1 << 63;
/// In a second identity's record (`set_alias_records`), beside its object's number (always
/// below `ALIAS_BASE`): a daemon opened it (`mark_opened`).
const ALIAS_OPENED: u64 = 1 << 63;

impl Node {
    fn new(ino: Ino, generation: u64, state: NodeState) -> Node {
        Node {
            ino,
            generation_or_number: AtomicU64::new(generation),
            shared: Shared {
                state: Mutex::new(state),
                copy_up: Mutex::new(()),
            },
            primary: None,
            lookups: AtomicU64::new(0),
            entries: ChangeSeq::default(),
            io: Default::default(),
            current: AtomicU64::new(SELF),
            held_parent: AtomicU64::new(0),
            kept: Default::default(),
            told: AtomicU32::new(clock()),
        }
    }

    /// A second identity of this object under node id `ino`: same state, own kernel inode.
    fn alias(self: &Arc<Node>, ino: Ino) -> Node {
        debug_assert!(ino >= ALIAS_BASE && !self.is_alias());
        let unused = NodeState::new(&Found {
            ino,
            kind: 0,
            upper: false,
            lower: None,
            origin: false,
            origins: false,
            upper_ino: None,
            generation: None,
        });
        Node {
            ino,
            generation_or_number: AtomicU64::new(self.st_ino()),
            shared: Shared {
                state: Mutex::new(unused),
                copy_up: Mutex::new(()),
            },
            primary: Some(self.clone()),
            lookups: AtomicU64::new(1),
            entries: ChangeSeq::default(),
            io: Default::default(),
            current: AtomicU64::new(SELF),
            held_parent: AtomicU64::new(0),
            kept: Default::default(),
            told: AtomicU32::new(clock()),
        }
    }

    /// Keeps the node in the table after the kernel forgets it, for as long as the object has
    /// a name: a lower hard link whose names this mount removed (`lower_names_gone`), looked
    /// up by two names or more (a copy-up joins the names it knows), or copied up (the others
    /// join the copy at their lookup, `copied_up_link_of`). Nothing on disk
    /// says either before a remount, so a node made anew by a lookup would count the lower
    /// file's names, or show another name as the lower file with its old content. Costs the
    /// node's memory for each such file until the unmount: even once every name the node
    /// knows is gone, the lower file may have others no lookup has named yet.
    pub fn keep(&self) {
        self.kept.store(true, Ordering::Relaxed);
    }

    /// One more kernel reference: the kernel was just given an entry for this node.
    fn count_reference(&self) {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        self.told.store(clock(), Ordering::Relaxed);
    }

    /// Whether the kernel holds this node id and was given an entry for it less than half of
    /// `ttl` ago, so that the entry and its attributes are still valid in its caches for a
    /// while longer. Seconds are whole: a `ttl` under 2 s is never enough.
    pub fn told_within(&self, ttl: std::time::Duration) -> bool {
        let told = self.told.load(Ordering::Relaxed);
        let age = u64::from(clock().saturating_sub(told));
        told != NOT_HELD
            && self.lookups.load(Ordering::Relaxed) > 0
            && self.current.load(Ordering::Relaxed) == SELF
            && (age + 1) * 2 <= ttl.as_secs()
    }

    /// The kernel dropped its entry for this node (it does for a directory whose mode or
    /// ACL changed, to check access again): the next listing gives the whole entry.
    pub fn entry_dropped(&self) {
        self.told.store(NOT_HELD, Ordering::Relaxed);
    }

    /// How the kernel inode behind this node id does I/O.
    pub fn io(&self) -> &NodeIo {
        self.io.get_or_init(Box::default)
    }

    /// What every identity of the object shares: the primary's.
    fn shared(&self) -> &Shared {
        self.primary.as_ref().map_or(&self.shared, |p| &p.shared)
    }

    pub fn state(&self) -> MutexGuard<'_, NodeState> {
        self.shared()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub fn kind(&self) -> u32 {
        self.state().kind
    }

    /// Serialises copy-up of this object (held across the copy, unlike the state's lock).
    pub fn copy_up_lock(&self) -> MutexGuard<'_, ()> {
        self.shared()
            .copy_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Its most recent name, for the record of where it was once forgotten.
    fn last_place(&self) -> Place {
        let st = self.state();
        let first = st.links.first().filter(|_| !st.unlinked);
        first.map(|(p, name)| (*p, name.clone()))
    }

    pub fn generation(&self) -> u64 {
        if self.is_alias() {
            0
        } else {
            self.generation_or_number.load(Ordering::Relaxed)
        }
    }

    /// The inode number `stat` shows: `ino`, except for a second identity (see `retire`).
    pub fn st_ino(&self) -> Ino {
        if self.is_alias() {
            self.generation_or_number.load(Ordering::Relaxed)
        } else {
            self.ino
        }
    }

    pub fn is_dir(&self) -> bool {
        self.kind() == libc::S_IFDIR
    }

    /// Whether the kernel may hold this node id from a daemon before this one, bound to a
    /// backing file that daemon registered (`InodeTable::fresh_file_ids`): a second identity
    /// made before `first_alias`, or an object's own number once lookups no longer hand it out
    /// (a file this daemon made keeps handing out its own).
    pub fn from_before(&self, first_alias: Ino) -> bool {
        if self.is_alias() {
            self.ino < first_alias
        } else {
            self.current.load(Ordering::Relaxed) != SELF
        }
    }

    /// Whether this is a second identity (never bound to a lower file).
    pub fn is_alias(&self) -> bool {
        self.ino >= ALIAS_BASE
    }

    /// Whether lookups of this object name another node id now (`retire`): opens still made
    /// through this one come through a descriptor, not a name (/proc/self/fd,
    /// open_by_handle_at), so the kernel cannot retry them under a new inode.
    pub fn is_retired(&self) -> bool {
        !self.is_alias() && self.current.load(Ordering::Relaxed) != SELF
    }

    /// Whether the object has had another kernel inode besides this one (`retire`): each has
    /// a page cache of its own, and a write through one does not reach the other's.
    pub fn has_two_identities(&self) -> bool {
        self.is_alias() || self.current.load(Ordering::Relaxed) != SELF
    }
}

impl NodeState {
    fn new(found: &Found) -> NodeState {
        NodeState {
            kind: found.kind,
            links: Links::default(),
            upper: found.upper,
            lower: found.lower.clone(),
            unlinked: false,
            has_origin: found.origin,
            origins: found.origins,
            open: Weak::new(),
            subdirs_plus_one: None,
            subdirs_gen: 0,
            subdirs_changing: 0,
            rare: None,
            protection: 0,
        }
    }
}

/// Gives back most of a shard's room once it holds an eighth of what it could: a hash map
/// keeps its peak capacity, which after the kernel forgot a walk of 100,000 files was 2 MiB of
/// empty tables. Shrunk to twice what it holds, it grows again only after as many more
/// inserts as half of that, so a table going up and down costs a rehash now and then. An
/// empty one gives back all of it: the 64 shards' least tables (4.4 KiB each) were 280 KiB of
/// a daemon whose kernel had forgotten every inode, in pages of their own among the nodes.
fn shrink_when_emptied<V>(map: &mut HashMap<Ino, V>) {
    const KEEP: usize = 128;
    if map.is_empty() {
        if map.capacity() > 0 {
            *map = HashMap::new();
        }
    } else if map.capacity() > KEEP && map.len() * 8 < map.capacity() {
        map.shrink_to((map.len() * 2).max(KEEP));
    }
}

/// What a lookup found, to be recorded in the table.
#[derive(Debug, Clone)]
pub struct Found {
    pub ino: Ino,
    pub kind: u32,
    pub upper: bool,
    pub lower: Option<LowerRef>,
    /// The upper object carries `mosaicfs.origin` (it was copied up).
    pub origin: bool,
    /// For a directory: its upper part is marked `mosaicfs.origins` (see layers::DirFlags).
    pub origins: bool,
    /// The upper object's own inode number in the upper layer, where known (`ino` is its
    /// origin's for a copy-up): tells a pinned object from another copy of the same origin.
    pub upper_ino: Option<u64>,
    /// For an object numbered by its upper inode: the generation its number carries, the same
    /// in every mount (`Attr::stable_generation`), so that a file handle taken before a
    /// remount finds it, and one of an object the upper file system gave the same number
    /// before does not. `None`: numbered by a lower object (lower layers never give a number
    /// twice), or no birth time to take it from; such numbers count generations in the table.
    pub generation: Option<u64>,
}

/// The generation of a new object under a number that had generation `old` (if the table
/// remembers one): its stable generation where it has one and that differs, else the next.
/// Kept below 2^32: the kernel stores 32 bits and compares them with the whole reply, so a
/// larger one would make every lookup of the inode look like a new object.
fn next_generation(old: Option<u64>, stable: Option<u64>) -> u64 {
    let next = |g: u64| (g + 1) & 0xffff_ffff;
    match (old, stable) {
        (Some(old), Some(g)) if g == old => next(old),
        (_, Some(g)) => g,
        (Some(old), None) => next(old),
        (None, None) => 0,
    }
}

const SHARDS: usize = 64;

type Shard = RwLock<ShardMap>;

#[derive(Default)]
struct ShardMap {
    nodes: HashMap<Ino, Arc<Node>>,
}

/// A forgotten node's parent and name, `None` once its last known name was removed.
type Place = Option<(Ino, Name)>;

/// What the table knows of a number it holds no node for (`InodeTable::seen`).
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    /// Named `.1` in the directory `.0` when last seen.
    At(Ino, OsString),
    /// Its last known name was removed.
    Gone,
    /// Never seen, or the record was dropped or could not hold its name.
    Unknown,
}

pub struct InodeTable {
    shards: Box<[Shard]>,
    /// Where nodes the kernel forgot were last seen, and their generations: what a file
    /// handle needs after `drop_caches` (`Overlay::lookup_by_number`), and what keeps a handle
    /// of a removed object from opening a new object made under its number later in the
    /// mount (the new one gets the next generation, `insert_new`). A record is written in the
    /// same hold of the shard's lock that removes the node.
    records: Records,
    next_alias: AtomicU64,
    /// `keep_directories`.
    keep_dirs: std::sync::atomic::AtomicBool,
    /// `set_alias_records`.
    alias_records: std::sync::OnceLock<Arc<std::os::fd::OwnedFd>>,
    /// `fresh_file_ids`, and the first second identity made since.
    fresh_files: std::sync::atomic::AtomicBool,
    first_alias: AtomicU64,
    /// Scans of the tree begun (`begin_scan`); records carry the count at their writing.
    scans: AtomicU64,
    /// The scan that last saw the whole tree and recorded every object in it
    /// (`Overlay::scan_for`), or 0; reset when a record is dropped. Since that scan, a number
    /// neither held nor recorded names nothing, nor does one recorded gone before it began.
    whole: AtomicU64,
}

impl InodeTable {
    pub fn new(
        root_upper: bool,
        root_lower: Option<LowerRef>,
        root_origins: bool,
        records: Records,
    ) -> Self {
        let shards: Vec<_> = (0..SHARDS).map(|_| RwLock::default()).collect();
        let table = InodeTable {
            shards: shards.into_boxed_slice(),
            records,
            next_alias: AtomicU64::new(ALIAS_BASE),
            keep_dirs: Default::default(),
            alias_records: Default::default(),
            fresh_files: Default::default(),
            first_alias: AtomicU64::new(ALIAS_BASE),
            scans: AtomicU64::new(1),
            whole: AtomicU64::new(0),
        };
        let mut state = NodeState::new(&Found {
            ino: ROOT_INO,
            kind: libc::S_IFDIR,
            upper: root_upper,
            lower: root_lower,
            origin: false,
            origins: root_origins,
            upper_ino: None,
            generation: None,
        });
        state.links.push((ROOT_INO, Name::new(OsStr::new(""))));
        let root = Node::new(ROOT_INO, 0, state);
        root.lookups.store(1, Ordering::Relaxed);
        table
            .shard(ROOT_INO)
            .write()
            .unwrap()
            .nodes
            .insert(ROOT_INO, Arc::new(root));
        table
    }

    fn shard(&self, ino: Ino) -> &Shard {
        // Inode numbers of one file system are dense; mix the bits so shards fill evenly.
        let h = ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58;
        &self.shards[h as usize % SHARDS]
    }

    fn write(&self, ino: Ino) -> std::sync::RwLockWriteGuard<'_, ShardMap> {
        self.shard(ino).write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, ino: Ino) -> Option<Arc<Node>> {
        self.shard(ino)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .nodes
            .get(&ino)
            .cloned()
    }

    /// The node `ino` with one more reference counted, if the table holds it.
    pub fn get_counted(&self, ino: Ino) -> Option<Arc<Node>> {
        // Under the read lock: `forget` changes counts under the write lock only.
        let shard = self.shard(ino).read().unwrap_or_else(|e| e.into_inner());
        let node = shard.nodes.get(&ino)?;
        node.count_reference();
        Some(node.clone())
    }

    /// Where the forgotten node `ino` was last seen.
    pub fn seen(&self, ino: Ino) -> Seen {
        let _shard = self.shard(ino).read().unwrap_or_else(|e| e.into_inner());
        self.records.get(ino).map_or(Seen::Unknown, |r| r.seen)
    }

    /// Whether `ino`, which the table holds no node for, surely names nothing: the last whole
    /// scan found it nowhere and nothing recorded it since.
    pub fn surely_gone(&self, ino: Ino) -> bool {
        let whole = self.whole.load(Ordering::Relaxed);
        if whole == 0 {
            return false;
        }
        let shard = self.shard(ino).read().unwrap_or_else(|e| e.into_inner());
        if shard.nodes.contains_key(&ino) {
            return false;
        }
        match self.records.get(ino) {
            None => true,
            Some(r) => r.seen == Seen::Gone && r.epoch < whole,
        }
    }

    /// Starts a scan of the tree: its number, for `scanned_whole`.
    pub fn begin_scan(&self) -> u64 {
        self.scans.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The scan `epoch` saw the whole tree and recorded all of it.
    pub fn scanned_whole(&self, epoch: u64) {
        self.whole.store(epoch, Ordering::Relaxed);
    }

    /// Records that `ino` is named `name` in `parent` (a scan of the tree), unless the table
    /// holds it. False if the record had no room.
    pub fn note_seen(&self, ino: Ino, parent: Ino, name: &OsStr) -> bool {
        let shard = self.write(ino);
        if shard.nodes.contains_key(&ino) {
            return true;
        }
        let generation = self.records.get(ino).map_or(0, |r| r.generation);
        self.depart(&shard, ino, Some((parent, name)), generation)
    }

    /// Records where `ino` was last seen (`records`), under its shard's lock. False if the
    /// table knows less than before (another number's record displaced): a whole scan then no
    /// longer vouches for numbers it does not hold.
    fn depart(
        &self,
        _shard: &ShardMap,
        ino: Ino,
        place: Option<(Ino, &OsStr)>,
        generation: u64,
    ) -> bool {
        let epoch = self.scans.load(Ordering::Relaxed);
        let kept = self.records.put(ino, place, generation, epoch);
        if !kept {
            self.whole.store(0, Ordering::Relaxed);
        }
        kept
    }

    /// Lets `node`, found by its number with no kernel reference on its parent, keep the
    /// reference on `parent` that finding it counted, until the kernel forgets `node`: the
    /// parent chain must stay in the table while the kernel holds a node (paths are built from
    /// it). A node that keeps one already gives this one back.
    pub fn hold_parent(&self, node: &Node, parent: Ino) {
        if node
            .held_parent
            .compare_exchange(0, parent, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            self.forget(parent, 1);
        }
    }

    /// Keeps the directories above `node` in the table for as long as it stays: `node`, found
    /// by its number, may be one whose FORGET is on its way, and so may each directory above
    /// it — the kernel forgot them all, and the daemon's workers take their FORGETs in any
    /// order. From `node` up to the root, each keeps a counted reference on the directory it is
    /// named in (`hold_parent`) unless it keeps one already. `None` once that holds; where
    /// `node` was last named if a directory on the way has left the table already, so that no
    /// path to `node` can be built until it is found again by that name.
    pub fn hold_up(&self, node: &Node) -> Option<(Ino, OsString)> {
        let place = node.last_place()?;
        let mut up: Option<Arc<Node>> = None;
        let mut parent = place.0;
        for _ in 0..4096 {
            if parent == ROOT_INO {
                return None;
            }
            let child = up.as_deref().unwrap_or(node);
            let found = match child.held_parent.load(Ordering::Relaxed) {
                0 => self
                    .get_counted(parent)
                    .inspect(|_| self.hold_parent(child, parent)),
                _ => self.get(parent),
            };
            let Some(dir) = found else {
                return Some((place.0, place.1.as_os_str().to_os_string()));
            };
            // A directory without a name holds nothing above it.
            (parent, _) = dir.last_place()?;
            up = Some(dir);
        }
        None
    }

    /// Records a lookup of `name` in `parent` and counts one kernel reference to it.
    pub fn remember(&self, parent: Ino, name: &OsStr, found: &Found) -> Arc<Node> {
        self.remember_if(parent, name, found, || true)
            .expect("an unconditional record")
    }

    /// `remember`, if `still()` holds while the inode's state is locked: that is, if no change
    /// overtook what `found` says (every change updates the state under that lock after its
    /// sequence says it started). Otherwise records nothing and returns `None`.
    pub fn remember_if(
        &self,
        parent: Ino,
        name: &OsStr,
        found: &Found,
        still: impl Fn() -> bool,
    ) -> Option<Arc<Node>> {
        let node = self.counted(found);
        {
            let mut st = node.state();
            if !still() {
                drop(st);
                self.forget(node.ino, 1);
                return None;
            }
            // Found unlinked, the number names a new object, except where it cannot: a
            // lower-only object that was lower-only before (lower layers do not change: this
            // is another name of a lower hard link), or the pinned upper object itself (its
            // upper number cannot have been given to another; a copy-up numbered by its origin
            // may be another copy of that lower file, with another upper number). The kernel
            // inode of the removed name, still open perhaps, must then stay good.
            let same = if found.upper {
                st.rare()
                    .pin
                    .as_ref()
                    .is_some_and(|p| Some(p.upper_ino) == found.upper_ino)
            } else {
                !st.upper
            };
            let reused = st.kind != found.kind || st.unlinked && !same;
            if !node.is_alias() && reused {
                // A new object under a number the old one left behind.
                let old = node.generation();
                node.generation_or_number.store(
                    next_generation(Some(old), found.generation),
                    Ordering::Relaxed,
                );
                st.open = Weak::new();
                st.links.clear();
                st.set_protection(None);
            }
            if st.upper != found.upper || st.lower != found.lower || st.links.is_empty() {
                st.subdirs_changed();
            }
            st.kind = found.kind;
            st.upper = found.upper;
            st.lower = found.lower.clone();
            st.has_origin = found.origin;
            // The mark is only ever added, and a move into the directory adds it while this
            // lookup may have read the layers or the node before (dir.rs
            // `note_origin_moved_into`): keep it unless the number names a new object.
            st.origins = found.origins || st.origins && !reused;
            st.unlinked = false;
            let link = (parent, Name::new(name));
            let known = st.links.iter().position(|l| *l == link);
            if let Some(pos) = known {
                // Most recent name first: it is the one known to be valid right now.
                st.links.make_first(pos);
            } else {
                st.links.push_first(link);
                // A lower hard link known by two names: a copy-up joins the names it knows
                // (`Node::keep`), so they must outlive the kernel forgetting the inode.
                if !st.upper && st.kind != libc::S_IFDIR && st.links.len() > 1 {
                    node.keep();
                }
            }
        }
        Some(node)
    }

    /// The node a lookup of `found` names, its kernel reference counted: the object's own
    /// number, or its second identity once the first was retired.
    fn counted(&self, found: &Found) -> Arc<Node> {
        loop {
            let (primary, current) = {
                let mut shard = self.write(found.ino);
                let records = &self.records;
                let node = shard.nodes.entry(found.ino).or_insert_with(|| {
                    // Found again: the object keeps the generation its handles carry.
                    let kept = records.take(found.ino);
                    let generation = found.generation.or(kept).unwrap_or(0);
                    let node = Node::new(found.ino, generation, NodeState::new(found));
                    if found.kind == libc::S_IFREG && self.fresh_files.load(Ordering::Relaxed) {
                        node.current.store(RETIRED, Ordering::Relaxed);
                    }
                    Arc::new(node)
                });
                let current = node.current.load(Ordering::Relaxed);
                if current == SELF {
                    node.count_reference();
                    return node.clone();
                }
                (node.clone(), current)
            };
            if current == RETIRED {
                // Shards are locked one at a time (the alias may hash to the same one).
                let alias = self.new_alias(&primary);
                self.write(alias.ino).nodes.insert(alias.ino, alias.clone());
                let shard = self.write(found.ino);
                match shard.nodes.get(&found.ino) {
                    Some(p)
                        if Arc::ptr_eq(p, &primary)
                            && p.current.load(Ordering::Relaxed) == RETIRED =>
                    {
                        p.current.store(alias.ino, Ordering::Relaxed);
                        return alias;
                    }
                    _ => {
                        drop(shard);
                        self.write(alias.ino).nodes.remove(&alias.ino);
                        continue;
                    }
                }
            }
            if let Some(alias) = self.write(current).nodes.get(&current) {
                alias.count_reference();
                return alias.clone();
            }
            // The second identity was forgotten meanwhile (forget resets `current`): retry.
            let shard = self.write(found.ino);
            if let Some(p) = shard.nodes.get(&found.ino)
                && p.current.load(Ordering::Relaxed) == current
            {
                p.current.store(RETIRED, Ordering::Relaxed);
            }
        }
    }

    /// Directories stay in the table once known, whatever the kernel forgets: in a daemon that
    /// took a mount over (takeover.rs), counts of the nodes the kernel got from the daemon
    /// before are not exact — such a node is counted once for all the kernel's references, and
    /// a directory met on the way to one only for its child — so a FORGET could drop a
    /// directory whose children's paths still lead through it. Directories are few; each
    /// costs its node until the unmount.
    pub fn keep_directories(&self) {
        self.keep_dirs.store(true, Ordering::Relaxed);
    }

    /// Second identities are recorded in `records` (a file of the work dir, by_number.rs): the
    /// object number of `ALIAS_BASE + i` at byte `8 * i`, written before the kernel hears of
    /// it, so that a daemon taking the mount over (takeover.rs) finds the object of every node
    /// id the kernel holds. Numbering goes on from the records `start` already holds.
    pub fn set_alias_records(&self, records: Arc<std::os::fd::OwnedFd>, start: u64) {
        self.next_alias.store(ALIAS_BASE + start, Ordering::Relaxed);
        let _ = self.alias_records.set(records);
    }

    /// The object number recorded for second identity `ino` (`set_alias_records`).
    pub fn recorded_alias(&self, ino: Ino) -> Option<Ino> {
        self.alias_record(ino).map(|r| r & !ALIAS_OPENED)
    }

    /// The record of second identity `ino` as written: its object's number, with
    /// `ALIAS_OPENED` where a daemon opened it.
    fn alias_record(&self, ino: Ino) -> Option<u64> {
        let records = self.alias_records.get()?;
        let at = ino.checked_sub(ALIAS_BASE)?.checked_mul(8)?;
        let mut buf = [0u8; 8];
        match rustix::io::pread(&**records, &mut buf, at) {
            Ok(8) => Some(u64::from_le_bytes(buf)).filter(|&n| n != 0),
            _ => None,
        }
    }

    /// Whether second identity `ino` was never opened by any daemon (`mark_opened`): the
    /// kernel inode under it was never bound to a file, so that a daemon taking the mount over
    /// may open it as one of its own. False where the record cannot be read.
    pub fn never_opened(&self, ino: Ino) -> bool {
        self.alias_record(ino)
            .is_some_and(|r| r & ALIAS_OPENED == 0)
    }

    /// Records that second identity `alias` is being opened, before the kernel hears of the
    /// open (`never_opened`): the kernel inode may be bound to this daemon's backing file or
    /// I/O mode from now on, which a daemon after it could not match. Where the record cannot
    /// be written, a later daemon reads the old one and opens the node as unopened; the
    /// warning says so. Written once: a read of the page-cached record is all a later open
    /// costs (a write would take the file's lock, which every worker's opens share).
    pub fn mark_opened(&self, alias: &Node) {
        let Some(records) = self.alias_records.get() else {
            return;
        };
        if !self.never_opened(alias.ino) {
            return;
        }
        let at = (alias.ino - ALIAS_BASE) * 8;
        let record = alias.st_ino() | ALIAS_OPENED;
        if let Err(e) = rustix::io::pwrite(&**records, &record.to_le_bytes(), at) {
            log::warn!(
                "cannot record the open of node id {} in the work dir ({e}): a daemon that \
                 takes the mount over may fail to open it (EIO)",
                alias.ino
            );
        }
    }

    /// The first second identity this daemon made (`set_alias_records`): lower ones are an
    /// earlier daemon's.
    pub fn first_alias(&self) -> Ino {
        self.first_alias.load(Ordering::Relaxed)
    }

    /// From now on a regular file found by a lookup gets a node id of its own rather than its
    /// object number (its primary node starts retired, `counted`): in a daemon that took over
    /// a mount whose files pass through, the kernel inode under the object number may still be
    /// bound to a backing file the daemon before registered (takeover.rs).
    pub fn fresh_file_ids(&self) {
        self.first_alias
            .store(self.next_alias.load(Ordering::Relaxed), Ordering::Relaxed);
        self.fresh_files.store(true, Ordering::Relaxed);
    }

    pub fn fresh_files(&self) -> bool {
        self.fresh_files.load(Ordering::Relaxed)
    }

    /// A node for second identity `ino` of `primary`, made by an earlier daemon, counted once
    /// for the kernel's references (takeover.rs). The primary's own identity is left as it is.
    pub fn adopt_alias(&self, primary: &Arc<Node>, ino: Ino) -> Arc<Node> {
        let mut shard = self.write(ino);
        if let Some(n) = shard.nodes.get(&ino) {
            return n.clone();
        }
        let alias = Arc::new(primary.alias(ino));
        shard.nodes.insert(ino, alias.clone());
        alias
    }

    /// Makes a new second identity of `primary` and records it (`set_alias_records`).
    fn new_alias(&self, primary: &Arc<Node>) -> Arc<Node> {
        let ino = self.next_alias.fetch_add(1, Ordering::Relaxed);
        if let Some(records) = self.alias_records.get() {
            let at = (ino - ALIAS_BASE) * 8;
            if let Err(e) = rustix::io::pwrite(&**records, &primary.st_ino().to_le_bytes(), at) {
                log::warn!(
                    "cannot record node id {ino} in the work dir ({e}): a daemon that takes \
                     the mount over answers ESTALE for it"
                );
            }
        }
        Arc::new(primary.alias(ino))
    }

    /// Makes lookups of `node`'s object name a new node id from now on, while the kernel inode
    /// behind `node` lives on for the handles open on it. The kernel binds an inode to the one
    /// backing file its passthrough handles use; a handle that needs another (or none) gets a
    /// new kernel inode this way (see file/mod.rs, `IoMode`). Returns false for a second identity.
    pub fn retire(&self, node: &Node) -> bool {
        if node.is_alias() {
            return false;
        }
        let shard = self.write(node.ino);
        if let Some(p) = shard.nodes.get(&node.ino)
            && std::ptr::eq(Arc::as_ptr(p), node)
            && p.current.load(Ordering::Relaxed) == SELF
        {
            p.current.store(RETIRED, Ordering::Relaxed);
        }
        true
    }

    /// Records an object that lost its last name while open, found again after a takeover
    /// (by_number.rs, orphans), and counts one kernel reference.
    pub fn remember_orphan(&self, found: &Found) -> Arc<Node> {
        let mut state = NodeState::new(found);
        state.unlinked = true;
        self.insert_new(found.ino, state, found.generation)
    }

    /// Records an object that has no name yet (O_TMPFILE) and counts one kernel reference.
    pub fn remember_unnamed(&self, found: &Found) -> Arc<Node> {
        let mut state = NodeState::new(found);
        state.upper = true;
        state.lower = None;
        state.unlinked = true;
        state.has_origin = false;
        state.origins = false;
        self.insert_new(found.ino, state, found.generation)
    }

    /// Records an object this mount has just made as `name` in `parent` (mkdir, mknod,
    /// symlink, create) and counts one kernel reference. Its number is free in the layer, but
    /// not always here: the object that had it may have been removed by a rename over it a
    /// moment ago, with that rename still to forget its name. A made object is never the old
    /// one, so it gets a node of its own instead of joining the old node's names (the kernel,
    /// given the old generation, would take the two for one inode and apply the rename's
    /// nlink drop to the new file).
    pub fn remember_new(&self, parent: Ino, name: &OsStr, found: &Found) -> Arc<Node> {
        let mut state = NodeState::new(found);
        state.links.push((parent, Name::new(name)));
        self.insert_new(found.ino, state, found.generation)
    }

    /// `stable`: the generation the object's number carries in every mount (`Found::generation`).
    fn insert_new(&self, ino: Ino, state: NodeState, stable: Option<u64>) -> Arc<Node> {
        let mut shard = self.write(ino);
        // The kernel may still hold the number's old object, or a file handle of it: a new
        // generation tells them apart, and its references stay counted here until it forgets
        // them.
        let (old, held) = match shard.nodes.get(&ino) {
            Some(old) => (Some(old.generation()), old.lookups.load(Ordering::Relaxed)),
            None => (self.records.take(ino), 0),
        };
        let generation = next_generation(old, stable);
        let node = Arc::new(Node::new(ino, generation, state));
        node.lookups.store(held + 1, Ordering::Relaxed);
        shard.nodes.insert(ino, node.clone());
        node
    }

    /// Drops `n` kernel references; the inode is forgotten when none is left, and where it was
    /// is recorded (`Records`). A node found by its number gives back the reference on its
    /// parent it kept (`hold_parent`).
    pub fn forget(&self, ino: Ino, n: u64) {
        let mut next = Some((ino, n));
        while let Some((ino, n)) = next.take() {
            if let Some(node) = self.forget_one(ino, n) {
                let held = node.held_parent.load(Ordering::Relaxed);
                next = (held != 0).then_some((held, 1));
                drop(node);
                give_back_now_and_then();
            }
        }
    }

    /// `forget` of one node: the node if it left the table.
    ///
    /// A node leaves the table and its record (`Records`) is written in one hold of the
    /// shard: a look in between would find the number neither held nor recorded, which after a
    /// whole scan means "names nothing" (`surely_gone`: a directory's file handle answered
    /// ESTALE after `drop_caches`), and a lookup there would make a node of generation 0 for
    /// an object whose handles carry another. Where the node was is read from its state
    /// before the shard is locked (no state lock is taken under a shard's), and read again if
    /// the count it was read for changed meanwhile.
    fn forget_one(&self, ino: Ino, n: u64) -> Option<Arc<Node>> {
        if ino == ROOT_INO {
            return None;
        }
        // Read before the shard is locked: no state lock is taken under a shard's (a node's
        // kind never changes).
        let kept_dir =
            self.keep_dirs.load(Ordering::Relaxed) && self.get(ino).is_some_and(|n| n.is_dir());
        let mut read: Option<(Arc<Node>, Place)> = None;
        loop {
            let mut shard = self.write(ino);
            let node = shard.nodes.get(&ino)?;
            let left = node.lookups.load(Ordering::Relaxed).saturating_sub(n);
            let current = node.current.load(Ordering::Relaxed);
            // A retired node whose second identity lives stays, to lead lookups there; a kept
            // one stays for its state (`keep`).
            if left > 0
                || (current != SELF && current != RETIRED)
                || node.kept.load(Ordering::Relaxed)
                || kept_dir
            {
                node.lookups.store(left, Ordering::Relaxed);
                return None;
            }
            let place = match &read {
                Some((was, place)) if Arc::ptr_eq(was, node) => place.clone(),
                _ if node.is_alias() => None,
                _ => {
                    let node = node.clone();
                    drop(shard);
                    let place = node.last_place();
                    read = Some((node, place));
                    continue;
                }
            };
            node.lookups.store(0, Ordering::Relaxed);
            let removed = shard
                .nodes
                .remove(&ino)
                .expect("held under the shard's lock");
            shrink_when_emptied(&mut shard.nodes);
            if !removed.is_alias() {
                let place = place.as_ref().map(|(p, name)| (*p, name.as_os_str()));
                self.depart(&shard, ino, place, removed.generation());
                return Some(removed);
            }
            drop(shard);
            let mut shard = self.write(removed.st_ino());
            if let Some(p) = shard.nodes.get(&removed.st_ino())
                && p.current.load(Ordering::Relaxed) == removed.ino
            {
                if p.lookups.load(Ordering::Relaxed) == 0 {
                    shard.nodes.remove(&removed.st_ino());
                } else {
                    // The first kernel inode may still be bound to its backing file.
                    p.current.store(RETIRED, Ordering::Relaxed);
                }
            }
            return Some(removed);
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).nodes.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Maps a layer file's `st_ino` to the merged view's inode number.
#[derive(Debug, Clone, Copy)]
pub struct InoMap {
    /// How many distinct devices the layers span.
    pub devices: u64,
}

impl InoMap {
    /// Never at or above `ALIAS_BASE` (the top bit is left for second identities).
    pub fn map(&self, dev_index: u64, st_ino: u64) -> Ino {
        const TAG_SHIFT: u32 = 56;
        // Tags 1..=126 name devices; 127 marks the numbers 0 and 1 below.
        let tag = (dev_index % 126 + 1) << TAG_SHIFT;
        let ino = if self.devices <= 1 {
            // No file system hands out numbers this large; clearing the bit keeps the rule.
            st_ino & (ALIAS_BASE - 1)
        } else if st_ino < (1 << TAG_SHIFT) {
            st_ino | tag
        } else {
            // Too large to tag: fold, keeping the tag. Collisions need 2^56 inodes on one layer.
            (st_ino ^ (st_ino >> TAG_SHIFT)) & ((1 << TAG_SHIFT) - 1) | tag
        };
        // 1 is the FUSE root and 0 is invalid; a file system's own root may be numbered 1.
        match ino {
            0 | ROOT_INO => ino | (0x7f << TAG_SHIFT),
            _ => ino,
        }
    }
}

#[cfg(test)]
mod tests;
