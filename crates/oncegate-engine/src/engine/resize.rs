//! Adding shards: the new shards start owning nothing, then slots move to them. One
//! mover does it, in an engine: `Engine::add_shards` (`oncegate admin add-shards`) while
//! the engine serves, one slot at a time, paced; `add_shards` (`oncegate reshard`) on a
//! stopped directory opens an engine that serves nobody and runs the same mover with
//! groups of slots and no pacing. `prepare_new_shards` first makes the new shards' token
//! epochs above every existing one, then the manifest counts them.
//!
//! One move, as the mover runs it (the shards' side is `shard/moves.rs`):
//!
//! 1. the routing table marks the slots moving: their new requests are held, in order
//!    (`routes.rs`), and the source is sent the hand-over behind the slots' earlier
//!    requests;
//! 2. the destination writes the slots' records durably with its counters raised;
//! 3. the map file is flipped durably (`slots::write`);
//! 4. the table gives the slots to the destination and sends it the held requests, in
//!    order, before anything sent later;
//! 5. the source deletes its copies, a chunk per alarm (or, stopped first, at its next
//!    open).
//!
//! A move that fails before the flip ends with the slots where they were (their held
//! requests go back to the source; the destination drops its copies). A flip whose
//! outcome on disk is unknown is undone by writing the old map again; if even that
//! fails, the slots answer `unavailable` until a restart reads the map, rather than
//! risk two owners. The map on disk always names exactly one owner with each slot's
//! truth, so a crash at any point restarts into a correct directory, and running the
//! same command again resumes the moves that are left.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::error::ResizeError;
use super::routes::{Moving, hand_over};
use super::{Engine, Inner, ShardHandle};
use crate::clock::{Clock, StoppedClock};
use crate::config::{EngineConfig, SHARDS_MAX, StoreKind};
use crate::error::Error;
use crate::faults::Faults;
use crate::files::{Files, OsFiles};
use crate::placement::LayoutError;
use crate::placement::manifest;
use crate::placement::slots::{self, SlotMap, SlotMove, Slots};
use crate::shard::{Control, Mail, MoveOut, Moved, Parked};

/// What a reshard did.
#[derive(Clone, Debug, PartialEq)]
pub struct Resharded {
    /// Shards before.
    pub shards_before: u32,
    /// Shards after.
    pub shards_after: u32,
    /// Slots that changed owner.
    pub slots_moved: u32,
    /// Records copied to their new shards.
    pub records_moved: u64,
    /// The slot map's version at the end.
    pub map_version: u64,
    /// How long each move held its slots' requests.
    pub pauses: Option<Pauses>,
}

/// The pause of a moved slot (from holding its requests to releasing them to the new
/// shard), over the moves of one add-shards, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pauses {
    /// The median move.
    pub p50_ms: f64,
    /// The 99th percentile.
    pub p99_ms: f64,
    /// The longest.
    pub max_ms: f64,
}

impl Pauses {
    /// The figures of `pauses_ms` (any order); `None` when no slot moved.
    pub fn of(mut pauses_ms: Vec<f64>) -> Option<Pauses> {
        pauses_ms.sort_by(f64::total_cmp);
        let at = |q: f64| pauses_ms[((pauses_ms.len() - 1) as f64 * q).round() as usize];
        let max_ms = *pauses_ms.last()?;
        Some(Pauses { p50_ms: at(0.5), p99_ms: at(0.99), max_ms })
    }
}

/// Progress: slots moved so far and in all.
pub type Progress<'a> = &'a mut dyn FnMut(u32, u32);

/// Slots an offline reshard moves at once: few moves (each is a few syncs), while a
/// hand-over carries at most 1/128 of the records in memory (going from 1 shard to 2).
const OFFLINE_SLOTS_PER_MOVE: usize = 64;

/// Adds shards to the stopped directory of `config` (its `shards` is ignored: the
/// directory's manifest says how many it has) until it has `to`.
///
/// Its engine's clock stands still at the directory's last mark ([`StoppedClock`]): the
/// reshard's own time is not the service's, so no lease ends and nothing expires while it
/// runs, and the next server start sees the marks of the last stop and gives leases their
/// restart grace.
pub fn add_shards(config: &EngineConfig, to: u32, progress: Progress<'_>) -> Result<Resharded, ResizeError> {
    add_shards_on(config, to, Arc::new(StoppedClock), Arc::new(OsFiles), &Faults::default(), progress)
}

/// [`add_shards`] on a clock and a files seam, with the faults a test injects
/// (`Faults::stop_moves_after` stops it as a crash would). It opens an engine that
/// serves nobody on the directory and runs [`Engine::add_shards`]'s mover, with groups
/// of slots and no pacing, then deletes the moved copies before it closes.
pub fn add_shards_on(
    config: &EngineConfig,
    to: u32,
    clock: Arc<dyn Clock>,
    files: Arc<dyn Files>,
    faults: &Faults,
    progress: Progress<'_>,
) -> Result<Resharded, ResizeError> {
    let lock = manifest::lock(&*files, &config.data_dir)?;
    // Checked under the lock the engine then opens with. A directory of another store
    // (a PostgreSQL node's, the log store's) is refused before anything changes: a
    // PostgreSQL node's directory (no manifest) hears why, whatever kind it was given.
    if manifest::is_node_dir(&*files, &config.data_dir)? {
        return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
    }
    if manifest::check_store_kind(&*files, config)? == StoreKind::Postgres {
        return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
    }
    let dir = &config.data_dir;
    let manifest = manifest::read(&*files, dir)?.ok_or_else(|| LayoutError::Manifest {
        path: dir.join(manifest::MANIFEST_FILE),
        reason: "not found: this is not a data directory".to_owned(),
    })?;
    let shards = manifest.shards;
    if to < shards || to > SHARDS_MAX {
        return Err(ResizeError::Target { to, shards, max: SHARDS_MAX });
    }
    let config = EngineConfig { shards, ..config.clone() };
    let engine = Engine::open_locked(config, clock, faults.clone(), files, lock)?;
    let done = engine.spread_slots(to, OFFLINE_SLOTS_PER_MOVE, Duration::ZERO, progress);
    if done.is_ok() {
        // Left to the alarms, the old copies would all be deleted by the next open, in
        // one transaction before the shard serves.
        engine.drop_moved_copies();
    }
    engine.shutdown();
    done
}

/// Makes shards `manifest.shards..to` part of the directory: their token epochs above
/// every epoch any shard has used (before a new shard owns anything), then the manifest's
/// new count. The new shards own no slot until the map gives them some.
pub(crate) fn prepare_new_shards(
    files: &dyn Files,
    dir: &std::path::Path,
    manifest: &manifest::Manifest,
    to: u32,
) -> Result<(), LayoutError> {
    let epoch = (0..to)
        .map(|shard| manifest::read_epoch(files, &manifest::epoch_file(dir, shard)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| LayoutError::Io { path: dir.to_owned(), source })?
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
        + 1;
    for shard in manifest.shards..to {
        let path = manifest::epoch_file(dir, shard);
        manifest::write_epoch(files, &path, epoch).map_err(|source| LayoutError::Io { path, source })?;
    }
    if to != manifest.shards {
        manifest::set_shards(files, dir, manifest, to)?;
    }
    Ok(())
}

impl Engine {
    /// Makes every shard delete the rows of slots that left it, and waits.
    fn drop_moved_copies(&self) {
        let shards = self.inner.handles();
        let (done, dropped) = crossbeam_channel::bounded(shards.len());
        let asked =
            shards.iter().filter(|shard| shard.control.send(Control::DropLeft(done.clone())).is_ok()).count();
        for _ in 0..asked {
            if dropped.recv().is_err() {
                break;
            }
        }
    }
}

/// Why shards are never added to a PostgreSQL store, online or offline.
pub(crate) const NO_SLOTS_ON_POSTGRES: &str = "shards on PostgreSQL share one table, so there is nothing to move: restart the node with more --shards (or add nodes)";

impl Engine {
    /// Adds shards while the engine serves, until it has `to` (at most `SHARDS_MAX`),
    /// and spreads the slots evenly, moving one slot at a time from the shards over
    /// their share to the new ones, at most `slot_moves_per_second_max` per second.
    /// `progress` hears the slots moved and the slots to move. Run again after an error
    /// or a crash, it resumes the moves that are left (`to` may then equal the count).
    pub fn add_shards(&self, to: u32, progress: Progress<'_>) -> Result<Resharded, ResizeError> {
        let pause = match self.inner.cx.config.slot_moves_per_second_max {
            0 => Duration::ZERO,
            rate => Duration::from_secs(1) / rate,
        };
        self.spread_slots(to, 1, pause, progress)
    }

    /// The mover: `slots_per_move` slots of one pair of shards at a time, `pause` per
    /// slot between moves.
    fn spread_slots(
        &self,
        to: u32,
        slots_per_move: usize,
        pause: Duration,
        progress: Progress<'_>,
    ) -> Result<Resharded, ResizeError> {
        let inner = &self.inner;
        if inner.cx.postgres.is_some() {
            return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
        }
        let _one_at_a_time = inner
            .map_unchanged()
            .ok_or(ResizeError::Busy { what: "another add-shards or a backup is running on this server" })?;
        if let Some(moving) = &inner.table().moving {
            // Slots whose map flip could not be written nor undone: only a restart,
            // reading the map from disk, can say which shard owns them.
            return Err(ResizeError::SlotStuck {
                slots: moving.step.slots.clone(),
                to: moving.step.to,
                reason: "its map could not be written".to_owned(),
            });
        }
        let before = inner.handles().len() as u32;
        if to < before || to > SHARDS_MAX {
            return Err(ResizeError::Target { to, shards: before, max: SHARDS_MAX });
        }
        if to > before {
            self.start_new_shards(before, to)?;
        }
        let moves = inner.table().map.moves_to_spread(to);
        let total = moves.len() as u32;
        progress(0, total);
        let (mut done, mut records) = (0, 0);
        let mut pauses_ms = Vec::with_capacity(total as usize);
        for step in in_groups(moves, slots_per_move) {
            if inner.closing.load(Ordering::Acquire) {
                return Err(ResizeError::Interrupted { reason: "the engine is shutting down" });
            }
            let started = Instant::now();
            let count = step.slots.len() as u32;
            let moved = self.move_slots(step)?;
            records += moved;
            metrics::counter!("oncegate_slot_moves_total").increment(u64::from(count));
            metrics::counter!("oncegate_slot_moved_records_total").increment(moved);
            let took = started.elapsed();
            metrics::histogram!("oncegate_slot_move_seconds").record(took.as_secs_f64());
            pauses_ms.push(took.as_secs_f64() * 1_000.0);
            done += count;
            progress(done, total);
            // Pacing, not synchronisation: it leaves the disk to the traffic between moves.
            std::thread::sleep(pause.saturating_mul(count).saturating_sub(started.elapsed()));
        }
        Ok(Resharded {
            shards_before: before,
            shards_after: to,
            slots_moved: total,
            records_moved: records,
            map_version: inner.table().map.version,
            pauses: Pauses::of(pauses_ms),
        })
    }

    /// Makes shards `before..to` part of the directory (epochs, manifest), starts them
    /// and adds them to the routing table; they own no slot yet. (The manifest may
    /// already count some of them: an earlier add that stopped before starting them.)
    fn start_new_shards(&self, before: u32, to: u32) -> Result<(), ResizeError> {
        let inner = &self.inner;
        let dir = &inner.cx.config.data_dir;
        let manifest = manifest::read(&*inner.cx.files, dir)?.ok_or_else(|| LayoutError::Manifest {
            path: dir.join(manifest::MANIFEST_FILE),
            reason: "the manifest disappeared while the engine ran".to_owned(),
        })?;
        prepare_new_shards(&*inner.cx.files, dir, &manifest, to)?;
        let handles = inner.start_shards(before..to)?;
        inner.table_mut().shards.extend(handles);
        tracing::info!(from = before, to, "new shards started; slots move to them next");
        Ok(())
    }

    /// Moves one group of slots; returns the records they carried.
    fn move_slots(&self, step: SlotMove) -> Result<u64, ResizeError> {
        let inner = &self.inner;
        let (source, destination) = {
            let mut table = inner.table_mut();
            let shard = |id: u32| {
                table
                    .shards
                    .get(id as usize)
                    .cloned()
                    .ok_or_else(|| not_running(id, "the shard is not running"))
            };
            let shards = (shard(step.from)?, shard(step.to)?);
            table.moving = Some(Moving::new(step.clone()));
            shards
        };
        inner.cx.slots.set_moving(Some(step.clone()));
        let mut parked = Parked::default();
        let records = match self.copy_slots(&step, &source, &destination, &mut parked) {
            Ok(records) => records,
            Err(error) => {
                let slots = step.slots.clone();
                self.end_move(step, None, parked);
                let _ = destination.control.send(Control::DropSlot(slots));
                return Err(error);
            }
        };
        stop_point(inner)?;
        let map = match self.flip(&step) {
            Ok(map) => map,
            Err(error) => return Err(self.undo_flip(step, &destination, parked, error)),
        };
        stop_point(inner)?;
        let slots = step.slots.clone();
        self.end_move(step, Some(map), parked);
        let _ = source.control.send(Control::DropSlot(slots));
        Ok(records)
    }

    /// Steps 1 and 2: the source hands the slots over, the destination writes them
    /// durably. Their parked reserves are kept in `parked` for whichever shard owns the
    /// slots at the end.
    fn copy_slots(
        &self,
        step: &SlotMove,
        source: &ShardHandle,
        destination: &ShardHandle,
        parked: &mut Parked,
    ) -> Result<u64, ResizeError> {
        let failed = |shard: u32| move |source: Error| ResizeError::Shard { shard, source };
        let gone = |shard: u32| not_running(shard, "the shard stopped");
        let (reply, handover) = crossbeam_channel::bounded(1);
        let move_out = MoveOut { slots: step.slots.clone(), reply };
        source.data.send(Mail::MoveOut(move_out)).map_err(|_| gone(step.from))?;
        let mut handover = handover.recv().map_err(|_| gone(step.from))?.map_err(failed(step.from))?;
        *parked = handover.take_parked();
        stop_point(&self.inner)?;
        let (reply, written) = crossbeam_channel::bounded(1);
        destination.control.send(Control::MoveIn(handover, reply)).map_err(|_| gone(step.to))?;
        written.recv().map_err(|_| gone(step.to))?.map_err(failed(step.to))
    }

    /// Step 3: the map with the slots at their destination, durable before it is
    /// returned.
    fn flip(&self, step: &SlotMove) -> Result<SlotMap, ResizeError> {
        let mut map = self.inner.table().map.clone();
        for slot in step.slots.iter() {
            map.set_owner(slot, step.to);
        }
        map.version += 1;
        slots::write(&*self.inner.cx.files, &self.inner.cx.config.data_dir, &map)?;
        Ok(map)
    }

    /// A flip failed, so the file may hold either map: write the old one again (with a
    /// higher version) and end the move where it began; if that fails too, the slot
    /// answers `unavailable` until a restart.
    fn undo_flip(
        &self,
        step: SlotMove,
        destination: &ShardHandle,
        parked: Parked,
        error: ResizeError,
    ) -> ResizeError {
        let inner = &self.inner;
        let mut old = inner.table().map.clone();
        old.version += 2;
        match slots::write(&*inner.cx.files, &inner.cx.config.data_dir, &old) {
            Ok(()) => {
                inner.table_mut().map.version = old.version;
                let slots = step.slots.clone();
                self.end_move(step, None, parked);
                let _ = destination.control.send(Control::DropSlot(slots));
            }
            Err(again) => {
                tracing::error!(slots = %step.slots, %error, %again, "the slot map could not be written; the slots answer unavailable until a restart");
                let stuck = ResizeError::SlotStuck {
                    slots: step.slots.clone(),
                    to: step.to,
                    reason: format!("{error}; undoing it failed too: {again}"),
                };
                let mut table = inner.table_mut();
                if let Some(moving) = table.moving.as_mut() {
                    moving.stuck = true;
                    moving.refuse_held();
                    let refusal = moving.stuck_error();
                    for reply in parked.into_replies() {
                        let _ = reply.send(Err(refusal.clone()));
                    }
                }
                return stuck;
            }
        }
        error
    }

    /// Step 4 (or the end of a failed move, `flipped` none): the table routes the slot to
    /// its owner, which gets the slot's parked reserves and then its held requests, in
    /// order, before anything sent later. They go on the owner's channel for what moves
    /// hand over, which never waits, under the table's lock: callers that route to the
    /// owner after it send behind them, and the shard reads that channel first. (Sent on
    /// its bounded mailbox, the held requests had to wait there for a place, under the
    /// lock at the last: a stalled owner stopped every caller's routing.)
    fn end_move(&self, step: SlotMove, flipped: Option<SlotMap>, parked: Parked) {
        let inner = &self.inner;
        let owner = if flipped.is_some() { step.to } else { step.from };
        let mut table = inner.table_mut();
        if let Some(map) = &flipped {
            table.map = map.clone();
        }
        let handle = Arc::clone(&table.shards[owner as usize]);
        // Shards that open from now on keep the slot's rows only where it lives.
        match flipped {
            Some(map) => inner.cx.slots.set_map(map),
            None => inner.cx.slots.set_moving(None),
        }
        hand_over(&handle, owner, Moved::Adopt(parked));
        let held = table.moving.take().map(|moving| moving.take_held()).unwrap_or_default();
        if !held.is_empty() {
            hand_over(&handle, owner, Moved::Held(held));
        }
    }
}

/// The moves as steps of at most `size` slots going from one shard to another: one slot
/// a step in the order given, or groups of the slots each pair of shards exchanges, the
/// pairs in the order they first appear.
fn in_groups(moves: Vec<(u32, u32, u32)>, size: usize) -> Vec<SlotMove> {
    let one = |(slot, from, to): (u32, u32, u32)| SlotMove { slots: Slots::one(slot), from, to };
    if size <= 1 {
        return moves.into_iter().map(one).collect();
    }
    let mut pairs: Vec<((u32, u32), Vec<u32>)> = Vec::new();
    for (slot, from, to) in moves {
        match pairs.iter_mut().find(|(pair, _)| *pair == (from, to)) {
            Some((_, slots)) => slots.push(slot),
            None => pairs.push(((from, to), vec![slot])),
        }
    }
    pairs
        .into_iter()
        .flat_map(|((from, to), slots)| {
            slots
                .chunks(size)
                .map(|group| SlotMove { slots: Slots::of(group.to_vec()), from, to })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A shard that cannot take part in a move: it stopped, or never ran.
fn not_running(shard: u32, reason: &str) -> ResizeError {
    ResizeError::Shard { shard, source: Error::Unavailable { shard, reason: reason.to_owned() } }
}

/// Where a test may stop a move dead, as a crash would (`Faults::stop_moves_after`).
fn stop_point(inner: &Inner) -> Result<(), ResizeError> {
    if inner.cx.faults.move_should_stop() {
        return Err(ResizeError::Interrupted { reason: "injected fault: slot move stopped" });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Pauses;

    #[test]
    fn pauses_are_read_from_the_sorted_moves() {
        assert_eq!(Pauses::of(Vec::new()), None, "no move, no figure");
        let pauses = Pauses::of((1..=100).rev().map(f64::from).collect()).unwrap();
        assert_eq!((pauses.p50_ms, pauses.p99_ms, pauses.max_ms), (51.0, 99.0, 100.0));
    }
}
