//! The shard actor: one OS thread that alone owns its store (a SQLite file, or a
//! connection to the shared PostgreSQL table; `store/mod.rs` is the boundary).
//!
//! The protocol, in the order the loop runs it:
//!
//! 1. **Control first.** Shutdown, alarm, reopen and a slot move's requests (take a
//!    slot in, drop a slot's rows) arrive on their own channel and are handled before
//!    any data, so an operator can always reach a busy shard. What a finished move hands
//!    the slot's new owner (its parked reserves, then its held requests) comes on a
//!    third channel, read before the mailbox.
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
//!    (`resource_exhausted`) and the batch goes on. A full disk keeps the file open and
//!    refuses writes (reads and replays go on) until a retry finds room. A failed sync
//!    halts the shard until the process restarts (a reopen could read back what the disk
//!    lost). Any other storage error rolls the transaction back, answers `unavailable` to
//!    every request of the batch and every parked waiter, closes the file and marks the
//!    shard failed; it answers `unavailable` at once and retries a clean open with
//!    exponential backoff.
//!
//! Time: the shard's clock guard is anchored once per process (at the engine's start);
//! an in-process reopen keeps that frame, so a wall-clock step never reaches a decision.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, at, never, select};
use oncegate_core::{ClockGuard, Command, Reply, Scope};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::error::Error;
use crate::faults::Faults;
use crate::files::Files;
use crate::placement::manifest;
use crate::placement::slots::Slots;
use crate::quota::Quotas;
use crate::store::{Store, StoreError, sqlite};

mod batch;
mod book;
mod moves;
mod open;
mod state;

use open::Asked;

use book::Book;
pub(crate) use book::Parked;
pub(crate) use moves::{Handover, MoveOut};
pub use state::ShardState;
pub(crate) use state::{Arrival, FrameFloor, Marks, Shared, Start};

/// A data request: one command on one key, and where to send the answer.
pub(crate) struct Request {
    pub scope: Scope,
    pub command: Command,
    pub reply: oneshot::Sender<Result<Reply, Error>>,
    /// The caller's span (disabled unless a subscriber wants it), so the batch that
    /// serves the request can link to it.
    pub span: tracing::Span,
    /// A reserve sent as key parts in a store routed by bucket base (`scope` then names
    /// the base, which every bucket's key routes by): the batch derives its key.
    pub derive: Option<Box<Derive>>,
}

/// What a shard needs to derive a reserve's key from its batch's time.
pub(crate) struct Derive {
    pub derived: oncegate_core::DerivedKey,
    /// Set by the shard, before it answers, to the key that answered.
    pub named: Arc<std::sync::OnceLock<oncegate_core::Key>>,
}

/// What arrives on a shard's data channel, in the order it was sent.
pub(crate) enum Mail {
    /// A caller's request.
    Call(Request),
    /// Hand a moving slot over: it comes behind every request of the slot sent before
    /// the move began, so those are decided here first (`moves.rs`).
    MoveOut(MoveOut),
}

/// What a slot's move hands the slot's owner once it is over (or undone), on a channel of
/// its own that the shard reads before any request on its mailbox: the move's end sends
/// it under the routing table's lock and must not wait there for a mailbox place (a
/// stalled shard would stop every caller's routing), and it must be served before the
/// requests that callers route to the owner after the lock.
pub(crate) enum Moved {
    /// Park the reserves that waited on the slot's keys, ahead of its held requests.
    Adopt(Parked),
    /// The requests the slot held while it moved, in arrival order.
    Held(std::collections::VecDeque<Request>),
}

/// Why an alarm runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Alarm {
    /// Its deadline came: a shared store's poll that finds nothing to do writes nothing.
    Due,
    /// On request (`Engine::run_alarms`): reclaim runs whatever its schedule says.
    Asked,
}

/// Requests that must not wait behind data.
pub(crate) enum Control {
    /// Finish what is queued, answer waiters, close the file, exit.
    Shutdown,
    /// Run the alarm now (tests move a manual clock, then call this instead of sleeping).
    RunAlarms(crossbeam_channel::Sender<()>),
    /// Close and reopen the file now (after an operator fixed a fault).
    Reopen(crossbeam_channel::Sender<Result<bool, Error>>),
    /// Take in a moving slot's records and counters, durably; answer how many records
    /// came. (Its parked reserves follow as `Moved::Adopt` once the move is over.)
    MoveIn(Handover, crossbeam_channel::Sender<Result<u64, Error>>),
    /// Delete the rows of a slot this shard no longer owns (a bounded chunk per alarm).
    DropSlot(Slots),
    /// Delete every row of slots that left now, a chunk per transaction, then answer (an
    /// offline reshard, before its engine closes).
    DropLeft(crossbeam_channel::Sender<()>),
}

/// What every shard of an engine shares, built once when the engine opens; the engine
/// holds it too.
pub(crate) struct Context {
    /// The engine's configuration.
    pub config: EngineConfig,
    /// The clock every decision reads.
    pub clock: Arc<dyn Clock>,
    /// The process's one reading of the wall clock, which every frame is anchored to.
    pub start: Start,
    /// What derived keys need from the shards: the highest persisted mark, how many
    /// shards have not opened yet, and the format a shared store's schema names.
    pub floor: FrameFloor,
    /// The marks of the shards opened with the engine, which lift every frame to one time.
    pub marks: Arc<Marks>,
    /// The fault seam the tests arm (inert otherwise).
    pub faults: Faults,
    /// Each tenant's most records per shard.
    pub quotas: Quotas,
    /// The files seam (the operating system's, or a simulated disk).
    pub files: Arc<dyn Files>,
    /// Which shard owns each slot, as slots move.
    pub slots: crate::placement::slots::LiveMap,
    /// The shared PostgreSQL store, when the records live there instead of in files.
    pub postgres: Option<crate::store::SharedDb>,
}

/// What one shard is made of, handed over by the engine: the engine's context, and the
/// shard's own channels and counters.
pub(crate) struct Parts {
    pub id: u32,
    pub cx: Arc<Context>,
    /// Its place among the shards opening together, whose marks lift one frame.
    pub arrival: Arrival,
    pub shared: Arc<Shared>,
    pub data: Receiver<Mail>,
    pub moved: Receiver<Moved>,
    pub control: Receiver<Control>,
    /// Nudges from callers that stopped waiting.
    pub gone: Receiver<()>,
}

/// Sent once per shard when its first open attempt is over, with the file it could not
/// write if that attempt found the disk full.
pub(crate) type Started = Sender<(u32, Option<std::path::PathBuf>)>;

/// When writes are tried again after the disk filled up.
struct WriteRetry {
    /// When writes are tried again, on the injected clock's monotonic time.
    retry_at_ms: u64,
    /// The pause before that try.
    backoff_ms: u64,
    /// Whether writes are refused now (false: being tried again).
    refusing: bool,
}

/// What a halted shard answers, and what its `last_error` adds: after a failed sync
/// Linux may mark the unwritten pages clean, so a reopen in this process could read a
/// failed commit back as committed and chain acknowledged commits onto writes the disk
/// lost. A new process drops the WAL's cached pages before SQLite reads it.
const HALTED: &str = "the disk may have lost what this process would read back: the shard answers unavailable until the process restarts (restart required)";
/// What a halted shard's callers hear.
const HALTED_SYNC: &str = "a commit failed in its sync, and the disk may have lost what this process would read back: the shard answers unavailable until the process restarts (restart required)";

pub(crate) struct Shard {
    id: u32,
    cx: Arc<Context>,
    path: PathBuf,
    epoch_path: PathBuf,
    arrival: Arrival,
    /// Whether a clean open has completed in this process (the first one anchors the
    /// clock, runs the integrity check and the restart grace).
    opened: bool,
    shared: Arc<Shared>,
    data: Receiver<Mail>,
    moved: Receiver<Moved>,
    control: Receiver<Control>,
    gone: Receiver<()>,
    store: Option<Store>,
    guard: ClockGuard,
    /// The token epoch of the current open (see `token.rs`).
    epoch: u64,
    book: Book,
    /// Rows of slots that moved away; alarms delete them in chunks.
    leaving: Vec<moves::Leaving>,
    /// The rows of the slots this shard last handed over, until the move ends.
    handed: Option<moves::Leaving>,
    /// Slots moved in during this process (their earlier copies may be here).
    received: std::collections::HashSet<u32>,
    backoff_ms: u64,
    reopen_at: Option<Instant>,
    /// A commit's sync failed: the store stays closed until the process restarts.
    halted: bool,
    /// The disk filled up: writes are refused until a retry finds room.
    write_retry: Option<WriteRetry>,
    /// Why the last open failed, when the disk was full: the file it could not write.
    open_found_disk_full: Option<std::path::PathBuf>,
    /// How far the store's time was ahead of the shard's frame at its last transaction
    /// (a PostgreSQL database's clock; 0 for a file), for scheduling alarms in its time.
    store_ahead_ms: i64,
    /// When (in the store's time) the last alarm read every parked reserve's key again:
    /// the next poll is due a poll interval later, however busy the mailbox is.
    polled_at_ms: u64,
}

impl Shard {
    pub fn new(parts: Parts) -> Shard {
        let Parts { id, cx, arrival, shared, data, moved, control, gone } = parts;
        Shard {
            id,
            path: manifest::shard_file(&cx.config.data_dir, id),
            epoch_path: manifest::epoch_file(&cx.config.data_dir, id),
            backoff_ms: cx.config.reopen_backoff_ms_min,
            book: Book::new(id, cx.quotas.clone()),
            cx,
            arrival,
            opened: false,
            shared,
            data,
            moved,
            control,
            gone,
            store: None,
            guard: ClockGuard::new(0),
            epoch: 0,
            leaving: Vec::new(),
            handed: None,
            received: std::collections::HashSet::new(),
            reopen_at: None,
            halted: false,
            write_retry: None,
            open_found_disk_full: None,
            store_ahead_ms: 0,
            polled_at_ms: 0,
        }
    }

    fn unavailable(&self, reason: &str) -> Error {
        Error::Unavailable { shard: self.id, reason: reason.to_owned() }
    }

    /// Why the shard has no store: it failed and reopens with backoff, or it halted.
    fn closed_reason(&self) -> &'static str {
        if self.halted { HALTED_SYNC } else { "the shard failed and is reopening" }
    }

    /// Closes the store after `error`. A failed sync halts the shard until the process
    /// restarts; any other failure schedules a reopen with backoff. A full disk is the
    /// exception: the open store stays open and refuses writes until a retry finds room.
    fn record_failure(&mut self, error: &StoreError) {
        if error.is_disk_full() && self.store.is_some() {
            return self.refuse_writes(error);
        }
        self.store = None;
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        if error.is_failed_sync() {
            tracing::error!(shard = self.id, %error, "{HALTED}");
            self.halted = true;
            self.reopen_at = None;
            self.shared.set_last_error(format!("{error}; {HALTED}"));
        } else {
            tracing::error!(shard = self.id, %error, "storage failure; answering unavailable until a clean reopen");
            self.reopen_at = Some(Instant::now() + Duration::from_millis(self.backoff_ms));
            self.backoff_ms = (self.backoff_ms * 2).min(self.cx.config.reopen_backoff_ms_max);
            self.shared.set_last_error(error.to_string());
        }
        // Fail closed: nobody parked on this shard may be granted by a later open.
        let refusal = self.unavailable(&format!("storage failure: {error}"));
        for reply in self.book.drain_waiters() {
            let _ = reply.send(Err(refusal.clone()));
        }
        self.shared.waiters.store(0, Ordering::Relaxed);
        self.shared.set_state(if self.halted { ShardState::Halted } else { ShardState::Failed });
    }

    /// The disk is full: writes are refused (alone, each answered `resource_exhausted`
    /// naming the disk) while reads and replays go on, and tried again after a pause that
    /// doubles from `reopen_backoff_ms_min` to `_max` while the disk stays full.
    fn refuse_writes(&mut self, error: &StoreError) {
        let backoff_ms = self.write_retry.as_ref().map_or(self.cx.config.reopen_backoff_ms_min, |retry| {
            (retry.backoff_ms * 2).min(self.cx.config.reopen_backoff_ms_max)
        });
        if self.write_retry.as_ref().is_none_or(|retry| !retry.refusing) {
            tracing::warn!(shard = self.id, path = %self.path.display(), %error, retry_ms = backoff_ms, "the disk is full: writes are refused, reads and replays go on");
        }
        let retry_at_ms = self.cx.clock.monotonic_ms() + backoff_ms;
        self.write_retry = Some(WriteRetry { retry_at_ms, backoff_ms, refusing: true });
        if let Some(own) = self.store.as_mut().and_then(Store::own_mut) {
            own.refuse_writes(true);
        }
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        self.shared.set_last_error(format!("{}", book::disk_full(self.id, &self.path)));
    }

    /// Takes writes again once the pause after a full disk is over (the next write
    /// finds out whether it has room).
    fn retry_writes_when_due(&mut self) {
        if let Some(retry) = self.write_retry.as_mut()
            && retry.refusing
            && retry.retry_at_ms <= self.cx.clock.monotonic_ms()
        {
            retry.refusing = false;
            if let Some(own) = self.store.as_mut().and_then(Store::own_mut) {
                own.refuse_writes(false);
            }
        }
    }

    /// A write committed after the disk was full: it has room again.
    fn writes_resumed(&mut self) {
        if self.write_retry.take().is_some() {
            tracing::info!(shard = self.id, "the disk has room again: writes resume");
        }
    }

    /// What a write refused alone hears: the disk is full, or the file at its limit.
    fn write_refusal(&self) -> Error {
        if self.store.as_ref().and_then(Store::own).is_some_and(sqlite::Store::writes_refused) {
            book::disk_full(self.id, &self.path)
        } else {
            book::file_full(self.id, &self.cx.config)
        }
    }

    /// The actor's loop; returns when shut down or when the engine is dropped. `started`
    /// is taken (and sent on) once the first open attempt is over.
    pub fn run(mut self, started: &mut Option<Started>) {
        self.open(Asked::ByShard);
        if let Some(started) = started.take() {
            let _ = started.send((self.id, self.open_found_disk_full.take()));
        }
        loop {
            while let Ok(control) = self.control.try_recv() {
                if self.handle_control(control) {
                    return self.finish();
                }
            }
            let alarm = self.next_alarm();
            if alarm.is_some_and(|a| a <= Instant::now()) {
                self.alarm(Alarm::Due);
                continue;
            }
            // Deleting a moved slot's rows is background work: it takes turns with the
            // mailbox (select picks at random among ready operations) instead of going
            // first, so a large slot never stalls the shard's traffic.
            let refusing =
                self.store.as_ref().and_then(Store::own).is_some_and(sqlite::Store::writes_refused);
            let timer = if self.store.is_some() && !self.leaving.is_empty() && !refusing {
                at(Instant::now())
            } else {
                alarm.map_or_else(never, at)
            };
            select! {
                recv(self.control) -> control => match control {
                    Ok(control) => if self.handle_control(control) { return self.finish() },
                    Err(_) => return self.finish(),
                },
                recv(self.moved) -> moved => match moved {
                    Ok(moved) => self.take_moved(moved),
                    Err(_) => return self.finish(),
                },
                recv(self.data) -> request => match request {
                    Ok(request) => self.batch(request),
                    Err(_) => return self.finish(),
                },
                recv(self.gone) -> _ => self.forget_gone(),
                recv(timer) -> _ => self.alarm(Alarm::Due),
            }
        }
    }

    /// Handles one control message; returns whether to stop.
    fn handle_control(&mut self, control: Control) -> bool {
        match control {
            Control::Shutdown => true,
            Control::RunAlarms(done) => {
                self.alarm(Alarm::Asked);
                let _ = done.send(());
                false
            }
            Control::Reopen(done) if self.halted => {
                let _ = done.send(Err(self.unavailable(HALTED_SYNC)));
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
                let ok = self.open(Asked::ByOperator);
                let _ = done.send(Ok(ok));
                false
            }
            Control::MoveIn(handover, done) => {
                let _ = done.send(self.move_in(handover));
                false
            }
            Control::DropSlot(slots) => {
                self.leave(slots);
                false
            }
            Control::DropLeft(done) => {
                self.drop_left();
                let _ = done.send(());
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
        let Some(store) = self.store.as_ref() else {
            return self.reopen_at;
        };
        let mut guard = self.guard;
        let now_ms = guard.read(self.cx.clock.monotonic_ms()).saturating_add_signed(self.store_ahead_ms);
        // A shared store's waiters are read again at its poll interval: another node may
        // have committed or released their key.
        let poll_ms =
            store.waiters_poll_ms().filter(|_| self.book.waiters_len > 0).map(|p| self.polled_at_ms + p);
        // While writes are refused reclaim deletes nothing: it waits for the next try.
        let reclaim_ms = match self.write_retry.as_ref().filter(|retry| retry.refusing) {
            Some(retry) => {
                let retry_in_ms = retry.retry_at_ms.saturating_sub(self.cx.clock.monotonic_ms());
                self.book.next_reclaim_ms.map(|at| at.max(now_ms + retry_in_ms))
            }
            None => self.book.next_reclaim_ms,
        };
        let deadline_ms = [reclaim_ms, self.book.waiters_alarm_ms(), poll_ms].into_iter().flatten().min()?;
        Some(Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms)))
    }

    fn batch(&mut self, first: Mail) {
        let (requests, after) = self.drain(Some(first));
        // What a move handed over goes before these requests. It is read after them: a
        // request routed here after a move's end was sent after the move's message, so
        // the message is on its channel by the time the request has been drained.
        self.serve_moved();
        if !requests.is_empty() {
            self.serve_batch(requests);
        }
        if let Some(Mail::MoveOut(move_out)) = after {
            self.move_out(move_out);
        }
    }

    /// Everything moves have handed this shard so far, in the order it was sent.
    fn serve_moved(&mut self) {
        while let Ok(moved) = self.moved.try_recv() {
            self.take_moved(moved);
        }
    }

    fn take_moved(&mut self, moved: Moved) {
        match moved {
            Moved::Adopt(parked) => self.adopt(parked),
            Moved::Held(held) => self.serve_held(held),
        }
    }

    /// A moving slot's held requests, in order, in batches of at most `batch_len_max`.
    fn serve_held(&mut self, mut held: std::collections::VecDeque<Request>) {
        while !held.is_empty() {
            let batch: Vec<Request> = held.drain(..held.len().min(self.cx.config.batch_len_max)).collect();
            self.serve_batch(batch);
        }
    }

    /// Takes what the mailbox holds now, after `first`, up to `batch_len_max` requests in
    /// all, stopping at a slot's hand-over (handled after the requests before it, and
    /// before those after it).
    fn drain(&self, first: Option<Mail>) -> (Vec<Request>, Option<Mail>) {
        let mut requests = Vec::with_capacity(self.cx.config.batch_len_max.min(64));
        let mut next = first;
        loop {
            match next {
                Some(Mail::Call(request)) => requests.push(request),
                Some(mail) => return (requests, Some(mail)),
                None => return (requests, None),
            }
            if requests.len() >= self.cx.config.batch_len_max {
                return (requests, None);
            }
            next = self.data.try_recv().ok();
        }
    }
}
