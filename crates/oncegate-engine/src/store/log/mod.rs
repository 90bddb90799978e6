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
//!   latest record, and the [`Schedule`] files keys (hashes) by reclaim window, both rebuilt
//!   by reading the log at open. A record is read back from its segment when it is
//!   decided on (the last megabyte of committed frames is kept in memory for the
//!   commits that follow reserves: `recent.rs`).
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
mod recent;
mod recover;
mod txn;

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use oncegate_core::route::Routing;

use self::format::{Entry, FRAME_HEADER_BYTES};
use self::recent::Recent;
pub(crate) use self::txn::Txn;
use super::{Meta, StoreError};
use crate::files::{Files, SegmentFile};
use crate::index::Index;
use crate::quota::Tally;
use crate::schedule::Schedule;
use crate::{Durability, Faults};

/// The most bytes of the oldest segment one commit reads to copy its live records.
const COMPACT_BYTES_PER_COMMIT: usize = 256 * 1024;
/// The most records of slots the shard does not own that one commit of an open ends.
const FOREIGN_DELETES_PER_COMMIT: usize = 4_096;
/// The bytes of zeros a spare segment gets between two syncs.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;
/// The bytes of zeros one write puts in a segment: four pages. The page cache keeps a
/// file's pages in folios as large as the writes that made them (XFS since Linux 5.18,
/// ext4 since 6.16; readahead makes large ones too), and a write of a few hundred bytes
/// into a folio dirties all of it. Zero-filled by 1 MiB writes, every commit's frames
/// marked a 1 MiB folio dirty and its `fdatasync` walked each of the folio's 256 blocks:
/// on this machine 15–24 µs of system time per small write and sync against 9–11 µs on
/// folios of 4 or 16 KiB, and 1 MiB of `write_bytes` counted per commit. Page-sized
/// writes cost the filling thread 2.5 times the CPU of 1 MiB ones (46 against 19 ms per
/// 64 MiB); 16 KiB ones 1.3–1.5 times, for the same gain per commit (docs/benchmarks.md).
const ZERO_WRITE_BYTES: u64 = 16 << 10;
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
    /// The most bytes the log's segments take together (the spare being made aside).
    pub bytes_max: u64,
    pub reclaim_granularity_ms: u64,
    pub files: Arc<dyn Files>,
    pub routing: Routing,
    /// Where segments retired by compaction are counted (the shard's checkpoints).
    pub retired: Arc<std::sync::atomic::AtomicU64>,
    /// Frames taken back whose zeros could not be written: kept by the shard across its
    /// reopens, and zeroed by the next open before it reads the log.
    pub owed: OwedZeros,
    /// The slots the shard keeps: the open deletes the records of every other slot (a
    /// slot move cut short left them). `None` keeps every record.
    pub owned: Option<crate::slots::Owned>,
}

impl Tuning {
    /// The settings of an engine's shard logs.
    pub fn of(
        config: &crate::EngineConfig,
        files: Arc<dyn Files>,
        owned: Option<crate::slots::Owned>,
        routing: Routing,
    ) -> Tuning {
        Tuning {
            durability: config.durability,
            segment_bytes: config.store.log_segment_bytes,
            bytes_max: config.shard_file_bytes_max,
            reclaim_granularity_ms: config.reclaim_granularity_ms,
            files,
            routing,
            retired: Arc::default(),
            owed: OwedZeros::default(),
            owned,
        }
    }
}

/// Places in the log that must be zeroed before it is read again: frames of a commit
/// taken back after a failed sync, whose zeros could not even be written. Such a frame
/// stays readable in the page cache, marked clean, while the disk may never get it (Linux
/// after a failed writeback): read by the shard's reopen in this process as the log's, it
/// would become the chain that later commits extend, and after a power cut they would
/// stand past a frame the disk lost, which the open refuses as damage. (A process
/// restart in between forgets them; its open drops the segments' cached pages instead,
/// see [`Store::open`], which is the weaker net: what the device then returns may still
/// sit in its own volatile cache, which the failed sync did not flush.)
#[derive(Clone, Debug, Default)]
pub(crate) struct OwedZeros(Arc<std::sync::Mutex<Vec<Owed>>>);

/// Bytes `from..to` of segment `seq`, owed zeros.
#[derive(Clone, Copy, Debug)]
struct Owed {
    seq: u32,
    from: u64,
    to: u64,
}

impl OwedZeros {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Owed>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

/// Whose write asks for room: a request's record may not take the log's last segment,
/// which is kept for the writes that free room (tombstones, compaction's copies), so
/// that a log full of live records still reclaims and compacts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    Request,
    Upkeep,
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
    /// Where the frames of each segment before the head end (the writer moved on there).
    ends: BTreeMap<u32, u64>,
    /// Segments written since they were last synced, each with the offset of its first
    /// write since then (`durability = "normal"` only).
    unsynced: BTreeMap<u32, u64>,
    /// Commits are synced whatever the durability (a slot move's copy, which the map
    /// will name as the slot's truth).
    sync_forced: bool,
    /// A retirement renamed or removed a segment but the directory sync after it failed:
    /// the name may not be durable. Nothing is written until a directory sync succeeds,
    /// since the renamed file may be the next one written, and after a power cut its new
    /// frames would sit under its old name as the oldest segment, where recovery would
    /// read them as the chain's start and lose every segment after it.
    dir_unsynced: bool,
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
    /// The time the last frame written carries (as read at open, then as committed): a
    /// commit with nothing in it may skip its frame only while its time is close to this.
    frame_time_ms: u64,
    /// The last committed frames: the commits that follow reserves read their records
    /// from here.
    recent: Recent,
    /// The record counts read at open, until the shard takes them.
    tally: Option<Tally>,
    retired: Arc<std::sync::atomic::AtomicU64>,
    owed: OwedZeros,
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

impl Store {
    /// Opens (creating if needed) the log in `dir` and reads it whole. Returns the store,
    /// the counters its last transaction left (raised over every record it holds), and
    /// whether it was new.
    pub fn open(dir: &Path, tuning: &Tuning, faults: &Faults) -> Result<(Store, Meta, bool), StoreError> {
        if faults.open_should_fail() {
            return Err(StoreError::Injected("open"));
        }
        let files = Arc::clone(&tuning.files);
        files.create_dir_all(dir).map_err(io(dir))?;
        // An earlier store of this process may have renamed a segment without a durable
        // directory entry (its sync failed, and the shard reopened the store): the renamed
        // file may be the next one written, so its name is made durable before anything is.
        files.sync_dir(dir).map_err(io(dir))?;
        let mut segments = BTreeMap::new();
        for seq in files.list(dir).map_err(io(dir))?.iter().filter_map(|n| parse_segment_name(n)) {
            let path = dir.join(segment_name(seq));
            let file = files.open_segment(&path).map_err(io(&path))?;
            // A failed writeback leaves pages that the device may lack in the page cache,
            // marked clean. Read from there, a commit that was never acknowledged would
            // become the chain that later commits extend, and a power cut would take them
            // with it. This store's earlier ones owe such frames their zeros (see
            // `pay_owed_zeros`), but a restart of the process forgets what was owed; read
            // from the device, the walk finds what a power cut would leave.
            file.drop_cached().map_err(io(&path))?;
            // Offsets were chosen for the size the segments were made with: read with a
            // smaller one, their ends would be cut off.
            let size = file.size().map_err(io(&path))?;
            if size > tuning.segment_bytes {
                return Err(StoreError::Corrupt(format!(
                    "{} is {size} bytes, more than store.log_segment_bytes ({}): set it back to the size the log was written with",
                    path.display(),
                    tuning.segment_bytes
                )));
            }
            segments.insert(seq, file);
        }
        let mut store = Store {
            dir: dir.to_owned(),
            files,
            faults: faults.clone(),
            durability: tuning.durability,
            routing: tuning.routing,
            segment_bytes: tuning.segment_bytes,
            segments_max: segments_max(tuning, faults),
            segments,
            ends: BTreeMap::new(),
            unsynced: BTreeMap::new(),
            sync_forced: false,
            dir_unsynced: false,
            preparing: None,
            chain: Chain { seq: 0, checksum: 0, head: 1, tail: 0 },
            salt: random_salt(),
            index: Index::default(),
            schedule: Schedule::new(tuning.reclaim_granularity_ms),
            live_bytes: 0,
            compaction: None,
            frame_time_ms: 0,
            recent: Recent::default(),
            tally: None,
            retired: Arc::clone(&tuning.retired),
            owed: tuning.owed.clone(),
        };
        store.pay_owed_zeros()?;
        let recover::Recovered { meta, created, foreign } = store.recover(tuning.owned.as_ref())?;
        store.frame_time_ms = meta.high_water_ms;
        if created {
            let first = store.segments.keys().next().copied().unwrap_or(1);
            store.fill_first(first)?;
            store.chain.head = first;
            store.segment(first)?;
        }
        store.sync_recovered()?;
        if !foreign.is_empty() {
            store.delete_foreign(&foreign, meta)?;
        }
        Ok((store, meta, created))
    }

    /// Zero-fills a new log's first segment to its full size, as every later segment is
    /// before it is written: grown by appends instead, each commit's `fdatasync` would
    /// also write the file's new size (a second device write, about a third more time per
    /// commit here) until the segment filled, which at a light load takes days. Nothing
    /// was committed in it (the log is new), so frames an interrupted first transaction
    /// left may be overwritten.
    fn fill_first(&self, seq: u32) -> Result<(), StoreError> {
        let size = match self.segments.get(&seq) {
            Some(file) => file.size().map_err(io(&self.dir))?,
            None => 0,
        };
        if size < self.segment_bytes {
            zero_fill(&*self.files, &self.dir, seq, self.segment_bytes).map_err(io(&self.dir))?;
        }
        Ok(())
    }

    /// Syncs every segment up to the head. An earlier open may have left its frames in
    /// the page cache only (`durability = "normal"`, or a process killed before its
    /// sync); recovery read them as the chain, so they must be durable before anything
    /// chains onto them: a commit synced by this open (under `"full"`, or a slot move's
    /// copy) is lost with any frame before it.
    fn sync_recovered(&self) -> Result<(), StoreError> {
        for (_, file) in self.segments.range(..=self.chain.head) {
            file.sync_data().map_err(io(&self.dir))?;
        }
        Ok(())
    }

    /// Deletes, in one transaction carrying the counters as opened, the records of slots
    /// the shard does not own: a slot move cut short left them here, and the slot's truth
    /// is its owner's. Left in the log, they would come back if the slot ever moved here
    /// again (its keys deleted meanwhile by their owner included).
    ///
    /// In transactions of `FOREIGN_DELETES_PER_COMMIT`, each compacting as any commit
    /// does: a slot's records can be millions (half of every source's after an offline
    /// reshard), and one transaction would hold all their tombstones in memory and could
    /// need more room than a nearly full log has, failing every open.
    fn delete_foreign(&mut self, foreign: &[(u64, i64)], meta: Meta) -> Result<(), StoreError> {
        for chunk in foreign.chunks(FOREIGN_DELETES_PER_COMMIT) {
            let txn = self.begin(meta.high_water_ms)?;
            txn.delete_rows(chunk)?;
            txn.commit(meta)?;
        }
        tracing::info!(
            records = foreign.len(),
            "deleted records of slots this shard does not own (a slot move was cut short)"
        );
        Ok(())
    }

    /// Commits from now on are synced whatever the durability (`on`), or as configured.
    pub fn sync_commits(&mut self, on: bool) {
        self.sync_forced = on;
    }

    /// The segment file `seq`, opened (and its name made durable) if it is new.
    fn segment(&mut self, seq: u32) -> Result<&dyn SegmentFile, StoreError> {
        if !self.segments.contains_key(&seq) {
            let path = self.dir.join(segment_name(seq));
            let file = self.files.open_segment(&path).map_err(io(&path))?;
            self.files.sync_dir(&self.dir).map_err(io(&self.dir))?;
            self.dir_unsynced = false;
            self.segments.insert(seq, file);
        }
        Ok(&*self.segments[&seq])
    }

    /// Reads the whole of segment `seq` into `bytes` (at open, and for the corruption
    /// check). The buffer is reused from segment to segment: a fresh one per segment
    /// cost the open a page fault and a zeroed page per 4 KiB read (a tenth of its CPU).
    fn read_segment(&self, seq: u32, bytes: &mut Vec<u8>) -> Result<(), StoreError> {
        let file = &self.segments[&seq];
        bytes.resize(file.size().map_err(io(&self.dir))? as usize, 0);
        let read = file.read_at(0, bytes).map_err(io(&self.dir))?;
        bytes.truncate(read);
        Ok(())
    }

    /// Starts a write transaction at the shard's time `now_ms`. Its first frame starts
    /// where the chain ends, or in the next segment when not even a frame's header would
    /// fit there (a log written by this code always leaves room for one).
    pub fn begin(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        let (mut head, mut tail) = (self.chain.head, self.chain.tail);
        if tail + FRAME_HEADER_BYTES as u64 > self.segment_bytes {
            if self.used_segments() + 1 > self.segments_max {
                return Err(StoreError::Full);
            }
            self.take_prepared(true)?;
            self.ends.insert(head, tail);
            head += 1;
            tail = 0;
            self.segment(head)?;
        }
        Ok(Txn::new(self, now_ms, head, tail))
    }

    /// A read transaction: never committed, so it never moves to a new segment.
    pub fn begin_read(&mut self, now_ms: u64) -> Result<Txn<'_>, StoreError> {
        let (head, tail) = (self.chain.head, self.chain.tail);
        Ok(Txn::new(self, now_ms, head, tail))
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
    /// gone (retired: nothing in it is live, so only a stale hint names it).
    fn read_entry(&self, position: i64) -> Result<Option<(Entry, usize)>, StoreError> {
        let (seq, offset) = split(position);
        let Some(file) = self.segments.get(&seq) else { return Ok(None) };
        if let Some(bytes) = self.recent.from(position) {
            return decode_at(bytes).map(Some);
        }
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

    /// Writes a transaction's frames. With `durability = "full"` each segment's frame is
    /// synced before the next segment's is written, so that frames become durable in
    /// order (recovery relies on it to tell damage from a torn end). With `"normal"`
    /// nothing is synced, unless `retiring` or syncs are forced: then every segment
    /// written since its last sync is, after the write, so that compaction's copies are
    /// durable before their source goes, and a forced commit with every frame before it
    /// (recovery accepts no frame after a lost one).
    ///
    /// On a failure, the frames it began to write are overwritten with zeros (`unwrite`),
    /// and only those: one not written may sit at the start of a recycled segment, whose
    /// earlier frames are still the log's where its new name is not yet durable. Under
    /// `"normal"` a failed sync also takes back everything written since each segment's
    /// last good sync (`unwrite_unsynced`).
    fn write_frames(&mut self, frames: &[txn::Pending], retiring: bool) -> Result<(), StoreError> {
        let mut begun = 0;
        let written = self.write_and_sync(frames, retiring, &mut begun);
        if written.is_err() {
            self.unwrite(&frames[..begun]);
        }
        written
    }

    /// `write_frames` without the undo; `begun` counts the frames whose write started.
    fn write_and_sync(
        &mut self,
        frames: &[txn::Pending],
        retiring: bool,
        begun: &mut usize,
    ) -> Result<(), StoreError> {
        let retiring = retiring || self.sync_forced;
        let full = self.durability == Durability::Full;
        if self.dir_unsynced {
            self.files.sync_dir(&self.dir).map_err(io(&self.dir))?;
            self.dir_unsynced = false;
        }
        for frame in frames {
            let file = &self.segments[&frame.seq];
            *begun += 1;
            file.write_at(frame.start, &frame.bytes).map_err(io(&self.dir))?;
            if full {
                file.sync_data().map_err(io(&self.dir))?;
            } else {
                self.unsynced.entry(frame.seq).or_insert(frame.start);
            }
        }
        if retiring {
            // An entry leaves the set only once its sync succeeded: what is left after a
            // failure is taken back.
            while let Some((&seq, _)) = self.unsynced.first_key_value() {
                if let Some(file) = self.segments.get(&seq)
                    && let Err(source) = file.sync_data()
                {
                    self.unwrite_unsynced();
                    return Err(StoreError::Io { path: self.dir.clone(), source });
                }
                self.unsynced.remove(&seq);
            }
        }
        Ok(())
    }

    /// After a failed sync under `durability = "normal"`, overwrites with zeros
    /// everything written to each segment since its last good sync. Those frames were
    /// acknowledged without a sync (which `"normal"` allows), but after a failed
    /// `fdatasync` the kernel may have dropped them and marked their pages clean: the
    /// shard's reopen would read them from the page cache as the log's, its own syncs
    /// would succeed on nothing, and compaction could retire the segments that hold the
    /// only durable copies of their records. The latest segment is zeroed first and each
    /// segment's zeros synced, as [`Store::unwrite`] does and for the same reason, and
    /// zeros that cannot be written or synced are owed to the next open, as there.
    fn unwrite_unsynced(&mut self) {
        for (seq, from) in std::mem::take(&mut self.unsynced).into_iter().rev() {
            if let Some(file) = self.segments.get(&seq)
                && (write_zeros(&**file, from, self.segment_bytes).is_err() || file.sync_data().is_err())
            {
                self.owed.lock().push(Owed { seq, from, to: self.segment_bytes });
            }
        }
    }

    /// After a failed write or sync, overwrites the transaction's frames with zeros, as
    /// far as the disk still lets it. A failed `fdatasync` leaves the frames in the page
    /// cache while the disk may never get them: the shard's reopen in this process would
    /// read them as the chain's continuation, and commits chained onto them would be lost
    /// with them at the next power cut. Zeroed, the reopen ends the chain before them.
    ///
    /// The last frame goes first, and each frame's zeros are synced before the frame
    /// before it is zeroed. So a power cut while zeroing leaves the transaction's frames
    /// up to some point, which recovery takes for a torn end. Zeroing the first frame
    /// first could leave zeros followed by a whole later frame, which under `"full"` says
    /// every frame before it was durable, and recovery would refuse the log as damaged in
    /// acknowledged history. When a frame's zeros are written but cannot be synced, the
    /// frames before it are left whole (zeros the disk might keep ahead of the unsynced
    /// ones would be that damage) and that frame's zeros are owed: the next open drops
    /// the page cache before it reads the log ([`SegmentFile::drop_cached`]), so without
    /// them it would read the frame from the device, whole if the failed writeback got it
    /// there, and whether the transaction was taken back would depend on what the device
    /// kept; paid, the open finds the transaction without its last frame and ends it
    /// there. When the zeros cannot even be written, that frame and every one
    /// before it are owed their zeros ([`OwedZeros`]), last first, and the next open
    /// writes them before it reads the log: read whole by the reopen, the transaction
    /// would become the chain that later commits extend, and zeroed now, the frames before
    /// it would be zeros ahead of a frame the disk may hold whole, which recovery refuses.
    /// Left whole until then, a cut leaves the transaction cut short, a torn end.
    fn unwrite(&self, frames: &[txn::Pending]) {
        let owed = |f: &txn::Pending| Owed { seq: f.seq, from: f.start, to: f.start + f.bytes.len() as u64 };
        for (i, frame) in frames.iter().enumerate().rev() {
            let file = &self.segments[&frame.seq];
            match file.write_at(frame.start, &vec![0; frame.bytes.len()]) {
                Ok(()) if file.sync_data().is_err() => {
                    self.owed.lock().push(owed(frame));
                    return;
                }
                Ok(()) => {}
                Err(_) => {
                    self.owed.lock().extend(frames[..=i].iter().rev().map(owed));
                    return;
                }
            }
        }
    }

    /// Writes and syncs the zeros an earlier store of this shard owed (in the order they
    /// were owed: a transaction's last frame first), before the log is read. A failure
    /// fails the open, which is tried again, and the zeros stay owed.
    fn pay_owed_zeros(&mut self) -> Result<(), StoreError> {
        let mut owed = self.owed.lock();
        while let Some(&Owed { seq, from, to }) = owed.first() {
            // A segment no longer there (removed from outside) has nothing left to zero.
            if let Some(file) = self.segments.get(&seq) {
                write_zeros(&**file, from, to).map_err(io(&self.dir))?;
                file.sync_data().map_err(io(&self.dir))?;
            }
            owed.remove(0);
        }
        Ok(())
    }

    /// Segments from the oldest to the head.
    fn used_segments(&self) -> u64 {
        let oldest = self.segments.keys().next().copied().unwrap_or(self.chain.head);
        u64::from(self.chain.head.saturating_sub(oldest)) + 1
    }

    /// Whether compaction should copy more: the log holds more than twice its live
    /// bytes and at least three segments, or it is one segment short of its limit and
    /// holds a quarter of a segment's worth of dead bytes. Without dead bytes compaction
    /// frees nothing: a log full of live records copied its oldest segment to its head on
    /// every commit, a segment's writing per refused batch. With them, a cycle through
    /// the segments frees them, and ends when they are gone (copies are packed: a copied
    /// record no longer has a frame header of its own).
    fn compaction_due(&self) -> bool {
        let used_segments = self.used_segments();
        let used_bytes = (used_segments - 1) * self.segment_bytes + self.chain.tail;
        used_segments >= 3 && used_bytes > 2 * self.live_bytes + self.segment_bytes
            || used_segments + 1 >= self.segments_max
                && used_segments >= 2
                && used_bytes >= self.live_bytes + self.segment_bytes / 4
    }

    /// Retires the oldest segment, copied whole (the copies are durable: the caller
    /// synced them): kept as the next spare when none is ready or being made, removed
    /// otherwise. Its name changes durably before anything else is written (when the
    /// directory sync fails, the next write syncs it first, or fails), so a crash leaves
    /// it either old (read again, harmlessly: every live record of it has a newer copy)
    /// or a spare.
    ///
    /// A segment whose name could not be changed stays the oldest (and is retired again
    /// when compaction next reaches its end): retiring a later one first would break the
    /// chain that recovery walks from the oldest segment.
    fn retire(&mut self, seq: u32) -> Result<(), StoreError> {
        if !self.segments.contains_key(&seq) {
            return Ok(());
        }
        let path = self.dir.join(segment_name(seq));
        let spare = self.chain.head + 1;
        let recycle = self.preparing.is_none() && !self.segments.contains_key(&spare);
        if recycle {
            self.files.rename(&path, &self.dir.join(segment_name(spare))).map_err(io(&path))?;
        } else {
            self.files.remove(&path).map_err(io(&path))?;
        }
        let file = self.segments.remove(&seq).expect("checked above");
        self.recent.forget(seq);
        if recycle {
            self.segments.insert(spare, file);
        }
        self.ends.remove(&seq);
        self.compaction = None;
        self.retired.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dir_unsynced = true;
        self.files.sync_dir(&self.dir).map_err(io(&self.dir))?;
        self.dir_unsynced = false;
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

/// How many segments the log may take: its byte limit over the segment size, at least
/// two. A test's page limit (`Faults::limit_pages`, pages of 4 KiB as SQLite's) lowers it,
/// down to one segment, where no request's record fits at all: meant for logs opened new
/// after it is set (a log already past one segment could then not even compact).
fn segments_max(tuning: &Tuning, faults: &Faults) -> u64 {
    let configured = (tuning.bytes_max / tuning.segment_bytes).max(2);
    match faults.page_count_max() {
        Some(pages) => configured.min(pages * 4096 / tuning.segment_bytes).max(1),
        None => configured,
    }
}

/// Creates segment `seq` full of zeros and makes it and its name durable. Each chunk is
/// synced before the next is written: left to the end, the whole segment's writeback
/// would queue ahead of the shards' commit syncs on the same disk.
fn zero_fill(files: &dyn Files, dir: &Path, seq: u32, bytes: u64) -> std::io::Result<()> {
    let file = files.open_segment(&dir.join(segment_name(seq)))?;
    let mut offset = 0;
    while offset < bytes {
        let end = (offset + ZERO_CHUNK_BYTES).min(bytes);
        write_zeros(&*file, offset, end)?;
        file.sync_data()?;
        offset = end;
    }
    files.sync_dir(dir)
}

/// Writes zeros over `from..to` of `file` in writes of [`ZERO_WRITE_BYTES`] (which says
/// why): the first write ends at a multiple of it, so each later one fills one folio.
fn write_zeros(file: &dyn SegmentFile, from: u64, to: u64) -> std::io::Result<()> {
    let zeros = [0; ZERO_WRITE_BYTES as usize];
    let mut offset = from;
    while offset < to {
        let n = (ZERO_WRITE_BYTES - offset % ZERO_WRITE_BYTES).min(to - offset);
        file.write_at(offset, &zeros[..n as usize])?;
        offset += n;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use oncegate_core::{Fingerprint, Key, Namespace, Record, Scope, Tenant, Transition};

    const SEGMENT_BYTES: u64 = 64 << 10;

    fn tuning(files: Arc<dyn Files>, bytes_max: u64) -> Tuning {
        Tuning {
            durability: Durability::Full,
            segment_bytes: SEGMENT_BYTES,
            bytes_max,
            reclaim_granularity_ms: 1_000,
            files,
            routing: Routing::BucketBase,
            retired: Arc::default(),
            owed: OwedZeros::default(),
            owned: None,
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

    /// 2,000 batches 100 ms apart, each of ten keys `k{batch}-{n}` (token `batch * 10 + n +
    /// 1`), of which the first `long_lived` live long and the others expire within a
    /// second; each batch also reclaims what is due, so the log fills with dead records
    /// for compaction to drop.
    fn fill_expiring(store: &mut Store, long_lived: u64) {
        for batch in 0..2_000u64 {
            let now = batch * 100;
            let txn = store.begin(now).unwrap();
            for n in 0..10 {
                let ttl = if n < long_lived { 10_000_000 } else { 1_000 };
                txn.put(&scope(&format!("k{batch}-{n}")), &granted(batch * 10 + n + 1, now, ttl)).unwrap();
            }
            txn.reclaim(now, 1_000).unwrap();
            txn.commit(Meta { next_token: batch * 10 + 11, high_water_ms: now }).unwrap();
        }
    }

    /// The reclaim schedule holds an entry per key and window, not per write: a key
    /// rewritten 5,000 times with the same deadline (a heartbeat's), and long-lived
    /// records copied again and again by compaction, add none; they are still reclaimed
    /// when their window comes. (With an entry per write, the schedule grew with every
    /// heartbeat and every copy until the window came, bounded by no key count.)
    #[test]
    fn rewrites_and_compaction_copies_add_no_schedule_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let held = granted(1, 0, 60_000_000);
        for batch in 0..5_000u64 {
            let txn = store.begin(batch).unwrap();
            txn.put(&scope("beating"), &held).unwrap();
            txn.commit(Meta { next_token: 2, high_water_ms: batch }).unwrap();
        }
        assert_eq!(store.schedule.len(), 1, "one key, one window");
        // Short-lived keys make compaction run over the long-lived ones many times.
        fill_expiring(&mut store, 1);
        assert!(store.retired.load(std::sync::atomic::Ordering::Relaxed) > 3, "compaction ran");
        let live = store.index.iter().count();
        assert!(store.schedule.len() <= live + 64, "{} entries for {live} live keys", store.schedule.len());
        // The long-lived ones still go when their window comes.
        let txn = store.begin(100_000_000).unwrap();
        let removed = txn.reclaim(100_000_000, usize::MAX).unwrap();
        txn.commit(Meta { next_token: 30_000, high_water_ms: 100_000_000 }).unwrap();
        assert_eq!((removed.pending + removed.completed) as usize, live, "every live key reclaimed");
        assert_eq!(store.index.iter().count(), 0);
    }

    /// A new log's first segment is zero-filled to its full size before the first commit,
    /// so that no commit's sync has to write a grown file size as well.
    #[test]
    fn a_new_log_starts_in_a_zero_filled_segment() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, created) = open(dir.path(), 1 << 30);
        assert!(created);
        let first = store.segments[&store.chain.head].size().unwrap();
        assert_eq!(first, SEGMENT_BYTES, "the first segment at its full size before any commit");
        let txn = store.begin(0).unwrap();
        txn.put(&scope("k"), &granted(1, 0, 60_000)).unwrap();
        txn.commit(Meta { next_token: 2, high_water_ms: 0 }).unwrap();
        drop(store);
        let (store, meta, created) = open(dir.path(), 1 << 30);
        assert!(!created);
        assert_eq!(meta.next_token, 2, "the commit in the filled segment is read back");
        assert_eq!(store.segments[&store.chain.head].size().unwrap(), SEGMENT_BYTES);
    }

    /// A first fill cut short (a crash or a power cut between its chunks) leaves a short
    /// first segment and nothing committed: the next open fills it again to its full size.
    #[test]
    fn a_first_fill_cut_short_is_done_again_at_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        crate::files::OsFiles
            .write_new(&dir.path().join(segment_name(1)), &vec![0; SEGMENT_BYTES as usize / 3])
            .unwrap();
        let (mut store, _, created) = open(dir.path(), 1 << 30);
        assert!(created, "nothing was committed in the short segment");
        assert_eq!((store.chain.head, store.segments[&1].size().unwrap()), (1, SEGMENT_BYTES));
        let txn = store.begin(0).unwrap();
        txn.put(&scope("k"), &granted(1, 0, 60_000)).unwrap();
        txn.commit(Meta { next_token: 2, high_water_ms: 0 }).unwrap();
        drop(store);
        let (_, meta, created) = open(dir.path(), 1 << 30);
        assert_eq!((created, meta.next_token), (false, 2));
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
        fill_expiring(&mut store, 1);
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

    /// A log of three segments whose requests filled what they may (100 live records a
    /// commit, so few bytes of frame headers), with an upkeep write that took its head
    /// into the last segment; every frame's time is 1.
    fn filled_to_the_last_segment(dir: &Path) -> Store {
        let (mut store, _, _) = open(dir, 3 * SEGMENT_BYTES);
        let meta = Meta { next_token: 1_000_000, high_water_ms: 1 };
        let mut n = 0u64;
        loop {
            let txn = store.begin(1).unwrap();
            let mut full = false;
            for _ in 0..100 {
                match txn.put(&scope(&format!("k{n}")), &granted(n + 1, 1, 10_000_000)) {
                    Ok(_) => n += 1,
                    Err(StoreError::Full) => {
                        full = true;
                        break;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            txn.commit(meta).unwrap();
            if full {
                break;
            }
        }
        let txn = store.begin(1).unwrap();
        txn.put_upkeep(&scope("k0"), &granted(1, 1, 10_000_000)).unwrap();
        txn.commit(meta).unwrap();
        assert_eq!(store.used_segments(), store.segments_max);
        store
    }

    /// In the log's last segment, kept for the writes that free room, a commit with
    /// nothing in it writes nothing while its time is within a second of the last
    /// frame's; a second on, or when its counters are wanted, it writes its bare frame,
    /// and a reopen reads that time.
    #[test]
    fn an_empty_commit_in_the_last_segment_writes_nothing_but_a_time_a_second_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = filled_to_the_last_segment(dir.path());
        let meta = |ms| Meta { next_token: 1_000_000, high_water_ms: ms };
        let tail = store.chain.tail;
        for ms in [1, 500, 1_000] {
            store.begin(ms).unwrap().commit(meta(ms)).unwrap();
        }
        assert_eq!(store.chain.tail, tail, "nothing written within the second");
        store.begin(1_001).unwrap().commit(meta(1_001)).unwrap();
        assert_eq!(store.chain.tail, tail + FRAME_HEADER_BYTES as u64, "the time a second on is written");
        let txn = store.begin(1_002).unwrap();
        txn.want_meta();
        txn.commit(meta(1_002)).unwrap();
        assert_eq!(store.chain.tail, tail + 2 * FRAME_HEADER_BYTES as u64, "wanted counters are written");
        store.begin(1_500).unwrap().commit(meta(1_500)).unwrap();
        drop(store);
        let (_, recovered, _) = open(dir.path(), 3 * SEGMENT_BYTES);
        assert_eq!(recovered.high_water_ms, 1_002);
    }

    /// Bare frames written a second apart never take the last room for a header in the
    /// log's last segment: a transaction can always begin there (the reclaim alarm's that
    /// frees the log). Once they filled it to its end, no transaction could.
    #[test]
    fn bare_frames_leave_the_last_segment_room_to_begin() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = filled_to_the_last_segment(dir.path());
        let room = (SEGMENT_BYTES - store.chain.tail) / FRAME_HEADER_BYTES as u64;
        for n in 0..room + 10 {
            let ms = 2_000 + n * 1_001;
            store.begin(ms).unwrap().commit(Meta { next_token: 1_000_000, high_water_ms: ms }).unwrap();
        }
        assert!(store.chain.tail + FRAME_HEADER_BYTES as u64 <= SEGMENT_BYTES, "{}", store.chain.tail);
        let txn = store.begin(u64::MAX / 2).unwrap();
        txn.want_meta();
        txn.commit(Meta { next_token: 1_000_000, high_water_ms: u64::MAX / 2 }).unwrap();
        store.begin(u64::MAX / 2).expect("a transaction still begins");
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

    fn fill(store: &mut Store, batches: std::ops::Range<u64>, ttl_ms: u64) {
        for batch in batches {
            let txn = store.begin(batch).unwrap();
            for n in 0..20 {
                txn.put(&scope(&format!("k{batch}-{n}")), &granted(batch * 20 + n + 1, batch, ttl_ms))
                    .unwrap();
            }
            txn.commit(Meta { next_token: batch * 20 + 21, high_water_ms: batch }).unwrap();
        }
    }

    /// A frame damaged in acknowledged history (not a torn end: whole frames written after
    /// it follow, in its own segment or later ones) makes the log refuse to open,
    /// instead of ending there and dropping every transaction after it; in the oldest
    /// segment, and in the middle of the head.
    #[test]
    fn a_damaged_frame_in_acknowledged_history_is_refused_not_cut() {
        for damaged in ["oldest", "head"] {
            let dir = tempfile::tempdir().unwrap();
            let (mut store, _, _) = open(dir.path(), 1 << 30);
            fill(&mut store, 0..200, 60_000);
            let (first, head, tail) =
                (*store.segments.keys().next().unwrap(), store.chain.head, store.chain.tail);
            assert!(head >= first + 2, "the writes crossed segments");
            drop(store);
            let (seq, offset) = if damaged == "oldest" { (first, 5_000) } else { (head, tail / 2) };
            let file = crate::files::OsFiles.open_segment(&dir.path().join(segment_name(seq))).unwrap();
            file.write_at(offset, &[0xa5; 8]).unwrap();
            let opened = Store::open(
                dir.path(),
                &tuning(Arc::new(crate::files::OsFiles), 1 << 30),
                &Faults::default(),
            );
            assert!(matches!(opened, Err(StoreError::Corrupt(_))), "{damaged}: {:?}", opened.map(|_| ()));
        }
    }

    /// Offsets were chosen for the segment size the log was written with: opened with a
    /// smaller one, it is refused rather than read short.
    #[test]
    fn a_smaller_segment_size_than_the_log_was_written_with_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        fill(&mut store, 0..100, 60_000);
        drop(store);
        let smaller =
            Tuning { segment_bytes: SEGMENT_BYTES / 2, ..tuning(Arc::new(crate::files::OsFiles), 1 << 30) };
        let opened = Store::open(dir.path(), &smaller, &Faults::default());
        assert!(matches!(opened, Err(StoreError::Corrupt(_))), "{:?}", opened.map(|_| ()));
    }

    /// A log whose requests filled it still reclaims what expired and compacts: the last
    /// segment is kept for tombstones and copies, so requests get room again.
    #[test]
    fn a_full_log_reclaims_and_compacts_its_way_back_to_room() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 4 * SEGMENT_BYTES);
        let mut refused = false;
        for batch in 0..400u64 {
            let txn = store.begin(batch).unwrap();
            let put = txn.put(&scope(&format!("k{batch}")), &granted(batch + 1, batch, 1_000));
            if put.as_ref().is_err_and(|e| txn.failed_alone(e)) {
                refused = true;
                break;
            }
            put.unwrap();
            txn.commit(Meta { next_token: batch + 2, high_water_ms: batch }).unwrap();
            let mut big = granted(batch + 1, batch, 1_000);
            big.fingerprint = Fingerprint::from_stored(vec![1; 64]);
            let txn = store.begin(batch).unwrap();
            for n in 0..40 {
                if txn.put(&scope(&format!("k{batch}-{n}")), &big).is_err() {
                    refused = true;
                }
            }
            txn.commit(Meta { next_token: batch + 2, high_water_ms: batch }).unwrap();
        }
        assert!(refused, "the log reached its limit");
        // Everything expires; reclaim and compaction free the log.
        for round in 0..200u64 {
            let now = 1_000_000 + round;
            let txn = store.begin(now).unwrap();
            txn.reclaim(now, 10_000).unwrap();
            txn.commit(Meta { next_token: 1_000, high_water_ms: now }).unwrap();
        }
        let txn = store.begin(2_000_000).unwrap();
        txn.put(&scope("after"), &granted(1_000, 2_000_000, 1_000)).unwrap();
        txn.commit(Meta { next_token: 1_001, high_water_ms: 2_000_000 }).unwrap();
        assert!(store.used_segments() < 4, "{} segments in use", store.used_segments());
    }

    /// The OS's files, watched: segment syncs fail while `failing` is set, and a segment
    /// removed or renamed while another holds writes not yet synced is noted.
    #[derive(Debug, Default)]
    struct Watched {
        failing: std::sync::atomic::AtomicBool,
        /// Set: this many more segment syncs succeed, then every one fails (`failing`), or,
        /// with `recovers`, the next one only.
        syncs_before_failing: std::sync::Mutex<Option<u32>>,
        recovers: std::sync::atomic::AtomicBool,
        /// Set: segment writes fail too while syncs fail (`failing`), as the writes of a
        /// disk that has begun to fail.
        writes_fail_with_syncs: std::sync::atomic::AtomicBool,
        /// Renames and removes of segments to refuse.
        failing_retires: std::sync::atomic::AtomicU32,
        /// Segments written since their last sync (the spare thread's zero-filling aside).
        dirty: std::sync::Mutex<std::collections::HashSet<PathBuf>>,
        retired_over_unsynced: std::sync::atomic::AtomicBool,
        /// Set: the directory sync after the next rename fails (once).
        failing_dir_sync_after_rename: std::sync::atomic::AtomicBool,
        failing_dir_sync: std::sync::atomic::AtomicBool,
        /// A rename since the directory was last synced: a power cut may undo it.
        renamed_unsynced: std::sync::Mutex<Option<(PathBuf, PathBuf)>>,
        /// Set: every segment write from now on, in order (path, offset, bytes).
        journal: std::sync::Mutex<Option<Vec<Written>>>,
    }

    /// A segment write: the segment, the offset, the bytes.
    type Written = (PathBuf, u64, Vec<u8>);

    #[derive(Debug)]
    struct WatchedSegment {
        file: Box<dyn SegmentFile>,
        path: PathBuf,
        watched: Arc<Watched>,
    }

    impl SegmentFile for WatchedSegment {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
            self.file.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
            let seq_cst = std::sync::atomic::Ordering::SeqCst;
            if self.watched.writes_fail_with_syncs.load(seq_cst) && self.watched.failing.load(seq_cst) {
                return Err(std::io::Error::other("injected: write failed"));
            }
            if std::thread::current().name() != Some("oncegate-log-spare") {
                self.watched.dirty.lock().unwrap().insert(self.path.clone());
                if let Some(journal) = self.watched.journal.lock().unwrap().as_mut() {
                    journal.push((self.path.clone(), offset, bytes.to_vec()));
                }
            }
            self.file.write_at(offset, bytes)
        }
        fn drop_cached(&self) -> std::io::Result<()> {
            self.file.drop_cached()
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let recovers = self.watched.recovers.load(std::sync::atomic::Ordering::SeqCst);
            let mut before_failing = self.watched.syncs_before_failing.lock().unwrap();
            if let Some(left) = before_failing.as_mut() {
                if *left == 0 {
                    self.watched.failing.store(true, std::sync::atomic::Ordering::SeqCst);
                    if recovers {
                        *before_failing = None;
                    }
                } else {
                    *left -= 1;
                }
            }
            drop(before_failing);
            if self.watched.failing.load(std::sync::atomic::Ordering::SeqCst) {
                if recovers {
                    self.watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
                }
                return Err(std::io::Error::other("injected: fdatasync failed"));
            }
            self.watched.dirty.lock().unwrap().remove(&self.path);
            self.file.sync_data()
        }
        fn size(&self) -> std::io::Result<u64> {
            self.file.size()
        }
    }

    /// The files seam over [`Watched`] (an `Arc`, shared with its segments).
    #[derive(Debug, Default)]
    struct WatchedFiles(Arc<Watched>);

    impl WatchedFiles {
        fn retiring(&self, path: &Path) -> std::io::Result<()> {
            let failing = &self.0.failing_retires;
            let refuse = |n: u32| n.checked_sub(1);
            if failing
                .fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    refuse,
                )
                .is_ok()
            {
                return Err(std::io::Error::other("injected: the segment cannot be renamed or removed"));
            }
            let dirty = self.0.dirty.lock().unwrap();
            if dirty.iter().any(|p| p != path) {
                self.0.retired_over_unsynced.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(())
        }
    }

    impl Files for WatchedFiles {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            crate::files::OsFiles.create_dir_all(dir)
        }
        fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
            crate::files::OsFiles.read(path)
        }
        fn write_new(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            crate::files::OsFiles.write_new(path, bytes)
        }
        fn create(&self, path: &Path) -> std::io::Result<bool> {
            crate::files::OsFiles.create(path)
        }
        fn sync_file(&self, path: &Path) -> std::io::Result<()> {
            crate::files::OsFiles.sync_file(path)
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            self.retiring(from)?;
            crate::files::OsFiles.rename(from, to)?;
            *self.0.renamed_unsynced.lock().unwrap() = Some((from.to_owned(), to.to_owned()));
            if self.0.failing_dir_sync_after_rename.swap(false, std::sync::atomic::Ordering::SeqCst) {
                self.0.failing_dir_sync.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(())
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            self.retiring(path)?;
            crate::files::OsFiles.remove(path)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            if self.0.failing_dir_sync.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(std::io::Error::other("injected: the directory cannot be synced"));
            }
            crate::files::OsFiles.sync_dir(dir)?;
            *self.0.renamed_unsynced.lock().unwrap() = None;
            Ok(())
        }
        fn list(&self, dir: &Path) -> std::io::Result<Vec<String>> {
            crate::files::OsFiles.list(dir)
        }
        fn lock(&self, dir: &Path) -> std::io::Result<Option<crate::files::LockGuard>> {
            crate::files::OsFiles.lock(dir)
        }
        fn restrict(&self, path: &Path) -> std::io::Result<()> {
            crate::files::OsFiles.restrict(path)
        }
        fn open_segment(&self, path: &Path) -> std::io::Result<Box<dyn SegmentFile>> {
            let file = crate::files::OsFiles.open_segment(path)?;
            Ok(Box::new(WatchedSegment { file, path: path.to_owned(), watched: Arc::clone(&self.0) }))
        }
    }

    /// With `durability = "normal"` commits are not synced, but a segment is retired only
    /// once every segment written since its last sync is: compaction's copies of its live
    /// records may be spread over several commits and segments.
    #[test]
    fn durability_normal_retires_a_segment_only_after_its_copies_are_synced() {
        let (_dir, watched, _, mut store) = watched_log(Durability::Normal);
        fill_expiring(&mut store, 3);
        assert!(store.retired.load(std::sync::atomic::Ordering::Relaxed) > 0, "compaction retired segments");
        assert!(!watched.retired_over_unsynced.load(std::sync::atomic::Ordering::SeqCst));
    }

    /// A commit whose `fdatasync` failed is not read back by the shard's next open in the
    /// same process, though its frames sit in the page cache: the disk may never have
    /// them, and what the shard commits next must not chain onto them.
    #[test]
    fn a_commit_whose_sync_failed_is_not_read_back_by_the_next_open() {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        let failing = &watched.failing;
        let txn = store.begin(1).unwrap();
        txn.put(&scope("before"), &granted(1, 1, 60_000)).unwrap();
        txn.commit(Meta { next_token: 2, high_water_ms: 1 }).unwrap();
        failing.store(true, std::sync::atomic::Ordering::SeqCst);
        let txn = store.begin(2).unwrap();
        txn.put(&scope("unsynced"), &granted(2, 2, 60_000)).unwrap();
        assert!(txn.commit(Meta { next_token: 3, high_water_ms: 2 }).is_err());
        failing.store(false, std::sync::atomic::Ordering::SeqCst);
        drop(store);
        let (mut store, meta, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        assert_eq!(
            meta,
            Meta { next_token: 2, high_water_ms: 1 },
            "the failed commit's counters are not read"
        );
        let txn = store.begin(3).unwrap();
        assert!(txn.get(&scope("before")).unwrap().is_some());
        assert!(txn.get(&scope("unsynced")).unwrap().is_none(), "read back from the page cache");
    }

    /// Under `durability = "normal"`, a sync that fails (one a retirement or a forced
    /// commit asks for) also takes back the earlier commits written since their segment's
    /// last good sync: the kernel may have dropped them after the error while marking
    /// their pages clean, so the reopen in this process, reading them from the page
    /// cache, would take them for the log's (its own syncs then succeed on nothing) and
    /// compaction could retire the segments their copies came from.
    #[test]
    fn a_failed_sync_under_normal_takes_back_every_frame_since_the_last_good_one() {
        let (dir, watched, normal, mut store) = watched_log(Durability::Normal);
        store.sync_commits(true);
        commit_keys(&mut store, 1, "synced-").unwrap();
        store.sync_commits(false);
        for batch in 2..6 {
            commit_keys(&mut store, batch, &format!("unsynced{batch}-")).unwrap();
        }
        store.sync_commits(true);
        watched.failing.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(commit_keys(&mut store, 6, "failed-").is_err(), "the injected sync failure is reported");
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        drop(store);
        let (mut store, meta, _) = Store::open(dir.path(), &normal, &Faults::default()).unwrap();
        assert_eq!(meta, Meta { next_token: 21, high_water_ms: 1 }, "the chain ends at the last good sync");
        let txn = store.begin(7).unwrap();
        assert!(txn.get(&scope("synced-0")).unwrap().is_some(), "a synced record was lost");
        for batch in 2..6 {
            assert!(
                txn.get(&scope(&format!("unsynced{batch}-0"))).unwrap().is_none(),
                "read back from the page cache"
            );
        }
    }

    /// The same failed sync under `"normal"` on a disk that then fails the zeros too: the
    /// frames since the last good sync stay in the page cache, and the reopen in this
    /// process read them as the log's until the zeros were owed to it (it writes them
    /// before it reads the log).
    #[test]
    fn frames_a_failed_sync_under_normal_could_not_zero_are_zeroed_by_the_reopen() {
        let (dir, watched, normal, mut store) = watched_log(Durability::Normal);
        let seq_cst = std::sync::atomic::Ordering::SeqCst;
        store.sync_commits(true);
        commit_keys(&mut store, 1, "synced-").unwrap();
        store.sync_commits(false);
        commit_keys(&mut store, 2, "unsynced-").unwrap();
        store.sync_commits(true);
        watched.writes_fail_with_syncs.store(true, seq_cst);
        *watched.syncs_before_failing.lock().unwrap() = Some(0);
        assert!(commit_keys(&mut store, 3, "failed-").is_err(), "the injected sync failure is reported");
        *watched.syncs_before_failing.lock().unwrap() = None;
        watched.failing.store(false, seq_cst);
        assert!(!normal.owed.lock().is_empty(), "the zeros could not be written, so they are owed");
        drop(store);
        let (mut store, meta, _) = Store::open(dir.path(), &normal, &Faults::default()).unwrap();
        assert!(normal.owed.lock().is_empty(), "the open paid what was owed");
        assert_eq!(meta, Meta { next_token: 21, high_water_ms: 1 }, "the chain ends at the last good sync");
        let txn = store.begin(4).unwrap();
        assert!(txn.get(&scope("synced-0")).unwrap().is_some(), "a synced record was lost");
        assert!(txn.get(&scope("unsynced-0")).unwrap().is_none(), "read back from the page cache");
        assert!(txn.get(&scope("failed-0")).unwrap().is_none(), "the failed commit read back");
    }

    /// A commit whose sync fails and whose zeros are written but cannot be synced owes
    /// those zeros to the next open: it drops the page cache before it reads the log, and
    /// would otherwise read the frame from the device, whole if the failed writeback got
    /// it there (a real file system here keeps the zeros, so the debt is what is checked).
    #[test]
    fn zeros_that_could_not_be_synced_are_owed_to_the_next_open() {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        commit_keys(&mut store, 1, "before-").unwrap();
        *watched.syncs_before_failing.lock().unwrap() = Some(0);
        assert!(commit_keys(&mut store, 2, "failed-").is_err(), "the injected sync failure is reported");
        *watched.syncs_before_failing.lock().unwrap() = None;
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(tuning.owed.lock().len(), 1, "the frame's zeros are owed");
        drop(store);
        let (mut store, meta, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        assert!(tuning.owed.lock().is_empty(), "the open paid what was owed");
        assert_eq!(
            meta,
            Meta { next_token: 21, high_water_ms: 1 },
            "the failed commit's counters are not read"
        );
        let txn = store.begin(3).unwrap();
        assert!(txn.get(&scope("before-0")).unwrap().is_some());
        assert!(txn.get(&scope("failed-0")).unwrap().is_none(), "the failed commit read back");
    }

    /// When the syncs of one retiring (or forced) commit under `"normal"` succeed for an
    /// earlier segment and fail for a later one, the earlier segment's frames are kept
    /// (durable now) and the later one's taken back: the chain the reopen reads ends
    /// where the durable prefix does.
    #[test]
    fn a_sync_failing_after_a_good_one_takes_back_only_the_later_segment() {
        let (dir, watched, normal, mut store) = watched_log(Durability::Normal);
        let mut batch = 1;
        while store.chain.head == 1 {
            commit_keys(&mut store, batch, &format!("first{batch}-")).unwrap();
            batch += 1;
        }
        let in_second = batch - 1;
        commit_keys(&mut store, batch, &format!("second{batch}-")).unwrap();
        batch += 1;
        assert_eq!(store.unsynced.len(), 2, "both segments written unsynced");
        store.sync_commits(true);
        *watched.syncs_before_failing.lock().unwrap() = Some(1);
        assert!(commit_keys(&mut store, batch, "failed-").is_err(), "the second segment's sync fails");
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        *watched.syncs_before_failing.lock().unwrap() = None;
        drop(store);
        let (mut store, _, _) = Store::open(dir.path(), &normal, &Faults::default()).unwrap();
        let txn = store.begin(batch + 1).unwrap();
        for kept in 1..in_second {
            assert!(txn.get(&scope(&format!("first{kept}-0"))).unwrap().is_some(), "first{kept} lost");
        }
        let second = format!("second{}-0", in_second + 1);
        assert!(txn.get(&scope(&second)).unwrap().is_none(), "{second} read back from the page cache");
    }

    /// Under `"full"`, a commit spanning two segments whose second sync fails is taken
    /// back by zeroing its frames. A power cut while they are zeroed may keep any prefix
    /// of those zero writes (here: each prefix, writes reaching the disk in order): with
    /// the first frame zeroed first, the prefix of one left zeros before a whole second
    /// frame, whose `ordered` flag says the first was durable, and the log was refused as
    /// corrupt. Zeroed last frame first, every prefix opens, with the commit wholly there
    /// or wholly gone.
    #[test]
    fn a_spanning_commit_taken_back_leaves_a_log_that_opens_after_a_cut_while_zeroing() {
        let zeroed = spanning_commit_taken_back(true);
        assert_eq!(zeroed, ["00000002.seg", "00000001.seg"], "both frames zeroed, the last first");
    }

    /// The same with every sync failing from the second frame's on: the second frame's
    /// zeros are written and cannot be synced, and the first frame is left whole. With
    /// no sync to order them, a cut may keep any of the zero writes, not only a prefix:
    /// zeros over the first frame kept without the second frame's were the damage above.
    /// The reopen in this process already finds the commit without its last frame.
    #[test]
    fn a_spanning_commit_whose_zeros_cannot_be_synced_keeps_its_first_frame() {
        let zeroed = spanning_commit_taken_back(false);
        assert_eq!(zeroed, ["00000002.seg"], "only the last frame zeroed");
    }

    /// Commits `records` records of about 4 KB each (`spanning0`, ...) in one transaction at
    /// time 2, the first `syncs_ok` segment syncs succeeding and every later one failing.
    fn commit_big_records(
        store: &mut Store,
        watched: &Watched,
        records: u64,
        syncs_ok: u32,
    ) -> Result<(), StoreError> {
        let mut big = granted(100, 2, 10_000_000);
        big.completion = Some(oncegate_core::Completion {
            outcome: oncegate_core::Outcome::Succeeded,
            response: vec![7; 4_000],
            completed_at_ms: 2,
        });
        let txn = store.begin(2).unwrap();
        for n in 0..records {
            txn.put(&scope(&format!("spanning{n}")), &big).unwrap();
        }
        *watched.syncs_before_failing.lock().unwrap() = Some(syncs_ok);
        txn.commit(Meta { next_token: 200, high_water_ms: 2 })
    }

    /// A transaction of four frames (four segments) cut off after its third was durable,
    /// here by its fourth frame's sync failing and its zeros failing to sync too, leaves
    /// three whole frames that the next open finds incomplete. The open's own commit went
    /// where the first was, so the second no longer chained and the third, whole and
    /// ordered, sat two past the chain's end: the open after that refused the log as
    /// damaged. The open now zeroes an incomplete transaction's frames first.
    #[test]
    fn a_transaction_cut_off_after_three_of_its_four_frames_leaves_a_log_that_opens_twice() {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        commit_keys(&mut store, 1, "before-").unwrap();
        // About 3.5 segments of records: four frames.
        assert!(commit_big_records(&mut store, &watched, 56, 3).is_err());
        assert_eq!(store.chain.head, 1, "the commit started in the first segment");
        drop(store);
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        *watched.syncs_before_failing.lock().unwrap() = None;
        for open in 0..2 {
            let opened = Store::open(dir.path(), &tuning, &Faults::default());
            let (mut store, _, _) = opened.unwrap_or_else(|e| panic!("open {open}: {e}"));
            let txn = store.begin(3).unwrap();
            assert!(txn.get(&scope("before-0")).unwrap().is_some());
            assert!(txn.get(&scope("spanning0")).unwrap().is_none(), "the cut-off transaction is not read");
            drop(txn);
            // What the shard's open commits (its counters), in the first frame's place.
            let txn = store.begin(3).unwrap();
            txn.commit(Meta { next_token: 200, high_water_ms: 3 }).unwrap();
        }
    }

    /// After a commit of three frames taken back whose third frame's zeros could not be
    /// synced, the reopen in this process reads those zeros from the page cache, finds the
    /// first two frames incomplete and zeroes them, synced, then commits in the first
    /// one's place. A power cut may keep all that and lose the unsynced zeros: the third
    /// frame, whole and ordered, two past the new chain's end, and the next open refused
    /// the log. The reopen zeroes and syncs the place of the frame after the incomplete
    /// ones first.
    #[test]
    fn a_reopen_after_zeros_that_could_not_be_synced_leaves_a_log_that_opens_after_a_cut() {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        commit_keys(&mut store, 1, "before-").unwrap();
        *watched.journal.lock().unwrap() = Some(Vec::new());
        // About 2.3 segments of records: three frames.
        assert!(commit_big_records(&mut store, &watched, 36, 2).is_err());
        drop(store);
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        *watched.syncs_before_failing.lock().unwrap() = None;
        let journal = watched.journal.lock().unwrap().take().unwrap();
        let (frames, zeros): (Vec<_>, Vec<_>) =
            journal.into_iter().partition(|(_, _, b)| b.iter().any(|&x| x != 0));
        assert_eq!((frames.len(), zeros.len()), (3, 1), "three frames written, the third zeroed");
        *watched.journal.lock().unwrap() = Some(Vec::new());
        let (mut reopened, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        // What the shard's open commits, in the first frame's place.
        reopened.begin(3).unwrap().commit(Meta { next_token: 200, high_water_ms: 3 }).unwrap();
        drop(reopened);
        let reopen_writes = watched.journal.lock().unwrap().take().unwrap();
        // The cut: the commit's zeros over the third frame are lost; every write of the
        // reopen stays (each was synced).
        let os = crate::files::OsFiles;
        let cut = tempfile::tempdir().unwrap();
        for name in os.list(dir.path()).unwrap() {
            os.write_new(&cut.path().join(&name), &os.read(&dir.path().join(&name)).unwrap()).unwrap();
        }
        let segment = |path: &PathBuf| os.open_segment(&cut.path().join(path.file_name().unwrap())).unwrap();
        let third = frames.iter().find(|(p, o, _)| (p, o) == (&zeros[0].0, &zeros[0].1)).unwrap();
        segment(&third.0).write_at(third.1, &third.2).unwrap();
        for (path, offset, bytes) in &reopen_writes {
            segment(path).write_at(*offset, bytes).unwrap();
        }
        let opened = Store::open(cut.path(), &tuning, &Faults::default());
        let (mut store, _, _) = opened.unwrap_or_else(|e| panic!("after the cut: {e}"));
        let txn = store.begin(4).unwrap();
        assert!(txn.get(&scope("before-0")).unwrap().is_some());
        assert!(txn.get(&scope("spanning0")).unwrap().is_none());
    }

    /// Commits a transaction spanning two segments whose second sync fails (and, unless
    /// `recovers`, every sync after it), then opens the log after each cut that keeps a
    /// prefix of the zero writes (when their syncs succeed: each was durable before the
    /// next began) or any subset of them (when they fail); returns the segments zeroed,
    /// in order.
    fn spanning_commit_taken_back(recovers: bool) -> Vec<String> {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        let mut batch = 1;
        while SEGMENT_BYTES - store.chain.tail > 4_096 {
            commit_keys(&mut store, batch, &format!("before{batch}-")).unwrap();
            batch += 1;
        }
        // Sixty records do not fit in the first segment's room: the commit spans two.
        let txn = store.begin(batch).unwrap();
        for n in 0..60 {
            txn.put(&scope(&format!("spanning{n}")), &granted(batch * 100 + n, batch, 10_000_000)).unwrap();
        }
        *watched.journal.lock().unwrap() = Some(Vec::new());
        watched.recovers.store(recovers, std::sync::atomic::Ordering::SeqCst);
        *watched.syncs_before_failing.lock().unwrap() = Some(1);
        assert!(txn.commit(Meta { next_token: batch * 100 + 61, high_water_ms: batch }).is_err());
        drop(store);
        watched.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        *watched.syncs_before_failing.lock().unwrap() = None;
        let journal = watched.journal.lock().unwrap().take().unwrap();
        let (frames, zeros): (Vec<_>, Vec<_>) =
            journal.into_iter().partition(|(_, _, b)| b.iter().any(|&x| x != 0));
        assert_eq!(frames.len(), 2, "the commit wrote one frame in each of two segments");
        let before_image = |(path, offset, _): &Written| {
            frames
                .iter()
                .find(|(p, o, _)| p == path && o == offset)
                .expect("a zeroed frame was written")
                .clone()
        };
        let os = crate::files::OsFiles;
        let subsets = 0..1u32 << zeros.len();
        let cuts: Vec<Vec<bool>> = if recovers {
            (0..=zeros.len()).map(|kept| (0..zeros.len()).map(|n| n < kept).collect()).collect()
        } else {
            subsets.map(|bits| (0..zeros.len()).map(|n| bits & (1 << n) != 0).collect()).collect()
        };
        for kept in cuts {
            // The files after a cut that kept the zero writes `kept` says.
            let cut = tempfile::tempdir().unwrap();
            for name in os.list(dir.path()).unwrap() {
                os.write_new(&cut.path().join(&name), &os.read(&dir.path().join(&name)).unwrap()).unwrap();
            }
            for (lost, _) in zeros.iter().zip(&kept).filter(|(_, kept)| !**kept) {
                let (path, offset, bytes) = before_image(lost);
                let file = os.open_segment(&cut.path().join(path.file_name().unwrap())).unwrap();
                file.write_at(offset, &bytes).unwrap();
            }
            let opened = Store::open(cut.path(), &tuning, &Faults::default());
            let (mut reopened, _, _) = opened.unwrap_or_else(|e| panic!("zero writes kept {kept:?}: {e}"));
            let txn = reopened.begin(batch + 1).unwrap();
            assert!(
                txn.get(&scope("before1-0")).unwrap().is_some(),
                "a commit before the failed one was lost"
            );
            let first = txn.get(&scope("spanning0")).unwrap().is_some();
            let last = txn.get(&scope("spanning59")).unwrap().is_some();
            assert_eq!(first, last, "zero writes kept {kept:?}: the failed commit is there in part");
            // Every zero write kept (the page cache, as the reopen in this process reads it):
            // the commit is gone.
            assert!(kept.contains(&false) || !first, "the reopen reads the failed commit back");
        }
        zeros.iter().map(|(path, _, _)| path.file_name().unwrap().to_string_lossy().into_owned()).collect()
    }

    /// The log's last segment is for the writes that free room: while the head is in it,
    /// every request's write is refused, even where the segment has room; tombstones and
    /// compaction still go there.
    #[test]
    fn requests_never_write_into_the_last_segment() {
        let dir = tempfile::tempdir().unwrap();
        // Segments larger than compaction reads per commit, so that copying one takes
        // several commits and the head can reach the last segment meanwhile.
        let segment_bytes = 4 * COMPACT_BYTES_PER_COMMIT as u64;
        let tuning = Tuning { segment_bytes, ..tuning(Arc::new(crate::files::OsFiles), 3 * segment_bytes) };
        let (mut store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        let mut in_last = 0;
        for batch in 0..3_000u64 {
            let last = store.used_segments() == store.segments_max;
            in_last += u64::from(last);
            if in_last > 20 {
                break;
            }
            let txn = store.begin(batch).unwrap();
            for n in 0..20 {
                // Half of the records are replaced at once, so compaction has room to win.
                let key = format!("k{batch}-{}", n % 10);
                let put = txn.put(&scope(&key), &granted(batch * 20 + n + 1, batch, 10_000_000));
                assert!(
                    !last || matches!(put, Err(StoreError::Full)),
                    "a request wrote into the last segment"
                );
            }
            txn.commit(Meta { next_token: batch * 20 + 21, high_water_ms: batch }).unwrap();
        }
        assert!(in_last > 0, "the head never reached the last segment");
    }

    /// A compacted segment that could not be renamed or removed stays the oldest, and no
    /// later segment is retired before it: the log still opens whole afterwards (retiring
    /// a later one would have broken the chain recovery walks from the oldest segment).
    #[test]
    fn a_segment_that_could_not_be_retired_stays_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let files = Arc::new(WatchedFiles::default());
        files.0.failing_retires.store(3, std::sync::atomic::Ordering::SeqCst);
        let tuning = tuning(files, 1 << 30);
        let (mut store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        fill_expiring(&mut store, 1);
        assert!(store.retired.load(std::sync::atomic::Ordering::Relaxed) > 3, "later retirements succeeded");
        drop(store);
        let (mut store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        let txn = store.begin(200_000).unwrap();
        for batch in 0..2_000u64 {
            assert!(txn.get(&scope(&format!("k{batch}-0"))).unwrap().is_some(), "k{batch}-0");
        }
    }

    /// A recycled segment whose new name could not be made durable (the directory sync
    /// after the rename failed) is not written until a directory sync succeeds. Written
    /// at once, a power cut could give its new frames the old name back, as the oldest
    /// segment: recovery would start the chain there and lose every segment after it.
    #[test]
    fn a_recycled_segment_is_not_written_before_its_name_is_durable() {
        recycled_segment_after_a_failed_directory_sync(false);
    }

    /// The same when the store is dropped and opened again before the recycled segment is
    /// written (the shard reopens its store after any failure): the open syncs the
    /// directory, so the rename an earlier store could not make durable is durable before
    /// this one writes anything.
    #[test]
    fn a_reopened_log_makes_an_earlier_rename_durable_before_it_writes() {
        recycled_segment_after_a_failed_directory_sync(true);
    }

    /// A new log of `durability` on watched files (1 GiB at most), with its directory, the
    /// files' record and the settings to open it again.
    fn watched_log(durability: Durability) -> (tempfile::TempDir, Arc<Watched>, Tuning, Store) {
        let dir = tempfile::tempdir().unwrap();
        let files = Arc::new(WatchedFiles::default());
        let watched = Arc::clone(&files.0);
        let tuning = Tuning { durability, ..tuning(files, 1 << 30) };
        let (store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        (dir, watched, tuning, store)
    }

    /// Commits ten keys named `prefix` and a number as batch `batch`.
    fn commit_keys(store: &mut Store, batch: u64, prefix: &str) -> Result<(), StoreError> {
        let txn = store.begin(batch)?;
        for n in 0..10 {
            txn.put(&scope(&format!("{prefix}{n}")), &granted(batch * 10 + n + 1, batch, 10_000_000))?;
        }
        txn.commit(Meta { next_token: batch * 10 + 11, high_water_ms: batch })
    }

    /// A log whose segment 1 holds only records with newer copies in segment 2, with no
    /// spare made after the head (a spare's fill syncs the directory); returns the next
    /// batch number. `room_bytes`: commits go on until the head has at most this much room.
    fn first_segment_superseded(store: &mut Store, dir: &Path, room_bytes: u64) -> u64 {
        let mut batch = 0;
        for round in 0..2 {
            while store.chain.head == round + 1 {
                commit_keys(store, batch, &format!("x{batch}-")).unwrap();
                batch += 1;
            }
        }
        for old in 0..batch {
            commit_keys(store, batch + old, &format!("x{old}-")).unwrap();
        }
        batch *= 2;
        while SEGMENT_BYTES - store.chain.tail > room_bytes {
            commit_keys(store, batch, &format!("y{batch}-")).unwrap();
            batch += 1;
        }
        store.take_prepared(true).unwrap();
        let spare = store.chain.head + 1;
        if let Some(file) = store.segments.remove(&spare) {
            drop(file);
            crate::files::OsFiles.remove(&dir.join(segment_name(spare))).unwrap();
        }
        batch
    }

    /// A power cut: undoes a rename the directory was not synced after.
    fn undo_unsynced_rename(watched: &Watched) {
        if let Some((from, to)) = watched.renamed_unsynced.lock().unwrap().take() {
            crate::files::OsFiles.rename(&to, &from).unwrap();
        }
    }

    /// Retires segment 1 into the spare with the directory sync after the rename failing,
    /// (`reopen`: drops the store and opens it again), commits into the recycled file, cuts
    /// the power, and checks that every record committed after the retirement is there.
    fn recycled_segment_after_a_failed_directory_sync(reopen: bool) {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        let mut batch = first_segment_superseded(&mut store, dir.path(), SEGMENT_BYTES);
        let spare = store.chain.head + 1;
        watched.failing_dir_sync_after_rename.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(store.retire(1).is_err(), "the injected directory sync failure is reported");
        assert!(store.segments.contains_key(&spare), "segment 1 was recycled as the spare");
        if reopen {
            drop(store);
            (store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        }
        // Records written from now on, up to the first commits into the recycled file.
        let mut late = 0;
        while store.chain.head < spare || late < 3 {
            commit_keys(&mut store, batch, &format!("late{late}-")).unwrap();
            (batch, late) = (batch + 1, late + 1);
        }
        assert!(
            store.chain.tail * 2 < SEGMENT_BYTES,
            "no spare after it made yet (its fill syncs the directory)"
        );
        drop(store);
        undo_unsynced_rename(&watched);
        let (mut store, _, _) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        let txn = store.begin(batch).unwrap();
        for n in 0..late {
            assert!(txn.get(&scope(&format!("late{n}-0"))).unwrap().is_some(), "late{n}-0 lost");
        }
    }

    /// A commit that fails before writing anything (here at the directory sync that a
    /// recycled segment's unsynced name holds the next write back for) writes nothing:
    /// the zeros that undo a failed write went to the frames' places whether or not they
    /// were written, there the start of the recycled file, which a power cut can give its
    /// old name back as the oldest segment: an outage under durability full (a damaged
    /// start), every record lost under normal (a log read as new).
    #[test]
    fn a_commit_that_failed_before_writing_writes_no_zeros() {
        let (dir, watched, tuning, mut store) = watched_log(Durability::Full);
        // Less room than a commit of ten keys takes: the next one spills into the spare.
        let mut batch = first_segment_superseded(&mut store, dir.path(), 512);
        let spare = store.chain.head + 1;
        watched.failing_dir_sync_after_rename.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(store.retire(1).is_err(), "the injected directory sync failure is reported");
        watched.failing_dir_sync.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(commit_keys(&mut store, batch, "failed-").is_err(), "the second directory sync failure too");
        batch += 1;
        let mut start = vec![0; FRAME_HEADER_BYTES];
        store.segments[&spare].read_at(0, &mut start).unwrap();
        assert!(start.iter().any(|&b| b != 0), "the recycled file's first frame was zeroed");
        drop(store);
        undo_unsynced_rename(&watched);
        let (mut store, _, created) = Store::open(dir.path(), &tuning, &Faults::default()).unwrap();
        assert!(!created, "the log was read as new");
        let txn = store.begin(batch).unwrap();
        assert!(
            txn.get(&scope("x0-0")).unwrap().is_some(),
            "a record committed before the failures was lost"
        );
    }

    /// Frames an earlier open wrote without syncing them (`durability = "normal"`) are
    /// synced when the log is opened again, before anything chains onto them: a commit
    /// this open syncs (under `"full"`, or a slot move's copy) would otherwise be lost
    /// with them at a power cut.
    #[test]
    fn an_open_syncs_the_frames_an_earlier_open_left_unsynced() {
        let (dir, watched, normal, mut store) = watched_log(Durability::Normal);
        for batch in 0..100u64 {
            let txn = store.begin(batch).unwrap();
            for n in 0..20 {
                txn.put(&scope(&format!("k{batch}-{n}")), &granted(batch * 20 + n + 1, batch, 60_000))
                    .unwrap();
            }
            txn.commit(Meta { next_token: batch * 20 + 21, high_water_ms: batch }).unwrap();
        }
        assert!(watched.dirty.lock().unwrap().len() > 1, "the writes crossed segments, unsynced");
        drop(store);
        let (store, _, _) = Store::open(dir.path(), &normal, &Faults::default()).unwrap();
        assert!(watched.dirty.lock().unwrap().is_empty(), "unsynced after the open: {:?}", watched.dirty);
        drop(store);
    }

    /// A transaction that rolls back (a slot's copy that did not fit) files nothing in the
    /// reclaim schedule: an entry naming bytes never written would be read by a later
    /// alarm, after other frames filled them, as an entry that is not there.
    #[test]
    fn a_rolled_back_transaction_schedules_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let txn = store.begin(0).unwrap();
        txn.put(&scope("gone"), &granted(1, 0, 1_000)).unwrap();
        drop(txn);
        assert_eq!(store.next_reclaim_ms(), None, "the rolled-back put left an entry");
        let txn = store.begin(0).unwrap();
        txn.put(&scope("kept"), &granted(2, 0, 1_000)).unwrap();
        txn.commit(Meta { next_token: 3, high_water_ms: 0 }).unwrap();
        assert_eq!(store.next_reclaim_ms(), Some(store.schedule.due_ms(1_000)));
    }

    /// Records of slots the shard does not own are ended at open, in several commits when
    /// there are many, and stay ended: the next open finds none of them.
    #[test]
    fn an_open_ends_the_records_of_slots_the_shard_does_not_own() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let records = 3 * FOREIGN_DELETES_PER_COMMIT as u64 + 7;
        let txn = store.begin(0).unwrap();
        for n in 0..records {
            txn.put(&scope(&format!("k{n}")), &granted(n + 1, 0, 60_000)).unwrap();
        }
        txn.commit(Meta { next_token: records + 1, high_water_ms: 0 }).unwrap();
        drop(store);
        // Shard 1 of a one-shard map owns no slot.
        let map = Arc::new(crate::slots::SlotMap::even(1));
        let owned = crate::slots::Owned { map, shard: 1, moving: None };
        let foreign = Tuning { owned: Some(owned), ..tuning(Arc::new(crate::files::OsFiles), 1 << 30) };
        let (mut store, meta, _) = Store::open(dir.path(), &foreign, &Faults::default()).unwrap();
        assert_eq!(meta.next_token, records + 1, "the counters still cover the foreign records");
        assert_eq!((store.take_count().pending, store.index.len()), (0, 0));
        drop(store);
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        assert_eq!((store.take_count().pending, store.index.len()), (0, 0), "ended for good");
    }

    /// Ending the foreign records in several commits, each compacting: a foreign record
    /// that compaction copies forward before its chunk comes is ended there too (by
    /// hash), and none survives the open or the next one.
    #[test]
    fn foreign_records_copied_forward_by_compaction_are_ended_too() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        let records = FOREIGN_DELETES_PER_COMMIT as u64;
        // The oldest segments hold records that stay live (so compaction copies them
        // forward), then other keys are written over five times (so the log is mostly
        // dead and every commit of the open compacts).
        for round in 0..6u64 {
            let txn = store.begin(round).unwrap();
            for n in 0..records {
                let key = if round == 0 { format!("k{n}") } else { format!("c{n}") };
                txn.put(&scope(&key), &granted(round * records + n + 1, round, 60_000)).unwrap();
            }
            txn.commit(Meta { next_token: 6 * records + 1, high_water_ms: round }).unwrap();
        }
        drop(store);
        let map = Arc::new(crate::slots::SlotMap::even(1));
        let owned = crate::slots::Owned { map, shard: 1, moving: None };
        let foreign = Tuning { owned: Some(owned), ..tuning(Arc::new(crate::files::OsFiles), 1 << 30) };
        let (mut store, _, _) = Store::open(dir.path(), &foreign, &Faults::default()).unwrap();
        assert!(
            foreign.retired.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "the open's commits compacted"
        );
        assert_eq!((store.take_count().pending, store.index.len()), (0, 0));
        drop(store);
        let (mut store, _, _) = open(dir.path(), 1 << 30);
        assert_eq!((store.take_count().pending, store.index.len()), (0, 0), "ended for good");
    }
}
