//! The real server on port 0, driven by the generated tonic client: every outcome, every
//! error mapping, auth, health, reflection, message limits, load shedding and graceful
//! shutdown.

use oncegate_proto::v1 as pb;
use oncegate_server::{FIELD_METADATA, TenantConfig, token_sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

mod common;

use common::{T0, config_in, granted, refused, reserve, start_in, start_with};

fn commit(key: &str, token: u64, response: &[u8]) -> pb::CommitRequest {
    pb::CommitRequest {
        namespace: "live".into(),
        key: key.into(),
        token,
        outcome: pb::Outcome::Succeeded as i32,
        response: response.to_vec(),
    }
}

/// Reads a health watch until it reports `status`.
async fn watch_until(
    watch: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    status: tonic_health::pb::health_check_response::ServingStatus,
) {
    while watch.message().await.unwrap().expect("a status").status != status as i32 {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_over_grpc() {
    let server = start_with(|_| {}).await;
    let mut client = server.client().await;

    let first = client.reserve(reserve("fill-1")).await.unwrap().into_inner();
    assert_eq!(first.key, "fill-1");
    let token = granted(&first);
    match client.reserve(reserve("fill-1")).await.unwrap().into_inner().outcome {
        Some(pb::reserve_response::Outcome::InProgress(p)) => {
            assert_eq!((p.attempt, p.retry_after_ms), (1, 1_000))
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    let mismatch = pb::ReserveRequest { fingerprint: b"other".to_vec(), ..reserve("fill-1") };
    assert!(matches!(
        client.reserve(mismatch).await.unwrap().into_inner().outcome,
        Some(pb::reserve_response::Outcome::Mismatch(_))
    ));
    let renewed = client
        .heartbeat(pb::HeartbeatRequest {
            namespace: "live".into(),
            key: "fill-1".into(),
            token,
            lease_ms: 5_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(renewed.lease_until_ms, T0 + 5_000);
    let committed = client.commit(commit("fill-1", token, b"order A-77")).await.unwrap().into_inner();
    assert_eq!(committed.expires_at_ms, T0 + 24 * 3_600_000);
    match client.reserve(reserve("fill-1")).await.unwrap().into_inner().outcome {
        Some(pb::reserve_response::Outcome::Completed(c)) => {
            assert_eq!(
                (c.token, c.outcome, c.response.as_slice()),
                (token, pb::Outcome::Succeeded as i32, &b"order A-77"[..])
            );
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    let view = client
        .get(pb::GetRequest { namespace: "live".into(), key: "fill-1".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (view.state, view.token, view.response.as_slice()),
        (pb::State::Completed as i32, token, &b"order A-77"[..])
    );

    let other = granted(&client.reserve(reserve("other")).await.unwrap().into_inner());
    client
        .release(pb::ReleaseRequest { namespace: "live".into(), key: "other".into(), token: other })
        .await
        .unwrap();
    let view = client
        .get(pb::GetRequest { namespace: "live".into(), key: "other".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(view.state, pb::State::Free as i32);

    let derived = pb::ReserveRequest {
        namespace: "live".into(),
        key_parts: vec!["trade".into(), "BTCUSDT".into(), "buy".into()],
        bucket_ms: 60_000,
        ..Default::default()
    };
    let response = client.reserve(derived).await.unwrap().into_inner();
    assert_eq!(response.key, format!("trade:BTCUSDT:buy::{}", T0 / 60_000));
    granted(&response);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_maps_to_its_status() {
    let server = start_with(|_| {}).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(reserve("k")).await.unwrap().into_inner());

    let stale = client.commit(commit("k", token + 100, b"")).await.unwrap_err();
    refused(&stale, Code::FailedPrecondition, "lease_lost");
    let missing = client.commit(commit("nothing", 1, b"")).await.unwrap_err();
    refused(&missing, Code::NotFound, "not_found");
    client.commit(commit("k", token, b"r")).await.unwrap();
    let failed = pb::CommitRequest { outcome: pb::Outcome::Failed as i32, ..commit("k", token, b"r") };
    refused(&client.commit(failed).await.unwrap_err(), Code::FailedPrecondition, "conflict");
    let release = pb::ReleaseRequest { namespace: "live".into(), key: "k".into(), token };
    refused(&client.release(release).await.unwrap_err(), Code::FailedPrecondition, "already_completed");

    let bad: Vec<(tonic::Status, &str)> = vec![
        (client.commit(commit("k", 0, b"")).await.unwrap_err(), "token"),
        (
            client.commit(pb::CommitRequest { outcome: 0, ..commit("k", token, b"") }).await.unwrap_err(),
            "outcome",
        ),
        (
            client.commit(pb::CommitRequest { outcome: 7, ..commit("k", token, b"") }).await.unwrap_err(),
            "outcome",
        ),
        (client.reserve(reserve(&"k".repeat(513))).await.unwrap_err(), "key"),
        (
            client.reserve(pb::ReserveRequest { namespace: "".into(), ..reserve("k") }).await.unwrap_err(),
            "namespace",
        ),
        (client.reserve(pb::ReserveRequest { ttl_ms: 1, ..reserve("k") }).await.unwrap_err(), "ttl_ms"),
        (client.commit(commit("k", token, &vec![0; 65 * 1024])).await.unwrap_err(), "response"),
    ];
    for (status, field) in bad {
        refused(&status, Code::InvalidArgument, "invalid_argument");
        assert_eq!(
            status.metadata().get(FIELD_METADATA).and_then(|v| v.to_str().ok()),
            Some(field),
            "{status:?}"
        );
        assert!(status.message().contains(field), "{status:?}");
    }

    server.faults.fail_commits(1);
    let down = client.reserve(reserve("any")).await.unwrap_err();
    refused(&down, Code::Unavailable, "unavailable");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_is_shed_with_resource_exhausted() {
    let server = start_with(|c| {
        c.server.requests_in_flight_max = 1;
        c.engine.shards = 1;
    })
    .await;
    let mut client = server.client().await;
    server.faults.close_gate();
    let mut held_client = client.clone();
    let held = tokio::spawn(async move { held_client.reserve(reserve("held")).await });
    let faults = server.faults.clone();
    tokio::task::spawn_blocking(move || faults.wait_held(1)).await.unwrap();
    let shed = client.reserve(reserve("shed")).await.unwrap_err();
    refused(&shed, Code::ResourceExhausted, "resource_exhausted");
    assert!(shed.message().contains("requests_in_flight_max is 1"), "{shed:?}");
    server.faults.open_gate();
    granted(&held.await.unwrap().unwrap().into_inner());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_and_the_server_stays_up() {
    let server = start_with(|c| c.server.message_bytes_max = 128 * 1024).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(reserve("big")).await.unwrap().into_inner());
    let status = client.commit(commit("big", token, &vec![1; 200 * 1024])).await.unwrap_err();
    assert!(matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted), "{status:?}");
    client.commit(commit("big", token, b"small")).await.unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_authenticate_and_never_share_keys() {
    let server = start_with(|c| {
        c.tenants = vec![
            TenantConfig {
                name: "acme".into(),
                token_sha256: token_sha256("acme-secret"),
                ..TenantConfig::default()
            },
            TenantConfig {
                name: "globex".into(),
                token_sha256: token_sha256("globex-secret"),
                ..TenantConfig::default()
            },
        ];
    })
    .await;
    let mut client = server.client().await;
    let with = |token: &str, message: pb::ReserveRequest| {
        let mut request = Request::new(message);
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        request
    };
    refused(&client.reserve(reserve("k")).await.unwrap_err(), Code::Unauthenticated, "unauthenticated");
    refused(
        &client.reserve(with("wrong", reserve("k"))).await.unwrap_err(),
        Code::Unauthenticated,
        "unauthenticated",
    );
    let mut basic = Request::new(reserve("k"));
    basic.metadata_mut().insert("authorization", "Basic YWNtZQ==".parse().unwrap());
    refused(&client.reserve(basic).await.unwrap_err(), Code::Unauthenticated, "unauthenticated");

    // Both tenants reserve the same namespace and key: both are granted.
    granted(&client.reserve(with("acme-secret", reserve("shared"))).await.unwrap().into_inner());
    granted(&client.reserve(with("globex-secret", reserve("shared"))).await.unwrap().into_inner());
    let again = client.reserve(with("acme-secret", reserve("shared"))).await.unwrap().into_inner();
    assert!(matches!(again.outcome, Some(pb::reserve_response::Outcome::InProgress(_))));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_shards() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let server = start_with(|_| {}).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "oncegate.v1.Gate"] {
        let mut watch =
            health.watch(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        // The reporter publishes its first status shortly after start; wait for SERVING.
        watch_until(&mut watch, ServingStatus::Serving).await;
    }
    let mut watch =
        health.watch(HealthCheckRequest { service: "oncegate.v1.Gate".into() }).await.unwrap().into_inner();
    server.faults.fail_commits(1);
    let mut client = server.client().await;
    refused(&client.reserve(reserve("x")).await.unwrap_err(), Code::Unavailable, "unavailable");
    watch_until(&mut watch, ServingStatus::NotServing).await;
    assert!(
        tokio::task::spawn_blocking({
            let engine = server.engine.clone();
            move || {
                (0..2).all(|s| {
                    engine.reopen_shard(s).unwrap()
                        || engine.shard_states()[s as usize] == oncegate_engine::ShardState::Serving
                })
            }
        })
        .await
        .unwrap()
    );
    watch_until(&mut watch, ServingStatus::Serving).await;
    drop((watch, health, client));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_reports_not_serving_and_is_not_held_open_by_watchers() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let server = start_with(|c| c.server.shutdown_grace_ms = 100).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap();
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest { service: "oncegate.v1.Gate".into() })
        .await
        .unwrap()
        .into_inner();
    let stopping = tokio::spawn(server.stop());
    // The watcher hears NOT_SERVING (or its stream ends), and the stop completes anyway.
    loop {
        match watch.message().await {
            Ok(Some(m)) if m.status == ServingStatus::NotServing as i32 => break,
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => break,
        }
    }
    stopping.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_gate_in_v1_and_v1alpha() {
    let server = start_with(|_| {}).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap();
    {
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut client = ServerReflectionClient::new(channel.clone());
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream =
            client.server_reflection_info(tokio_stream::iter(vec![request])).await.unwrap().into_inner();
        let response = stream.message().await.unwrap().expect("an answer");
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("{response:?}")
        };
        let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"oncegate.v1.Gate") && names.contains(&"grpc.health.v1.Health"), "{names:?}");
    }
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let mut client = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol("oncegate.v1.Gate".into())),
        };
        let mut stream =
            client.server_reflection_info(tokio_stream::iter(vec![request])).await.unwrap().into_inner();
        let response = stream.message().await.unwrap().expect("an answer");
        let Some(MessageResponse::FileDescriptorResponse(files)) = response.message_response else {
            panic!("{response:?}")
        };
        assert!(!files.file_descriptor_proto.is_empty());
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_keeps_acknowledged_data() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path());
    let server = start_in(config.clone(), None).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(reserve("kept")).await.unwrap().into_inner());
    client.commit(commit("kept", token, b"durable")).await.unwrap();
    let engine = server.stop().await;
    tokio::task::spawn_blocking(move || engine.shutdown()).await.unwrap();

    let server = start_in(config, None).await;
    let mut client = server.client().await;
    let view = client
        .get(pb::GetRequest { namespace: "live".into(), key: "kept".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((view.state, view.response.as_slice()), (pb::State::Completed as i32, &b"durable"[..]));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_gave_up_is_never_granted() {
    let server = start_with(|c| c.engine.shards = 1).await;
    let mut client = server.client().await;
    let a = granted(&client.reserve(reserve("k")).await.unwrap().into_inner());
    // B waits up to 20 s for a 10 min lease, but its own deadline is 2 s: long enough to be
    // seen parked on a slow machine (after its deadline the count is back to 0).
    let mut b = Request::new(pb::ReserveRequest { wait_ms: 20_000, lease_ms: 600_000, ..reserve("k") });
    b.set_timeout(std::time::Duration::from_millis(2_000));
    let b = tokio::spawn({
        let mut client = client.clone();
        async move { client.reserve(b).await }
    });
    let waiters = |n: u64| {
        let engine = server.engine.clone();
        tokio::task::spawn_blocking(move || {
            engine.wait_stats(0, std::time::Duration::from_secs(10), |s| s.waiters == n)
        })
    };
    assert!(waiters(1).await.unwrap(), "B is parked");
    let gave_up = b.await.unwrap().unwrap_err();
    assert!(matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled), "{gave_up:?}");
    assert!(waiters(0).await.unwrap(), "the server drops B when its caller goes");
    client.release(pb::ReleaseRequest { namespace: "live".into(), key: "k".into(), token: a }).await.unwrap();
    let c = client.reserve(reserve("k")).await.unwrap().into_inner();
    match c.outcome {
        Some(pb::reserve_response::Outcome::Granted(g)) => {
            assert_eq!(g.previous, pb::Previous::None as i32, "nobody held the key in between")
        }
        other => panic!("the gone B must not hold the key: {other:?}"),
    }
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_shard_fails_health_and_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let server = start_with(|_| {}).await;
    let mut health = HealthClient::new(server.channel().await);
    let mut watch =
        health.watch(HealthCheckRequest { service: "oncegate.v1.Gate".into() }).await.unwrap().into_inner();
    server.faults.panic_next_batch();
    let mut client = server.client().await;
    refused(&client.reserve(reserve("x")).await.unwrap_err(), Code::Unavailable, "unavailable");
    watch_until(&mut watch, ServingStatus::NotServing).await;
    let addr = server.metrics_addr;
    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz")).await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("panicked"), "{body}");
    drop((watch, health, client));
    server.stop().await;
}
