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
//! Locking: the table is sharded, each shard behind its own `RwLock` held only to find or insert
//! an entry. Each inode's mutable state sits behind its own `Mutex`. A thread may take an
//! ancestor's state lock while holding a descendant's (path building walks upwards), never the
//! other way round, and never two unrelated inodes' locks at once.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use crate::file::OpenFile;
use crate::layers::LayerId;

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;

/// Where the lower part of a merged object lives. For a directory, every lower layer that
/// contributes to it (top to bottom, stopping at an opaque one); for anything else, the one
/// topmost layer that has it. The path is the same in all those layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowerRef {
    pub path: PathBuf,
    pub layers: Vec<LayerId>,
}

impl LowerRef {
    pub fn top(&self) -> LayerId {
        self.layers[0]
    }
}

#[derive(Debug)]
pub struct NodeState {
    /// S_IFMT bits.
    pub kind: u32,
    /// Names of this inode in the merged tree; the first is used to build its upper path.
    pub links: Vec<(Ino, OsString)>,
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
    /// For a merged directory: how many subdirectories its merged view has (its `st_nlink` is
    /// that plus 2), once counted. Reset by `subdirs_changed`.
    pub subdirs: Option<u64>,
    /// Bumped by every change to the subdirectories, so a count taken across one is not kept.
    pub subdirs_gen: u64,
}

impl NodeState {
    /// A subdirectory of this directory was made, removed or moved.
    pub fn subdirs_changed(&mut self) {
        self.subdirs = None;
        self.subdirs_gen += 1;
    }
}

pub struct Node {
    pub ino: Ino,
    /// Bumped when the number is reused for a new object while the kernel may still hold the
    /// old one (upper file systems reuse inode numbers): the kernel tells the two apart by
    /// (nodeid, generation), and would otherwise take the new directory for the dead one.
    generation: AtomicU64,
    state: Mutex<NodeState>,
    lookups: AtomicU64,
    /// Serialises copy-up of this object (held across the copy, unlike `state`).
    pub copy_up: Mutex<()>,
}

impl Node {
    pub fn state(&self) -> MutexGuard<'_, NodeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn kind(&self) -> u32 {
        self.state().kind
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn is_dir(&self) -> bool {
        self.kind() == libc::S_IFDIR
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
}

const SHARDS: usize = 64;

type Shard = RwLock<HashMap<Ino, Arc<Node>>>;

pub struct InodeTable {
    shards: Box<[Shard]>,
}

impl InodeTable {
    pub fn new(root_upper: bool, root_lower: Option<LowerRef>, root_origins: bool) -> Self {
        let shards: Vec<_> = (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect();
        let table = InodeTable {
            shards: shards.into_boxed_slice(),
        };
        let root = Arc::new(Node {
            ino: ROOT_INO,
            generation: AtomicU64::new(0),
            state: Mutex::new(NodeState {
                kind: libc::S_IFDIR,
                links: vec![(ROOT_INO, OsString::new())],
                upper: root_upper,
                lower: root_lower,
                unlinked: false,
                has_origin: false,
                origins: root_origins,
                open: Weak::new(),
                subdirs: None,
                subdirs_gen: 0,
            }),
            lookups: AtomicU64::new(1),
            copy_up: Mutex::new(()),
        });
        table
            .shard(ROOT_INO)
            .write()
            .unwrap()
            .insert(ROOT_INO, root);
        table
    }

    fn shard(&self, ino: Ino) -> &Shard {
        // Inode numbers of one file system are dense; mix the bits so shards fill evenly.
        let h = ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58;
        &self.shards[h as usize % SHARDS]
    }

    pub fn get(&self, ino: Ino) -> Option<Arc<Node>> {
        self.shard(ino)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ino)
            .cloned()
    }

    /// Records a lookup of `name` in `parent` and counts one kernel reference to it.
    pub fn remember(&self, parent: Ino, name: &OsStr, found: &Found) -> Arc<Node> {
        let node = {
            let mut shard = self
                .shard(found.ino)
                .write()
                .unwrap_or_else(|e| e.into_inner());
            shard
                .entry(found.ino)
                .or_insert_with(|| {
                    Arc::new(Node {
                        ino: found.ino,
                        generation: AtomicU64::new(0),
                        state: Mutex::new(NodeState {
                            kind: found.kind,
                            links: Vec::new(),
                            upper: found.upper,
                            lower: found.lower.clone(),
                            unlinked: false,
                            has_origin: found.origin,
                            origins: found.origins,
                            open: Weak::new(),
                            subdirs: None,
                            subdirs_gen: 0,
                        }),
                        lookups: AtomicU64::new(0),
                        copy_up: Mutex::new(()),
                    })
                })
                .clone()
        };
        node.lookups.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = node.state();
            if st.unlinked || st.kind != found.kind {
                // A new object under a number the old one left behind.
                node.generation.fetch_add(1, Ordering::Relaxed);
                st.open = Weak::new();
                st.links.clear();
            }
            if st.upper != found.upper || st.lower != found.lower || st.links.is_empty() {
                st.subdirs_changed();
            }
            st.kind = found.kind;
            st.upper = found.upper;
            st.lower = found.lower.clone();
            st.has_origin = found.origin;
            st.origins = found.origins;
            st.unlinked = false;
            let link = (parent, name.to_os_string());
            if let Some(pos) = st.links.iter().position(|l| *l == link) {
                // Most recent name first: it is the one known to be valid right now.
                st.links.swap(0, pos);
            } else {
                st.links.insert(0, link);
            }
        }
        node
    }

    /// Records an object that has no name yet (O_TMPFILE) and counts one kernel reference.
    pub fn remember_unnamed(&self, found: &Found) -> Arc<Node> {
        let node = Arc::new(Node {
            ino: found.ino,
            generation: AtomicU64::new(0),
            state: Mutex::new(NodeState {
                kind: found.kind,
                links: Vec::new(),
                upper: true,
                lower: None,
                unlinked: true,
                has_origin: false,
                origins: false,
                open: Weak::new(),
                subdirs: None,
                subdirs_gen: 0,
            }),
            lookups: AtomicU64::new(1),
            copy_up: Mutex::new(()),
        });
        let mut shard = self
            .shard(found.ino)
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(old) = shard.get(&found.ino) {
            // The number of an object the kernel still holds: a new generation tells them apart.
            node.generation
                .store(old.generation() + 1, Ordering::Relaxed);
        }
        shard.insert(found.ino, node.clone());
        node
    }

    /// Drops `n` kernel references; the inode is forgotten when none is left.
    pub fn forget(&self, ino: Ino, n: u64) {
        if ino == ROOT_INO {
            return;
        }
        let mut shard = self.shard(ino).write().unwrap_or_else(|e| e.into_inner());
        if let Some(node) = shard.get(&ino) {
            let prev = node.lookups.fetch_sub(
                n.min(node.lookups.load(Ordering::Relaxed)),
                Ordering::Relaxed,
            );
            if prev <= n {
                shard.remove(&ino);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().map_or(0, |s| s.len()))
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
    pub fn map(&self, dev_index: u64, st_ino: u64) -> Ino {
        const TAG_SHIFT: u32 = 56;
        let ino = if self.devices <= 1 {
            st_ino
        } else if st_ino < (1 << TAG_SHIFT) {
            st_ino | ((dev_index + 1) << TAG_SHIFT)
        } else {
            // Too large to tag: fold, keeping the tag. Collisions need 2^56 inodes on one layer.
            (st_ino ^ (st_ino >> TAG_SHIFT)) & ((1 << TAG_SHIFT) - 1)
                | ((dev_index + 1) << TAG_SHIFT)
        };
        // 1 is the FUSE root and 0 is invalid; a file system's own root may be numbered 1.
        match ino {
            0 | ROOT_INO => ino | (0xff << TAG_SHIFT),
            _ => ino,
        }
    }
}
