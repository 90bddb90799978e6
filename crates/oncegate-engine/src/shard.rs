//! The shard actor: one OS thread that alone owns one SQLite file.
//!
//! The protocol, in the order the loop runs it:
//!
//! 1. **Control first.** Shutdown, alarm and reopen requests arrive on their own channel
//!    and are handled before any data, so an operator can always reach a busy shard.
//! 2. **Batch.** The actor drains up to `batch_len_max` requests from its bounded
//!    mailbox, decides each with the core (later ones see earlier ones' effects because
//!    each reads inside the same transaction), writes the token counter and the clock
//!    high-water mark, commits, and only then replies to every request of the batch.
//! 3. **Alarm.** Between batches, the actor sleeps on the mailbox until its next deadline:
//!    the earliest reclaimable record, a waited key's lease end, a waiter's deadline, or
//!    a reopen attempt. An alarm serves waiters and reclaims at most `reclaim_batch_max`
//!    records, in one transaction.
//! 4. **Failure.** Any storage error rolls the transaction back, answers `unavailable` to
//!    every request of the batch and every parked waiter, closes the file and marks the
//!    shard failed. A failed shard answers `unavailable` at once and retries a clean open
//!    with exponential backoff.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, at, never, select};
use oncegate_core::{
    Change, ClockGuard, Command, Decision, Record, Reply, Reserve, ReserveReply, Scope, decide,
};
use tokio::sync::oneshot;

use crate::store::{Meta, Store, StoreError, Tuning, Txn};
use crate::{Clock, EngineConfig, Error, Faults};

/// A data request: one command on one key, and where to send the answer.
pub(crate) struct Request {
    pub scope: Scope,
    pub command: Command,
    pub reply: oneshot::Sender<Result<Reply, Error>>,
    /// The caller's span (disabled unless a subscriber wants it), so the batch that
    /// serves the request can link to it.
    pub span: tracing::Span,
}

/// Requests that must not wait behind data.
pub(crate) enum Control {
    /// Finish what is queued, answer waiters, close the file, exit.
    Shutdown,
    /// Run the alarm now (tests move a manual clock, then call this instead of sleeping).
    RunAlarms(crossbeam_channel::Sender<()>),
    /// Close and reopen the file now (after an operator fixed a fault).
    Reopen(crossbeam_channel::Sender<bool>),
}

/// A shard's lifecycle state, visible to health checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShardState {
    /// Opening its file for the first time.
    Starting,
    /// Serving requests.
    Serving,
    /// A storage error closed the file; answering `unavailable` and retrying an open.
    Failed,
    /// Shut down.
    Stopped,
}

impl ShardState {
    fn from_u8(v: u8) -> ShardState {
        match v {
            0 => ShardState::Starting,
            1 => ShardState::Serving,
            2 => ShardState::Failed,
            _ => ShardState::Stopped,
        }
    }

    /// The lowercase name used in logs and status output.
    pub fn as_str(self) -> &'static str {
        match self {
            ShardState::Starting => "starting",
            ShardState::Serving => "serving",
            ShardState::Failed => "failed",
            ShardState::Stopped => "stopped",
        }
    }
}

/// Counters the actor publishes for `Engine::stats` without being asked.
#[derive(Default)]
pub(crate) struct Shared {
    /// The state for cheap reads; `state_lock` and `state_changed` let waiters block.
    state: AtomicU8,
    state_lock: Mutex<()>,
    state_changed: Condvar,
    pub batches: AtomicU64,
    pub commands: AtomicU64,
    pub commits: AtomicU64,
    pub failures: AtomicU64,
    pub reclaimed: AtomicU64,
    pub alarms: AtomicU64,
    /// Stored records by state, published after each commit.
    pub records_pending: AtomicU64,
    pub records_completed: AtomicU64,
    pub waiters: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

impl Shared {
    pub fn state(&self) -> ShardState {
        ShardState::from_u8(self.state.load(Ordering::Acquire))
    }

    fn set_state(&self, state: ShardState) {
        let v = match state {
            ShardState::Starting => 0,
            ShardState::Serving => 1,
            ShardState::Failed => 2,
            ShardState::Stopped => 3,
        };
        let _guard = self.state_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.state.store(v, Ordering::Release);
        self.state_changed.notify_all();
    }

    pub fn wait_state(&self, state: ShardState, timeout: Duration) -> bool {
        let guard = self.state_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (_guard, result) = self
            .state_changed
            .wait_timeout_while(guard, timeout, |_| self.state() != state)
            .unwrap_or_else(|p| p.into_inner());
        !result.timed_out()
    }
}

/// A reserve parked until its key changes or its wait runs out.
struct Waiter {
    reserve: Reserve,
    deadline_ms: u64,
    reply: oneshot::Sender<Result<Reply, Error>>,
}

/// The parked reserves of one key, first come first served.
struct WaitQueue {
    waiters: VecDeque<Waiter>,
    /// The holder's lease deadline as last seen: when it passes, a waiter may be granted.
    lease_until_ms: u64,
}

/// Answers to send once the batch's transaction has committed.
type Outbox = Vec<(oneshot::Sender<Result<Reply, Error>>, Result<Reply, Error>)>;

/// The actor's in-memory state that a batch changes alongside the store.
struct Book {
    next_token: u64,
    queues: HashMap<Scope, WaitQueue>,
    waiters_len: usize,
    /// The earliest instant a stored record becomes reclaimable, if known.
    next_reclaim_ms: Option<u64>,
    /// Stored records by state (pending, completed), as of the last commit.
    records: (i64, i64),
    /// Changes to `records` by the transaction in progress.
    records_delta: (i64, i64),
}

impl Book {
    /// Writes a decision's change and keeps the alarm index, token counter and record
    /// counts in step. `prior` is the stored record the decision was made on.
    fn apply(
        &mut self,
        txn: &Txn<'_>,
        scope: &Scope,
        prior: Option<&Record>,
        decision: &Decision,
    ) -> Result<(), StoreError> {
        if decision.consumes_token() {
            self.next_token += 1;
        }
        let count = |record: Option<&Record>, sign: i64| match record {
            None => (0, 0),
            Some(r) if r.completion.is_some() => (0, sign),
            Some(_) => (sign, 0),
        };
        let (before, after) = match &decision.change {
            Change::Keep => return Ok(()),
            Change::Put(record) => {
                txn.put(scope, record)?;
                let at = record.reclaim_at_ms();
                self.next_reclaim_ms = Some(self.next_reclaim_ms.map_or(at, |n| n.min(at)));
                (count(prior, -1), count(Some(record), 1))
            }
            Change::Delete => {
                txn.delete(scope)?;
                (count(prior, -1), (0, 0))
            }
        };
        self.records_delta.0 += before.0 + after.0;
        self.records_delta.1 += before.1 + after.1;
        Ok(())
    }

    /// The transaction committed: its record counts become true.
    fn settle(&mut self, shared: &Shared) {
        self.records.0 += std::mem::take(&mut self.records_delta.0);
        self.records.1 += std::mem::take(&mut self.records_delta.1);
        shared.records_pending.store(self.records.0.max(0) as u64, Ordering::Relaxed);
        shared.records_completed.store(self.records.1.max(0) as u64, Ordering::Relaxed);
    }

    /// Answers the parked reserves of `scope` that can be answered now: a replay for all
    /// when the key completed, a grant for the first when it is free or abandoned, and
    /// `in progress` for those whose wait ran out (all of them when `closing`).
    fn serve_waiters(
        &mut self,
        txn: &Txn<'_>,
        scope: &Scope,
        now_ms: u64,
        closing: bool,
        outbox: &mut Outbox,
    ) -> Result<(), StoreError> {
        let Some(mut queue) = self.queues.remove(scope) else { return Ok(()) };
        let mut in_progress = None;
        while let Some(waiter) = queue.waiters.front() {
            let command = Command::Reserve(waiter.reserve.clone());
            let step = txn.get(scope).and_then(|record| {
                let decision = decide(record.as_ref(), &command, now_ms, self.next_token);
                self.apply(txn, scope, record.as_ref(), &decision)?;
                Ok(decision)
            });
            let decision = match step {
                Ok(decision) => decision,
                Err(error) => {
                    // Put the queue back so the failure path answers every waiter.
                    self.queues.insert(scope.clone(), queue);
                    return Err(error);
                }
            };
            if let Ok(Reply::Reserve(ReserveReply::InProgress { lease_until_ms, .. })) = &decision.reply {
                queue.lease_until_ms = *lease_until_ms;
                in_progress = Some(decision.reply);
                break;
            }
            let waiter = queue.waiters.pop_front().expect("front exists");
            outbox.push((waiter.reply, decision.reply.map_err(Error::from)));
        }
        if let Some(reply) = in_progress {
            let (done, kept): (VecDeque<_>, VecDeque<_>) =
                queue.waiters.into_iter().partition(|w| closing || w.deadline_ms <= now_ms);
            for waiter in done {
                outbox.push((waiter.reply, reply.clone().map_err(Error::from)));
            }
            queue.waiters = kept;
        }
        if !queue.waiters.is_empty() {
            self.queues.insert(scope.clone(), queue);
        }
        self.waiters_len = self.queues.values().map(|q| q.waiters.len()).sum();
        Ok(())
    }

    /// The earliest deadline among parked reserves and the leases they wait on.
    fn waiters_alarm_ms(&self) -> Option<u64> {
        self.queues
            .values()
            .flat_map(|q| std::iter::once(q.lease_until_ms).chain(q.waiters.iter().map(|w| w.deadline_ms)))
            .min()
    }
}

pub(crate) struct Shard {
    id: u32,
    config: Arc<EngineConfig>,
    path: PathBuf,
    clock: Arc<dyn Clock>,
    faults: Faults,
    shared: Arc<Shared>,
    data: Receiver<Request>,
    control: Receiver<Control>,
    store: Option<Store>,
    guard: ClockGuard,
    book: Book,
    backoff_ms: u64,
    reopen_at: Option<Instant>,
}

impl Shard {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u32,
        config: Arc<EngineConfig>,
        path: PathBuf,
        clock: Arc<dyn Clock>,
        faults: Faults,
        shared: Arc<Shared>,
        data: Receiver<Request>,
        control: Receiver<Control>,
    ) -> Shard {
        let backoff_ms = config.reopen_backoff_ms_min;
        Shard {
            id,
            config,
            path,
            clock,
            faults,
            shared,
            data,
            control,
            store: None,
            guard: ClockGuard::new(0),
            book: Book {
                next_token: 1,
                queues: HashMap::new(),
                waiters_len: 0,
                next_reclaim_ms: None,
                records: (0, 0),
                records_delta: (0, 0),
            },
            backoff_ms,
            reopen_at: None,
        }
    }

    fn unavailable(&self, reason: &str) -> Error {
        Error::Unavailable { shard: self.id, reason: reason.to_owned() }
    }

    /// Opens the file cleanly: integrity check, counters, restart grace. On failure the
    /// shard stays failed and schedules the next attempt.
    fn open(&mut self) -> bool {
        match self.try_open() {
            Ok(store) => {
                self.store = Some(store);
                self.backoff_ms = self.config.reopen_backoff_ms_min;
                self.reopen_at = None;
                self.shared.set_state(ShardState::Serving);
                tracing::info!(shard = self.id, path = %self.path.display(), "shard serving");
                true
            }
            Err(error) => {
                self.record_failure(&error);
                false
            }
        }
    }

    fn try_open(&mut self) -> Result<Store, StoreError> {
        let tuning = Tuning {
            durability: self.config.durability,
            file_bytes_max: self.config.shard_file_bytes_max,
            page_cache_bytes_max: self.config.page_cache_bytes_max,
            wal_checkpoint_pages: self.config.wal_checkpoint_pages,
        };
        let (mut store, meta) = Store::open(&self.path, &tuning, &self.faults)?;
        self.guard = ClockGuard::new(meta.high_water_ms);
        let now = self.guard.anchor(self.clock.now_ms(), self.clock.monotonic_ms());
        let txn = store.begin()?;
        let mut extended = 0usize;
        for (scope, mut record) in txn.pending_leased_after(meta.high_water_ms)? {
            if record.apply_restart_grace(meta.high_water_ms, now, self.config.lease_restart_grace_ms) {
                txn.put(&scope, &record)?;
                extended += 1;
            }
        }
        txn.set_meta(Meta { next_token: meta.next_token, high_water_ms: now })?;
        txn.commit()?;
        if extended > 0 {
            tracing::info!(shard = self.id, leases = extended, "restart grace extended live leases");
        }
        self.book.next_token = meta.next_token;
        self.book.next_reclaim_ms = store.min_reclaim_at_ms()?;
        let (pending, completed) = store.count()?;
        self.book.records = (pending as i64, completed as i64);
        self.book.records_delta = (0, 0);
        self.book.settle(&self.shared);
        Ok(store)
    }

    fn record_failure(&mut self, error: &StoreError) {
        tracing::error!(shard = self.id, %error, "storage failure; answering unavailable until a clean reopen");
        self.store = None;
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        *self.shared.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.to_string());
        self.shared.set_state(ShardState::Failed);
        // Fail closed: nobody parked on this shard may be granted by a later open.
        let reason = format!("storage failure: {error}");
        for (_, queue) in self.book.queues.drain() {
            for waiter in queue.waiters {
                let _ = waiter.reply.send(Err(Error::Unavailable { shard: self.id, reason: reason.clone() }));
            }
        }
        self.book.waiters_len = 0;
        self.shared.waiters.store(0, Ordering::Relaxed);
        self.reopen_at = Some(Instant::now() + Duration::from_millis(self.backoff_ms));
        self.backoff_ms = (self.backoff_ms * 2).min(self.config.reopen_backoff_ms_max);
    }

    /// The actor's loop; returns when shut down or when the engine is dropped.
    pub fn run(mut self, started: Sender<u32>) {
        self.open();
        let _ = started.send(self.id);
        loop {
            while let Ok(control) = self.control.try_recv() {
                if self.handle_control(control) {
                    return self.finish();
                }
            }
            let alarm = self.next_alarm();
            if alarm.is_some_and(|a| a <= Instant::now()) {
                self.alarm();
                continue;
            }
            let timer = alarm.map_or_else(never, at);
            select! {
                recv(self.control) -> control => match control {
                    Ok(control) => if self.handle_control(control) { return self.finish() },
                    Err(_) => return self.finish(),
                },
                recv(self.data) -> request => match request {
                    Ok(request) => self.batch(request),
                    Err(_) => return self.finish(),
                },
                recv(timer) -> _ => self.alarm(),
            }
        }
    }

    /// Handles one control message; returns whether to stop.
    fn handle_control(&mut self, control: Control) -> bool {
        match control {
            Control::Shutdown => true,
            Control::RunAlarms(done) => {
                self.alarm();
                let _ = done.send(());
                false
            }
            Control::Reopen(done) => {
                self.store = None;
                let ok = self.open();
                let _ = done.send(ok);
                false
            }
        }
    }

    /// When the loop must wake up even if no request arrives.
    fn next_alarm(&self) -> Option<Instant> {
        if self.store.is_none() {
            return self.reopen_at;
        }
        let deadline_ms = match (self.book.next_reclaim_ms, self.book.waiters_alarm_ms()) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let mut guard = self.guard;
        let now_ms = guard.read(self.clock.monotonic_ms());
        Some(Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms)))
    }

    fn batch(&mut self, first: Request) {
        let requests = self.drain(Some(first));
        self.apply_batch(requests);
    }

    /// Takes what the mailbox holds now, after `first`, up to `batch_len_max` in all.
    fn drain(&self, first: Option<Request>) -> Vec<Request> {
        let mut requests = Vec::with_capacity(self.config.batch_len_max.min(64));
        requests.extend(first);
        while requests.len() < self.config.batch_len_max {
            match self.data.try_recv() {
                Ok(request) => requests.push(request),
                Err(_) => break,
            }
        }
        requests
    }

    fn apply_batch(&mut self, requests: Vec<Request>) {
        let len = requests.len() as u64;
        let Some(store) = self.store.as_mut() else {
            let error = self.unavailable("the shard failed and is reopening");
            for request in requests {
                let _ = request.reply.send(Err(error.clone()));
            }
            return;
        };
        self.faults.pass_gate();
        let batch_span = tracing::debug_span!("batch", shard = self.id, len);
        for request in &requests {
            batch_span.follows_from(&request.span);
        }
        let _entered = batch_span.enter();
        let now = self.guard.read(self.clock.monotonic_ms());
        let token_before = self.book.next_token;
        let mut outbox: Outbox = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter();
        let result = apply(store, &mut self.book, &self.config, &mut requests, &mut outbox, now, self.id);
        metrics::histogram!("oncegate_shard_batch_len", "shard" => self.id.to_string()).record(len as f64);
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        self.shared.commands.fetch_add(len, Ordering::Relaxed);
        // Counters are published before the answers, so a caller that got its answer
        // sees stats that include its request.
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        match result {
            Ok(()) => {
                self.book.settle(&self.shared);
                self.shared.commits.fetch_add(1, Ordering::Relaxed);
                for (reply, answer) in outbox {
                    let _ = reply.send(answer);
                }
            }
            Err(error) => {
                // Nothing of this batch is durable: the counter goes back, and every
                // caller hears `unavailable`, never an acknowledgement.
                self.book.next_token = token_before;
                self.book.records_delta = (0, 0);
                self.record_failure(&error);
                let refusal = self.unavailable(&format!("storage failure: {error}"));
                for (reply, _) in outbox {
                    let _ = reply.send(Err(refusal.clone()));
                }
                for request in requests {
                    let _ = request.reply.send(Err(refusal.clone()));
                }
            }
        }
    }

    fn alarm(&mut self) {
        let Some(store) = self.store.as_mut() else {
            if self.reopen_at.is_some_and(|at| at <= Instant::now()) {
                self.open();
            }
            return;
        };
        let now = self.guard.read(self.clock.monotonic_ms());
        let limit = self.config.reclaim_batch_max;
        let mut outbox: Outbox = Vec::new();
        let book = &mut self.book;
        let result = (|| -> Result<usize, StoreError> {
            let txn = store.begin()?;
            let due: Vec<Scope> = book
                .queues
                .iter()
                .filter(|(_, q)| q.lease_until_ms <= now || q.waiters.iter().any(|w| w.deadline_ms <= now))
                .map(|(scope, _)| scope.clone())
                .collect();
            for scope in &due {
                book.serve_waiters(&txn, scope, now, false, &mut outbox)?;
            }
            let (pending, completed) = txn.reclaim(now, limit)?;
            book.records_delta.0 -= pending as i64;
            book.records_delta.1 -= completed as i64;
            txn.set_meta(Meta { next_token: book.next_token, high_water_ms: now })?;
            txn.commit()?;
            Ok(pending + completed)
        })();
        match result {
            Ok(reclaimed) => {
                self.book.settle(&self.shared);
                self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
                self.shared.reclaimed.fetch_add(reclaimed as u64, Ordering::Relaxed);
                self.shared.alarms.fetch_add(1, Ordering::Relaxed);
                self.shared.commits.fetch_add(1, Ordering::Relaxed);
                // The transaction committed: these answers are true whatever happens next.
                for (reply, answer) in outbox {
                    let _ = reply.send(answer);
                }
                // A full chunk means more may be due: look again at once, after queued data.
                let next = if reclaimed == limit { Ok(Some(now)) } else { store.min_reclaim_at_ms() };
                match next {
                    Ok(next) => self.book.next_reclaim_ms = next,
                    Err(error) => self.record_failure(&error),
                }
            }
            Err(error) => {
                self.book.records_delta = (0, 0);
                self.record_failure(&error);
                let refusal = self.unavailable(&format!("storage failure: {error}"));
                for (reply, _) in outbox {
                    let _ = reply.send(Err(refusal.clone()));
                }
            }
        }
    }

    /// Shutdown: serve what was accepted, answer waiters, close the file.
    fn finish(mut self) {
        loop {
            let requests = self.drain(None);
            if requests.is_empty() {
                break;
            }
            self.apply_batch(requests);
        }
        if let Some(store) = self.store.as_mut() {
            let now = self.guard.read(self.clock.monotonic_ms());
            let mut outbox: Outbox = Vec::new();
            let book = &mut self.book;
            let result = (|| -> Result<(), StoreError> {
                let txn = store.begin()?;
                let scopes: Vec<Scope> = book.queues.keys().cloned().collect();
                for scope in &scopes {
                    book.serve_waiters(&txn, scope, now, true, &mut outbox)?;
                }
                txn.set_meta(Meta { next_token: book.next_token, high_water_ms: now })?;
                txn.commit()
            })();
            match result {
                Ok(()) => {
                    for (reply, answer) in outbox {
                        let _ = reply.send(answer);
                    }
                }
                Err(error) => {
                    for (reply, _) in outbox {
                        let _ = reply.send(Err(self.unavailable(&format!("storage failure: {error}"))));
                    }
                    self.record_failure(&error);
                }
            }
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
}

/// Applies a batch inside one transaction. Answers go to `outbox` (or, for parked
/// reserves, to the waiter queues) and are sent by the caller only after this returns
/// `Ok`, that is, after the commit is durable.
fn apply(
    store: &mut Store,
    book: &mut Book,
    config: &EngineConfig,
    requests: &mut impl Iterator<Item = Request>,
    outbox: &mut Outbox,
    now: u64,
    shard: u32,
) -> Result<(), StoreError> {
    let txn = store.begin()?;
    let mut touched: Vec<Scope> = Vec::new();
    for request in requests.by_ref() {
        let step = txn.get(&request.scope).and_then(|record| {
            let decision = decide(record.as_ref(), &request.command, now, book.next_token);
            book.apply(&txn, &request.scope, record.as_ref(), &decision).map(|()| decision)
        });
        let decision = match step {
            Ok(decision) => decision,
            Err(error) => {
                // Keep the caller's sender: the failure path answers everyone in the outbox.
                let placeholder = Error::Unavailable { shard: 0, reason: String::new() };
                outbox.push((request.reply, Err(placeholder)));
                return Err(error);
            }
        };
        if book.queues.contains_key(&request.scope) && !matches!(decision.change, Change::Keep) {
            touched.push(request.scope.clone());
        }
        if let (
            Command::Reserve(reserve),
            Ok(Reply::Reserve(ReserveReply::InProgress { lease_until_ms, .. })),
        ) = (&request.command, &decision.reply)
            && reserve.wait_ms > 0
        {
            if let Err((reply, error)) =
                park(book, config, &request.scope, reserve, now, *lease_until_ms, request.reply)
            {
                outbox.push((reply, Err(error)));
            }
            continue;
        }
        outbox.push((request.reply, decision.reply.map_err(Error::from)));
    }
    touched.sort();
    touched.dedup();
    for scope in &touched {
        book.serve_waiters(&txn, scope, now, false, outbox)?;
    }
    // `now` came from the guard, so it is the high-water mark to persist.
    txn.set_meta(Meta { next_token: book.next_token, high_water_ms: now })?;
    let started = std::time::Instant::now();
    txn.commit()?;
    metrics::histogram!("oncegate_shard_commit_seconds", "shard" => shard.to_string())
        .record(started.elapsed().as_secs_f64());
    Ok(())
}

/// Parks a reserve behind the key's holder, within the per-key and per-shard bounds; on
/// refusal the reply sender comes back with the error.
fn park(
    book: &mut Book,
    config: &EngineConfig,
    scope: &Scope,
    reserve: &Reserve,
    now: u64,
    lease_until_ms: u64,
    reply: oneshot::Sender<Result<Reply, Error>>,
) -> Result<(), (oneshot::Sender<Result<Reply, Error>>, Error)> {
    if book.waiters_len >= config.waiters_per_shard_max {
        let error = Error::ResourceExhausted {
            what: "the shard's waiter list".to_owned(),
            limit_name: "waiters_per_shard_max",
            limit: config.waiters_per_shard_max,
        };
        return Err((reply, error));
    }
    if book.queues.get(scope).is_some_and(|q| q.waiters.len() >= config.waiters_per_key_max)
        || config.waiters_per_key_max == 0
    {
        let error = Error::ResourceExhausted {
            what: "the key's waiter list".to_owned(),
            limit_name: "waiters_per_key_max",
            limit: config.waiters_per_key_max,
        };
        return Err((reply, error));
    }
    let queue = book
        .queues
        .entry(scope.clone())
        .or_insert_with(|| WaitQueue { waiters: VecDeque::new(), lease_until_ms });
    queue.lease_until_ms = lease_until_ms;
    queue.waiters.push_back(Waiter {
        reserve: reserve.clone(),
        deadline_ms: now.saturating_add(reserve.wait_ms),
        reply,
    });
    book.waiters_len += 1;
    Ok(())
}
