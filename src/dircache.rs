//! A bounded cache of `O_PATH` descriptors of layer directories.
//!
//! Every operation opens the directories it works in (fd-relative access, no fd per inode);
//! keeping the most recent ones open saves an `openat2` and a `close` each time. Lower layers
//! never change, so their entries stay right. An upper entry goes stale when a directory is
//! renamed or removed (the descriptor follows the directory, the path does not): those
//! operations drop every upper entry (`forget_upper`). The cache holds at most
//! `SHARDS * PER_SHARD` descriptors, well inside RLIMIT_NOFILE.
//!
//! Locking: one mutex per shard, held only to look up or insert.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::layers::LayerId;

const SHARDS: usize = 16;
const PER_SHARD: usize = 64;

type Shard = Mutex<HashMap<(LayerId, PathBuf), Arc<OwnedFd>>>;

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
    pub fn get(&self, layer: LayerId, rel: &Path) -> Option<Arc<OwnedFd>> {
        let shard = self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        shard.get(&(layer, rel.to_path_buf())).cloned()
    }

    pub fn insert(&self, layer: LayerId, rel: &Path, fd: Arc<OwnedFd>) {
        let mut shard = self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if shard.len() >= PER_SHARD {
            // Not LRU: any entry will do, the cache only has to stay bounded.
            if let Some(k) = shard.keys().next().cloned() {
                shard.remove(&k);
            }
        }
        shard.insert((layer, rel.to_path_buf()), fd);
    }

    /// Drops every entry of `layer` (a directory there was renamed or removed).
    pub fn forget_layer(&self, layer: LayerId) {
        for s in &self.shards {
            s.lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(l, _), _| *l != layer);
        }
    }
}
