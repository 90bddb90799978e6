//! Why the data directory's layout (manifest, slot map, epochs, lock) could not be read
//! or written.

use std::path::PathBuf;

/// Why the data directory's layout could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
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
        /// The configured kind's name in quotes.
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
    /// The slot map cannot be read or is damaged.
    #[error(transparent)]
    SlotMap(#[from] super::slots::SlotMapError),
}
