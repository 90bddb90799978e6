//! One shard's SQLite file: schema, pragmas, and the statements the actor runs.
//!
//! Only the shard's own thread ever touches a `Store`. Every statement is prepared once
//! per connection (`prepare_cached`) and every change happens inside the batch's one
//! transaction. Records are appended in arrival order and found through the in-memory
//! [`Index`] (`index.rs` says why).

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use oncegate_core::route::{self, Routing};
use oncegate_core::{Completion, Fingerprint, Outcome, Record, Scope};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior, params};

use super::checkpointer::{self, Checkpointer};
use super::{Meta, StoreError, decode_history, encode_history, stored_scope, stored_tenant};
use crate::config::Durability;
use crate::faults::Faults;
use crate::files::Files;
use crate::index::{Index, Undo};
use crate::quota::Tally;
use crate::schedule::Schedule;

/// The schema version this code reads and writes (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 6;

/// `records` holds only pending and completed records, one row per key, appended in
/// arrival order (`id`); `hash` is the routing hash of the scope, which the in-memory
/// index maps to `id`, and the scope itself is kept for collision checks, scans and
/// operators. `reclaim_at_ms` is `Record::reclaim_at_ms()`; the in-memory
/// [`Schedule`] finds the rows that are due (version 4 kept an index on it in the file,
/// which cost a fifth of the pages each batch wrote).
const SCHEMA_RECORDS: &str = "
CREATE TABLE records (
    id              INTEGER PRIMARY KEY,
    hash            INTEGER NOT NULL,
    tenant          TEXT    NOT NULL,
    namespace       TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    token           INTEGER NOT NULL,
    attempt         INTEGER NOT NULL,
    lease_until_ms  INTEGER NOT NULL,
    expires_at_ms   INTEGER NOT NULL,
    ttl_ms          INTEGER NOT NULL,
    reclaim_at_ms   INTEGER NOT NULL,
    fingerprint     BLOB    NOT NULL,
    outcome         INTEGER,
    response        BLOB,
    completed_at_ms INTEGER,
    history         BLOB
);
";

/// `meta` is one row: the fencing-token counter and the clock high-water mark. It is not
/// written by every batch (its page would be one more page per commit): the rows carry
/// both, each its latest grant's token and its latest event's time, so the counters at
/// open are the greater of `meta` and what the rows say. `meta` is written when that
/// would no longer hold: at open, and in any transaction that deletes rows (which may
/// take the greatest token or time with them). See [`Txn::commit`].
const SCHEMA_META: &str = "
CREATE TABLE meta (
    id            INTEGER PRIMARY KEY CHECK (id = 0),
    next_token    INTEGER NOT NULL,
    high_water_ms INTEGER NOT NULL
);
INSERT INTO meta (id, next_token, high_water_ms) VALUES (0, 1, 0);
";

/// SQLite undoes just the failing statement on `SQLITE_FULL` only when the statement keeps
/// a statement journal, which it does when a trigger may run (and a constraint may
/// abort); without one, a write that does not fit cancels the whole batch's transaction,
/// savepoints included. These triggers never fire (`WHEN 0`); while they exist every write
/// to `records` is undone on its own when the file is full, and only that request is
/// refused. They cost about 7% of a shard's CPU (docs/benchmarks.md), so they are
/// connection-local (`TEMP`) and exist only while the file is close enough to
/// `shard_file_bytes_max` that a batch could reach it (`Store::begin`). Schema 3 to 5
/// kept them in the file, always on.
const STATEMENT_JOURNAL_ON: &str = "
CREATE TEMP TRIGGER IF NOT EXISTS records_insert_undoable AFTER INSERT ON main.records WHEN 0 BEGIN SELECT 0; END;
CREATE TEMP TRIGGER IF NOT EXISTS records_update_undoable AFTER UPDATE ON main.records WHEN 0 BEGIN SELECT 0; END;
";
const STATEMENT_JOURNAL_OFF: &str = "
DROP TRIGGER IF EXISTS temp.records_insert_undoable;
DROP TRIGGER IF EXISTS temp.records_update_undoable;
";
/// The file-resident triggers of schemas 3 to 5.
const DROP_FILE_TRIGGERS: &str = "
DROP TRIGGER IF EXISTS main.records_insert_undoable;
DROP TRIGGER IF EXISTS main.records_update_undoable;
";

/// The record's columns in the order `read_record` expects (a macro so that statements
/// can be assembled with `concat!` into constants, keeping `prepare_cached` lookups free
/// of formatting).
macro_rules! columns {
    () => {
        "token, attempt, lease_until_ms, expires_at_ms, ttl_ms, fingerprint, outcome, response, completed_at_ms, history"
    };
}

const SELECT_RECORD: &str =
    concat!("SELECT tenant, namespace, key, ", columns!(), " FROM records WHERE id = ?1");
const DELETE_RECORD: &str = "DELETE FROM records WHERE id = ?1";
const SELECT_SCOPE: &str = "SELECT tenant, namespace, key FROM records WHERE id = ?1";
const INSERT_RECORD: &str = concat!(
    "INSERT INTO records (hash, tenant, namespace, key, reclaim_at_ms, ",
    columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)"
);
const UPDATE_RECORD: &str =
    "UPDATE records SET reclaim_at_ms = ?2, token = ?3, attempt = ?4, lease_until_ms = ?5,
    expires_at_ms = ?6, ttl_ms = ?7, fingerprint = ?8, outcome = ?9, response = ?10, completed_at_ms = ?11,
    history = ?12 WHERE id = ?1";
const SELECT_LEASED: &str = concat!(
    "SELECT tenant, namespace, key, ",
    columns!(),
    " FROM records WHERE outcome IS NULL AND lease_until_ms > ?1"
);

impl Meta {
    /// Raises the counters over a stored row: its token, and the time of its last
    /// history entry (read with `last_event_at!()`: 8 bytes, or nothing).
    fn cover(&mut self, token: i64, last_event_at: Option<Vec<u8>>) {
        self.next_token = self.next_token.max(from_sql(token).saturating_add(1));
        if let Some(at) = last_event_at.and_then(|b| <[u8; 8]>::try_from(b).ok()) {
            self.high_water_ms = self.high_water_ms.max(u64::from_le_bytes(at));
        }
    }
}

/// The time of a row's last history entry: the 8 bytes after its transition byte.
macro_rules! last_event_at {
    () => {
        "substr(history, -16, 8)"
    };
}

/// The page size of new shard files. Each commit writes whole pages: the right edge of
/// `records` (partly filled), the pages of rows a commit grows, their parent and page 1
/// (the file's size); at the batch sizes the engine runs, half of SQLite's default 4 KiB
/// wrote 30% fewer bytes per pair for the same CPU, while 1 KiB cost 70% more CPU
/// (docs/benchmarks.md). Files created before keep 4 KiB.
const NEW_FILE_PAGE_BYTES: i64 = 2048;

/// The settings a store is opened with.
pub(crate) struct Tuning {
    pub durability: Durability,
    pub file_bytes_max: u64,
    pub page_cache_bytes_max: u64,
    pub wal_checkpoint_pages: u64,
    /// The width of the reclaim schedule's windows.
    pub reclaim_granularity_ms: u64,
    /// The largest write of one record, in bytes (every field at its limit).
    pub write_bytes_max: u64,
    /// The most records one batch writes: its commands and the waiters it serves.
    pub batch_writes_max: u64,
    /// The slots this file's shard owns; rows of other slots (left by a slot move that
    /// was cut short) are deleted at open. `None`: every slot (tools that copy rows).
    pub owned: Option<crate::placement::slots::Owned>,
    /// The files seam, and with it the SQLite VFS.
    pub files: Arc<dyn Files>,
    /// How the directory routes keys: the hash stored beside each record is its.
    pub routing: Routing,
    /// Where the file's WAL checkpoints are counted.
    pub checkpoints: Arc<AtomicU64>,
}

pub(crate) struct Store {
    /// Declared before `conn`, so that its thread has stopped (and closed its connection)
    /// before the shard's connection, the file's last, closes.
    checkpointer: Checkpointer,
    conn: Connection,
    faults: Faults,
    index: Index,
    schedule: Schedule,
    /// The record counts read at open, until the shard takes them.
    tally: Option<Tally>,
    /// `max_page_count`: the file's size limit in pages.
    pages_max: u64,
    /// The most pages one batch's writes can take.
    batch_pages_max: u64,
    /// Whether the statement journal's triggers exist on this connection.
    journaled: bool,
    /// Whether writes are refused (the disk is full): see [`super::Store::refuse_writes`].
    writes_refused: bool,
    /// The configured durability, which [`Store::sync_commits`] puts back.
    durability: Durability,
    routing: Routing,
    /// The counters of the last commit (as opened before the first): every commit's are
    /// at least these.
    committed: Cell<Meta>,
}

impl Tuning {
    /// The settings of an engine's shard files.
    pub fn of(
        config: &crate::config::EngineConfig,
        files: Arc<dyn Files>,
        owned: Option<crate::placement::slots::Owned>,
        routing: Routing,
    ) -> Tuning {
        let limits = &config.limits;
        // Every field at its limit, the full history, and room for SQLite's own headers.
        let write_bytes_max = limits.response_bytes_max
            + limits.key_bytes_max
            + limits.fingerprint_bytes_max
            + 2 * 64
            + 16 * 17
            + 256;
        Tuning {
            durability: config.durability,
            file_bytes_max: config.shard_file_bytes_max,
            page_cache_bytes_max: config.page_cache_bytes_max,
            wal_checkpoint_pages: config.wal_checkpoint_pages,
            reclaim_granularity_ms: config.reclaim_granularity_ms,
            write_bytes_max: write_bytes_max as u64,
            batch_writes_max: (config.batch_len_max + config.waiters_per_shard_max) as u64,
            owned,
            files,
            routing,
            checkpoints: Arc::default(),
        }
    }
}

/// SQLite integers are signed; every value stored here is a time in ms or a counter far
/// below `i64::MAX`, and clamping keeps the ordering even if one ever was not.
fn to_sql(value: u64) -> i64 {
    value.min(i64::MAX as u64) as i64
}

fn from_sql(value: i64) -> u64 {
    value.max(0) as u64
}

/// The settings every shard file's connection runs with: WAL, the durability's
/// `synchronous`, the checkpoint interval, temporary tables in memory and the page cache.
/// The benchmark's raw-SQLite ceiling applies exactly these (and so checkpoints inline, as
/// SQLite does by default; a shard's file hands its checkpoints to `checkpointer.rs`).
pub fn configure(
    conn: &Connection,
    durability: Durability,
    wal_checkpoint_pages: u64,
    page_cache_bytes_max: u64,
) -> Result<(), StoreError> {
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Corrupt(format!("journal_mode is {mode}, not wal")));
    }
    conn.pragma_update(None, "synchronous", synchronous(durability))?;
    // A larger checkpoint interval lets a hot page be rewritten many times in the WAL
    // before it is copied once into the database file (measured: about 1.5x the
    // throughput of SQLite's default of 1,000 pages, see docs/benchmarks.md).
    let _: i64 =
        conn.query_row(&format!("PRAGMA wal_autocheckpoint = {wal_checkpoint_pages}"), [], |row| row.get(0))?;
    // Temporary tables and indices (large sorts) stay in memory rather than in files
    // that SQLite would create with the default mode in the temporary directory.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // Negative cache_size is in KiB.
    conn.pragma_update(None, "cache_size", -((page_cache_bytes_max / 1024) as i64))?;
    Ok(())
}

/// SQLite's `synchronous` for a durability.
fn synchronous(durability: Durability) -> &'static str {
    match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    }
}

/// Brings a file of schema `version` to [`SCHEMA_VERSION`], each step in one transaction
/// (a crash leaves the old file or the new one), or refuses a newer one.
fn upgrade(conn: &mut Connection, version: i64, routing: Routing) -> Result<(), StoreError> {
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    if !(0..SCHEMA_VERSION).contains(&version) {
        return Err(StoreError::Schema { found: version, supported: SCHEMA_VERSION });
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    match version {
        0 => {
            tx.execute_batch(SCHEMA_RECORDS)?;
            tx.execute_batch(SCHEMA_META)?;
        }
        1..=3 => {
            // Version 1 had no history column (records written by it start with none).
            if version == 1 {
                tx.execute_batch("ALTER TABLE records ADD COLUMN history BLOB")?;
            }
            migrate_to_appended_rows(&tx, routing)?;
        }
        _ => {
            // 4 and 5: the reclaim schedule moved into memory (its index in the file
            // goes), and the statement journal's triggers became connection-local.
            tx.execute_batch("DROP INDEX IF EXISTS records_by_reclaim_at;")?;
            tx.execute_batch(DROP_FILE_TRIGGERS)?;
        }
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit().map_err(commit_failed)?;
    Ok(())
}

/// What a failed `COMMIT` or checkpoint says about the disk: an I/O error (any
/// `SQLITE_IOERR_*`) may be a failed sync, after which this process must build on
/// nothing it reads back ([`StoreError::SyncFailed`]); `SQLITE_FULL` there is a full
/// disk ([`StoreError::DiskFull`]).
fn commit_failed(error: rusqlite::Error) -> StoreError {
    match error.sqlite_error_code() {
        Some(rusqlite::ErrorCode::SystemIoFailure) => StoreError::SyncFailed(error),
        Some(rusqlite::ErrorCode::DiskFull) => StoreError::DiskFull(error),
        _ => error.into(),
    }
}

/// Copies the shard file at `from` into `to`, an empty file, as of one commit
/// (`VACUUM INTO` on a connection of its own, in one read transaction, beside the
/// shard's); returns the copy's size in bytes. The copy is a database file without a
/// WAL, synced by the caller.
pub(crate) fn copy_file(from: &Path, to: &Path, vfs: Option<&str>) -> Result<u64, StoreError> {
    let open = |path: &Path| match vfs {
        Some(vfs) => Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs),
        None => Connection::open(path),
    };
    let target = to.to_str().ok_or_else(|| StoreError::Corrupt(format!("{} is not UTF-8", to.display())))?;
    open(from)?.execute("VACUUM INTO ?1", [target])?;
    let copy = open(to)?;
    let pages: i64 = copy.query_row("PRAGMA page_count", [], |row| row.get(0))?;
    let page_bytes: i64 = copy.query_row("PRAGMA page_size", [], |row| row.get(0))?;
    Ok(from_sql(pages) * from_sql(page_bytes))
}

/// `PRAGMA quick_check`: reads the whole file (at process start only).
fn quick_check(conn: &Connection, faults: &Faults) -> Result<(), StoreError> {
    let check: String = conn.query_row("PRAGMA quick_check", [], |row| row.get(0))?;
    let check = if faults.integrity_check_should_fail() { "injected corruption".to_owned() } else { check };
    if check != "ok" {
        return Err(StoreError::Corrupt(check));
    }
    Ok(())
}

impl Store {
    /// Opens (creating if needed) a shard file, checks it when `check_integrity` (at
    /// process start: a `quick_check` reads the whole file), and reads its counters.
    /// Returns whether the file was new.
    pub fn open(
        path: &Path,
        tuning: &Tuning,
        faults: &Faults,
        check_integrity: bool,
    ) -> Result<(Store, Meta, bool), StoreError> {
        if faults.open_should_fail() {
            return Err(StoreError::Injected("open"));
        }
        crate::files::create_shard_file(&*tuning.files, path)
            .map_err(|source| StoreError::Io { path: path.to_owned(), source })?;
        // A sync that failed in an earlier process may have left WAL frames in the page
        // cache that the device does not hold (Linux marks them clean): SQLite's recovery
        // must read what the device holds, or later commits would chain onto frames a
        // power cut takes away, and every one of them would be lost with them.
        let wal = crate::files::companion(path, "-wal");
        tuning.files.drop_cached(&wal).map_err(|source| StoreError::Io { path: wal.clone(), source })?;
        let mut conn = match tuning.files.sqlite_vfs() {
            Some(vfs) => Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs)?,
            None => Connection::open(path)?,
        };
        // Takes effect only on a new, empty file; older files keep the size they have.
        conn.pragma_update(None, "page_size", NEW_FILE_PAGE_BYTES)?;
        let checkpoint_pages = faults.wal_checkpoint_pages().unwrap_or(tuning.wal_checkpoint_pages);
        configure(&conn, tuning.durability, checkpoint_pages, tuning.page_cache_bytes_max)?;
        if check_integrity {
            quick_check(&conn, faults)?;
        }
        let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
        upgrade(&mut conn, version, tuning.routing)?;
        let stored =
            conn.query_row("SELECT next_token, high_water_ms FROM meta WHERE id = 0", [], |row| {
                Ok(Meta { next_token: from_sql(row.get(0)?), high_water_ms: from_sql(row.get(1)?) })
            })?;
        // The file's size limit applies from here: an upgrade needs room for the old and
        // the new table at once, and a file at its limit must still open.
        let page_bytes: i64 = conn.query_row("PRAGMA page_size", [], |row| row.get(0))?;
        let pages = faults.page_count_max().unwrap_or(tuning.file_bytes_max / from_sql(page_bytes).max(512));
        let _: i64 = conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |row| row.get(0))?;
        let Scanned { index, schedule, tally, rows, foreign } = scan(&conn, tuning, check_integrity)?;
        let meta = stored.max(rows);
        if !foreign.is_empty() {
            delete_foreign(&mut conn, &foreign, meta)?;
        }
        // Room for the largest batch: every write at its largest, plus the splits it may
        // cause up a tree of several levels.
        let write_pages = tuning.write_bytes_max / from_sql(page_bytes).saturating_sub(64).max(64) + 1 + 8;
        let checkpointer = Checkpointer::start(
            &conn,
            path,
            tuning.files.sqlite_vfs(),
            synchronous(tuning.durability),
            checkpoint_pages,
            Arc::clone(&tuning.checkpoints),
        )?;
        let store = Store {
            checkpointer,
            conn,
            faults: faults.clone(),
            index,
            schedule,
            tally: Some(tally),
            pages_max: pages,
            batch_pages_max: write_pages.saturating_mul(tuning.batch_writes_max),
            journaled: false,
            writes_refused: false,
            durability: tuning.durability,
            routing: tuning.routing,
            committed: Cell::new(meta),
        };
        Ok((store, meta, version == 0))
    }

    /// Refuses writes while the disk is full (see [`super::Store::refuse_writes`]).
    pub fn refuse_writes(&mut self, on: bool) {
        self.writes_refused = on;
    }

    /// Whether writes are refused.
    pub fn writes_refused(&self) -> bool {
        self.writes_refused
    }

    /// With `on`, every commit syncs the WAL (`synchronous=FULL`) whatever the configured
    /// durability; without, the configured durability again. A moved slot's copy must be
    /// on disk before the map names its new shard.
    pub fn sync_commits(&mut self, on: bool) -> Result<(), StoreError> {
        if self.durability == Durability::Full {
            return Ok(());
        }
        self.conn.pragma_update(None, "synchronous", if on { "FULL" } else { "NORMAL" })?;
        Ok(())
    }

    /// The (hash, row id) of every row of `slot` (one pass over the in-memory index).
    pub fn slot_rows(&self, slot: u32) -> Vec<(u64, i64)> {
        self.index.iter().filter(|(hash, _)| route::slot_of_hash(*hash) == slot).collect()
    }

    /// Starts the batch's write transaction, with every write keeping a statement
    /// journal when the batch could reach the file's size limit.
    pub fn begin(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        if let Some(error) = self.checkpointer.take_failed_sync() {
            return Err(StoreError::SyncFailed(error));
        }
        // A checkpoint copies into the database file, which may have to grow: none while
        // the disk is full, and one that fails says what of the disk (a full disk, or a
        // sync that may have failed).
        if !self.writes_refused && self.checkpointer.shard_must_checkpoint() {
            match checkpointer::checkpoint(&self.conn) {
                Ok(true) => self.checkpointer.count(),
                Ok(false) => {}
                Err(StoreError::Sqlite(error)) => return Err(commit_failed(error)),
                Err(error) => return Err(error),
            }
        }
        let near_full = self.pages_left()? < self.batch_pages_max;
        if near_full != self.journaled {
            self.conn.execute_batch(if near_full { STATEMENT_JOURNAL_ON } else { STATEMENT_JOURNAL_OFF })?;
            self.journaled = near_full;
        }
        self.start(TransactionBehavior::Immediate, now_ms)
    }

    /// Pages the file may still take: those below its limit and those on its free list.
    fn pages_left(&self) -> Result<u64, StoreError> {
        let count: i64 = self.conn.prepare_cached("PRAGMA page_count")?.query_row([], |row| row.get(0))?;
        let free: i64 = self.conn.prepare_cached("PRAGMA freelist_count")?.query_row([], |row| row.get(0))?;
        Ok(self.pages_max.saturating_sub(from_sql(count)) + from_sql(free))
    }

    /// Starts a read transaction for a batch of reads: one consistent snapshot, no write
    /// lock, nothing to sync. End it with [`Txn::finish_read`].
    pub fn begin_read(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        self.start(TransactionBehavior::Deferred, now_ms)
    }

    fn start(&mut self, behavior: TransactionBehavior, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        let tx = self.conn.transaction_with_behavior(behavior)?;
        Ok(Txn {
            tx: Some(tx),
            now_ms,
            faults: &self.faults,
            index: RefCell::new(&mut self.index),
            schedule: RefCell::new(&mut self.schedule),
            undo: RefCell::default(),
            unscheduled: RefCell::default(),
            deleted: Cell::new(false),
            wrote: Cell::new(false),
            located: RefCell::default(),
            routing: self.routing,
            checkpointer: &self.checkpointer,
            refused: self.writes_refused,
            committed: &self.committed,
        })
    }

    /// How many stored records are pending and how many completed, by tenant (expired
    /// ones not yet reclaimed included), as read at open; the shard keeps them up to date.
    pub fn take_count(&mut self) -> Tally {
        self.tally.take().unwrap_or_default()
    }

    /// When the reclaim schedule next has rows to take (some may have moved on: the
    /// alarm then finds less, or nothing, to delete).
    pub fn next_reclaim_ms(&self) -> Option<u64> {
        self.schedule.next_ms()
    }
}

/// The batch's transaction. Dropping it without `commit` rolls everything back, the
/// in-memory index's changes included.
pub(crate) struct Txn<'s> {
    /// `None` once committed.
    tx: Option<Transaction<'s>>,
    /// The shard's time for this transaction (its clock guard's reading).
    now_ms: u64,
    faults: &'s Faults,
    index: RefCell<&'s mut Index>,
    schedule: RefCell<&'s mut Schedule>,
    /// The index changes of this transaction, undone if it does not commit.
    undo: RefCell<Vec<Undo>>,
    /// Schedule entries this transaction took, put back if it does not commit.
    unscheduled: RefCell<Vec<(u64, i64)>>,
    /// Whether the transaction deleted a row (and so must write `meta`).
    deleted: Cell<bool>,
    /// Whether the transaction wrote a row (which then carries the batch's time).
    wrote: Cell<bool>,
    /// The last scope found, its row, and the row's `reclaim_at_ms` when it was read, so
    /// that the write after a read neither looks the row up again nor schedules it twice.
    located: RefCell<Option<Located>>,
    routing: Routing,
    checkpointer: &'s Checkpointer,
    /// Writes are refused: the disk is full.
    refused: bool,
    /// The store's counters as of its last commit.
    committed: &'s Cell<Meta>,
}

/// A row found by scope.
struct Located {
    scope: Scope,
    id: i64,
    reclaim_at_ms: Option<u64>,
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.undo_index();
        }
    }
}

/// Copies every row of a version 1–3 table (keyed by the scope) into the appended layout,
/// in reclaim order, computing each scope's hash; one transaction with the rest of the
/// upgrade, so a crash leaves the old file or the new one.
fn migrate_to_appended_rows(tx: &Transaction<'_>, routing: Routing) -> Result<(), StoreError> {
    // The old table keeps its reclaim index (renamed with it) until the copy is done, so
    // the copy reads in reclaim order without sorting the whole table.
    tx.execute_batch(
        "DROP TRIGGER IF EXISTS records_insert_undoable;
         DROP TRIGGER IF EXISTS records_update_undoable;
         ALTER TABLE records RENAME TO records_keyed;",
    )?;
    tx.execute_batch(SCHEMA_RECORDS)?;
    {
        let mut read = tx.prepare(concat!(
            "SELECT tenant, namespace, key, reclaim_at_ms, ",
            columns!(),
            " FROM records_keyed ORDER BY reclaim_at_ms"
        ))?;
        let mut insert = tx.prepare(INSERT_RECORD)?;
        let mut rows = read.query([])?;
        while let Some(row) = rows.next()? {
            let (tenant, namespace, key): (String, String, String) = (row.get(0)?, row.get(1)?, row.get(2)?);
            let scope = stored_scope(tenant, namespace, key)?;
            let mut values: Vec<rusqlite::types::Value> = vec![hash_to_sql(routing.hash(&scope)).into()];
            for column in 0..14 {
                values.push(row.get(column)?);
            }
            insert.execute(rusqlite::params_from_iter(values))?;
        }
    }
    tx.execute_batch("DROP TABLE records_keyed;")?;
    Ok(())
}

/// What one pass over a freshly opened file's rows builds.
struct Scanned {
    /// Rows of slots the shard does not own: the copies a cut-short slot move left.
    foreign: Vec<i64>,
    index: Index,
    schedule: Schedule,
    tally: Tally,
    /// The counters as the rows give them: one past the greatest token, and the latest
    /// event's time.
    rows: Meta,
}

/// The index, the reclaim schedule, the record counts and the counters the rows hold, in
/// one pass over a freshly opened file. Two rows of one scope (which the old primary key
/// made impossible, and only the index prevents now) are refused as corruption rather
/// than served from either.
///
/// With `verify_hashes` (at process start) it also checks that every row's stored hash is
/// its scope's: the index is built from the hash alone, so a damaged hash would hide the
/// row from its key (which would then be granted again), and `quick_check` checks the
/// file's structure, not the values in it. Keys are not named in the error (they may
/// carry customers' data).
fn scan(conn: &Connection, tuning: &Tuning, verify_hashes: bool) -> Result<Scanned, StoreError> {
    let (reclaim_granularity_ms, owned) = (tuning.reclaim_granularity_ms, tuning.owned.as_ref());
    let mut foreign = Vec::new();
    let mut index = Index::default();
    let mut schedule = Schedule::new(reclaim_granularity_ms);
    let mut tally = Tally::default();
    let mut counters = Meta { next_token: 0, high_water_ms: 0 };
    let mut shared_hashes = Vec::new();
    let mut stmt = conn.prepare(concat!(
        "SELECT hash, id, tenant, outcome IS NULL, reclaim_at_ms, token, ",
        last_event_at!(),
        ", namespace, key FROM records"
    ))?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let (hash, id) = (hash_from_sql(row.get(0)?), row.get(1)?);
        if verify_hashes {
            let (tenant, namespace): (String, String) = (row.get(2)?, row.get(7)?);
            let scope = stored_scope(tenant.clone(), namespace.clone(), row.get(8)?)?;
            if tuning.routing.hash(&scope) != hash {
                return Err(StoreError::Corrupt(format!(
                    "row {id} (tenant {tenant}, namespace {namespace}): its stored hash is not its key's"
                )));
            }
        }
        // The counters cover foreign rows too: their tokens and times were issued here.
        counters.cover(row.get(5)?, row.get(6)?);
        if owned.is_some_and(|owned| !owned.owns(route::slot_of_hash(hash))) {
            foreign.push(id);
            continue;
        }
        if index.ids(hash).next().is_some() {
            shared_hashes.push(hash);
        }
        index.insert(hash, id);
        schedule.add(from_sql(row.get(4)?), id);
        tally.add_stored(&stored_tenant(row.get(2)?)?, row.get(3)?);
    }
    drop(rows);
    let mut select = conn.prepare("SELECT tenant, namespace, key FROM records WHERE id = ?1")?;
    for hash in shared_hashes {
        let mut scopes = std::collections::HashSet::new();
        for id in index.ids(hash).collect::<Vec<_>>() {
            let scope: (String, String, String) =
                select.query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            if !scopes.insert(scope.clone()) {
                return Err(StoreError::Corrupt(format!(
                    "two rows for one key ({}/{}/{})",
                    scope.0, scope.1, scope.2
                )));
            }
        }
    }
    assert_eq!(
        index.len() as i64,
        tally.pending + tally.completed,
        "the index and the tally count the same owned rows"
    );
    Ok(Scanned { index, schedule, tally, rows: counters, foreign })
}

/// Writes the counters; every write of `meta` goes through here.
fn write_meta(conn: &Connection, meta: Meta) -> Result<(), StoreError> {
    conn.prepare_cached("UPDATE meta SET next_token = ?1, high_water_ms = ?2 WHERE id = 0")?
        .execute(params![to_sql(meta.next_token), to_sql(meta.high_water_ms)])?;
    Ok(())
}

/// Deletes rows by id, in the caller's transaction.
fn delete_rows(conn: &Connection, ids: &[i64]) -> Result<(), StoreError> {
    let mut delete = conn.prepare_cached(DELETE_RECORD)?;
    for id in ids {
        delete.execute(params![id])?;
    }
    Ok(())
}

/// The ids of the rows whose scope falls in `slots` (one pass over the table).
fn ids_in_slots(conn: &Connection, slots: &std::collections::HashSet<u32>) -> Result<Vec<i64>, StoreError> {
    let mut stmt = conn.prepare("SELECT id, hash FROM records")?;
    let mut rows = stmt.query([])?;
    let mut ids = Vec::new();
    while let Some(row) = rows.next()? {
        if slots.contains(&route::slot_of_hash(hash_from_sql(row.get(1)?))) {
            ids.push(row.get(0)?);
        }
    }
    Ok(ids)
}

/// Deletes the rows of slots the shard does not own, writing the counters first (a
/// transaction that deletes rows writes `meta`, see `Txn::commit`).
fn delete_foreign(conn: &mut Connection, foreign: &[i64], meta: Meta) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    write_meta(&tx, meta)?;
    delete_rows(&tx, foreign)?;
    tx.commit().map_err(commit_failed)?;
    tracing::info!(
        rows = foreign.len(),
        "deleted rows of slots this shard does not own (a slot move was cut short)"
    );
    Ok(())
}

/// A 64-bit hash as SQLite's signed integer, bit for bit (unlike `to_sql`, which clamps
/// quantities: a clamped hash would name another key after the next open).
fn hash_to_sql(hash: u64) -> i64 {
    hash as i64
}

fn hash_from_sql(value: i64) -> u64 {
    value as u64
}

fn read_record(row: &rusqlite::Row<'_>, offset: usize) -> rusqlite::Result<Record> {
    let outcome: Option<i64> = row.get(offset + 6)?;
    let completion = match outcome {
        None => None,
        Some(n) => Some(Completion {
            outcome: u8::try_from(n)
                .ok()
                .and_then(Outcome::from_u8)
                .ok_or_else(|| rusqlite::Error::IntegralValueOutOfRange(offset + 6, n))?,
            response: row.get::<_, Option<Vec<u8>>>(offset + 7)?.unwrap_or_default(),
            completed_at_ms: from_sql(row.get::<_, Option<i64>>(offset + 8)?.unwrap_or(0)),
        }),
    };
    Ok(Record {
        token: from_sql(row.get(offset)?),
        attempt: u32::try_from(row.get::<_, i64>(offset + 1)?).unwrap_or(u32::MAX),
        lease_until_ms: from_sql(row.get(offset + 2)?),
        expires_at_ms: from_sql(row.get(offset + 3)?),
        ttl_ms: from_sql(row.get(offset + 4)?),
        fingerprint: Fingerprint::from_stored(row.get(offset + 5)?),
        completion,
        history: decode_history(&row.get::<_, Option<Vec<u8>>>(offset + 9)?.unwrap_or_default()),
    })
}

impl Txn<'_> {
    /// The time the transaction's decisions use: the shard's own, from its clock guard.
    pub fn now(&self) -> u64 {
        self.now_ms
    }

    fn failpoint(&self) -> Result<(), StoreError> {
        if self.faults.op_should_fail() {
            return Err(StoreError::Injected("store operation"));
        }
        Ok(())
    }

    fn tx(&self) -> &Transaction<'_> {
        self.tx.as_ref().expect("a transaction is open until it commits")
    }

    /// Puts the in-memory index and schedule back as they were before the transaction.
    fn undo_index(&self) {
        let mut index = self.index.borrow_mut();
        for undo in self.undo.borrow_mut().drain(..).rev() {
            index.undo(undo);
        }
        self.schedule.borrow_mut().restore(self.unscheduled.borrow_mut().drain(..));
    }

    /// The row of a key, if it has one: the index names the candidates, the stored scope
    /// decides between them.
    fn locate(&self, scope: &Scope) -> Result<Option<i64>, StoreError> {
        if let Some(last) = &*self.located.borrow()
            && last.scope == *scope
        {
            return Ok(Some(last.id));
        }
        let index = self.index.borrow();
        let mut stmt = self.tx().prepare_cached(SELECT_SCOPE)?;
        for id in index.ids(self.routing.hash(scope)) {
            let found = stmt
                .query_row(params![id], |row| {
                    Ok(row.get_ref(0)?.as_str()? == scope.tenant.as_str()
                        && row.get_ref(1)?.as_str()? == scope.namespace.as_str()
                        && row.get_ref(2)?.as_str()? == scope.key.as_str())
                })
                .optional()?;
            if found == Some(true) {
                *self.located.borrow_mut() = Some(Located { scope: scope.clone(), id, reclaim_at_ms: None });
                return Ok(Some(id));
            }
        }
        Ok(None)
    }

    /// The stored record of a key, expired or not.
    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        let Some(id) = self.locate(scope)? else { return Ok(None) };
        let mut stmt = self.tx().prepare_cached(SELECT_RECORD)?;
        let record = stmt.query_row(params![id], |row| read_record(row, 3)).optional()?;
        if let (Some(record), Some(located)) = (&record, &mut *self.located.borrow_mut()) {
            located.reclaim_at_ms = Some(record.reclaim_at_ms());
        }
        Ok(record)
    }

    /// Inserts or replaces a key's record: in place when it has a row, appended when not.
    /// Returns the instant from which the reclaim schedule will take it.
    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.refuse()?;
        self.failpoint()?;
        let completion = record.completion.as_ref();
        let values = params![
            to_sql(record.reclaim_at_ms()),
            to_sql(record.token),
            i64::from(record.attempt),
            to_sql(record.lease_until_ms),
            to_sql(record.expires_at_ms),
            to_sql(record.ttl_ms),
            record.fingerprint.as_bytes(),
            completion.map(|c| i64::from(c.outcome.as_u8())),
            completion.map(|c| c.response.as_slice()),
            completion.map(|c| to_sql(c.completed_at_ms)),
            encode_history(&record.history),
        ];
        let reclaim_at_ms = record.reclaim_at_ms();
        self.wrote.set(true);
        if let Some(id) = self.locate(scope)? {
            let mut stmt = self.tx().prepare_cached(UPDATE_RECORD)?;
            let mut all: Vec<&dyn rusqlite::ToSql> = vec![&id];
            all.extend_from_slice(values);
            stmt.execute(all.as_slice())?;
            return Ok(self.reschedule(id, reclaim_at_ms));
        }
        let hash = self.routing.hash(scope);
        let mut stmt = self.tx().prepare_cached(INSERT_RECORD)?;
        let (hash_sql, tenant, namespace, key) =
            (hash_to_sql(hash), scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str());
        let mut all: Vec<&dyn rusqlite::ToSql> = vec![&hash_sql, &tenant, &namespace, &key];
        all.extend_from_slice(values);
        stmt.execute(all.as_slice())?;
        let id = self.tx().last_insert_rowid();
        self.index.borrow_mut().insert(hash, id);
        self.undo.borrow_mut().push(Undo::Remove(hash, id));
        *self.located.borrow_mut() =
            Some(Located { scope: scope.clone(), id, reclaim_at_ms: Some(reclaim_at_ms) });
        let mut schedule = self.schedule.borrow_mut();
        schedule.add(reclaim_at_ms, id);
        Ok(schedule.due_ms(reclaim_at_ms))
    }

    /// Files a rewritten row under its new deadline's window, unless the row was read in
    /// this transaction with a deadline in the same window (its entry is still right).
    fn reschedule(&self, id: i64, reclaim_at_ms: u64) -> u64 {
        let mut schedule = self.schedule.borrow_mut();
        let due = schedule.due_ms(reclaim_at_ms);
        let mut located = self.located.borrow_mut();
        let Some(located) = located.as_mut().filter(|l| l.id == id) else {
            schedule.add(reclaim_at_ms, id);
            return due;
        };
        if located.reclaim_at_ms.is_none_or(|before| schedule.due_ms(before) != due) {
            schedule.add(reclaim_at_ms, id);
        }
        located.reclaim_at_ms = Some(reclaim_at_ms);
        due
    }

    /// Deletes a key's record.
    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        self.refuse()?;
        self.failpoint()?;
        let Some(id) = self.locate(scope)? else { return Ok(()) };
        self.tx().prepare_cached(DELETE_RECORD)?.execute(params![id])?;
        self.forget(self.routing.hash(scope), id);
        Ok(())
    }

    /// Takes a deleted row out of the index (undone if the transaction does not commit).
    fn forget(&self, hash: u64, id: i64) {
        self.deleted.set(true);
        self.index.borrow_mut().remove(hash, id);
        self.undo.borrow_mut().push(Undo::Insert(hash, id));
        *self.located.borrow_mut() = None;
    }

    /// Takes at most `limit` entries from the reclaim schedule's ended windows and deletes
    /// those rows that are reclaimable at `now_ms` (an entry whose row moved on or is gone
    /// deletes nothing); returns what was deleted, counted by state and tenant.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        if self.refused {
            return Ok(Tally::default());
        }
        self.failpoint()?;
        let taken = self.schedule.borrow_mut().take_due(now_ms, limit);
        self.unscheduled.borrow_mut().extend(taken.iter().copied());
        let mut stmt = self.tx().prepare_cached(
            "DELETE FROM records WHERE id = ?1 AND reclaim_at_ms <= ?2 RETURNING hash, tenant, outcome IS NULL",
        )?;
        let mut removed = Tally::default();
        for (_, id) in taken {
            let row = stmt
                .query_row(params![id, to_sql(now_ms)], |row| {
                    Ok((hash_from_sql(row.get(0)?), row.get::<_, String>(1)?, row.get::<_, bool>(2)?))
                })
                .optional()?;
            if let Some((hash, tenant, pending)) = row {
                removed.add_stored(&stored_tenant(tenant)?, pending);
                self.forget(hash, id);
            }
        }
        Ok(removed)
    }

    /// Pending records whose lease runs past `after_ms`: those the restart grace applies to.
    pub fn pending_leased_after(&self, after_ms: u64) -> Result<Vec<(Scope, Record)>, StoreError> {
        let mut stmt = self.tx().prepare_cached(SELECT_LEASED)?;
        let rows = stmt.query_map(params![to_sql(after_ms)], |row| {
            let scope = (row.get::<_, String>(0)?, row.get::<_, String>(1)?, row.get::<_, String>(2)?);
            Ok((scope, read_record(row, 3)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let ((tenant, namespace, key), record) = row?;
            out.push((stored_scope(tenant, namespace, key)?, record));
        }
        Ok(out)
    }

    /// Writes the counters (at open; otherwise [`Txn::commit`] does when it must). Not
    /// while writes are refused: the time mark then goes unpersisted, as a read's does.
    pub fn set_meta(&self, meta: Meta) -> Result<(), StoreError> {
        if self.refused {
            return Ok(());
        }
        self.failpoint()?;
        write_meta(self.tx(), meta)
    }

    /// Whether `error` undid only the statement that raised it, so that its request alone
    /// is refused and the batch goes on: `SQLITE_FULL`, with the transaction still open
    /// (SQLite cancels the whole transaction instead when the statement kept no statement
    /// journal; the schema's triggers make every write to `records` keep one).
    pub fn failed_alone(&self, error: &StoreError) -> bool {
        matches!(error, StoreError::WritesRefused) || (error.is_full() && !self.tx().is_autocommit())
    }

    /// Refuses a write while the disk is full, before it touches the file.
    fn refuse(&self) -> Result<(), StoreError> {
        if self.refused { Err(StoreError::WritesRefused) } else { Ok(()) }
    }

    /// Ends a read transaction: it wrote nothing, so rolling back costs nothing and
    /// syncs nothing.
    pub fn finish_read(self) {
        drop(self);
    }

    /// Whether the ack-before-commit bug is switched on (see `Faults`): only the
    /// power-loss harness's proof that it can see does that.
    pub fn acks_early(&self) -> bool {
        self.faults.acks_before_commit()
    }

    /// Makes the batch durable. Returns only once SQLite reports the commit done (with
    /// `synchronous=FULL`, after the WAL is synced).
    ///
    /// `meta` is the counters after the batch. They are written only when the batch
    /// deleted a row or wrote none: every row a batch writes carries its grant's token and
    /// an event at the batch's time, so what the rows and `meta` say together at the next
    /// open covers every token handed out and every time used, unless a delete took the
    /// row that said so, or no row says it (a batch whose answers were all replays,
    /// refusals or `in progress` still records the time they were decided at; not while
    /// writes are refused on a full disk, when that time goes unpersisted, as a read's).
    pub fn commit(mut self, meta: Meta) -> Result<(), StoreError> {
        let before = self.committed.get();
        assert!(
            meta.next_token >= before.next_token && meta.high_water_ms >= before.high_water_ms,
            "the counters never go back across a commit: {before:?} then {meta:?}"
        );
        if self.deleted.get() || !self.wrote.get() {
            self.set_meta(meta)?;
        }
        self.failpoint()?;
        if self.faults.commit_should_fail() {
            // Dropping the transaction rolls it back (the index too), exactly as a failed
            // COMMIT would.
            return Err(StoreError::Injected("commit"));
        }
        if self.faults.sync_should_fail() {
            let failed = rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR_FSYNC);
            let injected = rusqlite::Error::SqliteFailure(failed, Some("injected failed sync".to_owned()));
            return Err(StoreError::SyncFailed(injected));
        }
        let tx = self.tx.take().expect("a transaction commits once");
        if let Err(error) = tx.commit() {
            self.undo_index();
            return Err(commit_failed(error));
        }
        self.undo.borrow_mut().clear();
        self.unscheduled.borrow_mut().clear();
        self.checkpointer.committed();
        self.committed.set(meta);
        Ok(())
    }
}

/// A slot's rows in a live shard, for moving the slot to another one (`shard/moves.rs`).
/// There is no on-disk index on the slot (it would put a random page back into every
/// write); one pass over the in-memory index ([`Store::slot_rows`]) finds a slot's rows,
/// a few milliseconds per million keys, once per move.
impl Txn<'_> {
    /// The stored records of `rows` (from [`Store::slot_rows`]) with their scopes, expired
    /// ones included (their destination reclaims them as this shard would have).
    pub fn records_of(&self, rows: &[(u64, i64)]) -> Result<Vec<(Scope, Record)>, StoreError> {
        self.failpoint()?;
        let mut stmt = self.tx().prepare_cached(SELECT_RECORD)?;
        let mut records = Vec::with_capacity(rows.len());
        for (hash, id) in rows {
            let (tenant, namespace, key, record) = stmt.query_row(params![id], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?, read_record(row, 3)?))
            })?;
            let scope = stored_scope(tenant, namespace, key)?;
            // The row was found by its hash; a record that does not hash to it would move
            // to a slot its key never routes to.
            if self.routing.hash(&scope) != *hash {
                return Err(StoreError::Corrupt(format!("row {id}: its stored hash is not its key's")));
            }
            records.push((scope, record));
        }
        Ok(records)
    }

    /// Deletes the rows `rows` names (from [`Store::slot_rows`]); returns what was
    /// deleted, counted by state and tenant. A row gone since it was listed (reclaimed)
    /// is skipped, and so is another row that took its id since (SQLite reuses the id of
    /// a deleted last row): the hash must match too.
    pub fn delete_rows(&self, rows: &[(u64, i64)]) -> Result<Tally, StoreError> {
        self.refuse()?;
        self.failpoint()?;
        let mut stmt = self.tx().prepare_cached(
            "DELETE FROM records WHERE id = ?1 AND hash = ?2 RETURNING tenant, outcome IS NULL",
        )?;
        let mut removed = Tally::default();
        for (hash, id) in rows {
            let row: Option<(String, bool)> = stmt
                .query_row(params![id, hash_to_sql(*hash)], |row| Ok((row.get(0)?, row.get(1)?)))
                .optional()?;
            if let Some((tenant, pending)) = row {
                removed.add_stored(&stored_tenant(tenant)?, pending);
                self.forget(*hash, *id);
            }
        }
        Ok(removed)
    }
}

/// Copying a slot's rows from one shard file to another, for moving slots (`reshard.rs`).
impl Store {
    /// Copies every row of `slots` from `src` into this store, replacing any rows of those
    /// slots already here (left by a copy that was cut short), in one transaction that
    /// also raises `meta` to cover the copied tokens and times. `meta` is this store's
    /// counters as opened. Returns the rows copied.
    pub(crate) fn copy_slots_from(
        &mut self,
        src: &Store,
        slots: &std::collections::HashSet<u32>,
        meta: Meta,
    ) -> Result<u64, StoreError> {
        let in_slots = |hash: i64| slots.contains(&route::slot_of_hash(hash_from_sql(hash)));
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        delete_rows(&tx, &ids_in_slots(&tx, slots)?)?;
        let mut counters = meta;
        let mut copied = 0;
        {
            let mut read = src.conn.prepare(concat!(
                "SELECT hash, tenant, namespace, key, reclaim_at_ms, ",
                columns!(),
                ", ",
                last_event_at!(),
                " FROM records"
            ))?;
            let mut insert = tx.prepare(INSERT_RECORD)?;
            let mut rows = read.query([])?;
            while let Some(row) = rows.next()? {
                if !in_slots(row.get(0)?) {
                    continue;
                }
                let values: Vec<rusqlite::types::Value> =
                    (0..15).map(|c| row.get(c)).collect::<Result<_, _>>()?;
                insert.execute(rusqlite::params_from_iter(values))?;
                counters.cover(row.get(5)?, row.get(15)?);
                copied += 1;
            }
        }
        write_meta(&tx, counters)?;
        tx.commit()?;
        Ok(copied)
    }

    /// Deletes every row of `slots`, writing `meta` (this store's counters as opened) in
    /// the same transaction. Returns the rows deleted.
    pub(crate) fn delete_slots(
        &mut self,
        slots: &std::collections::HashSet<u32>,
        meta: Meta,
    ) -> Result<u64, StoreError> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        write_meta(&tx, meta)?;
        let ids = ids_in_slots(&tx, slots)?;
        delete_rows(&tx, &ids)?;
        tx.commit()?;
        Ok(ids.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncegate_core::{Key, Namespace, Tenant, Transition};

    fn tuning() -> Tuning {
        Tuning {
            durability: Durability::Full,
            file_bytes_max: 1 << 30,
            page_cache_bytes_max: 1 << 20,
            wal_checkpoint_pages: 1_000,
            reclaim_granularity_ms: 1_000,
            write_bytes_max: 70_000,
            batch_writes_max: 256,
            owned: None,
            files: Arc::new(crate::files::OsFiles),
            routing: Routing::BucketBase,
            checkpoints: Arc::default(),
        }
    }

    fn scope(key: &str) -> Scope {
        Scope {
            tenant: Tenant::default_tenant(),
            namespace: Namespace::new("n").unwrap(),
            key: Key::from_stored(key.into()),
        }
    }

    fn granted(token: u64, at_ms: u64) -> Record {
        let mut record = Record {
            token,
            attempt: 1,
            lease_until_ms: at_ms + 10,
            expires_at_ms: at_ms + 100,
            ttl_ms: 100,
            fingerprint: Fingerprint::from_stored(Vec::new()),
            completion: None,
            history: Vec::new(),
        };
        record.push_event(Transition::Granted, at_ms, token);
        record
    }

    /// The shard's own connection does not checkpoint: its checkpointer thread does, and
    /// the WAL still restarts from its beginning (the tail the thread leaves is copied by
    /// the shard before its next write), so the WAL file stays a few intervals long.
    #[test]
    fn the_checkpointer_copies_the_wal_and_the_wal_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.sqlite");
        let tuning = Tuning { wal_checkpoint_pages: 16, ..tuning() };
        let (mut store, _, _) = Store::open(&path, &tuning, &Faults::default(), true).unwrap();
        let mut record = granted(1, 0);
        record.fingerprint = Fingerprint::from_stored(vec![7; 1500]);
        for n in 0..1_000u64 {
            let txn = store.begin(n).unwrap();
            txn.put(&scope(&format!("k{n}")), &record).unwrap();
            txn.commit(Meta { next_token: n + 2, high_water_ms: n }).unwrap();
        }
        let wal_bytes = tuning.files.read(&dir.path().join("shard.sqlite-wal")).unwrap().len();
        drop(store);
        // Each commit appends at least one 2 KiB page: without checkpoints, or without
        // restarts, the WAL would pass 2 MB.
        assert!(wal_bytes < 1_000_000, "the WAL grew to {wal_bytes} bytes");
        assert!(tuning.checkpoints.load(std::sync::atomic::Ordering::Relaxed) > 0, "nothing checkpointed");
    }

    /// Batches that delete nothing leave `meta` as it was; the next open reads the
    /// counters from the rows, and a delete of the row that held them writes `meta`.
    #[test]
    fn the_counters_survive_without_meta_writes_and_through_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.sqlite");
        let faults = Faults::default();
        let meta = |store_meta: Meta| (store_meta.next_token, store_meta.high_water_ms);
        let (mut store, opened, _) = Store::open(&path, &tuning(), &faults, true).unwrap();
        assert_eq!(meta(opened), (1, 0));
        let txn = store.begin(0).unwrap();
        txn.put(&scope("a"), &granted(7, 500)).unwrap();
        txn.put(&scope("b"), &granted(9, 700)).unwrap();
        txn.commit(Meta { next_token: 10, high_water_ms: 700 }).unwrap();
        drop(store);

        let (mut store, opened, _) = Store::open(&path, &tuning(), &faults, false).unwrap();
        assert_eq!(meta(opened), (10, 700), "from the rows: meta was never written");
        let txn = store.begin(0).unwrap();
        txn.delete(&scope("b")).unwrap();
        txn.commit(Meta { next_token: 12, high_water_ms: 800 }).unwrap();
        drop(store);

        let (_, opened, _) = Store::open(&path, &tuning(), &faults, false).unwrap();
        assert_eq!(meta(opened), (12, 800), "the delete wrote meta, or token 9 and time 700 would be lost");
    }

    /// A slot's rows are listed when the slot leaves and deleted later; SQLite gives the
    /// id of a deleted last row to the next insert, so a listed id may name another key
    /// by then. Deleting by the list deletes only the rows it named.
    #[test]
    fn a_listed_row_whose_id_went_to_another_key_is_not_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Faults::default();
        let (mut store, _, _) =
            Store::open(&dir.path().join("shard.sqlite"), &tuning(), &faults, true).unwrap();
        let txn = store.begin(0).unwrap();
        txn.put(&scope("leaving"), &granted(7, 500)).unwrap();
        txn.commit(Meta { next_token: 8, high_water_ms: 500 }).unwrap();
        let slot = route::slot_of(&scope("leaving"));
        let listed = store.slot_rows(slot);
        assert_eq!(listed.len(), 1);
        // Reclaimed (here deleted) before the drop, and its id reused by another key.
        let txn = store.begin(0).unwrap();
        txn.delete(&scope("leaving")).unwrap();
        txn.put(&scope("staying"), &granted(8, 600)).unwrap();
        txn.commit(Meta { next_token: 9, high_water_ms: 600 }).unwrap();
        assert_eq!(store.slot_rows(route::slot_of(&scope("staying")))[0].1, listed[0].1, "the id was reused");
        let txn = store.begin(0).unwrap();
        let removed = txn.delete_rows(&listed).unwrap();
        assert_eq!(removed.pending + removed.completed, 0);
        assert!(txn.get(&scope("staying")).unwrap().is_some(), "the other key's row is kept");
        txn.commit(Meta { next_token: 9, high_water_ms: 600 }).unwrap();
    }
}
