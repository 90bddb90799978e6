//! The shard actor: one OS thread that alone owns one SQLite file.
//!
//! The protocol, in the order the loop runs it:
//!
//! 1. **Control first.** Shutdown, alarm and reopen requests arrive on their own channel
//!    and are handled before any data, so an operator can always reach a busy shard.
//! 2. **Batch.** The actor drains up to `batch_len_max` requests from its bounded
//!    mailbox, decides each with the core (later ones see earlier ones' effects because
//!    each reads inside the same transaction), writes the token counter and the clock
//!    high-water mark, commits, and only then replies to every request of the batch. A
//!    batch of reads only takes no write transaction and no fsync.
//! 3. **Alarm.** Between batches, the actor sleeps on the mailbox until its next deadline:
//!    the earliest reclaimable record, a waited key's lease end, a waiter's deadline, or
//!    a reopen attempt. An alarm serves waiters and reclaims at most `reclaim_batch_max`
//!    records, in one transaction.
//! 4. **Gone callers.** A caller that stops waiting (its future dropped) nudges the
//!    shard, which drops its parked reserve at once; a request whose caller has gone is
//!    never granted and never parked.
//! 5. **Failure.** A write that does not fit in the file is refused alone
//!    (`resource_exhausted`) and the batch goes on. Any other storage error rolls the
//!    transaction back, answers `unavailable` to every request of the batch and every
//!    parked waiter, closes the file and marks the shard failed. A failed shard answers
//!    `unavailable` at once and retries a clean open with exponential backoff.
//!
//! Time: the shard's clock guard is anchored once per process (at the engine's start);
//! an in-process reopen keeps that frame, so a wall-clock step never reaches a decision.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, at, never, select};
use oncegate_core::{ClockGuard, Command, Reply, ReserveReply, Scope, decide};
use tokio::sync::oneshot;

use crate::book::{Book, Outbox, file_full};
use crate::files::Files;
use crate::quota::Quotas;
use crate::store::{Meta, Store, StoreError, Tuning, Txn};
use crate::{Clock, EngineConfig, Error, Faults, manifest, token};

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
#[repr(u8)]
pub enum ShardState {
    /// Opening its file for the first time.
    Starting,
    /// Serving requests.
    Serving,
    /// A storage error closed the file; answering `unavailable` and retrying an open.
    Failed,
    /// Shut down.
    Stopped,
    /// The shard's thread panicked (a bug): it answers `unavailable` until the process
    /// restarts.
    Panicked,
}

impl ShardState {
    const ALL: [ShardState; 5] = [
        ShardState::Starting,
        ShardState::Serving,
        ShardState::Failed,
        ShardState::Stopped,
        ShardState::Panicked,
    ];

    /// The inverse of `state as u8`: `ALL` lists the states in declaration order.
    fn from_u8(v: u8) -> ShardState {
        ShardState::ALL.get(usize::from(v)).copied().unwrap_or(ShardState::Stopped)
    }

    /// The lowercase name used in logs and status output.
    pub fn as_str(self) -> &'static str {
        match self {
            ShardState::Starting => "starting",
            ShardState::Serving => "serving",
            ShardState::Failed => "failed",
            ShardState::Stopped => "stopped",
            ShardState::Panicked => "panicked",
        }
    }
}

/// Counters the actor publishes for `Engine::stats` without being asked.
#[derive(Default)]
pub(crate) struct Shared {
    /// The state for cheap reads; `lock` and `changed` let others wait for a change of
    /// the state or of any counter.
    state: AtomicU8,
    lock: Mutex<()>,
    changed: Condvar,
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

    pub fn set_state(&self, state: ShardState) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.state.store(state as u8, Ordering::Release);
        self.changed.notify_all();
    }

    /// Wakes whoever waits in [`Shared::wait_until`]: counters changed.
    pub fn publish(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.changed.notify_all();
    }

    /// Blocks until `done` holds (checked at each state change or publication) or
    /// `timeout` passes; returns whether it held.
    pub fn wait_until(&self, timeout: Duration, done: impl Fn(&Shared) -> bool) -> bool {
        let guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let (_guard, result) = self
            .changed
            .wait_timeout_while(guard, timeout, |_| !done(self))
            .unwrap_or_else(|p| p.into_inner());
        !result.timed_out()
    }

    pub fn set_last_error(&self, error: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }
}

/// What derived keys need from the shards: the greatest persisted high-water mark, and
/// how many shards have not opened yet in this process (until all have, the mark is not
/// known and derived keys are refused rather than bucketed by a clock that may be behind).
#[derive(Debug, Default)]
pub(crate) struct FrameFloor {
    pub high_water_ms: AtomicU64,
    pub unopened: std::sync::atomic::AtomicU32,
}

/// The engine's start: the one wall-clock reading every shard anchors its frame to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Start {
    pub wall_ms: u64,
    pub monotonic_ms: u64,
}

/// What a shard is made of, handed over by the engine.
pub(crate) struct Parts {
    pub id: u32,
    pub config: Arc<EngineConfig>,
    pub clock: Arc<dyn Clock>,
    pub start: Start,
    pub floor: Arc<FrameFloor>,
    pub faults: Faults,
    pub shared: Arc<Shared>,
    pub data: Receiver<Request>,
    pub control: Receiver<Control>,
    /// Nudges from callers that stopped waiting.
    pub gone: Receiver<()>,
    /// Each tenant's most records per shard.
    pub quotas: Quotas,
    /// The files seam (the operating system's, or a simulated disk).
    pub files: Arc<dyn Files>,
}

/// Sent once per shard when its first open attempt is over.
pub(crate) type Started = Sender<u32>;

pub(crate) struct Shard {
    id: u32,
    config: Arc<EngineConfig>,
    path: PathBuf,
    epoch_path: PathBuf,
    clock: Arc<dyn Clock>,
    start: Start,
    floor: Arc<FrameFloor>,
    /// Whether a clean open has completed in this process (the first one anchors the
    /// clock, runs the integrity check and the restart grace).
    opened: bool,
    faults: Faults,
    shared: Arc<Shared>,
    data: Receiver<Request>,
    control: Receiver<Control>,
    gone: Receiver<()>,
    store: Option<Store>,
    guard: ClockGuard,
    /// The token epoch of the current open (see `token.rs`).
    epoch: u64,
    book: Book,
    files: Arc<dyn Files>,
    backoff_ms: u64,
    reopen_at: Option<Instant>,
}

impl Shard {
    pub fn new(parts: Parts) -> Shard {
        let Parts { id, config, clock, start, floor, faults, shared, data, control, gone, quotas, files } =
            parts;
        Shard {
            id,
            path: manifest::shard_file(&config.data_dir, id),
            epoch_path: manifest::epoch_file(&config.data_dir, id),
            backoff_ms: config.reopen_backoff_ms_min,
            config,
            clock,
            start,
            floor,
            opened: false,
            faults,
            shared,
            data,
            control,
            gone,
            store: None,
            guard: ClockGuard::new(0),
            epoch: 0,
            book: Book::new(id, quotas),
            files,
            reopen_at: None,
        }
    }

    fn unavailable(&self, reason: &str) -> Error {
        Error::Unavailable { shard: self.id, reason: reason.to_owned() }
    }

    /// Opens the file cleanly: integrity check (at process start only), token epoch,
    /// counters, restart grace. On failure the shard stays failed and schedules the next
    /// attempt.
    fn open(&mut self) -> bool {
        match self.try_open() {
            Ok(store) => {
                self.store = Some(store);
                if !self.opened {
                    self.opened = true;
                    self.floor.high_water_ms.fetch_max(self.guard.high_water_ms(), Ordering::SeqCst);
                    self.floor.unopened.fetch_sub(1, Ordering::SeqCst);
                }
                self.backoff_ms = self.config.reopen_backoff_ms_min;
                self.reopen_at = None;
                self.shared.set_state(ShardState::Serving);
                tracing::info!(shard = self.id, path = %self.path.display(), epoch = self.epoch, "shard serving");
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
            files: Arc::clone(&self.files),
        };
        // Only the first open of the process checks the file and re-anchors the clock;
        // an in-process reopen keeps the frame, so a wall-clock step cannot age records.
        let process_start = !self.opened;
        let (mut store, meta, created) = Store::open(&self.path, &tuning, &self.faults, process_start)?;
        let stored_epoch =
            manifest::read_epoch(&*self.files, &self.epoch_path).map_err(|e| self.epoch_error(e))?;
        let epoch = token::epoch_at_open(stored_epoch, meta.next_token, created);
        if epoch > token::EPOCH_MAX {
            return Err(StoreError::Corrupt(format!(
                "token epoch {epoch} is past the last one ({}); tokens would no longer increase",
                token::EPOCH_MAX
            )));
        }
        // Durable before the first grant of this open, so no later open can reuse it.
        self.write_epoch(epoch)?;
        let now = if process_start { self.anchor(meta.high_water_ms) } else { self.keep_frame(meta) };
        let txn = store.begin()?;
        if process_start {
            self.restart_grace(&txn, meta.high_water_ms, now)?;
        }
        let next_token = meta.next_token.max(token::first_of(epoch));
        txn.set_meta(Meta { next_token, high_water_ms: now })?;
        txn.commit()?;
        self.epoch = epoch;
        self.book.next_token = next_token;
        self.book.next_reclaim_ms = store.min_reclaim_at_ms()?;
        self.book.reset_records(store.count()?);
        self.book.settle(&self.shared);
        Ok(store)
    }

    /// The process's first open: anchors the frame at the engine's start, lifted to the
    /// persisted mark, and says how far the wall clock moved while the shard was down.
    fn anchor(&mut self, high_water_ms: u64) -> u64 {
        self.guard = ClockGuard::new(high_water_ms.max(self.guard.high_water_ms()));
        self.guard.anchor(self.start.wall_ms, self.start.monotonic_ms);
        if high_water_ms > 0 && self.start.wall_ms > high_water_ms {
            tracing::info!(
                shard = self.id,
                forward_ms = self.start.wall_ms - high_water_ms,
                "the wall clock is past the persisted high-water mark (downtime, or a step while stopped); records and leases aged by that much"
            );
        } else if self.start.wall_ms < high_water_ms {
            tracing::warn!(
                shard = self.id,
                behind_ms = high_water_ms - self.start.wall_ms,
                "the wall clock is behind the persisted high-water mark; time continues from the mark"
            );
        }
        self.guard.read(self.clock.monotonic_ms())
    }

    /// An in-process reopen: the frame stays; only a higher persisted mark lifts it.
    fn keep_frame(&mut self, meta: Meta) -> u64 {
        self.guard.raise(meta.high_water_ms);
        self.guard.read(self.clock.monotonic_ms())
    }

    /// After a process restart every lease that was live at the stop runs at least
    /// `lease_restart_grace_ms` more, so a holder that was working is not overtaken by
    /// the downtime.
    fn restart_grace(&self, txn: &Txn<'_>, high_water_ms: u64, now: u64) -> Result<(), StoreError> {
        let mut extended = 0usize;
        for (scope, mut record) in txn.pending_leased_after(high_water_ms)? {
            if record.apply_restart_grace(high_water_ms, now, self.config.lease_restart_grace_ms) {
                txn.put(&scope, &record)?;
                extended += 1;
            }
        }
        if extended > 0 {
            tracing::info!(shard = self.id, leases = extended, "restart grace extended live leases");
        }
        Ok(())
    }

    fn epoch_error(&self, source: std::io::Error) -> StoreError {
        StoreError::Io { path: self.epoch_path.clone(), source }
    }

    fn write_epoch(&self, epoch: u64) -> Result<(), StoreError> {
        manifest::write_epoch(&*self.files, &self.epoch_path, epoch).map_err(|e| self.epoch_error(e))
    }

    /// Moves to a new token epoch when the current one could run out within one batch
    /// and one round of waiters: the new epoch is durable before any token of it is used.
    /// A failure to write it fails the shard like any I/O error.
    fn ensure_token_room(&mut self) {
        let room = (self.config.batch_len_max + self.config.waiters_per_shard_max + 1) as u64;
        if self.store.is_none() || !token::needs_new_epoch(self.book.next_token, room) {
            return;
        }
        let epoch = self.epoch + 1;
        if let Err(error) = self.write_epoch(epoch) {
            return self.record_failure(&error);
        }
        self.epoch = epoch;
        self.book.next_token = token::first_of(epoch);
        tracing::info!(shard = self.id, epoch, "token counter moved to a new epoch");
    }

    fn record_failure(&mut self, error: &StoreError) {
        tracing::error!(shard = self.id, %error, "storage failure; answering unavailable until a clean reopen");
        self.store = None;
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        self.shared.set_last_error(error.to_string());
        // Fail closed: nobody parked on this shard may be granted by a later open.
        let refusal = self.unavailable(&format!("storage failure: {error}"));
        for reply in self.book.drain_waiters() {
            let _ = reply.send(Err(refusal.clone()));
        }
        self.shared.waiters.store(0, Ordering::Relaxed);
        self.reopen_at = Some(Instant::now() + Duration::from_millis(self.backoff_ms));
        self.backoff_ms = (self.backoff_ms * 2).min(self.config.reopen_backoff_ms_max);
        self.shared.set_state(ShardState::Failed);
    }

    /// The actor's loop; returns when shut down or when the engine is dropped. `started`
    /// is taken (and sent on) once the first open attempt is over.
    pub fn run(mut self, started: &mut Option<Started>) {
        self.open();
        if let Some(started) = started.take() {
            let _ = started.send(self.id);
        }
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
                recv(self.gone) -> _ => self.forget_gone(),
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
                // Parked reserves were decided against the file being closed: they hear
                // `unavailable` and retry against the reopened one.
                let refusal = self.unavailable("the shard was reopened by an operator");
                for reply in self.book.drain_waiters() {
                    let _ = reply.send(Err(refusal.clone()));
                }
                self.shared.waiters.store(0, Ordering::Relaxed);
                self.store = None;
                let ok = self.open();
                let _ = done.send(ok);
                false
            }
        }
    }

    /// Callers went away: their parked reserves stop waiting and stop counting.
    fn forget_gone(&mut self) {
        let dropped = self.book.forget_gone();
        if dropped > 0 {
            tracing::debug!(shard = self.id, dropped, "dropped waiters whose caller has gone");
        }
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        self.shared.publish();
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
        self.ensure_token_room();
        let Some(store) = self.store.as_mut() else {
            let error = self.unavailable("the shard failed and is reopening");
            for request in requests {
                let _ = request.reply.send(Err(error.clone()));
            }
            return;
        };
        self.faults.pass_gate();
        self.faults.maybe_panic();
        let batch_span = tracing::debug_span!("batch", shard = self.id, len);
        for request in &requests {
            batch_span.follows_from(&request.span);
        }
        let _entered = batch_span.enter();
        let now = self.guard.read(self.clock.monotonic_ms());
        let token_before = self.book.next_token;
        let mut outbox: Outbox = Vec::with_capacity(requests.len());
        let mut batch =
            Batch { book: &mut self.book, config: &self.config, shard: self.id, now, outbox: &mut outbox };
        let result = batch.apply(store, requests);
        metrics::histogram!("oncegate_shard_batch_len", "shard" => self.id.to_string()).record(len as f64);
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        self.shared.commands.fetch_add(len, Ordering::Relaxed);
        // Counters are published before the answers, so a caller that got its answer
        // sees stats that include its request.
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        match result {
            Ok(wrote) => {
                self.book.settle(&self.shared);
                if wrote {
                    self.shared.commits.fetch_add(1, Ordering::Relaxed);
                }
                self.shared.publish();
                for (reply, answer) in outbox {
                    let _ = reply.send(answer);
                }
            }
            Err(error) => {
                // Nothing of this batch is durable: the counter goes back, and every
                // caller hears `unavailable`, never an acknowledgement.
                self.book.next_token = token_before;
                self.book.discard_delta();
                self.record_failure(&error);
                let refusal = self.unavailable(&format!("storage failure: {error}"));
                for (reply, _) in outbox {
                    let _ = reply.send(Err(refusal.clone()));
                }
            }
        }
    }

    fn alarm(&mut self) {
        self.ensure_token_room();
        let Some(store) = self.store.as_mut() else {
            if self.reopen_at.is_some_and(|at| at <= Instant::now()) {
                self.open();
            }
            return;
        };
        let now = self.guard.read(self.clock.monotonic_ms());
        let limit = self.config.reclaim_batch_max;
        let full = file_full(self.id, &self.config);
        let mut outbox: Outbox = Vec::new();
        let book = &mut self.book;
        let result = (|| -> Result<usize, StoreError> {
            let txn = store.begin()?;
            for scope in &book.due(now) {
                book.serve_waiters(&txn, scope, now, false, &full, &mut outbox)?;
            }
            let removed = txn.reclaim(now, limit)?;
            book.records_delta.remove(&removed);
            txn.set_meta(Meta { next_token: book.next_token, high_water_ms: now })?;
            txn.commit()?;
            Ok((removed.pending + removed.completed) as usize)
        })();
        match result {
            Ok(reclaimed) => {
                self.book.settle(&self.shared);
                self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
                self.shared.reclaimed.fetch_add(reclaimed as u64, Ordering::Relaxed);
                self.shared.alarms.fetch_add(1, Ordering::Relaxed);
                self.shared.commits.fetch_add(1, Ordering::Relaxed);
                self.shared.publish();
                // The transaction committed: these answers are true whatever happens next.
                for (reply, answer) in outbox {
                    let _ = reply.send(answer);
                }
                // A full chunk means more may be due: look again at once. The loop runs due
                // alarms before reading the mailbox, so a backlog is reclaimed ahead of
                // queued data (one chunk per tick).
                let next = if reclaimed == limit { Ok(Some(now)) } else { store.min_reclaim_at_ms() };
                match next {
                    Ok(next) => self.book.next_reclaim_ms = next,
                    Err(error) => self.record_failure(&error),
                }
            }
            Err(error) => {
                self.book.discard_delta();
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
            let full = file_full(self.id, &self.config);
            let mut outbox: Outbox = Vec::new();
            let book = &mut self.book;
            let result = (|| -> Result<(), StoreError> {
                let txn = store.begin()?;
                for scope in &book.waited_keys() {
                    book.serve_waiters(&txn, scope, now, true, &full, &mut outbox)?;
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

/// One batch being applied: the book it changes and where its answers go. Answers go to
/// `outbox` (or, for parked reserves, to the waiter queues) and are sent by the shard
/// only after `apply` returns `Ok`, that is, after the commit is durable.
struct Batch<'a> {
    book: &'a mut Book,
    config: &'a EngineConfig,
    shard: u32,
    now: u64,
    outbox: &'a mut Outbox,
}

impl Batch<'_> {
    /// Applies the requests inside one transaction: a write transaction committed with
    /// the counters, or, when every request only reads, a read transaction that writes
    /// and syncs nothing. Returns whether it wrote.
    fn apply(&mut self, store: &mut Store, requests: Vec<Request>) -> Result<bool, StoreError> {
        let writes = requests.iter().any(|r| !r.command.is_read_only());
        let txn = if writes { store.begin()? } else { store.begin_read()? };
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
        let full = file_full(self.shard, self.config);
        for scope in &touched {
            self.book.serve_waiters(&txn, scope, self.now, false, &full, self.outbox)?;
        }
        // `now` came from the guard, so it is the high-water mark to persist.
        txn.set_meta(Meta { next_token: self.book.next_token, high_water_ms: self.now })?;
        if txn.acks_early() {
            // The deliberate bug the power-loss harness must catch: answers before COMMIT.
            for (reply, answer) in self.outbox.drain(..) {
                let _ = reply.send(answer);
            }
        }
        let started = Instant::now();
        txn.commit()?;
        metrics::histogram!("oncegate_shard_commit_seconds", "shard" => self.shard.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(true)
    }

    /// Decides one request. A reserve or read whose caller has gone is skipped: never
    /// granted, never parked. A write that does not fit is refused alone.
    fn step(&mut self, txn: &Txn<'_>, request: Request, touched: &mut Vec<Scope>) -> Result<(), StoreError> {
        let Request { scope, command, reply, .. } = request;
        if reply.is_closed() && matches!(command, Command::Reserve(_) | Command::Get | Command::Inspect) {
            return Ok(());
        }
        let book = &mut *self.book;
        let step = txn.get(&scope).and_then(|record| {
            let decision = decide(record.as_ref(), &command, self.now, book.next_token);
            if let Some(refusal) = book.quota_refusal(&scope, record.as_ref(), &decision) {
                return Ok(Err(refusal));
            }
            book.apply(txn, &scope, record.as_ref(), &decision).map(|()| Ok(decision))
        });
        let decision = match step {
            Ok(Ok(decision)) => decision,
            Ok(Err(refusal)) => {
                self.outbox.push((reply, Err(refusal)));
                return Ok(());
            }
            Err(error) if txn.failed_alone(&error) => {
                self.outbox.push((reply, Err(file_full(self.shard, self.config))));
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
}
