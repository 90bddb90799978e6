//! One shard's log of its own: a directory of fixed-size segment files to which each
//! transaction appends one frame of entries, synced before the transaction answers.
//!
//! SQLite writes whole pages for each commit, and its B-tree and VDBE work is most of what
//! a shard spends per command (docs/benchmarks.md, "A log of our own"). Here a commit is
//! one positioned write of the batch's entries and one `fdatasync`; a segment is
//! zero-filled once (by a helper thread, before it is needed) and recycled after
//! compaction, so a sync changes data blocks only, never the file's size or extents.
//!
//! - **Memory** is the truth for finding things, the log for what they are: the
//!   [`Index`] maps each key's hash to the position (`segment << 32 | offset`) of its
//!   latest record, and the [`Schedule`] files positions by reclaim window, both rebuilt
//!   by reading the log at open. A record is read back from its segment when it is
//!   decided on (the last committed frames are kept in memory for the commit that
//!   usually follows a reserve).
//! - **Durability**: `commit` writes the frames, syncs each segment it wrote, and only
//!   then changes the in-memory state the next transaction sees. Any failure leaves the
//!   shard to drop the store and open it again from the disk.
//! - **Recovery** walks the frame chain (`format.rs`) from the oldest segment and applies
//!   every complete transaction; where the chain ends, the next frame is written.
//! - **Compaction** is first in, first out: while the log holds more than twice its live
//!   bytes, each commit also copies the live records of the oldest segment's next frames
//!   to the head (at most `COMPACT_BYTES_PER_COMMIT`), and a segment copied whole is
//!   retired (kept as the next spare, or removed). Tombstones of the oldest segment are
//!   dropped with it: no older segment is left for them to hide anything in.

mod format;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use oncegate_core::route::Routing;
use oncegate_core::{Record, Scope, Tenant};

use self::format::{Entry, FRAME_HEADER_BYTES};
use super::{Meta, StoreError};
use crate::files::{Files, SegmentFile};
use crate::index::{Index, Undo};
use crate::quota::Tally;
use crate::schedule::Schedule;
use crate::{Durability, Faults};

/// The most bytes of live records one commit copies out of the oldest segment.
const COMPACT_BYTES_PER_COMMIT: usize = 256 * 1024;
/// The chunk a spare segment is zero-filled with.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// What an entry read is first tried with; a longer entry takes a second read.
const READ_GUESS_BYTES: usize = 1024;

/// A segment's file name: its number in hex, so that names sort as numbers do.
fn segment_name(seq: u32) -> String {
    format!("{seq:08x}.seg")
}

fn parse_segment_name(name: &str) -> Option<u32> {
    u32::from_str_radix(name.strip_suffix(".seg")?, 16).ok()
}

/// The position of an entry: its segment and its offset there.
fn position(seq: u32, offset: u64) -> i64 {
    (i64::from(seq) << 32) | offset as i64
}

fn split(position: i64) -> (u32, u64) {
    ((position >> 32) as u32, (position & 0xffff_ffff) as u64)
}

/// The settings of a shard's log.
pub(crate) struct Tuning {
    pub durability: Durability,
    /// Every segment's size.
    pub segment_bytes: u64,
    /// The most bytes the log's segments take together (spares included).
    pub bytes_max: u64,
    pub reclaim_granularity_ms: u64,
    pub files: Arc<dyn Files>,
    pub routing: Routing,
}

impl Tuning {
    /// The settings of an engine's shard logs.
    pub fn of(config: &crate::EngineConfig, files: Arc<dyn Files>, routing: Routing) -> Tuning {
        Tuning {
            durability: config.durability,
            segment_bytes: config.store.log_segment_bytes,
            bytes_max: config.shard_file_bytes_max,
            reclaim_granularity_ms: config.reclaim_granularity_ms,
            files,
            routing,
        }
    }
}

/// Where the chain of frames stands: the last accepted frame, and where the next goes.
#[derive(Clone, Copy, Debug)]
struct Chain {
    seq: u64,
    checksum: u64,
    head: u32,
    tail: u64,
}

/// The oldest segment being copied forward: where its next frame starts, and the frame
/// number that frame must have.
#[derive(Clone, Copy, Debug)]
struct Compaction {
    seq: u32,
    offset: u64,
    frame_seq: Option<u64>,
}

pub(crate) struct Store {
    dir: PathBuf,
    files: Arc<dyn Files>,
    faults: Faults,
    durability: Durability,
    routing: Routing,
    segment_bytes: u64,
    segments_max: u64,
    /// Every segment file by number: the live ones up to the head, then spares.
    segments: BTreeMap<u32, Box<dyn SegmentFile>>,
    /// The thread zero-filling the next spare, if one is.
    preparing: Option<JoinHandle<std::io::Result<u32>>>,
    chain: Chain,
    /// Mixed into every frame this open writes, so that no frame of it can be mistaken
    /// for a stale one at the same place in the chain.
    salt: u64,
    index: Index,
    schedule: Schedule,
    /// Bytes of records the index points at.
    live_bytes: u64,
    compaction: Option<Compaction>,
    /// The last committed frames (segment, offset, bytes): the next batch's commits read
    /// the records its reserves wrote from here.
    recent: Vec<(u32, u64, Vec<u8>)>,
    /// The record counts read at open, until the shard takes them.
    tally: Option<Tally>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(preparing) = self.preparing.take() {
            let _ = preparing.join();
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_owned(), source }
}

/// A random number for the salt (std's hasher keys are random per process and per call).
fn random_salt() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    hasher.finish()
}

/// What recovery keeps of each live record until the counts are taken.
struct LiveRecord {
    tenant: u32,
    pending: bool,
    len: u32,
}

/// The log read at open: the index, schedule, counts and chain it gives.
struct Recovered {
    chain: Option<Chain>,
    meta: Meta,
    live: HashMap<i64, LiveRecord>,
    tenants: Vec<Tenant>,
}

impl Store {
    /// Opens (creating if needed) the log in `dir` and reads it whole. Returns the store,
    /// the counters its last transaction left, and whether it was new.
    pub fn open(dir: &Path, tuning: &Tuning, faults: &Faults) -> Result<(Store, Meta, bool), StoreError> {
        if faults.open_should_fail() {
            return Err(StoreError::Injected("open"));
        }
        let files = Arc::clone(&tuning.files);
        files.create_dir_all(dir).map_err(io(dir))?;
        let mut numbers: Vec<u32> =
            files.list(dir).map_err(io(dir))?.iter().filter_map(|n| parse_segment_name(n)).collect();
        numbers.sort_unstable();
        let mut segments = BTreeMap::new();
        for seq in numbers {
            let path = dir.join(segment_name(seq));
            segments.insert(seq, files.open_segment(&path).map_err(io(&path))?);
        }
        let mut store = Store {
            dir: dir.to_owned(),
            files,
            faults: faults.clone(),
            durability: tuning.durability,
            routing: tuning.routing,
            segment_bytes: tuning.segment_bytes,
            segments_max: (tuning.bytes_max / tuning.segment_bytes).max(2),
            segments,
            preparing: None,
            chain: Chain { seq: 0, checksum: 0, head: 1, tail: 0 },
            salt: random_salt(),
            index: Index::default(),
            schedule: Schedule::new(tuning.reclaim_granularity_ms),
            live_bytes: 0,
            compaction: None,
            recent: Vec::new(),
            tally: None,
        };
        let recovered = store.recover()?;
        let created = recovered.chain.is_none();
        match recovered.chain {
            Some(chain) => store.chain = chain,
            None => {
                let first = store.segments.keys().next().copied().unwrap_or(1);
                store.chain.head = first;
                store.segment(first)?;
            }
        }
        // Segments before the head that hold no frame of the chain (a recycled spare whose
        // first frame was lost cannot be one: the chain starts at the oldest segment) and
        // every one past the head are spares; numbers below the oldest are never reused.
        let mut tally = Tally::default();
        for record in recovered.live.values() {
            tally.add_stored(&recovered.tenants[record.tenant as usize], record.pending);
            store.live_bytes += u64::from(record.len);
        }
        store.tally = Some(tally);
        Ok((store, recovered.meta, created))
    }

    /// The segment file `seq`, opened (and its name made durable) if it is new.
    fn segment(&mut self, seq: u32) -> Result<&dyn SegmentFile, StoreError> {
        if !self.segments.contains_key(&seq) {
            let path = self.dir.join(segment_name(seq));
            let file = self.files.open_segment(&path).map_err(io(&path))?;
            self.files.sync_dir(&self.dir).map_err(io(&self.dir))?;
            self.segments.insert(seq, file);
        }
        Ok(&*self.segments[&seq])
    }

    /// Reads every segment in order, applying each complete transaction of the chain.
    fn recover(&mut self) -> Result<Recovered, StoreError> {
        let mut walk = Walk::default();
        let numbers: Vec<u32> = self.segments.keys().copied().collect();
        for seq in numbers {
            let file = &self.segments[&seq];
            let len = file.size().map_err(io(&self.dir))?.min(self.segment_bytes) as usize;
            let mut bytes = vec![0; len];
            let read = file.read_at(0, &mut bytes).map_err(io(&self.dir))?;
            bytes.truncate(read);
            if !walk.segment(self, seq, &bytes)? {
                break;
            }
        }
        Ok(Recovered { chain: walk.committed, meta: walk.meta, live: walk.live, tenants: walk.tenants })
    }

    /// Starts a write transaction at the shard's time `now_ms`. Its first frame starts
    /// where the chain ends, or in the next segment when not even a frame's header would
    /// fit there.
    pub fn begin(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        let (mut head, mut tail) = (self.chain.head, self.chain.tail);
        if tail + FRAME_HEADER_BYTES as u64 > self.segment_bytes {
            self.take_prepared(true)?;
            head += 1;
            tail = 0;
            self.segment(head)?;
        }
        Ok(Txn::new(self, now_ms, head, tail))
    }

    /// A read transaction: the same, never committed.
    pub fn begin_read(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        self.begin(now_ms)
    }

    /// How many stored records are pending and how many completed, by tenant, as read at
    /// open; the shard keeps them up to date.
    pub fn take_count(&mut self) -> Tally {
        self.tally.take().unwrap_or_default()
    }

    /// When the reclaim schedule next has records to take.
    pub fn next_reclaim_ms(&self) -> Option<u64> {
        self.schedule.next_ms()
    }

    /// The (hash, position) of every live record of `slot`.
    pub fn slot_rows(&self, slot: u32) -> Vec<(u64, i64)> {
        self.index.iter().filter(|(hash, _)| oncegate_core::route::slot_of_hash(*hash) == slot).collect()
    }

    /// Reads the entry at `position` from the committed log; `None` when its segment is
    /// gone (retired: nothing in it is live).
    fn read_entry(&self, position: i64) -> Result<Option<(Entry, usize)>, StoreError> {
        let (seq, offset) = split(position);
        for (frame_seq, start, bytes) in &self.recent {
            if *frame_seq == seq && offset >= *start && offset < start + bytes.len() as u64 {
                return decode_at(&bytes[(offset - start) as usize..]).map(Some);
            }
        }
        let Some(file) = self.segments.get(&seq) else { return Ok(None) };
        let mut buf = vec![0; READ_GUESS_BYTES];
        let read = file.read_at(offset, &mut buf).map_err(io(&self.dir))?;
        buf.truncate(read);
        let len = format::entry_len(&buf).ok_or_else(|| corrupt_at(position))?;
        if len > buf.len() {
            let had = buf.len();
            buf.resize(len, 0);
            let more = file.read_at(offset + had as u64, &mut buf[had..]).map_err(io(&self.dir))?;
            if had + more < len {
                return Err(corrupt_at(position));
            }
        }
        decode_at(&buf).map(Some)
    }

    /// Whether compaction should copy more: the log holds more than twice its live
    /// bytes and at least three segments, or it is one segment short of its limit.
    fn compaction_due(&self) -> bool {
        let Some(oldest) = self.segments.keys().next().copied() else { return false };
        let used_segments = u64::from(self.chain.head - oldest) + 1;
        let used_bytes = (used_segments - 1) * self.segment_bytes + self.chain.tail;
        used_segments >= 3 && used_bytes > 2 * self.live_bytes + self.segment_bytes
            || used_segments + 1 >= self.segments_max && used_segments >= 2
    }

    /// Retires the oldest segment, copied whole: kept as the next spare when none is
    /// ready or being made, removed otherwise. Its name changes durably before anything
    /// else is written, so a crash leaves it either old (read again, harmlessly: every
    /// live record of it has a newer copy) or a spare.
    fn retire(&mut self, seq: u32) -> Result<(), StoreError> {
        let Some(file) = self.segments.remove(&seq) else { return Ok(()) };
        let path = self.dir.join(segment_name(seq));
        let spare = self.chain.head + 1;
        if self.preparing.is_none() && !self.segments.contains_key(&spare) {
            let to = self.dir.join(segment_name(spare));
            self.files.rename(&path, &to).map_err(io(&path))?;
            self.segments.insert(spare, file);
        } else {
            drop(file);
            self.files.remove(&path).map_err(io(&path))?;
        }
        self.files.sync_dir(&self.dir).map_err(io(&self.dir))?;
        self.compaction = None;
        Ok(())
    }

    /// Starts zero-filling the segment after the head, unless it exists or is under way.
    fn prepare_spare(&mut self) {
        let seq = self.chain.head + 1;
        if self.preparing.is_some() || self.segments.contains_key(&seq) {
            return;
        }
        let (files, dir, bytes) = (Arc::clone(&self.files), self.dir.clone(), self.segment_bytes);
        let spawned = std::thread::Builder::new()
            .name("oncegate-log-spare".into())
            .spawn(move || zero_fill(&*files, &dir, seq, bytes).map(|()| seq));
        // Without a thread, the roll opens the segment itself (it then grows as written).
        self.preparing = spawned.ok();
    }

    /// The spare the helper thread made, once it is done (waiting for it when asked to).
    fn take_prepared(&mut self, wait: bool) -> Result<(), StoreError> {
        if !self.preparing.as_ref().is_some_and(|p| wait || p.is_finished()) {
            return Ok(());
        }
        let preparing = self.preparing.take().expect("checked above");
        let seq = match preparing.join() {
            Ok(result) => result.map_err(io(&self.dir))?,
            Err(_) => return Err(StoreError::Corrupt("the thread preparing a log segment panicked".into())),
        };
        let path = self.dir.join(segment_name(seq));
        let file = self.files.open_segment(&path).map_err(io(&path))?;
        self.segments.insert(seq, file);
        Ok(())
    }
}

/// Creates segment `seq` full of zeros and makes it and its name durable.
fn zero_fill(files: &dyn Files, dir: &Path, seq: u32, bytes: u64) -> std::io::Result<()> {
    let file = files.open_segment(&dir.join(segment_name(seq)))?;
    let zeros = vec![0; ZERO_CHUNK_BYTES];
    let mut offset = 0;
    while offset < bytes {
        let n = (bytes - offset).min(ZERO_CHUNK_BYTES as u64) as usize;
        file.write_at(offset, &zeros[..n])?;
        offset += n as u64;
    }
    file.sync_data()?;
    files.sync_dir(dir)
}

fn corrupt_at(position: i64) -> StoreError {
    let (seq, offset) = split(position);
    StoreError::Corrupt(format!("no whole entry at offset {offset} of log segment {}", segment_name(seq)))
}

/// Decodes the entry at the start of `bytes`; returns it and its length.
fn decode_at(bytes: &[u8]) -> Result<(Entry, usize), StoreError> {
    let len = format::entry_len(bytes).filter(|len| *len <= bytes.len());
    let len = len.ok_or_else(|| StoreError::Corrupt("a log entry runs past its frame".into()))?;
    Ok((format::read_entry(&bytes[..len])?, len))
}

/// Recovery's pass over the segments.
#[derive(Default)]
struct Walk {
    /// The last accepted frame (seq, checksum), and where the chain stands after it.
    last: Option<(u64, u64)>,
    /// The chain after the last complete transaction: where writing resumes.
    committed: Option<Chain>,
    meta: Meta,
    /// The entries of a transaction whose last frame is not read yet, with positions.
    open: Vec<(i64, Entry, usize)>,
    live: HashMap<i64, LiveRecord>,
    tenants: Vec<Tenant>,
    tenant_ids: HashMap<Tenant, u32>,
}

impl Walk {
    /// Applies the frames of one segment; returns whether the chain may go on in the next.
    fn segment(&mut self, store: &mut Store, seq: u32, bytes: &[u8]) -> Result<bool, StoreError> {
        let mut offset = 0usize;
        let mut any = false;
        while let Some(header) = format::read_header(&bytes[offset..], bytes.len() - offset) {
            let end = offset + FRAME_HEADER_BYTES + header.payload_len as usize;
            let continues = match self.last {
                None => offset == 0,
                Some((last_seq, checksum)) => header.seq == last_seq + 1 && header.prev == checksum,
            };
            if !continues || !format::frame_intact(&bytes[offset..end], &header) {
                break;
            }
            any = true;
            let mut at = offset + FRAME_HEADER_BYTES;
            while at < end {
                let (entry, len) = decode_at(&bytes[at..end])?;
                self.open.push((position(seq, at as u64), entry, len));
                at += len;
            }
            self.last = Some((header.seq, header.checksum));
            if header.last {
                for (position, entry, len) in std::mem::take(&mut self.open) {
                    self.apply(store, position, entry, len)?;
                }
                self.meta = header.meta;
                self.committed =
                    Some(Chain { seq: header.seq, checksum: header.checksum, head: seq, tail: end as u64 });
            }
            offset = end;
        }
        // A segment the chain did not reach is where it ended (or a spare).
        Ok(any)
    }

    fn apply(
        &mut self,
        store: &mut Store,
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
                    if let Some((Entry::Record { scope: other, .. }, _)) = store.read_entry(candidate)?
                        && other == scope
                    {
                        store.index.remove(hash, candidate);
                        self.live.remove(&candidate);
                    }
                }
                store.index.insert(hash, position);
                store.schedule.add(record.reclaim_at_ms(), position);
                let tenant = self.tenant_id(&scope.tenant);
                self.live.insert(
                    position,
                    LiveRecord { tenant, pending: record.completion.is_none(), len: len as u32 },
                );
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

/// A record found by scope in this transaction.
struct Located {
    scope: Scope,
    position: i64,
    len: usize,
    record: Record,
}

/// A frame being filled: its segment, its offset there, and its bytes (the header's
/// room first).
struct Pending {
    seq: u32,
    start: u64,
    bytes: Vec<u8>,
}

/// One transaction: the frames it will append, and the index changes it made (undone
/// if it does not commit).
pub(crate) struct Txn<'s> {
    store: RefCell<&'s mut Store>,
    now_ms: u64,
    frames: RefCell<Vec<Pending>>,
    undo: RefCell<Vec<Undo>>,
    unscheduled: RefCell<Vec<(u64, i64)>>,
    live_delta: Cell<i64>,
    located: RefCell<Option<Located>>,
    committed: Cell<bool>,
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if !self.committed.get() {
            let mut store = self.store.borrow_mut();
            for undo in self.undo.borrow_mut().drain(..).rev() {
                store.index.undo(undo);
            }
            let taken: Vec<_> = self.unscheduled.borrow_mut().drain(..).collect();
            store.schedule.restore(taken);
        }
    }
}

impl<'s> Txn<'s> {
    fn new(store: &'s mut Store, now_ms: u64, head: u32, tail: u64) -> Txn<'s> {
        let frame = Pending { seq: head, start: tail, bytes: vec![0; FRAME_HEADER_BYTES] };
        Txn {
            store: RefCell::new(store),
            now_ms,
            frames: RefCell::new(vec![frame]),
            undo: RefCell::default(),
            unscheduled: RefCell::default(),
            live_delta: Cell::new(0),
            located: RefCell::default(),
            committed: Cell::new(false),
        }
    }

    pub fn now(&self) -> u64 {
        self.now_ms
    }

    fn failpoint(&self) -> Result<(), StoreError> {
        if self.store.borrow().faults.op_should_fail() {
            return Err(StoreError::Injected("store operation"));
        }
        Ok(())
    }

    /// The entry at `position`: from this transaction's frames, or the log.
    fn entry_at(&self, position: i64) -> Result<Option<(Entry, usize)>, StoreError> {
        let (seq, offset) = split(position);
        for frame in self.frames.borrow().iter() {
            if frame.seq == seq && offset >= frame.start && offset < frame.start + frame.bytes.len() as u64 {
                return decode_at(&frame.bytes[(offset - frame.start) as usize..]).map(Some);
            }
        }
        self.store.borrow().read_entry(position)
    }

    /// The live record of a scope, if it has one: the index names the candidates, the
    /// stored scope decides between them.
    fn locate(&self, scope: &Scope) -> Result<Option<(i64, usize, Record)>, StoreError> {
        if let Some(last) = &*self.located.borrow()
            && last.scope == *scope
        {
            return Ok(Some((last.position, last.len, last.record.clone())));
        }
        let hash = self.store.borrow().routing.hash(scope);
        let candidates: Vec<i64> = self.store.borrow().index.ids(hash).collect();
        for position in candidates {
            if let Some((Entry::Record { scope: stored, record, .. }, len)) = self.entry_at(position)?
                && stored == *scope
            {
                *self.located.borrow_mut() =
                    Some(Located { scope: scope.clone(), position, len, record: record.clone() });
                return Ok(Some((position, len, record)));
            }
        }
        Ok(None)
    }

    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        Ok(self.locate(scope)?.map(|(_, _, record)| record))
    }

    /// Room for an entry of `len` bytes: in the current frame, or in a new frame at the
    /// start of the next segment. Refuses (`Full`, this write alone) when that segment
    /// would pass the log's limit.
    fn room(&self, len: usize) -> Result<(), StoreError> {
        let mut frames = self.frames.borrow_mut();
        let current = frames.last().expect("a transaction has a frame");
        let segment_bytes = self.store.borrow().segment_bytes;
        // A frame leaves room for the next one's header, so that a transaction always
        // starts in the head segment.
        if current.start + (current.bytes.len() + len + FRAME_HEADER_BYTES) as u64 <= segment_bytes {
            return Ok(());
        }
        let mut store = self.store.borrow_mut();
        let next = current.seq + 1;
        let oldest = store.segments.keys().next().copied().unwrap_or(next);
        if u64::from(next - oldest) + 1 > store.segments_max {
            return Err(StoreError::Full);
        }
        store.take_prepared(true)?;
        store.segment(next)?;
        frames.push(Pending { seq: next, start: 0, bytes: vec![0; FRAME_HEADER_BYTES] });
        Ok(())
    }

    /// Appends an entry (written by `write`, `len` bytes); returns its position.
    fn append(&self, len: usize, write: impl FnOnce(&mut Vec<u8>)) -> Result<i64, StoreError> {
        self.room(len)?;
        let mut frames = self.frames.borrow_mut();
        let frame = frames.last_mut().expect("a transaction has a frame");
        let at = position(frame.seq, frame.start + frame.bytes.len() as u64);
        write(&mut frame.bytes);
        Ok(at)
    }

    /// Points the index at a new position for `hash` (the old one, if any, leaves it).
    fn repoint(&self, hash: u64, old: Option<(i64, usize)>, new: Option<(i64, usize)>) {
        let mut store = self.store.borrow_mut();
        let mut undo = self.undo.borrow_mut();
        let mut delta = self.live_delta.get();
        if let Some((position, len)) = old {
            store.index.remove(hash, position);
            undo.push(Undo::Insert(hash, position));
            delta -= len as i64;
        }
        if let Some((position, len)) = new {
            store.index.insert(hash, position);
            undo.push(Undo::Remove(hash, position));
            delta += len as i64;
        }
        self.live_delta.set(delta);
    }

    /// Inserts or replaces a key's record; returns the instant from which reclaim may
    /// take it.
    pub fn put(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.failpoint()?;
        let hash = self.store.borrow().routing.hash(scope);
        let old = self.locate(scope)?.map(|(position, len, _)| (position, len));
        let len = format::record_len(scope, record);
        let at = self.append(len, |out| format::put_record(out, hash, scope, record))?;
        self.repoint(hash, old, Some((at, len)));
        *self.located.borrow_mut() =
            Some(Located { scope: scope.clone(), position: at, len, record: record.clone() });
        let mut store = self.store.borrow_mut();
        store.schedule.add(record.reclaim_at_ms(), at);
        Ok(store.schedule.due_ms(record.reclaim_at_ms()))
    }

    /// Deletes a key's record (a tombstone names the record it ends).
    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        self.failpoint()?;
        let Some((position, len, _)) = self.locate(scope)? else { return Ok(()) };
        let hash = self.store.borrow().routing.hash(scope);
        self.append(format::TOMBSTONE_BYTES, |out| format::put_tombstone(out, hash, position))?;
        self.repoint(hash, Some((position, len)), None);
        *self.located.borrow_mut() = None;
        Ok(())
    }

    /// Takes at most `limit` entries from the reclaim schedule's ended windows and
    /// deletes the records still there and reclaimable at `now_ms`.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        self.failpoint()?;
        let taken = self.store.borrow_mut().schedule.take_due(now_ms, limit);
        self.unscheduled.borrow_mut().extend(taken.iter().copied());
        let mut removed = Tally::default();
        for (_, position) in taken {
            let Some((Entry::Record { hash, scope, record }, len)) = self.entry_at(position)? else {
                continue;
            };
            let live = self.store.borrow().index.ids(hash).any(|p| p == position);
            if !live || record.reclaim_at_ms() > now_ms {
                continue;
            }
            self.append(format::TOMBSTONE_BYTES, |out| format::put_tombstone(out, hash, position))?;
            self.repoint(hash, Some((position, len)), None);
            removed.add_stored(&scope.tenant, record.completion.is_none());
            if self.located.borrow().as_ref().is_some_and(|l| l.position == position) {
                *self.located.borrow_mut() = None;
            }
        }
        Ok(removed)
    }

    /// Pending records whose lease runs past `after_ms` (the restart grace's), read from
    /// the log: once, at the process's first open.
    pub fn pending_leased_after(&self, after_ms: u64) -> Result<Vec<(Scope, Record)>, StoreError> {
        let positions: Vec<i64> = self.store.borrow().index.iter().map(|(_, p)| p).collect();
        let mut out = Vec::new();
        for position in positions {
            if let Some((Entry::Record { scope, record, .. }, _)) = self.entry_at(position)?
                && record.completion.is_none()
                && record.lease_until_ms > after_ms
            {
                out.push((scope, record));
            }
        }
        Ok(out)
    }

    /// Whether `error` refused one write alone (the log at its size limit).
    pub fn failed_alone(&self, error: &StoreError) -> bool {
        matches!(error, StoreError::Full)
    }

    pub fn acks_early(&self) -> bool {
        self.store.borrow().faults.acks_before_commit()
    }

    pub fn finish_read(self) {
        drop(self);
    }

    /// Copies the live records of the oldest segment's next frames (at most
    /// `COMPACT_BYTES_PER_COMMIT`) into this transaction; returns where the copy stopped
    /// and whether it reached the segment's end.
    fn compact(&self) -> Result<Option<(Compaction, bool)>, StoreError> {
        let mut state = {
            let store = self.store.borrow();
            if !store.compaction_due() && store.compaction.is_none() {
                return Ok(None);
            }
            let Some(oldest) = store.segments.keys().next().copied() else { return Ok(None) };
            if oldest >= store.chain.head {
                return Ok(None);
            }
            match store.compaction {
                Some(c) if c.seq == oldest => c,
                _ => Compaction { seq: oldest, offset: 0, frame_seq: None },
            }
        };
        let mut copied = 0;
        while copied < COMPACT_BYTES_PER_COMMIT {
            let Some(frame) = self.read_frame(&state)? else { return Ok(Some((state, true))) };
            let (header, bytes) = frame;
            let mut at = FRAME_HEADER_BYTES;
            while at < bytes.len() {
                let (entry, len) = decode_at(&bytes[at..])?;
                let from = position(state.seq, state.offset + at as u64);
                if let Entry::Record { hash, record, .. } = entry
                    && self.store.borrow().index.ids(hash).any(|p| p == from)
                {
                    // A log at its limit copies nothing more now: the frame is copied
                    // again from its start later (what moved is no longer live here).
                    let to = match self.append(len, |out| out.extend_from_slice(&bytes[at..at + len])) {
                        Err(StoreError::Full) => return Ok(Some((state, false))),
                        other => other?,
                    };
                    self.repoint(hash, Some((from, len)), Some((to, len)));
                    self.store.borrow_mut().schedule.add(record.reclaim_at_ms(), to);
                    copied += len;
                }
                at += len;
            }
            state = Compaction {
                seq: state.seq,
                offset: state.offset + bytes.len() as u64,
                frame_seq: Some(header.seq + 1),
            };
        }
        Ok(Some((state, false)))
    }

    /// The whole frame at the compaction's place in the oldest segment, if the chain
    /// goes on there (the segment's frames end where the writer moved to the next).
    fn read_frame(&self, state: &Compaction) -> Result<Option<(format::FrameHeader, Vec<u8>)>, StoreError> {
        let store = self.store.borrow();
        let Some(file) = store.segments.get(&state.seq) else { return Ok(None) };
        let room = store.segment_bytes.saturating_sub(state.offset) as usize;
        let mut head = [0; FRAME_HEADER_BYTES];
        let read = file.read_at(state.offset, &mut head).map_err(io(&store.dir))?;
        let Some(header) = format::read_header(&head[..read], room) else { return Ok(None) };
        if state.frame_seq.is_some_and(|expected| header.seq != expected) {
            return Ok(None);
        }
        let mut bytes = vec![0; FRAME_HEADER_BYTES + header.payload_len as usize];
        let read = file.read_at(state.offset, &mut bytes).map_err(io(&store.dir))?;
        if read < bytes.len() || !format::frame_intact(&bytes, &header) {
            return Ok(None);
        }
        Ok(Some((header, bytes)))
    }

    /// Makes the transaction durable: seals its frames into the chain, writes them,
    /// syncs every segment written, and only then lets the next transaction see it.
    pub fn commit(self, meta: Meta) -> Result<(), StoreError> {
        let compaction = self.compact()?;
        self.failpoint()?;
        if self.store.borrow().faults.commit_should_fail() {
            return Err(StoreError::Injected("commit"));
        }
        let mut frames = std::mem::take(&mut *self.frames.borrow_mut());
        let mut store = self.store.borrow_mut();
        let mut chain = store.chain;
        let count = frames.len();
        for (n, frame) in frames.iter_mut().enumerate() {
            let last = n + 1 == count;
            chain.checksum =
                format::seal_frame(&mut frame.bytes, last, chain.seq + 1, chain.checksum, meta, store.salt);
            chain.seq += 1;
            chain.head = frame.seq;
            chain.tail = frame.start + frame.bytes.len() as u64;
        }
        for frame in &frames {
            let file = &store.segments[&frame.seq];
            file.write_at(frame.start, &frame.bytes).map_err(io(&store.dir))?;
        }
        if store.durability == Durability::Full {
            for (n, frame) in frames.iter().enumerate() {
                if n == 0 || frames[n - 1].seq != frame.seq {
                    store.segments[&frame.seq].sync_data().map_err(io(&store.dir))?;
                }
            }
        }
        // Durable: from here the transaction is the log's state.
        self.committed.set(true);
        store.chain = chain;
        store.live_bytes = store.live_bytes.saturating_add_signed(self.live_delta.get());
        store.recent = frames.into_iter().map(|f| (f.seq, f.start, f.bytes)).collect();
        match compaction {
            Some((state, true)) => store.retire(state.seq)?,
            Some((state, false)) => store.compaction = Some(state),
            None => {}
        }
        store.take_prepared(false)?;
        if chain.tail * 2 > store.segment_bytes {
            store.prepare_spare();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncegate_core::{Fingerprint, Key, Namespace, Transition};

    const SEGMENT_BYTES: u64 = 64 << 10;

    fn tuning(files: Arc<dyn Files>, bytes_max: u64) -> Tuning {
        Tuning {
            durability: Durability::Full,
            segment_bytes: SEGMENT_BYTES,
            bytes_max,
            reclaim_granularity_ms: 1_000,
            files,
            routing: Routing::BucketBase,
        }
    }

    fn scope(key: &str) -> Scope {
        Scope {
            tenant: Tenant::default_tenant(),
            namespace: Namespace::new("n").unwrap(),
            key: Key::from_stored(key.into()),
        }
    }

    fn granted(token: u64, at_ms: u64, ttl_ms: u64) -> Record {
        let mut record = Record {
            token,
            attempt: 1,
            lease_until_ms: at_ms + 10,
            expires_at_ms: at_ms + ttl_ms,
            ttl_ms,
            fingerprint: Fingerprint::from_stored(vec![3; 32]),
            completion: None,
            history: Vec::new(),
        };
        record.push_event(Transition::Granted, at_ms, token);
        record
    }

    fn open(dir: &Path, bytes_max: u64) -> (Store, Meta, bool) {
        Store::open(dir, &tuning(Arc::new(crate::files::OsFiles), bytes_max), &Faults::default()).unwrap()
    }

    fn segment_count(dir: &Path) -> usize {
        crate::files::OsFiles.list(dir).unwrap().iter().filter(|n| parse_segment_name(n).is_some()).count()
    }

    /// Records written over many segments, some replaced and some deleted, read back the
    /// same after a reopen, with the counters and the counts of the last transaction.
    #[test]
    fn records_read_back_after_a_reopen_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, meta, created) = open(dir.path(), 1 << 30);
        assert!(created);
        assert_eq!(meta, Meta::default());
        for batch in 0..100u64 {
            let txn = store.begin(batch).unwrap();
            for n in 0..20 {
                let key = batch * 20 + n;
                txn.put(&scope(&format!("k{key}")), &granted(key + 1, batch, 60_000)).unwrap();
                if key % 3 == 0 {
                    txn.put(&scope(&format!("k{key}")), &granted(key + 5_000, batch, 60_000)).unwrap();
                }
                if key % 7 == 0 {
                    txn.delete(&scope(&format!("k{key}"))).unwrap();
                }
            }
            txn.commit(Meta { next_token: 9_000 + batch, high_water_ms: batch }).unwrap();
        }
        assert!(segment_count(dir.path()) > 2, "the writes crossed segments");
        drop(store);
        let (mut store, meta, created) = open(dir.path(), 1 << 30);
        assert!(!created);
        assert_eq!(meta, Meta { next_token: 9_099, high_water_ms: 99 });
        let tally = store.take_count();
        assert_eq!(tally.pending, (0..2_000).filter(|k| k % 7 != 0).count() as i64);
        let txn = store.begin(100).unwrap();
        for key in 0..2_000u64 {
            let got = txn.get(&scope(&format!("k{key}"))).unwrap();
            let token = if key % 3 == 0 { key + 5_000 } else { key + 1 };
            let expected = (key % 7 != 0).then(|| granted(token, key / 20, 60_000));
            assert_eq!(got, expected, "key k{key}");
        }
    }

    /// Records that expire are reclaimed (a tombstone each), and the log copies what is
    /// live out of its oldest segments and retires them: it stays a few segments long
    /// however much is written, and every live record reads back after a reopen.
    #[test]
    fn compaction_keeps_the_log_short_and_the_live_records() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        for batch in 0..2_000u64 {
            let now = batch * 100;
            let txn = store.begin(now).unwrap();
            // One key of each batch lives long; the others expire within a second.
            for n in 0..10 {
                let ttl = if n == 0 { 10_000_000 } else { 1_000 };
                txn.put(&scope(&format!("k{batch}-{n}")), &granted(batch * 10 + n + 1, now, ttl)).unwrap();
            }
            txn.reclaim(now, 1_000).unwrap();
            txn.commit(Meta { next_token: batch * 10 + 11, high_water_ms: now }).unwrap();
        }
        let written = 2_000 * 10 * format::record_len(&scope("k1000-1"), &granted(1, 0, 1_000)) as u64;
        assert!(written > 30 * SEGMENT_BYTES, "enough was written to need compaction");
        let segments = segment_count(dir.path());
        assert!(segments <= 12, "{segments} segments: compaction did not keep up");
        drop(store);
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let live = store.take_count();
        // The long-lived keys, and those of the last two seconds not yet reclaimed.
        assert!(live.pending >= 2_000 && live.pending <= 2_000 + 9 * 20, "{live:?}");
        let txn = store.begin(200_000).unwrap();
        for batch in 0..2_000u64 {
            let got = txn.get(&scope(&format!("k{batch}-0"))).unwrap();
            assert_eq!(got, Some(granted(batch * 10 + 1, batch * 100, 10_000_000)), "k{batch}-0");
        }
    }

    /// A transaction whose frame was torn is not applied; the log goes on from the last
    /// whole transaction, and what is written there after the reopen reads back at the
    /// next one.
    #[test]
    fn a_torn_frame_is_cut_and_the_log_goes_on_where_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let txn = store.begin(1).unwrap();
        txn.put(&scope("kept"), &granted(1, 1, 60_000)).unwrap();
        txn.commit(Meta { next_token: 2, high_water_ms: 1 }).unwrap();
        let torn_at = store.chain.tail;
        let txn = store.begin(2).unwrap();
        txn.put(&scope("torn"), &granted(2, 2, 60_000)).unwrap();
        txn.commit(Meta { next_token: 3, high_water_ms: 2 }).unwrap();
        let head = dir.path().join(segment_name(store.chain.head));
        drop(store);
        // Damage one byte of the second frame's payload, as a torn sector would.
        let file = crate::files::OsFiles.open_segment(&head).unwrap();
        file.write_at(torn_at + FRAME_HEADER_BYTES as u64 + 20, &[0xff]).unwrap();
        let (mut store, meta, _) = open(dir.path(), 1 << 30);
        assert_eq!(meta, Meta { next_token: 2, high_water_ms: 1 });
        assert_eq!(store.chain.tail, torn_at);
        let txn = store.begin(3).unwrap();
        assert!(txn.get(&scope("torn")).unwrap().is_none());
        txn.put(&scope("after"), &granted(3, 3, 60_000)).unwrap();
        txn.commit(Meta { next_token: 4, high_water_ms: 3 }).unwrap();
        drop(store);
        let (mut store, meta, _) = open(dir.path(), 1 << 30);
        assert_eq!(meta, Meta { next_token: 4, high_water_ms: 3 });
        let txn = store.begin(4).unwrap();
        assert!(txn.get(&scope("kept")).unwrap().is_some());
        assert!(txn.get(&scope("after")).unwrap().is_some());
        assert!(txn.get(&scope("torn")).unwrap().is_none());
    }

    /// At its size limit the log refuses the write that would pass it, alone: the
    /// transaction goes on and commits what fit.
    #[test]
    fn a_full_log_refuses_the_write_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 2 * SEGMENT_BYTES);
        let mut refused = 0;
        let mut stored = 0u64;
        for batch in 0..200u64 {
            let txn = store.begin(batch).unwrap();
            for n in 0..10 {
                match txn.put(&scope(&format!("k{batch}-{n}")), &granted(1, batch, 10_000_000)) {
                    Ok(_) => stored += 1,
                    Err(error) => {
                        assert!(txn.failed_alone(&error), "{error}");
                        refused += 1;
                    }
                }
            }
            txn.commit(Meta { next_token: 2, high_water_ms: batch }).unwrap();
        }
        assert!(refused > 0 && stored > 0, "stored {stored}, refused {refused}");
        drop(store);
        let (mut store, _, _) = open(dir.path(), 2 * SEGMENT_BYTES);
        assert_eq!(store.take_count().pending as u64, stored);
    }
}
