//! A slot moving between two live shards: the actors' side. The engine's mover
//! (`engine/resize.rs`) drives the steps and holds the slot's new requests meanwhile; every record
//! is read, written and deleted by the shard that owns the file, on its own thread.
//!
//! 1. **Out.** The source receives the hand-over on its data channel, behind every
//!    request for the slot sent before the move began, so those are decided first. It
//!    reads the slot's records, takes out the slot's parked reserves and hands both over
//!    with its token counter and its time. From then on no request of the slot reaches it.
//! 2. **In.** The destination writes the records in one transaction synced to disk
//!    whatever the configured durability (replacing any copies an earlier attempt left),
//!    with its token counter raised to the source's (its token epoch too, durably first)
//!    and its clock raised to the source's, so a moved key's next token is above every
//!    token the source issued and its times never go back.
//! 3. **Flip and release** are the mover's: the map file, then the parked reserves
//!    ([`Shard::adopt`]) and the held requests go to whichever shard owns the slot
//!    after (the source again when the move failed). No shard decides a parked reserve
//!    of the slot before the map says it owns the slot.
//! 4. **Drop.** The source deletes the slot's rows in chunks of `reclaim_batch_max`, one
//!    chunk per alarm, taking turns with its mailbox.
//!
//! A crash between any two steps leaves the map naming one shard, whose rows are the
//! slot's truth; the other shard's copies are deleted when it next opens.

use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;
use oncegate_core::{Record, Scope};

use super::Shard;
use super::book::{Book, Parked};
use crate::error::Error;
use crate::placement::slots::Slots;
use crate::placement::token;
use crate::store::{MOVES_ON_POSTGRES, Meta, Store, StoreError, Txn};

/// The mover's request to a source shard: hand `slots` over.
pub(crate) struct MoveOut {
    pub slots: Slots,
    pub reply: Sender<Result<Handover, Error>>,
}

/// What a source shard hands over with its slots.
pub(crate) struct Handover {
    pub slots: Slots,
    records: Vec<(Scope, Record)>,
    /// The source's token counter (above every token it issued) and its time.
    meta: Meta,
    parked: Parked,
}

impl Handover {
    /// Takes the slot's parked reserves out, for the mover to hand to the slot's owner
    /// when the move is over.
    pub fn take_parked(&mut self) -> Parked {
        std::mem::take(&mut self.parked)
    }
}

/// Rows of slots that moved away, still to delete (listed once, when the move ended:
/// nothing of the slots reaches this shard any more, so only reclaim can remove any).
pub(crate) struct Leaving {
    slots: Slots,
    rows: Vec<(u64, i64)>,
}

impl Shard {
    /// Step 1, at the source: reads the slot's records and hands them over with its
    /// waiters and counters. A storage failure fails the shard and the move.
    pub(super) fn move_out(&mut self, move_out: MoveOut) {
        let MoveOut { slots, reply } = move_out;
        let Some(store) = self.store.as_mut() else {
            let _ = reply.send(Err(self.unavailable(self.closed_reason())));
            return;
        };
        let now = self.guard.read(self.cx.clock.monotonic_ms());
        let Some(own) = store.own_mut() else {
            let _ = reply.send(Err(self.unavailable(&MOVES_ON_POSTGRES.to_string())));
            return;
        };
        let rows = own.slot_rows(&slots);
        let read = own.begin_read(now).and_then(|txn| {
            let records = txn.records_of(&rows);
            txn.finish_read();
            records
        });
        let records = match read {
            Ok(records) => records,
            // A row that does not hash to where it was found fails the move, not the
            // shard: its keys are served as before, and the row is named in the log.
            Err(error @ StoreError::Corrupt(_)) => {
                tracing::error!(shard = self.id, %slots, %error, "the slots cannot move: a row of them is damaged");
                let _ = reply.send(Err(self.unavailable(&format!("{slots} cannot move: {error}"))));
                return;
            }
            Err(error) => {
                self.record_failure(&error);
                let _ = reply.send(Err(self.unavailable(&format!("storage failure: {error}"))));
                return;
            }
        };
        // Nothing of the slots reaches this shard from now on, so these are the rows to
        // drop when the move ends (reclaim may take some first).
        self.handed = Some(Leaving { slots: slots.clone(), rows });
        let parked = self.book.take_parked(&slots, self.cx.slots.routing);
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        let high_water_ms = self.guard.read(self.cx.clock.monotonic_ms());
        let meta = Meta { next_token: self.book.next_token, high_water_ms };
        // A mover that has gone drops the hand-over: its waiters hear `unavailable`.
        let _ = reply.send(Ok(Handover { slots, records, meta, parked }));
    }

    /// Step 2, at the destination: writes the records, synced, with the counters raised
    /// to the source's. Returns the records written.
    pub(super) fn move_in(&mut self, handover: Handover) -> Result<u64, Error> {
        if self.store.is_none() {
            return Err(self.unavailable(self.closed_reason()));
        }
        let token_before = self.book.next_token;
        // Time never goes back here, and the moved records keep the time they had left:
        // a source whose clock is ahead lifts this shard's (as a persisted mark would),
        // and records from one that is behind are carried forward. (The shards of a
        // process share one frame, `open.rs`; only one that could not read its mark at
        // the start, and found it above the start's base later, runs ahead of the rest.)
        let source_now = handover.meta.high_water_ms;
        let ahead_ms = self.guard.read(self.cx.clock.monotonic_ms()).saturating_sub(source_now);
        self.guard.raise(source_now);
        // Every token the source issued is below its counter.
        self.book.next_token = self.book.next_token.max(handover.meta.next_token);
        if let Err(error) = self.raise_epoch(token::epoch_of(self.book.next_token)) {
            // No token of an epoch that is not durable: the counter goes back.
            self.book.next_token = token_before;
            self.record_failure(&error);
            return Err(self.unavailable(&format!("storage failure: {error}")));
        }
        let now = self.guard.read(self.cx.clock.monotonic_ms());
        let Handover { slots, records, .. } = handover;
        let stale = self.stale_copies(&slots);
        let store = self.store.as_mut().and_then(Store::own_mut);
        let book = &mut self.book;
        let mut written = 0;
        let result = (move || -> Result<u64, StoreError> {
            let store = store.ok_or(MOVES_ON_POSTGRES)?;
            // Synced whatever the durability: the map will name this copy as the truth.
            store.sync_commits(true)?;
            let txn = store.begin(now)?;
            let stale = txn.delete_rows(&stale)?;
            book.records_delta.remove(&stale);
            for (scope, mut record) in records {
                record.carry_forward(ahead_ms);
                let at = txn.put(&scope, &record)?;
                book.next_reclaim_ms = Some(book.next_reclaim_ms.map_or(at, |n| n.min(at)));
                book.records_delta.count(&scope.tenant, Some(&record), 1);
                written += 1;
            }
            let meta = Meta { next_token: book.next_token, high_water_ms: now };
            txn.set_meta(meta)?;
            txn.commit(meta)?;
            store.sync_commits(false)?;
            Ok(written)
        })();
        if let Err(error) = &result
            && (error.is_full() || error.is_disk_full())
        {
            // The copy does not fit in this shard's file, or on its disk: the move fails
            // (its transaction rolled back), and the shard goes on serving the slots it
            // has (refusing writes while the disk is full).
            self.book.next_token = token_before;
            self.book.discard_delta();
            let refusal = if error.is_disk_full() {
                self.refuse_writes(error);
                super::book::disk_full(self.id, &self.path)
            } else {
                super::book::file_full(self.id, &self.cx.config)
            };
            if let Some(own) = self.store.as_mut().and_then(Store::own_mut)
                && let Err(error) = own.sync_commits(false)
            {
                self.record_failure(&error);
            }
            return Err(refusal);
        }
        let written = self.conclude(result, Vec::new(), token_before, |_, shared| {
            shared.commits.fetch_add(1, Ordering::Relaxed);
        });
        let Some(written) = written else {
            return Err(self.unavailable("storage failure while taking in a moved slot"));
        };
        Ok(written)
    }

    /// The rows of `slots` already here, which a copy of them replaces. They can only be
    /// the copies of an earlier move of them to this shard in this process (a new
    /// process's open deleted every row of a slot the shard did not own, but for the
    /// slots moving to it then, which count as received): only then is the index
    /// searched for them.
    fn stale_copies(&mut self, slots: &Slots) -> Vec<(u64, i64)> {
        let listed = self.leaving.iter().any(|leaving| leaving.slots.overlaps(slots));
        self.leaving.retain(|leaving| !leaving.slots.overlaps(slots));
        let mut fresh = true;
        for slot in slots.iter() {
            fresh &= self.received.insert(slot);
        }
        if !listed && fresh {
            return Vec::new();
        }
        let Some(own) = self.store.as_ref().and_then(Store::own) else { return Vec::new() };
        own.slot_rows(slots)
    }

    /// Parks the reserves that waited on a moved slot's keys, now that this shard owns
    /// the slot; they are decided as the shard's own from here on.
    pub(super) fn adopt(&mut self, parked: Parked) {
        if self.store.is_none() {
            let error = self.unavailable(self.closed_reason());
            for reply in parked.into_replies() {
                let _ = reply.send(Err(error.clone()));
            }
            return;
        }
        self.book.adopt(parked);
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        self.shared.publish();
    }

    /// The mover says `slots` left this shard (moved away, or their copy here was
    /// undone): list their rows for the alarms to delete, unless the file is closed (its
    /// next open deletes every row of a slot the shard does not own). Ownership is not
    /// looked up: by the time this runs a later move may already be under way; a later
    /// move of the slots back here comes after this on the same channel and takes the
    /// list back.
    pub(super) fn leave(&mut self, slots: Slots) {
        let handed = self.handed.take();
        let Some(own) = self.store.as_ref().and_then(Store::own) else { return };
        // The source listed the rows when it handed the slots over; a destination whose
        // copy is being undone lists them now.
        let rows = match handed {
            Some(handed) if handed.slots == slots => handed.rows,
            _ => own.slot_rows(&slots),
        };
        // One list per slot: a slot that left twice (two undone moves) is listed once.
        self.leaving.retain(|leaving| !leaving.slots.overlaps(&slots));
        if !rows.is_empty() {
            self.leaving.push(Leaving { slots, rows });
        }
    }

    /// Deletes every row of slots that left, a chunk (`reclaim_batch_max`) per alarm
    /// transaction, until none is left or a chunk deletes nothing (a failed store: the
    /// next open deletes what is left).
    pub(super) fn drop_left(&mut self) {
        let left = |shard: &Shard| shard.leaving.iter().map(|leaving| leaving.rows.len()).sum::<usize>();
        let mut before = left(self);
        while before > 0 && self.store.is_some() {
            self.alarm(super::Alarm::Asked);
            let after = left(self);
            if after >= before {
                break;
            }
            before = after;
        }
    }

    /// Makes `epoch` the shard's token epoch, durably, when it is above the current one
    /// (a moved slot brought tokens of a later epoch).
    fn raise_epoch(&mut self, epoch: u64) -> Result<(), StoreError> {
        if epoch > self.epoch {
            self.write_epoch(epoch)?;
            self.epoch = epoch;
        }
        Ok(())
    }
}

/// Step 4, in an alarm's transaction: deletes at most `limit` rows of the slots that
/// moved away. A slot leaves the list once its rows are gone.
pub(super) fn drop_leaving(
    txn: &Txn<'_>,
    leaving: &mut Vec<Leaving>,
    limit: usize,
    book: &mut Book,
) -> Result<(), StoreError> {
    if leaving.is_empty() {
        return Ok(());
    }
    let txn = txn.own().ok_or(MOVES_ON_POSTGRES)?;
    let mut budget = limit;
    while budget > 0 {
        let Some(last) = leaving.last_mut() else { break };
        let chunk = last.rows.split_off(last.rows.len().saturating_sub(budget));
        budget -= chunk.len();
        let removed = txn.delete_rows(&chunk)?;
        book.records_delta.remove(&removed);
        if last.rows.is_empty() {
            leaving.pop();
        }
    }
    Ok(())
}
