//! Clients of the `Session` stream that never read their answers, for the tests of what
//! a stream may hold.

use std::time::Duration;

use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{TenantConfig, token_sha256};
use pb::session_request::Call;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};

use super::{Running, granted, reserve};

pub fn tenant(name: &str, edit: impl FnOnce(&mut TenantConfig)) -> TenantConfig {
    let mut config =
        TenantConfig { name: name.into(), token_sha256: token_sha256(name), ..TenantConfig::default() };
    edit(&mut config);
    config
}

pub fn authorized<T>(message: T, tenant: &str) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {tenant}").parse().unwrap());
    request
}

/// A connection whose client never takes an answer's bytes: every stream's window is 0.
pub async fn unread_channel(server: &Running) -> Channel {
    Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .initial_stream_window_size(0)
        .connect()
        .await
        .expect("connects")
}

/// Opens a `Session` stream as `tenant` on `channel` and sends `calls` on it; the stream
/// (kept open by the returned sender) is never read.
pub async fn unread_stream(
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

pub fn get(key: &str) -> Call {
    Call::Get(pb::GetRequest { namespace: "live".into(), key: key.into() })
}

/// Commits `key` as `tenant` with a response of `bytes`.
pub async fn committed(server: &Running, tenant: &str, key: &str, bytes: usize) {
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
pub async fn calls_counted(server: &Running, rpc: &str, tenant: &str) -> u64 {
    let addr = server.metrics_addr;
    let (_, body) = tokio::task::spawn_blocking(move || super::http_get(addr, "/metrics")).await.unwrap();
    let (rpc, tenant) = (format!("rpc=\"{rpc}\""), format!("tenant=\"{tenant}\""));
    body.lines()
        .filter(|line| line.starts_with("oncegate_requests_total{"))
        .filter(|line| line.contains(&rpc) && line.contains(&tenant))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits until `tenant` has made `n` calls of `rpc` (within a minute).
pub async fn until_counted(server: &Running, rpc: &str, tenant: &str, n: u64) {
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
