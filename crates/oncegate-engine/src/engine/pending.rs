//! An answer on its way from a shard, typed by the command that asked for it.

use std::sync::{Arc, OnceLock, Weak};

use crossbeam_channel::Sender;
use oncegate_core::gate::Renewed;
use oncegate_core::{Key, Record, Reply, ReserveReply, State, View};
use tokio::sync::oneshot;

use super::Inner;
use crate::error::Error;

/// Reads a command's answer out of the shard's reply: the one variant that command is
/// answered with, or `None` for another (a bug, answered `unavailable` rather than with
/// a panic).
pub(super) type Narrow<T> = fn(Reply) -> Option<T>;

/// A reserve's answer.
pub(super) fn reserve(reply: Reply) -> Option<ReserveReply> {
    match reply {
        Reply::Reserve(reply) => Some(reply),
        _ => None,
    }
}

/// A commit's answer: the record's expiry.
pub(super) fn commit(reply: Reply) -> Option<u64> {
    match reply {
        Reply::Commit { expires_at_ms } => Some(expires_at_ms),
        _ => None,
    }
}

/// A release's answer.
pub(super) fn release(reply: Reply) -> Option<()> {
    match reply {
        Reply::Release => Some(()),
        _ => None,
    }
}

/// A heartbeat's answer: the renewed lease.
pub(super) fn heartbeat(reply: Reply) -> Option<Renewed> {
    match reply {
        Reply::Heartbeat { lease_until_ms, expires_at_ms } => Some(Renewed { lease_until_ms, expires_at_ms }),
        _ => None,
    }
}

/// A get's answer: the key's view.
pub(super) fn get(reply: Reply) -> Option<View> {
    match reply {
        Reply::Get(view) => Some(view),
        _ => None,
    }
}

/// An inspect's answer: the key's state and whole record.
pub(super) fn inspect(reply: Reply) -> Option<(State, Option<Record>)> {
    match reply {
        Reply::Inspect { state, record } => Some((state, record)),
        _ => None,
    }
}

/// An operator removal's answer: the state and token removed.
pub(super) fn removed(reply: Reply) -> Option<(State, u64)> {
    match reply {
        Reply::Removed { previous, token } => Some((previous, token)),
        _ => None,
    }
}

/// An answer on its way from a shard. Dropped before the answer came (the caller was
/// cancelled or gave up), it closes its channel and nudges the shard, which drops the
/// request if it is still parked: a gone caller is never granted.
pub(super) struct Pending<T> {
    pub(super) shard: u32,
    /// Taken once the answer arrived (or a blocked thread waits for it): a `Pending`
    /// dropped with its receiver still here was given up by its caller.
    pub(super) rx: Option<oneshot::Receiver<Result<Reply, Error>>>,
    pub(super) narrow: Narrow<T>,
    pub(super) gone: Sender<()>,
    /// The request's slot and the engine, to nudge the slot's owner when it is no longer
    /// the shard the request was sent to: a waiter parked there moved with its slot.
    pub(super) slot: u32,
    pub(super) engine: Weak<Inner>,
}

impl<T> Pending<T> {
    /// What callers hear when the shard stopped before it answered.
    pub(super) fn lost(shard: u32) -> Error {
        Error::Unavailable { shard, reason: "the shard stopped before answering".to_owned() }
    }

    /// Waits for the answer; dropped meanwhile, the request is given up.
    pub(super) async fn wait(mut self) -> Result<T, Error> {
        let Some(rx) = self.rx.as_mut() else { return Err(Pending::<T>::lost(self.shard)) };
        let answer = rx.await;
        self.rx = None;
        self.read(answer.unwrap_or_else(|_| Err(Pending::<T>::lost(self.shard))))
    }

    /// Blocks the thread until the answer comes (it cannot give up).
    pub(super) fn wait_blocking(mut self) -> Result<T, Error> {
        // A blocked thread cannot give up, so the receiver is taken before it blocks.
        let Some(rx) = self.rx.take() else { return Err(Pending::<T>::lost(self.shard)) };
        self.read(rx.blocking_recv().unwrap_or_else(|_| Err(Pending::<T>::lost(self.shard))))
    }

    fn read(&self, answer: Result<Reply, Error>) -> Result<T, Error> {
        (self.narrow)(answer?).ok_or_else(|| Error::Unavailable {
            shard: self.shard,
            reason: "the shard answered with a reply of another command (a bug)".to_owned(),
        })
    }

    /// Nudges the slot's owner too when the slot moved since the request was sent. A
    /// table being written (a move's flip) is not waited for: a waiter left parked then
    /// is still never granted, and goes at its deadline or the owner's next sweep.
    fn nudge_new_owner(&self) {
        let Some(inner) = self.engine.upgrade() else { return };
        let Ok(table) = inner.table.try_read() else { return };
        let owner = table.map.owner(self.slot);
        if owner != self.shard
            && let Some(handle) = table.shards.get(owner as usize)
        {
            let _ = handle.gone.try_send(());
        }
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.as_mut() {
            // Closed before the nudge, so the shard sees the caller gone when it looks.
            rx.close();
            let _ = self.gone.try_send(());
            self.nudge_new_owner();
        }
    }
}

/// A reserve on its way, and the key its answer will come from.
pub(super) struct StartedReserve {
    pub keys: ReserveKeys,
    pub pending: Pending<ReserveReply>,
}

pub(super) enum ReserveKeys {
    /// Named by the caller, or derived before it was sent (a directory routed by whole
    /// keys).
    Known(Key),
    /// Derived by the shard, which names it here before it answers.
    Derived(Arc<OnceLock<Key>>),
}

impl ReserveKeys {
    /// The key the answer came from; read only after the answer arrived.
    pub fn answered(self, shard: u32) -> Result<Key, Error> {
        match self {
            ReserveKeys::Known(key) => Ok(key),
            ReserveKeys::Derived(named) => named.get().cloned().ok_or_else(|| Error::Unavailable {
                shard,
                reason: "the shard answered a derived reserve without naming its key (a bug)".to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use oncegate_core::Reply;

    /// A reply of another command's kind is refused, never narrowed by a panic.
    #[test]
    fn a_reply_of_another_kind_is_refused() {
        assert_eq!(super::commit(Reply::Commit { expires_at_ms: 7 }), Some(7));
        assert_eq!(super::commit(Reply::Release), None);
        assert_eq!(super::release(Reply::Commit { expires_at_ms: 7 }), None);
    }
}
