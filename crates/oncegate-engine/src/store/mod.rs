//! The boundary between the shard actor and what keeps its records durable.
//!
//! The actor (`shard/`) decides every request with the core's `decide`, keeps its waiters
//! and alarms, and answers only after a commit; what it talks to is a [`Store`] and, per
//! batch, a [`Txn`]. Two stores stand behind them:
//!
//! - [`sqlite`]: the shard's own file, which the actor alone opens (the default). The
//!   actor's thread is the only writer, so its in-memory index and counters are the truth.
//! - [`postgres`]: one table shared by every shard of every oncegate node pointed at the
//!   database. Nothing in memory is the truth there: a transaction locks the keys it
//!   decides, reads their rows, takes its time from the database's clock and its tokens
//!   from a database sequence (`postgres.rs` says why each is safe across nodes).
//!
//! The two differ in what the transaction needs up front (PostgreSQL locks the batch's
//! keys when it begins and reads the time after the locks), which is why [`Store::begin`]
//! takes the keys and the shard's own reading of time, and [`Txn::now`] answers the time
//! the decisions use. Everything else is the same calls on either side.

#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod sqlite;

use oncegate_core::{Event, Key, Namespace, Record, Scope, Tenant, Transition};

pub(crate) use sqlite::{Tuning, configure, open_configured};

/// The PostgreSQL store every shard of a node shares, when the records live there. A
/// build without the `postgres` feature has none: the type has no value.
#[cfg(feature = "postgres")]
pub(crate) type SharedDb = std::sync::Arc<postgres::Postgres>;
/// The PostgreSQL store every shard of a node shares, when the records live there. A
/// build without the `postgres` feature has none: the type has no value.
#[cfg(not(feature = "postgres"))]
#[derive(Clone)]
pub(crate) enum SharedDb {}

use crate::quota::Tally;

/// What can go wrong in the store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// SQLite refused or failed.
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A commit failed with an I/O error (any `SQLITE_IOERR_*`): its sync may have
    /// failed, and after a failed `fsync` Linux may mark the unwritten pages clean, so
    /// this process could read back as committed what the disk never kept. Nothing may
    /// be built on the file in this process again ([`StoreError::is_failed_sync`]).
    #[error("a commit failed with an I/O error (its sync may have failed): {0}")]
    SyncFailed(#[source] rusqlite::Error),
    /// The disk holding the shard's files is full: SQLite's commit found no room for the
    /// WAL (`SQLITE_FULL` at `COMMIT`, which SQLite rolls back whole: nothing of it was
    /// written), or a checkpoint none for the database file.
    #[error("the disk is full: {0}")]
    DiskFull(#[source] rusqlite::Error),
    /// The shard refuses writes since its disk filled up, until a retry finds room.
    #[error("writes are refused until the disk has room")]
    WritesRefused,
    /// PostgreSQL refused or failed, or could not be reached: the server's message and
    /// code when it sent one. The driver's error is kept for callers that match on it,
    /// but not chained as a source: its text carries the server's DETAIL and HINT, which
    /// may quote rows, and logs print the whole chain.
    #[cfg(feature = "postgres")]
    #[error("postgres: {}", postgres::describe(.0))]
    Postgres(tokio_postgres::Error),
    /// The PostgreSQL store could not be set up: its connection string, its TLS roots,
    /// its pool or its runtime.
    #[cfg(feature = "postgres")]
    #[error("postgres {what}: {source}")]
    PostgresSetup {
        /// What was being set up.
        what: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// PostgreSQL gave no answer within a bound.
    #[cfg(feature = "postgres")]
    #[error("postgres: no answer within {field} ({limit_ms} ms)")]
    PostgresTimeout {
        /// The setting that bounds it.
        field: &'static str,
        /// Its value.
        limit_ms: u64,
    },
    /// The database is not one the store may use (read-only, another schema's tables),
    /// or a decision broke the store's own rule (a bug).
    #[cfg(feature = "postgres")]
    #[error("postgres: {0}")]
    PostgresRefused(String),
    /// The file or table is not what a shard's store must be.
    #[error("integrity check failed: {0}")]
    Corrupt(String),
    /// The store was written by a newer version.
    #[error("schema version {found} is unknown; this version reads {supported}")]
    Schema {
        /// The version found.
        found: i64,
        /// The version this binary reads and writes.
        supported: i64,
    },
    /// A fault the tests injected.
    #[error("injected fault: {0}")]
    Injected(&'static str),
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The store cannot do this (slot moves between PostgreSQL shards: they share one
    /// table, so there is nothing to move).
    #[error("the {store} store does not support {what}")]
    Unsupported {
        /// `postgres` or `sqlite`.
        store: &'static str,
        /// What was asked.
        what: &'static str,
    },
}

impl StoreError {
    /// Whether the error is a failed sync of a commit: the shard stops until the process
    /// restarts, rather than reopen its file in this process.
    pub(crate) fn is_failed_sync(&self) -> bool {
        matches!(self, StoreError::SyncFailed(_))
    }

    /// Whether the disk is full: the store's own verdict, or a file the engine writes
    /// that could not grow (`ENOSPC`, or `EDQUOT` for a quota).
    pub(crate) fn is_disk_full(&self) -> bool {
        match self {
            StoreError::DiskFull(_) | StoreError::WritesRefused => true,
            StoreError::Io { source, .. } => matches!(source.raw_os_error(), Some(28 | 122)),
            _ => false,
        }
    }

    /// Whether a statement hit SQLite's `SQLITE_FULL`: the file reached
    /// `shard_file_bytes_max` (SQLite's `max_page_count`), or the disk is full (which
    /// [`StoreError::is_disk_full`] tells apart).
    pub(crate) fn is_full(&self) -> bool {
        match self {
            StoreError::Sqlite(e) => e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull),
            _ => false,
        }
    }
}

/// The persisted counters of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Meta {
    /// The token the next grant gets.
    pub next_token: u64,
    /// The greatest `now` the shard ever used.
    pub high_water_ms: u64,
}

impl Default for Meta {
    /// The counters of a store nothing was written to.
    fn default() -> Meta {
        Meta { next_token: 1, high_water_ms: 0 }
    }
}

impl Meta {
    /// Counters covering both.
    pub fn max(self, other: Meta) -> Meta {
        Meta {
            next_token: self.next_token.max(other.next_token),
            high_water_ms: self.high_water_ms.max(other.high_water_ms),
        }
    }
}

/// An open store: the shard's own SQLite file, or its connection to the PostgreSQL table
/// every node shares. What only a node's own store has (slot rows, forced syncs, the
/// counts read at open, refused writes on a full disk, `meta`, the restart grace) is
/// reached through [`Store::own`] and [`Txn::own`].
pub(crate) enum Store {
    /// The shard's SQLite file.
    Own(sqlite::Store),
    /// The shared PostgreSQL table.
    #[cfg(feature = "postgres")]
    Shared(postgres::Store),
}

/// One transaction of a batch, an alarm or a move. Dropping it without [`Txn::commit`]
/// rolls it back.
pub(crate) enum Txn<'s> {
    Own(sqlite::Txn<'s>),
    #[cfg(feature = "postgres")]
    Shared(postgres::Txn<'s>),
}

/// Calls the same method on whichever store is behind `$self`.
macro_rules! dispatch {
    ($self:expr, $kind:ident, $s:ident => $body:expr) => {
        match $self {
            $kind::Own($s) => $body,
            #[cfg(feature = "postgres")]
            $kind::Shared($s) => $body,
        }
    };
}

/// Shards on PostgreSQL share one table: no slot move runs there.
pub(crate) const MOVES_ON_POSTGRES: StoreError =
    StoreError::Unsupported { store: "postgres", what: "slot moves" };

impl Store {
    /// Starts a write transaction for a batch deciding `keys`, at the shard's own reading
    /// of time `local_now_ms` (the time itself is [`Txn::now`]).
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub fn begin(&mut self, keys: &[&Scope], local_now_ms: u64) -> Result<Txn<'_>, StoreError> {
        match self {
            Store::Own(store) => store.begin(local_now_ms).map(Txn::Own),
            #[cfg(feature = "postgres")]
            Store::Shared(store) => store.begin(keys, local_now_ms, true).map(Txn::Shared),
        }
    }

    /// Starts a read-only transaction (no lock, no write, nothing to sync).
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub fn begin_read(&mut self, keys: &[&Scope], local_now_ms: u64) -> Result<Txn<'_>, StoreError> {
        match self {
            Store::Own(store) => store.begin_read(local_now_ms).map(Txn::Own),
            #[cfg(feature = "postgres")]
            Store::Shared(store) => store.begin(keys, local_now_ms, false).map(Txn::Shared),
        }
    }

    /// When the store next has records to reclaim, as far as it knows.
    pub fn next_reclaim_ms(&self) -> Option<u64> {
        dispatch!(self, Store, s => s.next_reclaim_ms())
    }

    /// How often parked reserves must be decided again without a local change to their
    /// key: never for a store only this shard writes; for a shared one, at this interval
    /// (another node may commit or release the key).
    pub fn waiters_poll_ms(&self) -> Option<u64> {
        match self {
            Store::Own(_) => None,
            #[cfg(feature = "postgres")]
            Store::Shared(store) => Some(store.waiters_poll_ms()),
        }
    }

    /// The node's own store, when the records are in its file.
    pub fn own(&self) -> Option<&sqlite::Store> {
        match self {
            Store::Own(store) => Some(store),
            #[cfg(feature = "postgres")]
            Store::Shared(_) => None,
        }
    }

    /// [`Store::own`], to change it.
    pub fn own_mut(&mut self) -> Option<&mut sqlite::Store> {
        match self {
            Store::Own(store) => Some(store),
            #[cfg(feature = "postgres")]
            Store::Shared(_) => None,
        }
    }
}

impl<'s> Txn<'s> {
    /// The time every decision of this transaction uses.
    pub fn now(&self) -> u64 {
        dispatch!(self, Txn, t => t.now())
    }

    /// The token the next grant gets, given the shard's counter (which the shard raises
    /// past each token a decision took). The SQLite file's counter is the shard's own;
    /// PostgreSQL hands out tokens drawn from its sequence after the keys were locked.
    pub fn next_token(&self, counter: u64) -> Result<u64, StoreError> {
        match self {
            Txn::Own(_) => Ok(counter),
            #[cfg(feature = "postgres")]
            Txn::Shared(txn) => txn.next_token(counter),
        }
    }

    /// The stored record of a key, expired or not.
    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        dispatch!(self, Txn, t => t.get(scope))
    }

    /// Inserts or replaces a key's record; returns the instant from which reclaim may
    /// take it.
    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        dispatch!(self, Txn, t => t.put(scope, record))
    }

    /// Deletes a key's record.
    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        dispatch!(self, Txn, t => t.delete(scope))
    }

    /// Deletes at most `limit` records reclaimable at `now_ms`; returns what was deleted.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        dispatch!(self, Txn, t => t.reclaim(now_ms, limit))
    }

    /// The transaction of the node's own store, when the records are in its file.
    pub fn own(&self) -> Option<&sqlite::Txn<'s>> {
        match self {
            Txn::Own(txn) => Some(txn),
            #[cfg(feature = "postgres")]
            Txn::Shared(_) => None,
        }
    }

    /// Ends a read transaction.
    pub fn finish_read(self) {
        dispatch!(self, Txn, t => t.finish_read())
    }

    /// Makes the transaction durable; returns only once the store says it is.
    pub fn commit(self, meta: Meta) -> Result<(), StoreError> {
        dispatch!(self, Txn, t => t.commit(meta))
    }
}

/// Both stores' integers are signed; every value stored is a time in ms or a counter far
/// below `i64::MAX`, and clamping keeps the ordering even if one ever was not.
pub(crate) fn to_sql(value: u64) -> i64 {
    value.min(i64::MAX as u64) as i64
}

/// The inverse of [`to_sql`]; a negative value (never written) reads as 0.
pub(crate) fn from_sql(value: i64) -> u64 {
    value.max(0) as u64
}

/// A tenant name read back from the store; one that does not parse is corruption.
pub(crate) fn stored_tenant(name: String) -> Result<Tenant, StoreError> {
    Tenant::new(&name).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A scope read back from the store; one that does not parse is corruption.
pub(crate) fn stored_scope(tenant: String, namespace: String, key: String) -> Result<Scope, StoreError> {
    Ok(Scope {
        tenant: stored_tenant(tenant)?,
        namespace: Namespace::new(&namespace).map_err(|e| StoreError::Corrupt(e.to_string()))?,
        key: Key::from_stored(key),
    })
}

/// Bytes per history entry: the transition (1), `at_ms` (8, little-endian), the token (8).
const EVENT_BYTES: usize = 17;

/// A record's history as both stores keep it, written over `out` (whose buffer the
/// SQLite store reuses from one write to the next).
pub(crate) fn encode_history_into(history: &[Event], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(history.len() * EVENT_BYTES);
    for event in history {
        out.push(event.transition.as_u8());
        out.extend_from_slice(&event.at_ms.to_le_bytes());
        out.extend_from_slice(&event.token.to_le_bytes());
    }
}

/// Unknown transitions (from a newer version) are skipped rather than failing the read:
/// the history is for operators, the record itself is what decisions use.
pub(crate) fn decode_history(bytes: &[u8]) -> Vec<Event> {
    bytes
        .chunks_exact(EVENT_BYTES)
        .filter_map(|chunk| {
            let transition = Transition::from_u8(chunk[0])?;
            let at_ms = u64::from_le_bytes(chunk[1..9].try_into().ok()?);
            let token = u64::from_le_bytes(chunk[9..17].try_into().ok()?);
            Some(Event { transition, at_ms, token })
        })
        .collect()
}
