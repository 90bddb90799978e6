//! The shard's transactions: a batch of requests, an alarm (due waiters and reclaim), and
//! the last one at shutdown. Each ends the same way ([`Shard::conclude`]): answers go out
//! only after the commit is durable, and a failure answers `unavailable` to all of them.

use std::sync::atomic::Ordering;
use std::time::Instant;

use oncegate_core::{Command, Reply, ReserveReply, Scope, answers_from_earlier_bucket, decide};

use super::book::{Book, Outbox};
use super::{Alarm, Asked, Derive, Moved, Request, Shard, ShardState};
use crate::config::EngineConfig;
use crate::error::Error;
use crate::store::{Meta, Store, StoreError, Txn, sqlite};

impl Shard {
    /// Serves a batch of requests in one transaction.
    pub(super) fn serve_batch(&mut self, requests: Vec<Request>) {
        let len = requests.len() as u64;
        self.retry_writes_when_due();
        self.ensure_token_room();
        if self.store.is_none() {
            let error = self.unavailable(self.closed_reason());
            for request in requests {
                let _ = request.reply.send(Err(error.clone()));
            }
            return;
        }
        self.cx.faults.pass_gate();
        self.cx.faults.maybe_panic();
        let batch_span = tracing::debug_span!("batch", shard = self.id, len);
        for request in &requests {
            batch_span.follows_from(&request.span);
        }
        let _entered = batch_span.enter();
        let local_now = self.guard.read(self.cx.clock.monotonic_ms());
        let token_before = self.book.next_token;
        let mut outbox: Outbox = Vec::with_capacity(requests.len());
        let refusal = self.write_refusal();
        let store = self.store.as_mut().expect("checked above");
        let mut batch = Batch {
            book: &mut self.book,
            config: &self.cx.config,
            shard: self.id,
            refusal,
            store_estimate_ms: local_now.saturating_add_signed(self.store_ahead_ms),
            now: local_now,
            began: false,
            outbox: &mut outbox,
        };
        let result = batch.write(store, requests);
        // Only a transaction that began read the store's time: one that could not begin
        // says nothing of how far ahead the store is (taken as 0, the next derived reserve
        // would lock the wrong buckets when the database's clock and this node's differ).
        if batch.began {
            self.store_ahead_ms = batch.now as i64 - local_now as i64;
        }
        metrics::histogram!("oncegate_shard_batch_len", "shard" => self.id.to_string()).record(len as f64);
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        self.shared.commands.fetch_add(len, Ordering::Relaxed);
        let wrote = self.conclude(result, outbox, token_before, |wrote, shared| {
            shared.commits.fetch_add(u64::from(*wrote), Ordering::Relaxed);
        });
        // A batch that wrote while writes were being tried again found room.
        if wrote == Some(true)
            && self
                .store
                .as_ref()
                .is_some_and(|store| !store.own().is_some_and(sqlite::Store::writes_refused))
        {
            self.writes_resumed();
        }
    }

    /// Serves due waiters and reclaims up to `reclaim_batch_max` expired records, in one
    /// transaction; a failed shard tries to reopen when its backoff is over.
    pub(super) fn alarm(&mut self, why: Alarm) {
        self.retry_writes_when_due();
        self.ensure_token_room();
        if self.store.is_none() {
            if self.reopen_at.is_some_and(|at| at <= Instant::now()) {
                self.open(Asked::ByShard);
            }
            return;
        }
        let local_now = self.guard.read(self.cx.clock.monotonic_ms());
        let limit = self.cx.config.reclaim_batch_max;
        let full = self.write_refusal();
        let store = self.store.as_mut().expect("checked above");
        // A full disk reclaims nothing and drops no moved slot's rows (deletes write).
        let refusing = store.own().is_some_and(sqlite::Store::writes_refused);
        let token_before = self.book.next_token;
        let mut outbox: Outbox = Vec::new();
        let book = &mut self.book;
        let leaving = &mut self.leaving;
        // A shared store's waiters are all read again (another node may have changed
        // their keys); a file's only when due.
        let polled = store.waiters_poll_ms().is_some();
        let estimate = local_now.saturating_add_signed(self.store_ahead_ms);
        let mut store_now = None;
        // `None`: a poll that found nothing to do, and so wrote nothing.
        let result = (|| -> Result<Option<usize>, StoreError> {
            let keys = if polled {
                let must_write = why == Alarm::Asked || !leaving.is_empty();
                let Some(changed) = poll_waits(store, book, must_write, local_now, &mut store_now)? else {
                    return Ok(None);
                };
                changed
            } else {
                book.due(estimate)
            };
            let txn = store.begin(&keys.iter().collect::<Vec<_>>(), local_now)?;
            let now = txn.now();
            store_now = Some(now);
            let due = if polled { keys } else { book.due(now) };
            for scope in &due {
                book.serve_waiters(&txn, scope, now, false, &full, &mut outbox)?;
            }
            let removed = txn.reclaim(now, limit)?;
            book.records_delta.remove(&removed);
            if !refusing {
                super::moves::drop_leaving(&txn, leaving, limit, book)?;
            }
            txn.commit(Meta { next_token: book.next_token, high_water_ms: now })?;
            Ok(Some((removed.pending + removed.completed) as usize))
        })();
        // As after a batch: a transaction that could not begin read no store time.
        if let Some(store_now) = store_now {
            self.store_ahead_ms = store_now as i64 - local_now as i64;
        }
        self.polled_at_ms = store_now.unwrap_or(estimate);
        let reclaimed = self.conclude(result, outbox, token_before, |reclaimed, shared| {
            shared.alarms.fetch_add(1, Ordering::Relaxed);
            if let Some(reclaimed) = reclaimed {
                shared.reclaimed.fetch_add(*reclaimed as u64, Ordering::Relaxed);
                shared.commits.fetch_add(1, Ordering::Relaxed);
            }
        });
        let (Some(Some(_)), Some(store)) = (reclaimed, self.store.as_ref()) else { return };
        // Windows still due mean a backlog: the next alarm is at once. The loop runs due
        // alarms before reading the mailbox, so a backlog is reclaimed ahead of queued
        // data (one chunk per tick).
        self.book.next_reclaim_ms = store.next_reclaim_ms();
    }

    /// Shutdown: serve what was accepted, answer waiters, close the file.
    pub(super) fn finish(mut self) {
        loop {
            let (requests, after) = self.drain(self.data.try_recv().ok());
            // Read after the requests, as in a batch, and served before them.
            let moved: Vec<Moved> = self.moved.try_iter().collect();
            if requests.is_empty() && after.is_none() && moved.is_empty() {
                break;
            }
            for moved in moved {
                match moved {
                    // Answered `in progress` with the shard's own waiters below.
                    Moved::Adopt(parked) => self.book.adopt(parked),
                    Moved::Held(held) => self.serve_held(held),
                }
            }
            // In mailbox order: the requests came before what stopped the drain.
            if !requests.is_empty() {
                self.serve_batch(requests);
            }
            if let Some(super::Mail::MoveOut(move_out)) = after {
                let _ = move_out.reply.send(Err(self.unavailable("the shard is stopping")));
            }
        }
        if self.store.is_some() {
            let local_now = self.guard.read(self.cx.clock.monotonic_ms());
            let full = self.write_refusal();
            let store = self.store.as_mut().expect("checked above");
            let token_before = self.book.next_token;
            let mut outbox: Outbox = Vec::new();
            let book = &mut self.book;
            let result = (|| -> Result<(), StoreError> {
                let keys = book.waited_keys();
                let txn = store.begin(&keys.iter().collect::<Vec<_>>(), local_now)?;
                let now = txn.now();
                for scope in &keys {
                    book.serve_waiters(&txn, scope, now, true, &full, &mut outbox)?;
                }
                // A clean stop records its time: the restart grace measures from it.
                let meta = Meta { next_token: book.next_token, high_water_ms: now };
                if let Some(own) = txn.own() {
                    own.set_meta(meta)?;
                }
                txn.commit(meta)
            })();
            self.conclude(result, outbox, token_before, |(), _| {});
        }
        self.store = None;
        self.shared.waiters.store(0, Ordering::Relaxed);
        self.shared.set_state(ShardState::Stopped);
        tracing::info!(
            shard = self.id,
            batches = self.shared.batches.load(Ordering::Relaxed),
            commands = self.shared.commands.load(Ordering::Relaxed),
            reclaimed = self.shared.reclaimed.load(Ordering::Relaxed),
            failures = self.shared.failures.load(Ordering::Relaxed),
            "shard stopped; its file is closed"
        );
    }

    /// Publishes what the shard's gauges read besides its counters: the file's size and
    /// how far the shard's time is from the wall clock.
    pub(super) fn publish_gauges(&mut self) {
        if let Some(own) = self.store.as_ref().and_then(Store::own) {
            self.shared.file_bytes.store(own.used_bytes(), Ordering::Relaxed);
        }
        let now = self.guard.read(self.cx.clock.monotonic_ms()) as i64;
        let ahead_ms = now.saturating_sub(self.cx.clock.now_ms() as i64);
        self.shared.clock_ahead_ms.store(ahead_ms, Ordering::Relaxed);
    }

    /// The one end of every transaction. Committed: the book's counts become true,
    /// `durable` counts what the transaction did, the counters are published (so a
    /// caller that got its answer sees stats that include its request), and only then
    /// does every answer go out. Failed: nothing of it is durable, so the token counter
    /// goes back, its counts are forgotten, and every caller hears a refusal, never an
    /// acknowledgement: on a full disk `resource_exhausted` (the store stays open and
    /// refuses writes from now on), otherwise `unavailable` (the shard fails).
    pub(super) fn conclude<T>(
        &mut self,
        result: Result<T, StoreError>,
        outbox: Outbox,
        token_before: u64,
        durable: impl FnOnce(&T, &super::Shared),
    ) -> Option<T> {
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        match result {
            Ok(value) => {
                self.shared.set_records(self.book.settle());
                durable(&value, &self.shared);
                self.publish_gauges();
                self.shared.publish();
                for (reply, answer) in outbox {
                    let _ = reply.send(answer);
                }
                Some(value)
            }
            Err(error) => {
                self.book.next_token = token_before;
                self.book.discard_delta();
                let refusal = if error.is_disk_full() && self.store.is_some() {
                    self.refuse_writes(&error);
                    super::book::disk_full(self.id, &self.path)
                } else {
                    self.record_failure(&error);
                    self.unavailable(&format!("storage failure: {error}"))
                };
                for (reply, _) in outbox {
                    let _ = reply.send(Err(refusal.clone()));
                }
                None
            }
        }
    }
}

/// A shared store's poll of its parked reserves: reads every waited key without a lock,
/// and returns the keys whose waiters would now be answered, or `None` when there are
/// none, no reclaim is due and nothing else asks for a write (`must_write`: a moved
/// slot's records to drop, an alarm run on request), so that the alarm writes nothing. Writing every poll took the waited keys' locks (a shard stalled behind
/// any other node's transaction on one of them) and cost a WAL flush per poll whether or
/// not anything had changed. The write transaction that follows reads them again, under
/// their locks, and decides from that.
fn poll_waits(
    store: &mut Store,
    book: &mut Book,
    must_write: bool,
    local_now: u64,
    store_now: &mut Option<u64>,
) -> Result<Option<Vec<Scope>>, StoreError> {
    // Gone callers are dropped without a transaction; a wait that has lost all of its
    // callers needs no write.
    book.forget_gone();
    let waited = book.waited_keys();
    let read = store.begin_read(&waited.iter().collect::<Vec<_>>(), local_now)?;
    let now = read.now();
    *store_now = Some(now);
    let changed = book.changed_waits(now, |scope| read.get(scope))?;
    read.finish_read();
    let reclaim_due = book.next_reclaim_ms.is_some_and(|at| at <= now);
    Ok((!changed.is_empty() || reclaim_due || must_write).then_some(changed))
}

/// One batch being written: the book it changes and where its answers go. Answers go to
/// `outbox` (or, for parked reserves, to the waiter queues) and are sent by the shard
/// only after `write` returns `Ok`, that is, after the commit is durable.
struct Batch<'a> {
    book: &'a mut Book,
    config: &'a EngineConfig,
    shard: u32,
    /// What a write refused alone hears (the file at its limit, or the disk full).
    refusal: Error,
    /// The store's time as the shard expects it before the transaction (its own reading,
    /// moved by how far ahead the store's time was last), by which derived keys' buckets
    /// are locked: a shared store's time comes from the transaction itself.
    store_estimate_ms: u64,
    /// The shard's own time until the transaction begins, the store's from then on.
    now: u64,
    /// Whether the transaction began (and `now` is the store's).
    began: bool,
    outbox: &'a mut Outbox,
}

impl Batch<'_> {
    /// Applies the requests inside one transaction: a write transaction committed with
    /// the counters, or, when every request only reads, a read transaction that writes
    /// and syncs nothing. Returns whether it wrote.
    fn write(&mut self, store: &mut Store, requests: Vec<Request>) -> Result<bool, StoreError> {
        let writes = requests.iter().any(|r| !r.command.is_read_only());
        let candidates: Vec<Scope> = requests
            .iter()
            .filter_map(|r| r.derive.as_ref().map(|d| (&r.scope, d)))
            .flat_map(|(base, derive)| self.candidates(base, derive))
            .collect();
        let named = requests.iter().filter(|r| r.derive.is_none()).map(|r| &r.scope);
        let keys: Vec<&Scope> = named.chain(&candidates).collect();
        let began = if writes { store.begin(&keys, self.now) } else { store.begin_read(&keys, self.now) };
        drop(keys);
        let txn = match began {
            Ok(txn) => txn,
            Err(error) => {
                // Every caller goes into the outbox, which the failure path answers.
                let placeholder = Error::Unavailable { shard: self.shard, reason: String::new() };
                self.outbox.extend(requests.into_iter().map(|r| (r.reply, Err(placeholder.clone()))));
                return Err(error);
            }
        };
        self.now = txn.now();
        self.began = true;
        let mut touched: Vec<Scope> = Vec::new();
        let mut requests = requests.into_iter();
        for request in requests.by_ref() {
            if let Err(error) = self.step(&txn, request, &mut touched) {
                // The unanswered rest goes into the outbox too: the failure path answers
                // everyone there.
                let placeholder = Error::Unavailable { shard: self.shard, reason: String::new() };
                self.outbox.extend(requests.map(|r| (r.reply, Err(placeholder.clone()))));
                return Err(error);
            }
        }
        if !writes {
            txn.finish_read();
            return Ok(false);
        }
        touched.sort();
        touched.dedup();
        let full = self.refusal.clone();
        for scope in &touched {
            self.book.serve_waiters(&txn, scope, self.now, false, &full, self.outbox)?;
        }
        if txn.own().is_some_and(sqlite::Txn::acks_early) {
            // The deliberate bug the power-loss harness must catch: answers before COMMIT.
            for (reply, answer) in self.outbox.drain(..) {
                let _ = reply.send(answer);
            }
        }
        let started = Instant::now();
        // `now` came from the guard, so it is the high-water mark to persist.
        txn.commit(Meta { next_token: self.book.next_token, high_water_ms: self.now })?;
        metrics::histogram!("oncegate_shard_commit_seconds", "shard" => self.shard.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(true)
    }

    /// Decides one request. A reserve or read whose caller has gone is skipped: never
    /// granted, never parked. A write that does not fit is refused alone.
    fn step(&mut self, txn: &Txn<'_>, request: Request, touched: &mut Vec<Scope>) -> Result<(), StoreError> {
        let Request { scope, command, reply, derive, .. } = request;
        if reply.is_closed() && matches!(command, Command::Reserve(_) | Command::Get | Command::Inspect) {
            return Ok(());
        }
        let scope = match derive.map(|derive| self.derive(txn, &scope, &derive)) {
            None => scope,
            Some(Ok(Ok(scope))) => scope,
            Some(Ok(Err(refusal))) => {
                self.outbox.push((reply, Err(refusal)));
                return Ok(());
            }
            Some(Err(error)) => {
                self.outbox
                    .push((reply, Err(Error::Unavailable { shard: self.shard, reason: String::new() })));
                return Err(error);
            }
        };
        let book = &mut *self.book;
        let step = txn.get(&scope).and_then(|record| {
            if matches!(command, Command::Reserve(_)) {
                book.next_token = txn.next_token(book.next_token)?;
            }
            let decision = decide(record.as_ref(), &command, self.now, book.next_token);
            if let Some(refusal) = book.quota_refusal(&scope, record.as_ref(), &decision) {
                return Ok(Err(refusal));
            }
            book.record(txn, &scope, record.as_ref(), &decision).map(|()| Ok(decision))
        });
        let decision = match step {
            Ok(Ok(decision)) => decision,
            Ok(Err(refusal)) => {
                self.outbox.push((reply, Err(refusal)));
                return Ok(());
            }
            Err(error) if failed_alone(txn, &error) => {
                self.outbox.push((reply, Err(self.refusal.clone())));
                return Ok(());
            }
            Err(error) => {
                self.outbox
                    .push((reply, Err(Error::Unavailable { shard: self.shard, reason: String::new() })));
                return Err(error);
            }
        };
        if book.has_waiters(&scope) && !matches!(decision.change, oncegate_core::Change::Keep) {
            touched.push(scope.clone());
        }
        if let (
            Command::Reserve(reserve),
            Ok(Reply::Reserve(ReserveReply::InProgress { lease_until_ms, .. })),
        ) = (&command, &decision.reply)
            && reserve.wait_ms > 0
        {
            if let Err((reply, error)) =
                book.park(self.config, &scope, reserve, self.now, *lease_until_ms, reply)
            {
                self.outbox.push((reply, Err(error)));
            }
            return Ok(());
        }
        self.outbox.push((reply, decision.reply.map_err(Error::from)));
        Ok(())
    }

    /// The buckets a derived reserve may be decided in, as scopes to lock before the
    /// transaction reads its time: the expected bucket and one on either side (the
    /// store's time may differ from the estimate by less than a bucket), and with a grace
    /// the one before those (the earlier bucket of the lowest).
    fn candidates(&self, base: &Scope, derive: &Derive) -> Vec<Scope> {
        self.lockable(&derive.derived)
            .filter_map(|n| self.config.limits.key(&derive.derived.key(n)).ok())
            .map(|key| Scope { key, ..base.clone() })
            .collect()
    }

    fn lockable(&self, derived: &oncegate_core::DerivedKey) -> std::ops::RangeInclusive<u64> {
        let expected = derived.bucket_of(self.store_estimate_ms);
        let below = if derived.has_grace() { 2 } else { 1 };
        expected.saturating_sub(below)..=expected.saturating_add(1)
    }

    /// The key of a derived reserve, by the transaction's time: its bucket's, or within
    /// the grace after a boundary the previous bucket's while that one holds a record
    /// (`answers_from_earlier_bucket`). The caller learns it before any answer goes out.
    /// A refusal (a key past its length limit, a time outside the locked buckets) is the
    /// request's alone.
    fn derive(
        &self,
        txn: &Txn<'_>,
        base: &Scope,
        derive: &Derive,
    ) -> Result<Result<Scope, Error>, StoreError> {
        let derived = &derive.derived;
        let locked = self.lockable(derived);
        let (bucket, earlier) = (derived.bucket_of(self.now), derived.earlier_bucket(self.now));
        if !locked.contains(&bucket) || earlier.is_some_and(|e| !locked.contains(&e)) {
            let reason = "the store's clock and this node's differ by more than a bucket".to_owned();
            return Ok(Err(Error::Unavailable { shard: self.shard, reason }));
        }
        let scope = |n: u64| -> Result<Scope, Error> {
            Ok(Scope { key: self.config.limits.key(&derived.key(n))?, ..base.clone() })
        };
        let chosen = match earlier.map(scope) {
            None => scope(bucket),
            Some(Err(refusal)) => Err(refusal),
            Some(Ok(earlier)) if answers_from_earlier_bucket(txn.get(&earlier)?.as_ref(), self.now) => {
                Ok(earlier)
            }
            Some(Ok(_)) => scope(bucket),
        };
        if let Ok(chosen) = &chosen {
            let _ = derive.named.set(chosen.key.clone());
        }
        Ok(chosen)
    }
}

/// Whether `error` undid only the statement that raised it (a full SQLite file), so that
/// its request alone is refused and the batch goes on. A shared store's error is never
/// one.
pub(super) fn failed_alone(txn: &Txn<'_>, error: &StoreError) -> bool {
    txn.own().is_some_and(|own| own.failed_alone(error))
}
