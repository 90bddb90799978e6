//! Where each request goes: the live slot map, the shards' handles, and the one slot that
//! may be moving, whose requests wait here in arrival order until its move ends.
//!
//! Callers take the table's read lock to route and send; the mover (`resize.rs`) takes the
//! write lock only to start and end a move, and never waits for a shard while it holds it. A request is sent to its shard while the
//! read lock is held, so when the mover holds the write lock every request routed by the
//! old table is already in its shard's mailbox, ahead of anything sent after: that is
//! what keeps one key's requests in order across a move.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::ShardHandle;
use crate::error::Error;
use crate::placement::slots::{SlotMap, SlotMove};
use crate::shard::{Moved, Request};

/// The routing table.
pub(crate) struct Table {
    /// The map as durable on disk (a moving slot still names its source).
    pub map: SlotMap,
    /// Every shard, by number; shards are only ever added.
    pub shards: Vec<Arc<ShardHandle>>,
    /// The slot being moved, if any.
    pub moving: Option<Moving>,
}

/// A slot whose move is under way.
pub(crate) struct Moving {
    pub step: SlotMove,
    /// Its requests since the move began, in arrival order.
    held: Mutex<VecDeque<Request>>,
    /// The map flip failed and could not be undone, so neither shard may decide the slot:
    /// it answers `unavailable` until the process restarts and reads the map again.
    pub stuck: bool,
}

impl Moving {
    pub fn new(step: SlotMove) -> Moving {
        Moving { step, held: Mutex::new(VecDeque::new()), stuck: false }
    }

    fn held(&self) -> MutexGuard<'_, VecDeque<Request>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What every request of a stuck slot hears.
    pub fn stuck_error(&self) -> Error {
        Error::Unavailable {
            shard: self.step.from,
            reason: format!(
                "{} could not finish moving to shard {}; it answers again after a restart",
                self.step.slots, self.step.to
            ),
        }
    }

    /// Holds a request of the moving slot, within the mailbox's bound.
    pub fn hold(&self, request: Request, mailbox_depth_max: usize) -> Result<(), Error> {
        if self.stuck {
            return Err(self.stuck_error());
        }
        let mut held = self.held();
        if held.len() >= mailbox_depth_max {
            return Err(Error::ResourceExhausted {
                what: format!("{} requests held while they move", self.step.slots),
                limit_name: "mailbox_depth_max",
                limit: mailbox_depth_max,
            });
        }
        held.push_back(request);
        Ok(())
    }

    /// Answers every held request `unavailable` (the slot is stuck).
    pub fn refuse_held(&self) {
        let error = self.stuck_error();
        for request in self.held().drain(..) {
            let _ = request.reply.send(Err(error.clone()));
        }
    }

    /// Takes the requests held so far, in order: the move's end hands them to the slot's
    /// owner under the write lock, on the channel for what moves hand over.
    pub fn take_held(&self) -> VecDeque<Request> {
        std::mem::take(&mut *self.held())
    }
}

/// Gives a slot's owner what its move handed over, never waiting (its channel is
/// unbounded): called under the table's lock, which every caller routes under. A shard
/// that has stopped answers the held requests `unavailable`.
pub(crate) fn hand_over(shard: &ShardHandle, shard_id: u32, moved: Moved) {
    if let Err(unsent) = shard.moved.send(moved)
        && let Moved::Held(requests) = unsent.into_inner()
    {
        for request in requests {
            let _ = request.reply.send(Err(super::pending::Pending::<()>::lost(shard_id)));
        }
    }
}
