//! The engine's errors: the core's refusals, plus what storage and load can do.

use std::path::PathBuf;

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

/// Why a data directory could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The configuration breaks its own bounds.
    #[error("invalid engine configuration: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Config(Vec<oncegate_core::Problem>),
    /// A file in the data directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// Another process holds the data directory.
    #[error("{path} is locked by another process; one oncegate owns a data directory at a time")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// The manifest cannot be parsed or has an unknown format.
    #[error("manifest {path}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration asks for more shards than the directory has.
    #[error(
        "data directory {path} has {found} shards but the configuration asks for {configured}; keys are never \
         re-routed silently. To add shards, start the server with its {found} shards and run \
         `oncegate admin add-shards --to {configured}` (online), or stop it and run \
         `oncegate reshard --data-dir {path} --to {configured}` (shards cannot be removed)"
    )]
    ShardCount {
        /// The data directory.
        path: PathBuf,
        /// The count in the manifest.
        found: u32,
        /// The configured count.
        configured: u32,
    },
    /// The directory holds shard files but its manifest is gone: starting would route
    /// keys by a guessed shard count.
    #[error(
        "{path} is missing, but the data directory holds {shard_files} shard files; the manifest fixes \
         which shard owns each key, so oncegate will not guess it. Restore the manifest from a backup \
         of this directory (or recreate it with `shards = {shard_files}` only if you are sure every \
         shard file of the directory is present), then start again"
    )]
    ManifestMissing {
        /// The manifest's expected path.
        path: PathBuf,
        /// How many `shard-*.sqlite` files the directory holds.
        shard_files: usize,
    },
    /// The manifest routes keys by the slot map, and the map file is gone.
    #[error(
        "{path} is missing, but the manifest routes keys by it; the slot map says which shard owns each \
         key, so oncegate will not guess it. Restore it from a backup of this directory, then start again"
    )]
    SlotMapMissing {
        /// The slot map's expected path.
        path: PathBuf,
    },
    /// The PostgreSQL store could not be set up (its connection string, its runtime).
    #[error("postgres store: {0}")]
    Postgres(#[source] crate::store::StoreError),
    /// The store cannot do what was asked.
    #[error("{what}")]
    Unsupported {
        /// What, and what to do instead.
        what: &'static str,
    },
    /// The data directory holds records of another store than the one configured (or,
    /// unset, than the one its shards name): opened so, its records would be invisible
    /// and their keys granted again.
    #[error(
        "{dir} holds records of the {found} store ({example}) but store.kind is {configured}; set store.kind to the store that wrote them"
    )]
    OtherStore {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The kind its shards are.
        found: &'static str,
        /// One of them.
        example: String,
        /// The configured kind's name in quotes, or `unset`.
        configured: String,
    },
    /// The data directory holds a shard of the log store that versions before
    /// SQLite-only wrote: this version cannot read its records.
    #[error(
        "{dir} holds {example}, a shard of the log store that earlier versions of oncegate wrote; this version reads only SQLite and PostgreSQL stores"
    )]
    LogStore {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The first of its log shards.
        example: String,
    },
    /// A shard's first open found the disk full: the file it could not write.
    #[error(
        "{path}: no space left on device (ENOSPC); shard {shard} cannot open: free space on its file system and try again"
    )]
    DiskFull {
        /// The shard.
        shard: u32,
        /// The file.
        path: std::path::PathBuf,
    },
    /// The slot map cannot be read or is damaged.
    #[error(transparent)]
    SlotMap(#[from] crate::placement::slots::SlotMapError),
}

/// Why adding shards (online or to a stopped directory) stopped or was refused. Every key
/// is where the slot map says whatever the error; running the same add again resumes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    /// The data directory's own files (manifest, slot map, epochs) could not be read or
    /// written, or the directory could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The slot map could not be written.
    #[error(transparent)]
    SlotMap(#[from] crate::placement::slots::SlotMapError),
    /// The asked count is below the current one or above [`crate::SHARDS_MAX`].
    #[error("to is {to}; there are {shards} shards, and shards can be added up to {max}, never removed")]
    Target {
        /// The count asked for.
        to: u32,
        /// The count now.
        shards: u32,
        /// The most there may be.
        max: u32,
    },
    /// The store has no slots to move (PostgreSQL: every shard shares one table).
    #[error("{what}")]
    Unsupported {
        /// Why, and what to do instead.
        what: &'static str,
    },
    /// Another add-shards or a backup holds the slot map.
    #[error("{what}; wait for it to finish")]
    Busy {
        /// What is running.
        what: &'static str,
    },
    /// A slot's move could neither finish nor be undone (its map could not be written):
    /// the slot answers `unavailable` and no shard is added until the server restarts and
    /// reads the map from disk.
    #[error(
        "slot {slot} could not finish moving to shard {to} ({reason}); restart the server, then add shards again"
    )]
    SlotStuck {
        /// The slot.
        slot: u32,
        /// The shard it was moving to.
        to: u32,
        /// Why.
        reason: String,
    },
    /// The add stopped before it finished: the engine is shutting down, or a test
    /// stopped it.
    #[error("adding shards stopped: {reason}")]
    Interrupted {
        /// Why.
        reason: &'static str,
    },
    /// A shard's file could not be opened or changed (a stopped directory's add).
    #[error("shard {shard}: {source}")]
    Store {
        /// The shard.
        shard: u32,
        /// What its store said.
        #[source]
        source: crate::store::StoreError,
    },
    /// A shard failed its part of a move, or is not running (a serving engine's add).
    #[error("shard {shard}: {source}")]
    Shard {
        /// The shard.
        shard: u32,
        /// What it answered.
        #[source]
        source: Error,
    },
}

/// Why a backup was refused or failed. The original is unchanged whatever the error; the
/// copy is complete only when the backup returned `Ok`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    /// The node keeps no records of its own (PostgreSQL: back up the database).
    #[error("{what}")]
    Unsupported {
        /// Why, and what to do instead.
        what: &'static str,
    },
    /// An add-shards or another backup holds the slot map, or a slot is moving.
    #[error("{what}; wait for it to finish")]
    Busy {
        /// What is running.
        what: &'static str,
    },
    /// The destination exists and is not empty: a backup goes to a new directory.
    #[error("{path} exists and is not empty; a backup goes to a new directory")]
    NotEmpty {
        /// The destination.
        path: PathBuf,
    },
    /// A file of the copy or of the original could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A shard's file could not be copied.
    #[error("shard {shard}: {source}")]
    Copy {
        /// The shard.
        shard: u32,
        /// What SQLite said.
        #[source]
        source: crate::store::StoreError,
    },
}
