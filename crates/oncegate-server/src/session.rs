//! The `Session` stream: many calls over one bidirectional stream, each answered as soon
//! as its shard decides it (out of order), each exactly a unary call (the same
//! [`GateService::begin`]: admission, engine, metrics, logs).
//!
//! One task per stream reads requests and owns the calls in flight. It starts a call only
//! while fewer than `server.session_calls_in_flight_max` calls are in flight, reading at
//! most one request past that (so that a cancel is heard at the limit; a call read there
//! waits unstarted; the stream's response names the limit, so that a client can keep within
//! it and have each cancel read as it arrives), and answers through a channel of that many
//! slots. An answer the channel has no room for keeps its call's place until it is sent,
//! so a client that stops reading stops the server from starting its calls: backpressure,
//! never unbounded buffering; meanwhile the calls in flight are still polled, so their
//! deadlines hold and cancels are read (as far as the limit lets requests be read). A call
//! is queued on its shard as it is started (so a stream's calls reach their shards in the
//! order they were sent). When the stream
//! ends (the client goes away, or sends a message that does not decode) the task drops its
//! calls in flight, and each is then what a unary call whose caller has gone is: one not
//! yet decided is skipped by its shard (never granted, never parked); one already written
//! keeps its effect, and its answer is lost. A call also has a deadline, as a unary call
//! has (its `timeout_ms`, at most `server.request_timeout_ms`): past it the call is dropped
//! in the same way and answered `unavailable`, so that a shard that stalls never grants,
//! long after, a reserve whose client has given up on it. The deadline counts from when the
//! call was read, so a call held at the limit spends its time waiting, and one whose
//! deadline passed while it was held is refused without reaching its shard. And a client
//! whose caller has gone sends a `cancel` for its call, which drops it in the same way,
//! unanswered: the stream's equivalent of a unary call's reset.
//!
//! What a stream holds is bounded whatever its client does. The answers made and not yet
//! handed to the transport (the `ready` queue and the channel) are counted in bytes: past
//! `server.session_unsent_bytes_max` the stream starts no call until the transport takes
//! some (the calls in flight still finish). Each answer keeps its call's place among its
//! tenant's calls in flight until the transport takes it (the server's place goes back
//! with the engine's answer), so a client that does not read keeps its own tenant's
//! `requests_in_flight_max` taken, not the server's memory nor other tenants' share; and
//! a tenant has at most `tenants[].sessions_max` streams open.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use oncegate_core::{Invalid, Tenant};
use oncegate_proto::v1 as pb;
use pb::session_request::Call as In;
use pb::session_response::Result as Out;
use prost::Message;
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

use crate::gate::{Call, Deadline, GateService, SessionLimits};
use crate::status::Refusal;
use crate::telemetry;
use crate::tenants::TenantPlace;

/// An answer made and not yet taken by the transport, with what it holds until then.
struct Unsent {
    response: pb::SessionResponse,
    /// Its encoded size, counted in the stream's [`Backlog`].
    bytes: usize,
    /// Its call's place among its tenant's calls in flight, taken until the answer leaves.
    place: Option<TenantPlace>,
}

/// The bytes of one stream's unsent answers, shared by the stream's task (which adds an
/// answer's as it is made) and its [`Responses`] (which takes them off as the transport
/// takes the answer, and wakes the task).
#[derive(Default)]
struct Backlog {
    bytes: AtomicUsize,
    drained: Notify,
}

impl Backlog {
    fn new() -> Arc<Backlog> {
        telemetry::SESSION_STREAMS.fetch_add(1, Ordering::Relaxed);
        Arc::default()
    }

    fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    fn unsent(&self, response: pb::SessionResponse, place: Option<TenantPlace>) -> Unsent {
        let bytes = response.encoded_len();
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        telemetry::SESSION_UNSENT_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        Unsent { response, bytes, place }
    }

    /// The transport takes `unsent`: its bytes and its tenant's place are given back.
    fn sent(&self, unsent: Unsent) -> pb::SessionResponse {
        self.bytes.fetch_sub(unsent.bytes, Ordering::AcqRel);
        telemetry::SESSION_UNSENT_BYTES.fetch_sub(unsent.bytes as u64, Ordering::Relaxed);
        self.drained.notify_one();
        drop(unsent.place);
        unsent.response
    }
}

impl Drop for Backlog {
    /// The stream is over: the answers it never sent leave the process's count with it.
    fn drop(&mut self) {
        telemetry::SESSION_UNSENT_BYTES.fetch_sub(*self.bytes.get_mut() as u64, Ordering::Relaxed);
        telemetry::SESSION_STREAMS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The answers of one stream, as tonic sends them: each is taken off its stream's
/// backlog as tonic takes it.
pub struct Responses {
    answers: mpsc::Receiver<Result<Unsent, Status>>,
    backlog: Arc<Backlog>,
}

impl tokio_stream::Stream for Responses {
    type Item = Result<pb::SessionResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = std::task::ready!(self.answers.poll_recv(cx));
        Poll::Ready(next.map(|answer| answer.map(|unsent| self.backlog.sent(unsent))))
    }
}

/// Where a stream's task puts its answers, and the [`Responses`] tonic reads them from.
fn answers(capacity: usize, backlog: &Arc<Backlog>) -> (mpsc::Sender<Result<Unsent, Status>>, Responses) {
    let (sender, answers) = mpsc::channel(capacity);
    (sender, Responses { answers, backlog: Arc::clone(backlog) })
}

/// A call's answer, once its shard decides it, with its tenant's place.
type Answer = Pin<Box<dyn Future<Output = (pb::SessionResponse, Option<TenantPlace>)> + Send>>;

/// A call in flight: its answer, ready to send, or what remains of a cancelled call.
type InFlight = Pin<Box<dyn Future<Output = Ended> + Send>>;

/// How a call in flight ended. A cancel empties its slot, so a call answered was not
/// cancelled, and its id still names it: an answer ready in a poll is taken in the same
/// step, before the next request (a cancel, or a call reusing the id) is read.
enum Ended {
    Answered(pb::SessionResponse, Option<TenantPlace>),
    /// Dropped by a cancel (its id no longer in flight), unanswered.
    Cancelled,
}

/// A call's answer as its future in flight awaits it, shared with the stream's map so that
/// a cancel drops it at once (and with it the engine's reply channel: the shard then finds
/// the caller gone), rather than whenever the future is next polled.
struct Slot {
    answer: Option<Answer>,
    /// Who to wake once the answer is dropped.
    waker: Option<Waker>,
}

/// Authenticates the stream once (its metadata names the tenant for every call), then
/// serves it on a task of its own.
pub(crate) fn open(
    gate: GateService,
    request: Request<Streaming<pb::SessionRequest>>,
) -> Result<Response<Responses>, Status> {
    let tenant = match gate.auth().tenant(request.metadata()) {
        Ok(tenant) => tenant,
        Err(refusal) => {
            crate::telemetry::record_call("session", None, refusal.code().as_str(), Instant::now());
            return Err(refusal.to_status());
        }
    };
    let place = match gate.open_session(&tenant) {
        Ok(place) => place,
        Err(refusal) => {
            crate::telemetry::record_call("session", Some(&tenant), refusal.code().as_str(), Instant::now());
            return Err(refusal.to_status());
        }
    };
    let limits = gate.session;
    let metadata = request.metadata();
    let caller = crate::traces::caller_span("session", |key| metadata.get(key).and_then(|v| v.to_str().ok()));
    let session = Session::new(gate, tenant, place, caller);
    let (sender, responses) = answers(limits.calls_in_flight_max, &session.backlog);
    tokio::spawn(session.run(request.into_inner(), sender));
    let mut response = Response::new(responses);
    let limit = tonic::metadata::MetadataValue::from(limits.calls_in_flight_max as u64);
    response.metadata_mut().insert(oncegate_proto::SESSION_CALLS_IN_FLIGHT_MAX_METADATA, limit);
    Ok(response)
}

struct Session {
    gate: GateService,
    tenant: Tenant,
    limits: SessionLimits,
    /// The stream's place among its tenant's open streams, given back as it ends.
    _place: Option<OwnedSemaphorePermit>,
    /// The caller's trace, from the stream's `traceparent`: every call of the stream
    /// continues it (a disabled span unless traces are exported).
    caller: tracing::Span,
    /// The bytes of the answers in `ready` and in the answers' channel.
    backlog: Arc<Backlog>,
    /// The calls in flight, by id: where each one's answer is awaited.
    ids: HashMap<u64, Arc<Mutex<Slot>>>,
    in_flight: FuturesUnordered<InFlight>,
    /// A call read while the calls in flight were at their limit, not yet started, and
    /// when it was read (its deadline counts from then).
    aside: Option<(pb::SessionRequest, Instant)>,
    /// Answers ready and not yet sent (the answers' channel was full): at most
    /// `calls_in_flight_max`, since they take the places of the calls they answer.
    ready: VecDeque<Unsent>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.drop_calls();
    }
}

impl Session {
    /// Drops the calls in flight (each then a call whose caller has gone), and their count.
    fn drop_calls(&mut self) {
        let calls = self.in_flight.len() as u64;
        telemetry::SESSION_CALLS_IN_FLIGHT.fetch_sub(calls, Ordering::Relaxed);
        self.in_flight.clear();
        self.unhold();
    }

    /// Holds a call read while the stream has no room, counted until it starts or goes.
    fn hold(&mut self, request: pb::SessionRequest, read_at: Instant) {
        debug_assert!(self.aside.is_none(), "a stream holds one call at most");
        telemetry::SESSION_CALLS_HELD.fetch_add(1, Ordering::Relaxed);
        self.aside = Some((request, read_at));
    }

    /// Takes the held call, if there is one.
    fn unhold(&mut self) -> Option<(pb::SessionRequest, Instant)> {
        let held = self.aside.take();
        if held.is_some() {
            telemetry::SESSION_CALLS_HELD.fetch_sub(1, Ordering::Relaxed);
        }
        held
    }

    /// A stream's state before its first request: no call in flight.
    fn new(
        gate: GateService,
        tenant: Tenant,
        place: Option<OwnedSemaphorePermit>,
        caller: tracing::Span,
    ) -> Session {
        Session {
            caller,
            limits: gate.session,
            gate,
            tenant,
            _place: place,
            backlog: Backlog::new(),
            ids: HashMap::new(),
            in_flight: FuturesUnordered::new(),
            aside: None,
            ready: VecDeque::new(),
        }
    }

    async fn run(
        mut self,
        mut requests: Streaming<pb::SessionRequest>,
        answers: mpsc::Sender<Result<Unsent, Status>>,
    ) {
        let mut reading = true;
        let backlog = Arc::clone(&self.backlog);
        loop {
            if !self.send_ready(&answers) {
                return;
            }
            // The client sent its last call and every call is answered: the stream ends.
            if !reading && self.aside.is_none() && self.in_flight.is_empty() && self.ready.is_empty() {
                return;
            }
            if self.has_room()
                && let Some((held, read_at)) = self.unhold()
            {
                let refused = self.start(held, read_at);
                self.queue(refused, None);
                continue;
            }
            // Waiting for room to send is one arm among the others, never a wait of its own:
            // while a client reads slowly, the calls in flight are still polled, and polling
            // is what drops a call at its deadline (a call not polled past it could still be
            // granted).
            tokio::select! {
                biased;
                // The client has gone: returning drops every call in flight.
                () = answers.closed() => return,
                permit = answers.reserve(), if !self.ready.is_empty() => {
                    let Ok(permit) = permit else { return };
                    permit.send(Ok(self.ready.pop_front().expect("an answer is ready")));
                }
                Some(ended) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    telemetry::SESSION_CALLS_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
                    self.ended(ended);
                }
                // The transport took answers: a call held for the stream's bytes may start.
                () = backlog.drained.notified(), if self.aside.is_some() => {}
                message = requests.message(), if reading && self.aside.is_none() => match message {
                    Ok(Some(request)) => {
                        let refused = self.read(request);
                        self.queue(refused, None);
                    }
                    // The client sent its last call: answer those in flight, then end.
                    Ok(None) => reading = false,
                    Err(status) => return self.end_with(refused_stream(status), &answers).await,
                },
                else => return,
            }
        }
    }

    /// Ends the stream on a message that does not decode (or a broken stream) with its
    /// status, after the answers already ready. The calls in flight are dropped first, so
    /// none is granted while the status waits for the client to read.
    async fn end_with(&mut self, status: Status, answers: &mpsc::Sender<Result<Unsent, Status>>) {
        // The map shares each call's answer: both let go of it.
        self.drop_calls();
        self.ids.clear();
        for answer in std::mem::take(&mut self.ready) {
            if answers.send(Ok(answer)).await.is_err() {
                return;
            }
        }
        let _ = answers.send(Err(status)).await;
    }

    /// Sends the ready answers the channel has room for, without waiting (most answers
    /// go out here, without a turn of the loop's `select!` of their own); false once the
    /// client has gone.
    fn send_ready(&mut self, answers: &mpsc::Sender<Result<Unsent, Status>>) -> bool {
        while !self.ready.is_empty() {
            match answers.try_reserve() {
                Ok(permit) => permit.send(Ok(self.ready.pop_front().expect("an answer is ready"))),
                Err(mpsc::error::TrySendError::Full(())) => return true,
                Err(mpsc::error::TrySendError::Closed(())) => return false,
            }
        }
        true
    }

    /// Whether another call may start: the calls in flight and the answers not yet sent
    /// count alike, and the unsent answers' bytes are within their limit, so a client
    /// that stops reading stops the stream from starting calls.
    fn has_room(&self) -> bool {
        self.in_flight.len() + self.ready.len() < self.limits.calls_in_flight_max
            && self.backlog.bytes() < self.limits.unsent_bytes_max
    }

    /// Queues an answer to send, counted in the stream's backlog with its tenant's place.
    fn queue(&mut self, answer: Option<pb::SessionResponse>, place: Option<TenantPlace>) {
        if let Some(answer) = answer {
            let unsent = self.backlog.unsent(answer, place);
            self.ready.push_back(unsent);
        }
    }

    /// A request just read: a cancel is done at once, a call started when there is room
    /// and otherwise held aside, unread further, until there is. So a stream at its limit
    /// still hears a cancel (one request past the limit is read to see whether it is one).
    fn read(&mut self, request: pb::SessionRequest) -> Option<pb::SessionResponse> {
        let read_at = Instant::now();
        if matches!(request.call, Some(In::Cancel(_))) || self.has_room() {
            return self.start(request, read_at);
        }
        self.hold(request, read_at);
        None
    }

    /// Queues the answer of a call that ended: none for a cancelled one.
    fn ended(&mut self, ended: Ended) {
        let Ended::Answered(answer, place) = ended else { return };
        self.ids.remove(&answer.id);
        self.queue(Some(answer), place);
    }

    /// Starts one call, or cancels one, or returns its refusal when the request itself is
    /// wrong for a session (no call, or an id already in flight).
    fn start(&mut self, request: pb::SessionRequest, read_at: Instant) -> Option<pb::SessionResponse> {
        let id = request.id;
        let Some(call) = request.call else {
            return Some(refused(id, Invalid::Rule { field: "call", rule: "must name one call" }));
        };
        if let In::Cancel(_) = call {
            self.cancel(id);
            return None;
        }
        if self.ids.contains_key(&id) {
            let rule = "must be unique among the stream's calls in flight";
            return Some(refused(id, Invalid::Rule { field: "id", rule }));
        }
        let deadline = self.deadline(request.timeout_ms, read_at);
        // The call's own trace context, or else the stream's.
        let own = crate::traces::caller_span("session", |key| match key {
            "traceparent" => Some(request.traceparent.as_str()).filter(|t| !t.is_empty()),
            "tracestate" => Some(request.tracestate.as_str()).filter(|t| !t.is_empty()),
            _ => None,
        });
        let caller = if own.is_none() { self.caller.clone() } else { own };
        let answer = caller.in_scope(|| match call {
            In::Reserve(m) => Some(self.begin(id, m, deadline, |reserved| Out::Reserve(reserved.into()))),
            In::Commit(m) => Some(self.begin(id, m, deadline, Out::Commit)),
            In::Release(m) => Some(self.begin(id, m, deadline, Out::Release)),
            In::Heartbeat(m) => Some(self.begin(id, m, deadline, Out::Heartbeat)),
            In::Get(m) => Some(self.begin(id, m, deadline, Out::Get)),
            In::Cancel(_) => None, // done above
        })?;
        let slot = Arc::new(Mutex::new(Slot { answer: Some(answer), waker: None }));
        self.ids.insert(id, Arc::clone(&slot));
        telemetry::SESSION_CALLS_IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        self.in_flight.push(Box::pin(std::future::poll_fn(move |cx| {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(answer) = slot.answer.as_mut() else { return Poll::Ready(Ended::Cancelled) };
            let polled = answer.as_mut().poll(cx);
            if polled.is_pending() && !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                slot.waker = Some(cx.waker().clone());
            }
            polled.map(|(answer, place)| Ended::Answered(answer, place))
        })));
        None
    }

    /// Cancels the call `id`: dropped here and now (its shard, deciding it later, finds
    /// its caller gone), or never started when it was held aside.
    fn cancel(&mut self, id: u64) {
        if self.aside.as_ref().is_some_and(|(held, _)| held.id == id) {
            self.unhold();
        }
        let Some(call) = self.ids.remove(&id) else { return };
        let mut slot = call.lock().unwrap_or_else(PoisonError::into_inner);
        let answer = slot.answer.take();
        // Woken, the call's future ends (`Cancelled`) and leaves the calls in flight.
        let waker = slot.waker.take();
        drop(slot);
        drop(answer);
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// A call's deadline: the one it asks for, within the server's request timeout,
    /// counted from when it was read.
    fn deadline(&self, timeout_ms: u64, from: Instant) -> Deadline {
        let most = self.gate.request_timeout;
        match Duration::from_millis(timeout_ms) {
            asked if timeout_ms > 0 && asked <= most => {
                Deadline { from, within: asked, limit: "the call's timeout_ms" }
            }
            _ => Deadline { from, within: most, limit: "server.request_timeout_ms" },
        }
    }

    /// One call on the unary path, its answer wrapped for the stream.
    fn begin<M: Call>(&self, id: u64, message: M, deadline: Deadline, wrap: fn(M::Reply) -> Out) -> Answer {
        let answer = self.gate.begin_held(Ok(self.tenant.clone()), message, Some(deadline));
        // A combinator, not an `async` block, which would hold `answer` twice.
        Box::pin(answer.map(move |(answer, place)| {
            let result = match answer {
                Ok((reply, _)) => wrap(reply),
                Err(refusal) => Out::Refusal(refusal.to_wire()),
            };
            (pb::SessionResponse { id, result: Some(result) }, place)
        }))
    }
}

/// The status that ends a stream whose request stream broke: one tonic could not read
/// (a frame that does not decode, a message over `server.message_bytes_max`, which tonic
/// calls `INTERNAL` and `OUT_OF_RANGE`) is the client's, `INVALID_ARGUMENT`.
fn refused_stream(status: Status) -> Status {
    match status.code() {
        tonic::Code::Internal | tonic::Code::OutOfRange => Status::invalid_argument(status.message()),
        _ => status,
    }
}

fn refused(id: u64, invalid: Invalid) -> pb::SessionResponse {
    pb::SessionResponse { id, result: Some(Out::Refusal(Refusal::from(invalid).to_wire())) }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::body::{Body, Bytes};
    use oncegate_core::{Outcome, Previous, ReserveReply};
    use oncegate_engine::{CommitRequest, Engine, EngineConfig, KeyRequest, ReserveRequest};
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::codec::Codec;

    use super::*;
    use crate::auth::Auth;
    use crate::tenants::Admit;

    /// One message of a gRPC request body: uncompressed, its length before it.
    fn frame(message: &[u8]) -> Result<Bytes, Status> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(message.len() as u32).to_be_bytes());
        bytes.extend_from_slice(message);
        Ok(Bytes::from(bytes))
    }

    fn reserve(wait_ms: u64) -> ReserveRequest {
        ReserveRequest { namespace: "live".into(), key: "k".into(), wait_ms, ..ReserveRequest::default() }
    }

    async fn waiters(engine: &Engine, n: u64) -> bool {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == n))
            .await
            .unwrap()
    }

    fn release(token: u64) -> KeyRequest {
        KeyRequest { namespace: "live".into(), key: "k".into(), token, lease_ms: 0 }
    }

    /// One shard with `k` held (`holder` its token), and a stream of at most
    /// `in_flight_max` calls in flight on it, fed frame by frame below tonic's transport.
    struct Stand {
        _dir: tempfile::TempDir,
        engine: Engine,
        tenant: Tenant,
        holder: u64,
        session: Session,
        frames: mpsc::Sender<Result<Bytes, Status>>,
        requests: Streaming<pb::SessionRequest>,
    }

    async fn stand(in_flight_max: usize) -> Stand {
        stand_with(SessionLimits { calls_in_flight_max: in_flight_max, unsent_bytes_max: 1 << 20 }).await
    }

    async fn stand_with(limits: SessionLimits) -> Stand {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig { data_dir: dir.path().to_owned(), shards: 1, ..EngineConfig::default() };
        let engine = Engine::open(config).expect("the engine opens");
        let tenant = Tenant::default_tenant();
        let holder = match engine.reserve(&tenant, reserve(0)).await.unwrap().reply {
            ReserveReply::Granted { token, .. } => token,
            other => panic!("expected a grant, got {other:?}"),
        };
        let admit = Admit::new(64, &[], engine.clock().clone());
        let gate = GateService::new(engine.clone(), Auth::new(&[]), admit, limits, Duration::from_secs(60));
        let session = Session::new(gate, tenant.clone(), None, tracing::Span::none());
        let (frames, body) = mpsc::channel(4);
        let mut codec =
            oncegate_proto::codec::StrictCodec::<pb::SessionResponse, pb::SessionRequest>::default();
        let body = Body::from_stream(ReceiverStream::new(body));
        let requests = Streaming::new_request(codec.decoder(), body, None, None);
        Stand { _dir: dir, engine, tenant, holder, session, frames, requests }
    }

    /// Runs `session` with an answers' channel of one place, full from the start (the test
    /// reads that answer first), so that every answer the stream makes waits for room.
    fn serve_unread(
        session: Session,
        requests: Streaming<pb::SessionRequest>,
    ) -> (tokio::task::JoinHandle<()>, Responses) {
        let (answers, unread) = super::answers(1, &session.backlog);
        let placeholder = session.backlog.unsent(pb::SessionResponse::default(), None);
        answers.try_send(Ok(placeholder)).map_err(|_| ()).expect("the channel is empty");
        (tokio::spawn(session.run(requests, answers)), unread)
    }

    /// Releases `k` and checks that the next reserve is a first grant: `what` never held
    /// the key.
    async fn first_grant_after_release(engine: &Engine, tenant: &Tenant, holder: u64, what: &str) {
        engine.release(tenant, release(holder)).await.unwrap();
        match engine.reserve(tenant, reserve(0)).await.unwrap().reply {
            ReserveReply::Granted { previous, .. } => assert_eq!(previous, Previous::None),
            other => panic!("{what} must not hold the key: {other:?}"),
        }
    }

    /// A stream that ends on a message that does not decode, while its client reads no
    /// answers, waits to send its status with the answers' channel full. Its calls in
    /// flight are dropped before that wait, so that a parked reserve is never granted
    /// to a stream that is over (the id map kept each call's answer alive until the
    /// status was sent). Driven here below tonic's transport, so that the channel is full
    /// by construction rather than by flow-control windows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_ended_by_a_bad_message_drops_its_calls_before_its_status_waits() {
        let Stand { _dir, engine, tenant, holder, session, frames, requests } = stand(1).await;
        let (served, mut unread) = serve_unread(session, requests);

        let waiting = pb::ReserveRequest::from(reserve(20_000));
        let call = pb::SessionRequest {
            id: 1,
            call: Some(In::Reserve(waiting)),
            timeout_ms: 0,
            ..Default::default()
        };
        frames.send(frame(&call.encode_to_vec())).await.unwrap();
        assert!(waiters(&engine, 1).await, "the stream's reserve is parked");
        // A varint cut off: the message does not decode.
        frames.send(frame(&[0xff])).await.unwrap();
        assert!(waiters(&engine, 0).await, "the parked reserve is dropped while the status waits");
        assert!(!served.is_finished(), "the status waits for room in the answers' channel");

        first_grant_after_release(&engine, &tenant, holder, "the ended stream's reserve").await;
        assert!(unread.next().await.expect("the answer put there").is_ok());
        let status = unread.next().await.expect("the stream's status").expect_err("a status");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        served.await.unwrap();
    }

    /// How many `release` calls the process's latency histogram holds that took longer
    /// than half a second.
    fn slow_releases() -> u64 {
        let text = crate::telemetry::handle().render();
        let sample = |series: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(series))
                .map_or(0, |value| value.trim().parse::<f64>().expect("a sample's value") as u64)
        };
        let name = "oncegate_request_duration_seconds";
        sample(&format!("{name}_count{{rpc=\"release\"}}"))
            - sample(&format!("{name}_bucket{{rpc=\"release\",le=\"0.5\"}}"))
    }

    /// A call held at the stream's limit spends its deadline waiting: one whose
    /// deadline passed while it was held is refused without reaching its shard. (The
    /// deadline counted from when the call started, so a release held behind a parked
    /// reserve was started with all its time still to run, long after its client had
    /// given up, and released the key.) Its latency counts the wait too (it was timed from
    /// when it started, so the time held went uncounted). The clock is tokio's paused one,
    /// so the order of the two deadlines is set by construction.
    #[tokio::test(start_paused = true)]
    async fn a_call_held_at_the_limit_past_its_deadline_never_reaches_its_shard() {
        let Stand { _dir, engine, tenant, holder, session, frames, requests } = stand(1).await;
        let slow_before = slow_releases();
        let (answers, mut answered) = super::answers(4, &session.backlog);

        // The reserve parks behind the holder and fills the stream's one place; the
        // release, read next, is held aside until the reserve's deadline frees it.
        let waiting = pb::ReserveRequest::from(reserve(20_000));
        let parked = pb::SessionRequest {
            id: 1,
            call: Some(In::Reserve(waiting)),
            timeout_ms: 1_000,
            ..Default::default()
        };
        let release = pb::ReleaseRequest::from(release(holder));
        let held = pb::SessionRequest {
            id: 2,
            call: Some(In::Release(release)),
            timeout_ms: 50,
            ..Default::default()
        };
        frames.send(frame(&parked.encode_to_vec())).await.unwrap();
        frames.send(frame(&held.encode_to_vec())).await.unwrap();
        let served = tokio::spawn(session.run(requests, answers));

        let mut refused = Vec::new();
        for _ in 0..2 {
            let answer = answered.next().await.expect("an answer").expect("not a status");
            match answer.result {
                Some(Out::Refusal(refusal)) => {
                    assert_eq!(refusal.grpc_code, tonic::Code::Unavailable as i32, "{refusal:?}");
                    refused.push((answer.id, refusal.message));
                }
                other => panic!("call {} must be refused past its deadline: {other:?}", answer.id),
            }
        }
        refused.sort_unstable();
        assert!(refused[0].1.starts_with("no answer within 1000 ms"), "{refused:?}");
        assert!(refused[1].1.starts_with("not started within 50 ms"), "the held call: {refused:?}");
        assert!(slow_releases() > slow_before, "the held release's latency counts the second it was held");
        match engine.reserve(&tenant, reserve(0)).await.unwrap().reply {
            ReserveReply::InProgress { .. } => {}
            other => panic!("the held release must not have reached the shard: {other:?}"),
        }
        drop(frames);
        served.await.unwrap();
    }

    /// A call's deadline holds while the stream waits for its client to read: the calls in
    /// flight are still polled, so a parked reserve is dropped at its deadline, never
    /// granted to a caller that gave up on it. (The stream waited for room in the answers'
    /// channel with nothing else polled: a reserve parked there past its deadline stayed
    /// parked, was granted once its key was released, and was answered as granted when
    /// the client read again, long after that client had given up.) The channel is full
    /// from the start, the refusal that then waits for room is made without the engine,
    /// and the clock is tokio's paused one, so the deadline passes only once the stream
    /// waits.
    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_deadline_is_dropped_while_its_stream_waits_to_send() {
        let Stand { _dir, engine, tenant, holder, session, frames, requests } = stand(2).await;
        let (served, mut unread) = serve_unread(session, requests);

        let waiting = pb::ReserveRequest::from(reserve(20_000));
        let parked = pb::SessionRequest {
            id: 1,
            call: Some(In::Reserve(waiting)),
            timeout_ms: 1_000,
            ..Default::default()
        };
        frames.send(frame(&parked.encode_to_vec())).await.unwrap();
        assert!(waiters(&engine, 1).await, "the stream's reserve is parked");
        // No call: refused at once, and the refusal waits for room in the channel.
        let empty = pb::SessionRequest { id: 2, call: None, timeout_ms: 0, ..Default::default() };
        frames.send(frame(&empty.encode_to_vec())).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(waiters(&engine, 0).await, "the parked reserve is dropped at its deadline");

        first_grant_after_release(&engine, &tenant, holder, "the reserve past its deadline").await;
        assert!(unread.next().await.expect("the answer put there").is_ok());
        let mut ids = Vec::new();
        for _ in 0..2 {
            let answer = unread.next().await.expect("an answer").expect("not a status");
            let Some(Out::Refusal(refusal)) = answer.result else {
                panic!("call {} must be refused: {:?}", answer.id, answer.result)
            };
            if answer.id == 1 {
                assert_eq!(refusal.grpc_code, tonic::Code::Unavailable as i32, "{refusal:?}");
                assert!(refusal.message.starts_with("no answer within 1000 ms"), "{refusal:?}");
            }
            ids.push(answer.id);
        }
        ids.sort_unstable();
        assert_eq!(ids, [1, 2]);
        drop(frames);
        served.await.unwrap();
    }

    /// Waits (on a blocking thread, so that the paused clock does not run ahead meanwhile)
    /// until the stream's unsent answers take at least `bytes`.
    async fn unsent_at_least(backlog: &Arc<Backlog>, bytes: usize) -> bool {
        let backlog = Arc::clone(backlog);
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            while backlog.bytes() < bytes {
                if started.elapsed() > Duration::from_secs(10) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        })
        .await
        .unwrap()
    }

    /// Past `server.session_unsent_bytes_max` a stream starts no call until the transport
    /// takes answers: a call read there is held, spending its deadline, and starts once
    /// the answers drain. (Only the count of answers was limited: a client that read
    /// nothing made the stream hold up to twice `session_calls_in_flight_max` answers of
    /// up to 64 KiB each, 32 MiB a stream.) The reserve read past the limit would be
    /// answered `in_progress` (the key is held) had it started then; held, its 50 ms pass
    /// on the paused clock before the answers drain, so it is refused unstarted.
    #[tokio::test(start_paused = true)]
    async fn a_stream_past_its_unsent_bytes_starts_no_call_until_answers_drain() {
        let limits = SessionLimits { calls_in_flight_max: 8, unsent_bytes_max: 4 << 10 };
        let Stand { _dir, engine, tenant, session, frames, requests, .. } = stand_with(limits).await;
        let big = ReserveRequest { key: "big".into(), ..reserve(0) };
        let ReserveReply::Granted { token, .. } = engine.reserve(&tenant, big).await.unwrap().reply else {
            panic!("big is free")
        };
        let response = vec![7; 8 << 10];
        let commit = CommitRequest {
            namespace: "live".into(),
            key: "big".into(),
            token,
            outcome: Outcome::Succeeded,
            response,
        };
        engine.commit(&tenant, commit).await.unwrap();
        let backlog = Arc::clone(&session.backlog);
        let (served, mut unread) = serve_unread(session, requests);

        let get = pb::GetRequest { namespace: "live".into(), key: "big".into() };
        let get = pb::SessionRequest { id: 1, call: Some(In::Get(get)), timeout_ms: 0, ..Default::default() };
        frames.send(frame(&get.encode_to_vec())).await.unwrap();
        assert!(unsent_at_least(&backlog, 8 << 10).await, "the get's answer waits unsent");
        let held = pb::ReserveRequest::from(reserve(0));
        let held =
            pb::SessionRequest { id: 2, call: Some(In::Reserve(held)), timeout_ms: 50, ..Default::default() };
        frames.send(frame(&held.encode_to_vec())).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;

        assert!(unread.next().await.expect("the answer put there").is_ok());
        let answer = unread.next().await.expect("the get's answer").expect("not a status");
        assert!(matches!((answer.id, answer.result), (1, Some(Out::Get(_)))));
        let answer = unread.next().await.expect("the held call's answer").expect("not a status");
        match answer.result {
            Some(Out::Refusal(refusal)) => {
                assert_eq!(answer.id, 2);
                assert!(refusal.message.starts_with("not started within 50 ms"), "{refusal:?}");
            }
            other => panic!("the reserve must be held until the answers drain: {other:?}"),
        }
        drop(frames);
        served.await.unwrap();
        assert_eq!(backlog.bytes(), 0, "every answer left");
    }
}
