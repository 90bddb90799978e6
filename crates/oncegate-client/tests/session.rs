//! The client's `Session` stream against the real server (in process, port 0): a call
//! whose caller goes before its answer is taken back.

#[path = "../../oncegate-server/tests/common/mod.rs"]
mod common;

use oncegate_client::{Client, Gate, GateError, ReserveRequest};
use oncegate_core::{Code, Previous, ReserveReply};

fn reserve(key: &str) -> ReserveRequest {
    ReserveRequest {
        namespace: "live".into(),
        key: key.into(),
        lease_ms: 600_000,
        ..ReserveRequest::default()
    }
}

/// A reserve whose caller was dropped while its call was in flight on the stream is never
/// granted: the client sends a cancel behind it, and the server drops the call as it drops
/// a unary call whose client reset it. Before, the call went on, and its shard, deciding
/// it later, granted the key to nobody and held it for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_whose_caller_went_is_taken_back_and_never_granted() {
    let server = common::start_with(|c| c.engine.shards = 1).await;
    let client = Client::connect(format!("http://{}", server.addr)).await.unwrap();
    // The stream is open before the shard is held.
    client.reserve(reserve("warm")).await.unwrap();

    server.faults.close_gate();
    let gone = tokio::spawn({
        let client = client.clone();
        async move { client.reserve(reserve("k")).await }
    });
    let faults = server.faults.clone();
    tokio::task::spawn_blocking(move || faults.wait_held(1)).await.unwrap();
    // The reserve is in the batch its shard holds; its caller goes.
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    // A call sent after the cancel, refused before it reaches a shard: once its answer is
    // here, the server has read the cancel (a stream's requests are read in order).
    let invalid = client.reserve(ReserveRequest { namespace: String::new(), ..reserve("k") }).await;
    assert_eq!(invalid.unwrap_err().code(), Code::InvalidArgument);
    server.faults.open_gate();

    match client.reserve(reserve("k")).await.unwrap().reply {
        ReserveReply::Granted { previous, .. } => assert_eq!(previous, Previous::None, "nobody held the key"),
        other => panic!("the cancelled call must not hold the key: {other:?}"),
    }
    // Dropping the client ends its stream, which the server's graceful stop waits for.
    drop(client);
    server.stop().await;
}

/// A client refused a `Session` stream because its tenant has `tenants[].sessions_max`
/// open sends unary calls instead: heartbeats and commits must never be refused for it, or
/// a lease would lapse and the work be granted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refused_a_stream_for_its_tenants_limit_sends_unary_calls() {
    let tenant = oncegate_server::TenantConfig {
        name: "acme".into(),
        token_sha256: oncegate_server::token_sha256("acme-secret"),
        sessions_max: 1,
        ..oncegate_server::TenantConfig::default()
    };
    let server = common::start_with(move |c| c.tenants = vec![tenant]).await;
    let connect = || Client::builder(format!("http://{}", server.addr)).token("acme-secret").connect();
    let (first, second) = (connect().await.unwrap(), connect().await.unwrap());
    first.reserve(reserve("first")).await.expect("the first client's stream opens");
    let granted = second.reserve(reserve("second")).await.expect("the second client goes unary");
    let ReserveReply::Granted { token, .. } = granted.reply else { panic!("{granted:?}") };
    let commit = oncegate_client::CommitRequest {
        namespace: "live".into(),
        key: "second".into(),
        token,
        outcome: oncegate_core::Outcome::Succeeded,
        response: b"done".to_vec(),
    };
    second.commit(commit).await.expect("its commit is served");
    drop((first, second));
    server.stop().await;
}
