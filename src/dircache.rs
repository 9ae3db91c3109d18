//! A bounded cache of `O_PATH` descriptors of layer directories.
//!
//! Every operation opens the directories it works in (fd-relative access, no fd per inode);
//! keeping the most recent ones open saves an `openat2` and a `close` each time. Lower layers
//! never change, so their entries stay right. An upper entry goes stale when a directory is
//! renamed or removed (the descriptor follows the directory, the path does not): each entry
//! carries the generation of upper directory moves it was opened in (`Overlay::moves`, a
//! token of its change sequence). Dropping entries at a move would not be enough: a
//! descriptor opened just before a move may be inserted just after it. Instead each move
//! records the paths it changes (the moved directory's old and new place, a removed
//! directory's) under the number of its change (`moved`), and an entry of an older generation
//! is used only if no move recorded since then touched its path or a directory above it —
//! in a workload that renames or removes directories now and then (a build, fsstress) the
//! rest of the cache stays warm. Writers record before their change counts as finished, so a
//! reader whose token is newer than a move always finds that move in the record; an entry
//! older than the oldest record kept (`MOVES_KEPT`) is not used. The cache holds at most
//! `SHARDS * PER_SHARD` descriptors, well inside RLIMIT_NOFILE.
//!
//! Locking: one mutex per shard, held only to look up or insert; one for the record of moves,
//! taken after a shard's when both are (lock order: docs/ROBUSTNESS.md).

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A layer's index in the stack (`layers::LayerId`; this cache sits below the stack).
type LayerId = u16;

const SHARDS: usize = 16;
const PER_SHARD: usize = 64;

type Shard = Mutex<HashMap<(LayerId, PathBuf), (Arc<OwnedFd>, u64)>>;

pub struct DirCache {
    shards: [Shard; SHARDS],
    moves: Mutex<Moves>,
}

/// The upper paths recent directory moves changed, by change number (`seq::changes`).
#[derive(Default)]
struct Moves {
    recent: VecDeque<(u64, PathBuf)>,
    /// The newest change number dropped from `recent`: entries older than it cannot be checked.
    dropped: u64,
}

const MOVES_KEPT: usize = 64;

impl Default for DirCache {
    fn default() -> Self {
        DirCache {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            moves: Mutex::new(Moves::default()),
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
    /// The descriptor of `rel` in `layer`, if one was opened in generation `generation` or in
    /// an older one and no directory move since then changed what `rel` names.
    pub fn get(&self, layer: LayerId, rel: &Path, generation: u64) -> Option<Arc<OwnedFd>> {
        let mut shard = self.shards[shard_of(layer, rel)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (fd, g) = shard.get_mut(&(layer, rel.to_path_buf()))?;
        if *g != generation {
            if *g > generation || !self.unmoved(rel, *g, generation) {
                return None;
            }
            // Checked up to `generation`: the next look is a plain hit until the next move.
            *g = generation;
        }
        Some(fd.clone())
    }

    /// Records that change number `change` (a directory move or removal in the upper layer)
    /// changes what the upper path `rel`, and every path below it, names. Called by the
    /// writer while it holds its change guard.
    pub fn moved(&self, change: u64, rel: &Path) {
        let mut moves = self.moves.lock().unwrap_or_else(|e| e.into_inner());
        if moves.recent.len() >= MOVES_KEPT
            && let Some((n, _)) = moves.recent.pop_front()
        {
            moves.dropped = moves.dropped.max(n);
        }
        moves.recent.push_back((change, rel.to_path_buf()));
    }

    /// Whether no move recorded after generation `from` and up to `to` touched `rel`. Paths
    /// are compared as bytes (a `Path::starts_with` walks components: with a full record that
    /// was 25 µs a look, more than the `openat2` the cache saves).
    fn unmoved(&self, rel: &Path, from: u64, to: u64) -> bool {
        let (from, to) = (crate::seq::changes(from), crate::seq::changes(to));
        let rel = rel.as_os_str().as_bytes();
        let moves = self.moves.lock().unwrap_or_else(|e| e.into_inner());
        from >= moves.dropped
            && !moves.recent.iter().any(|(n, moved)| {
                let moved = moved.as_os_str().as_bytes();
                *n > from
                    && *n <= to
                    && rel.starts_with(moved)
                    && (moved.is_empty() || rel.len() == moved.len() || rel[moved.len()] == b'/')
            })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> Arc<OwnedFd> {
        Arc::new(std::fs::File::open("/").unwrap().into())
    }

    /// A token of a change sequence after `n` finished changes.
    fn token(n: u64) -> u64 {
        n << 20
    }

    #[test]
    fn an_entry_outlives_moves_elsewhere_but_not_one_of_its_own_path_or_above() {
        let c = DirCache::default();
        for p in ["a/b", "a/b/c", "x/y", "ab", "a/bc"] {
            c.insert(0, Path::new(p), fd(), token(3));
        }
        c.moved(4, Path::new("x/z"));
        c.moved(5, Path::new("a/b"));
        assert!(
            c.get(0, Path::new("x/y"), token(5)).is_some(),
            "x/z's move is not x/y's"
        );
        assert!(
            c.get(0, Path::new("ab"), token(5)).is_some(),
            "a/b is no prefix of ab"
        );
        assert!(c.get(0, Path::new("a/b"), token(5)).is_none());
        assert!(
            c.get(0, Path::new("a/b/c"), token(5)).is_none(),
            "below a moved directory"
        );
        // A reader whose token predates the move still sees the entry as opened.
        assert!(c.get(0, Path::new("a/b"), token(4)).is_some());
        // An entry opened after the move is right for it.
        c.insert(0, Path::new("a/b"), fd(), token(5));
        assert!(c.get(0, Path::new("a/b"), token(9)).is_some());
        // The root (a path that could not be told) stands for every entry.
        c.moved(10, Path::new(""));
        assert!(c.get(0, Path::new("x/y"), token(10)).is_none());
    }

    #[test]
    fn an_entry_older_than_the_moves_kept_is_not_used() {
        let c = DirCache::default();
        c.insert(0, Path::new("keep"), fd(), token(1));
        for n in 2..2 + MOVES_KEPT as u64 + 1 {
            c.moved(n, Path::new("elsewhere"));
        }
        let now = token(2 + MOVES_KEPT as u64);
        assert!(c.get(0, Path::new("keep"), now).is_none());
        c.insert(0, Path::new("keep"), fd(), now);
        assert!(c.get(0, Path::new("keep"), now).is_some());
    }
}
