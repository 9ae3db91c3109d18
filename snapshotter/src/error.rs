//! The snapshotter's one error type. Each kind is the gRPC code containerd's proxy turns back
//! into its own error (errdefs.FromGRPC): NotFound, AlreadyExists, FailedPrecondition and
//! InvalidArgument reach `ctr` and the CRI plugin as the same errors containerd's built-in
//! snapshotters give.

use std::fmt;

use containerd_snapshots::tonic::{Code, Status};

#[derive(Debug)]
pub enum SnapError {
    NotFound(String),
    AlreadyExists(String),
    FailedPrecondition(String),
    InvalidArgument(String),
    Internal(String),
}

impl SnapError {
    /// An I/O error on a path of the snapshotter's root, saying what was being done.
    pub fn io(what: &str, path: &std::path::Path, e: std::io::Error) -> SnapError {
        SnapError::Internal(format!("{what} {}: {e}", path.display()))
    }
}

impl fmt::Display for SnapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapError::NotFound(m)
            | SnapError::AlreadyExists(m)
            | SnapError::FailedPrecondition(m)
            | SnapError::InvalidArgument(m)
            | SnapError::Internal(m) => f.write_str(m),
        }
    }
}

impl From<SnapError> for Status {
    fn from(e: SnapError) -> Status {
        let code = match e {
            SnapError::NotFound(_) => Code::NotFound,
            SnapError::AlreadyExists(_) => Code::AlreadyExists,
            SnapError::FailedPrecondition(_) => Code::FailedPrecondition,
            SnapError::InvalidArgument(_) => Code::InvalidArgument,
            SnapError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
