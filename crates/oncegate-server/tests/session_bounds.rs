//! What a `Session` stream may hold, whatever its client does: clients that never read
//! their answers (an HTTP/2 stream window of 0: the server can send them no byte) keep
//! their tenant's places taken, and a tenant opens at most `tenants[].sessions_max`
//! streams. (The memory they take is measured alone, in `session_memory.rs`.)

use std::time::Duration;

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{TenantConfig, token_sha256};
use pb::session_request::Call;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};

mod common;

use common::{Running, exhausted, gauge, granted, reserve, start_with};

fn tenant(name: &str, edit: impl FnOnce(&mut TenantConfig)) -> TenantConfig {
    let mut config =
        TenantConfig { name: name.into(), token_sha256: token_sha256(name), ..TenantConfig::default() };
    edit(&mut config);
    config
}

fn authorized<T>(message: T, tenant: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {tenant}").parse().unwrap());
    request
}

/// A connection whose client never takes an answer's bytes: every stream's window is 0.
async fn unread_channel(server: &Running) -> Channel {
    Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .initial_stream_window_size(0)
        .connect()
        .await
        .expect("connects")
}

/// Opens a `Session` stream as `tenant` on `channel` and sends `calls` on it; the stream
/// (kept open by the returned sender) is never read.
async fn unread_stream(
    channel: &Channel,
    tenant: &str,
    calls: impl IntoIterator<Item = Call>,
) -> Result<(mpsc::Sender<pb::SessionRequest>, tonic::Streaming<pb::SessionResponse>), tonic::Status> {
    let (requests, rx) = mpsc::channel(1024);
    for (id, call) in calls.into_iter().enumerate() {
        let request =
            pb::SessionRequest { id: id as u64, call: Some(call), timeout_ms: 0, ..Default::default() };
        requests.try_send(request).expect("room for every call");
    }
    let request = authorized(ReceiverStream::new(rx), tenant);
    let answers = GateClient::new(channel.clone()).session(request).await?.into_inner();
    Ok((requests, answers))
}

fn get(key: &str) -> Call {
    Call::Get(pb::GetRequest { namespace: "live".into(), key: key.into() })
}

/// Commits `key` as `tenant` with a response of `bytes`.
async fn committed(server: &Running, tenant: &str, key: &str, bytes: usize) {
    let mut client = server.client().await;
    let reply = client.reserve(authorized(reserve(key), tenant)).await.unwrap().into_inner();
    let commit = pb::CommitRequest {
        namespace: "live".into(),
        key: key.into(),
        token: granted(&reply),
        outcome: pb::Outcome::Succeeded as i32,
        response: vec![b'r'; bytes],
    };
    client.commit(authorized(commit, tenant)).await.unwrap();
}

/// The calls of `rpc` that `tenant` made, answered or refused, as `/metrics` counts them.
async fn calls_counted(server: &Running, rpc: &str, tenant: &str) -> u64 {
    let addr = server.metrics_addr;
    let (_, body) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    let (rpc, tenant) = (format!("rpc=\"{rpc}\""), format!("tenant=\"{tenant}\""));
    body.lines()
        .filter(|line| line.starts_with("oncegate_requests_total{"))
        .filter(|line| line.contains(&rpc) && line.contains(&tenant))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits until `tenant` has made `n` calls of `rpc` (within a minute).
async fn until_counted(server: &Running, rpc: &str, tenant: &str, n: u64) {
    let mut counted = 0;
    for _ in 0..3_000 {
        counted = calls_counted(server, rpc, tenant).await;
        if counted >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{tenant} made {counted} {rpc} calls, not {n}");
}

/// An answer keeps its call's place under the tenant's `requests_in_flight_max` until the
/// transport takes it: a tenant whose streams are not read cannot start more calls than
/// its limit, wherever they are sent. (The place was given back as the engine answered, so
/// a client that never read could have any number of answers made and held, and every
/// place was free again once its stream's calls were answered.) The transport may take
/// one answer into its buffer past a zero window, so one place may be free: a parked
/// reserve takes it, and then a get finds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsent_answer_keeps_its_place_in_the_tenants_calls_in_flight() {
    let server = start_with(|c| {
        c.engine.shards = 1;
        c.tenants = vec![tenant("slow", |t| t.requests_in_flight_max = 4)];
    })
    .await;
    committed(&server, "slow", "big", 64 << 10).await;
    let mut unary = server.client().await;
    unary.reserve(authorized(reserve("held"), "slow")).await.expect("held is free");
    let channel = unread_channel(&server).await;
    let stream = unread_stream(&channel, "slow", (0..64).map(|_| get("big"))).await.expect("opens");
    until_counted(&server, "get", "slow", 64).await;

    let waiting = authorized(pb::ReserveRequest { wait_ms: 20_000, ..reserve("held") }, "slow");
    let mut parked = server.client().await;
    let parked = tokio::spawn(async move { parked.reserve(waiting).await });
    // It parks (a place was free) or is refused (none was): either way, no place is left.
    let mut settled = false;
    for _ in 0..3_000 {
        settled = parked.is_finished() || server.engine.stats()[0].waiters == 1;
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(settled, "the waiting reserve neither parked nor was refused");
    let get = authorized(pb::GetRequest { namespace: "live".into(), key: "big".into() }, "slow");
    let shed = unary.get(get).await.expect_err("unsent answers hold the tenant's places");
    exhausted(&shed, "tenants[].requests_in_flight_max");

    parked.abort();
    drop((stream, channel));
    for _ in 0..3_000 {
        let get = authorized(pb::GetRequest { namespace: "live".into(), key: "big".into() }, "slow");
        if unary.get(get).await.is_ok() {
            server.stop().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the places were not given back when the stream went");
}

/// A stream whose unsent answers reach `server.session_unsent_bytes_max` starts no new
/// call: the next one it reads is held (`oncegate_session_calls_held`) and nothing after
/// it is read. Gets of a 64 KiB answer are sent one at a time, each after the last is
/// answered or held; the transport takes an answer or two past a zero window, and the
/// next fills the budget. (Without the byte budget no call was held: only the stream's
/// 256 calls in flight and its tenant's places bounded what an unread stream held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_its_unsent_bytes_starts_no_call() {
    let server = start_with(|c| {
        c.engine.shards = 1;
        c.server.session_unsent_bytes_max = 64 << 10;
        c.tenants = vec![tenant("budget", |_| {})];
    })
    .await;
    committed(&server, "budget", "big", 64 << 10).await;
    let channel = unread_channel(&server).await;
    let (requests, answers) = unread_stream(&channel, "budget", []).await.expect("opens");
    let mut answered = 0;
    for id in 0..16 {
        let request = pb::SessionRequest { id, call: Some(get("big")), timeout_ms: 0, ..Default::default() };
        requests.try_send(request).expect("room for the call");
        let mut held = false;
        for _ in 0..3_000 {
            held = gauge(&server, "oncegate_session_calls_held").await >= 1.0;
            answered = calls_counted(&server, "get", "budget").await;
            if held || answered > id {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if held {
            assert!(answered <= 4, "{answered} answers of 64 KiB were made before one was held");
            let unsent = gauge(&server, "oncegate_session_unsent_bytes").await;
            assert!(unsent >= f64::from(64 << 10), "held at {unsent} unsent bytes");
            drop((requests, answers, channel));
            server.stop().await;
            return;
        }
        assert_eq!(answered, id + 1, "get {id} was neither answered nor held");
    }
    panic!("16 answers of 64 KiB were made and none of the stream's calls was held");
}

/// A tenant opens at most `tenants[].sessions_max` streams; one more is refused naming
/// the limit, and a stream that ends gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_opens_at_most_sessions_max_streams() {
    let server = start_with(|c| {
        c.tenants = vec![tenant("busy", |t| t.sessions_max = 2), tenant("other", |t| t.sessions_max = 1)];
    })
    .await;
    let channel = server.channel().await;
    let first = unread_stream(&channel, "busy", []).await.expect("the first opens");
    let second = unread_stream(&channel, "busy", []).await.expect("the second opens");
    let third = unread_stream(&channel, "busy", []).await.expect_err("the third is refused");
    exhausted(&third, "tenants[].sessions_max");
    let other = unread_stream(&channel, "other", []).await.expect("another tenant's stream opens");

    drop(first);
    for _ in 0..3_000 {
        if let Ok(again) = unread_stream(&channel, "busy", []).await {
            drop((again, second, other, channel));
            server.stop().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the ended stream's place was not given back");
}
