//! Where each request goes: the live slot map, the shards' handles, and the one slot that
//! may be moving, whose requests wait here in arrival order until its move ends.
//!
//! Callers take the table's read lock to route and send; the mover (`grow.rs`) takes the
//! write lock only to start and end a move, and never waits for a shard while it holds it. A request is sent to its shard while the
//! read lock is held, so when the mover holds the write lock every request routed by the
//! old table is already in its shard's mailbox, ahead of anything sent after: that is
//! what keeps one key's requests in order across a move.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::shard::{Mail, Request};
use crate::slots::{SlotMap, SlotMove};
use crate::{Error, ShardHandle};

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
                "slot {} could not finish moving to shard {}; it answers again after a restart",
                self.step.slot, self.step.to
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
                what: format!("slot {} requests held while it moves", self.step.slot),
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

    /// Takes the requests held so far, in order. The mover sends them to the slot's
    /// owner without the table's lock (a full mailbox may make it wait), while later ones
    /// keep arriving here behind them; it ends the move, under the write lock, only when
    /// none is left.
    pub fn take_held(&self) -> VecDeque<Request> {
        std::mem::take(&mut *self.held())
    }
}

/// Sends `requests`, in order, to `shard`'s mailbox, waiting for room (they were
/// accepted already); a request whose shard has stopped hears `unavailable`.
pub(crate) fn send_in_order(shard: &ShardHandle, shard_id: u32, requests: VecDeque<Request>) {
    for request in requests {
        if let Err(unsent) = shard.data.send(Mail::Call(request))
            && let Mail::Call(request) = unsent.into_inner()
        {
            let _ = request.reply.send(Err(crate::Pending::lost(shard_id)));
        }
    }
}
