//! The snapshotter's metadata: one record per snapshot, keyed by its name, in a redb database
//! (`ROOT/metadata.redb`). redb commits each write transaction durably (fsync) or not at all,
//! so a crash leaves the metadata as it was before or after an operation, never between.
//!
//! A record holds what containerd asks back (kind, parent, labels, times) and the number of
//! the snapshot's directory under `ROOT/snapshots/`. Directories and records are kept in step
//! by the order of the steps in snapshots.rs: a directory is made before the record that
//! names it is committed, and removed only after its record is gone, so a crash can leave a
//! directory no record names (removed at start and by Cleanup), never a record without its
//! directory.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableTable, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::error::SnapError;

/// name → JSON-encoded [`Record`].
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
/// "next_id" → the number the next snapshot's directory gets.
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    View,
    Active,
    Committed,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// Nanoseconds since the epoch: JSON numbers, exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    secs: u64,
    nanos: u32,
}

impl Stamp {
    pub fn now() -> Stamp {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Stamp {
            secs: d.as_secs(),
            nanos: d.subsec_nanos(),
        }
    }

    pub fn time(self) -> SystemTime {
        UNIX_EPOCH + Duration::new(self.secs, self.nanos)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// The directory `ROOT/snapshots/ID`.
    pub id: u64,
    pub kind: Kind,
    /// The parent's name ("" for none); always a committed snapshot.
    pub parent: String,
    pub labels: HashMap<String, String>,
    pub created: Stamp,
    pub updated: Stamp,
    /// Bytes and inodes of the layer, taken at commit (committed snapshots only: their layer
    /// no longer changes).
    #[serde(default)]
    pub usage: Option<(i64, i64)>,
    /// For a layer a layer store serves (remote.rs): the store's tree, which the snapshot's
    /// `fs` links to, given back to the store when the snapshot goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<PathBuf>,
}

pub struct Store {
    db: Database,
}

/// A write transaction: all its changes land together at [`Txn::commit`], or none do.
pub struct Txn(WriteTransaction);

fn internal(what: &str) -> impl Fn(redb::Error) -> SnapError + '_ {
    move |e| SnapError::Internal(format!("metadata store: {what}: {e}"))
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, SnapError> {
        let db = Database::create(path).map_err(|e| {
            SnapError::Internal(format!(
                "cannot open the metadata store {}: {e}; if it is damaged, move it away and start \
                 with an empty root",
                path.display()
            ))
        })?;
        let store = Store { db };
        let txn = store.write()?;
        txn.0
            .open_table(SNAPSHOTS)
            .map_err(|e| internal("create table")(e.into()))?;
        txn.0
            .open_table(COUNTERS)
            .map_err(|e| internal("create table")(e.into()))?;
        txn.commit()?;
        Ok(store)
    }

    /// Only one write transaction is open at a time (redb's writer lock): holding one keeps
    /// every other change, and Cleanup, out.
    pub fn write(&self) -> Result<Txn, SnapError> {
        Ok(Txn(self
            .db
            .begin_write()
            .map_err(|e| internal("begin")(e.into()))?))
    }

    /// The snapshots table as of now (a read transaction: it sees no half-done change).
    fn snapshots(&self) -> Result<redb::ReadOnlyTable<&'static str, &'static [u8]>, SnapError> {
        let txn = self.db.begin_read().map_err(read_error)?;
        txn.open_table(SNAPSHOTS).map_err(read_error)
    }

    pub fn get(&self, name: &str) -> Result<Option<Record>, SnapError> {
        lookup(&self.snapshots()?, name)
    }

    /// The records as of now, for several reads that must agree (a snapshot and its parents),
    /// without the writer lock.
    pub fn read(&self) -> Result<ReadView, SnapError> {
        Ok(ReadView(self.snapshots()?))
    }

    pub fn all(&self) -> Result<Vec<(String, Record)>, SnapError> {
        collect(&self.snapshots()?)
    }
}

/// A consistent view of the records (`Store::read`).
pub struct ReadView(redb::ReadOnlyTable<&'static str, &'static [u8]>);

impl ReadView {
    pub fn get(&self, name: &str) -> Result<Option<Record>, SnapError> {
        lookup(&self.0, name)
    }
}

fn read_error(e: impl Into<redb::Error>) -> SnapError {
    internal("read")(e.into())
}

fn lookup(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    name: &str,
) -> Result<Option<Record>, SnapError> {
    let value = table.get(name).map_err(read_error)?;
    value.map(|v| decode(name, v.value())).transpose()
}

fn decode(name: &str, bytes: &[u8]) -> Result<Record, SnapError> {
    serde_json::from_slice(bytes).map_err(|e| {
        SnapError::Internal(format!(
            "metadata store: the record of snapshot {name:?} is damaged: {e}"
        ))
    })
}

fn collect(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Vec<(String, Record)>, SnapError> {
    let mut out = Vec::new();
    for row in table.iter().map_err(read_error)? {
        let (k, v) = row.map_err(read_error)?;
        out.push((k.value().to_string(), decode(k.value(), v.value())?));
    }
    Ok(out)
}

impl Txn {
    pub fn get(&self, name: &str) -> Result<Option<Record>, SnapError> {
        lookup(&self.0.open_table(SNAPSHOTS).map_err(read_error)?, name)
    }

    pub fn all(&self) -> Result<Vec<(String, Record)>, SnapError> {
        collect(&self.0.open_table(SNAPSHOTS).map_err(read_error)?)
    }

    pub fn put(&self, name: &str, record: &Record) -> Result<(), SnapError> {
        let bytes = serde_json::to_vec(record).map_err(|e| SnapError::Internal(e.to_string()))?;
        let mut table = self
            .0
            .open_table(SNAPSHOTS)
            .map_err(|e| internal("write")(e.into()))?;
        table
            .insert(name, bytes.as_slice())
            .map_err(|e| internal("write")(e.into()))?;
        Ok(())
    }

    pub fn delete(&self, name: &str) -> Result<(), SnapError> {
        let mut table = self
            .0
            .open_table(SNAPSHOTS)
            .map_err(|e| internal("write")(e.into()))?;
        table
            .remove(name)
            .map_err(|e| internal("write")(e.into()))?;
        Ok(())
    }

    /// A directory number never handed out before (the counter only grows, and is committed
    /// with the record that uses it).
    pub fn next_id(&self) -> Result<u64, SnapError> {
        let mut table = self
            .0
            .open_table(COUNTERS)
            .map_err(|e| internal("write")(e.into()))?;
        let id = table
            .get("next_id")
            .map_err(|e| internal("read")(e.into()))?
            .map_or(1, |v| v.value());
        table
            .insert("next_id", id + 1)
            .map_err(|e| internal("write")(e.into()))?;
        Ok(id)
    }

    pub fn commit(self) -> Result<(), SnapError> {
        self.0.commit().map_err(|e| internal("commit")(e.into()))
    }
}
