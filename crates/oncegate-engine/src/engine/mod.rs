//! The embedded engine: routes each call to its key's shard and waits for the answer.
//!
//! - `open.rs` opens a data directory and starts the shards;
//! - `calls.rs` turns the API's requests into commands on the right shard;
//! - `pending.rs` is an answer on its way back, typed by its command;
//! - `routes.rs` is the routing table (slot map, shards, the slot moving now);
//! - `resize.rs` adds shards and moves slots to them, online or on a stopped directory;
//! - `backup.rs` copies a serving node's shards; `gate.rs` binds a tenant.

mod backup;
mod calls;
mod error;
mod gate;
mod open;
mod pending;
mod resize;
mod routes;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use oncegate_core::{ClockGuard, Limits, Scope, Tenant};

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::error::Error;
use crate::files;
use crate::placement::slots;
use crate::shard::{self, Context, Control, Mail, ShardState, Shared};

pub use backup::BackedUp;
pub use error::{BackupError, OpenError, ResizeError};
pub use gate::TenantGate;
pub use resize::{Pauses, Progress, Resharded, add_shards, add_shards_on};

/// One shard's counters, as `Engine::stats` reports them.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardStats {
    /// The shard number.
    pub shard: u32,
    /// Slots the slot map gives this shard.
    pub slots: u32,
    /// Starting, serving, failed, stopped, panicked or halted.
    pub state: ShardState,
    /// Requests waiting in the mailbox now.
    pub mailbox_depth: usize,
    /// Batches applied (committed or failed).
    pub batches: u64,
    /// Commands in those batches.
    pub commands: u64,
    /// `commands / batches`: how much each fsync carried.
    pub batch_len_mean: f64,
    /// Transactions committed (batches and alarms).
    pub commits: u64,
    /// Storage failures since start.
    pub failures: u64,
    /// Expired records deleted by alarms.
    pub reclaimed: u64,
    /// Alarm ticks run (each reclaims at most `reclaim_batch_max` records).
    pub alarms: u64,
    /// WAL checkpoints of the shard file (none on PostgreSQL).
    pub checkpoints: u64,
    /// Reserves parked now.
    pub waiters: u64,
    /// Stored pending records (expired ones not yet reclaimed included).
    pub records_pending: u64,
    /// Stored completed records (expired ones not yet reclaimed included).
    pub records_completed: u64,
    /// The bytes of the shard file's pages in use, read at most a second of the shard's
    /// time before its last write batch (0 on PostgreSQL): beside
    /// `shard_file_bytes_max`, how full the file is.
    pub file_bytes: u64,
    /// How far the shard's time runs ahead of the wall clock, in ms (negative: behind),
    /// as of its last batch: far ahead, the clock guard holds time from going back.
    pub clock_ahead_ms: i64,
    /// The last storage error, if any.
    pub last_error: Option<String>,
}

struct ShardHandle {
    data: Sender<Mail>,
    /// What a slot's move hands its owner at its end (unbounded: sent under the routing
    /// table's lock, which must never wait for a shard).
    moved: Sender<shard::Moved>,
    control: Sender<Control>,
    /// Callers that stop waiting nudge the shard here (capacity 1: nudges coalesce).
    gone: Sender<()>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Inner {
    /// What the engine and every shard share (configuration, clock, files, slot map,
    /// quotas, the clock marks).
    cx: Arc<Context>,
    /// The shards and the slot map that routes to them (`routes.rs`).
    table: RwLock<routes::Table>,
    closing: AtomicBool,
    /// The time frame for deriving keys in directories routed by whole keys (bucket
    /// routing derives in the shard's transaction), anchored like the shards' (wall clock
    /// at open, then monotonic time), so a clock step cannot move a derived key into
    /// another bucket.
    frame: Mutex<ClockGuard>,
    /// Held while shards are added or a backup runs: the slot map changes under neither.
    growing: Mutex<()>,
    /// Held for the engine's life: one process owns a data directory.
    _lock: files::LockGuard,
}

/// The embedded engine: routes each call to its key's shard and waits for the answer.
///
/// Cloning is cheap and shares the same shards. The shards stop when `shutdown` is called
/// or when the last clone is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Sets each tenant's most stored records per shard (replacing any earlier table); a
    /// tenant not in `table` has no quota. A reserve that would store a record for a new
    /// key of a tenant at its quota on the key's shard is refused `resource_exhausted`
    /// (`tenants[].records_per_shard_max`); the tenant's existing keys are served as
    /// before, and reclaiming its expired records makes room again.
    pub fn set_records_per_shard_max(&self, table: std::collections::HashMap<Tenant, u64>) {
        self.inner.cx.quotas.set(table);
    }

    /// The clock every decision reads; fronts that keep time of their own (rate limits)
    /// read it too, so that tests drive them with the same manual clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.inner.cx.clock
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cx.config
    }

    /// The request limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.cx.config.limits
    }

    /// The shard that owns a scope: the slot map's owner of the scope's slot.
    pub fn shard_of(&self, scope: &Scope) -> u32 {
        self.inner.table().map.owner(self.inner.cx.slots.routing.slot_of(scope))
    }

    /// Each shard's state, cheaply (no message to the shard): for health checks.
    pub fn shard_states(&self) -> Vec<ShardState> {
        self.inner.table().shards.iter().map(|s| s.shared.state()).collect()
    }

    /// Waits until a shard reaches `state` or `timeout` passes; returns whether it did.
    /// Operators and tests use it to wait for recovery without polling.
    pub fn wait_shard_state(&self, shard: u32, state: ShardState, timeout: std::time::Duration) -> bool {
        match self.inner.handle(shard) {
            Some(handle) => handle.shared.wait_until(timeout, |shared| shared.state() == state),
            None => false,
        }
    }

    /// Each shard's counters.
    pub fn stats(&self) -> Vec<ShardStats> {
        let table = self.inner.table();
        let slots = table.map.slots_per_shard(table.shards.len() as u32);
        table.shards.iter().enumerate().map(|(id, s)| s.stats(id as u32, slots[id])).collect()
    }

    /// The slots moving now, if an add-shards is under way.
    pub fn slot_moving(&self) -> Option<slots::SlotMove> {
        self.inner.table().moving.as_ref().map(|moving| moving.step.clone())
    }

    /// Waits until one shard's counters satisfy `done` (checked whenever the shard
    /// publishes them) or `timeout` passes; returns whether they did. Tests and operators
    /// use it to wait for an effect without polling or sleeping.
    pub fn wait_stats(
        &self,
        shard: u32,
        timeout: std::time::Duration,
        done: impl Fn(&ShardStats) -> bool,
    ) -> bool {
        let Some(handle) = self.inner.handle(shard) else { return false };
        // The slot count is read once: the predicate runs under the shard's counters'
        // lock, where taking the routing table's would order the two locks both ways.
        let slots = {
            let table = self.inner.table();
            table.map.slots_per_shard(table.shards.len() as u32)[shard as usize]
        };
        handle.shared.wait_until(timeout, |_| done(&handle.stats(shard, slots)))
    }

    /// Makes every shard run its alarm now and waits until all have: reclaim, lease
    /// expiry for waiters, waiter deadlines. Shards do this on their own at each
    /// deadline; tests that move a `ManualClock` call it instead of sleeping.
    pub fn run_alarms(&self) {
        let shards = self.inner.handles();
        let (done_tx, done_rx) = crossbeam_channel::bounded(shards.len());
        let mut asked = 0;
        for shard in &shards {
            if shard.control.send(Control::RunAlarms(done_tx.clone())).is_ok() {
                asked += 1;
            }
        }
        for _ in 0..asked {
            if done_rx.recv().is_err() {
                break;
            }
        }
    }

    /// Asks one shard to close and reopen its file now; returns whether it serves again.
    /// Refused (`unavailable`, saying a restart is required) for a shard halted by a
    /// failed sync: only a new process may open its file again.
    pub fn reopen_shard(&self, shard: u32) -> Result<bool, Error> {
        let Some(handle) = self.inner.handle(shard) else { return Ok(false) };
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        if handle.control.send(Control::Reopen(done_tx)).is_err() {
            return Ok(false);
        }
        done_rx.recv().unwrap_or(Ok(false))
    }

    /// Stops accepting calls, lets every shard finish what it accepted (commit, answer
    /// waiters `in progress`), closes the files and waits for the threads. Idempotent;
    /// dropping the last clone does the same.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// [`Engine::shutdown`] for async code: the wait for the shards' threads happens on a
    /// thread of its own, not on the runtime's.
    pub async fn close(&self) {
        let engine = self.clone();
        let (done, closed) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new().name("oncegate-close".to_owned()).spawn(move || {
            engine.shutdown();
            // Before the answer: the caller may open the directory again at once.
            drop(engine);
            let _ = done.send(());
        });
        match spawned {
            Ok(_) => {
                let _ = closed.await;
            }
            // No thread to spare: close here, as `shutdown` would.
            Err(_) => self.shutdown(),
        }
    }
}

/// The data directory, the store and the shards' states: what a log line of a program
/// that embeds the engine wants to say about it.
impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let config = &self.inner.cx.config;
        let states: Vec<_> = self.stats().iter().map(|shard| shard.state.as_str()).collect();
        f.debug_struct("Engine")
            .field("data_dir", &config.data_dir)
            .field("store", &config.store.kind().name())
            .field("shards", &states)
            .finish()
    }
}

impl ShardHandle {
    fn stats(&self, shard: u32, slots: u32) -> ShardStats {
        let shared = &self.shared;
        let batches = shared.batches.load(Ordering::Relaxed);
        let commands = shared.commands.load(Ordering::Relaxed);
        ShardStats {
            shard,
            slots,
            state: shared.state(),
            mailbox_depth: self.data.len(),
            batches,
            commands,
            batch_len_mean: if batches == 0 { 0.0 } else { commands as f64 / batches as f64 },
            commits: shared.commits.load(Ordering::Relaxed),
            failures: shared.failures.load(Ordering::Relaxed),
            reclaimed: shared.reclaimed.load(Ordering::Relaxed),
            alarms: shared.alarms.load(Ordering::Relaxed),
            checkpoints: shared.checkpoints.load(Ordering::Relaxed),
            waiters: shared.waiters.load(Ordering::Relaxed),
            records_pending: shared.records_pending.load(Ordering::Relaxed),
            records_completed: shared.records_completed.load(Ordering::Relaxed),
            file_bytes: shared.file_bytes.load(Ordering::Relaxed),
            clock_ahead_ms: shared.clock_ahead_ms.load(Ordering::Relaxed),
            last_error: shared.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

impl Inner {
    fn table(&self) -> RwLockReadGuard<'_, routes::Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn table_mut(&self) -> RwLockWriteGuard<'_, routes::Table> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the lock an add-shards and a backup hold while they run, so that the slot
    /// map changes under neither; `None` while the other holds it. A poisoned lock only
    /// says an earlier holder panicked; the table says where it was.
    fn map_unchanged(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        match self.growing.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The shards, taken out of the table so that waiting on one holds no lock.
    fn handles(&self) -> Vec<Arc<ShardHandle>> {
        self.table().shards.clone()
    }

    fn handle(&self, shard: u32) -> Option<Arc<ShardHandle>> {
        self.table().shards.get(shard as usize).cloned()
    }

    fn shutdown(&self) {
        // Under the table's write lock no call is between its `closing` check and its
        // mailbox, so every call accepted is queued before its shard hears the stop, and
        // `finish` serves the mailbox to its end. The shards are told before calls are
        // refused: a refusal then means every shard has heard. A shard never takes this
        // lock, so a full control channel waits only for its shard's current batch.
        let shards = {
            let table = self.table_mut();
            for shard in &table.shards {
                let _ = shard.control.send(Control::Shutdown);
            }
            self.closing.store(true, Ordering::Release);
            table.shards.clone()
        };
        for shard in &shards {
            let thread = shard.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(thread) = thread
                && thread.join().is_err()
            {
                tracing::error!("a shard thread panicked");
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}
