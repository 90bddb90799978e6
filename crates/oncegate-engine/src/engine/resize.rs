//! Adding shards: the new shards start owning nothing, then slots move to them.
//!
//! Two movers share the same layout rules (`prepare_new_shards` first makes the new
//! shards' token epochs above every existing one, then the manifest counts them):
//!
//! - **online** (`Engine::add_shards`, `oncegate admin add-shards`): one slot at a time
//!   while every shard serves;
//! - **offline** (`add_shards`, `oncegate reshard`): on a stopped directory, a group of
//!   slots (every slot going from one shard to another) at a time.
//!
//! One online move, as the mover runs it (the shards' side is `shard/moves.rs`):
//!
//! 1. the routing table marks the slot moving: its new requests are held, in order
//!    (`routes.rs`), and the source is sent the hand-over behind the slot's earlier
//!    requests;
//! 2. the destination writes the slot's records durably with its counters raised;
//! 3. the map file is flipped durably (`slots::write`);
//! 4. the table gives the slot to the destination and sends it the held requests, in
//!    order, before anything sent later;
//! 5. the source deletes its copies, a chunk per alarm.
//!
//! A move that fails before the flip ends with the slot where it was (its held requests
//! go back to the source; the destination drops its copies). A flip whose outcome on
//! disk is unknown is undone by writing the old map again; if even that fails, the slot
//! answers `unavailable` until a restart reads the map, rather than risk two owners.
//!
//! One offline group takes three durable steps: the destination copies the group's
//! records (one transaction that first drops rows an earlier attempt left, and raises
//! its counters over the source's); the map gives the slots to the destination; the
//! source deletes its copies (which its next open would otherwise do).
//!
//! Either way the map on disk always names exactly one owner with the slot's truth, so a
//! crash at any point restarts into a correct directory, and running the same command
//! again resumes the moves that are left.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::error::ResizeError;
use super::routes::{Moving, hand_over};
use super::{Engine, Inner, ShardHandle};
use crate::config::{Durability, EngineConfig, SHARDS_MAX, StoreKind};
use crate::error::Error;
use crate::faults::Faults;
use crate::files::{Files, OsFiles};
use crate::placement::LayoutError;
use crate::placement::manifest;
use crate::placement::slots::{self, SlotMap, SlotMove};
use crate::shard::{Control, Mail, MoveOut, Moved, Parked};
use crate::store::Tuning;
use crate::store::sqlite;

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
    /// How long each moved slot's requests were held (online moves only).
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

/// Adds shards to the stopped directory of `config` (its `shards` is ignored: the
/// directory's manifest says how many it has) until it has `to`.
pub fn add_shards(config: &EngineConfig, to: u32, progress: Progress<'_>) -> Result<Resharded, ResizeError> {
    add_shards_on(config, to, Arc::new(OsFiles), &Faults::default(), progress)
}

/// [`add_shards`] on a files seam, with the faults a test injects
/// (`Faults::fail_op_after` stops it after that many durable steps).
pub fn add_shards_on(
    config: &EngineConfig,
    to: u32,
    files: Arc<dyn Files>,
    faults: &Faults,
    progress: Progress<'_>,
) -> Result<Resharded, ResizeError> {
    let _lock = manifest::lock(&*files, &config.data_dir)?;
    // A directory of another store (a PostgreSQL node's, the log store's) is refused
    // before anything changes. Settled first, so that a PostgreSQL node's directory (no
    // manifest) hears why, whatever kind the command was given.
    if manifest::is_node_dir(&*files, &config.data_dir)? {
        return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
    }
    let kind = manifest::check_store_kind(&*files, config)?;
    if kind == StoreKind::Postgres {
        return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
    }
    let dir = &config.data_dir;
    let manifest = manifest::read(&*files, dir)?.ok_or_else(|| LayoutError::Manifest {
        path: dir.join(manifest::MANIFEST_FILE),
        reason: "not found: this is not a data directory".to_owned(),
    })?;
    let before = manifest.shards;
    if to < before || to > SHARDS_MAX {
        return Err(ResizeError::Target { to, shards: before, max: SHARDS_MAX });
    }
    let (mut map, _, routing) = manifest::open_or_create(&*files, dir, before)?;
    // Read again: opening may have moved an older directory's routing to the map.
    let manifest = manifest::read(&*files, dir)?.unwrap_or(manifest);
    prepare_new_shards(&*files, dir, &manifest, to)?;
    let moves = map.moves_to_spread(to);
    let total = moves.len() as u32;
    let mut groups: BTreeMap<(u32, u32), HashSet<u32>> = BTreeMap::new();
    for (slot, from, dest) in moves {
        groups.entry((from, dest)).or_default().insert(slot);
    }
    let (mut moved, mut records) = (0, 0);
    progress(0, total);
    // Always synced: the map must never name a destination whose copy a power cut undid.
    let tuning = Tuning { durability: Durability::Full, ..Tuning::of(config, files, None, routing) };
    for ((from, dest), group) in groups {
        records += move_group(config, &tuning, faults, &mut map, from, dest, &group)?;
        moved += group.len() as u32;
        progress(moved, total);
    }
    Ok(Resharded {
        shards_before: before,
        shards_after: to,
        slots_moved: moved,
        records_moved: records,
        map_version: map.version,
        pauses: None,
    })
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

/// The three steps of one group: copy, flip the map, delete at the source.
fn move_group(
    config: &EngineConfig,
    tuning: &Tuning,
    faults: &Faults,
    map: &mut SlotMap,
    from: u32,
    dest: u32,
    group: &HashSet<u32>,
) -> Result<u64, ResizeError> {
    let shard_error = |shard: u32| move |source| ResizeError::Store { shard, source };
    let dir = &config.data_dir;
    let (mut source, source_meta, _) =
        sqlite::Store::open(&manifest::shard_file(dir, from), tuning, faults, false)
            .map_err(shard_error(from))?;
    let (mut destination, destination_meta, _) =
        sqlite::Store::open(&manifest::shard_file(dir, dest), tuning, faults, false)
            .map_err(shard_error(dest))?;
    step(faults)?;
    // The destination's counters start above the source's, not only above the tokens of
    // the rows it copies: a key of the group released or reclaimed at the source has no
    // row, and its next grant must still be above its last token there (the source's
    // epoch may have risen past the destination's since the new shards were made).
    let start = destination_meta.max(source_meta);
    let copied = destination.copy_slots_from(&source, group, start).map_err(shard_error(dest))?;
    step(faults)?;
    for slot in group {
        map.set_owner(*slot, dest);
    }
    map.version += 1;
    slots::write(&*tuning.files, dir, map)?;
    step(faults)?;
    source.delete_slots(group, source_meta).map_err(shard_error(from))?;
    tracing::info!(
        from,
        to = dest,
        slots = group.len(),
        records = copied,
        map_version = map.version,
        "slots moved"
    );
    Ok(copied)
}

/// A point where a test may stop the reshard, as a crash would.
fn step(faults: &Faults) -> Result<(), ResizeError> {
    if faults.op_should_fail() {
        return Err(ResizeError::Interrupted { reason: "injected fault: reshard stopped" });
    }
    Ok(())
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
        let inner = &self.inner;
        if inner.cx.postgres.is_some() {
            return Err(ResizeError::Unsupported { what: NO_SLOTS_ON_POSTGRES });
        }
        let _one_at_a_time = inner
            .map_unchanged()
            .ok_or(ResizeError::Busy { what: "another add-shards or a backup is running on this server" })?;
        if let Some(moving) = &inner.table().moving {
            // A slot whose map flip could not be written nor undone: only a restart,
            // reading the map from disk, can say which shard owns it.
            let (slot, to) = (moving.step.slot, moving.step.to);
            return Err(ResizeError::SlotStuck {
                slot,
                to,
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
        let pause = match inner.cx.config.slot_moves_per_second_max {
            0 => Duration::ZERO,
            rate => Duration::from_secs(1) / rate,
        };
        let mut records = 0;
        let mut pauses_ms = Vec::with_capacity(total as usize);
        for (done, (slot, from, dest)) in moves.into_iter().enumerate() {
            if inner.closing.load(Ordering::Acquire) {
                return Err(ResizeError::Interrupted { reason: "the engine is shutting down" });
            }
            let started = Instant::now();
            let moved = self.move_slot(SlotMove { slot, from, to: dest })?;
            records += moved;
            metrics::counter!("oncegate_slot_moves_total").increment(1);
            metrics::counter!("oncegate_slot_moved_records_total").increment(moved);
            let took = started.elapsed();
            metrics::histogram!("oncegate_slot_move_seconds").record(took.as_secs_f64());
            pauses_ms.push(took.as_secs_f64() * 1_000.0);
            progress(done as u32 + 1, total);
            // Pacing, not synchronisation: it leaves the disk to the traffic between moves.
            std::thread::sleep(pause.saturating_sub(started.elapsed()));
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

    /// Moves one slot; returns the records it carried.
    fn move_slot(&self, step: SlotMove) -> Result<u64, ResizeError> {
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
            table.moving = Some(Moving::new(step));
            shards
        };
        inner.cx.slots.set_moving(Some(step));
        let mut parked = Parked::default();
        let records = match self.copy_slot(step, &source, &destination, &mut parked) {
            Ok(records) => records,
            Err(error) => {
                self.end_move(step, None, parked);
                let _ = destination.control.send(Control::DropSlot(step.slot));
                return Err(error);
            }
        };
        stop_point(inner)?;
        let map = match self.flip(step) {
            Ok(map) => map,
            Err(error) => return Err(self.undo_flip(step, &destination, parked, error)),
        };
        stop_point(inner)?;
        self.end_move(step, Some(map), parked);
        let _ = source.control.send(Control::DropSlot(step.slot));
        Ok(records)
    }

    /// Steps 1 and 2: the source hands the slot over, the destination writes it durably.
    /// The slot's parked reserves are kept in `parked` for whichever shard owns the slot
    /// at the end.
    fn copy_slot(
        &self,
        step: SlotMove,
        source: &ShardHandle,
        destination: &ShardHandle,
        parked: &mut Parked,
    ) -> Result<u64, ResizeError> {
        let failed = |shard: u32| move |source: Error| ResizeError::Shard { shard, source };
        let gone = |shard: u32| not_running(shard, "the shard stopped");
        let (reply, handover) = crossbeam_channel::bounded(1);
        source.data.send(Mail::MoveOut(MoveOut { slot: step.slot, reply })).map_err(|_| gone(step.from))?;
        let mut handover = handover.recv().map_err(|_| gone(step.from))?.map_err(failed(step.from))?;
        *parked = handover.take_parked();
        stop_point(&self.inner)?;
        let (reply, written) = crossbeam_channel::bounded(1);
        destination.control.send(Control::MoveIn(handover, reply)).map_err(|_| gone(step.to))?;
        written.recv().map_err(|_| gone(step.to))?.map_err(failed(step.to))
    }

    /// Step 3: the map with the slot at its destination, durable before it is returned.
    fn flip(&self, step: SlotMove) -> Result<SlotMap, ResizeError> {
        let mut map = self.inner.table().map.clone();
        map.set_owner(step.slot, step.to);
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
                self.end_move(step, None, parked);
                let _ = destination.control.send(Control::DropSlot(step.slot));
            }
            Err(again) => {
                tracing::error!(slot = step.slot, %error, %again, "the slot map could not be written; the slot answers unavailable until a restart");
                let stuck = ResizeError::SlotStuck {
                    slot: step.slot,
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
