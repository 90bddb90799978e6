//! The one translation between the `Gate` types and the proto's, on the client's side.

use oncegate_core::gate::{CommitRequest, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Key, Outcome, Previous, ReserveReply, State, View};
use oncegate_proto::v1 as pb;
use pb::reserve_response::Outcome as Answer;

use crate::ClientError;

pub(crate) fn reserve_request(r: ReserveRequest) -> pb::ReserveRequest {
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

pub(crate) fn commit_request(r: CommitRequest) -> pb::CommitRequest {
    pb::CommitRequest {
        namespace: r.namespace,
        key: r.key,
        token: r.token,
        outcome: outcome_to_wire(r.outcome),
        response: r.response,
    }
}

pub(crate) fn release_request(r: KeyRequest) -> pb::ReleaseRequest {
    pb::ReleaseRequest { namespace: r.namespace, key: r.key, token: r.token }
}

pub(crate) fn heartbeat_request(r: KeyRequest) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: r.lease_ms }
}

pub(crate) fn get_request(r: KeyRequest) -> pb::GetRequest {
    pb::GetRequest { namespace: r.namespace, key: r.key }
}

fn outcome_to_wire(outcome: Outcome) -> i32 {
    match outcome {
        Outcome::Succeeded => pb::Outcome::Succeeded as i32,
        Outcome::Failed => pb::Outcome::Failed as i32,
    }
}

fn outcome_from_wire(value: i32) -> Result<Outcome, ClientError> {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Succeeded) => Ok(Outcome::Succeeded),
        Ok(pb::Outcome::Failed) => Ok(Outcome::Failed),
        _ => Err(ClientError::Protocol(format!("outcome {value} is not one this client knows"))),
    }
}

pub(crate) fn reserved(r: pb::ReserveResponse) -> Result<Reserved, ClientError> {
    let reply = match r.outcome {
        Some(Answer::Granted(g)) => ReserveReply::Granted {
            token: g.token,
            attempt: g.attempt,
            lease_until_ms: g.lease_until_ms,
            expires_at_ms: g.expires_at_ms,
            previous: if g.previous == pb::Previous::Abandoned as i32 {
                Previous::Abandoned
            } else {
                Previous::None
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
        None => return Err(ClientError::Protocol("a reserve answered without an outcome".to_owned())),
    };
    Ok(Reserved { key: Key::from_stored(r.key), reply })
}

pub(crate) fn renewed(r: pb::HeartbeatResponse) -> Renewed {
    Renewed { lease_until_ms: r.lease_until_ms, expires_at_ms: r.expires_at_ms }
}

pub(crate) fn view(r: pb::GetResponse) -> Result<View, ClientError> {
    let state = match pb::State::try_from(r.state) {
        Ok(pb::State::Free) => State::Free,
        Ok(pb::State::Pending) => State::Pending,
        Ok(pb::State::Abandoned) => State::Abandoned,
        Ok(pb::State::Completed) => State::Completed,
        _ => return Err(ClientError::Protocol(format!("state {} is not one this client knows", r.state))),
    };
    let outcome =
        if r.outcome == pb::Outcome::Unspecified as i32 { None } else { Some(outcome_from_wire(r.outcome)?) };
    Ok(View {
        state,
        token: r.token,
        attempt: r.attempt,
        lease_until_ms: r.lease_until_ms,
        expires_at_ms: r.expires_at_ms,
        outcome,
        response: r.response,
    })
}
