//! The `Session` stream: many calls over one bidirectional stream, each answered as soon
//! as its shard decides it (out of order), each exactly a unary call (the same
//! [`GateService::begin`]: admission, engine, metrics, logs).
//!
//! One task per stream reads requests and owns the calls in flight. It reads a request
//! only while fewer than `server.session_calls_in_flight_max` calls are in flight, and
//! answers through a channel of that many slots, so a client that stops reading stops
//! the server from reading its requests: backpressure, never unbounded buffering. A
//! call is queued on its shard as it is read (so a stream's calls reach their shards in
//! the order they were sent). When the stream ends (the client goes away, or sends a
//! message that does not decode) the task drops its calls in flight, and each is then
//! what a unary call whose caller has gone is: one not yet decided is skipped by its
//! shard (never granted, never parked); one already written keeps its effect, and its
//! answer is lost. A call also has a deadline, as a unary call has (its `timeout_ms`,
//! at most `server.request_timeout_ms`): past it the call is dropped in the same way and
//! answered `unavailable`, so that a shard that stalls never grants, long after, a
//! reserve whose client has given up on it. And a client whose caller has gone sends a
//! `cancel` for its call, which drops it in the same way, unanswered: the stream's
//! equivalent of a unary call's reset.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use oncegate_core::{Invalid, Tenant};
use oncegate_proto::v1 as pb;
use pb::session_request::Call as In;
use pb::session_response::Result as Out;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};

use crate::gate::{Call, Deadline, GateService};
use crate::status::Refusal;

/// The answers of one stream, as tonic sends them.
pub type Responses = tokio_stream::wrappers::ReceiverStream<Result<pb::SessionResponse, Status>>;

/// A call in flight: its answer, ready to send, or what remains of a cancelled call.
type InFlight = Pin<Box<dyn Future<Output = Ended> + Send>>;

/// How a call in flight ended.
enum Ended {
    Answered {
        started: u64,
        answer: pb::SessionResponse,
    },
    /// Dropped by a cancel (its id no longer in flight), unanswered.
    Cancelled,
}

/// A call in flight as the stream knows it by id: which call it is (an id is reused once
/// its call is cancelled, and the cancelled call may end after its successor started),
/// and the sender whose drop cancels it.
struct Started {
    started: u64,
    _cancel: oneshot::Sender<()>,
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
            crate::telemetry::record_call(
                "session",
                None,
                refusal.code().as_str(),
                std::time::Instant::now(),
            );
            return Err(refusal.to_status());
        }
    };
    let in_flight_max = gate.session_calls_in_flight_max;
    let (answers, responses) = mpsc::channel(in_flight_max);
    let session = Session {
        gate,
        tenant,
        in_flight_max,
        ids: HashMap::new(),
        started: 0,
        in_flight: FuturesUnordered::new(),
    };
    tokio::spawn(session.run(request.into_inner(), answers));
    Ok(Response::new(Responses::new(responses)))
}

struct Session {
    gate: GateService,
    tenant: Tenant,
    in_flight_max: usize,
    /// The calls in flight, by id.
    ids: HashMap<u64, Started>,
    /// How many calls the stream started.
    started: u64,
    in_flight: FuturesUnordered<InFlight>,
}

impl Session {
    async fn run(
        mut self,
        mut requests: Streaming<pb::SessionRequest>,
        answers: mpsc::Sender<Result<pb::SessionResponse, Status>>,
    ) {
        let mut reading = true;
        loop {
            // The client sent its last call and every call is answered: the stream ends.
            if !reading && self.in_flight.is_empty() {
                return;
            }
            let room = self.in_flight.len() < self.in_flight_max;
            let answer = tokio::select! {
                biased;
                // The client has gone: returning drops every call in flight.
                () = answers.closed() => return,
                Some(ended) = self.in_flight.next(), if !self.in_flight.is_empty() => match ended {
                    // A call cancelled after its answer was ready gets no answer either:
                    // its id may name another call by now.
                    Ended::Answered { started, answer } => {
                        if self.ids.get(&answer.id).is_none_or(|call| call.started != started) {
                            continue;
                        }
                        self.ids.remove(&answer.id);
                        answer
                    }
                    Ended::Cancelled => continue,
                },
                message = requests.message(), if reading && room => match message {
                    Ok(Some(request)) => match self.start(request) {
                        Some(refused) => refused,
                        None => continue,
                    },
                    // The client sent its last call: answer those in flight, then end.
                    Ok(None) => {
                        reading = false;
                        continue;
                    }
                    // A message that does not decode (or a broken stream) ends the stream
                    // with its status. The calls in flight are dropped first, so none is
                    // granted while the status waits for the client to read.
                    Err(status) => {
                        self.in_flight.clear();
                        let _ = answers.send(Err(status)).await;
                        return;
                    }
                },
                else => return,
            };
            if answers.send(Ok(answer)).await.is_err() {
                return;
            }
        }
    }

    /// Starts one call, or cancels one, or returns its refusal when the request itself is
    /// wrong for a session (no call, or an id already in flight).
    fn start(&mut self, request: pb::SessionRequest) -> Option<pb::SessionResponse> {
        let id = request.id;
        let Some(call) = request.call else {
            return Some(refused(id, Invalid::Rule { field: "call", rule: "must name one call" }));
        };
        let cancels = matches!(call, In::Cancel(_));
        if !cancels && self.ids.contains_key(&id) {
            let rule = "must be unique among the stream's calls in flight";
            return Some(refused(id, Invalid::Rule { field: "id", rule }));
        }
        let deadline = self.deadline(request.timeout_ms);
        self.started += 1;
        let (cancel, cancelled) = oneshot::channel();
        let slot = Slot { id, started: self.started, cancelled };
        let call = match call {
            In::Reserve(m) => self.begin(slot, m, deadline, Out::Reserve),
            In::Commit(m) => self.begin(slot, m, deadline, Out::Commit),
            In::Release(m) => self.begin(slot, m, deadline, Out::Release),
            In::Heartbeat(m) => self.begin(slot, m, deadline, Out::Heartbeat),
            In::Get(m) => self.begin(slot, m, deadline, Out::Get),
            In::Cancel(_) => {
                // Dropping its sender ends the call at its next poll, which comes before
                // the next request is read (the loop is biased): a call sent after a
                // cancel reaches its shard only once the cancelled one is gone.
                self.ids.remove(&id);
                return None;
            }
        };
        self.ids.insert(id, Started { started: self.started, _cancel: cancel });
        self.in_flight.push(call);
        None
    }

    /// A call's deadline: the one it asks for, within the server's request timeout.
    fn deadline(&self, timeout_ms: u64) -> Deadline {
        let most = self.gate.request_timeout;
        match Duration::from_millis(timeout_ms) {
            asked if timeout_ms > 0 && asked <= most => {
                Deadline { within: asked, limit: "the call's timeout_ms" }
            }
            _ => Deadline { within: most, limit: "server.request_timeout_ms" },
        }
    }

    /// One call on the unary path, its answer wrapped for the stream, unless it is
    /// cancelled first.
    fn begin<M: Call>(
        &self,
        slot: Slot,
        message: M,
        deadline: Deadline,
        wrap: fn(M::Reply) -> Out,
    ) -> InFlight {
        let answer = self.gate.begin(Ok(self.tenant.clone()), message, Some(deadline));
        let Slot { id, started, cancelled } = slot;
        Box::pin(async move {
            let result = tokio::select! {
                biased;
                answer = answer => match answer {
                    Ok((reply, _)) => wrap(reply),
                    Err(refusal) => Out::Refusal(refusal.to_wire()),
                },
                _ = cancelled => return Ended::Cancelled,
            };
            Ended::Answered { started, answer: pb::SessionResponse { id, result: Some(result) } }
        })
    }
}

/// Where a call's answer goes: its id, which call of the stream it is, and the receiver
/// that hears its cancel.
struct Slot {
    id: u64,
    started: u64,
    cancelled: oneshot::Receiver<()>,
}

fn refused(id: u64, invalid: Invalid) -> pb::SessionResponse {
    pb::SessionResponse { id, result: Some(Out::Refusal(Refusal::from(invalid).to_wire())) }
}
