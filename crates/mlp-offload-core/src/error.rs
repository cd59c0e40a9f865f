//! The one error type of the core. The bindings map each kind to one Python exception in one place.

use std::io;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call failed. `errno` and `path` travel to Python as `OSError.errno` / `.filename`.
    #[error("{op} {path}: {source}{}", offset.map(|o| format!(" (at offset {o})")).unwrap_or_default())]
    Io {
        op: &'static str,
        path: PathBuf,
        offset: Option<u64>,
        #[source]
        source: io::Error,
    },
    /// A stored object is not what was written: checksum mismatch, truncated file, torn write.
    #[error("object {key:?} in {path}: {reason}")]
    Corrupt {
        key: String,
        path: PathBuf,
        reason: String,
    },
    /// A configuration key or argument has a bad value; `key` names it.
    #[error("{key}: {message}")]
    Config { key: String, message: String },
    /// The named object does not exist in the store.
    #[error("no object {key:?} in the store at {root}")]
    NotFound { key: String, root: PathBuf },
    /// Another open store holds this rank directory (the same path and rank opened twice, in this
    /// process or another); `holder` is the pid its lock file names.
    #[error(
        "{path} is in use by {} (another store opened the same path and rank); close it, or give this one \
         other paths or another rank",
        holder.map_or_else(|| "another store".to_string(), |pid| format!("process {pid}"))
    )]
    InUse { path: PathBuf, holder: Option<u32> },
}

impl Error {
    pub fn io(op: &'static str, path: impl AsRef<Path>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.as_ref().to_path_buf(),
            offset: None,
            source,
        }
    }

    pub fn io_at(op: &'static str, path: impl AsRef<Path>, offset: u64, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.as_ref().to_path_buf(),
            offset: Some(offset),
            source,
        }
    }

    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The OS error number, where there is one (corruption reports `EIO`, a missing object `ENOENT`).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            Error::Corrupt { .. } => Some(libc::EIO),
            Error::NotFound { .. } => Some(libc::ENOENT),
            Error::InUse { .. } => Some(libc::EWOULDBLOCK),
            Error::Config { .. } => None,
        }
    }

    /// The file or directory the error is about, where there is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::Io { path, .. } | Error::Corrupt { path, .. } => Some(path),
            Error::NotFound { root, .. } => Some(root),
            Error::InUse { path, .. } => Some(path),
            Error::Config { .. } => None,
        }
    }

    /// A copy for handing one failure to several waiters (`io::Error` is not `Clone`).
    pub fn duplicate(&self) -> Error {
        match self {
            Error::Io {
                op,
                path,
                offset,
                source,
            } => Error::Io {
                op,
                path: path.clone(),
                offset: *offset,
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::Corrupt { key, path, reason } => Error::Corrupt {
                key: key.clone(),
                path: path.clone(),
                reason: reason.clone(),
            },
            Error::Config { key, message } => Error::Config {
                key: key.clone(),
                message: message.clone(),
            },
            Error::NotFound { key, root } => Error::NotFound {
                key: key.clone(),
                root: root.clone(),
            },
            Error::InUse { path, holder } => Error::InUse {
                path: path.clone(),
                holder: *holder,
            },
        }
    }
}
