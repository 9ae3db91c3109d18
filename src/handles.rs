//! What a FUSE `fh` names — an open file (`Handle`) or a directory being listed
//! (`DirHandle`) — and the sharded table that keeps them, keyed by that number.
//!
//! The next number comes from one atomic counter, touched on open only (never on read or
//! write); lookups touch one shard's lock.

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::file::{IoMode, OpenFile};
use crate::inode::{Ino, Node};

/// An open file handle: the inode it was opened on, the open state every handle of that inode
/// shares, and how this handle does its I/O.
pub struct Handle {
    pub file: Arc<OpenFile>,
    pub node: Arc<Node>,
    pub append: bool,
    /// Opened on an append-only file (fileattr.rs): every write must append.
    pub append_only: bool,
    pub writable: bool,
    /// O_SYNC or O_DSYNC: each write is on disk, whole blocks included, when it returns.
    pub sync: bool,
    /// Opened by execve(2): counted in `NodeState::executing` while it lives.
    pub exec: bool,
    pub(crate) io: Mutex<IoMode>,
}

impl Handle {
    pub fn io(&self) -> IoMode {
        *self.io.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.node.io().end(self.io());
        if self.exec {
            let mut st = self.node.state();
            if st.rare().executing > 0 {
                st.rare_mut().executing -= 1;
            }
        }
    }
}

pub type HandleTable = HandleMap<Handle>;

/// One entry of a directory listing.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: OsString,
    pub ino: Ino,
    /// S_IFMT bits.
    pub kind: u32,
}

/// An open directory (kernels without zero-message OPENDIR only): the directory it was opened
/// on. Listings are kept per directory, not per handle (readdir.rs `Listings`).
pub struct DirHandle {
    pub ino: Ino,
}

pub type DirHandleTable = HandleMap<DirHandle>;

const SHARDS: usize = 16;

pub struct HandleMap<T> {
    next: AtomicU64,
    shards: [Mutex<HashMap<u64, Arc<T>>>; SHARDS],
}

impl<T> Default for HandleMap<T> {
    fn default() -> Self {
        HandleMap {
            next: AtomicU64::new(1),
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        }
    }
}

/// Where a daemon's handle numbers start: its place in the mount's line of daemons (the
/// number of takeovers before it, takeover.rs) above this bit. A daemon that takes a mount over
/// tells the handles the kernel still holds from its predecessors' by their number alone, and
/// never hands out one of theirs again.
const EPOCH_SHIFT: u32 = 48;

impl<T> HandleMap<T> {
    /// Handle numbers from now on are this daemon's: `epoch` takeovers came before it.
    pub fn set_epoch(&self, epoch: u32) {
        let epoch = u64::from(epoch.min(0xffff));
        self.next
            .store((epoch << EPOCH_SHIFT) | 1, Ordering::Relaxed);
    }

    /// Whether `fh` was handed out by a daemon that served the mount before this one.
    pub fn is_inherited(&self, fh: u64) -> bool {
        fh >> EPOCH_SHIFT < self.next.load(Ordering::Relaxed) >> EPOCH_SHIFT
    }

    /// Puts `value` under the number `fh` an earlier daemon gave it; `false` if a handle of
    /// that number is there already.
    pub fn insert_at(&self, fh: u64, value: T) -> bool {
        let mut shard = self.shard(fh);
        if shard.contains_key(&fh) {
            return false;
        }
        shard.insert(fh, Arc::new(value));
        true
    }

    fn shard(&self, fh: u64) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<T>>> {
        self.shards[(fh as usize) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, value: T) -> u64 {
        let fh = self.next.fetch_add(1, Ordering::Relaxed);
        self.shard(fh).insert(fh, Arc::new(value));
        fh
    }

    pub fn get(&self, fh: u64) -> Option<Arc<T>> {
        self.shard(fh).get(&fh).cloned()
    }

    pub fn remove(&self, fh: u64) -> Option<Arc<T>> {
        self.shard(fh).remove(&fh)
    }

    /// Every value in the table.
    pub fn values(&self) -> Vec<Arc<T>> {
        self.shards
            .iter()
            .flat_map(|s| {
                s.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .cloned()
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    pub fn clear(&self) {
        for s in &self.shards {
            s.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}
