//! A transaction on the shard file: a batch's, an alarm's, or a slot move's.

use std::cell::{Cell, RefCell};

use oncegate_core::route::Routing;
use oncegate_core::{Record, Scope};
use rusqlite::{
    CachedStatement, Connection, OptionalExtension, ToSql, Transaction, params, params_from_iter,
};

use super::checkpointer::Checkpointer;
use super::commit_failed;
use super::schema::*;
use crate::faults::Faults;
use crate::index::{Index, Undo};
use crate::quota::Tally;
use crate::schedule::Schedule;
use crate::store::{Meta, StoreError, encode_history_into, stored_scope, stored_tenant};

/// The batch's transaction. Dropping it without `commit` rolls everything back, the
/// in-memory index's changes included.
pub(crate) struct Txn<'s> {
    /// `None` once committed.
    pub(super) tx: Option<Transaction<'s>>,
    /// The shard's time for this transaction (its clock guard's reading).
    pub(super) now_ms: u64,
    pub(super) faults: &'s Faults,
    pub(super) index: RefCell<&'s mut Index>,
    pub(super) schedule: RefCell<&'s mut Schedule>,
    /// The index changes of this transaction, undone if it does not commit.
    pub(super) undo: RefCell<Vec<Undo>>,
    /// Schedule entries this transaction took, put back if it does not commit.
    pub(super) unscheduled: RefCell<Vec<(u64, i64)>>,
    /// Whether the transaction deleted a row (and so must write `meta`).
    pub(super) deleted: Cell<bool>,
    /// Whether the transaction wrote a row (which then carries the batch's time).
    pub(super) wrote: Cell<bool>,
    /// The last scope found, its row, and the row's `reclaim_at_ms` when it was read, so
    /// that the write after a read neither looks the row up again nor schedules it twice.
    pub(super) located: RefCell<Option<Located>>,
    pub(super) routing: Routing,
    pub(super) checkpointer: &'s Checkpointer,
    /// Writes are refused: the disk is full.
    pub(super) refused: bool,
    /// The store's counters as of its last commit.
    pub(super) committed: &'s Cell<Meta>,
    /// The room the store knows its file to have, at least, which each write is charged
    /// against.
    pub(super) room: &'s super::Room,
    /// The statements every command uses, taken from the connection's cache when the
    /// transaction starts (every transaction, though a read or an alarm uses one or
    /// none) rather than at each use, which copies the SQL into a new key each time;
    /// boxed, as they are most of the transaction's size.
    pub(super) statements: Box<Statements<'s>>,
    /// Scratch space for encoding each written record's history.
    pub(super) history_buf: RefCell<Vec<u8>>,
}

/// A transaction's statements for finding, reading and writing a key's row.
pub(super) struct Statements<'c> {
    scope: RefCell<CachedStatement<'c>>,
    record: RefCell<CachedStatement<'c>>,
    update: RefCell<CachedStatement<'c>>,
    insert: RefCell<CachedStatement<'c>>,
}

impl<'c> Statements<'c> {
    pub(super) fn prepare(conn: &'c Connection) -> Result<Statements<'c>, rusqlite::Error> {
        Ok(Statements {
            scope: RefCell::new(conn.prepare_cached(SELECT_SCOPE)?),
            record: RefCell::new(conn.prepare_cached(SELECT_RECORD)?),
            update: RefCell::new(conn.prepare_cached(UPDATE_RECORD)?),
            insert: RefCell::new(conn.prepare_cached(INSERT_RECORD)?),
        })
    }
}

/// A row found by scope.
pub(super) struct Located {
    scope: Scope,
    id: i64,
    reclaim_at_ms: Option<u64>,
}

/// Whether a row read by [`SELECT_SCOPE`] or [`SELECT_RECORD`] (the scope's three
/// columns first) holds `scope`.
fn holds(row: &rusqlite::Row<'_>, scope: &Scope) -> rusqlite::Result<bool> {
    Ok(row.get_ref(0)?.as_str()? == scope.tenant.as_str()
        && row.get_ref(1)?.as_str()? == scope.namespace.as_str()
        && row.get_ref(2)?.as_str()? == scope.key.as_str())
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.undo_index();
        }
    }
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
        if let Some(id) = self.last_located(scope) {
            return Ok(Some(id));
        }
        let index = self.index.borrow();
        let mut stmt = self.statements.scope.borrow_mut();
        for id in index.ids(self.routing.hash(scope)) {
            let found = stmt.query_row(params![id], |row| holds(row, scope)).optional()?;
            if found == Some(true) {
                self.set_located(scope, id, None);
                return Ok(Some(id));
            }
        }
        Ok(None)
    }

    /// The row of `scope` if it is the last scope found in this transaction.
    fn last_located(&self, scope: &Scope) -> Option<i64> {
        self.located.borrow().as_ref().filter(|last| last.scope == *scope).map(|last| last.id)
    }

    /// Remembers the row `scope` was found at, reusing the last scope's strings.
    fn set_located(&self, scope: &Scope, id: i64, reclaim_at_ms: Option<u64>) {
        let mut located = self.located.borrow_mut();
        match &mut *located {
            Some(last) => {
                last.scope.clone_from(scope);
                (last.id, last.reclaim_at_ms) = (id, reclaim_at_ms);
            }
            None => *located = Some(Located { scope: scope.clone(), id, reclaim_at_ms }),
        }
    }

    /// The stored record of a key, expired or not. Each candidate row is read whole and
    /// its scope compared there: one statement per candidate, not [`Txn::locate`]'s and
    /// then the record's.
    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        let mut stmt = self.statements.record.borrow_mut();
        if let Some(id) = self.last_located(scope) {
            let record = stmt.query_row(params![id], |row| read_record(row, 3)).optional()?;
            if let (Some(record), Some(located)) = (&record, &mut *self.located.borrow_mut()) {
                located.reclaim_at_ms = Some(record.reclaim_at_ms());
            }
            return Ok(record);
        }
        let index = self.index.borrow();
        for id in index.ids(self.routing.hash(scope)) {
            let found = stmt
                .query_row(params![id], |row| {
                    if holds(row, scope)? { read_record(row, 3).map(Some) } else { Ok(None) }
                })
                .optional()?
                .flatten();
            if let Some(record) = found {
                self.set_located(scope, id, Some(record.reclaim_at_ms()));
                return Ok(Some(record));
            }
        }
        Ok(None)
    }

    /// Inserts or replaces a key's record: in place when it has a row, appended when not.
    /// Returns the instant from which the reclaim schedule will take it.
    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.refuse()?;
        self.failpoint()?;
        let completion = record.completion.as_ref();
        let mut history = self.history_buf.borrow_mut();
        encode_history_into(&record.history, &mut history);
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
            history.as_slice(),
        ];
        let reclaim_at_ms = record.reclaim_at_ms();
        // Charged before the write, whether or not it is done; 256: the integers and
        // SQLite's headers, as in the limits' largest.
        let bytes = record.fingerprint.as_bytes().len()
            + completion.map_or(0, |c| c.response.len())
            + history.len()
            + scope.tenant.as_str().len()
            + scope.namespace.as_str().len()
            + scope.key.as_str().len()
            + 256;
        self.room.charge(bytes as u64);
        // Bound from iterators: no vector of parameters per write. `wrote` is set only
        // once a row is written: a write refused alone (a full file) carries no time.
        if let Some(id) = self.locate(scope)? {
            let all = std::iter::once(&id as &dyn ToSql).chain(values.iter().copied());
            self.statements.update.borrow_mut().execute(params_from_iter(all))?;
            self.wrote.set(true);
            return Ok(self.reschedule(id, reclaim_at_ms));
        }
        let hash = self.routing.hash(scope);
        let (hash_sql, tenant, namespace, key) =
            (hash_to_sql(hash), scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str());
        let all =
            [&hash_sql as &dyn ToSql, &tenant, &namespace, &key].into_iter().chain(values.iter().copied());
        self.statements.insert.borrow_mut().execute(params_from_iter(all))?;
        self.wrote.set(true);
        let id = self.tx().last_insert_rowid();
        self.index.borrow_mut().insert(hash, id);
        self.undo.borrow_mut().push(Undo::Remove(hash, id));
        self.set_located(scope, id, Some(reclaim_at_ms));
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
        let mut stmt = self.statements.record.borrow_mut();
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
