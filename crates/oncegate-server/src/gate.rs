//! The `oncegate.v1.Gate` service: authenticate, admit, translate, call the engine,
//! translate back. No decision is made here; every answer comes from the engine.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use oncegate_core::{Invalid, Outcome, Previous, ReserveReply, State, Tenant};
use oncegate_engine::{CommitRequest, Engine, KeyRequest, ReserveRequest};
use oncegate_proto::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Auth;
use crate::status::Refusal;
use crate::tenants::{Admit, Demand};

/// The gRPC `Gate` service over an engine.
#[derive(Clone)]
pub struct GateService {
    engine: Engine,
    auth: Arc<Auth>,
    admit: Arc<Admit>,
}

/// A short, stable digest of a key for logs: keys can carry customer data, so the raw
/// key is never logged.
pub fn key_digest(key: &str) -> String {
    format!("{:08x}", xxhash_rust::xxh3::xxh3_64(key.as_bytes()) as u32)
}

fn outcome_from_wire(value: i32) -> Result<Outcome, Invalid> {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Succeeded) => Ok(Outcome::Succeeded),
        Ok(pb::Outcome::Failed) => Ok(Outcome::Failed),
        Ok(pb::Outcome::Unspecified) => {
            Err(Invalid::Rule { field: "outcome", rule: "must be OUTCOME_SUCCEEDED or OUTCOME_FAILED" })
        }
        Err(_) => Err(Invalid::UnknownEnum { field: "outcome", value: i64::from(value) }),
    }
}

fn outcome_to_wire(outcome: Outcome) -> i32 {
    match outcome {
        Outcome::Succeeded => pb::Outcome::Succeeded as i32,
        Outcome::Failed => pb::Outcome::Failed as i32,
    }
}

/// The wire number of a state.
pub(crate) fn state_to_wire(state: State) -> i32 {
    (match state {
        State::Free => pb::State::Free,
        State::Pending => pb::State::Pending,
        State::Abandoned => pb::State::Abandoned,
        State::Completed => pb::State::Completed,
    }) as i32
}

fn reserve_to_wire(reply: ReserveReply) -> pb::reserve_response::Outcome {
    use pb::reserve_response::Outcome as O;
    match reply {
        ReserveReply::Granted { token, attempt, lease_until_ms, expires_at_ms, previous } => {
            O::Granted(pb::Granted {
                token,
                attempt,
                lease_until_ms,
                expires_at_ms,
                previous: match previous {
                    Previous::None => pb::Previous::None as i32,
                    Previous::Abandoned => pb::Previous::Abandoned as i32,
                },
            })
        }
        ReserveReply::InProgress { attempt, lease_until_ms, retry_after_ms } => {
            O::InProgress(pb::InProgress { attempt, lease_until_ms, retry_after_ms })
        }
        ReserveReply::Completed { token, outcome, response, completed_at_ms, expires_at_ms } => {
            O::Completed(pb::Completed {
                token,
                outcome: outcome_to_wire(outcome),
                response,
                completed_at_ms,
                expires_at_ms,
            })
        }
        ReserveReply::Mismatch { expires_at_ms } => O::Mismatch(pb::Mismatch { expires_at_ms }),
    }
}

fn outcome_name(outcome: &pb::reserve_response::Outcome) -> &'static str {
    match outcome {
        pb::reserve_response::Outcome::Granted(g) if g.previous == pb::Previous::Abandoned as i32 => {
            "granted_after_abandon"
        }
        pb::reserve_response::Outcome::Granted(_) => "granted",
        pb::reserve_response::Outcome::InProgress(_) => "in_progress",
        pb::reserve_response::Outcome::Completed(_) => "completed",
        pb::reserve_response::Outcome::Mismatch(_) => "mismatch",
    }
}

/// The span of one request: RPC, tenant, namespace, a digest of the key (never the key),
/// the shard (recorded by the engine when it routes the call), outcome and duration.
fn request_span(rpc: &'static str, namespace: &str, key: &str) -> tracing::Span {
    tracing::debug_span!(
        "request",
        rpc,
        tenant = tracing::field::Empty,
        namespace,
        key = %key_digest(key),
        shard = tracing::field::Empty,
        outcome = tracing::field::Empty,
        duration_us = tracing::field::Empty,
    )
}

/// Logs, counts and times one finished call. Keys are logged only as a digest.
fn finish<T>(rpc: &'static str, tenant: Option<&Tenant>, key: &str, started: Instant, answer: &Answer<T>) {
    let label = match answer {
        Ok((_, outcome)) => outcome,
        Err(refusal) => refusal.code().as_str(),
    };
    crate::telemetry::record_call(rpc, tenant, label, started);
    let tenant = tenant.map_or("-", |t| t.as_str());
    let duration_us = started.elapsed().as_micros() as u64;
    let span = tracing::Span::current();
    span.record("tenant", tenant);
    span.record("outcome", label);
    span.record("duration_us", duration_us);
    match answer {
        Ok(_) => tracing::debug!(rpc, tenant, key = %key_digest(key), outcome = label, duration_us, "served"),
        Err(refusal) => {
            tracing::debug!(rpc, tenant, key = %key_digest(key), outcome = label, duration_us, error = %refusal, "refused")
        }
    }
}

/// What the one call path needs to know of each request message.
trait Call: Send + 'static {
    /// The RPC's name, as metrics and logs label it.
    const RPC: &'static str;
    fn namespace(&self) -> &str;
    /// The key as logs digest it (a derived key's parts, joined, before it is derived).
    fn key(&self) -> Cow<'_, str>;
    /// What the call asks of the server's and the tenant's limits.
    fn demand(&self) -> Demand;
}

macro_rules! keyed_call {
    ($message:ty, $rpc:literal, $demand:expr) => {
        impl Call for $message {
            const RPC: &'static str = $rpc;
            fn namespace(&self) -> &str {
                &self.namespace
            }
            fn key(&self) -> Cow<'_, str> {
                Cow::Borrowed(&self.key)
            }
            fn demand(&self) -> Demand {
                $demand
            }
        }
    };
}

keyed_call!(pb::CommitRequest, "commit", Demand::Finish);
keyed_call!(pb::ReleaseRequest, "release", Demand::Finish);
keyed_call!(pb::HeartbeatRequest, "heartbeat", Demand::Finish);
keyed_call!(pb::GetRequest, "get", Demand::Start { waits: false });

impl Call for pb::ReserveRequest {
    const RPC: &'static str = "reserve";
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn key(&self) -> Cow<'_, str> {
        if self.key.is_empty() { Cow::Owned(self.key_parts.join(":")) } else { Cow::Borrowed(&self.key) }
    }
    fn demand(&self) -> Demand {
        Demand::Start { waits: self.wait_ms > 0 }
    }
}

/// A call's answer and its metric label (`granted`, `ok`, ...).
type Answer<T> = Result<(T, &'static str), Refusal>;

impl GateService {
    /// A service answering from `engine`, authenticating with `auth`, admitting calls
    /// through `admit`'s server and tenant limits.
    pub(crate) fn new(engine: Engine, auth: Auth, admit: Admit) -> GateService {
        GateService { engine, auth: Arc::new(auth), admit: Arc::new(admit) }
    }

    /// The one path of every call: authenticate (an unauthenticated caller learns
    /// nothing, not even load), admit, run `work`, then count, time and log the call.
    async fn call<M, T, F, Fut>(&self, request: Request<M>, work: F) -> Result<Response<T>, Status>
    where
        M: Call,
        F: FnOnce(Engine, Tenant, M) -> Fut,
        Fut: Future<Output = Answer<T>>,
    {
        let started = Instant::now();
        let message = request.get_ref();
        let span = request_span(M::RPC, message.namespace(), &message.key());
        async move {
            let key = request.get_ref().key().into_owned();
            let demand = request.get_ref().demand();
            let (tenant, answer) = match self.auth.tenant(request.metadata()) {
                Err(refusal) => (None, Err(refusal)),
                Ok(tenant) => {
                    let answer = match self.admit.admit(&tenant, demand) {
                        // The admission holds the call's slots until the engine answers.
                        Ok(_admission) => {
                            work(self.engine.clone(), tenant.clone(), request.into_inner()).await
                        }
                        Err(refusal) => Err(refusal),
                    };
                    (Some(tenant), answer)
                }
            };
            finish(M::RPC, tenant.as_ref(), &key, started, &answer);
            answer.map(|(reply, _)| Response::new(reply)).map_err(|refusal| refusal.to_status())
        }
        .instrument(span)
        .await
    }
}

#[tonic::async_trait]
impl pb::gate_server::Gate for GateService {
    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        self.call(request, |engine, tenant, r| async move {
            let call = ReserveRequest {
                namespace: r.namespace,
                key: r.key,
                key_parts: r.key_parts,
                bucket_ms: r.bucket_ms,
                ttl_ms: r.ttl_ms,
                lease_ms: r.lease_ms,
                fingerprint: r.fingerprint,
                wait_ms: r.wait_ms,
            };
            let reserved = engine.reserve(&tenant, call).await?;
            let outcome = reserve_to_wire(reserved.reply);
            let label = outcome_name(&outcome);
            Ok((pb::ReserveResponse { key: reserved.key.as_str().to_owned(), outcome: Some(outcome) }, label))
        })
        .await
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        self.call(request, |engine, tenant, r| async move {
            let call = CommitRequest {
                namespace: r.namespace,
                key: r.key,
                token: r.token,
                outcome: outcome_from_wire(r.outcome)?,
                response: r.response,
            };
            let expires_at_ms = engine.commit(&tenant, call).await?;
            Ok((pb::CommitResponse { expires_at_ms }, "ok"))
        })
        .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.call(request, |engine, tenant, r| async move {
            let call = KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: 0 };
            engine.release(&tenant, call).await?;
            Ok((pb::ReleaseResponse {}, "ok"))
        })
        .await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.call(request, |engine, tenant, r| async move {
            let call =
                KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: r.lease_ms };
            let renewed = engine.heartbeat(&tenant, call).await?;
            let reply = pb::HeartbeatResponse {
                lease_until_ms: renewed.lease_until_ms,
                expires_at_ms: renewed.expires_at_ms,
            };
            Ok((reply, "ok"))
        })
        .await
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        self.call(request, |engine, tenant, r| async move {
            let call = KeyRequest { namespace: r.namespace, key: r.key, token: 0, lease_ms: 0 };
            let view = engine.get(&tenant, call).await?;
            let reply = pb::GetResponse {
                state: state_to_wire(view.state),
                token: view.token,
                attempt: view.attempt,
                lease_until_ms: view.lease_until_ms,
                expires_at_ms: view.expires_at_ms,
                outcome: view.outcome.map_or(pb::Outcome::Unspecified as i32, outcome_to_wire),
                response: view.response,
            };
            Ok((reply, "ok"))
        })
        .await
    }
}
