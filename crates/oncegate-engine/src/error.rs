//! The engine's errors: the core's refusals, plus what storage and load can do.

use oncegate_core::Code;

/// Why an engine call did not produce an answer about the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A definite answer from the contract (invalid argument, not found, lease lost,
    /// conflict, already completed).
    #[error(transparent)]
    Refused(#[from] oncegate_core::Error),
    /// The key's shard cannot serve; nothing was changed or granted.
    #[error("shard {shard} is unavailable: {reason}")]
    Unavailable {
        /// The shard that owns the key.
        shard: u32,
        /// Why, in words.
        reason: String,
    },
    /// The disk holding the shard's file is full: the write was refused and nothing of it
    /// stored (the batch that found the disk full is refused whole, its reads included).
    /// From then on reads and replays go on; writes resume once the disk has room.
    #[error(
        "shard {shard} cannot write: the disk holding {path} is full (ENOSPC); reads and replays still work, and writes resume once it has room"
    )]
    DiskFull {
        /// The shard.
        shard: u32,
        /// Its file.
        path: String,
    },
    /// A bounded queue is full; retry later.
    #[error("{what} is full; {limit_name} is {limit}")]
    ResourceExhausted {
        /// What is full, for example "shard 1 mailbox".
        what: String,
        /// The setting that bounds it.
        limit_name: &'static str,
        /// Its value.
        limit: usize,
    },
}

impl Error {
    /// The stable code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Refused(refusal) => refusal.code(),
            Error::Unavailable { .. } => Code::Unavailable,
            Error::ResourceExhausted { .. } | Error::DiskFull { .. } => Code::ResourceExhausted,
        }
    }
}

impl From<oncegate_core::Invalid> for Error {
    fn from(invalid: oncegate_core::Invalid) -> Self {
        Error::Refused(invalid.into())
    }
}
