//! One transaction of the log: the frames it appends, written and synced at commit.

use std::cell::{Cell, RefCell};

use oncegate_core::{Record, Scope};

use super::format::{self, Entry, FRAME_HEADER_BYTES};
use super::{
    COMPACT_BYTES_PER_COMMIT, Compaction, Store, Writer, corrupt_at, decode_at, io, position, split,
};
use crate::index::Undo;
use crate::quota::Tally;
use crate::store::{Meta, StoreError};

/// How far a commit's time may run ahead of the last frame's before a commit with nothing
/// in it writes its bare frame after all, in the log's last segment.
const FRAME_TIME_SKIP_MS: u64 = 1_000;

/// A record found by scope in this transaction.
struct Located {
    scope: Scope,
    position: i64,
    len: usize,
    record: Record,
}

/// A frame being filled: its segment, its offset there, and its bytes (the header's
/// room first).
pub(super) struct Pending {
    pub(super) seq: u32,
    pub(super) start: u64,
    pub(super) bytes: Vec<u8>,
}

/// One transaction: the frames it will append, and the index changes it made (undone
/// if it does not commit).
pub(crate) struct Txn<'s> {
    store: RefCell<&'s mut Store>,
    now_ms: u64,
    frames: RefCell<Vec<Pending>>,
    undo: RefCell<Vec<Undo>>,
    unscheduled: RefCell<Vec<(u64, i64)>>,
    /// Keys to file in the reclaim schedule (deadline, [`schedule_entry`]) once the commit
    /// is durable, so that a transaction that rolls back files nothing.
    scheduled: RefCell<Vec<(u64, i64)>>,
    live_delta: Cell<i64>,
    located: RefCell<Option<Located>>,
    /// Whether the commit must write its frame even with nothing in it: its counters
    /// and time are wanted on disk (a clean stop's time, from which the restart grace
    /// measures).
    meta_wanted: Cell<bool>,
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
    pub(super) fn new(store: &'s mut Store, now_ms: u64, head: u32, tail: u64) -> Txn<'s> {
        let frame = Pending { seq: head, start: tail, bytes: vec![0; FRAME_HEADER_BYTES] };
        Txn {
            store: RefCell::new(store),
            now_ms,
            frames: RefCell::new(vec![frame]),
            undo: RefCell::default(),
            unscheduled: RefCell::default(),
            scheduled: RefCell::default(),
            live_delta: Cell::new(0),
            located: RefCell::default(),
            meta_wanted: Cell::new(false),
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

    /// The routing hash of a scope (the index's key).
    fn hash(&self, scope: &Scope) -> u64 {
        self.store.borrow().routing.hash(scope)
    }

    /// Where the live record of a scope is, if it has one (the record itself is left in
    /// `located`): the index names the candidates, the stored scope decides between them.
    fn locate(&self, scope: &Scope, hash: u64) -> Result<Option<(i64, usize)>, StoreError> {
        if let Some(last) = &*self.located.borrow()
            && last.scope == *scope
        {
            return Ok(Some((last.position, last.len)));
        }
        let candidates: Vec<i64> = self.store.borrow().index.ids(hash).collect();
        for position in candidates {
            // The index names only live records: one whose segment is gone was lost.
            let found = self.entry_at(position)?.ok_or_else(|| corrupt_at(position))?;
            if let (Entry::Record { scope: stored, record, .. }, len) = found
                && stored == *scope
            {
                *self.located.borrow_mut() = Some(Located { scope: stored, position, len, record });
                return Ok(Some((position, len)));
            }
        }
        Ok(None)
    }

    pub fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.failpoint()?;
        if self.locate(scope, self.hash(scope))?.is_none() {
            return Ok(None);
        }
        Ok(self.located.borrow().as_ref().map(|located| located.record.clone()))
    }

    /// Room for an entry of `len` bytes: in the current frame, or in a new frame at the
    /// start of the next segment. Refuses (`Full`, this write alone) when that segment
    /// would pass the log's limit (a request's write: the limit less one segment).
    fn room(&self, len: usize, writer: Writer) -> Result<(), StoreError> {
        let mut frames = self.frames.borrow_mut();
        let current = frames.last().expect("a transaction has a frame");
        let mut store = self.store.borrow_mut();
        let oldest = store.segments.keys().next().copied().unwrap_or(current.seq);
        let allowed = match writer {
            Writer::Request => store.segments_max - 1,
            Writer::Upkeep => store.segments_max,
        };
        // The segment a write lands in counts, whether it is the current one or the next:
        // a request's write may not use the last segment even when it is already open.
        let within = |seq: u32| u64::from(seq.saturating_sub(oldest)) < allowed;
        // A frame leaves room for the next one's header, so that a transaction always
        // starts in the head segment.
        if current.start + (current.bytes.len() + len + FRAME_HEADER_BYTES) as u64 <= store.segment_bytes {
            return if within(current.seq) { Ok(()) } else { Err(StoreError::Full) };
        }
        let next = current.seq + 1;
        if !within(next) {
            return Err(StoreError::Full);
        }
        store.take_prepared(true)?;
        store.segment(next)?;
        frames.push(Pending { seq: next, start: 0, bytes: vec![0; FRAME_HEADER_BYTES] });
        Ok(())
    }

    /// Appends an entry (written by `write`, `len` bytes); returns its position.
    fn append(
        &self,
        writer: Writer,
        len: usize,
        write: impl FnOnce(&mut Vec<u8>),
    ) -> Result<i64, StoreError> {
        self.room(len, writer)?;
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
        self.put_as(Writer::Request, scope, record)
    }

    /// Replaces a live record for the store's own upkeep (the restart grace): like a
    /// compaction copy it supersedes a live copy, so it may use the last segment.
    pub fn put_upkeep(&self, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.put_as(Writer::Upkeep, scope, record)
    }

    fn put_as(&self, writer: Writer, scope: &Scope, record: &Record) -> Result<u64, StoreError> {
        self.failpoint()?;
        let hash = self.hash(scope);
        let old = self.locate(scope, hash)?;
        let old_reclaim_at_ms = old.and(self.located.borrow().as_ref().map(|l| l.record.reclaim_at_ms()));
        let len = format::record_len(scope, record);
        let at = self.append(writer, len, |out| format::put_record(out, hash, scope, record))?;
        self.repoint(hash, old, Some((at, len)));
        *self.located.borrow_mut() =
            Some(Located { scope: scope.clone(), position: at, len, record: record.clone() });
        let due_ms = self.store.borrow().schedule.due_ms(record.reclaim_at_ms());
        // The key's entry in a window still to come finds this record as well: a heartbeat
        // (whose deadline stays) files nothing more.
        let filed = old_reclaim_at_ms
            .is_some_and(|old| self.store.borrow().schedule.due_ms(old) == due_ms && due_ms > self.now_ms);
        if !filed {
            self.scheduled.borrow_mut().push((record.reclaim_at_ms(), schedule_entry(hash)));
        }
        Ok(due_ms)
    }

    /// Deletes a key's record (a tombstone names the record it ends).
    pub fn delete(&self, scope: &Scope) -> Result<(), StoreError> {
        self.failpoint()?;
        let hash = self.hash(scope);
        let Some((position, len)) = self.locate(scope, hash)? else { return Ok(()) };
        self.tombstone(hash, position, len)
    }

    /// Ends the live record at `position` (`len` bytes) with a tombstone naming it.
    /// Tombstones may use the log's last segment.
    fn tombstone(&self, hash: u64, position: i64, len: usize) -> Result<(), StoreError> {
        let tombstone = |out: &mut Vec<u8>| format::put_tombstone(out, hash, position);
        self.append(Writer::Upkeep, format::TOMBSTONE_BYTES, tombstone)?;
        self.repoint(hash, Some((position, len)), None);
        if self.located.borrow().as_ref().is_some_and(|l| l.position == position) {
            *self.located.borrow_mut() = None;
        }
        Ok(())
    }

    /// The records of `rows` (from [`Store::slot_rows`]) with their scopes, expired ones
    /// included (their destination reclaims them as this shard would have).
    pub fn records_of(&self, rows: &[(u64, i64)]) -> Result<Vec<(Scope, Record)>, StoreError> {
        self.failpoint()?;
        let read = |position: i64| match self.entry_at(position)? {
            Some((Entry::Record { scope, record, .. }, _)) => Ok((scope, record)),
            _ => Err(corrupt_at(position)),
        };
        rows.iter().map(|(_, position)| read(*position)).collect()
    }

    /// Deletes the live records of the hashes `rows` names (from [`Store::slot_rows`], for
    /// a slot no request reaches any more); returns what was deleted, counted by state and
    /// tenant. The hash decides, not the position: compaction may have copied a record
    /// since it was listed, and every record of a hash is in the hash's slot. A hash with
    /// nothing left (reclaimed since) deletes nothing.
    pub fn delete_rows(&self, rows: &[(u64, i64)]) -> Result<Tally, StoreError> {
        self.failpoint()?;
        let mut removed = Tally::default();
        for (hash, _) in rows {
            let live: Vec<i64> = self.store.borrow().index.ids(*hash).collect();
            for position in live {
                let Some((Entry::Record { scope, record, .. }, len)) = self.entry_at(position)? else {
                    return Err(corrupt_at(position));
                };
                self.tombstone(*hash, position, len)?;
                removed.add_stored(&scope.tenant, record.completion.is_none());
            }
        }
        Ok(removed)
    }

    /// Takes at most `limit` entries from the reclaim schedule's ended windows and
    /// deletes the records still there and reclaimable at `now_ms`. Tombstones may use
    /// the log's last segment; a log with no room even there fails the alarm (`Full`),
    /// and the shard reopens with backoff rather than retrying at once.
    pub fn reclaim(&self, now_ms: u64, limit: usize) -> Result<Tally, StoreError> {
        self.failpoint()?;
        let taken = self.store.borrow_mut().schedule.take_due(now_ms, limit);
        self.unscheduled.borrow_mut().extend(taken.iter().copied());
        let mut removed = Tally::default();
        for (_, entry) in taken {
            // Entries are hints: a key whose record moved to a later window, or is gone,
            // deletes nothing here.
            let live: Vec<i64> = {
                let store = self.store.borrow();
                entry_hashes(entry).flat_map(|hash| store.index.ids(hash).collect::<Vec<_>>()).collect()
            };
            for position in live {
                let Some((Entry::Record { hash, scope, record }, len)) = self.entry_at(position)? else {
                    continue;
                };
                if record.reclaim_at_ms() > now_ms {
                    continue;
                }
                self.tombstone(hash, position, len)?;
                removed.add_stored(&scope.tenant, record.completion.is_none());
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

    /// Asks the commit to write this transaction's frame even if it holds no entry
    /// (every frame carries the counters and the time).
    pub fn want_meta(&self) {
        self.meta_wanted.set(true);
    }

    /// Whether the commit may write nothing: the transaction holds no entry (nor did a
    /// compaction step copy any, or finish a segment, whose retirement needs a sync), its
    /// frame would go into the log's last segment, and either it would take the last room
    /// for a header there or no one wants its time on disk and that time is within
    /// `FRAME_TIME_SKIP_MS` of the last frame's. That segment is kept
    /// for the writes that free room; a storm of refused batches, each writing a bare
    /// header, once filled it until no transaction could begin, the reclaim alarm's
    /// neither. The time bound keeps the high-water mark a restart reads close to the
    /// truth (the restart grace rewrites every lease that ends after it, and a stale mark
    /// would have it rewrite leases long expired, into that same last segment), at the
    /// cost of one bare header a second at most. At the last room not even a clean
    /// stop's or an open's time is written: the mark then stays at the last frame's, and
    /// a restart's grace may find leases to rewrite that ended since, which fail as full
    /// there (the open says so, as for a log full of live records) rather than leave a
    /// log in which no transaction can begin.
    fn may_write_nothing(&self, compaction: &Option<(Compaction, bool)>, meta: Meta) -> bool {
        let frames = self.frames.borrow();
        let [frame] = frames.as_slice() else { return false };
        let store = self.store.borrow();
        let oldest = store.segments.keys().next().copied().unwrap_or(frame.seq);
        // The last room for a header is never spent on a bare frame, whatever it carries:
        // the next transaction could then not begin, the reclaim alarm's neither.
        let last_room = frame.start + 2 * FRAME_HEADER_BYTES as u64 > store.segment_bytes;
        frame.bytes.len() == FRAME_HEADER_BYTES
            && !matches!(compaction, Some((_, true)))
            && u64::from(frame.seq.saturating_sub(oldest)) + 1 >= store.segments_max
            && (last_room
                || !self.meta_wanted.get()
                    && meta.high_water_ms < store.frame_time_ms.saturating_add(FRAME_TIME_SKIP_MS))
    }

    /// Copies the live records of the oldest segment's next frames into this transaction
    /// (reading at most `COMPACT_BYTES_PER_COMMIT` of it); returns where the copy stopped
    /// and whether it reached the segment's end.
    fn compact(&self) -> Result<Option<(Compaction, bool)>, StoreError> {
        let (mut state, end) = {
            let store = self.store.borrow();
            if !store.compaction_due() && store.compaction.is_none() {
                return Ok(None);
            }
            let Some(oldest) = store.segments.keys().next().copied() else { return Ok(None) };
            let Some(end) = store.ends.get(&oldest).copied() else { return Ok(None) };
            let state = match store.compaction {
                Some(c) if c.seq == oldest => c,
                _ => Compaction { seq: oldest, offset: 0, frame_seq: None },
            };
            (state, end)
        };
        let mut read = 0;
        while read < COMPACT_BYTES_PER_COMMIT {
            if state.offset >= end {
                return Ok(Some((state, true)));
            }
            let (header, bytes) = self.read_frame(&state)?;
            read += bytes.len();
            if !self.copy_live(&state, &bytes)? {
                return Ok(Some((state, false)));
            }
            state = Compaction {
                seq: state.seq,
                offset: state.offset + bytes.len() as u64,
                frame_seq: Some(header.seq + 1),
            };
        }
        Ok(Some((state, false)))
    }

    /// Copies the live records of one frame of the segment being compacted to this
    /// transaction; returns false when the log had no room for one (the frame is then
    /// copied again from its start later: what moved is no longer live there).
    fn copy_live(&self, state: &Compaction, bytes: &[u8]) -> Result<bool, StoreError> {
        let mut at = FRAME_HEADER_BYTES;
        while at < bytes.len() {
            let (entry, len) = decode_at(&bytes[at..])?;
            let from = position(state.seq, state.offset + at as u64);
            if let Entry::Record { hash, .. } = entry
                && self.store.borrow().index.ids(hash).any(|p| p == from)
            {
                let copy = |out: &mut Vec<u8>| out.extend_from_slice(&bytes[at..at + len]);
                let to = match self.append(Writer::Upkeep, len, copy) {
                    Err(StoreError::Full) => return Ok(false),
                    other => other?,
                };
                // The key's schedule entry finds the copy: it names the key, not the bytes.
                self.repoint(hash, Some((from, len)), Some((to, len)));
            }
            at += len;
        }
        Ok(true)
    }

    /// The whole frame at the compaction's place in the oldest segment: before the
    /// segment's end every frame was accepted at open or written by this process, so one
    /// that does not read back whole, or out of order, is damage.
    fn read_frame(&self, state: &Compaction) -> Result<(format::FrameHeader, Vec<u8>), StoreError> {
        let store = self.store.borrow();
        let damaged = || {
            StoreError::Corrupt(format!(
                "log segment {} has no whole frame at offset {} before its end",
                super::segment_name(state.seq),
                state.offset
            ))
        };
        let file = store.segments.get(&state.seq).ok_or_else(damaged)?;
        let room = store.segment_bytes.saturating_sub(state.offset) as usize;
        let mut head = [0; FRAME_HEADER_BYTES];
        let read = file.read_at(state.offset, &mut head).map_err(io(&store.dir))?;
        let header = format::read_header(&head[..read], room).ok_or_else(damaged)?;
        if state.frame_seq.is_some_and(|expected| header.seq != expected) {
            return Err(damaged());
        }
        let mut bytes = vec![0; FRAME_HEADER_BYTES + header.payload_len as usize];
        let read = file.read_at(state.offset, &mut bytes).map_err(io(&store.dir))?;
        if read < bytes.len() || !format::frame_intact(&bytes, &header) {
            return Err(damaged());
        }
        Ok((header, bytes))
    }

    /// Makes the transaction durable: seals its frames into the chain, writes them,
    /// syncs every segment written, and only then lets the next transaction see it.
    pub fn commit(self, meta: Meta) -> Result<(), StoreError> {
        let compaction = self.compact()?;
        self.failpoint()?;
        if self.store.borrow().faults.commit_should_fail() {
            return Err(StoreError::Injected("commit"));
        }
        if self.may_write_nothing(&compaction, meta) {
            // Nothing was changed, so nothing is undone on drop either; schedule entries
            // the reclaim took found nothing to delete and stay taken. Where compaction
            // got to is kept in memory only, as always.
            if let Some((state, _)) = compaction {
                self.store.borrow_mut().compaction = Some(state);
            }
            self.committed.set(true);
            return Ok(());
        }
        let mut frames = std::mem::take(&mut *self.frames.borrow_mut());
        let mut store = self.store.borrow_mut();
        let mut chain = store.chain;
        let count = frames.len();
        let ordered = store.durability == crate::Durability::Full;
        for (n, frame) in frames.iter_mut().enumerate() {
            let flags = format::Flags { last: n + 1 == count, ordered };
            chain.checksum =
                format::seal_frame(&mut frame.bytes, flags, chain.seq + 1, chain.checksum, meta, store.salt);
            chain.seq += 1;
            chain.head = frame.seq;
            chain.tail = frame.start + frame.bytes.len() as u64;
        }
        // A segment is retired only once the copies of its live records are durable,
        // whatever the durability: otherwise a power cut could take records of any age.
        // (`write_frames` then syncs every segment written since its last sync.)
        let retiring = matches!(compaction, Some((_, true)));
        store.write_frames(&frames, retiring)?;
        // Written, and with durability full synced: from here the transaction is the
        // log's state.
        self.committed.set(true);
        for pair in frames.windows(2) {
            if pair[0].seq != pair[1].seq {
                store.ends.insert(pair[0].seq, pair[0].start + pair[0].bytes.len() as u64);
            }
        }
        store.chain = chain;
        store.frame_time_ms = meta.high_water_ms;
        for (reclaim_at_ms, position) in self.scheduled.borrow_mut().drain(..) {
            store.schedule.add(reclaim_at_ms, position);
        }
        store.live_bytes = store.live_bytes.saturating_add_signed(self.live_delta.get());
        for frame in frames {
            store.recent.add(frame.seq, frame.start, frame.bytes);
        }
        // What follows tidies up after a durable commit: a failure there is logged, never
        // reported as the commit's (its callers' changes are on disk). A segment whose
        // retirement failed stays on disk, is read again at the next open (its live
        // records have newer copies), and is left to the operator's disk; one renamed
        // without a durable directory entry holds back the next write until the
        // directory is synced (`Store::write_frames`).
        match compaction {
            Some((state, true)) => {
                if let Err(error) = store.retire(state.seq) {
                    tracing::warn!(%error, segment = state.seq, "a compacted log segment could not be retired");
                }
            }
            Some((state, false)) => store.compaction = Some(state),
            None => {}
        }
        if let Err(error) = store.take_prepared(false) {
            // The next segment change opens the segment itself (and fails then, before
            // writing, if the disk still refuses).
            tracing::warn!(%error, "the next log segment could not be prepared");
        }
        if chain.tail * 2 > store.segment_bytes {
            store.prepare_spare();
        }
        Ok(())
    }
}

/// A key as the reclaim schedule files it: its routing hash with the top bit cleared (the
/// schedule's entries are non-negative). Filing keys rather than positions keeps one
/// entry per key and window however often the record is rewritten or copied.
pub(super) fn schedule_entry(hash: u64) -> i64 {
    (hash & (i64::MAX as u64)) as i64
}

/// The hashes a schedule entry may stand for.
fn entry_hashes(entry: i64) -> impl Iterator<Item = u64> {
    let low = entry as u64;
    [low, low | (1 << 63)].into_iter()
}
