//! The gRPC face: containerd's snapshots service (the containerd-snapshots crate's trait),
//! each call run on a blocking thread (the store fsyncs, Usage walks a layer) and logged when
//! it fails.

use std::collections::HashMap;
use std::sync::Arc;

use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind as GrpcKind, Snapshotter, Usage};

use crate::error::SnapError;
use crate::snapshots::{self, Snapshots};
use crate::store::Kind;

pub struct Service(pub Arc<Snapshots>);

impl Service {
    async fn run<T: Send + 'static>(
        &self,
        what: String,
        f: impl FnOnce(&Snapshots) -> Result<T, SnapError> + Send + 'static,
    ) -> Result<T, SnapError> {
        let snapshots = self.0.clone();
        let result = tokio::task::spawn_blocking(move || f(&snapshots))
            .await
            .unwrap_or_else(|e| Err(SnapError::Internal(format!("{what}: {e}"))));
        // NotFound and AlreadyExists are answers containerd asks for (a Stat before a Prepare,
        // an unpack that finds its layer there), not failures.
        if let Err(e) = &result
            && !matches!(e, SnapError::NotFound(_) | SnapError::AlreadyExists(_))
        {
            eprintln!("mosaicfs-snapshotter: {what}: {e}");
        }
        result
    }
}

fn info(i: snapshots::Info) -> Info {
    Info {
        kind: match i.record.kind {
            Kind::View => GrpcKind::View,
            Kind::Active => GrpcKind::Active,
            Kind::Committed => GrpcKind::Committed,
        },
        name: i.name,
        parent: i.record.parent,
        labels: i.record.labels,
        created_at: i.record.created.time(),
        updated_at: i.record.updated.time(),
    }
}

type InfoIter = std::vec::IntoIter<Result<Info, SnapError>>;

#[containerd_snapshots::tonic::async_trait]
impl Snapshotter for Service {
    type Error = SnapError;

    async fn stat(&self, key: String) -> Result<Info, SnapError> {
        self.run(format!("stat {key:?}"), move |s| s.stat(&key))
            .await
            .map(info)
    }

    async fn update(&self, i: Info, fieldpaths: Option<Vec<String>>) -> Result<Info, SnapError> {
        let what = format!("update {:?}", i.name);
        self.run(what, move |s| {
            s.update(&i.name, i.labels, &fieldpaths.unwrap_or_default())
        })
        .await
        .map(info)
    }

    async fn usage(&self, key: String) -> Result<Usage, SnapError> {
        let (size, inodes) = self
            .run(format!("usage {key:?}"), move |s| s.usage(&key))
            .await?;
        Ok(Usage { size, inodes })
    }

    async fn mounts(&self, key: String) -> Result<Vec<Mount>, SnapError> {
        self.run(format!("mounts {key:?}"), move |s| s.mounts(&key))
            .await
    }

    async fn prepare(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, SnapError> {
        let what = format!("prepare {key:?} on {parent:?}");
        self.run(what, move |s| s.create(Kind::Active, &key, &parent, labels))
            .await
    }

    async fn view(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, SnapError> {
        let what = format!("view {key:?} of {parent:?}");
        self.run(what, move |s| s.create(Kind::View, &key, &parent, labels))
            .await
    }

    async fn commit(
        &self,
        name: String,
        key: String,
        labels: HashMap<String, String>,
    ) -> Result<(), SnapError> {
        self.run(format!("commit {key:?} as {name:?}"), move |s| {
            s.commit(&name, &key, labels)
        })
        .await
    }

    async fn remove(&self, key: String) -> Result<(), SnapError> {
        self.run(format!("remove {key:?}"), move |s| s.remove(&key))
            .await
    }

    async fn clear(&self) -> Result<(), SnapError> {
        self.run("cleanup".into(), |s| s.cleanup().map(drop)).await
    }

    type InfoStream = tokio_stream::Iter<InfoIter>;

    async fn list(
        &self,
        _snapshotter: String,
        filters: Vec<String>,
    ) -> Result<Self::InfoStream, SnapError> {
        let all = self
            .run(format!("list {filters:?}"), move |s| s.list(&filters))
            .await?;
        let infos: Vec<Result<Info, SnapError>> = all.into_iter().map(|i| Ok(info(i))).collect();
        Ok(tokio_stream::iter(infos))
    }
}
