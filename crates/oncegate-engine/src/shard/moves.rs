//! A slot moving between two live shards: the actors' side. The engine's mover
//! (`grow.rs`) drives the steps and holds the slot's new requests meanwhile; every record
//! is read, written and deleted by the shard that owns the file, on its own thread.
//!
//! 1. **Out.** The source receives the hand-over on its data channel, behind every
//!    request for the slot sent before the move began, so those are decided first. It
//!    reads the slot's records, takes out the slot's parked reserves and hands both over
//!    with its token counter and its time. From then on no request of the slot reaches it.
//! 2. **In.** The destination writes the records in one durable transaction (replacing
//!    any copies an earlier attempt left), with its token counter raised to the source's
//!    (its token epoch too, durably first) and its clock raised to the source's, so a
//!    moved key's next token is above every token the source issued and its times never
//!    go back. Only then does it park the handed-over reserves, in their order.
//! 3. **Flip and release** are the mover's (the map file, then the held requests).
//! 4. **Drop.** The source deletes the slot's rows in chunks of `reclaim_batch_max`, one
//!    chunk per alarm, like reclaim.
//!
//! A crash between any two steps leaves the map naming one shard, whose rows are the
//! slot's truth; the other shard's copies are deleted when it next opens.

use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;
use oncegate_core::{Record, Scope};

use super::Shard;
use crate::book::{Book, Parked};
use crate::error::Error;
use crate::slots::Owned;
use crate::store::{Meta, StoreError, Txn};
use crate::token;

/// The mover's request to a source shard: hand `slot` over.
pub(crate) struct MoveOut {
    pub slot: u32,
    pub reply: Sender<Result<Handover, Error>>,
}

/// What a source shard hands over with a slot.
pub(crate) struct Handover {
    pub slot: u32,
    records: Vec<(Scope, Record)>,
    /// The source's token counter (above every token it issued) and its time.
    meta: Meta,
    parked: Parked,
}

impl Handover {
    /// Answers every handed-over waiter with `error` (the move did not complete).
    fn refuse_waiters(self, error: &Error) {
        refuse(self.parked, error);
    }
}

fn refuse(parked: Parked, error: &Error) {
    for reply in parked.into_replies() {
        let _ = reply.send(Err(error.clone()));
    }
}

impl Shard {
    /// Step 1, at the source: reads the slot's records and hands them over with its
    /// waiters and counters. A storage failure fails the shard and the move.
    pub(super) fn move_out(&mut self, move_out: MoveOut) {
        let MoveOut { slot, reply } = move_out;
        let Some(store) = self.store.as_mut() else {
            let _ = reply.send(Err(self.unavailable("the shard failed and is reopening")));
            return;
        };
        let read = store.begin_read().and_then(|txn| {
            let records = txn.slot_records(slot);
            txn.finish_read();
            records
        });
        let records = match read {
            Ok(records) => records,
            Err(error) => {
                self.record_failure(&error);
                let _ = reply.send(Err(self.unavailable(&format!("storage failure: {error}"))));
                return;
            }
        };
        let parked = self.book.take_parked(slot);
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        let high_water_ms = self.guard.read(self.clock.monotonic_ms());
        let meta = Meta { next_token: self.book.next_token, high_water_ms };
        // A mover that has gone drops the hand-over: its waiters hear `unavailable`.
        let _ = reply.send(Ok(Handover { slot, records, meta, parked }));
    }

    /// Step 2, at the destination: writes the records durably with the counters raised to
    /// the source's, then parks the handed-over reserves. Returns the records written.
    pub(super) fn move_in(&mut self, handover: Handover) -> Result<u64, Error> {
        if self.store.is_none() {
            let error = self.unavailable("the shard failed and is reopening");
            handover.refuse_waiters(&error);
            return Err(error);
        }
        let token_before = self.book.next_token;
        // Time and tokens continue from the source's: the copied records' times are in
        // the same frame, and every token the source issued is below `meta.next_token`.
        self.guard.raise(handover.meta.high_water_ms);
        self.book.next_token = self.book.next_token.max(handover.meta.next_token);
        if let Err(error) = self.raise_epoch(token::epoch_of(self.book.next_token)) {
            self.record_failure(&error);
            let refusal = self.unavailable(&format!("storage failure: {error}"));
            handover.refuse_waiters(&refusal);
            return Err(refusal);
        }
        let now = self.guard.read(self.clock.monotonic_ms());
        let Handover { slot, records, parked, .. } = handover;
        let store = self.store.as_mut().expect("checked above");
        let book = &mut self.book;
        let result = (|| -> Result<u64, StoreError> {
            let txn = store.begin()?;
            let (stale, _) = txn.delete_slot(slot, usize::MAX)?;
            book.records_delta.remove(&stale);
            for (scope, record) in &records {
                let at = txn.put(scope, record)?;
                book.next_reclaim_ms = Some(book.next_reclaim_ms.map_or(at, |n| n.min(at)));
                book.records_delta.count(&scope.tenant, Some(record), 1);
            }
            let meta = Meta { next_token: book.next_token, high_water_ms: now };
            txn.set_meta(meta)?;
            txn.commit(meta)?;
            Ok(records.len() as u64)
        })();
        let written = self.conclude(result, Vec::new(), token_before, |_, shared| {
            shared.commits.fetch_add(1, Ordering::Relaxed);
        });
        let Some(written) = written else {
            let error = self.unavailable("storage failure while taking in a moved slot");
            refuse(parked, &error);
            return Err(error);
        };
        // The slot's rows are live here now: a drop queued by an earlier attempt that
        // failed must not delete them.
        self.leaving.retain(|leaving| *leaving != slot);
        self.book.adopt(parked);
        self.shared.waiters.store(self.book.waiters_len as u64, Ordering::Relaxed);
        self.shared.publish();
        Ok(written)
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
/// moved away (never of a slot the shard owns again). A slot leaves the list once its
/// rows are gone.
pub(super) fn drop_leaving(
    txn: &Txn<'_>,
    leaving: &mut Vec<u32>,
    owned: &Owned,
    limit: usize,
    book: &mut Book,
) -> Result<(), StoreError> {
    let mut budget = limit;
    while let Some(&slot) = leaving.last() {
        if owned.owns(slot) {
            leaving.pop();
            continue;
        }
        let (removed, more) = txn.delete_slot(slot, budget)?;
        budget = budget.saturating_sub((removed.pending + removed.completed) as usize);
        book.records_delta.remove(&removed);
        if more {
            break;
        }
        leaving.pop();
        if budget == 0 {
            break;
        }
    }
    Ok(())
}
