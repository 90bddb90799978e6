//! The slot map: which shard owns each of the 16,384 slots that keys hash onto
//! (`oncegate_core::route`), persisted in the data directory beside the manifest.
//!
//! Until this map existed, a key's shard was `slot % shards`, computed; a directory made
//! then is given exactly that map the first time this version opens it, so no key moves.
//! From then on the map is the only truth about where a key lives, and the manifest's
//! `routing` says so: a directory whose manifest names the map but whose map file is gone
//! or damaged is refused, never given a computed map, because after a slot has moved a
//! computed map would send its keys to a shard that has never seen them.
//!
//! The file (`oncegate.slots`) is binary and small (32 KiB): a magic line, the map's
//! version (raised by every change), the slot count, one little-endian `u16` owner per
//! slot, and an xxh3-64 checksum of everything before it. It is written only through
//! `files::write_atomically` (temporary file, fsync, rename, fsync of the directory), so a
//! crash leaves the old map or the new one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use oncegate_core::route::{Routing, SLOT_COUNT, shard_of_slot};

use crate::files::{Files, write_atomically};

/// The slot map's file name inside the data directory.
pub const SLOTS_FILE: &str = "oncegate.slots";

const MAGIC: &[u8] = b"oncegate slot map v1\n";

/// What is wrong with a slot map file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SlotMapError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The file is not a slot map this version can trust.
    #[error("slot map {path}: {reason}")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// Which shard owns each slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMap {
    /// Raised by every change of an owner; 1 for a new map.
    pub version: u64,
    owners: Vec<u16>,
}

impl SlotMap {
    /// Slots spread over `shards` as keys were routed before the map existed:
    /// `slot % shards`.
    pub fn even(shards: u32) -> SlotMap {
        let owners = (0..SLOT_COUNT).map(|slot| shard_of_slot(slot, shards) as u16).collect();
        SlotMap { version: 1, owners }
    }

    /// The shard that owns `slot`.
    pub fn owner(&self, slot: u32) -> u32 {
        u32::from(self.owners[slot as usize])
    }

    /// How many slots each of `shards` shards owns.
    pub fn slots_per_shard(&self, shards: u32) -> Vec<u32> {
        let mut counts = vec![0; shards as usize];
        for owner in &self.owners {
            if let Some(count) = counts.get_mut(usize::from(*owner)) {
                *count += 1;
            }
        }
        counts
    }

    /// Gives `slot` to `shard` (the caller raises `version` once per persisted change).
    pub fn set_owner(&mut self, slot: u32, shard: u32) {
        self.owners[slot as usize] = shard as u16;
    }

    /// The moves `(slot, from, to)` that spread the slots evenly over `shards` (each owns
    /// 16,384 / `shards` slots, the first few one more), taking slots only from shards
    /// over their share: adding shards moves no slot between the shards that were there.
    /// The same map always gives the same moves, so a move cut short resumes where it was.
    pub fn moves_to_spread(&self, shards: u32) -> Vec<(u32, u32, u32)> {
        let share = |shard: u32| SLOT_COUNT / shards + u32::from(shard < SLOT_COUNT % shards);
        let mut counts = self.slots_per_shard(shards);
        let mut moves = Vec::new();
        let mut receiver = 0;
        for slot in 0..SLOT_COUNT {
            let from = self.owner(slot);
            if counts[from as usize] <= share(from) {
                continue;
            }
            while receiver < shards && counts[receiver as usize] >= share(receiver) {
                receiver += 1;
            }
            if receiver == shards {
                break;
            }
            counts[from as usize] -= 1;
            counts[receiver as usize] += 1;
            moves.push((slot, from, receiver));
        }
        moves
    }

    /// The file's bytes.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAGIC.len() + 12 + self.owners.len() * 2 + 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.owners.len() as u32).to_le_bytes());
        for owner in &self.owners {
            out.extend_from_slice(&owner.to_le_bytes());
        }
        let checksum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Reads a map back, refusing anything but a whole, unaltered map whose owners are
    /// all below `shards`.
    fn decode(bytes: &[u8], shards: u32) -> Result<SlotMap, String> {
        let body_len = bytes.len().checked_sub(8).ok_or("the file is truncated")?;
        let (body, checksum) = bytes.split_at(body_len);
        if xxhash_rust::xxh3::xxh3_64(body).to_le_bytes() != checksum {
            return Err("its checksum does not match (the file is damaged)".to_owned());
        }
        let rest = body.strip_prefix(MAGIC).ok_or("it does not start with the slot map's header")?;
        let (version, rest) = rest.split_at_checked(8).ok_or("the file is truncated")?;
        let (count, rest) = rest.split_at_checked(4).ok_or("the file is truncated")?;
        let version = u64::from_le_bytes(version.try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(count.try_into().expect("4 bytes"));
        if count != SLOT_COUNT || rest.len() != SLOT_COUNT as usize * 2 {
            return Err(format!("it maps {count} slots; this version routes {SLOT_COUNT}"));
        }
        let owners: Vec<u16> =
            rest.chunks_exact(2).map(|pair| u16::from_le_bytes([pair[0], pair[1]])).collect();
        if let Some(slot) = owners.iter().position(|owner| u32::from(*owner) >= shards) {
            return Err(format!(
                "slot {slot} belongs to shard {}, but the directory has {shards} shards",
                owners[slot]
            ));
        }
        Ok(SlotMap { version, owners })
    }
}

/// Slots that move together: one for an add-shards while serving, a group for an
/// offline reshard. Sorted, without repeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slots(Arc<[u32]>);

impl Slots {
    /// One slot.
    pub fn one(slot: u32) -> Slots {
        Slots(Arc::from([slot]))
    }

    /// These slots, sorted.
    pub fn of(mut slots: Vec<u32>) -> Slots {
        slots.sort_unstable();
        slots.dedup();
        Slots(slots.into())
    }

    /// Whether `slot` is one of them.
    pub fn contains(&self, slot: u32) -> bool {
        self.0.binary_search(&slot).is_ok()
    }

    /// Whether any slot is in both.
    pub fn overlaps(&self, other: &Slots) -> bool {
        self.0.iter().any(|slot| other.contains(*slot))
    }

    /// The slots, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `slot 17`, or `slots 17 to 9000 (256)`.
impl std::fmt::Display for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.0 {
            [one] => write!(f, "slot {one}"),
            [first, .., last] => write!(f, "slots {first} to {last} ({})", self.0.len()),
            [] => f.write_str("no slot"),
        }
    }
}

/// Slots on their way from one shard to another (`shard/moves.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMove {
    /// The slots.
    pub slots: Slots,
    /// The shard that owns it until the map is flipped.
    pub from: u32,
    /// The shard that owns it after.
    pub to: u32,
}

/// The slots one shard owns, as its store checks them at open.
#[derive(Clone, Debug)]
pub struct Owned {
    /// The map.
    pub map: Arc<SlotMap>,
    /// The shard.
    pub shard: u32,
    /// Slots being moved: both their shards keep their rows until the move ends, because
    /// until the map is flipped the source's rows are the truth, and after it the
    /// destination's copies are.
    pub moving: Option<SlotMove>,
}

impl Owned {
    /// Whether the shard keeps the rows of `slot`.
    pub fn owns(&self, slot: u32) -> bool {
        self.map.owner(slot) == self.shard
            || self
                .moving
                .as_ref()
                .is_some_and(|m| m.slots.contains(slot) && (m.from == self.shard || m.to == self.shard))
    }
}

/// The map as a running engine has it, for shards that open (or reopen) while slots
/// move. Only the mover writes it, and never while it waits for a shard, so a shard that
/// takes the lock at open never waits for a move.
#[derive(Debug)]
pub(crate) struct LiveMap {
    state: Mutex<(Arc<SlotMap>, Option<SlotMove>)>,
    /// How keys hash onto slots; fixed for the directory's life.
    pub routing: Routing,
}

impl LiveMap {
    pub fn new(map: SlotMap, routing: Routing) -> LiveMap {
        LiveMap { state: Mutex::new((Arc::new(map), None)), routing }
    }

    /// What `shard` keeps rows of now.
    pub fn owned(&self, shard: u32) -> Owned {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        Owned { map: Arc::clone(&state.0), shard, moving: state.1.clone() }
    }

    /// A move starts or ends (`None`).
    pub fn set_moving(&self, moving: Option<SlotMove>) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = moving;
    }

    /// The map was flipped: `map` is the new one, and no slot is moving.
    pub fn set_map(&self, map: SlotMap) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = (Arc::new(map), None);
    }
}

/// The slot map file of a data directory.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(SLOTS_FILE)
}

/// Reads the map; `None` when the file does not exist.
pub fn read(files: &dyn Files, data_dir: &Path, shards: u32) -> Result<Option<SlotMap>, SlotMapError> {
    let path = path(data_dir);
    match files.read(&path) {
        Ok(bytes) => {
            SlotMap::decode(&bytes, shards).map(Some).map_err(|reason| SlotMapError::Damaged { path, reason })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SlotMapError::Io { path, source }),
    }
}

/// Persists the map; returns only once it is durable.
pub fn write(files: &dyn Files, data_dir: &Path, map: &SlotMap) -> Result<(), SlotMapError> {
    let path = path(data_dir);
    write_atomically(files, &path, &map.encode()).map_err(|source| SlotMapError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_even_map_routes_as_slot_mod_shards_did() {
        for shards in [1, 2, 3, 7, 1024] {
            let map = SlotMap::even(shards);
            assert!((0..SLOT_COUNT).all(|slot| map.owner(slot) == slot % shards));
            let counts = map.slots_per_shard(shards);
            assert_eq!(counts.iter().sum::<u32>(), SLOT_COUNT);
            assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "{counts:?}");
        }
    }

    #[test]
    fn spreading_over_more_shards_moves_only_to_the_new_ones_and_evenly() {
        let mut map = SlotMap::even(2);
        let moves = map.moves_to_spread(4);
        assert_eq!(moves.len(), 8_192);
        assert!(moves.iter().all(|(_, from, to)| *from < 2 && *to >= 2));
        for (slot, _, to) in &moves {
            map.set_owner(*slot, *to);
        }
        assert_eq!(map.slots_per_shard(4), vec![4_096; 4]);
        assert!(map.moves_to_spread(4).is_empty(), "spread already");
        // Cut short half-way, the rest is exactly what was left.
        let mut half = SlotMap::even(3);
        let moves = half.moves_to_spread(7);
        for (slot, _, to) in &moves[..moves.len() / 2] {
            half.set_owner(*slot, *to);
        }
        assert_eq!(half.moves_to_spread(7), moves[moves.len() / 2..].to_vec());
    }

    #[test]
    fn a_map_reads_back_as_written_and_damage_is_refused() {
        let mut map = SlotMap::even(4);
        map.version = 9;
        map.owners[77] = 3;
        let bytes = map.encode();
        assert_eq!(SlotMap::decode(&bytes, 4), Ok(map.clone()));
        let mut flipped = bytes.clone();
        flipped[MAGIC.len() + 20] ^= 1;
        assert!(SlotMap::decode(&flipped, 4).unwrap_err().contains("checksum"));
        assert!(SlotMap::decode(&bytes[..bytes.len() - 3], 4).is_err(), "truncated");
        assert!(SlotMap::decode(&bytes, 3).unwrap_err().contains("shard 3"), "an owner past the shard count");
        assert!(SlotMap::decode(b"", 4).is_err());
    }
}
