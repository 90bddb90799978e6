//! The `oncegate.v1.Gate` service: authenticate, admit, translate, call the engine,
//! translate back. No decision is made here; every answer comes from the engine.

use std::sync::Arc;

use oncegate_core::{Invalid, Outcome, Previous, ReserveReply, State, Tenant};
use oncegate_engine::{CommitRequest, Engine, KeyRequest, ReserveRequest};
use oncegate_proto::v1 as pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Auth;
use crate::status::{invalid, status, with_code};

/// The gRPC `Gate` service over an engine.
#[derive(Clone)]
pub struct GateService {
    engine: Engine,
    auth: Arc<Auth>,
    in_flight: Arc<Semaphore>,
    in_flight_max: usize,
}

/// A short, stable digest of a key for logs: keys can carry customer data, so the raw
/// key is never logged.
pub fn key_digest(key: &str) -> String {
    format!("{:08x}", xxhash_rust::xxh3::xxh3_64(key.as_bytes()) as u32)
}

fn outcome_from_wire(value: i32) -> Result<Outcome, Status> {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Succeeded) => Ok(Outcome::Succeeded),
        Ok(pb::Outcome::Failed) => Ok(Outcome::Failed),
        Ok(pb::Outcome::Unspecified) => Err(invalid(Invalid::Rule {
            field: "outcome",
            rule: "must be OUTCOME_SUCCEEDED or OUTCOME_FAILED",
        })),
        Err(_) => Err(invalid(Invalid::UnknownEnum { field: "outcome", value: i64::from(value) })),
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

impl GateService {
    /// A service answering from `engine`, authenticating with `auth`, serving at most
    /// `in_flight_max` calls at once.
    pub fn new(engine: Engine, auth: Auth, in_flight_max: usize) -> GateService {
        GateService {
            engine,
            auth: Arc::new(auth),
            in_flight: Arc::new(Semaphore::new(in_flight_max)),
            in_flight_max,
        }
    }

    /// Authenticates first (an unauthenticated caller learns nothing, not even load),
    /// then takes an in-flight slot or sheds the call.
    fn admit<T>(
        &self,
        rpc: &'static str,
        request: &Request<T>,
        started: std::time::Instant,
    ) -> Result<(Tenant, OwnedSemaphorePermit), Status> {
        let tenant = self.auth.tenant(request.metadata()).inspect_err(|status| {
            crate::telemetry::record_call(rpc, None, refusal_name(status), started);
        })?;
        let permit = Arc::clone(&self.in_flight).try_acquire_owned().map_err(|_| {
            crate::telemetry::record_call(rpc, Some(&tenant), "resource_exhausted", started);
            with_code(
                oncegate_core::Code::ResourceExhausted,
                format!(
                    "the server is at its in-flight limit; requests_in_flight_max is {}",
                    self.in_flight_max
                ),
            )
        })?;
        Ok((tenant, permit))
    }
}

/// The metric label of a refusal: its stable code.
fn refusal_name(status: &Status) -> &'static str {
    let code = status.metadata().get(crate::CODE_METADATA).and_then(|v| v.to_str().ok());
    oncegate_core::Code::ALL.iter().map(|c| c.as_str()).find(|name| Some(*name) == code).unwrap_or("internal")
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
fn finish<T>(
    rpc: &'static str,
    tenant: Option<&Tenant>,
    key: &str,
    started: std::time::Instant,
    result: &Result<T, Status>,
    outcome: &'static str,
) {
    let label = match result {
        Ok(_) => outcome,
        Err(status) => refusal_name(status),
    };
    crate::telemetry::record_call(rpc, tenant, label, started);
    let tenant = tenant.map_or("-", |t| t.as_str());
    let duration_us = started.elapsed().as_micros() as u64;
    let span = tracing::Span::current();
    span.record("tenant", tenant);
    span.record("outcome", label);
    span.record("duration_us", duration_us);
    match result {
        Ok(_) => tracing::debug!(rpc, tenant, key = %key_digest(key), outcome = label, duration_us, "served"),
        Err(s) => {
            tracing::debug!(rpc, tenant, key = %key_digest(key), outcome = label, duration_us, error = s.message(), "refused")
        }
    }
}

#[tonic::async_trait]
impl pb::gate_server::Gate for GateService {
    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let span = request_span("reserve", &request.get_ref().namespace, &request.get_ref().key);
        async move {
            let started = std::time::Instant::now();
            let (tenant, _permit) = self.admit("reserve", &request, started)?;
            let r = request.into_inner();
            let key_for_log = if r.key.is_empty() { r.key_parts.join(":") } else { r.key.clone() };
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
            let result = self.engine.reserve(&tenant, call).await.map_err(|e| status(&e)).map(|reserved| {
                pb::ReserveResponse {
                    key: reserved.key.as_str().to_owned(),
                    outcome: Some(reserve_to_wire(reserved.reply)),
                }
            });
            let outcome = result.as_ref().ok().and_then(|r| r.outcome.as_ref()).map_or("", outcome_name);
            finish("reserve", Some(&tenant), &key_for_log, started, &result, outcome);
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        let span = request_span("commit", &request.get_ref().namespace, &request.get_ref().key);
        async move {
            let started = std::time::Instant::now();
            let (tenant, _permit) = self.admit("commit", &request, started)?;
            let r = request.into_inner();
            let key = r.key.clone();
            let result = async {
                let call = CommitRequest {
                    namespace: r.namespace,
                    key: r.key,
                    token: r.token,
                    outcome: outcome_from_wire(r.outcome)?,
                    response: r.response,
                };
                let expires_at_ms = self.engine.commit(&tenant, call).await.map_err(|e| status(&e))?;
                Ok(pb::CommitResponse { expires_at_ms })
            }
            .await;
            finish("commit", Some(&tenant), &key, started, &result, "ok");
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let span = request_span("release", &request.get_ref().namespace, &request.get_ref().key);
        async move {
            let started = std::time::Instant::now();
            let (tenant, _permit) = self.admit("release", &request, started)?;
            let r = request.into_inner();
            let key = r.key.clone();
            let call = KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: 0 };
            let result = self
                .engine
                .release(&tenant, call)
                .await
                .map_err(|e| status(&e))
                .map(|()| pb::ReleaseResponse {});
            finish("release", Some(&tenant), &key, started, &result, "ok");
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let span = request_span("heartbeat", &request.get_ref().namespace, &request.get_ref().key);
        async move {
            let started = std::time::Instant::now();
            let (tenant, _permit) = self.admit("heartbeat", &request, started)?;
            let r = request.into_inner();
            let key = r.key.clone();
            let call =
                KeyRequest { namespace: r.namespace, key: r.key, token: r.token, lease_ms: r.lease_ms };
            let result = self.engine.heartbeat(&tenant, call).await.map_err(|e| status(&e)).map(|renewed| {
                pb::HeartbeatResponse {
                    lease_until_ms: renewed.lease_until_ms,
                    expires_at_ms: renewed.expires_at_ms,
                }
            });
            finish("heartbeat", Some(&tenant), &key, started, &result, "ok");
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let span = request_span("get", &request.get_ref().namespace, &request.get_ref().key);
        async move {
            let started = std::time::Instant::now();
            let (tenant, _permit) = self.admit("get", &request, started)?;
            let r = request.into_inner();
            let key = r.key.clone();
            let call = KeyRequest { namespace: r.namespace, key: r.key, token: 0, lease_ms: 0 };
            let result =
                self.engine.get(&tenant, call).await.map_err(|e| status(&e)).map(|view| pb::GetResponse {
                    state: state_to_wire(view.state),
                    token: view.token,
                    attempt: view.attempt,
                    lease_until_ms: view.lease_until_ms,
                    expires_at_ms: view.expires_at_ms,
                    outcome: view.outcome.map_or(pb::Outcome::Unspecified as i32, outcome_to_wire),
                    response: view.response,
                });
            finish("get", Some(&tenant), &key, started, &result, "ok");
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }
}
