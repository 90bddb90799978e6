//! Calls multiplexed over one `Session` stream per client: many calls in flight on one
//! HTTP/2 stream, answered out of order and matched by id, which costs the server about
//! half the CPU of a unary call. A task per stream sends the calls and routes the answers;
//! a stream that ends (a reset, a server restart) is opened again by the next call. A
//! caller that goes before its answer (its future dropped, its timeout passed) has a
//! `cancel` sent for its call, so that the server drops it as it drops a unary call whose
//! client reset it: a reserve not yet decided is then never granted to nobody.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use pb::session_request::Call;
use pb::session_response::Result as Out;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::{ClientError, Refusal};

/// A call on its way, when its caller stops waiting, and where its answer goes.
type Waiting = (pb::SessionRequest, Instant, oneshot::Sender<Out>);

/// Calls in flight on one stream before senders wait for room.
const CALLS_QUEUED_MAX: usize = 1024;

/// The client's stream, opened on first use and again after it ends.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    stream: Mutex<Option<Open>>,
    ids: AtomicU64,
}

/// An open stream's way in: calls (bounded, senders wait for room), and the ids of calls
/// whose callers have gone (one at most per call, so bounded by the calls in flight; a
/// dropped future cannot wait for room).
#[derive(Clone, Debug)]
struct Open {
    calls: mpsc::Sender<Waiting>,
    cancels: mpsc::UnboundedSender<u64>,
}

/// Sends a cancel for a call when dropped before its answer came: its caller has gone.
struct CancelOnDrop {
    id: u64,
    cancels: Option<mpsc::UnboundedSender<u64>>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancels) = self.cancels.take() {
            let _ = cancels.send(self.id);
        }
    }
}

impl Sessions {
    /// Sends `call` on the stream (opening it if needed) and waits for its answer; gives
    /// the call back unsent when the server has no `Session` call, or refuses this client
    /// a stream (its tenant has `tenants[].sessions_max` open).
    pub async fn call(
        &self,
        gate: &GateClient<Channel>,
        metadata: &tonic::metadata::MetadataMap,
        call: Call,
        ends_at: Instant,
    ) -> Result<Result<Out, Call>, ClientError> {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (answer, answered) = oneshot::channel();
        let stream = match self.stream(gate, metadata).await {
            Ok(stream) => stream,
            Err(status)
                if matches!(status.code(), tonic::Code::Unimplemented | tonic::Code::ResourceExhausted) =>
            {
                tracing::info!(%status, "no Session stream for this client; it sends unary calls");
                return Ok(Err(call));
            }
            Err(status) => return Err(ClientError::of_status(status)),
        };
        let request = pb::SessionRequest { id, call: Some(call), timeout_ms: 0, ..Default::default() };
        if stream.calls.send((request, ends_at, answer)).await.is_err() {
            // The stream ended between the check and the send: the call never left.
            self.stream.lock().await.take();
            return Err(ended("the session stream ended before the call was sent"));
        }
        let mut gone = CancelOnDrop { id, cancels: Some(stream.cancels) };
        let answer = answered.await;
        gone.cancels = None;
        Ok(Ok(answer.map_err(|_| ended("the session stream ended before the call was answered"))?))
    }

    async fn stream(
        &self,
        gate: &GateClient<Channel>,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Open, tonic::Status> {
        let mut stream = self.stream.lock().await;
        if let Some(open) = stream.as_ref().filter(|s| !s.calls.is_closed()) {
            return Ok(open.clone());
        }
        let opened = open(gate.clone(), metadata.clone()).await?;
        *stream = Some(opened.clone());
        Ok(opened)
    }
}

/// When a call given `timeout` from now ends (far in the future for a timeout too long
/// to add).
pub(crate) fn deadline_from_now(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

fn ended(message: &str) -> ClientError {
    Refusal::unanswered(message.to_owned())
}

/// Opens a stream and starts the task that sends its calls and routes its answers by id;
/// when the stream ends, every call still waiting hears so (its sender is dropped).
async fn open(
    mut gate: GateClient<Channel>,
    metadata: tonic::metadata::MetadataMap,
) -> Result<Open, tonic::Status> {
    let (calls, queued) = mpsc::channel::<Waiting>(CALLS_QUEUED_MAX);
    let (cancels, cancelled) = mpsc::unbounded_channel();
    // Bounded too, and the task never waits on it: it would stop reading answers, and a
    // server whose answers are not read stops reading calls (HTTP/2 flow control), a
    // deadlock. A call that finds it full is kept aside while the task goes on reading
    // answers, and no other is taken from `calls` until it is handed over, so callers wait
    // there. (Unbounded, it grew with every call that callers gave up on and retried
    // while the server read nothing.)
    let (requests, outgoing) = mpsc::channel(CALLS_QUEUED_MAX);
    // The server drops a call when the caller's deadline passes, as it drops a unary
    // call, so that a reserve the caller gave up on is never granted. The time left is
    // written as the call leaves, not when it was queued: a call that waited here (the
    // server reads no more while its calls in flight are at their limit) has less.
    // A call whose time ran out while it waited here is not sent at all: its caller has
    // given up, and a reserve granted now would hold the key for nobody.
    // A call cancelled while it waited in that channel is not sent either, nor then its
    // cancel; one already sent has its cancel follow it.
    let taken_back = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let outgoing_taken_back = Arc::clone(&taken_back);
    let outgoing = tokio_stream::wrappers::ReceiverStream::new(outgoing).filter_map(
        move |(mut request, ends_at): (pb::SessionRequest, Instant)| {
            let gone = outgoing_taken_back.lock().unwrap_or_else(PoisonError::into_inner).remove(&request.id);
            if matches!(request.call, Some(Call::Cancel(_))) {
                return gone.then_some(request);
            }
            if gone {
                return None;
            }
            let left = ends_at.saturating_duration_since(Instant::now());
            request.timeout_ms = u64::try_from(left.as_millis()).ok()?;
            // 0 would ask for the server's own limit; under 1 ms left is no time.
            (request.timeout_ms > 0).then_some(request)
        },
    );
    let mut request = tonic::Request::new(outgoing);
    *request.metadata_mut() = metadata;
    let response = gate.session(request).await?;
    let in_flight_max = calls_in_flight_max(response.metadata());
    let answers = response.into_inner();
    let routes = Routes::new(requests, taken_back, in_flight_max);
    tokio::spawn(routes.run(queued, cancelled, answers));
    Ok(Open { calls, cancels })
}

/// The most calls the server keeps in flight on the stream, as its response says (a
/// server that does not say has no such limit).
fn calls_in_flight_max(metadata: &tonic::metadata::MetadataMap) -> usize {
    let value = metadata.get(oncegate_proto::SESSION_CALLS_IN_FLIGHT_MAX_METADATA);
    let limit = value.and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    limit.filter(|&limit| limit > 0).unwrap_or(usize::MAX)
}

/// The stream task's state: the callers waiting by id, and what it could not yet hand to
/// the outgoing channel.
struct Routes {
    waiting: HashMap<u64, oneshot::Sender<Out>>,
    /// The server's limit of calls in flight on the stream. No more calls than that are
    /// waiting for answers, so the server never holds one unstarted, and a cancel (which
    /// frees its call's place at once) is always read as soon as it arrives; a call held
    /// there would keep a cancel behind it unread, and its reserve parked, or granted to
    /// nobody, until the held call could start.
    in_flight_max: usize,
    /// Requests taken while `requests` was full, in order: at most one call (no other is
    /// taken from the callers' queue until it is handed over, so callers wait there), and
    /// the cancels behind it.
    aside: VecDeque<(pb::SessionRequest, Instant)>,
    requests: mpsc::Sender<(pb::SessionRequest, Instant)>,
    /// The ids of calls cancelled after they were handed to `requests`, until the
    /// outgoing stream meets the call (then dropped, unsent) or its cancel.
    taken_back: Arc<std::sync::Mutex<HashSet<u64>>>,
}

impl Routes {
    fn new(
        requests: mpsc::Sender<(pb::SessionRequest, Instant)>,
        taken_back: Arc<std::sync::Mutex<HashSet<u64>>>,
        in_flight_max: usize,
    ) -> Routes {
        Routes { waiting: HashMap::new(), in_flight_max, aside: VecDeque::new(), requests, taken_back }
    }

    async fn run(
        mut self,
        mut queued: mpsc::Receiver<Waiting>,
        mut cancelled: mpsc::UnboundedReceiver<u64>,
        mut answers: impl tokio_stream::Stream<Item = Result<pb::SessionResponse, tonic::Status>> + Unpin,
    ) {
        // Waiting for room borrows the sender while the other arms change `self`.
        let outgoing = self.requests.clone();
        loop {
            tokio::select! {
                // Cancels first: a caller's next call, sent after its previous one was
                // dropped, then follows the cancel on the stream.
                biased;
                Some(id) = cancelled.recv() => {
                    if !self.cancel(id) {
                        return;
                    }
                }
                // Answers before new calls: callers waiting for answers already here
                // must not wait on other callers' calls.
                answer = answers.next() => {
                    let Some(Ok(answer)) = answer else { return };
                    if let (Some(caller), Some(result)) = (self.waiting.remove(&answer.id), answer.result) {
                        let _ = caller.send(result);
                    }
                }
                room = outgoing.reserve(), if !self.aside.is_empty() => {
                    let Ok(room) = room else { return };
                    room.send(self.aside.pop_front().expect("checked by the guard"));
                }
                call = queued.recv(), if self.aside.is_empty() && self.waiting.len() < self.in_flight_max => {
                    let Some((request, ends_at, answer)) = call else { return };
                    if !self.take(request, ends_at, answer) {
                        return;
                    }
                }
            }
        }
    }

    /// Hands a caller's call to the stream; false once the stream has ended.
    fn take(&mut self, request: pb::SessionRequest, ends_at: Instant, answer: oneshot::Sender<Out>) -> bool {
        // A caller that gave up before its call left is not waited for (one that gives up
        // later sends a cancel, which takes it out of `waiting`).
        if answer.is_closed() {
            return true;
        }
        self.waiting.insert(request.id, answer);
        self.send((request, ends_at))
    }

    /// Takes back the call `id` whose caller has gone: unsent, it is not sent; sent, a
    /// cancel follows it. False once the stream has ended.
    fn cancel(&mut self, id: u64) -> bool {
        if self.waiting.remove(&id).is_none() {
            // Answered already, or never taken from the queue (then skipped there).
            return true;
        }
        if let Some(at) = self.aside.iter().position(|(request, _)| request.id == id) {
            self.aside.remove(at);
            return true;
        }
        self.taken_back.lock().unwrap_or_else(PoisonError::into_inner).insert(id);
        let cancel = pb::SessionRequest {
            id,
            call: Some(Call::Cancel(pb::Cancel {})),
            timeout_ms: 0,
            ..Default::default()
        };
        self.send((cancel, Instant::now()))
    }

    /// Hands a request to the outgoing channel, or puts it aside while that is full (never
    /// waiting: a task that stopped reading answers would stop the server reading calls).
    fn send(&mut self, request: (pb::SessionRequest, Instant)) -> bool {
        if !self.aside.is_empty() {
            self.aside.push_back(request);
            return true;
        }
        match self.requests.try_send(request) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(request)) => {
                self.aside.push_back(request);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// A refused call of a session, as the unary call's status would have said it.
pub(crate) fn refused(refusal: pb::Refusal) -> ClientError {
    let grpc = tonic::Code::from(refusal.grpc_code);
    let code = oncegate_core::Code::ALL.into_iter().find(|c| c.as_str() == refusal.code);
    let code = code.unwrap_or_else(|| oncegate_proto::status::code_of(&tonic::Status::new(grpc, "")));
    let named = |text: String| Some(text).filter(|t| !t.is_empty());
    ClientError::Refused(Refusal {
        code,
        grpc: grpc.into(),
        message: refusal.message,
        field: named(refusal.field),
        limit: named(refusal.limit),
        causes: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use tokio_stream::wrappers::ReceiverStream;

    use super::*;

    fn get(id: u64) -> pb::SessionRequest {
        let get = pb::GetRequest { namespace: "live".into(), key: format!("k{id}") };
        pb::SessionRequest { id, call: Some(Call::Get(get)), timeout_ms: 0, ..Default::default() }
    }

    /// The limit is read from the stream's response header; a server that gives none,
    /// or none that parses, is taken to have no limit.
    #[test]
    fn the_limit_of_calls_in_flight_is_read_from_the_response_header() {
        let limit = |value: Option<&str>| {
            let mut metadata = tonic::metadata::MetadataMap::new();
            if let Some(value) = value {
                metadata.insert(oncegate_proto::SESSION_CALLS_IN_FLIGHT_MAX_METADATA, value.parse().unwrap());
            }
            calls_in_flight_max(&metadata)
        };
        assert_eq!(limit(Some("3")), 3);
        assert_eq!(limit(None), usize::MAX);
        assert_eq!(limit(Some("0")), usize::MAX);
        assert_eq!(limit(Some("many")), usize::MAX);
    }

    /// At the server's limit of calls in flight the stream task sends no further call, so
    /// a cancel goes out ahead of the next call and the server, which has room, reads it
    /// at once. (The task sent every call it was given; past the limit the server held one
    /// unstarted and read nothing behind it, so a cancel waited there, and the cancelled
    /// reserve stayed parked, or was granted to nobody, until the held call could start.)
    /// The runtime has one thread: the task runs until it waits each time the test waits,
    /// so what it would send has been sent by the time the test looks.
    #[tokio::test]
    async fn at_the_servers_limit_a_cancel_goes_out_before_the_next_call() {
        let (requests, mut outgoing) = mpsc::channel(CALLS_QUEUED_MAX);
        let routes = Routes::new(requests, Arc::default(), 1);
        let (calls, queued) = mpsc::channel(CALLS_QUEUED_MAX);
        let (cancels, cancelled) = mpsc::unbounded_channel();
        let (answers, answered) = mpsc::channel(4);
        let ends_at = deadline_from_now(Duration::from_secs(60));
        let (first, _first_caller) = oneshot::channel();
        let (second, second_caller) = oneshot::channel();
        calls.send((get(1), ends_at, first)).await.unwrap();
        calls.send((get(2), ends_at, second)).await.unwrap();
        let task = tokio::spawn(routes.run(queued, cancelled, ReceiverStream::new(answered)));

        assert_eq!(outgoing.recv().await.expect("the first call").0.id, 1);
        assert!(outgoing.try_recv().is_err(), "the second call waits for room");
        cancels.send(1).unwrap();
        let cancel = outgoing.recv().await.expect("the cancel").0;
        assert!(matches!((cancel.id, cancel.call), (1, Some(Call::Cancel(_)))), "the cancel goes first");
        assert_eq!(outgoing.recv().await.expect("the second call").0.id, 2, "the cancel made room");
        let answer = pb::SessionResponse { id: 2, result: Some(Out::Get(pb::GetResponse::default())) };
        answers.send(Ok(answer)).await.unwrap();
        assert!(matches!(second_caller.await, Ok(Out::Get(_))), "the answer reaches its caller");

        drop(calls);
        task.await.unwrap();
    }
}
