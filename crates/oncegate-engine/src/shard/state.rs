//! What a shard shows the rest of the engine: its state, its counters (published with a
//! condition variable, so tests wait on them instead of sleeping), and the clock frame
//! all shards share.

use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

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
    /// A commit's sync failed: the shard answers `unavailable` until the process
    /// restarts, and refuses an operator's reopen (a reopen in this process could read
    /// back as committed what the disk lost).
    Halted,
}

impl ShardState {
    /// Every state, in declaration order.
    pub const ALL: [ShardState; 6] = [
        ShardState::Starting,
        ShardState::Serving,
        ShardState::Failed,
        ShardState::Stopped,
        ShardState::Panicked,
        ShardState::Halted,
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
            ShardState::Halted => "halted",
        }
    }
}

/// Counters the actor publishes for `Engine::stats` without being asked.
#[derive(Default)]
pub(crate) struct Shared {
    /// The state for cheap reads; `waiting` and `changed` let others wait for a change
    /// of the state or of any counter. `waiting` counts the threads in
    /// [`Shared::wait_until`]: a condition variable's notification is a system call
    /// whether anyone waits or not, and the shard publishes after every batch.
    state: AtomicU8,
    waiting: Mutex<usize>,
    changed: Condvar,
    pub batches: AtomicU64,
    pub commands: AtomicU64,
    pub commits: AtomicU64,
    pub failures: AtomicU64,
    pub reclaimed: AtomicU64,
    pub alarms: AtomicU64,
    /// WAL checkpoints of the shard's file, its checkpointer's and its own (shared with
    /// the store, whose checkpointer thread counts).
    pub checkpoints: Arc<AtomicU64>,
    /// Stored records by state, published after each commit.
    pub records_pending: AtomicU64,
    pub records_completed: AtomicU64,
    pub waiters: AtomicU64,
    /// The bytes of the shard file's pages in use, read at most a second before its last
    /// write batch (0 on a shared store).
    pub file_bytes: AtomicU64,
    /// How far the shard's time is ahead of the wall clock (ms; negative: behind), as of
    /// its last batch. Far ahead, the wall clock stepped back (or a mark from a clock
    /// that ran ahead was persisted) and the clock guard holds time from going back.
    pub clock_ahead_ms: AtomicI64,
    pub last_error: Mutex<Option<String>>,
}

impl Shared {
    pub fn state(&self) -> ShardState {
        ShardState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Publishes the record counts of the last commit.
    pub fn set_records(&self, counts: super::book::RecordCounts) {
        self.records_pending.store(counts.pending, Ordering::Relaxed);
        self.records_completed.store(counts.completed, Ordering::Relaxed);
    }

    pub fn set_state(&self, state: ShardState) {
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        self.state.store(state as u8, Ordering::Release);
        if *waiting > 0 {
            self.changed.notify_all();
        }
    }

    /// Wakes whoever waits in [`Shared::wait_until`]: counters changed.
    pub fn publish(&self) {
        // A waiter counts itself under the lock before it checks its condition, and
        // the counters were stored before this lock is taken: either it sees them, or
        // it is counted here and woken.
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if *waiting > 0 {
            self.changed.notify_all();
        }
    }

    /// Blocks until `done` holds (checked at each state change or publication) or
    /// `timeout` passes; returns whether it held.
    pub fn wait_until(&self, timeout: Duration, done: impl Fn(&Shared) -> bool) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        *waiting += 1;
        // Counted out however the wait ends, a panic of `done` included: a count left
        // raised would make every later publication a system call for nobody.
        let _counted = CountedIn(self);
        let (_waiting, result) = self
            .changed
            .wait_timeout_while(waiting, timeout, |_| !done(self))
            .unwrap_or_else(|p| p.into_inner());
        !result.timed_out()
    }

    pub fn set_last_error(&self, error: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }
}

/// A thread counted in [`Shared::waiting`]; dropping it counts the thread out. It takes
/// the lock again, so it must be dropped after the guard of the wait.
struct CountedIn<'a>(&'a Shared);

impl Drop for CountedIn<'_> {
    fn drop(&mut self) {
        *self.0.waiting.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
    }
}

/// What derived keys need from the shards: the greatest persisted high-water mark, how
/// many shards have not opened yet in this process (until all have, the mark is not
/// known and derived keys are refused rather than bucketed by a clock that may be
/// behind), and the store's derived-key format (the directory's routing; a PostgreSQL
/// store's as its schema records it, which a shard reads when it opens).
#[derive(Debug, Default)]
pub(crate) struct FrameFloor {
    pub high_water_ms: AtomicU64,
    pub unopened: std::sync::atomic::AtomicU32,
    pub format: std::sync::OnceLock<oncegate_core::route::Routing>,
}

/// The engine's start: the one wall-clock reading every shard anchors its frame to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Start {
    pub wall_ms: u64,
    pub monotonic_ms: u64,
}

/// The persisted marks of the shards that open together at the engine's start, so that
/// they all anchor one frame: the wall clock at start, lifted to the highest mark any of
/// them persisted. Lifting each shard to its own mark alone left shards whose marks were
/// ahead of the wall clock (a step back while stopped) running apart for the whole
/// process, and a slot moved from one to another then aged the destination's own leases
/// by the gap.
#[derive(Debug)]
pub(crate) struct Marks {
    state: Mutex<MarksState>,
    all_in: Condvar,
}

#[derive(Debug)]
struct MarksState {
    /// Shards of the start that have not added their mark yet.
    waiting_for: usize,
    highest_ms: u64,
}

impl Marks {
    /// Marks for `shards` opening together (0: nobody waits, as for a shared store,
    /// whose time is the database's).
    pub fn new(shards: usize) -> Marks {
        let state = MarksState { waiting_for: shards, highest_ms: 0 };
        Marks { state: Mutex::new(state), all_in: Condvar::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MarksState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a shard's mark (`None`: its store could not be read) and waits until every
    /// shard of the start has added its own; the highest mark.
    fn arrive(&self, mark_ms: Option<u64>) -> u64 {
        let mut state = self.state();
        state.highest_ms = state.highest_ms.max(mark_ms.unwrap_or(0));
        self.leave_locked(&mut state);
        let state = self.all_in.wait_while(state, |s| s.waiting_for > 0).unwrap_or_else(|p| p.into_inner());
        state.highest_ms
    }

    /// The base for a shard that opens after the start (one that failed at first, or one
    /// added later), without waiting: the start's highest mark, or its own if higher. Its
    /// own does not raise the start's, which its peers (and shards added later) keep.
    fn join(&self, mark_ms: u64) -> u64 {
        self.state().highest_ms.max(mark_ms)
    }

    fn leave_locked(&self, state: &mut MarksState) {
        state.waiting_for = state.waiting_for.saturating_sub(1);
        if state.waiting_for == 0 {
            self.all_in.notify_all();
        }
    }

    /// Stops waiting for shards that will never open (a start that failed part-way).
    pub fn abandon(&self) {
        let mut state = self.state();
        state.waiting_for = 0;
        self.all_in.notify_all();
    }

    /// The highest mark added so far.
    pub fn highest_ms(&self) -> u64 {
        self.state().highest_ms
    }
}

/// One shard's place among the [`Marks`] of the start, until it adds its mark. Dropped
/// unused (its thread ended first), it lets the others stop waiting for it.
#[derive(Debug)]
pub(crate) struct Arrival {
    marks: Arc<Marks>,
    pending: bool,
}

impl Arrival {
    pub fn new(marks: Arc<Marks>) -> Arrival {
        Arrival { marks, pending: true }
    }

    /// The highest mark of the shards opening with this one, `mark_ms` (this shard's)
    /// among them: the first call waits for all of them, later ones do not.
    pub fn highest_with(&mut self, mark_ms: Option<u64>) -> u64 {
        if std::mem::take(&mut self.pending) {
            self.marks.arrive(mark_ms)
        } else {
            self.marks.join(mark_ms.unwrap_or(0))
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        if self.pending {
            self.marks.leave_locked(&mut self.marks.state());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishing notifies only when someone waits; one who is waiting must still hear it.
    #[test]
    fn a_waiter_already_waiting_is_woken_by_a_publication() {
        let shared = Arc::new(Shared::default());
        let (woken_tx, woken) = std::sync::mpsc::channel();
        {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || {
                // Its own timeout is out of reach: only the publication can end the wait.
                let held =
                    shared.wait_until(Duration::from_secs(3_600), |s| s.commands.load(Ordering::Relaxed) > 0);
                let _ = woken_tx.send(held);
            });
        }
        // The count is raised under the lock, which the waiter gives up only inside the
        // condition variable's wait: once it reads 1 here, the waiter is waiting.
        let counted_by = std::time::Instant::now() + Duration::from_secs(60);
        while *shared.waiting.lock().unwrap() == 0 {
            assert!(std::time::Instant::now() < counted_by, "the waiter never counted itself in");
            std::thread::yield_now();
        }
        shared.commands.store(1, Ordering::Relaxed);
        shared.publish();
        // A bound on the wait, not on its speed: a lost notification would wait an hour.
        let held = woken.recv_timeout(Duration::from_secs(60)).expect("the publication woke the waiter");
        assert!(held);
        assert_eq!(*shared.waiting.lock().unwrap(), 0, "the waiter counted itself out");
    }

    /// A condition that panics leaves no waiter counted, so publications do not go on
    /// notifying for nobody. (The count was lowered only on a normal return.)
    #[test]
    fn a_wait_whose_condition_panics_counts_itself_out() {
        let shared = Shared::default();
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            shared.wait_until(Duration::from_secs(3_600), |_| panic!("the condition fails"))
        }));
        assert!(waited.is_err(), "the condition's panic reaches the caller");
        assert_eq!(*shared.waiting.lock().unwrap_or_else(|p| p.into_inner()), 0);
    }
}
