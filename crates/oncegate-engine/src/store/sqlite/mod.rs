//! One shard's SQLite file: schema, pragmas, and the statements the actor runs.
//!
//! Only the shard's own thread ever touches a `Store`. Every statement is prepared once
//! per connection (`prepare_cached`), the four every command runs are taken from that
//! cache once per transaction (`txn::Statements`), and every change happens inside the
//! batch's one transaction. Records are appended in arrival order and found through the
//! in-memory [`Index`] (`index.rs` says why).

mod checkpointer;
mod gather;
#[macro_use]
mod schema;
mod txn;

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use oncegate_core::route::{self, Routing};
use rusqlite::{Connection, OpenFlags, Transaction, TransactionBehavior};

use super::{Meta, StoreError};
use crate::config::Durability;
use crate::faults::Faults;
use crate::files::Files;
use crate::index::Index;
use crate::quota::Tally;
use crate::schedule::Schedule;
use checkpointer::Checkpointer;
use schema::*;
use txn::Statements;
pub(crate) use txn::Txn;

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
    /// The file's page size, in bytes.
    page_bytes: u64,
    /// The file's pages in use (its pages less its free list), as last read.
    pages_used: Cell<u64>,
    /// The room left in the file as a lower bound, so that a batch need not ask SQLite.
    room: Room,
    /// Whether the statement journal's triggers exist on this connection.
    journaled: bool,
    /// Whether writes are refused (the disk is full): see [`Store::refuse_writes`].
    writes_refused: bool,
    /// The configured durability, which [`Store::sync_commits`] puts back.
    durability: Durability,
    routing: Routing,
    /// The counters of the last commit (as opened before the first): every commit's are
    /// at least these.
    committed: Cell<Meta>,
}

/// The longest a shard goes between readings of its file's size from SQLite (the size
/// gauge's age), in its clock's milliseconds; near the file's limit, every write
/// transaction reads it.
const ROOM_READ_INTERVAL_MS: u64 = 1_000;

/// What a store knows of the room left in its file without asking SQLite.
struct Room {
    /// Pages the file may still take, at least: the last reading, less what every write
    /// since was charged ([`Room::charge`]; a delete frees pages, so it charges nothing).
    pages: Cell<u64>,
    /// When (the shard's time) it was last read.
    read_at_ms: Cell<u64>,
    /// The most pages a record at the limits' largest takes.
    write_pages_max: u64,
    page_bytes: u64,
}

impl Room {
    /// Charges a write of `write_bytes`: the pages it may take, and never fewer than a
    /// record at the limits' largest (a record stored under larger limits may be moved
    /// in, so its own size counts too).
    fn charge(&self, write_bytes: u64) {
        let pages = write_pages(write_bytes, self.page_bytes).max(self.write_pages_max);
        self.pages.set(self.pages.get().saturating_sub(pages));
    }
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
        let sqlite = config.store.sqlite();
        Tuning {
            durability: config.durability,
            file_bytes_max: sqlite.shard_file_bytes_max,
            page_cache_bytes_max: sqlite.page_cache_bytes_max,
            wal_checkpoint_pages: sqlite.wal_checkpoint_pages,
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

/// The settings every shard file's connection runs with: WAL, the durability's
/// `synchronous`, the checkpoint interval, temporary tables in memory and the page cache.
/// SQLite checkpoints on commit at that interval unless a WAL hook replaces it, as a
/// shard's does (`checkpointer.rs`) and the benchmark's raw-SQLite ceiling's.
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

/// What a failed `COMMIT` or checkpoint says about the disk: an I/O error (any
/// `SQLITE_IOERR_*`) may be a failed sync, after which this process must build on
/// nothing it reads back ([`StoreError::SyncFailed`]); `SQLITE_FULL` there is a full
/// disk ([`StoreError::DiskFull`]).
pub(super) fn commit_failed(error: rusqlite::Error) -> StoreError {
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

/// Opens a connection with a shard file's settings: through the gathering VFS over the
/// files seam's, with the page size of new files (older files keep theirs) and
/// [`configure`]'s settings. Only that: [`Store::open`] also creates the file through the
/// seam, drops the WAL's cached pages and starts the checkpointer, and it alone opens a
/// shard's file (the gathering VFS allows one writer). The benchmark's raw-SQLite
/// ceiling opens its own files this way.
pub(crate) fn open_configured(
    path: &Path,
    files: &dyn Files,
    durability: Durability,
    wal_checkpoint_pages: u64,
    page_cache_bytes_max: u64,
) -> Result<Connection, StoreError> {
    let vfs = gather::vfs_over(files.sqlite_vfs())?;
    let conn = Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs.as_str())?;
    conn.pragma_update(None, "page_size", NEW_FILE_PAGE_BYTES)?;
    configure(&conn, durability, wal_checkpoint_pages, page_cache_bytes_max)?;
    Ok(conn)
}

/// Creates the shard file through the files seam if it is missing, and drops its WAL's
/// cached pages. A sync that failed in an earlier process may have left WAL frames in the
/// page cache that the device does not hold (Linux marks them clean): SQLite's recovery
/// must read what the device holds, or later commits would chain onto frames a power cut
/// takes away, and every one of them would be lost with them.
fn prepare_file(files: &dyn Files, path: &Path) -> Result<(), StoreError> {
    crate::files::create_shard_file(files, path)
        .map_err(|source| StoreError::Io { path: path.to_owned(), source })?;
    let wal = crate::files::companion(path, "-wal");
    files.drop_cached(&wal).map_err(|source| StoreError::Io { path: wal.clone(), source })
}

/// Sets the file's size limit, `shard_file_bytes_max` in pages (or the faults' limit);
/// returns it and the page size.
fn limit_pages(conn: &Connection, tuning: &Tuning, faults: &Faults) -> Result<(u64, u64), StoreError> {
    let page_bytes: i64 = conn.query_row("PRAGMA page_size", [], |row| row.get(0))?;
    let page_bytes = from_sql(page_bytes);
    let pages = faults.page_count_max().unwrap_or(tuning.file_bytes_max / page_bytes.max(512));
    let _: i64 = conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |row| row.get(0))?;
    Ok((pages, page_bytes))
}

/// The most pages a write of `write_bytes` takes: its bytes over a page's room, and the
/// splits it may cause up a tree of several levels.
pub(super) fn write_pages(write_bytes: u64, page_bytes: u64) -> u64 {
    write_bytes / page_bytes.saturating_sub(64).max(64) + 1 + 8
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
        prepare_file(&*tuning.files, path)?;
        let checkpoint_pages = faults.wal_checkpoint_pages().unwrap_or(tuning.wal_checkpoint_pages);
        let mut conn = open_configured(
            path,
            &*tuning.files,
            tuning.durability,
            checkpoint_pages,
            tuning.page_cache_bytes_max,
        )?;
        if let Some(pages) = faults.page_cache_pages() {
            // A positive cache_size is in pages.
            conn.pragma_update(None, "cache_size", super::to_sql(pages))?;
        }
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
        let (pages, page_bytes) = limit_pages(&conn, tuning, faults)?;
        let Scanned { index, schedule, tally, rows, foreign } = scan(&conn, tuning, check_integrity)?;
        let meta = stored.max(rows);
        if !foreign.is_empty() {
            delete_foreign(&mut conn, &foreign, meta)?;
        }
        let write_pages = write_pages(tuning.write_bytes_max, page_bytes);
        let checkpointer = Checkpointer::start(
            &conn,
            path,
            &gather::vfs_over(tuning.files.sqlite_vfs())?,
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
            page_bytes,
            pages_used: Cell::new(0),
            room: Room {
                pages: Cell::new(0),
                read_at_ms: Cell::new(0),
                write_pages_max: write_pages,
                page_bytes,
            },
            batch_pages_max: write_pages.saturating_mul(tuning.batch_writes_max),
            journaled: false,
            writes_refused: false,
            durability: tuning.durability,
            routing: tuning.routing,
            committed: Cell::new(meta),
        };
        // The file's size as opened, for the gauge read before the first batch.
        store.room.pages.set(store.pages_left()?);
        Ok((store, meta, version == 0))
    }

    /// Refuses writes while the disk is full (the shard does, through `Store::own_mut`).
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

    /// The (hash, row id) of every row of `slots` (one pass over the in-memory index,
    /// however many slots).
    pub fn slot_rows(&self, slots: &crate::placement::slots::Slots) -> Vec<(u64, i64)> {
        self.index.iter().filter(|(hash, _)| slots.contains(route::slot_of_hash(*hash))).collect()
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
        let near_full = self.room_at_least(now_ms)? < self.batch_pages_max;
        if near_full != self.journaled {
            self.conn.execute_batch(if near_full { STATEMENT_JOURNAL_ON } else { STATEMENT_JOURNAL_OFF })?;
            self.journaled = near_full;
        }
        self.start(TransactionBehavior::Immediate, now_ms)
    }

    /// Pages the file may still take, at least, before a write transaction: read from
    /// SQLite when the room the writes since the last reading may have left is under a
    /// batch's largest, or when that reading is `ROOM_READ_INTERVAL_MS` old (for the size
    /// gauge); otherwise the last reading less every write's charge since. Read every
    /// batch, the two `PRAGMA`s cost about 3% of a shard's CPU, half of it SQLite
    /// compiling each `PRAGMA` anew every time it runs.
    fn room_at_least(&self, now_ms: u64) -> Result<u64, StoreError> {
        let read_due = now_ms >= self.room.read_at_ms.get().saturating_add(ROOM_READ_INTERVAL_MS);
        let room = if self.room.pages.get() < self.batch_pages_max || read_due {
            self.room.read_at_ms.set(now_ms);
            self.pages_left()?
        } else {
            self.room.pages.get()
        };
        // The transaction's `meta` row, which may grow by a byte, is charged now.
        self.room.pages.set(room);
        self.room.charge(0);
        Ok(room)
    }

    /// Pages the file may still take: those below its limit and those on its free list.
    fn pages_left(&self) -> Result<u64, StoreError> {
        let count: i64 = self.conn.prepare_cached("PRAGMA page_count")?.query_row([], |row| row.get(0))?;
        let free: i64 = self.conn.prepare_cached("PRAGMA freelist_count")?.query_row([], |row| row.get(0))?;
        self.pages_used.set(from_sql(count).saturating_sub(from_sql(free)));
        Ok(self.pages_max.saturating_sub(from_sql(count)) + from_sql(free))
    }

    /// The bytes of the file's pages in use (free pages aside), read at most
    /// `ROOM_READ_INTERVAL_MS` before the last write transaction began: how close the
    /// file is to `shard_file_bytes_max`.
    pub fn used_bytes(&self) -> u64 {
        self.pages_used.get().saturating_mul(self.page_bytes)
    }

    /// Starts a read transaction for a batch of reads: one consistent snapshot, no write
    /// lock, nothing to sync. End it with [`Txn::finish_read`].
    pub fn begin_read(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        self.start(TransactionBehavior::Deferred, now_ms)
    }

    fn start(&mut self, behavior: TransactionBehavior, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        // Unchecked: a shared borrow, so that the statements borrow the connection too
        // (the store's `&mut self` already rules out a nested transaction).
        let tx = Transaction::new_unchecked(&self.conn, behavior)?;
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
            room: &self.room,
            statements: Box::new(Statements::prepare(&self.conn)?),
            history_buf: RefCell::default(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use oncegate_core::{Fingerprint, Key, Namespace, Record, Scope, Tenant, Transition};

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

    /// Scopes whose hashes collide share the index's entry: only the stored scope tells
    /// their rows apart, when a key is read, written or deleted, whichever of its three
    /// parts differs.
    #[test]
    fn scopes_whose_hashes_collide_keep_their_own_rows() {
        let other = |tenant: &str, namespace: &str, key: &str| Scope {
            tenant: Tenant::new(tenant).unwrap(),
            namespace: Namespace::new(namespace).unwrap(),
            key: Key::from_stored(key.into()),
        };
        let pairs = [
            ("key", other("t", "n", "a"), other("t", "n", "b")),
            ("tenant", other("t", "n", "a"), other("u", "n", "a")),
            ("namespace", other("t", "n", "a"), other("t", "m", "a")),
        ];
        let token = |txn: &Txn<'_>, scope: &Scope| txn.get(scope).unwrap().map(|r| r.token);
        for (differs, a, b) in pairs {
            let dir = tempfile::tempdir().unwrap();
            let (mut store, _, _) =
                Store::open(&dir.path().join("shard.sqlite"), &tuning(), &Faults::default(), true).unwrap();
            let txn = store.begin(0).unwrap();
            txn.put(&a, &granted(7, 500)).unwrap();
            txn.commit(Meta { next_token: 8, high_water_ms: 500 }).unwrap();
            // A 64-bit collision, made by hand: b's hash names a's row.
            let routing = tuning().routing;
            let a_row = store.index.ids(routing.hash(&a)).next().unwrap();
            store.index.insert(routing.hash(&b), a_row);
            let txn = store.begin(0).unwrap();
            assert_eq!(token(&txn, &b), None, "{differs}: b read a's row");
            txn.put(&b, &granted(9, 600)).unwrap();
            assert_eq!(token(&txn, &a), Some(7), "{differs}: b's first write went to a's row");
            txn.commit(Meta { next_token: 10, high_water_ms: 600 }).unwrap();
            // Both rows under b's hash now, a's first: a write of b with nothing read
            // before it passes a's row and rewrites b's.
            let txn = store.begin(0).unwrap();
            txn.put(&b, &granted(11, 700)).unwrap();
            assert_eq!((token(&txn, &a), token(&txn, &b)), (Some(7), Some(11)), "{differs}");
            txn.commit(Meta { next_token: 12, high_water_ms: 700 }).unwrap();
            assert_eq!(store.index.ids(routing.hash(&b)).count(), 2, "{differs}: b got a second row");
            let txn = store.begin(0).unwrap();
            txn.delete(&b).unwrap();
            assert_eq!(
                (token(&txn, &a), token(&txn, &b)),
                (Some(7), None),
                "{differs}: the delete took a's row"
            );
            txn.commit(Meta { next_token: 12, high_water_ms: 700 }).unwrap();
        }
    }

    /// Batches between two readings of the file's size are charged the most their writes
    /// can take, records larger than the limits allow now included (stored under larger
    /// ones, then moved in): the statement journal is on before a write can reach the
    /// limit, so the write that does not fit is refused alone however long ago the last
    /// reading was.
    #[test]
    fn writes_between_readings_of_the_size_keep_room_for_a_refusal_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.sqlite");
        let faults = Faults::default();
        faults.limit_pages(2_000);
        let tuning = Tuning { batch_writes_max: 8, write_bytes_max: 1_000, ..tuning() };
        let (mut store, _, _) = Store::open(&path, &tuning, &faults, true).unwrap();
        let mut big = granted(1, 500);
        big.fingerprint = Fingerprint::from_stored(vec![7; 32 * 1024]);
        let mut stored = 0;
        let refusal = 'fill: loop {
            // One clock reading throughout: no reading of the size falls due by time.
            let txn = store.begin(500).unwrap();
            for _ in 0..8 {
                if let Err(error) = txn.put(&scope(&format!("k{stored}")), &big) {
                    assert!(txn.failed_alone(&error), "{error} after {stored}: the batch was undone");
                    break 'fill error;
                }
                stored += 1;
            }
            txn.commit(Meta { next_token: 2, high_water_ms: 500 }).unwrap();
        };
        assert!(refusal.is_full() && stored > 100, "{refusal} after {stored}");
    }

    /// The size gauge is read again once `ROOM_READ_INTERVAL_MS` has passed, and not
    /// before while the file is far from its limit.
    #[test]
    fn the_file_size_is_read_again_after_its_interval() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.sqlite");
        let (mut store, _, _) = Store::open(&path, &tuning(), &Faults::default(), true).unwrap();
        let write = |store: &mut Store, now_ms: u64, key: &str| {
            let txn = store.begin(now_ms).unwrap();
            txn.put(&scope(key), &granted(1, now_ms)).unwrap();
            txn.commit(Meta { next_token: 2, high_water_ms: now_ms }).unwrap();
        };
        write(&mut store, ROOM_READ_INTERVAL_MS, "first");
        let read = store.used_bytes();
        for n in 0..200 {
            write(&mut store, ROOM_READ_INTERVAL_MS + 1, &format!("k{n}"));
        }
        assert_eq!(store.used_bytes(), read, "read again before its interval");
        write(&mut store, 2 * ROOM_READ_INTERVAL_MS, "late");
        assert!(store.used_bytes() > read, "not read again after its interval");
    }

    /// A write that does not fit in a full file is refused alone, and the batch goes on;
    /// its time must still be kept, in `meta` when no row of the batch carries it.
    #[test]
    fn a_batch_whose_only_write_did_not_fit_keeps_its_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.sqlite");
        let faults = Faults::default();
        faults.limit_pages(48);
        let meta = |store_meta: Meta| (store_meta.next_token, store_meta.high_water_ms);
        let (mut store, _, _) = Store::open(&path, &tuning(), &faults, true).unwrap();
        let mut big = granted(1, 500);
        big.fingerprint = Fingerprint::from_stored(vec![7; 16 * 1024]);
        let mut stored = 0;
        let refusal = loop {
            let txn = store.begin(500).unwrap();
            match txn.put(&scope(&format!("k{stored}")), &big) {
                Ok(_) => txn.commit(Meta { next_token: 2, high_water_ms: 500 }).unwrap(),
                Err(error) => break error,
            }
            stored += 1;
        };
        assert!(refusal.is_full() && stored > 0, "{refusal} after {stored}");
        let txn = store.begin(900).unwrap();
        assert!(txn.put(&scope("late"), &big).unwrap_err().is_full());
        txn.commit(Meta { next_token: 2, high_water_ms: 900 }).unwrap();
        drop(store);
        let (_, opened, _) = Store::open(&path, &tuning(), &faults, false).unwrap();
        assert_eq!(meta(opened), (2, 900), "the refused batch's time was lost");
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
        let listed = store.slot_rows(&crate::placement::slots::Slots::one(slot));
        assert_eq!(listed.len(), 1);
        // Reclaimed (here deleted) before the drop, and its id reused by another key.
        let txn = store.begin(0).unwrap();
        txn.delete(&scope("leaving")).unwrap();
        txn.put(&scope("staying"), &granted(8, 600)).unwrap();
        txn.commit(Meta { next_token: 9, high_water_ms: 600 }).unwrap();
        assert_eq!(
            store.slot_rows(&crate::placement::slots::Slots::one(route::slot_of(&scope("staying"))))[0].1,
            listed[0].1,
            "the id was reused"
        );
        let txn = store.begin(0).unwrap();
        let removed = txn.delete_rows(&listed).unwrap();
        assert_eq!(removed.pending + removed.completed, 0);
        assert!(txn.get(&scope("staying")).unwrap().is_some(), "the other key's row is kept");
        txn.commit(Meta { next_token: 9, high_water_ms: 600 }).unwrap();
    }
}
