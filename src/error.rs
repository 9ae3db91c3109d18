//! The one error type of mosaicfs: an errno for the FUSE boundary plus context for the log.

use std::fmt;

#[derive(Debug, Clone)]
pub struct Error {
    errno: i32,
    context: Option<String>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn from_errno(errno: i32) -> Self {
        Error {
            errno,
            context: None,
        }
    }

    /// An error that the log should explain: `EIO` for damaged metadata, say, with the file named.
    pub fn with_context(errno: i32, context: impl Into<String>) -> Self {
        Error {
            errno,
            context: Some(context.into()),
        }
    }

    pub fn errno(&self) -> i32 {
        self.errno
    }

    pub fn context(&self) -> Option<&str> {
        self.context.as_deref()
    }

    pub fn is(&self, errno: i32) -> bool {
        self.errno == errno
    }
}

pub fn errno(e: i32) -> Error {
    Error::from_errno(e)
}

impl From<rustix::io::Errno> for Error {
    fn from(e: rustix::io::Errno) -> Self {
        Error::from_errno(e.raw_os_error())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let msg = std::io::Error::from_raw_os_error(self.errno);
        match &self.context {
            Some(c) => write!(f, "{c}: {msg}"),
            None => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for Error {}
