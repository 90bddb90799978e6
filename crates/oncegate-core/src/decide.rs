//! The one decision function: every answer oncegate gives is computed here.
//!
//! [`decide`] takes the stored record of a key (or none), a validated command, the
//! shard's `now` and the next fencing token, and returns the change to store and the
//! reply. It reads no clock and touches no storage, so the whole contract is tested
//! against it directly.

use crate::{Completion, Error, Event, Fingerprint, Outcome, Record, State, Transition};

/// The longest retry-after hint given with `in progress`: a holder may commit long before
/// its lease ends, so retries should look again soon rather than at the lease deadline.
pub const RETRY_AFTER_MS_MAX: u64 = 1_000;

/// A reserve: "may this attempt proceed?". All fields are validated and resolved (zero
/// ttl or lease already replaced by the defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserve {
    /// How long the record is remembered from the grant (and at least this long after a
    /// commit).
    pub ttl_ms: u64,
    /// How long the holder may work before it must heartbeat, commit or release.
    pub lease_ms: u64,
    /// The payload's fingerprint, or none.
    pub fingerprint: Fingerprint,
    /// How long the engine parks this reserve when the key is in progress; the decision
    /// itself ignores it.
    pub wait_ms: u64,
}

/// A commit by the holder of `token`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// The fencing token of the grant.
    pub token: u64,
    /// How the attempt ended.
    pub outcome: Outcome,
    /// Bytes to replay to later reserves, within the response limit.
    pub response: Vec<u8>,
}

/// A validated operation on one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// May this attempt proceed?
    Reserve(Reserve),
    /// The holder finished; store the outcome and response.
    Commit(Commit),
    /// The holder gives the key up so a retry may proceed.
    Release {
        /// The fencing token of the grant.
        token: u64,
    },
    /// The holder is still working; renew its lease.
    Heartbeat {
        /// The fencing token of the grant.
        token: u64,
        /// The new lease, from now.
        lease_ms: u64,
    },
    /// Read the key's state without changing it.
    Get,
    /// Operator: read the whole stored record (if live).
    Inspect,
    /// Operator: free a pending or abandoned key whatever its token, so the next reserve
    /// is granted (with a greater token). A completed key is refused, as for `Release`.
    ForceRelease,
    /// Operator: delete the key's live record in any state, completion included.
    Purge,
}

impl Command {
    /// Whether the command can change the store; a `get` never does, so the engine may
    /// answer it without a write transaction.
    pub fn is_read_only(&self) -> bool {
        matches!(self, Command::Get | Command::Inspect)
    }
}

/// Whether a grant took over an abandoned attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Previous {
    /// The key was free.
    None,
    /// An earlier attempt's lease ran out; the caller should check for its side effects.
    Abandoned,
}

/// The answer to a reserve. All four are successful answers; only `Granted` lets the
/// attempt proceed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReserveReply {
    /// Proceed: the caller holds the key with this token until the lease ends.
    Granted {
        /// The fencing token to name in commit, release and heartbeat.
        token: u64,
        /// 1 for a first grant, one more after each abandonment.
        attempt: u32,
        /// The lease deadline.
        lease_until_ms: u64,
        /// The lease's length: the one asked for, or the server's default when none was
        /// (a holder heartbeats every third of it).
        lease_ms: u64,
        /// When the record expires unless committed later.
        expires_at_ms: u64,
        /// Whether an abandoned attempt came before.
        previous: Previous,
    },
    /// Another attempt holds the key; do not proceed now.
    InProgress {
        /// The holder's attempt number.
        attempt: u32,
        /// The holder's lease deadline.
        lease_until_ms: u64,
        /// When to look again.
        retry_after_ms: u64,
    },
    /// The key was completed; here is what the first attempt stored.
    Completed {
        /// The token of the attempt that committed.
        token: u64,
        /// Its outcome.
        outcome: Outcome,
        /// Its stored response.
        response: Vec<u8>,
        /// When it committed.
        completed_at_ms: u64,
        /// When the record expires.
        expires_at_ms: u64,
    },
    /// The key exists with another request's fingerprint.
    Mismatch {
        /// When the record expires and the key becomes free.
        expires_at_ms: u64,
    },
}

/// The view of a key that `get` returns. For a free key every number is zero.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// The derived state at the time of the read.
    pub state: State,
    /// The latest token.
    pub token: u64,
    /// The latest attempt number.
    pub attempt: u32,
    /// The latest lease deadline.
    pub lease_until_ms: u64,
    /// The expiry.
    pub expires_at_ms: u64,
    /// The outcome, once completed.
    pub outcome: Option<Outcome>,
    /// The stored response, once completed.
    pub response: Vec<u8>,
}

impl View {
    /// The view of a free key.
    pub const FREE: View = View {
        state: State::Free,
        token: 0,
        attempt: 0,
        lease_until_ms: 0,
        expires_at_ms: 0,
        outcome: None,
        response: Vec::new(),
    };
}

/// A successful answer to a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The answer to a reserve.
    Reserve(ReserveReply),
    /// The commit is stored (or was stored by this same token already).
    Commit {
        /// When the completed record expires.
        expires_at_ms: u64,
    },
    /// The key is free again.
    Release,
    /// The lease was renewed.
    Heartbeat {
        /// The new lease deadline.
        lease_until_ms: u64,
        /// The record's expiry.
        expires_at_ms: u64,
    },
    /// The key's state.
    Get(View),
    /// The whole live record (none when the key is free) and its state at the shard's
    /// `now`.
    Inspect {
        /// The state.
        state: State,
        /// The record.
        record: Option<Record>,
    },
    /// An operator action removed the record.
    Removed {
        /// The state the key was in.
        previous: State,
        /// The token of the removed record.
        token: u64,
    },
}

/// What to do with the stored record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Leave it as it is.
    Keep,
    /// Store this record (insert or replace).
    Put(Record),
    /// Delete the record: the key becomes free.
    Delete,
}

/// The result of [`decide`]: the change to make durable and the reply to send after it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The change to the stored record.
    pub change: Change,
    /// The answer to the caller.
    pub reply: Result<Reply, Error>,
}

impl Decision {
    /// Whether this decision granted the key, and so used up the `next_token` it was
    /// given; the engine then advances its token counter in the same transaction.
    pub fn consumes_token(&self) -> bool {
        matches!(self.reply, Ok(Reply::Reserve(ReserveReply::Granted { .. })))
    }

    fn keep(reply: Result<Reply, Error>) -> Decision {
        Decision { change: Change::Keep, reply }
    }
}

/// Which key answers a reserve sent within the bucket grace after a boundary (see
/// `bucket_grace_ms` in the contract): the earlier bucket's while it holds a live record,
/// since the call may be a retry of one sent before the boundary and nothing can tell it
/// apart; the current bucket's when the earlier key is free (never reserved, released
/// or expired).
///
/// An abandoned earlier key answers too: `decide` then takes it over, which raises its
/// token and so fences off the stalled holder's late commit, and tells the new holder
/// `previous = abandoned`. Sending that retry to a fresh current key instead would leave
/// the stalled holder free to commit, and the retry would run the work a second time
/// without being told.
///
/// `earlier` is the stored record of the earlier bucket's key, possibly expired; `now_ms`
/// is the shard's guarded time, as for [`decide`].
pub fn answers_from_earlier_bucket(earlier: Option<&Record>, now_ms: u64) -> bool {
    earlier.is_some_and(|record| record.state(now_ms) != State::Free)
}

/// Decides one command against the key's stored record.
///
/// `record` is what the store holds, possibly expired (reads treat an expired record as
/// free even before the shard's alarm reclaims it). `now_ms` must come from the shard's
/// clock guard, so it never goes backwards. `next_token` must be greater than every token
/// the shard ever granted; it is used only when the reply is a grant.
pub fn decide(record: Option<&Record>, command: &Command, now_ms: u64, next_token: u64) -> Decision {
    let live = record.filter(|r| !r.is_expired(now_ms));
    match command {
        Command::Reserve(reserve) => decide_reserve(live, reserve, now_ms, next_token),
        Command::Commit(commit) => decide_commit(live, commit, now_ms),
        Command::Release { token } => match holder_check(live, *token, now_ms) {
            Ok(_) => Decision { change: Change::Delete, reply: Ok(Reply::Release) },
            Err(error) => Decision::keep(Err(error)),
        },
        Command::Heartbeat { token, lease_ms } => match holder_check(live, *token, now_ms) {
            Ok(held) => {
                let mut renewed = held.clone();
                renewed.lease_until_ms = now_ms.saturating_add(*lease_ms);
                renewed.push_event(Transition::Heartbeat, now_ms, *token);
                let reply = Reply::Heartbeat {
                    lease_until_ms: renewed.lease_until_ms,
                    expires_at_ms: renewed.expires_at_ms,
                };
                Decision { change: Change::Put(renewed), reply: Ok(reply) }
            }
            Err(error) => Decision::keep(Err(error)),
        },
        Command::Get => Decision::keep(Ok(Reply::Get(view(live, now_ms)))),
        Command::Inspect => Decision::keep(Ok(Reply::Inspect {
            state: live.map_or(State::Free, |r| r.state(now_ms)),
            record: live.cloned(),
        })),
        Command::ForceRelease => match live.map(|r| (r.state(now_ms), r.token)) {
            None => Decision::keep(Err(Error::NotFound)),
            Some((State::Completed, _)) => Decision::keep(Err(Error::AlreadyCompleted)),
            Some((previous, token)) => {
                Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous, token }) }
            }
        },
        Command::Purge => match live.map(|r| (r.state(now_ms), r.token)) {
            None => Decision::keep(Err(Error::NotFound)),
            Some((previous, token)) => {
                Decision { change: Change::Delete, reply: Ok(Reply::Removed { previous, token }) }
            }
        },
    }
}

fn decide_reserve(live: Option<&Record>, reserve: &Reserve, now_ms: u64, next_token: u64) -> Decision {
    let grant = |attempt: u32, previous: Previous, fingerprint: Fingerprint, history: Vec<Event>| {
        let mut record = Record {
            token: next_token,
            attempt,
            lease_until_ms: now_ms.saturating_add(reserve.lease_ms),
            expires_at_ms: now_ms.saturating_add(reserve.ttl_ms),
            ttl_ms: reserve.ttl_ms,
            fingerprint,
            completion: None,
            history,
        };
        let transition = match previous {
            Previous::None => Transition::Granted,
            Previous::Abandoned => Transition::Regranted,
        };
        record.push_event(transition, now_ms, next_token);
        let reply = ReserveReply::Granted {
            token: record.token,
            attempt,
            lease_until_ms: record.lease_until_ms,
            lease_ms: reserve.lease_ms,
            expires_at_ms: record.expires_at_ms,
            previous,
        };
        Decision { change: Change::Put(record), reply: Ok(Reply::Reserve(reply)) }
    };
    let Some(record) = live else {
        return grant(1, Previous::None, reserve.fingerprint.clone(), Vec::new());
    };
    // A caller that sends a fingerprint asks for a check, and the check passes only when
    // the record is bound to the same payload; a caller that sends none opts out.
    if !reserve.fingerprint.is_none() && reserve.fingerprint != record.fingerprint {
        let reply = ReserveReply::Mismatch { expires_at_ms: record.expires_at_ms };
        return Decision::keep(Ok(Reply::Reserve(reply)));
    }
    match record.state(now_ms) {
        State::Completed => {
            let completion = record.completion.as_ref().expect("completed records carry a completion");
            let reply = ReserveReply::Completed {
                token: record.token,
                outcome: completion.outcome,
                response: completion.response.clone(),
                completed_at_ms: completion.completed_at_ms,
                expires_at_ms: record.expires_at_ms,
            };
            Decision::keep(Ok(Reply::Reserve(reply)))
        }
        State::Pending => {
            let remaining = record.lease_until_ms - now_ms;
            let reply = ReserveReply::InProgress {
                attempt: record.attempt,
                lease_until_ms: record.lease_until_ms,
                retry_after_ms: remaining.clamp(1, RETRY_AFTER_MS_MAX),
            };
            Decision::keep(Ok(Reply::Reserve(reply)))
        }
        State::Abandoned => {
            // The key stays bound to its payload unless the new attempt names one.
            let fingerprint = if reserve.fingerprint.is_none() {
                record.fingerprint.clone()
            } else {
                reserve.fingerprint.clone()
            };
            let mut history = record.history.clone();
            history.push(Event {
                transition: Transition::Abandoned,
                at_ms: record.lease_until_ms,
                token: record.token,
            });
            grant(record.attempt.saturating_add(1), Previous::Abandoned, fingerprint, history)
        }
        State::Free => unreachable!("expired records were filtered out above"),
    }
}

fn decide_commit(live: Option<&Record>, commit: &Commit, now_ms: u64) -> Decision {
    if let Some(record) = live
        && let Some(done) = &record.completion
    {
        // Only a retry of the very commit that completed the key is acknowledged again.
        return if commit.token == record.token && commit.outcome == done.outcome {
            Decision::keep(Ok(Reply::Commit { expires_at_ms: record.expires_at_ms }))
        } else {
            Decision::keep(Err(Error::Conflict { current: record.token, outcome: done.outcome }))
        };
    }
    match holder_check(live, commit.token, now_ms) {
        Ok(held) => {
            let mut completed = held.clone();
            completed.expires_at_ms = held.expires_at_ms.max(now_ms.saturating_add(held.ttl_ms));
            completed.completion = Some(Completion {
                outcome: commit.outcome,
                response: commit.response.clone(),
                completed_at_ms: now_ms,
            });
            completed.push_event(Transition::Committed, now_ms, commit.token);
            let reply = Reply::Commit { expires_at_ms: completed.expires_at_ms };
            Decision { change: Change::Put(completed), reply: Ok(reply) }
        }
        Err(error) => Decision::keep(Err(error)),
    }
}

/// Checks that `token` is the current holder of a pending or abandoned key.
fn holder_check(live: Option<&Record>, token: u64, now_ms: u64) -> Result<&Record, Error> {
    let record = live.ok_or(Error::NotFound)?;
    match record.state(now_ms) {
        State::Completed => Err(Error::AlreadyCompleted),
        State::Pending | State::Abandoned if record.token == token => Ok(record),
        State::Pending | State::Abandoned => Err(Error::LeaseLost { token, current: record.token }),
        State::Free => Err(Error::NotFound),
    }
}

fn view(live: Option<&Record>, now_ms: u64) -> View {
    let Some(record) = live else { return View::FREE };
    View {
        state: record.state(now_ms),
        token: record.token,
        attempt: record.attempt,
        lease_until_ms: record.lease_until_ms,
        expires_at_ms: record.expires_at_ms,
        outcome: record.completion.as_ref().map(|c| c.outcome),
        response: record.completion.as_ref().map(|c| c.response.clone()).unwrap_or_default(),
    }
}
