//! The one translation between the `Gate` types (`oncegate_core::gate`) and the wire
//! messages, both ways: the client writes requests and reads answers with it, the server
//! reads requests and writes answers with the same functions, so the two sides cannot
//! drift apart.
//!
//! What can be malformed on the wire (an enum number, a missing oneof) is a `TryFrom`
//! whose error is the core's `Invalid`, naming the field.

use oncegate_core::gate::{CommitRequest, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Invalid, Key, Outcome, Previous, ReserveReply, State, View};

use crate::v1 as pb;
use pb::reserve_response::Outcome as Answer;

/// The wire number of an outcome.
pub fn outcome_to_wire(outcome: Outcome) -> i32 {
    (match outcome {
        Outcome::Succeeded => pb::Outcome::Succeeded,
        Outcome::Failed => pb::Outcome::Failed,
    }) as i32
}

/// An outcome from its wire number; unspecified or unknown numbers are refused.
pub fn outcome_from_wire(value: i32) -> Result<Outcome, Invalid> {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Succeeded) => Ok(Outcome::Succeeded),
        Ok(pb::Outcome::Failed) => Ok(Outcome::Failed),
        Ok(pb::Outcome::Unspecified) => {
            Err(Invalid::Rule { field: "outcome", rule: "must be OUTCOME_SUCCEEDED or OUTCOME_FAILED" })
        }
        Err(_) => Err(Invalid::UnknownEnum { field: "outcome", value: i64::from(value) }),
    }
}

/// The wire number of a state.
pub fn state_to_wire(state: State) -> i32 {
    (match state {
        State::Free => pb::State::Free,
        State::Pending => pb::State::Pending,
        State::Abandoned => pb::State::Abandoned,
        State::Completed => pb::State::Completed,
    }) as i32
}

fn state_from_wire(value: i32) -> Result<State, Invalid> {
    match pb::State::try_from(value) {
        Ok(pb::State::Free) => Ok(State::Free),
        Ok(pb::State::Pending) => Ok(State::Pending),
        Ok(pb::State::Abandoned) => Ok(State::Abandoned),
        Ok(pb::State::Completed) => Ok(State::Completed),
        _ => Err(Invalid::UnknownEnum { field: "state", value: i64::from(value) }),
    }
}

impl From<ReserveRequest> for pb::ReserveRequest {
    fn from(r: ReserveRequest) -> Self {
        pb::ReserveRequest {
            namespace: r.namespace,
            key: r.key,
            key_parts: r.key_parts,
            bucket_ms: r.bucket_ms,
            bucket_grace_ms: r.bucket_grace_ms,
            ttl_ms: r.ttl_ms,
            lease_ms: r.lease_ms,
            fingerprint: r.fingerprint,
            wait_ms: r.wait_ms,
        }
    }
}

impl From<pb::ReserveRequest> for ReserveRequest {
    fn from(r: pb::ReserveRequest) -> Self {
        ReserveRequest {
            namespace: r.namespace,
            key: r.key,
            key_parts: r.key_parts,
            bucket_ms: r.bucket_ms,
            bucket_grace_ms: r.bucket_grace_ms,
            ttl_ms: r.ttl_ms,
            lease_ms: r.lease_ms,
            fingerprint: r.fingerprint,
            wait_ms: r.wait_ms,
        }
    }
}

impl From<CommitRequest> for pb::CommitRequest {
    fn from(r: CommitRequest) -> Self {
        pb::CommitRequest {
            namespace: r.namespace,
            key: r.key,
            token: r.token,
            outcome: outcome_to_wire(r.outcome),
            response: r.response,
        }
    }
}

impl TryFrom<pb::CommitRequest> for CommitRequest {
    type Error = Invalid;
    fn try_from(r: pb::CommitRequest) -> Result<Self, Invalid> {
        Ok(CommitRequest {
            namespace: r.namespace,
            key: r.key,
            token: r.token,
            outcome: outcome_from_wire(r.outcome)?,
            response: r.response,
        })
    }
}

impl From<KeyRequest> for pb::ReleaseRequest {
    fn from(r: KeyRequest) -> Self {
        pb::ReleaseRequest { namespace: r.namespace, key: r.key, token: r.token }
    }
}

impl From<pb::ReleaseRequest> for KeyRequest {
    fn from(r: pb::ReleaseRequest) -> Self {
        KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: 0 }
    }
}

impl From<KeyRequest> for pb::HeartbeatRequest {
    fn from(r: KeyRequest) -> Self {
        pb::HeartbeatRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: r.lease_ms }
    }
}

impl From<pb::HeartbeatRequest> for KeyRequest {
    fn from(r: pb::HeartbeatRequest) -> Self {
        KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: r.lease_ms }
    }
}

impl From<KeyRequest> for pb::GetRequest {
    fn from(r: KeyRequest) -> Self {
        pb::GetRequest { namespace: r.namespace, key: r.key }
    }
}

impl From<pb::GetRequest> for KeyRequest {
    fn from(r: pb::GetRequest) -> Self {
        KeyRequest { namespace: r.namespace, key: r.key, token: 0, lease_ms: 0 }
    }
}

impl From<ReserveReply> for Answer {
    fn from(reply: ReserveReply) -> Self {
        match reply {
            ReserveReply::Granted { token, attempt, lease_until_ms, lease_ms, expires_at_ms, previous } => {
                Answer::Granted(pb::Granted {
                    token,
                    attempt,
                    lease_until_ms,
                    lease_ms,
                    expires_at_ms,
                    previous: (match previous {
                        Previous::None => pb::Previous::None,
                        Previous::Abandoned => pb::Previous::Abandoned,
                    }) as i32,
                })
            }
            ReserveReply::InProgress { attempt, lease_until_ms, retry_after_ms } => {
                Answer::InProgress(pb::InProgress { attempt, lease_until_ms, retry_after_ms })
            }
            ReserveReply::Completed { token, outcome, response, completed_at_ms, expires_at_ms } => {
                Answer::Completed(pb::Completed {
                    token,
                    outcome: outcome_to_wire(outcome),
                    response,
                    completed_at_ms,
                    expires_at_ms,
                })
            }
            ReserveReply::Mismatch { expires_at_ms } => Answer::Mismatch(pb::Mismatch { expires_at_ms }),
        }
    }
}

impl From<Reserved> for pb::ReserveResponse {
    fn from(reserved: Reserved) -> Self {
        pb::ReserveResponse { key: reserved.key.as_str().to_owned(), outcome: Some(reserved.reply.into()) }
    }
}

impl TryFrom<pb::ReserveResponse> for Reserved {
    type Error = Invalid;
    fn try_from(r: pb::ReserveResponse) -> Result<Self, Invalid> {
        let reply = match r.outcome {
            Some(Answer::Granted(g)) => ReserveReply::Granted {
                token: g.token,
                attempt: g.attempt,
                lease_until_ms: g.lease_until_ms,
                lease_ms: g.lease_ms,
                expires_at_ms: g.expires_at_ms,
                previous: match pb::Previous::try_from(g.previous) {
                    Ok(pb::Previous::None) => Previous::None,
                    Ok(pb::Previous::Abandoned) => Previous::Abandoned,
                    Err(_) => {
                        return Err(Invalid::UnknownEnum { field: "previous", value: i64::from(g.previous) });
                    }
                },
            },
            Some(Answer::InProgress(p)) => ReserveReply::InProgress {
                attempt: p.attempt,
                lease_until_ms: p.lease_until_ms,
                retry_after_ms: p.retry_after_ms,
            },
            Some(Answer::Completed(c)) => ReserveReply::Completed {
                token: c.token,
                outcome: outcome_from_wire(c.outcome)?,
                response: c.response,
                completed_at_ms: c.completed_at_ms,
                expires_at_ms: c.expires_at_ms,
            },
            Some(Answer::Mismatch(m)) => ReserveReply::Mismatch { expires_at_ms: m.expires_at_ms },
            None => return Err(Invalid::Empty { field: "outcome" }),
        };
        Ok(Reserved { key: Key::from_stored(r.key), reply })
    }
}

impl From<Renewed> for pb::HeartbeatResponse {
    fn from(r: Renewed) -> Self {
        pb::HeartbeatResponse { lease_until_ms: r.lease_until_ms, expires_at_ms: r.expires_at_ms }
    }
}

impl From<pb::HeartbeatResponse> for Renewed {
    fn from(r: pb::HeartbeatResponse) -> Self {
        Renewed { lease_until_ms: r.lease_until_ms, expires_at_ms: r.expires_at_ms }
    }
}

impl From<View> for pb::GetResponse {
    fn from(view: View) -> Self {
        pb::GetResponse {
            state: state_to_wire(view.state),
            token: view.token,
            attempt: view.attempt,
            lease_until_ms: view.lease_until_ms,
            expires_at_ms: view.expires_at_ms,
            outcome: view.outcome.map_or(pb::Outcome::Unspecified as i32, outcome_to_wire),
            response: view.response,
        }
    }
}

impl TryFrom<pb::GetResponse> for View {
    type Error = Invalid;
    fn try_from(r: pb::GetResponse) -> Result<Self, Invalid> {
        let outcome = if r.outcome == pb::Outcome::Unspecified as i32 {
            None
        } else {
            Some(outcome_from_wire(r.outcome)?)
        };
        Ok(View {
            state: state_from_wire(r.state)?,
            token: r.token,
            attempt: r.attempt,
            lease_until_ms: r.lease_until_ms,
            expires_at_ms: r.expires_at_ms,
            outcome,
            response: r.response,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What one side writes the other reads back unchanged.
    #[test]
    fn every_message_survives_the_round_trip() {
        let request = ReserveRequest {
            namespace: "live".into(),
            key_parts: vec!["a".into()],
            bucket_ms: 60_000,
            bucket_grace_ms: 2_000,
            fingerprint: vec![1, 2],
            wait_ms: 5,
            ..ReserveRequest::default()
        };
        assert_eq!(ReserveRequest::from(pb::ReserveRequest::from(request.clone())), request);
        let commit = CommitRequest {
            namespace: "live".into(),
            key: "k".into(),
            token: 7,
            outcome: Outcome::Failed,
            response: b"r".to_vec(),
        };
        assert_eq!(CommitRequest::try_from(pb::CommitRequest::from(commit.clone())), Ok(commit));
        let replies = [
            ReserveReply::Granted {
                token: 9,
                attempt: 2,
                lease_until_ms: 3,
                lease_ms: 5,
                expires_at_ms: 4,
                previous: Previous::Abandoned,
            },
            ReserveReply::InProgress { attempt: 1, lease_until_ms: 5, retry_after_ms: 6 },
            ReserveReply::Completed {
                token: 9,
                outcome: Outcome::Succeeded,
                response: b"x".to_vec(),
                completed_at_ms: 1,
                expires_at_ms: 2,
            },
            ReserveReply::Mismatch { expires_at_ms: 8 },
        ];
        for reply in replies {
            let reserved = Reserved { key: Key::from_stored("k".into()), reply };
            assert_eq!(Reserved::try_from(pb::ReserveResponse::from(reserved.clone())), Ok(reserved));
        }
        let view = View { state: State::Completed, outcome: Some(Outcome::Succeeded), ..View::FREE };
        assert_eq!(View::try_from(pb::GetResponse::from(view.clone())), Ok(view));
        assert_eq!(View::try_from(pb::GetResponse::from(View::FREE)), Ok(View::FREE));
    }

    #[test]
    fn malformed_enums_and_a_missing_outcome_are_refused_by_name() {
        let commit = pb::CommitRequest { outcome: 0, ..Default::default() };
        assert_eq!(CommitRequest::try_from(commit).unwrap_err().field(), "outcome");
        let commit = pb::CommitRequest { outcome: 9, ..Default::default() };
        assert!(matches!(
            CommitRequest::try_from(commit),
            Err(Invalid::UnknownEnum { field: "outcome", value: 9 })
        ));
        assert_eq!(Reserved::try_from(pb::ReserveResponse::default()).unwrap_err().field(), "outcome");
        let view = pb::GetResponse { state: 42, ..Default::default() };
        assert_eq!(View::try_from(view).unwrap_err().field(), "state");
    }
}
