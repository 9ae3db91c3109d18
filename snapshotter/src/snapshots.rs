//! The snapshots themselves: a directory per snapshot under `ROOT/snapshots/ID`, holding `fs`
//! (the layer: an active snapshot's upper dir, a committed snapshot's lower layer) and, for
//! active snapshots, `work` (mosaicfs' work dir). containerd mounts what [`Snapshots::mounts`]
//! answers: a bind mount for a snapshot with no parent (or a view of one), otherwise a
//! `fuse3.mosaicfs` mount with the parents' layers as lower layers, top first, made by
//! `mount.fuse3` running `mosaicfs` (the helper form mosaicfs has always taken).
//!
//! A committed layer keeps mosaicfs' partial files: their marks name the layer they patch by
//! its place below (docs/FORMAT.md), and a committed snapshot's parents never change, so the
//! layer reads the same under every child.
//!
//! Crash safety (with store.rs): Prepare and View make the directory under a temporary name,
//! rename it into place and only then commit the record; Remove commits the record's removal
//! and then removes the directory. Directories no record names are removed at start and by
//! Cleanup, while the store's writer lock keeps every other change out.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use containerd_snapshots::api::types::Mount;

use crate::error::SnapError;
use crate::filter::{Fields, Filter};
use crate::remote::{self, LayerStore, RemoteLayer};
use crate::store::{Kind, Record, Stamp, Store};

/// Labels containerd (1.7 and later) and nerdctl set to ask for a user-namespaced view of the
/// layers; they become mosaicfs' `uidmapping=`/`gidmapping=` options, as fuse-overlayfs-snapshotter
/// makes them fuse-overlayfs' (`0:100000:65536,65536:...` → `0:100000:65536:65536:...`).
const UID_MAPPING_LABEL: &str = "containerd.io/snapshot/uidmapping";
const GID_MAPPING_LABEL: &str = "containerd.io/snapshot/gidmapping";

pub struct Snapshots {
    root: PathBuf,
    store: Store,
    /// More mosaicfs options for every fuse3.mosaicfs mount (`--mount-options`).
    mount_options: Vec<String>,
    /// Where image layers can be taken lazily from (`--layer-store`; remote.rs).
    layer_store: Option<LayerStore>,
}

/// A snapshot as containerd's Stat and List see it.
pub struct Info {
    pub name: String,
    pub record: Record,
}

fn not_found(name: &str) -> SnapError {
    SnapError::NotFound(format!("snapshot {name:?} does not exist"))
}

impl Snapshots {
    /// Opens (or starts) the snapshotter's root, removing what a crash left behind.
    pub fn open(root: &Path, mount_options: Vec<String>) -> Result<Snapshots, SnapError> {
        let dir = root.join("snapshots");
        fs::create_dir_all(&dir).map_err(|e| SnapError::io("cannot create", &dir, e))?;
        let store = Store::open(&root.join("metadata.redb"))?;
        let snapshots = Snapshots {
            root: root.to_path_buf(),
            store,
            mount_options,
            layer_store: None,
        };
        for path in snapshots.cleanup()? {
            eprintln!(
                "mosaicfs-snapshotter: removed {} (left by an operation a crash interrupted)",
                path.display()
            );
        }
        Ok(snapshots)
    }

    /// Takes image layers the layer store at `root` serves instead of unpacking them.
    pub fn with_layer_store(mut self, root: PathBuf) -> Snapshots {
        self.layer_store = Some(LayerStore::new(root));
        self
    }

    fn dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    fn layer(&self, id: u64) -> PathBuf {
        self.dir(id).join("fs")
    }

    pub fn stat(&self, name: &str) -> Result<Info, SnapError> {
        let record = self.store.get(name)?.ok_or_else(|| not_found(name))?;
        Ok(Info {
            name: name.to_string(),
            record,
        })
    }

    /// A new active (read-write) or view (read-only) snapshot on `parent`, and its mounts.
    pub fn create(
        &self,
        kind: Kind,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, SnapError> {
        if key.is_empty() {
            return Err(SnapError::InvalidArgument(
                "a snapshot needs a key (it was empty)".into(),
            ));
        }
        if let Some(layer) = self.remote_layer(kind, &labels)? {
            return self.commit_remote(layer, parent, labels);
        }
        let txn = self.store.write()?;
        if txn.get(key)?.is_some() {
            return Err(SnapError::AlreadyExists(format!(
                "snapshot {key:?} already exists"
            )));
        }
        let parents = parents_of(|n| txn.get(n), parent)?;
        let id = txn.next_id()?;
        let now = Stamp::now();
        let record = Record {
            id,
            kind,
            parent: parent.to_string(),
            labels,
            created: now,
            updated: now,
            usage: None,
            remote: None,
        };
        let dir = self.dir(id);
        // A directory of this number can only be a leftover of a crash before its record was
        // committed: nothing refers to it.
        if dir.exists() {
            fs::remove_dir_all(&dir)
                .map_err(|e| SnapError::io("cannot remove the leftover", &dir, e))?;
        }
        let tmp = self.root.join("snapshots").join(format!("new-{id}"));
        let made = self
            .make_dir(&tmp, kind, parents.first().copied())
            .and_then(|()| {
                fs::rename(&tmp, &dir)
                    .map_err(|e| SnapError::io("cannot rename into place", &tmp, e))
            });
        let committed = made.and_then(|()| {
            txn.put(key, &record)?;
            txn.commit()
        });
        if let Err(e) = committed {
            let _ = fs::remove_dir_all(&tmp);
            let _ = fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok(self.mounts_of(&record, &parents))
    }

    /// The layer the layer store serves for the image layer containerd prepares a snapshot to
    /// unpack, when there is a store, the labels name a layer and the store has it.
    fn remote_layer(
        &self,
        kind: Kind,
        labels: &HashMap<String, String>,
    ) -> Result<Option<RemoteLayer>, SnapError> {
        let (Some(store), Some(target), Kind::Active) =
            (&self.layer_store, labels.get(remote::TARGET_LABEL), kind)
        else {
            return Ok(None);
        };
        if self.store.get(target)?.is_some() {
            return Err(SnapError::AlreadyExists(format!(
                "snapshot {target:?} already exists"
            )));
        }
        Ok(store.find(labels))
    }

    /// Commits the snapshot containerd would unpack the layer into (named by the target label)
    /// with the store's tree as its layer, and answers "already exists", which tells containerd
    /// that the layer is there without fetching it. The directory is made and renamed into
    /// place before the record is committed, as in [`Snapshots::create`].
    fn commit_remote(
        &self,
        layer: RemoteLayer,
        parent: &str,
        mut labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, SnapError> {
        let tree = layer.tree();
        let target = labels[remote::TARGET_LABEL].clone();
        labels.insert(remote::REMOTE_LABEL.into(), "remote snapshot".into());
        let committed = (|| {
            let txn = self.store.write()?;
            if txn.get(&target)?.is_some() {
                return Err(SnapError::AlreadyExists(format!(
                    "snapshot {target:?} already exists"
                )));
            }
            parents_of(|n| txn.get(n), parent)?;
            let id = txn.next_id()?;
            let dir = self.dir(id);
            if dir.exists() {
                fs::remove_dir_all(&dir)
                    .map_err(|e| SnapError::io("cannot remove the leftover", &dir, e))?;
            }
            let tmp = self.root.join("snapshots").join(format!("new-{id}"));
            let _ = fs::remove_dir_all(&tmp);
            let made = fs::create_dir(&tmp)
                .and_then(|()| std::os::unix::fs::symlink(&tree, tmp.join("fs")))
                .and_then(|()| fs::rename(&tmp, &dir))
                .map_err(|e| SnapError::io("cannot make the snapshot directory", &tmp, e));
            let now = Stamp::now();
            let record = Record {
                id,
                kind: Kind::Committed,
                parent: parent.to_string(),
                labels,
                created: now,
                updated: now,
                usage: Some((0, 0)),
                remote: Some(tree.clone()),
            };
            let done = made.and_then(|()| {
                txn.put(&target, &record)?;
                txn.commit()
            });
            if done.is_err() {
                let _ = fs::remove_dir_all(&tmp);
                let _ = fs::remove_dir_all(&dir);
            }
            done
        })();
        if let Err(e) = committed {
            remote::release(&tree);
            return Err(e);
        }
        eprintln!(
            "mosaicfs-snapshotter: layer {target} taken from the layer store ({})",
            tree.display()
        );
        Err(SnapError::AlreadyExists(format!(
            "snapshot {target:?} already exists: the layer store serves its layer ({})",
            tree.display()
        )))
    }

    /// `fs` (mode 0755, owned as the parent's layer root is, as containerd's overlayfs
    /// snapshotter does: the root of the merged tree keeps its owner) and, for an active
    /// snapshot, `work`.
    fn make_dir(&self, tmp: &Path, kind: Kind, parent: Option<u64>) -> Result<(), SnapError> {
        let _ = fs::remove_dir_all(tmp);
        let layer = tmp.join("fs");
        fs::create_dir_all(&layer).map_err(|e| SnapError::io("cannot create", &layer, e))?;
        fs::set_permissions(&layer, fs::Permissions::from_mode(0o755))
            .map_err(|e| SnapError::io("cannot chmod", &layer, e))?;
        if let Some(parent) = parent {
            let of = self.layer(parent);
            let st = fs::metadata(&of)
                .map_err(|e| SnapError::io("cannot stat the parent layer", &of, e))?;
            std::os::unix::fs::lchown(&layer, Some(st.uid()), Some(st.gid()))
                .map_err(|e| SnapError::io("cannot chown", &layer, e))?;
        }
        if kind == Kind::Active {
            let work = tmp.join("work");
            fs::create_dir(&work).map_err(|e| SnapError::io("cannot create", &work, e))?;
            fs::set_permissions(&work, fs::Permissions::from_mode(0o711))
                .map_err(|e| SnapError::io("cannot chmod", &work, e))?;
        }
        Ok(())
    }

    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, SnapError> {
        // A read view: containerd asks for mounts at every container start, and a snapshot's
        // parents are committed and cannot go while it exists.
        let view = self.store.read()?;
        let record = view.get(key)?.ok_or_else(|| not_found(key))?;
        if record.kind == Kind::Committed {
            return Err(SnapError::FailedPrecondition(format!(
                "snapshot {key:?} is committed: only active snapshots and views have mounts"
            )));
        }
        let parents = parents_of(|n| view.get(n), &record.parent)?;
        Ok(self.mounts_of(&record, &parents))
    }

    fn mounts_of(&self, record: &Record, parents: &[u64]) -> Vec<Mount> {
        let bind = |dir: PathBuf, ro: bool| Mount {
            r#type: "bind".into(),
            source: dir.to_string_lossy().into_owned(),
            target: String::new(),
            options: vec![if ro { "ro" } else { "rw" }.into(), "rbind".into()],
        };
        let active = record.kind == Kind::Active;
        match (parents, active) {
            ([], _) => return vec![bind(self.layer(record.id), !active)],
            ([only], false) => return vec![bind(self.layer(*only), true)],
            _ => {}
        }
        let lowers: Vec<String> = parents
            .iter()
            .map(|id| self.layer(*id).to_string_lossy().into_owned())
            .collect();
        let mut options = Vec::new();
        if active {
            options.push(format!(
                "workdir={}",
                self.dir(record.id).join("work").display()
            ));
            options.push(format!("upperdir={}", self.layer(record.id).display()));
        }
        options.push(format!("lowerdir={}", lowers.join(":")));
        options.extend(self.mount_options.iter().cloned());
        for (label, option) in [
            (UID_MAPPING_LABEL, "uidmapping"),
            (GID_MAPPING_LABEL, "gidmapping"),
        ] {
            if let Some(map) = record.labels.get(label) {
                options.push(format!("{option}={}", map.replace(',', ":")));
            }
        }
        vec![Mount {
            r#type: "fuse3.mosaicfs".into(),
            source: "mosaicfs".into(),
            target: String::new(),
            options,
        }]
    }

    /// Makes active snapshot `key` the committed snapshot `name`: the same layer, now read-only
    /// and usable as a parent. Its usage is taken now, once.
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), SnapError> {
        let record = self.store.get(key)?.ok_or_else(|| not_found(key))?;
        if record.kind != Kind::Active {
            return Err(SnapError::FailedPrecondition(format!(
                "snapshot {key:?} is {}: only an active snapshot can be committed",
                record.kind.name()
            )));
        }
        // Outside the transaction: a big layer takes a while to walk, and an active snapshot
        // being committed is no longer mounted.
        let usage = disk_usage(&self.layer(record.id))?;
        let txn = self.store.write()?;
        let current = txn.get(key)?.ok_or_else(|| not_found(key))?;
        if current.id != record.id || current.kind != Kind::Active {
            return Err(SnapError::FailedPrecondition(format!(
                "snapshot {key:?} changed while being committed"
            )));
        }
        if txn.get(name)?.is_some() {
            return Err(SnapError::AlreadyExists(format!(
                "snapshot {name:?} already exists"
            )));
        }
        let now = Stamp::now();
        let committed = Record {
            kind: Kind::Committed,
            labels,
            created: now,
            updated: now,
            usage: Some((usage.0, usage.1)),
            ..current
        };
        txn.delete(key)?;
        txn.put(name, &committed)?;
        txn.commit()
    }

    pub fn remove(&self, key: &str) -> Result<(), SnapError> {
        let txn = self.store.write()?;
        let record = txn.get(key)?.ok_or_else(|| not_found(key))?;
        let children: Vec<String> = txn
            .all()?
            .into_iter()
            .filter(|(_, r)| r.parent == key)
            .map(|(n, _)| n)
            .collect();
        if !children.is_empty() {
            return Err(SnapError::FailedPrecondition(format!(
                "cannot remove snapshot {key:?}: snapshots {children:?} are built on it; remove them first"
            )));
        }
        txn.delete(key)?;
        txn.commit()?;
        if let Some(tree) = &record.remote {
            remote::release(tree);
        }
        let dir = self.dir(record.id);
        let doomed = self
            .root
            .join("snapshots")
            .join(format!("rm-{}", record.id));
        match fs::rename(&dir, &doomed).and_then(|()| fs::remove_dir_all(&doomed)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // The record is gone: the directory is a leftover that Cleanup takes.
            Err(e) => eprintln!(
                "mosaicfs-snapshotter: removed snapshot {key:?}, but not its directory yet: {e}"
            ),
        }
        Ok(())
    }

    /// Replaces the labels (`fieldpaths` empty or `labels`) or single labels (`labels.KEY`);
    /// nothing else of a snapshot can change.
    pub fn update(
        &self,
        name: &str,
        labels: HashMap<String, String>,
        fieldpaths: &[String],
    ) -> Result<Info, SnapError> {
        let txn = self.store.write()?;
        let mut record = txn.get(name)?.ok_or_else(|| not_found(name))?;
        if fieldpaths.is_empty() {
            record.labels = labels;
        } else {
            for path in fieldpaths {
                if path == "labels" {
                    record.labels = labels.clone();
                } else if let Some(key) = path.strip_prefix("labels.") {
                    match labels.get(key) {
                        Some(v) => record.labels.insert(key.to_string(), v.clone()),
                        None => record.labels.remove(key),
                    };
                } else {
                    return Err(SnapError::InvalidArgument(format!(
                        "cannot update {path:?} of snapshot {name:?}: only labels can change"
                    )));
                }
            }
        }
        record.updated = Stamp::now();
        txn.put(name, &record)?;
        txn.commit()?;
        Ok(Info {
            name: name.to_string(),
            record,
        })
    }

    /// Bytes and inodes the layer holds on disk: allocated blocks, so a partial file counts
    /// the blocks written into it, not its size.
    pub fn usage(&self, key: &str) -> Result<(i64, i64), SnapError> {
        let record = self.store.get(key)?.ok_or_else(|| not_found(key))?;
        match record.usage {
            Some(usage) => Ok(usage),
            None => disk_usage(&self.layer(record.id)),
        }
    }

    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>, SnapError> {
        let filters = filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::new();
        for (name, record) in self.store.all()? {
            let fields = Fields {
                name: &name,
                parent: &record.parent,
                kind: record.kind.name(),
                labels: &record.labels,
            };
            if filters.is_empty() || filters.iter().any(|f| f.matches(&fields)) {
                out.push(Info { name, record });
            }
        }
        Ok(out)
    }

    /// Removes the directories no record names (what a crash or a failed removal left), and
    /// says which.
    pub fn cleanup(&self) -> Result<Vec<PathBuf>, SnapError> {
        // The writer lock: no Prepare is between making a directory and committing its record.
        let txn = self.store.write()?;
        let live: HashSet<String> = txn
            .all()?
            .into_iter()
            .map(|(_, r)| r.id.to_string())
            .collect();
        let dir = self.root.join("snapshots");
        let mut removed = Vec::new();
        for entry in fs::read_dir(&dir).map_err(|e| SnapError::io("cannot list", &dir, e))? {
            let entry = entry.map_err(|e| SnapError::io("cannot list", &dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if live.contains(&name) {
                continue;
            }
            let path = entry.path();
            match fs::remove_dir_all(&path) {
                Ok(()) => removed.push(path),
                Err(e) => eprintln!(
                    "mosaicfs-snapshotter: cannot remove {}: {e}",
                    path.display()
                ),
            }
        }
        drop(txn);
        Ok(removed)
    }
}

/// The directory numbers of `parent` and its ancestors, top first, read with `get`.
fn parents_of(
    get: impl Fn(&str) -> Result<Option<Record>, SnapError>,
    parent: &str,
) -> Result<Vec<u64>, SnapError> {
    let mut ids = Vec::new();
    let mut name = parent.to_string();
    while !name.is_empty() {
        let record = get(&name)?.ok_or_else(|| {
            SnapError::NotFound(format!("parent snapshot {name:?} does not exist"))
        })?;
        if record.kind != Kind::Committed {
            return Err(SnapError::InvalidArgument(format!(
                "parent {name:?} is not a committed snapshot (it is {}): commit it first",
                record.kind.name()
            )));
        }
        ids.push(record.id);
        name = record.parent;
    }
    Ok(ids)
}

/// st_blocks of every inode under `dir` (each hard-linked inode once), and their number.
fn disk_usage(dir: &Path) -> Result<(i64, i64), SnapError> {
    let mut seen = HashSet::new();
    let (mut bytes, mut inodes) = (0i64, 0i64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let st = fs::symlink_metadata(&path).map_err(|e| SnapError::io("cannot stat", &path, e))?;
        if seen.insert((st.dev(), st.ino())) {
            bytes += st.blocks() as i64 * 512;
            inodes += 1;
        }
        if st.is_dir() {
            for entry in fs::read_dir(&path).map_err(|e| SnapError::io("cannot list", &path, e))? {
                stack.push(
                    entry
                        .map_err(|e| SnapError::io("cannot list", &path, e))?
                        .path(),
                );
            }
        }
    }
    Ok((bytes, inodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> HashMap<String, String> {
        HashMap::new()
    }

    #[test]
    fn a_stack_mounts_its_parents_top_first_under_the_active_layer() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path(), vec!["copy_whole=0".into()]).unwrap();
        let base = s.create(Kind::Active, "base-tmp", "", labels()).unwrap();
        assert_eq!(base[0].r#type, "bind");
        s.commit("base", "base-tmp", labels()).unwrap();
        s.create(Kind::Active, "mid-tmp", "base", labels()).unwrap();
        s.commit("mid", "mid-tmp", labels()).unwrap();
        let top = s.create(Kind::Active, "top", "mid", labels()).unwrap();
        assert_eq!(top[0].r#type, "fuse3.mosaicfs");
        let (mid, base) = (
            s.stat("mid").unwrap().record.id,
            s.stat("base").unwrap().record.id,
        );
        let lower = top[0]
            .options
            .iter()
            .find(|o| o.starts_with("lowerdir="))
            .unwrap();
        assert_eq!(
            lower,
            &format!(
                "lowerdir={}:{}",
                s.layer(mid).display(),
                s.layer(base).display()
            )
        );
        assert!(
            top[0].options.contains(&"copy_whole=0".to_string()),
            "--mount-options reach the mount"
        );
        let view = s.create(Kind::View, "v", "mid", labels()).unwrap();
        assert!(
            view[0].options.iter().all(|o| !o.starts_with("upperdir=")),
            "a view is read-only"
        );
    }

    #[test]
    fn errors_are_the_kinds_containerd_expects() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path(), Vec::new()).unwrap();
        s.create(Kind::Active, "a", "", labels()).unwrap();
        assert!(matches!(
            s.create(Kind::Active, "a", "", labels()),
            Err(SnapError::AlreadyExists(_))
        ));
        assert!(matches!(
            s.create(Kind::Active, "b", "a", labels()),
            Err(SnapError::InvalidArgument(_))
        ));
        assert!(matches!(
            s.create(Kind::Active, "b", "nope", labels()),
            Err(SnapError::NotFound(_))
        ));
        s.commit("c", "a", labels()).unwrap();
        assert!(matches!(s.stat("a"), Err(SnapError::NotFound(_))));
        assert!(matches!(
            s.mounts("c"),
            Err(SnapError::FailedPrecondition(_))
        ));
        s.create(Kind::View, "v", "c", labels()).unwrap();
        assert!(matches!(
            s.commit("d", "v", labels()),
            Err(SnapError::FailedPrecondition(_))
        ));
        assert!(matches!(
            s.remove("c"),
            Err(SnapError::FailedPrecondition(_))
        ));
        s.remove("v").unwrap();
        s.remove("c").unwrap();
        assert!(s.list(&[]).unwrap().is_empty());
    }

    #[test]
    fn usage_counts_allocated_blocks_not_sizes() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path(), Vec::new()).unwrap();
        s.create(Kind::Active, "a", "", labels()).unwrap();
        let f = fs::File::create(s.layer(s.stat("a").unwrap().record.id).join("sparse")).unwrap();
        f.set_len(1 << 30).unwrap();
        let (bytes, inodes) = s.usage("a").unwrap();
        assert!(bytes < 1 << 20, "a 1 GiB hole counted {bytes} bytes");
        assert_eq!(inodes, 2);
    }

    #[test]
    fn a_directory_no_record_names_is_removed_when_the_root_is_opened_again() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path(), Vec::new()).unwrap();
        s.create(Kind::Active, "a", "", labels()).unwrap();
        let kept = s.dir(s.stat("a").unwrap().record.id);
        drop(s);
        // What a crash between the rename and the commit of a Prepare leaves behind.
        let orphan = root.path().join("snapshots/99/fs");
        fs::create_dir_all(&orphan).unwrap();
        fs::create_dir_all(root.path().join("snapshots/new-7/fs")).unwrap();
        let s = Snapshots::open(root.path(), Vec::new()).unwrap();
        assert!(!orphan.exists() && !root.path().join("snapshots/new-7").exists());
        assert!(kept.exists());
        assert_eq!(s.stat("a").unwrap().record.kind, Kind::Active);
    }

    #[test]
    fn a_layer_the_layer_store_serves_is_committed_without_unpacking() {
        let root = tempfile::tempdir().unwrap();
        let store = tempfile::tempdir().unwrap();
        // The store's layout: base64("reg/img:1")/DIGEST/diff.
        let tree = store.path().join("cmVnL2ltZzox/sha256:00ff/diff");
        fs::create_dir_all(&tree).unwrap();
        fs::write(tree.join("file"), "from the store").unwrap();
        let s = Snapshots::open(root.path(), Vec::new())
            .unwrap()
            .with_layer_store(store.path().to_path_buf());
        let unpack = |digest: &str| {
            HashMap::from([
                (remote::TARGET_LABEL.to_string(), "chain-1".to_string()),
                (
                    "containerd.io/snapshot/cri.image-ref".to_string(),
                    "reg/img:1".to_string(),
                ),
                (
                    "containerd.io/snapshot/cri.layer-digest".to_string(),
                    digest.to_string(),
                ),
            ])
        };
        // A layer the store does not have is unpacked as before.
        assert!(
            s.create(Kind::Active, "extract-0", "", unpack("sha256:0000"))
                .is_ok()
        );
        s.remove("extract-0").unwrap();
        // containerd's unpack takes "already exists" as "the layer is there".
        assert!(matches!(
            s.create(Kind::Active, "extract-1", "", unpack("sha256:00ff")),
            Err(SnapError::AlreadyExists(_))
        ));
        assert!(matches!(s.stat("extract-1"), Err(SnapError::NotFound(_))));
        let info = s.stat("chain-1").unwrap();
        assert_eq!(info.record.kind, Kind::Committed);
        assert!(info.record.labels.contains_key(remote::REMOTE_LABEL));
        assert_eq!(s.usage("chain-1").unwrap(), (0, 0));
        // A container on it sees the store's tree below its own layer.
        let mounts = s.create(Kind::Active, "c", "chain-1", labels()).unwrap();
        let layer = s.layer(info.record.id);
        assert_eq!(mounts[0].r#type, "fuse3.mosaicfs");
        assert!(
            mounts[0]
                .options
                .contains(&format!("lowerdir={}", layer.display()))
        );
        assert_eq!(
            fs::read_to_string(layer.join("file")).unwrap(),
            "from the store"
        );
        s.create(Kind::Active, "c2", "", labels()).unwrap();
        let view = s.create(Kind::View, "v", "chain-1", labels()).unwrap();
        assert_eq!(view[0].source, layer.to_string_lossy());
        // Removing the snapshot gives the layer back and leaves the store's files alone.
        s.remove("c").unwrap();
        s.remove("v").unwrap();
        s.remove("chain-1").unwrap();
        assert_eq!(
            fs::read_to_string(tree.join("file")).unwrap(),
            "from the store"
        );
    }

    #[test]
    fn update_changes_labels_only() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path(), Vec::new()).unwrap();
        s.create(
            Kind::Active,
            "a",
            "",
            HashMap::from([("x".into(), "1".into()), ("y".into(), "2".into())]),
        )
        .unwrap();
        let info = s
            .update(
                "a",
                HashMap::from([("y".into(), "3".into())]),
                &["labels.y".into(), "labels.x".into()],
            )
            .unwrap();
        assert_eq!(
            info.record.labels,
            HashMap::from([("y".to_string(), "3".to_string())])
        );
        assert!(matches!(
            s.update("a", labels(), &["parent".into()]),
            Err(SnapError::InvalidArgument(_))
        ));
    }
}
