//! Adding shards to a stopped data directory: `oncegate reshard --data-dir DIR --to N`.
//!
//! The slots are spread evenly over the new count, moving slots only from the shards
//! there were to the new ones, a group at a time (every slot going from one shard to
//! another). Each group takes three durable steps, and a crash after any of them leaves a
//! directory that opens with every key answered as before:
//!
//! 1. the destination copies the group's records (one transaction, which first drops
//!    any rows of those slots an earlier attempt left, and raises its counters over the
//!    copied tokens and times); the map still sends the slots to the source, and a
//!    shard deletes at open the rows of slots it does not own;
//! 2. the map gives the slots to the destination (atomic rewrite of `oncegate.slots`);
//! 3. the source deletes its copies (which its next open would otherwise do).
//!
//! Before any slot moves, every new shard's token epoch is set above every existing
//! shard's, so a moved key's next grant is above every token its old shard issued; then
//! the manifest records the new count. Running the command again after a crash resumes
//! the moves that are left. Online moves, with traffic, are the next step of issue 15.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use crate::files::{Files, OsFiles};
use crate::slots::{self, SlotMap};
use crate::store::Tuning;
use crate::store::sqlite::Store;
use crate::{EngineConfig, Faults, OpenError, manifest};

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
pub fn add_shards(config: &EngineConfig, to: u32, progress: Progress<'_>) -> Result<Resharded, OpenError> {
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
) -> Result<Resharded, OpenError> {
    let _lock = manifest::lock(&*files, &config.data_dir)?;
    // A directory of another store (a PostgreSQL node's, the log store's) is refused
    // before anything changes. Settled first, so that a PostgreSQL node's directory (no
    // manifest) hears why, whatever kind the command was given.
    let mut config = config.clone();
    if manifest::is_node_dir(&*files, &config.data_dir)? {
        return Err(OpenError::Unsupported { what: crate::grow::NO_SLOTS_ON_POSTGRES });
    }
    let kind = manifest::settle_store_kind(&*files, &mut config)?;
    if kind == crate::StoreKind::Postgres {
        return Err(OpenError::Unsupported { what: crate::grow::NO_SLOTS_ON_POSTGRES });
    }
    let dir = &config.data_dir;
    let manifest = manifest::read(&*files, dir)?.ok_or_else(|| OpenError::Manifest {
        path: dir.join(manifest::MANIFEST_FILE),
        reason: "not found: this is not a data directory".to_owned(),
    })?;
    let config = &config;
    let before = manifest.shards;
    if to < before || to > crate::config::SHARDS_MAX {
        return Err(OpenError::Config(vec![oncegate_core::Problem::new(
            "to",
            format!(
                "is {to}; the directory has {before} shards, and shards can be added up to {}, never removed",
                crate::config::SHARDS_MAX
            ),
        )]));
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
    let tuning = Tuning { durability: crate::Durability::Full, ..Tuning::of(config, files, None, routing) };
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
) -> Result<(), OpenError> {
    let epoch = (0..to)
        .map(|shard| manifest::read_epoch(files, &manifest::epoch_file(dir, shard)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| OpenError::Io { path: dir.to_owned(), source })?
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
        + 1;
    for shard in manifest.shards..to {
        let path = manifest::epoch_file(dir, shard);
        manifest::write_epoch(files, &path, epoch).map_err(|source| OpenError::Io { path, source })?;
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
) -> Result<u64, OpenError> {
    let shard_error =
        |shard: u32| move |e: crate::store::StoreError| OpenError::Shard { shard, reason: e.to_string() };
    let dir = &config.data_dir;
    let (mut source, source_meta, _) =
        Store::open(&manifest::shard_file(dir, from), tuning, faults, false).map_err(shard_error(from))?;
    let (mut destination, destination_meta, _) =
        Store::open(&manifest::shard_file(dir, dest), tuning, faults, false).map_err(shard_error(dest))?;
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
fn step(faults: &Faults) -> Result<(), OpenError> {
    if faults.op_should_fail() {
        return Err(OpenError::Interrupted { reason: "injected fault: reshard stopped".to_owned() });
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
