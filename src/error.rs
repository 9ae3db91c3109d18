//! The one error type of mosaicfs: an errno for the FUSE boundary plus context for the log.
//!
//! Two kinds share it. A request's error is an errno with, at most, context that names what
//! failed ("reading the mark of 'a/b': Input/output error"). A setup or tool error — a bad
//! option, a missing layer, a refused mount, a damaged layer found by fsck — is a message that
//! already says what was wrong and what to do: it prints as written, with no errno text after
//! it (`Error::message`, or `?` on a `String`). The `message!` macro formats one.
//! Decoders of layer data (the partial-file mark, stat overrides) answer with a `String`
//! reason instead: what is wrong with the bytes, which their caller wraps in either kind.

use std::fmt;

#[derive(Debug, Clone)]
pub struct Error {
    errno: i32,
    context: Option<String>,
    /// The context is the whole message (a setup or tool error): printed alone.
    whole: bool,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn from_errno(errno: i32) -> Self {
        Error {
            errno,
            context: None,
            whole: false,
        }
    }

    /// An error that the log should explain: `EIO` for damaged metadata, say, with the file named.
    pub fn with_context(errno: i32, context: impl Into<String>) -> Self {
        Error {
            errno,
            context: Some(context.into()),
            whole: false,
        }
    }

    /// A setup or tool error: `msg` says what was wrong and what to do, and is all it prints.
    pub fn message(msg: impl Into<String>) -> Self {
        Error {
            errno: libc::EINVAL,
            context: Some(msg.into()),
            whole: true,
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

/// `message!("cannot open '{}'", path.display())`: a setup or tool error, formatted.
#[macro_export]
macro_rules! message {
    ($($arg:tt)*) => {
        $crate::error::Error::message(format!($($arg)*))
    };
}

impl From<String> for Error {
    fn from(msg: String) -> Self {
        Error::message(msg)
    }
}

impl From<&str> for Error {
    fn from(msg: &str) -> Self {
        Error::message(msg)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let msg = std::io::Error::from_raw_os_error(self.errno);
        match &self.context {
            Some(c) if self.whole => write!(f, "{c}"),
            Some(c) => write!(f, "{c}: {msg}"),
            None => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_prints_alone_and_an_errno_with_its_text() {
        let m = crate::message!("upperdir '{}' does not exist: create it", "/u");
        assert_eq!(m.to_string(), "upperdir '/u' does not exist: create it");
        let from_string: Error = String::from("bad option").into();
        assert_eq!(from_string.to_string(), "bad option");
        let e = Error::with_context(libc::EIO, "reading the mark of 'a'");
        assert_eq!(
            e.to_string(),
            "reading the mark of 'a': Input/output error (os error 5)"
        );
        assert_eq!(
            errno(libc::ENOENT).to_string(),
            "No such file or directory (os error 2)"
        );
    }
}
