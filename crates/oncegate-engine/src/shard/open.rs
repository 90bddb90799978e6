//! Opening a shard file cleanly: the integrity check (at process start), the token
//! epoch, the clock frame, the restart grace; and what a failed open leaves behind.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use oncegate_core::ClockGuard;

use super::{Shard, ShardState};
use crate::placement::{manifest, token};
#[cfg(feature = "postgres")]
use crate::store::postgres;
use crate::store::{Meta, Store, StoreError, Tuning, sqlite};

/// Who asks for an open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Asked {
    /// The shard: at start, or to reconnect after a failure.
    ByShard,
    /// An operator (`ReopenShard`): a shared store's records are counted again.
    ByOperator,
}

impl Shard {
    /// Opens the file cleanly: integrity check (at process start only), token epoch,
    /// counters, restart grace. On failure the shard stays failed and schedules the next
    /// attempt.
    pub(super) fn open(&mut self, asked: Asked) -> bool {
        match self.try_open(asked) {
            Ok(store) => {
                self.store = Some(store);
                if !self.opened {
                    self.opened = true;
                    self.cx.floor.high_water_ms.fetch_max(self.guard.high_water_ms(), Ordering::SeqCst);
                    self.cx.floor.unopened.fetch_sub(1, Ordering::SeqCst);
                }
                self.backoff_ms = self.cx.config.reopen_backoff_ms_min;
                self.reopen_at = None;
                // A new store takes writes; the next that does not fit says so again.
                self.write_retry = None;
                // The gauges read right after an open, before any batch.
                self.publish_gauges();
                self.shared.set_state(ShardState::Serving);
                tracing::info!(shard = self.id, path = %self.path.display(), epoch = self.epoch, "shard serving");
                true
            }
            Err(error) => {
                if !self.opened && error.is_disk_full() {
                    let path = match &error {
                        StoreError::Io { path, .. } => path.clone(),
                        _ => self.path.clone(),
                    };
                    self.open_found_disk_full = Some(path);
                }
                // The shards opening with this one wait for its mark; it has none to give.
                if !self.opened && self.cx.postgres.is_none() {
                    self.arrival.highest_with(None);
                }
                self.record_failure(&error);
                false
            }
        }
    }

    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    fn try_open(&mut self, asked: Asked) -> Result<Store, StoreError> {
        match self.cx.postgres.clone() {
            #[cfg(feature = "postgres")]
            Some(pg) => self.open_postgres(&pg, asked),
            #[cfg(not(feature = "postgres"))]
            Some(none) => match none {},
            None => self.open_own(),
        }
    }

    /// Connects to the shared table. Time and tokens come from the database in each
    /// transaction; the shard's own frame (anchored like a file's, at the greatest mark
    /// any node persisted) only schedules its alarms, and decides when the engine's clock
    /// is configured to. No restart grace: other nodes go on serving the keys while this
    /// one is down, so its downtime is not a pause of anyone's lease.
    #[cfg(feature = "postgres")]
    fn open_postgres(
        &mut self,
        pg: &std::sync::Arc<postgres::Postgres>,
        asked: Asked,
    ) -> Result<Store, StoreError> {
        let owned = self.cx.slots.owned(self.id);
        let process_start = !self.opened;
        let (mut store, meta, format) = postgres::Store::open(
            pg,
            self.id,
            &owned,
            &self.cx.faults,
            postgres::Opening { first: process_start, count: process_start || asked == Asked::ByOperator },
            self.cx.config.reclaim_granularity_ms,
        )?;
        // Every shard reads the same row; the first to open tells the engine.
        let _ = self.cx.floor.format.set(format);
        // A reopen keeps the frame and is not lifted to the database's mark: the mark is
        // in the database's time, which may run ahead of the node's, and a frame lifted
        // to it would stand still until the node's clock caught up, and with it the pace
        // that every transaction's time is held to.
        let now = if process_start {
            self.anchor_at(self.cx.start.wall_ms, meta.high_water_ms)
        } else {
            self.guard.read(self.cx.clock.monotonic_ms())
        };
        // Other nodes' records come due without this shard hearing of them: it looks for
        // them once a reclaim window after it opens, and after each reclaim from then on.
        // Alarms are in the store's time: the shard's own plus how far ahead of it the
        // store's was at the last batch (0 before the first).
        let store_now = now.saturating_add_signed(self.store_ahead_ms);
        self.book.next_reclaim_ms = Some(store_now + self.cx.config.reclaim_granularity_ms);
        // Counted when the node starts and when an operator reopens the shard; a reconnect
        // after a failure keeps the shard's own counts.
        if let Some(counted) = store.take_count() {
            self.book.reset_records(counted);
        }
        self.shared.set_records(self.book.settle());
        Ok(Store::Shared(store))
    }

    /// Opens the shard's own store (its SQLite file): the token epoch, the
    /// clock frame, the restart grace, and the counters written before the first grant.
    fn open_own(&mut self) -> Result<Store, StoreError> {
        let owned = self.cx.slots.owned(self.id);
        // Opened as a moving slot's destination, the file keeps that slot's rows: they
        // are copies of an earlier attempt, which the move's copy must replace.
        if let Some(moving) = owned.moving.as_ref().filter(|m| m.to == self.id) {
            self.received.extend(moving.slots.iter());
        }
        // Only the first open of the process checks the file and re-anchors the clock;
        // an in-process reopen keeps the frame, so a wall-clock step cannot age records.
        let process_start = !self.opened;
        let tuning = Tuning {
            checkpoints: Arc::clone(&self.shared.checkpoints),
            ..Tuning::of(&self.cx.config, Arc::clone(&self.cx.files), Some(owned), self.cx.slots.routing)
        };
        let (mut store, meta, created) =
            sqlite::Store::open(&self.path, &tuning, &self.cx.faults, process_start)?;
        let stored_epoch =
            manifest::read_epoch(&*self.cx.files, &self.epoch_path).map_err(|e| self.epoch_error(e))?;
        let epoch = token::epoch_at_open(
            stored_epoch,
            meta.next_token,
            created,
            token::floor(self.cx.clock.now_ms()),
        );
        if epoch > token::EPOCH_MAX {
            return Err(StoreError::Corrupt(format!(
                "token epoch {epoch} is past the last one ({}); tokens would no longer increase",
                token::EPOCH_MAX
            )));
        }
        // Durable before the first grant of this open, so no later open can reuse it.
        self.write_epoch(epoch)?;
        let now = if process_start { self.anchor(meta.high_water_ms) } else { self.keep_frame(meta) };
        let txn = store.begin(now)?;
        if process_start {
            self.restart_grace(&txn, meta.high_water_ms, now)?;
        }
        let next_token = meta.next_token.max(token::first_of(epoch));
        let meta = Meta { next_token, high_water_ms: now };
        txn.set_meta(meta)?;
        txn.commit(meta)?;
        self.epoch = epoch;
        self.book.next_token = next_token;
        // The open deleted the rows of every slot the shard does not own.
        self.leaving.clear();
        self.handed = None;
        self.book.next_reclaim_ms = store.next_reclaim_ms();
        self.book.reset_records(store.take_count());
        self.shared.set_records(self.book.settle());
        Ok(Store::Own(store))
    }

    /// The process's first open of the shard's own store: anchors the frame at the
    /// engine's start, lifted to the highest mark persisted by any shard opening with it
    /// (so that every shard of the process keeps one time, and a slot moved between two
    /// of them keeps its leases' time left without aging the destination's).
    pub(super) fn anchor(&mut self, high_water_ms: u64) -> u64 {
        let highest_ms = self.arrival.highest_with(Some(high_water_ms));
        self.anchor_at(self.cx.start.wall_ms.max(highest_ms), high_water_ms)
    }

    /// Anchors the frame at `base_ms`, never below the persisted mark, and says how far
    /// time moved while the shard was down.
    pub(super) fn anchor_at(&mut self, base_ms: u64, high_water_ms: u64) -> u64 {
        if !anchor_once(&mut self.guard, base_ms, self.cx.start.monotonic_ms, high_water_ms) {
            return self.guard.read(self.cx.clock.monotonic_ms());
        }
        if high_water_ms > 0 && base_ms > high_water_ms {
            tracing::info!(
                shard = self.id,
                forward_ms = base_ms - high_water_ms,
                wall_behind_ms = base_ms - self.cx.start.wall_ms,
                "time is past the persisted high-water mark (downtime, a step while stopped, or another shard's later mark); records and leases aged by that much"
            );
        } else if base_ms < high_water_ms {
            tracing::warn!(
                shard = self.id,
                behind_ms = high_water_ms - base_ms,
                "the wall clock is behind the persisted high-water mark; time continues from the mark"
            );
        }
        self.guard.read(self.cx.clock.monotonic_ms())
    }

    /// An in-process reopen: the frame stays; only a higher persisted mark lifts it.
    pub(super) fn keep_frame(&mut self, meta: Meta) -> u64 {
        self.guard.raise(meta.high_water_ms);
        self.guard.read(self.cx.clock.monotonic_ms())
    }

    /// After a process restart every lease that was live at the stop runs at least
    /// `lease_restart_grace_ms` more, so a holder that was working is not overtaken by
    /// the downtime.
    pub(super) fn restart_grace(
        &self,
        txn: &sqlite::Txn<'_>,
        high_water_ms: u64,
        now: u64,
    ) -> Result<(), StoreError> {
        let mut extended = 0usize;
        for (scope, mut record) in txn.pending_leased_after(high_water_ms)? {
            if record.apply_restart_grace(high_water_ms, now, self.cx.config.lease_restart_grace_ms) {
                txn.put(&scope, &record).inspect_err(|error| {
                    if error.is_full() {
                        tracing::warn!(
                            shard = self.id,
                            extended,
                            "the restart grace's rewrites of the leases live at the stop do not fit within shard_file_bytes_max; raise it to open the shard"
                        );
                    }
                })?;
                extended += 1;
            }
        }
        if extended > 0 {
            tracing::info!(shard = self.id, leases = extended, "restart grace extended live leases");
        }
        Ok(())
    }

    pub(super) fn epoch_error(&self, source: std::io::Error) -> StoreError {
        StoreError::Io { path: self.epoch_path.clone(), source }
    }

    pub(super) fn write_epoch(&self, epoch: u64) -> Result<(), StoreError> {
        manifest::write_epoch(&*self.cx.files, &self.epoch_path, epoch).map_err(|e| self.epoch_error(e))
    }

    /// Moves to a new token epoch when the current one could run out within one batch
    /// and one round of waiters: the new epoch is durable before any token of it is used.
    /// A failure to write it fails the shard like any I/O error.
    pub(super) fn ensure_token_room(&mut self) {
        let room = (self.cx.config.batch_len_max + self.cx.config.waiters_per_shard_max + 1) as u64;
        let on_file = self.store.as_ref().is_some_and(|store| store.own().is_some());
        if !on_file || !token::needs_new_epoch(self.book.next_token, room) {
            return;
        }
        let epoch = token::next_epoch(self.epoch, token::floor(self.cx.clock.now_ms()));
        if epoch > token::EPOCH_MAX {
            let reason = format!("token epoch {epoch} is past the last one ({})", token::EPOCH_MAX);
            return self.record_failure(&StoreError::Corrupt(reason));
        }
        if let Err(error) = self.write_epoch(epoch) {
            return self.record_failure(&error);
        }
        self.epoch = epoch;
        // Never below the counter: a slot moved in may have raised it.
        self.book.next_token = self.book.next_token.max(token::first_of(epoch));
        tracing::info!(shard = self.id, epoch, "token counter moved to a new epoch");
    }
}

/// Anchors `guard` at `base_ms` as of the engine's start (`start_monotonic_ms`), never
/// below the persisted mark; returns whether it did. A guard already anchored (a first
/// open that failed after anchoring, tried again) keeps its frame and is only raised to
/// the mark: anchoring it again from the start's reading, above the time it had already
/// read, would count the time since the start twice and put the shard ahead of its peers.
fn anchor_once(guard: &mut ClockGuard, base_ms: u64, start_monotonic_ms: u64, high_water_ms: u64) -> bool {
    if guard.is_anchored() {
        guard.raise(high_water_ms);
        return false;
    }
    *guard = ClockGuard::new(high_water_ms.max(guard.high_water_ms()));
    guard.anchor(base_ms, start_monotonic_ms);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_open_tried_again_keeps_the_frame_it_anchored() {
        let mut guard = ClockGuard::new(0);
        assert!(anchor_once(&mut guard, 1_000_000, 50, 900_000));
        // The first attempt read time 30 s after the start, then failed.
        assert_eq!(guard.read(30_050), 1_030_000);
        let anchored_again = anchor_once(&mut guard, 1_000_000, 50, 900_000);
        assert_eq!(guard.read(40_050), 1_040_000, "10 s later, not 30 s ahead of the start's frame");
        assert!(!anchored_again);
        // A persisted mark above the frame still lifts it.
        anchor_once(&mut guard, 1_000_000, 50, 2_000_000);
        assert_eq!(guard.read(40_060), 2_000_000);
    }
}
