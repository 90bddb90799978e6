//! The oncegate shard engine and its embedded API.
//!
//! Each key hashes (see `oncegate_core::route`) to a slot, which the slot map gives to one
//! shard. A shard is an actor: one OS thread that alone owns its store (one SQLite file in
//! WAL mode, or one connection to the PostgreSQL table every node shares; `store/`) and
//! is fed through a bounded crossbeam-channel mailbox. It applies a drained batch in one transaction and answers
//! only after the commit is durable. `docs/ARCHITECTURE.md` is the map; `shard/mod.rs`
//! has the actor's protocol.
//!
//! The same [`Engine`] serves the gRPC front and in-process (embedded) callers: its
//! methods are `async` (usable from any runtime; the answer travels on a oneshot
//! channel) with `_blocking` twins for synchronous callers.
//!
//! The modules depend one way: `files` ← `placement` ← `store` ← `shard` ← `engine`, with
//! `clock`, `config`, `error`, `faults`, `index`, `quota` and `schedule` as vocabulary
//! any of them may use.

mod clock;
mod config;
mod engine;
mod error;
mod faults;
pub mod files;
mod index;
mod placement;
mod quota;
mod schedule;
mod shard;
mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Durability, EngineConfig, PgClock, PostgresConfig, PostgresUrl, SHARDS_DEFAULT, SHARDS_MAX, SqliteConfig,
    StoreConfig, StoreKind, UnknownStoreKind,
};
pub use engine::{BackedUp, Engine, ShardStats, TenantGate};
pub use engine::{BackupError, OpenError, ResizeError};
pub use error::Error;
#[doc(hidden)]
pub use faults::Faults;
pub use oncegate_core::gate::{CommitRequest, Gate, KeyRequest, Renewed, ReserveRequest, Reserved};
pub use placement::LayoutError;
pub use placement::slots::{SlotMapError, SlotMove, Slots};
pub use shard::ShardState;
pub use store::StoreError;

/// The stores this build can keep records in (the PostgreSQL store is the `postgres`
/// feature).
pub const STORE_KINDS: &[&str] =
    if cfg!(feature = "postgres") { &["sqlite", "postgres"] } else { &["sqlite"] };

/// Adding shards to a stopped data directory (`oncegate reshard`), and what an add did.
pub mod reshard {
    pub use crate::engine::{Pauses, Progress, Resharded, add_shards, add_shards_on};
}

/// What the workspace's own tests and tools reach into: the data directory's layout and
/// SQLite's settings for the benchmark's layouts and raw ceiling. Not the API: it changes
/// without notice.
#[doc(hidden)]
pub mod testing {
    pub use crate::placement::{manifest, slots, token};

    /// Opens a SQLite file with a shard file's VFS, page size and settings (from
    /// `config`), without the shard's schema, checkpointer or start-up steps: the
    /// benchmark's raw-SQLite ceiling measures the same SQLite on files of its own this
    /// way. Never on a serving shard's file: it would be a second writer.
    pub fn open_sqlite_like_shard(
        path: &std::path::Path,
        config: &crate::EngineConfig,
    ) -> Result<rusqlite::Connection, crate::StoreError> {
        let sqlite = config.store.sqlite();
        crate::store::open_configured(
            path,
            &crate::files::OsFiles,
            config.durability,
            sqlite.wal_checkpoint_pages,
            sqlite.page_cache_bytes_max,
        )
    }

    /// Applies the settings of a shard file's connection to `conn` (WAL, `synchronous`,
    /// the checkpoint interval, the page cache) from `config`, for the benchmark's record
    /// layouts, which choose their own page size.
    pub fn configure_sqlite(
        conn: &rusqlite::Connection,
        config: &crate::EngineConfig,
    ) -> Result<(), crate::StoreError> {
        let sqlite = config.store.sqlite();
        crate::store::configure(
            conn,
            config.durability,
            sqlite.wal_checkpoint_pages,
            sqlite.page_cache_bytes_max,
        )
    }
}
