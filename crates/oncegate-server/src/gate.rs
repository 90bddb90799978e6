//! The `oncegate.v1.Gate` service: authenticate, admit, translate, call the engine,
//! translate back. No decision is made here; every answer comes from the engine.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{self, Either, FutureExt};
use oncegate_core::gate::Reserved;
use oncegate_core::{Previous, ReserveReply, Tenant};
use oncegate_engine::{CommitRequest, Engine, KeyRequest, ReserveRequest};
use oncegate_proto::v1 as pb;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Auth;
use crate::status::Refusal;
use crate::tenants::{Admission, Admit, Demand, TenantPlace};

/// The gRPC `Gate` service over an engine.
#[derive(Clone)]
pub struct GateService {
    engine: Engine,
    auth: Arc<Auth>,
    admit: Arc<Admit>,
    pub(crate) session: SessionLimits,
    /// `server.request_timeout_ms`: a unary call's deadline, and the longest a `Session`
    /// call may ask for.
    pub(crate) request_timeout: Duration,
}

/// The limits of one `Session` stream (`server.session_*`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SessionLimits {
    /// `server.session_calls_in_flight_max`.
    pub calls_in_flight_max: usize,
    /// `server.session_unsent_bytes_max`.
    pub unsent_bytes_max: usize,
}

/// How long a call that the front itself times out may take, from when, and where that
/// came from (for its refusal). Unary gRPC calls have none here: tonic's layer drops them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    /// When the call was read: a call held before it starts spends its time waiting.
    pub from: Instant,
    pub within: Duration,
    pub limit: &'static str,
}

impl Deadline {
    fn until(&self) -> Instant {
        self.from + self.within
    }

    fn unanswered(&self) -> Refusal {
        Refusal::Unanswered { within_ms: self.within.as_millis() as u64, limit: self.limit }
    }

    fn unstarted(&self) -> Refusal {
        Refusal::Unstarted { within_ms: self.within.as_millis() as u64, limit: self.limit }
    }
}

/// A short, stable digest of a key for logs: keys can carry customer data, so the raw
/// key is never logged.
pub fn key_digest(key: &str) -> String {
    format!("{:08x}", xxhash_rust::xxh3::xxh3_64(key.as_bytes()) as u32)
}

fn outcome_name(reply: &ReserveReply) -> &'static str {
    match reply {
        ReserveReply::Granted { previous: Previous::Abandoned, .. } => "granted_after_abandon",
        ReserveReply::Granted { .. } => "granted",
        ReserveReply::InProgress { .. } => "in_progress",
        ReserveReply::Completed { .. } => "completed",
        ReserveReply::Mismatch { .. } => "mismatch",
    }
}

/// The span of one request: RPC, tenant, namespace, a digest of the key (never the key),
/// the shard (recorded by the engine when it routes the call), outcome and duration.
/// Built only when debug logging is on for this module: without a subscriber that wants
/// it, a span and its key digest are work every call would pay for nothing.
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

/// Logs, counts and times one finished call. Keys are logged only as a digest, and only
/// when debug logging is on (`key` is `None` otherwise).
fn finish<T>(
    rpc: &'static str,
    tenant: Option<&Tenant>,
    key: Option<&str>,
    started: Instant,
    answer: &Answer<T>,
) {
    let label = match answer {
        Ok((_, outcome)) => outcome,
        Err(refusal) => refusal.code().as_str(),
    };
    crate::telemetry::record_call(rpc, tenant, label, started);
    let Some(key) = key else { return };
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

/// What the one call path needs to know of each request message, and how it starts on
/// the engine.
pub(crate) trait Call: Send + Sized + 'static {
    /// The RPC's name, as metrics and logs label it.
    const RPC: &'static str;
    /// The answer: its wire message, or, for a reserve, the engine's [`Reserved`], whose
    /// outcome is not optional as the message's is (each front converts it).
    type Reply: Send + 'static;
    fn namespace(&self) -> &str;
    /// The key as logs digest it (a derived key's parts, joined, before it is derived).
    fn key(&self) -> Cow<'_, str>;
    /// What the call asks of the server's and the tenant's limits.
    fn demand(&self) -> Demand;
    /// Translates the message and queues it on its shard before returning (so calls of
    /// one stream reach their shards in the order they were read); the future is the
    /// engine's answer, translated back.
    fn start(
        self,
        engine: &Engine,
        tenant: &Tenant,
    ) -> impl Future<Output = Answer<Self::Reply>> + Send + 'static + use<Self>;
}

macro_rules! keyed_call {
    ($message:ty, $reply:ty, $rpc:literal, $demand:expr, $start:expr) => {
        impl Call for $message {
            const RPC: &'static str = $rpc;
            type Reply = $reply;
            fn namespace(&self) -> &str {
                &self.namespace
            }
            fn key(&self) -> Cow<'_, str> {
                Cow::Borrowed(&self.key)
            }
            fn demand(&self) -> Demand {
                $demand
            }
            fn start(
                self,
                engine: &Engine,
                tenant: &Tenant,
            ) -> impl Future<Output = Answer<Self::Reply>> + Send + 'static + use<> {
                $start(self, engine, tenant)
            }
        }
    };
}

keyed_call!(pb::CommitRequest, pb::CommitResponse, "commit", Demand::Finish, start_commit);
keyed_call!(pb::ReleaseRequest, pb::ReleaseResponse, "release", Demand::Finish, start_release);
keyed_call!(pb::HeartbeatRequest, pb::HeartbeatResponse, "heartbeat", Demand::Keep, start_heartbeat);
keyed_call!(pb::GetRequest, pb::GetResponse, "get", Demand::Start { waits: false }, start_get);

impl Call for pb::ReserveRequest {
    const RPC: &'static str = "reserve";
    type Reply = Reserved;
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn key(&self) -> Cow<'_, str> {
        if self.key.is_empty() { Cow::Owned(self.key_parts.join(":")) } else { Cow::Borrowed(&self.key) }
    }
    fn demand(&self) -> Demand {
        Demand::Start { waits: self.wait_ms > 0 }
    }
    fn start(
        self,
        engine: &Engine,
        tenant: &Tenant,
    ) -> impl Future<Output = Answer<Self::Reply>> + Send + 'static + use<> {
        let pending = engine.reserve(tenant, ReserveRequest::from(self));
        async move {
            let reserved = pending.await?;
            let label = outcome_name(&reserved.reply);
            Ok((reserved, label))
        }
    }
}

fn start_commit(
    r: pb::CommitRequest,
    engine: &Engine,
    tenant: &Tenant,
) -> impl Future<Output = Answer<pb::CommitResponse>> + Send + 'static + use<> {
    let pending = CommitRequest::try_from(r).map(|call| engine.commit(tenant, call));
    async move {
        let expires_at_ms = pending?.await?;
        Ok((pb::CommitResponse { expires_at_ms }, "ok"))
    }
}

fn start_release(
    r: pb::ReleaseRequest,
    engine: &Engine,
    tenant: &Tenant,
) -> impl Future<Output = Answer<pb::ReleaseResponse>> + Send + 'static + use<> {
    let pending = engine.release(tenant, KeyRequest::from(r));
    async move {
        pending.await?;
        Ok((pb::ReleaseResponse {}, "ok"))
    }
}

fn start_heartbeat(
    r: pb::HeartbeatRequest,
    engine: &Engine,
    tenant: &Tenant,
) -> impl Future<Output = Answer<pb::HeartbeatResponse>> + Send + 'static + use<> {
    let pending = engine.heartbeat(tenant, KeyRequest::from(r));
    async move { Ok((pb::HeartbeatResponse::from(pending.await?), "ok")) }
}

fn start_get(
    r: pb::GetRequest,
    engine: &Engine,
    tenant: &Tenant,
) -> impl Future<Output = Answer<pb::GetResponse>> + Send + 'static + use<> {
    let pending = engine.get(tenant, KeyRequest::from(r));
    async move { Ok((pb::GetResponse::from(pending.await?), "ok")) }
}

/// A call's answer and its metric label (`granted`, `ok`, ...).
pub(crate) type Answer<T> = Result<(T, &'static str), Refusal>;

/// `answer`, holding the call's admission (its slots of the server's and the tenant's
/// limits) until it is given or given up, and then handing the caller what the answer
/// keeps of it (the tenant's place).
fn holding<F: Future>(
    admission: Admission,
    answer: F,
) -> impl Future<Output = (F::Output, Option<TenantPlace>)> {
    answer.map(move |answer| (answer, admission.answered()))
}

impl GateService {
    /// A service answering from `engine`, authenticating with `auth`, admitting calls
    /// through `admit`'s server and tenant limits, each `Session` stream within `session`,
    /// each call within `request_timeout` at most.
    pub(crate) fn new(
        engine: Engine,
        auth: Auth,
        admit: Admit,
        session: SessionLimits,
        request_timeout: Duration,
    ) -> GateService {
        let (auth, admit) = (Arc::new(auth), Arc::new(admit));
        GateService { engine, auth, admit, session, request_timeout }
    }

    /// [`GateService::begin_held`], its admission let go with the engine's answer: a
    /// unary call's answer goes to the transport as it is returned.
    pub(crate) fn begin<M: Call>(
        &self,
        tenant: Result<Tenant, Refusal>,
        message: M,
        deadline: Option<Deadline>,
    ) -> impl Future<Output = Answer<M::Reply>> + Send + 'static + use<M> {
        self.begin_held(tenant, message, deadline).map(|(answer, _place)| answer)
    }

    /// A place among the tenant's open `Session` streams (none for the open `default`
    /// tenant), held while the stream is open.
    pub(crate) fn open_session(&self, tenant: &Tenant) -> Result<Option<OwnedSemaphorePermit>, Refusal> {
        self.admit.open_session(tenant)
    }

    /// The one path of every call, unary or in a session, once its caller is
    /// authenticated (or refused): admit, start on the engine (queued before this
    /// returns), then count, time and log the answer. The admission holds the call's
    /// slots until the engine answers; the answer then comes with the tenant's place
    /// (none when the call was refused, finishes work, or has no tenant limits), which
    /// the caller keeps until it drops it: a `Session` stream, until the answer leaves. Past `deadline` the engine's answer is given up:
    /// dropping it is what makes the shard skip a call not yet decided. A call with a
    /// deadline builds its timer here, so it must begin on a tokio runtime with its time
    /// driver (every front's calls do).
    pub(crate) fn begin_held<M: Call>(
        &self,
        tenant: Result<Tenant, Refusal>,
        message: M,
        deadline: Option<Deadline>,
    ) -> impl Future<Output = (Answer<M::Reply>, Option<TenantPlace>)> + Send + 'static + use<M> {
        // A call with a deadline is timed from when it was read, as its deadline is: a call
        // held at a stream's limit, or whose HTTP body was slow, spent that time waiting.
        let started = deadline.map_or_else(Instant::now, |d| d.from);
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        let key = debug.then(|| message.key().into_owned());
        let span = if debug {
            request_span(M::RPC, message.namespace(), key.as_deref().unwrap_or(""))
        } else {
            tracing::Span::none()
        };
        // The engine records the shard in, and links its batch to, the span current when
        // the call is queued.
        let entered = span.enter();
        // A call whose deadline passed before it could start (held behind a stream's limit)
        // is refused without reaching its shard: queued, it could take effect after its
        // caller was told that it had not been answered in time.
        let passed = deadline.filter(|d| d.until() <= Instant::now());
        let (tenant, admitted) = match (tenant, passed) {
            (Ok(tenant), Some(passed)) => (Some(tenant), Err(passed.unstarted())),
            (Ok(tenant), None) => {
                let admitted = self
                    .admit
                    .admit(&tenant, message.demand())
                    .map(|admission| (admission, message.start(&self.engine, &tenant)));
                (Some(tenant), admitted)
            }
            (Err(refusal), _) => (None, Err(refusal)),
        };
        drop(entered);
        // Combinators rather than an `async` block: a block keeps the future it awaits
        // twice (once captured, once being awaited), and each call's future is moved whole
        // into its box; the profile of the `Session` stream had these copies at a tenth
        // of the workers' time.
        let answer = match (admitted, deadline) {
            (Ok((admission, pending)), None) => Either::Left(Either::Left(holding(admission, pending))),
            (Ok((admission, pending)), Some(deadline)) => {
                let late = move |_| Err(deadline.unanswered());
                let timed =
                    tokio::time::timeout_at(deadline.until(), pending).map(move |a| a.unwrap_or_else(late));
                Either::Left(Either::Right(holding(admission, timed)))
            }
            (Err(refusal), _) => Either::Right(future::ready((Err(refusal), None))),
        };
        answer
            .map(move |(answer, place)| {
                finish(M::RPC, tenant.as_ref(), key.as_deref(), started, &answer);
                (answer, place)
            })
            .instrument(span)
    }

    /// How callers are authenticated.
    pub(crate) fn auth(&self) -> &Arc<Auth> {
        &self.auth
    }

    /// A unary call: authenticate (an unauthenticated caller learns nothing, not even
    /// load), then [`GateService::begin`].
    async fn unary<M: Call>(&self, request: Request<M>) -> Result<Response<M::Reply>, Status> {
        let tenant = self.auth.tenant(request.metadata());
        let metadata = request.metadata();
        let caller =
            crate::traces::caller_span("grpc", |key| metadata.get(key).and_then(|v| v.to_str().ok()));
        // Entered only while the call is queued: its request span, made then, is the child.
        let answer = caller.in_scope(|| self.begin(tenant, request.into_inner(), None));
        let answer = answer.await;
        answer.map(|(reply, _)| Response::new(reply)).map_err(|refusal| refusal.to_status())
    }
}

#[tonic::async_trait]
impl pb::gate_server::Gate for GateService {
    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        self.unary(request).await.map(|answer| answer.map(pb::ReserveResponse::from))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        self.unary(request).await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.unary(request).await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.unary(request).await
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        self.unary(request).await
    }

    type SessionStream = crate::session::Responses;

    async fn session(
        &self,
        request: Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        crate::session::open(self.clone(), request)
    }
}
