//! The shard file's schema, its statements, its migrations, and the scan that rebuilds
//! the in-memory index at open.

use oncegate_core::route::{self, Routing};
use oncegate_core::{Completion, Fingerprint, Outcome, Record};
use rusqlite::{Connection, Transaction, TransactionBehavior, params};

use super::{Tuning, commit_failed};
use crate::index::Index;
use crate::quota::Tally;
use crate::schedule::Schedule;
use crate::store::{Meta, StoreError, decode_history, stored_scope, stored_tenant};

/// The schema version this code reads and writes (`PRAGMA user_version`).
pub(super) const SCHEMA_VERSION: i64 = 6;

/// `records` holds only pending and completed records, one row per key, appended in
/// arrival order (`id`); `hash` is the routing hash of the scope, which the in-memory
/// index maps to `id`, and the scope itself is kept for collision checks, scans and
/// operators. `reclaim_at_ms` is `Record::reclaim_at_ms()`; the in-memory
/// [`Schedule`] finds the rows that are due (version 4 kept an index on it in the file,
/// which cost a fifth of the pages each batch wrote).
pub(super) const SCHEMA_RECORDS: &str = "
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
pub(super) const SCHEMA_META: &str = "
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
pub(super) const STATEMENT_JOURNAL_ON: &str = "
CREATE TEMP TRIGGER IF NOT EXISTS records_insert_undoable AFTER INSERT ON main.records WHEN 0 BEGIN SELECT 0; END;
CREATE TEMP TRIGGER IF NOT EXISTS records_update_undoable AFTER UPDATE ON main.records WHEN 0 BEGIN SELECT 0; END;
";
pub(super) const STATEMENT_JOURNAL_OFF: &str = "
DROP TRIGGER IF EXISTS temp.records_insert_undoable;
DROP TRIGGER IF EXISTS temp.records_update_undoable;
";
/// The file-resident triggers of schemas 3 to 5.
pub(super) const DROP_FILE_TRIGGERS: &str = "
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

pub(super) const SELECT_RECORD: &str =
    concat!("SELECT tenant, namespace, key, ", columns!(), " FROM records WHERE id = ?1");
pub(super) const DELETE_RECORD: &str = "DELETE FROM records WHERE id = ?1";
pub(super) const SELECT_SCOPE: &str = "SELECT tenant, namespace, key FROM records WHERE id = ?1";
pub(super) const INSERT_RECORD: &str = concat!(
    "INSERT INTO records (hash, tenant, namespace, key, reclaim_at_ms, ",
    columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)"
);
pub(super) const UPDATE_RECORD: &str =
    "UPDATE records SET reclaim_at_ms = ?2, token = ?3, attempt = ?4, lease_until_ms = ?5,
    expires_at_ms = ?6, ttl_ms = ?7, fingerprint = ?8, outcome = ?9, response = ?10, completed_at_ms = ?11,
    history = ?12 WHERE id = ?1";
pub(super) const SELECT_LEASED: &str = concat!(
    "SELECT tenant, namespace, key, ",
    columns!(),
    " FROM records WHERE outcome IS NULL AND lease_until_ms > ?1"
);

impl Meta {
    /// Raises the counters over a stored row: its token, and the time of its last
    /// history entry (read with `last_event_at!()`: 8 bytes, or nothing).
    pub(super) fn cover(&mut self, token: i64, last_event_at: Option<Vec<u8>>) {
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
pub(super) const NEW_FILE_PAGE_BYTES: i64 = 2048;

pub(super) use crate::store::{from_sql, to_sql};

/// Brings a file of schema `version` to [`SCHEMA_VERSION`], each step in one transaction
/// (a crash leaves the old file or the new one), or refuses a newer one.
pub(super) fn upgrade(conn: &mut Connection, version: i64, routing: Routing) -> Result<(), StoreError> {
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

/// Copies every row of a version 1–3 table (keyed by the scope) into the appended layout,
/// in reclaim order, computing each scope's hash; one transaction with the rest of the
/// upgrade, so a crash leaves the old file or the new one.
pub(super) fn migrate_to_appended_rows(tx: &Transaction<'_>, routing: Routing) -> Result<(), StoreError> {
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
pub(super) struct Scanned {
    /// Rows of slots the shard does not own: the copies a cut-short slot move left.
    pub(super) foreign: Vec<i64>,
    pub(super) index: Index,
    pub(super) schedule: Schedule,
    pub(super) tally: Tally,
    /// The counters as the rows give them: one past the greatest token, and the latest
    /// event's time.
    pub(super) rows: Meta,
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
pub(super) fn scan(conn: &Connection, tuning: &Tuning, verify_hashes: bool) -> Result<Scanned, StoreError> {
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
pub(super) fn write_meta(conn: &Connection, meta: Meta) -> Result<(), StoreError> {
    conn.prepare_cached("UPDATE meta SET next_token = ?1, high_water_ms = ?2 WHERE id = 0")?
        .execute(params![to_sql(meta.next_token), to_sql(meta.high_water_ms)])?;
    Ok(())
}

/// Deletes rows by id, in the caller's transaction.
pub(super) fn delete_rows(conn: &Connection, ids: &[i64]) -> Result<(), StoreError> {
    let mut delete = conn.prepare_cached(DELETE_RECORD)?;
    for id in ids {
        delete.execute(params![id])?;
    }
    Ok(())
}

/// Deletes the rows of slots the shard does not own, writing the counters first (a
/// transaction that deletes rows writes `meta`, see `Txn::commit`).
pub(super) fn delete_foreign(conn: &mut Connection, foreign: &[i64], meta: Meta) -> Result<(), StoreError> {
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
pub(super) fn hash_to_sql(hash: u64) -> i64 {
    hash as i64
}

pub(super) fn hash_from_sql(value: i64) -> u64 {
    value as u64
}

pub(super) fn read_record(row: &rusqlite::Row<'_>, offset: usize) -> rusqlite::Result<Record> {
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
