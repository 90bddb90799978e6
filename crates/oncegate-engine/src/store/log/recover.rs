//! Reading the log at open: the chain of frames from the oldest segment, every complete
//! transaction applied to the index, the schedule and the counts.
//!
//! The chain ends at the first frame that does not continue it: a torn or unsynced write
//! (the transaction it belongs to was never acknowledged), zeros, or a stale frame of a
//! recycled segment. With `durability = "full"` a frame is written only once every frame
//! before it is durable (a transaction spanning segments syncs each before writing the
//! next), and says so (its `ordered` flag): so past the chain's end, no whole ordered
//! frame can be numbered beyond the end's next one. If one is, the end is damage in
//! acknowledged history, and the log is refused as corrupt instead of being cut there
//! (the transactions after the damage would be lost, and their keys granted again).
//! Finding such a frame reads the rest of the log past the end, once, at open.

use std::collections::HashMap;

use oncegate_core::Tenant;
use oncegate_core::route::slot_of_hash;

use super::format::{self, Entry, FRAME_HEADER_BYTES};
use super::{Chain, Store, decode_at, position, segment_name, split};
use crate::quota::Tally;
use crate::slots::Owned;
use crate::store::{Meta, StoreError};

/// What recovery found.
pub(super) struct Recovered {
    /// The counters the last transaction left, raised over every record.
    pub meta: Meta,
    /// Whether the log is new (no transaction in it).
    pub created: bool,
    /// The live records of slots the shard does not own: left in the index for the open
    /// to delete, but neither counted nor scheduled.
    pub foreign: Vec<(u64, i64)>,
}

/// What recovery keeps of each live record until the counts are taken and the reclaim
/// schedule is filled.
struct LiveRecord {
    tenant: u32,
    pending: bool,
    len: u32,
    reclaim_at_ms: u64,
}

/// Recovery's pass over the segments.
#[derive(Default)]
struct Walk {
    /// The last accepted frame: its number and checksum.
    last: Option<(u64, u64)>,
    /// Where the last accepted frame ends: its segment and the offset after it.
    end: Option<(u32, usize)>,
    /// The chain after the last complete transaction: where writing resumes.
    committed: Option<Chain>,
    /// The counters: the last complete transaction's, raised over every record applied.
    meta: Meta,
    /// The entries of a transaction whose last frame is not read yet, with positions.
    open: Vec<(i64, Entry, usize)>,
    /// That transaction's frames: segment, start and end.
    open_frames: Vec<(u32, usize, usize)>,
    live: HashMap<i64, LiveRecord>,
    tenants: Vec<Tenant>,
    tenant_ids: HashMap<Tenant, u32>,
}

impl Store {
    /// Reads every segment in order, applying each complete transaction of the chain;
    /// sets the chain, the index, the schedule, the counts and where each segment's
    /// frames end. `owned` names the slots whose records are the shard's.
    pub(super) fn recover(&mut self, owned: Option<&Owned>) -> Result<Recovered, StoreError> {
        let mut walk = Walk::default();
        let numbers: Vec<u32> = self.segments.keys().copied().collect();
        let mut bytes = Vec::new();
        for seq in &numbers {
            self.read_segment(*seq, &mut bytes)?;
            match walk.segment(self, *seq, &bytes)? {
                Some(end) => self.ends.insert(*seq, end),
                None => break,
            };
        }
        let (end_seq, end_offset) = walk.end.unwrap_or((numbers.first().copied().unwrap_or(0), 0));
        let past = numbers
            .iter()
            .filter(|seq| **seq >= end_seq)
            .map(|seq| (*seq, if *seq == end_seq { end_offset } else { 0 }));
        self.refuse_ordered_frames_past(past.collect(), walk.last.map_or(0, |(seq, _)| seq))?;
        self.unwrite_incomplete(&walk.open_frames)?;
        let Some(chain) = walk.committed else {
            return Ok(Recovered { meta: walk.meta, created: true, foreign: Vec::new() });
        };
        self.chain = chain;
        // Segments after the head (the walk went on into them only for frames of a
        // transaction that did not complete) are spares: forget where their frames ended.
        self.ends.retain(|seq, _| *seq < chain.head);
        // The counters above cover foreign records too: their tokens and times were
        // issued here.
        let foreign: Vec<(u64, i64)> = match owned {
            Some(owned) => self.index.iter().filter(|(hash, _)| !owned.owns(slot_of_hash(*hash))).collect(),
            None => Vec::new(),
        };
        // Only live records are scheduled: an entry per record ever applied would be one
        // per write (twice the keys for reserves and their commits).
        let mut tally = Tally::default();
        for (_, position) in &foreign {
            if let Some(record) = walk.live.remove(position) {
                self.live_bytes += u64::from(record.len);
            }
        }
        for record in walk.live.values() {
            tally.add_stored(&walk.tenants[record.tenant as usize], record.pending);
            self.live_bytes += u64::from(record.len);
        }
        for (hash, position) in self.index.iter() {
            if let Some(record) = walk.live.get(&position) {
                self.schedule.add(record.reclaim_at_ms, super::txn::schedule_entry(hash));
            }
        }
        self.schedule.shrink_to_fit();
        self.tally = Some(tally);
        Ok(Recovered { meta: walk.meta, created: false, foreign })
    }

    /// Zeroes the frames of a transaction the walk found incomplete (cut off by a crash,
    /// or left whole by a commit taken back whose zeros could not be synced), last frame
    /// first, each synced, before anything is written. Left there, they outlived the
    /// open's own commit, which goes where the first of them was: the second, no longer
    /// chained, ended the chain, and a third or later one, whole and ordered, was numbered
    /// past it by more than one, so the next open refused the log as damaged. A failure
    /// here fails the open, which is tried again.
    ///
    /// First, the place of the frame that would have come next (the start of the next
    /// segment: a transaction's frames after its first each open a segment) is zeroed and
    /// synced: that frame may be whole on the disk, unread here only because its zeros,
    /// written by a commit taken back in this process, sit unsynced in the page cache.
    /// Zeros over the earlier frames reaching the disk without those would leave that
    /// frame past the chain's end, numbered beyond its next: the same damage.
    fn unwrite_incomplete(&self, frames: &[(u32, usize, usize)]) -> Result<(), StoreError> {
        if let Some(&(last, _, _)) = frames.last()
            && let Some(next) = self.segments.get(&(last + 1))
        {
            next.write_at(0, &[0; FRAME_HEADER_BYTES]).map_err(super::io(&self.dir))?;
            next.sync_data().map_err(super::io(&self.dir))?;
        }
        for &(seq, start, end) in frames.iter().rev() {
            let file = &self.segments[&seq];
            file.write_at(start as u64, &vec![0; end - start]).map_err(super::io(&self.dir))?;
            file.sync_data().map_err(super::io(&self.dir))?;
        }
        Ok(())
    }

    /// Refuses the log when the bytes past the chain's end (`past`: segments from where
    /// each is to be read) hold a whole ordered frame numbered beyond `last_seq + 1`.
    fn refuse_ordered_frames_past(&self, past: Vec<(u32, usize)>, last_seq: u64) -> Result<(), StoreError> {
        let mut bytes = Vec::new();
        for (seq, from) in past {
            self.read_segment(seq, &mut bytes)?;
            if let Some(found) = format::ordered_frame_past(&bytes, from, last_seq) {
                return Err(StoreError::Corrupt(format!(
                    "the log's frames end after frame {last_seq}, yet {} holds frame {found}, written after it was durable: a frame in between is damaged",
                    segment_name(seq)
                )));
            }
        }
        Ok(())
    }
}

impl Walk {
    /// Applies the frames of one segment; returns where its accepted frames end, or
    /// `None` when it holds none (the chain ended before it).
    fn segment(&mut self, store: &mut Store, seq: u32, bytes: &[u8]) -> Result<Option<u64>, StoreError> {
        let mut offset = 0usize;
        while let Some(header) = format::read_header(&bytes[offset..], bytes.len() - offset) {
            let end = offset + FRAME_HEADER_BYTES + header.payload_len as usize;
            let continues = match self.last {
                None => offset == 0,
                Some((last_seq, checksum)) => header.seq == last_seq + 1 && header.prev == checksum,
            };
            if !continues || !format::frame_intact(&bytes[offset..end], &header) {
                break;
            }
            let mut at = offset + FRAME_HEADER_BYTES;
            while at < end {
                let (entry, len) = decode_at(&bytes[at..end])?;
                self.open.push((position(seq, at as u64), entry, len));
                at += len;
            }
            self.last = Some((header.seq, header.checksum));
            self.end = Some((seq, end));
            self.open_frames.push((seq, offset, end));
            if header.last {
                self.open_frames.clear();
                for (position, entry, len) in std::mem::take(&mut self.open) {
                    self.apply(store, (seq, bytes), position, entry, len)?;
                }
                self.meta = self.meta.max(header.meta);
                self.committed =
                    Some(Chain { seq: header.seq, checksum: header.checksum, head: seq, tail: end as u64 });
            }
            offset = end;
        }
        Ok((offset > 0).then_some(offset as u64))
    }

    /// Applies one entry of a complete transaction; `current` is the segment being walked
    /// and its bytes.
    fn apply(
        &mut self,
        store: &mut Store,
        current: (u32, &[u8]),
        position: i64,
        entry: Entry,
        len: usize,
    ) -> Result<(), StoreError> {
        match entry {
            Entry::Tombstone { hash, position: gone } => {
                if store.index.ids(hash).any(|p| p == gone) {
                    store.index.remove(hash, gone);
                    self.live.remove(&gone);
                }
            }
            Entry::Record { hash, scope, record } => {
                let earlier: Vec<i64> = store.index.ids(hash).collect();
                for candidate in earlier {
                    if let Some((Entry::Record { scope: other, .. }, _)) =
                        entry_at(store, current, candidate)?
                        && other == scope
                    {
                        store.index.remove(hash, candidate);
                        self.live.remove(&candidate);
                    }
                }
                // The counters cover every record, as the SQLite file's rows do: a frame's
                // counters are its transaction's, and no record may hold more.
                self.meta.next_token = self.meta.next_token.max(record.token.saturating_add(1));
                if let Some(event) = record.history.last() {
                    self.meta.high_water_ms = self.meta.high_water_ms.max(event.at_ms);
                }
                store.index.insert(hash, position);
                let tenant = self.tenant_id(&scope.tenant);
                let (pending, len, reclaim_at_ms) =
                    (record.completion.is_none(), len as u32, record.reclaim_at_ms());
                self.live.insert(position, LiveRecord { tenant, pending, len, reclaim_at_ms });
            }
        }
        Ok(())
    }

    fn tenant_id(&mut self, tenant: &Tenant) -> u32 {
        if let Some(id) = self.tenant_ids.get(tenant) {
            return *id;
        }
        let id = self.tenants.len() as u32;
        self.tenants.push(tenant.clone());
        self.tenant_ids.insert(tenant.clone(), id);
        id
    }
}

/// The entry at `position`: from the bytes of the segment being walked when it is there
/// (where a key's earlier record usually is: a commit follows its reserve closely), else
/// read back from its segment. Read back every time, the earlier records of 2 M keys
/// written by a reserve and a commit each cost the open a third of its time.
fn entry_at(
    store: &Store,
    current: (u32, &[u8]),
    position: i64,
) -> Result<Option<(Entry, usize)>, StoreError> {
    let (seq, offset) = split(position);
    match current.1.get(offset as usize..) {
        Some(bytes) if seq == current.0 => decode_at(bytes).map(Some),
        _ => store.read_entry(position),
    }
}
