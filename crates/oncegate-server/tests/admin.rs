//! The Admin service: its own token, inspect, shard statistics, force-release and purge
//! (the next reserve is granted with a greater token), reopen after a fault.

mod common;

use common::{Running, T0, granted, start_in};
use oncegate_engine::EngineConfig;
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::admin_client::AdminClient;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{AdminConfig, Config, TenantConfig, TokenSha256, token_sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

fn with_token<T>(token: &str, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

fn config(dir: &std::path::Path, admin: bool) -> Config {
    Config {
        engine: EngineConfig {
            data_dir: dir.to_owned(),
            reopen_backoff_ms_min: 60_000,
            reopen_backoff_ms_max: 60_000,
            ..EngineConfig::default()
        },
        tenants: vec![TenantConfig {
            name: "acme".into(),
            token_sha256: token_sha256("acme-secret"),
            ..TenantConfig::default()
        }],
        admin: AdminConfig {
            token_sha256: if admin { token_sha256("admin-secret") } else { TokenSha256::Unset },
        },
        ..Config::default()
    }
}

fn key(name: &str, reason: &str) -> pb::AdminKeyRequest {
    pb::AdminKeyRequest {
        tenant: "acme".into(),
        namespace: "live".into(),
        key: name.into(),
        reason: reason.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_need_the_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(config(dir.path(), true), Some(dir)).await;
    let mut admin = AdminClient::new(server.channel().await);
    let refused = admin.shard_stats(pb::ShardStatsRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    let tenant_token =
        admin.shard_stats(with_token("acme-secret", pb::ShardStatsRequest {})).await.unwrap_err();
    assert_eq!(tenant_token.code(), Code::Unauthenticated, "a tenant's token is not an admin token");
    let stats =
        admin.shard_stats(with_token("admin-secret", pb::ShardStatsRequest {})).await.unwrap().into_inner();
    assert_eq!(stats.shards.len(), 2);
    assert!(stats.shards.iter().all(|s| s.state == "serving"));
    drop(admin);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_the_service_is_closed_once_there_are_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(config(dir.path(), false), Some(dir)).await;
    let mut admin = AdminClient::new(server.channel().await);
    let refused = admin.shard_stats(with_token("anything", pb::ShardStatsRequest {})).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert!(refused.message().contains("admin.token_sha256"), "{refused:?}");
    drop(admin);
    server.stop().await;
}

/// The tenant's reserve of `name`, with fingerprint `fp`.
fn reserve(name: &str) -> Request<pb::ReserveRequest> {
    let request = pb::ReserveRequest {
        namespace: "live".into(),
        key: name.into(),
        fingerprint: b"fp".to_vec(),
        ..Default::default()
    };
    with_token("acme-secret", request)
}

/// Reserves `name` as the tenant; the token of its grant.
async fn reserve_granted(gate: &mut GateClient<Channel>, name: &str) -> u64 {
    granted(&gate.reserve(reserve(name)).await.unwrap().into_inner())
}

/// Inspects the tenant's key `name` with the admin token.
async fn inspect(admin: &mut AdminClient<Channel>, name: &str) -> pb::InspectResponse {
    let request = pb::InspectRequest { tenant: "acme".into(), namespace: "live".into(), key: name.into() };
    admin.inspect(with_token("admin-secret", request)).await.unwrap().into_inner()
}

/// Inspect shows the pending grant `first`: its fingerprint, expiry and one transition.
async fn inspect_shows_the_pending_grant(admin: &mut AdminClient<Channel>, first: u64) {
    let view = inspect(admin, "stuck").await;
    assert_eq!(
        (view.state, view.token, view.fingerprint.as_slice()),
        (pb::State::Pending as i32, first, &b"fp"[..])
    );
    assert_eq!(view.expires_at_ms, T0 + 24 * 3_600_000);
    assert_eq!(view.history.len(), 1);
    assert_eq!(view.history[0].kind, pb::TransitionKind::TransitionGranted as i32);
}

/// Force-release needs a reason, then removes the pending grant `first`.
async fn force_release_the_pending_key(admin: &mut AdminClient<Channel>, first: u64) {
    let no_reason = admin.force_release(with_token("admin-secret", key("stuck", " "))).await.unwrap_err();
    assert_eq!(no_reason.code(), Code::InvalidArgument);
    let removed = admin
        .force_release(with_token("admin-secret", key("stuck", "worker host died")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((removed.previous, removed.token), (pb::State::Pending as i32, first));
}

/// Commits the grant `token` of `stuck` as failed.
async fn commit_failed(gate: &mut GateClient<Channel>, token: u64) {
    let request = pb::CommitRequest {
        namespace: "live".into(),
        key: "stuck".into(),
        token,
        outcome: pb::Outcome::Failed as i32,
        response: b"declined".to_vec(),
    };
    gate.commit(with_token("acme-secret", request)).await.unwrap();
}

/// The history holds only the grant `second` and its commit.
async fn the_history_starts_again(admin: &mut AdminClient<Channel>, second: u64) {
    let view = inspect(admin, "stuck").await;
    let kinds: Vec<i32> = view.history.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [pb::TransitionKind::TransitionGranted as i32, pb::TransitionKind::TransitionCommitted as i32],
        "the history starts again after a force-release"
    );
    assert_eq!(view.history[1].token, second);
}

/// The completed key (grant `second`) cannot be force-released but is purged.
async fn purge_the_completed_key(admin: &mut AdminClient<Channel>, second: u64) {
    let refused = admin.force_release(with_token("admin-secret", key("stuck", "retry"))).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "a completed key is purged, not released");
    let purged = admin
        .purge(with_token("admin-secret", key("stuck", "customer asked to retry")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((purged.previous, purged.token), (pb::State::Completed as i32, second));
}

/// A failed store commit refuses the reserve; both shards reopen; shard 9 is refused.
async fn fail_and_reopen_the_shards(
    server: &Running,
    gate: &mut GateClient<Channel>,
    admin: &mut AdminClient<Channel>,
) {
    server.faults.fail_commits(1);
    assert_eq!(gate.reserve(reserve("a")).await.unwrap_err().code(), Code::Unavailable);
    for shard in 0..2 {
        let reopened =
            admin.reopen_shard(with_token("admin-secret", pb::ReopenShardRequest { shard })).await.unwrap();
        assert!(reopened.into_inner().serving);
    }
    let out_of_range = admin
        .reopen_shard(with_token("admin-secret", pb::ReopenShardRequest { shard: 9 }))
        .await
        .unwrap_err();
    assert_eq!(out_of_range.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_force_release_and_purge() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(config(dir.path(), true), Some(dir)).await;
    let mut admin = AdminClient::new(server.channel().await);
    let mut gate = server.client().await;

    let first = reserve_granted(&mut gate, "stuck").await;
    inspect_shows_the_pending_grant(&mut admin, first).await;
    force_release_the_pending_key(&mut admin, first).await;
    let second = reserve_granted(&mut gate, "stuck").await;
    assert!(second > first, "the next grant has a greater token: {second} > {first}");

    commit_failed(&mut gate, second).await;
    the_history_starts_again(&mut admin, second).await;
    purge_the_completed_key(&mut admin, second).await;
    let third = reserve_granted(&mut gate, "stuck").await;
    assert!(third > second);
    let missing = admin.purge(with_token("admin-secret", key("never", "typo"))).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    fail_and_reopen_the_shards(&server, &mut gate, &mut admin).await;
    drop((admin, gate));
    server.stop().await;
}

/// A failed sync halts its shard until the process restarts: calls on it are answered
/// `UNAVAILABLE` saying so, `/readyz` fails naming the state, the shard statistics say a
/// restart is required, and `ReopenShard` is refused with that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sync_halts_the_shard_until_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(config(dir.path(), true), None).await;
    let mut gate = server.client().await;
    let mut admin = AdminClient::new(server.channel().await);
    let reserve = |name: &str| {
        let request = pb::ReserveRequest { namespace: "live".into(), key: name.into(), ..Default::default() };
        with_token("acme-secret", request)
    };
    server.faults.fail_syncs(1);
    let failed = gate.reserve(reserve("a")).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    let again = gate.reserve(reserve("a")).await.unwrap_err();
    assert!(again.message().contains("restart required"), "{again:?}");
    let shards = admin.shard_stats(with_token("admin-secret", pb::ShardStatsRequest {})).await.unwrap();
    let halted: Vec<_> = shards.into_inner().shards.into_iter().filter(|s| s.state == "halted").collect();
    assert_eq!(halted.len(), 1, "one shard halted");
    assert!(halted[0].last_error.contains("restart required"), "{:?}", halted[0]);
    let shard = halted[0].shard;
    let refused =
        admin.reopen_shard(with_token("admin-secret", pb::ReopenShardRequest { shard })).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(refused.message().contains("restart required"), "{refused:?}");
    let addr = server.metrics_addr;
    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz")).await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("halted"), "{body}");
    drop((admin, gate));
    server.stop().await;
}

/// `AddShards` streams its progress and ends with a summary while Gate calls go on over
/// the same server; keys written before answer the same after; a total below the current
/// count is refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_shards_streams_progress_while_calls_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), true);
    config.engine.slot_moves_per_second_max = 0;
    let server = start_in(config, Some(dir)).await;
    let mut admin = AdminClient::new(server.channel().await);
    let mut gate = server.client().await;
    let reserve = |name: String| {
        with_token(
            "acme-secret",
            pb::ReserveRequest { namespace: "live".into(), key: name, ..Default::default() },
        )
    };
    let mut tokens = Vec::new();
    for i in 0..40 {
        tokens.push(granted(&gate.reserve(reserve(format!("before-{i}"))).await.unwrap().into_inner()));
    }

    let refused = admin
        .add_shards(with_token("admin-secret", pb::AddShardsRequest { shards_total: 1 }))
        .await
        .expect_err("shards are never removed");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(refused.metadata().get(oncegate_proto::FIELD_METADATA).unwrap(), "shards_total");

    let mut stream = admin
        .add_shards(with_token("admin-secret", pb::AddShardsRequest { shards_total: 4 }))
        .await
        .expect("started")
        .into_inner();
    // Calls made while the slots move are answered like any other.
    let mut during = 0;
    let last = loop {
        let progress = stream.message().await.expect("no error").expect("a last message");
        if progress.done {
            break progress;
        }
        assert_eq!(progress.slots_total, 8_192);
        granted(&gate.reserve(reserve(format!("during-{during}"))).await.unwrap().into_inner());
        during += 1;
    };
    assert_eq!((last.slots_moved, last.shards_before), (8_192, 2), "{last:?}");
    assert!(during > 0, "progress was streamed");
    for (i, token) in tokens.iter().enumerate() {
        let name = format!("before-{i}");
        let again = gate.reserve(reserve(name.clone())).await.unwrap().into_inner();
        assert!(
            matches!(again.outcome, Some(pb::reserve_response::Outcome::InProgress(_))),
            "{name}: {again:?}"
        );
        let inspect = pb::InspectRequest { tenant: "acme".into(), namespace: "live".into(), key: name };
        let record = admin.inspect(with_token("admin-secret", inspect)).await.unwrap().into_inner();
        assert_eq!(record.token, *token);
    }
    let stats =
        admin.shard_stats(with_token("admin-secret", pb::ShardStatsRequest {})).await.unwrap().into_inner();
    let slots: Vec<u32> = stats.shards.iter().map(|s| s.slots).collect();
    assert_eq!(slots, vec![4_096; 4]);
    assert_eq!(stats.moving, None);
}
