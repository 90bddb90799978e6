//! A transaction on the shared table: the batch's keys locked, their rows read, the
//! database's time and a block of tokens.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use deadpool_postgres::Object;
use oncegate_core::route::{self};
use oncegate_core::{Record, Scope};
use tokio_postgres::types::ToSql;

use super::{Meta, StoreError, encode_history_into, stored_tenant};
use crate::quota::Tally;

use super::Store;
use super::schema::*;

/// A batch's transaction on the shared table. Reads come from the rows fetched (and
/// locked) at begin; writes are kept and sent at commit. Dropped without a commit, it
/// rolls back.
pub(crate) struct Txn<'s> {
    pub(super) store: &'s Store,
    pub(super) now_ms: u64,
    pub(super) write: bool,
    /// A time above the mark the clock statement wrote, to raise the lane's mark to
    /// at commit.
    pub(super) raise_mark: Option<u64>,
    /// The hashes locked at begin.
    pub(super) locked: Vec<i64>,
    /// Each locked key's record as this transaction sees it (`None`: no record).
    pub(super) rows: RefCell<HashMap<Scope, Option<Record>>>,
    /// Each key this transaction changed, and its record after (`None`: deleted).
    pub(super) changes: RefCell<HashMap<Scope, Option<Record>>>,
    /// The current token block: the next token to hand out and the end of the block.
    pub(super) tokens: Cell<(u64, u64)>,
    /// Whether the transaction is still open (a rollback is due on drop).
    pub(super) open: Cell<bool>,
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if self.open.get() {
            let (client, rollback) = (self.store.client(), &self.store.statements().rollback);
            let _ = self
                .store
                .pg
                .run(async { client.execute(rollback, &[]).await.map_err(StoreError::Postgres) });
        }
    }
}

impl Txn<'_> {
    pub fn now(&self) -> u64 {
        self.now_ms
    }

    fn failpoint(&self) -> Result<(), StoreError> {
        if self.store.faults.op_should_fail() {
            return Err(StoreError::Injected("store operation"));
        }
        Ok(())
    }

    /// The next token: from the current block, or from a new block drawn now (the keys
    /// are locked, so it is above every token their earlier holders got).
    pub fn next_token(&self, counter: u64) -> Result<u64, StoreError> {
        let (next, end) = self.tokens.get();
        let candidate = counter.max(next);
        if candidate < end {
            self.tokens.set((candidate, end));
            return Ok(candidate);
        }
        let (client, nextval) = (self.store.client(), &self.store.statements().nextval);
        let first: i64 = self
            .store
            .pg
            .run(async { Ok(client.query_one(nextval, &[]).await.map_err(StoreError::Postgres)?.get(0)) })?;
        let first = from_sql(first);
        self.tokens.set((first, first + TOKEN_BLOCK));
        Ok(first)
    }

    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        if let Some(changed) = self.changes.borrow().get(scope) {
            return Ok(changed.clone());
        }
        if let Some(row) = self.rows.borrow().get(scope) {
            return Ok(row.clone());
        }
        if self.locked.binary_search(&(route::scope_hash(scope) as i64)).is_ok() || !self.write {
            // Locked (or read) at begin and not found: the key has no record.
            return Ok(None);
        }
        Err(StoreError::PostgresRefused("a key was decided without being locked first (a bug)".to_owned()))
    }

    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.failpoint()?;
        self.changes.borrow_mut().insert(scope.clone(), Some(record.clone()));
        Ok(record.reclaim_at_ms())
    }

    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        self.failpoint()?;
        self.changes.borrow_mut().insert(scope.clone(), None);
        Ok(())
    }

    /// Deletes up to `limit` reclaimable records of this shard's slots that no other
    /// transaction holds and this one did not lock.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        self.failpoint()?;
        let client = self.store.client();
        let limit_rows = limit as i64;
        let rows = self.store.pg.run(async {
            client
                .query(
                    &self.store.statements().reclaim,
                    &[&to_sql(now_ms), &self.store.owned, &self.locked, &limit_rows],
                )
                .await
                .map_err(StoreError::Postgres)
        })?;
        let mut removed = Tally::default();
        for row in &rows {
            removed.add_stored(&stored_tenant(row.get(0))?, row.get(1));
        }
        // Other nodes' records come due without this shard hearing of them: it looks
        // again after a reclaim window, or at once while a backlog remains.
        let next = if rows.len() >= limit { now_ms } else { now_ms + self.store.reclaim_every_ms };
        self.store.next_reclaim_ms.set(Some(next));
        Ok(removed)
    }

    pub fn finish_read(self) {
        drop(self);
    }

    /// Sends the buffered writes and commits; returns once PostgreSQL reports the commit
    /// (durable as its `synchronous_commit` says).
    pub fn commit(self, _meta: Meta) -> Result<(), StoreError> {
        self.failpoint()?;
        if self.store.faults.commit_should_fail() {
            return Err(StoreError::Injected("commit"));
        }
        let changes = std::mem::take(&mut *self.changes.borrow_mut());
        let mark = self.raise_mark.map(|ms| (self.store.lane.as_str(), to_sql(ms)));
        let result =
            self.store.pg.run(write_changes(self.store.client(), self.store.statements(), changes, mark));
        self.open.set(result.is_err());
        result
    }
}

/// The columns of the upsert, one array per column.
#[derive(Default)]
pub(super) struct Upserts {
    pub(super) tenant: Vec<String>,
    pub(super) namespace: Vec<String>,
    pub(super) key: Vec<String>,
    pub(super) hash: Vec<i64>,
    pub(super) slot: Vec<i32>,
    pub(super) token: Vec<i64>,
    pub(super) attempt: Vec<i32>,
    pub(super) lease_until_ms: Vec<i64>,
    pub(super) expires_at_ms: Vec<i64>,
    pub(super) ttl_ms: Vec<i64>,
    pub(super) reclaim_at_ms: Vec<i64>,
    pub(super) fingerprint: Vec<Vec<u8>>,
    pub(super) outcome: Vec<Option<i16>>,
    pub(super) response: Vec<Option<Vec<u8>>>,
    pub(super) completed_at_ms: Vec<Option<i64>>,
    pub(super) history: Vec<Vec<u8>>,
}

impl Upserts {
    fn push(&mut self, scope: Scope, record: Record) {
        // The hash names the row's lock (the whole key's, on every node); the slot is the
        // routing's, which spreads reclaim over the shards.
        self.hash.push(route::scope_hash(&scope) as i64);
        self.slot.push(ROUTING.slot_of(&scope) as i32);
        self.reclaim_at_ms.push(to_sql(record.reclaim_at_ms()));
        self.tenant.push(scope.tenant.as_str().to_owned());
        self.namespace.push(scope.namespace.as_str().to_owned());
        self.key.push(scope.key.as_str().to_owned());
        self.token.push(to_sql(record.token));
        self.attempt.push(i32::try_from(record.attempt).unwrap_or(i32::MAX));
        self.lease_until_ms.push(to_sql(record.lease_until_ms));
        self.expires_at_ms.push(to_sql(record.expires_at_ms));
        self.ttl_ms.push(to_sql(record.ttl_ms));
        let mut history = Vec::new();
        encode_history_into(&record.history, &mut history);
        self.history.push(history);
        self.fingerprint.push(record.fingerprint.as_bytes().to_vec());
        let completion = record.completion;
        self.outcome.push(completion.as_ref().map(|c| i16::from(c.outcome.as_u8())));
        self.completed_at_ms.push(completion.as_ref().map(|c| to_sql(c.completed_at_ms)));
        self.response.push(completion.map(|c| c.response));
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 16] {
        [
            &self.tenant,
            &self.namespace,
            &self.key,
            &self.hash,
            &self.slot,
            &self.token,
            &self.attempt,
            &self.lease_until_ms,
            &self.expires_at_ms,
            &self.ttl_ms,
            &self.reclaim_at_ms,
            &self.fingerprint,
            &self.outcome,
            &self.response,
            &self.completed_at_ms,
            &self.history,
        ]
    }
}

/// One delete for every deleted record, one upsert for every changed one, and the
/// commit, sent together (pipelined). A statement that fails aborts the transaction,
/// whose `COMMIT` then only rolls it back; its error is what this returns.
pub(super) async fn write_changes(
    client: &Object,
    statements: &Statements,
    changes: HashMap<Scope, Option<Record>>,
    mark: Option<(&str, i64)>,
) -> Result<(), StoreError> {
    let mut upserts = Upserts::default();
    let mut deletes: [Vec<String>; 3] = Default::default();
    for (scope, record) in changes {
        match record {
            Some(record) => upserts.push(scope, record),
            None => {
                deletes[0].push(scope.tenant.as_str().to_owned());
                deletes[1].push(scope.namespace.as_str().to_owned());
                deletes[2].push(scope.key.as_str().to_owned());
            }
        }
    }
    let delete = async {
        if deletes[0].is_empty() {
            return Ok(0);
        }
        client.execute(&statements.delete, &[&deletes[0], &deletes[1], &deletes[2]]).await
    };
    let upsert = async {
        if upserts.tenant.is_empty() {
            return Ok(0);
        }
        client.execute(&statements.upsert, &upserts.params()).await
    };
    let raise = async {
        let Some((lane, ms)) = mark else { return Ok(0) };
        client.execute(&statements.raise_mark, &[&lane, &ms]).await
    };
    tokio::try_join!(raise, delete, upsert, client.execute(&statements.commit, &[]))
        .map_err(StoreError::Postgres)?;
    Ok(())
}
