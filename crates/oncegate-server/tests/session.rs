//! The `Session` stream on the real server (port 0) with the generated client: every call
//! answered as its unary twin, refusals that leave the stream open, duplicate ids,
//! backpressure, tenants, and calls whose stream went away.

use std::time::Duration;

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{Config, TenantConfig, token_sha256};
use pb::session_request::Call;
use pb::session_response::Result as Out;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Streaming};

mod common;

use common::{RawReserve, Running, exhausted, granted, reserve, start_with};

/// One open stream: requests go in through `send`, answers come out of `answers`.
struct Stream {
    requests: mpsc::Sender<pb::SessionRequest>,
    answers: Streaming<pb::SessionResponse>,
}

impl Stream {
    async fn open(server: &Running) -> Stream {
        Stream::open_as(server, None).await.expect("the stream opens")
    }

    async fn open_as(server: &Running, token: Option<&str>) -> Result<Stream, tonic::Status> {
        let (requests, rx) = mpsc::channel(64);
        let mut request = Request::new(ReceiverStream::new(rx));
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        let answers = server.client().await.session(request).await?.into_inner();
        Ok(Stream { requests, answers })
    }

    async fn send(&self, id: u64, call: Call) {
        self.requests
            .send(pb::SessionRequest { id, call: Some(call), timeout_ms: 0, ..Default::default() })
            .await
            .expect("the stream is open");
    }

    async fn next(&mut self) -> (u64, Out) {
        let answer = self.answers.message().await.expect("no stream error").expect("an answer");
        (answer.id, answer.result.expect("a result"))
    }

    /// Sends one call and reads the next answer, which must be its own.
    async fn call(&mut self, id: u64, call: Call) -> Out {
        self.send(id, call).await;
        let (answered, result) = self.next().await;
        assert_eq!(answered, id);
        result
    }
}

fn commit(key: &str, token: u64, response: &[u8]) -> Call {
    Call::Commit(pb::CommitRequest {
        namespace: "live".into(),
        key: key.into(),
        token,
        outcome: pb::Outcome::Succeeded as i32,
        response: response.to_vec(),
    })
}

fn get(key: &str) -> Call {
    Call::Get(pb::GetRequest { namespace: "live".into(), key: key.into() })
}

fn reserve_waiting(key: &str) -> Call {
    Call::Reserve(pb::ReserveRequest { wait_ms: 20_000, ..reserve(key) })
}

fn granted_in(result: &Out) -> u64 {
    match result {
        Out::Reserve(response) => granted(response),
        other => panic!("expected a reserve answer, got {other:?}"),
    }
}

fn refusal(result: Out) -> pb::Refusal {
    match result {
        Out::Refusal(refusal) => refusal,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn waiters(server: &Running, n: u64) -> bool {
    let engine = server.engine.clone();
    tokio::task::spawn_blocking(move || engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == n))
        .await
        .unwrap()
}

/// Releases the holder's grant of `k`, and checks that the next reserve of `k` is granted
/// as after that holder alone: `what` (a call that went away) never held the key.
async fn release_and_regrant(unary: &mut GateClient<Channel>, holder: u64, what: &str) {
    let release = pb::ReleaseRequest { namespace: "live".into(), key: "k".into(), token: holder };
    unary.release(release).await.unwrap();
    match unary.reserve(reserve("k")).await.unwrap().into_inner().outcome {
        Some(pb::reserve_response::Outcome::Granted(g)) => {
            assert_eq!(g.previous, pb::Previous::None as i32, "nobody held the key in between")
        }
        other => panic!("{what} must not hold the key: {other:?}"),
    }
}

/// One shard, `key` held by a unary reserve (`holder` its token), and a stream open: where
/// the tests of waiting calls begin. `limit` caps the stream's calls in flight.
struct Held {
    server: Running,
    unary: GateClient<Channel>,
    holder: u64,
    stream: Stream,
}

async fn held(key: &str, limit: Option<usize>) -> Held {
    held_with(key, |c| {
        if let Some(limit) = limit {
            c.server.session_calls_in_flight_max = limit;
        }
    })
    .await
}

/// [`held`] on a server configured by `edit` as well.
async fn held_with(key: &str, edit: impl FnOnce(&mut Config)) -> Held {
    let server = start_with(|c| {
        c.engine.shards = 1;
        edit(c);
    })
    .await;
    let mut unary = server.client().await;
    let holder = granted(&unary.reserve(reserve(key)).await.unwrap().into_inner());
    let stream = Stream::open(&server).await;
    Held { server, unary, holder, stream }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_answered_as_its_unary_twin() {
    let server = start_with(|_| {}).await;
    let mut stream = Stream::open(&server).await;
    let token = granted_in(&stream.call(1, Call::Reserve(reserve("k"))).await);
    let in_progress = stream.call(2, Call::Reserve(reserve("k"))).await;
    assert!(
        matches!(
            in_progress,
            Out::Reserve(pb::ReserveResponse {
                outcome: Some(pb::reserve_response::Outcome::InProgress(_)),
                ..
            })
        ),
        "{in_progress:?}"
    );
    let heartbeat = Call::Heartbeat(pb::HeartbeatRequest {
        namespace: "live".into(),
        key: "k".into(),
        token,
        lease_ms: 30_000,
    });
    assert!(matches!(stream.call(3, heartbeat).await, Out::Heartbeat(_)));
    assert!(matches!(stream.call(4, commit("k", token, b"answer")).await, Out::Commit(_)));
    match stream.call(5, Call::Reserve(reserve("k"))).await {
        Out::Reserve(pb::ReserveResponse {
            outcome: Some(pb::reserve_response::Outcome::Completed(c)),
            ..
        }) => {
            assert_eq!((c.token, c.response.as_slice()), (token, &b"answer"[..]))
        }
        other => panic!("expected the replay, got {other:?}"),
    }
    match stream.call(6, get("k")).await {
        Out::Get(view) => assert_eq!(view.state, pb::State::Completed as i32),
        other => panic!("{other:?}"),
    }
    let other = granted_in(&stream.call(7, Call::Reserve(reserve("other"))).await);
    let release =
        Call::Release(pb::ReleaseRequest { namespace: "live".into(), key: "other".into(), token: other });
    assert!(matches!(stream.call(8, release).await, Out::Release(_)));
    // What the stream wrote is what unary calls read.
    let mut unary = server.client().await;
    let view =
        unary.get(pb::GetRequest { namespace: "live".into(), key: "k".into() }).await.unwrap().into_inner();
    assert_eq!(view.response, b"answer");
    drop(stream);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_closes_its_side_gets_every_answer_then_the_end_of_the_stream() {
    let server = start_with(|_| {}).await;
    let Stream { requests, mut answers } = Stream::open(&server).await;
    for id in 1..=5 {
        let call = Call::Reserve(reserve(&format!("k{id}")));
        requests
            .send(pb::SessionRequest { id, call: Some(call), timeout_ms: 0, ..Default::default() })
            .await
            .unwrap();
    }
    drop(requests);
    let mut ids = Vec::new();
    while let Some(answer) = answers.message().await.expect("no stream error") {
        ids.push(answer.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2, 3, 4, 5], "every call answered, then the stream ended");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_is_answered_and_the_stream_goes_on() {
    let server = start_with(|_| {}).await;
    let mut stream = Stream::open(&server).await;
    let token = granted_in(&stream.call(1, Call::Reserve(reserve("k"))).await);
    let lost = refusal(stream.call(2, commit("k", token + 1, b"x")).await);
    assert_eq!(
        (lost.grpc_code, lost.code.as_str()),
        (Code::FailedPrecondition as i32, "lease_lost"),
        "{lost:?}"
    );
    let invalid = refusal(stream.call(3, Call::Reserve(reserve(&"x".repeat(700)))).await);
    assert_eq!((invalid.code.as_str(), invalid.field.as_str()), ("invalid_argument", "key"), "{invalid:?}");
    assert!(invalid.message.contains("512"), "{invalid:?}");
    let none = refusal({
        stream
            .requests
            .send(pb::SessionRequest { id: 4, call: None, timeout_ms: 0, ..Default::default() })
            .await
            .unwrap();
        let (id, result) = stream.next().await;
        assert_eq!(id, 4);
        result
    });
    assert_eq!((none.code.as_str(), none.field.as_str()), ("invalid_argument", "call"));
    assert!(matches!(stream.call(5, commit("k", token, b"ok")).await, Out::Commit(_)), "still served");
    drop(stream);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_come_as_decided_and_an_id_in_flight_is_not_reused() {
    let Held { server, mut unary, holder, mut stream } = held("held", None).await;
    stream.send(1, reserve_waiting("held")).await;
    assert!(waiters(&server, 1).await, "call 1 waits for the holder");
    // Later calls are answered before call 1: out of order.
    assert!(matches!(stream.call(2, get("held")).await, Out::Get(_)));
    let duplicate = refusal(stream.call(1, get("held")).await);
    assert_eq!(
        (duplicate.code.as_str(), duplicate.field.as_str()),
        ("invalid_argument", "id"),
        "{duplicate:?}"
    );
    let commit = pb::CommitRequest {
        namespace: "live".into(),
        key: "held".into(),
        token: holder,
        outcome: pb::Outcome::Succeeded as i32,
        response: b"done".to_vec(),
    };
    unary.commit(commit).await.unwrap();
    let (id, result) = stream.next().await;
    assert_eq!(id, 1);
    assert!(
        matches!(
            result,
            Out::Reserve(pb::ReserveResponse {
                outcome: Some(pb::reserve_response::Outcome::Completed(_)),
                ..
            })
        ),
        "{result:?}"
    );
    // Answered, id 1 may be used again.
    assert!(matches!(stream.call(1, get("held")).await, Out::Get(_)));
    drop(stream);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_reads_no_further_request_until_an_answer_drains() {
    let Held { server, mut unary, holder, mut stream } = held("held", Some(2)).await;
    stream.send(1, reserve_waiting("held")).await;
    stream.send(2, reserve_waiting("held")).await;
    stream.send(3, get("held")).await;
    assert!(waiters(&server, 2).await, "calls 1 and 2 wait");
    let release = pb::ReleaseRequest { namespace: "live".into(), key: "held".into(), token: holder };
    unary.release(release).await.unwrap();
    // The release grants call 1; only then is call 3 read, so it sees call 1's grant,
    // never the state before the release. Call 2 waits on.
    let mut answers = [stream.next().await, stream.next().await];
    answers.sort_by_key(|(id, _)| *id);
    assert_eq!((answers[0].0, answers[1].0), (1, 3));
    let token = granted_in(&answers[0].1);
    match &answers[1].1 {
        Out::Get(view) => {
            assert_eq!((view.state, view.token), (pb::State::Pending as i32, token), "{view:?}")
        }
        other => panic!("{other:?}"),
    }
    stream.send(4, commit("held", token, b"done")).await;
    let mut answers = [stream.next().await, stream.next().await];
    answers.sort_by_key(|(id, _)| *id);
    assert_eq!((answers[0].0, answers[1].0), (2, 4));
    assert!(
        matches!(
            &answers[0].1,
            Out::Reserve(pb::ReserveResponse {
                outcome: Some(pb::reserve_response::Outcome::Completed(_)),
                ..
            })
        ),
        "{:?}",
        answers[0]
    );
    drop(stream);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_stream_went_away_is_never_granted() {
    let server = start_with(|c| c.engine.shards = 1).await;
    let mut unary = server.client().await;
    let holder = granted(&unary.reserve(reserve("k")).await.unwrap().into_inner());
    let stream = Stream::open(&server).await;
    stream
        .send(1, Call::Reserve(pb::ReserveRequest { wait_ms: 20_000, lease_ms: 600_000, ..reserve("k") }))
        .await;
    assert!(waiters(&server, 1).await, "the stream's reserve is parked");
    drop(stream);
    assert!(waiters(&server, 0).await, "the server drops it when the stream goes");
    release_and_regrant(&mut unary, holder, "the gone call").await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_takes_its_tenant_from_its_metadata() {
    let server = start_with(|c| {
        c.tenants = vec![
            TenantConfig {
                name: "acme".into(),
                token_sha256: token_sha256("acme-secret"),
                ..Default::default()
            },
            TenantConfig {
                name: "globex".into(),
                token_sha256: token_sha256("globex-secret"),
                ..Default::default()
            },
        ]
    })
    .await;
    let refused = Stream::open_as(&server, Some("wrong")).await.err().expect("refused");
    assert_eq!(refused.code(), Code::Unauthenticated);
    let mut acme = Stream::open_as(&server, Some("acme-secret")).await.unwrap();
    let mut globex = Stream::open_as(&server, Some("globex-secret")).await.unwrap();
    granted_in(&acme.call(1, Call::Reserve(reserve("shared-name"))).await);
    granted_in(&globex.call(1, Call::Reserve(reserve("shared-name"))).await);
    drop((acme, globex));
    server.stop().await;
}

/// A session request with bytes where the contract has strings, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawSessionRequest {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, optional, tag = "2")]
    reserve: Option<RawReserve>,
}

/// A message that does not decode, or is over `server.message_bytes_max`, ends the stream
/// `INVALID_ARGUMENT`, as docs/semantics.md says. (A message over the limit ended it
/// `OUT_OF_RANGE`, tonic's code.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_does_not_decode_ends_the_stream_with_invalid_argument() {
    let server = start_with(|_| {}).await;
    let bad_utf8 = RawReserve { namespace: b"live".to_vec(), key: vec![0xff, 0xfe], ..Default::default() };
    let too_large =
        RawReserve { namespace: b"live".to_vec(), key: vec![b'k'; 300 << 10], ..Default::default() };
    for bad in [bad_utf8, too_large] {
        let status = stream_ended_by(&server, RawSessionRequest { id: 1, reserve: Some(bad) }).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }
    server.stop().await;
}

/// The status that ends a stream whose one message is `bad` (sent raw).
async fn stream_ended_by(server: &Running, bad: RawSessionRequest) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    let codec: tonic_prost::ProstCodec<RawSessionRequest, pb::SessionResponse> =
        tonic_prost::ProstCodec::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/oncegate.v1.Gate/Session");
    // The request stream stays open, so only the server can end the stream.
    let (requests, rx) = mpsc::channel(1);
    requests.send(bad).await.unwrap();
    let mut answers = grpc
        .streaming(Request::new(ReceiverStream::new(rx)), path, codec)
        .await
        .expect("the stream opens")
        .into_inner();
    let status = answers.message().await.expect_err("the stream ends with a status");
    drop(requests);
    status
}

/// A call past its deadline is dropped as a unary call past its own is: answered
/// `unavailable` at once, and a reserve that had not been decided (here, parked behind a
/// holder) is never granted, so a client that gave up on it never holds the key unaware.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_timeout_is_answered_unavailable_and_never_granted() {
    let Held { server, mut unary, holder, mut stream } = held("k", None).await;
    let waiting = pb::ReserveRequest { wait_ms: 20_000, lease_ms: 600_000, ..reserve("k") };
    let request = pb::SessionRequest {
        id: 1,
        call: Some(Call::Reserve(waiting)),
        timeout_ms: 300,
        ..Default::default()
    };
    stream.requests.send(request).await.unwrap();
    let (id, answer) = stream.next().await;
    let refusal = refusal(answer);
    assert_eq!((id, refusal.grpc_code, refusal.code.as_str()), (1, Code::Unavailable as i32, "unavailable"));
    assert!(refusal.message.contains("no answer within 300 ms (the call's timeout_ms)"), "{refusal:?}");
    assert!(waiters(&server, 0).await, "the parked reserve is dropped with its call");
    release_and_regrant(&mut unary, holder, "the timed-out call").await;
    // The stream goes on, and a call that asks for more than the server's request timeout
    // gets the server's.
    let get = pb::SessionRequest { id: 2, call: Some(get("k")), timeout_ms: u64::MAX, ..Default::default() };
    stream.requests.send(get).await.unwrap();
    assert!(matches!(stream.next().await, (2, Out::Get(_))));
    server.stop().await;
}

/// A call's place under `server.requests_in_flight_max` is held while it waits on its
/// shard, and given back when the call is given up: at its deadline, before its refusal is
/// sent, and at its cancel, before the stream reads its next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_place_in_the_servers_limit_is_held_while_it_waits_and_given_back_when_given_up() {
    let Held { server, mut unary, holder, mut stream } =
        held_with("k", |c| c.server.requests_in_flight_max = 1).await;
    let other = || pb::GetRequest { namespace: "live".into(), key: "other".into() };
    let waiting = pb::ReserveRequest { wait_ms: 20_000, ..reserve("k") };
    let request = pb::SessionRequest {
        id: 1,
        call: Some(Call::Reserve(waiting)),
        timeout_ms: 300,
        ..Default::default()
    };
    stream.requests.send(request).await.unwrap();
    assert!(waiters(&server, 1).await, "the stream's reserve is parked");
    let shed = unary.get(other()).await.expect_err("the parked call holds the one place");
    exhausted(&shed, "server.requests_in_flight_max");

    let (id, answer) = stream.next().await;
    assert_eq!((id, refusal(answer).code.as_str()), (1, "unavailable"), "the call's deadline passed");
    unary.get(other()).await.expect("the timed-out call gave its place back");
    assert!(waiters(&server, 0).await, "the parked reserve is dropped with its call");

    stream.send(2, reserve_waiting("k")).await;
    assert!(waiters(&server, 1).await, "the stream's second reserve is parked");
    stream.send(2, Call::Cancel(pb::Cancel {})).await;
    assert!(matches!(stream.call(3, get("k")).await, Out::Get(_)), "the cancelled call gave its place back");
    release_and_regrant(&mut unary, holder, "the calls given up").await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_is_dropped_unanswered_and_its_id_is_free_again() {
    let Held { server, mut unary, holder, mut stream } = held("k", None).await;
    stream.send(1, reserve_waiting("k")).await;
    assert!(waiters(&server, 1).await, "the stream's reserve is parked");
    stream.send(1, Call::Cancel(pb::Cancel {})).await;
    assert!(waiters(&server, 0).await, "the cancel drops it");
    // A cancel of an id not in flight does nothing; the ids are free, and the next answer
    // is the next call's: the cancelled one gets none.
    stream.send(7, Call::Cancel(pb::Cancel {})).await;
    assert!(matches!(stream.call(1, get("k")).await, Out::Get(_)));
    release_and_regrant(&mut unary, holder, "the cancelled call").await;
    server.stop().await;
}

/// The stream's response names its limit of calls in flight, so that a client can keep
/// within it: past it the server holds a call unstarted, and a cancel sent behind that
/// call waits unread until the call can start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_response_names_its_limit_of_calls_in_flight() {
    let server = start_with(|c| c.server.session_calls_in_flight_max = 3).await;
    let (_requests, rx) = mpsc::channel::<pb::SessionRequest>(1);
    let response = server.client().await.session(Request::new(ReceiverStream::new(rx))).await.unwrap();
    let limit = response.metadata().get(oncegate_proto::SESSION_CALLS_IN_FLIGHT_MAX_METADATA);
    assert_eq!(limit.map(|v| v.to_str().unwrap()), Some("3"), "{:?}", response.metadata());
    drop((response, _requests));
    server.stop().await;
}

/// A stream at its limit of calls in flight still hears a cancel: the server reads one
/// request past the limit, and holds a call there unstarted until there is room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_at_its_limit_still_hears_a_cancel() {
    let Held { server, mut unary, holder, mut stream } = held("k", Some(1)).await;
    stream.send(1, reserve_waiting("k")).await;
    assert!(waiters(&server, 1).await, "the stream's reserve is parked");
    stream.send(1, Call::Cancel(pb::Cancel {})).await;
    assert!(waiters(&server, 0).await, "the cancel was read at the limit");
    assert!(matches!(stream.call(2, get("k")).await, Out::Get(_)), "the stream goes on");
    release_and_regrant(&mut unary, holder, "the cancelled call").await;
    server.stop().await;
}
