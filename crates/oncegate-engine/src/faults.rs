//! A seam for injecting storage faults, used by the fault tests.
//!
//! Production code never arms it; an unarmed seam costs one relaxed atomic load per
//! batch. It is a seam rather than a cargo feature so that the binary under test is the
//! binary that ships.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Shared switches that make a store fail on demand. Clones share the switches.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    inner: Arc<FaultsInner>,
}

#[derive(Debug, Default)]
struct FaultsInner {
    /// The next this many batch commits fail after their writes, before `COMMIT`.
    commits_failing: AtomicU32,
    /// The next this many commits fail as a failed sync does (`SQLITE_IOERR_FSYNC`).
    syncs_failing: AtomicU32,
    /// The next this many opens (and reopens) of a shard fail.
    opens_failing: AtomicU32,
    /// When positive, counts the durable steps of online slot moves down; the mover stops
    /// dead at the one that takes it to zero, as a crash there would leave things.
    move_steps_until_stop: AtomicI64,
    /// When positive, counts store operations down; the one that takes it to zero fails.
    /// A random starting value puts the failure at a random point of the write path.
    ops_until_failure: AtomicI64,
    /// When non-zero, overrides the shard file size limit, in SQLite pages, at every
    /// open: a real "disk full" from SQLite itself.
    page_count_max: AtomicU64,
    /// The next this many integrity checks report corruption.
    integrity_checks_failing: AtomicU32,
    /// The next batch of any shard panics (a bug in the shard's thread, simulated).
    panic_next_batch: AtomicBool,
    /// When non-zero, overrides `wal_checkpoint_pages` at every open, below the
    /// configuration's floor: the power-loss harness checkpoints every few batches.
    wal_checkpoint_pages: AtomicU64,
    /// When non-zero, overrides `page_cache_bytes_max` at every open, in pages, below the
    /// configuration's floor: the power-loss harness's batches spill the cache.
    page_cache_pages: AtomicU64,
    /// The deliberate bug the power-loss harness must catch: shards answer a batch
    /// before its `COMMIT`.
    acks_before_commit: AtomicBool,
    /// While closed, shards stop before applying a batch: tests use it to hold a shard
    /// busy and fill its mailbox deterministically.
    gate_closed: AtomicBool,
    gate: Mutex<GateState>,
    gate_changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    /// Shards stopped at the gate now.
    held: usize,
}

fn take_one(counter: &AtomicU32) -> bool {
    counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

impl Faults {
    /// Makes the next `n` batch commits fail (across all shards).
    pub fn fail_commits(&self, n: u32) {
        self.inner.commits_failing.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` commits fail as a failed sync of the WAL does: the shard halts
    /// until the process restarts (the power-loss harness fails the real sync instead).
    pub fn fail_syncs(&self, n: u32) {
        self.inner.syncs_failing.store(n, Ordering::SeqCst);
    }

    /// Makes the `n`-th store operation from now fail (any shard): a read, a write, the
    /// counters' update or the commit, wherever the count runs out.
    pub fn fail_op_after(&self, n: u32) {
        self.inner.ops_until_failure.store(i64::from(n.max(1)), Ordering::SeqCst);
    }

    /// Makes an online add-shards stop dead after `n` durable steps of its slot moves
    /// (each move has three: the slot handed over, copied durably, the map flipped),
    /// leaving the moving slot's requests unanswered and the files as a crash would.
    pub fn stop_moves_after(&self, n: u32) {
        self.inner.move_steps_until_stop.store(i64::from(n.max(1)), Ordering::SeqCst);
    }

    /// Makes the next `n` shard opens fail.
    pub fn fail_opens(&self, n: u32) {
        self.inner.opens_failing.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` integrity checks (`quick_check` at a shard's first open in the
    /// process) report corruption.
    pub fn fail_integrity_checks(&self, n: u32) {
        self.inner.integrity_checks_failing.store(n, Ordering::SeqCst);
    }

    /// Makes the next batch of any shard panic, as a bug in the shard's thread would.
    pub fn panic_next_batch(&self) {
        self.inner.panic_next_batch.store(true, Ordering::SeqCst);
    }

    /// Checkpoints every shard file opened from now on after `pages` WAL pages (0 lifts
    /// the override), so that tests cross checkpoints often.
    pub fn checkpoint_after_pages(&self, pages: u64) {
        self.inner.wal_checkpoint_pages.store(pages, Ordering::SeqCst);
    }

    /// Keeps at most `pages` pages in SQLite's page cache of every shard file opened from
    /// now on (0 lifts the override), so that a batch that dirties more spills them into
    /// the WAL before its commit.
    pub fn cap_page_cache(&self, pages: u64) {
        self.inner.page_cache_pages.store(pages, Ordering::SeqCst);
    }

    /// Switches on a deliberate durability bug: every shard answers its batches before
    /// their `COMMIT`. Only the power-loss harness's proof that it can see uses it.
    pub fn ack_before_commit(&self) {
        self.inner.acks_before_commit.store(true, Ordering::SeqCst);
    }

    /// Limits every shard file opened from now on to `pages` SQLite pages (0 lifts the
    /// override).
    pub fn limit_pages(&self, pages: u64) {
        self.inner.page_count_max.store(pages, Ordering::SeqCst);
    }

    /// Makes shards stop before their next batch until [`Faults::open_gate`].
    pub fn close_gate(&self) {
        let _state = self.inner.gate.lock().unwrap_or_else(|p| p.into_inner());
        self.inner.gate_closed.store(true, Ordering::SeqCst);
    }

    /// Lets held shards go on.
    pub fn open_gate(&self) {
        let _state = self.inner.gate.lock().unwrap_or_else(|p| p.into_inner());
        self.inner.gate_closed.store(false, Ordering::SeqCst);
        self.inner.gate_changed.notify_all();
    }

    /// Blocks until `n` shards are held at the closed gate.
    pub fn wait_held(&self, n: usize) {
        let state = self.inner.gate.lock().unwrap_or_else(|p| p.into_inner());
        let _state =
            self.inner.gate_changed.wait_while(state, |s| s.held < n).unwrap_or_else(|p| p.into_inner());
    }

    pub(crate) fn pass_gate(&self) {
        if !self.inner.gate_closed.load(Ordering::Relaxed) {
            return;
        }
        let mut state = self.inner.gate.lock().unwrap_or_else(|p| p.into_inner());
        state.held += 1;
        self.inner.gate_changed.notify_all();
        let mut state = self
            .inner
            .gate_changed
            .wait_while(state, |_| self.inner.gate_closed.load(Ordering::SeqCst))
            .unwrap_or_else(|p| p.into_inner());
        state.held -= 1;
    }

    pub(crate) fn op_should_fail(&self) -> bool {
        self.inner.ops_until_failure.load(Ordering::Relaxed) > 0
            && self.inner.ops_until_failure.fetch_sub(1, Ordering::SeqCst) == 1
    }

    pub(crate) fn move_should_stop(&self) -> bool {
        self.inner.move_steps_until_stop.load(Ordering::Relaxed) > 0
            && self.inner.move_steps_until_stop.fetch_sub(1, Ordering::SeqCst) == 1
    }

    pub(crate) fn commit_should_fail(&self) -> bool {
        self.inner.commits_failing.load(Ordering::Relaxed) > 0 && take_one(&self.inner.commits_failing)
    }

    pub(crate) fn sync_should_fail(&self) -> bool {
        self.inner.syncs_failing.load(Ordering::Relaxed) > 0 && take_one(&self.inner.syncs_failing)
    }

    pub(crate) fn integrity_check_should_fail(&self) -> bool {
        self.inner.integrity_checks_failing.load(Ordering::Relaxed) > 0
            && take_one(&self.inner.integrity_checks_failing)
    }

    pub(crate) fn maybe_panic(&self) {
        if self.inner.panic_next_batch.load(Ordering::Relaxed)
            && self.inner.panic_next_batch.swap(false, Ordering::SeqCst)
        {
            panic!("injected panic in a shard thread");
        }
    }

    pub(crate) fn open_should_fail(&self) -> bool {
        self.inner.opens_failing.load(Ordering::Relaxed) > 0 && take_one(&self.inner.opens_failing)
    }

    pub(crate) fn wal_checkpoint_pages(&self) -> Option<u64> {
        match self.inner.wal_checkpoint_pages.load(Ordering::SeqCst) {
            0 => None,
            pages => Some(pages),
        }
    }

    pub(crate) fn page_cache_pages(&self) -> Option<u64> {
        match self.inner.page_cache_pages.load(Ordering::SeqCst) {
            0 => None,
            pages => Some(pages),
        }
    }

    pub(crate) fn acks_before_commit(&self) -> bool {
        self.inner.acks_before_commit.load(Ordering::Relaxed)
    }

    pub(crate) fn page_count_max(&self) -> Option<u64> {
        match self.inner.page_count_max.load(Ordering::SeqCst) {
            0 => None,
            n => Some(n),
        }
    }
}
