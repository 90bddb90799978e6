//! The engine's own errors: opening a data directory, adding shards, a backup. A call's
//! error is `crate::error::Error`; the layout's and the store's keep their own enums and
//! are carried as sources.

use std::path::PathBuf;

use crate::error::Error;
use crate::placement::LayoutError;
use crate::store::StoreError;

/// Why a data directory could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The configuration breaks its own bounds.
    #[error("invalid engine configuration: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Config(Vec<oncegate_core::Problem>),
    /// The PostgreSQL store could not be set up (its connection string, its runtime).
    #[error("postgres store: {0}")]
    Postgres(#[source] StoreError),
    /// The store cannot do what was asked.
    #[error("{what}")]
    Unsupported {
        /// What, and what to do instead.
        what: &'static str,
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
    /// A file the engine needs outside the layout (a shard's thread) could not be made.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The data directory's layout could not be read or written.
    #[error(transparent)]
    Layout(#[from] LayoutError),
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
    /// The data directory's manifest, epochs or slot map could not be read or written.
    #[error(transparent)]
    Layout(#[from] LayoutError),
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
        "{slots} could not finish moving to shard {to} ({reason}); restart the server (or run the reshard again), then add shards again"
    )]
    SlotStuck {
        /// The slots.
        slots: crate::placement::slots::Slots,
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
        source: StoreError,
    },
}
