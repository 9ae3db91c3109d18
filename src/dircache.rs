//! A bounded cache of `O_PATH` descriptors of layer directories.
//!
//! Every operation opens the directories it works in (fd-relative access, no fd per inode);
//! keeping the most recent ones open saves an `openat2` and a `close` each time. Lower layers
//! never change, so their entries stay right. An upper entry goes stale when a directory is
//! renamed or removed (the descriptor follows the directory, the path does not): each entry
//! carries the generation of upper directory moves it was opened in (`Overlay::moves`), and is
//! used only in that same generation. Dropping entries at a move would not be enough: a
//! descriptor opened just before a move may be inserted just after it. The cache holds at most
//! `SHARDS * PER_SHARD` descriptors, well inside RLIMIT_NOFILE.
//!
//! Locking: one mutex per shard, held only to look up or insert.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A layer's index in the stack (`layers::LayerId`; this cache sits below the stack).
type LayerId = u16;

const SHARDS: usize = 16;
const PER_SHARD: usize = 64;

type Shard = Mutex<HashMap<(LayerId, PathBuf), (Arc<OwnedFd>, u64)>>;

pub struct DirCache {
    shards: [Shard; SHARDS],
}

impl Default for DirCache {
    fn default() -> Self {
        DirCache {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        }
    }
}

fn shard_of(layer: LayerId, rel: &Path) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    layer.hash(&mut h);
    rel.hash(&mut h);
    h.finish() as usize % SHARDS
}

impl DirCache {
    /// The descriptor of `rel` in `layer`, if one was opened in generation `generation`.
    pub fn get(&self, layer: LayerId, rel: &Path, generation: u64) -> Option<Arc<OwnedFd>> {
        let shard = self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match shard.get(&(layer, rel.to_path_buf())) {
            Some((fd, g)) if *g == generation => Some(fd.clone()),
            _ => None,
        }
    }

    pub fn insert(&self, layer: LayerId, rel: &Path, fd: Arc<OwnedFd>, generation: u64) {
        let mut shard = self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if shard.len() >= PER_SHARD {
            // Not LRU: any entry will do, the cache only has to stay bounded.
            if let Some(k) = shard.keys().next().cloned() {
                shard.remove(&k);
            }
        }
        shard.insert((layer, rel.to_path_buf()), (fd, generation));
    }

    /// Drops the descriptor of `rel` in `layer`: its directory is gone from under it (ESTALE).
    pub fn forget(&self, layer: LayerId, rel: &Path) {
        self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(layer, rel.to_path_buf()));
    }
}
