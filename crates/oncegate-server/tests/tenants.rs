//! Per-tenant fairness through the real server: a tenant over each of its limits (calls
//! in flight, waiting reserves, request rate, records stored per shard) is refused `RESOURCE_EXHAUSTED` with the
//! `oncegate-limit` trailer naming the limit, while another tenant is served normally,
//! and the tenant's own heartbeats, commits and releases still go through.

mod common;

use std::time::Duration;

use common::{Running, exhausted, granted, reserve, start_with};
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{TenantConfig, token_sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

/// A tenant named `name` whose token is `name`, with `edit` applied to its limits.
fn tenant(name: &str, edit: impl FnOnce(&mut TenantConfig)) -> TenantConfig {
    let mut tenant =
        TenantConfig { name: name.into(), token_sha256: token_sha256(name), ..TenantConfig::default() };
    edit(&mut tenant);
    tenant
}

/// `acme` limited by `edit`, `globex` with the defaults; one shard, so that waiters are
/// counted in one place.
async fn two_tenants(edit: impl FnOnce(&mut TenantConfig)) -> Running {
    let acme = tenant("acme", edit);
    start_with(move |c| {
        c.engine.shards = 1;
        c.tenants = vec![acme, tenant("globex", |_| {})];
    })
    .await
}

fn as_tenant<T>(name: &str, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {name}").parse().unwrap());
    request
}

fn waiting(key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest { wait_ms: 20_000, ..reserve(key) }
}

/// Parks a waiting reserve of `tenant` on `key` (held by a grant already) and returns
/// once the shard holds `waiters` waiters.
async fn park(
    server: &Running,
    client: &GateClient<Channel>,
    tenant: &str,
    key: &str,
    waiters: u64,
) -> tokio::task::JoinHandle<Result<tonic::Response<pb::ReserveResponse>, tonic::Status>> {
    let mut client = client.clone();
    let request = as_tenant(tenant, waiting(key));
    let parked = tokio::spawn(async move { client.reserve(request).await });
    let engine = server.engine.clone();
    let seen = tokio::task::spawn_blocking(move || {
        engine.wait_stats(0, Duration::from_secs(10), |s| s.waiters == waiters)
    });
    assert!(seen.await.unwrap(), "{waiters} waiters parked");
    parked
}

/// Releases `key` of `tenant` through the gate: a call that ends admitted work, which no
/// tenant limit refuses.
async fn release(client: &mut GateClient<Channel>, tenant: &str, key: &str, token: u64) {
    let request = pb::ReleaseRequest { namespace: "live".into(), key: key.into(), token };
    client.release(as_tenant(tenant, request)).await.unwrap();
}

fn heartbeat(key: &str, token: u64) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest { namespace: "live".into(), key: key.into(), token, lease_ms: 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_in_flight_limit_is_refused_while_another_is_served() {
    let server = two_tenants(|t| t.requests_in_flight_max = 1).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(as_tenant("acme", reserve("k"))).await.unwrap().into_inner());
    // acme's one slot is taken by a reserve that waits for the holder.
    let parked = park(&server, &client, "acme", "k", 1).await;
    let refused = client.reserve(as_tenant("acme", reserve("other"))).await.unwrap_err();
    exhausted(&refused, "tenants[].requests_in_flight_max");
    assert!(refused.message().contains("requests_in_flight_max is 1"), "{refused:?}");
    granted(&client.reserve(as_tenant("globex", reserve("other"))).await.unwrap().into_inner());

    // Keeping and ending admitted work is never refused for the tenant's quota: the
    // holder heartbeats and releases while its tenant is at the limit, and the slot
    // comes back when the waiting call ends.
    client.heartbeat(as_tenant("acme", heartbeat("k", token))).await.unwrap();
    release(&mut client, "acme", "k", token).await;
    granted(&parked.await.unwrap().unwrap().into_inner());
    granted(&client.reserve(as_tenant("acme", reserve("other"))).await.unwrap().into_inner());
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_waiter_limit_is_refused_while_another_waits() {
    let server = two_tenants(|t| t.waiters_max = 1).await;
    let mut client = server.client().await;
    let acme_token = granted(&client.reserve(as_tenant("acme", reserve("k"))).await.unwrap().into_inner());
    let globex_token =
        granted(&client.reserve(as_tenant("globex", reserve("k"))).await.unwrap().into_inner());
    let acme_waiter = park(&server, &client, "acme", "k", 1).await;
    let refused = client.reserve(as_tenant("acme", waiting("k"))).await.unwrap_err();
    exhausted(&refused, "tenants[].waiters_max");
    // A reserve that does not wait is still served, and globex may wait.
    let in_progress = client.reserve(as_tenant("acme", reserve("k"))).await.unwrap().into_inner();
    assert!(
        matches!(in_progress.outcome, Some(pb::reserve_response::Outcome::InProgress(_))),
        "{in_progress:?}"
    );
    let globex_waiter = park(&server, &client, "globex", "k", 2).await;

    release(&mut client, "acme", "k", acme_token).await;
    release(&mut client, "globex", "k", globex_token).await;
    granted(&acme_waiter.await.unwrap().unwrap().into_inner());
    granted(&globex_waiter.await.unwrap().unwrap().into_inner());
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_request_rate_is_refused_until_time_passes_and_may_still_commit() {
    let server = two_tenants(|t| {
        t.requests_per_s = 2;
        t.requests_burst_max = 3;
    })
    .await;
    let mut client = server.client().await;
    let mut tokens = Vec::new();
    for key in ["a", "b", "c"] {
        tokens.push(granted(&client.reserve(as_tenant("acme", reserve(key))).await.unwrap().into_inner()));
    }
    // The clock stands still: the burst is spent and nothing refills it.
    let refused = client.reserve(as_tenant("acme", reserve("d"))).await.unwrap_err();
    exhausted(&refused, "tenants[].requests_per_s");
    assert!(refused.message().contains("retry in 500 ms"), "{refused:?}");
    let get = pb::GetRequest { namespace: "live".into(), key: "a".into() };
    exhausted(&client.get(as_tenant("acme", get)).await.unwrap_err(), "tenants[].requests_per_s");
    granted(&client.reserve(as_tenant("globex", reserve("d"))).await.unwrap().into_inner());
    // Heartbeats, commits and releases keep or end admitted work; the request rate
    // never refuses them (they have a rate of their own, tested below).
    client.heartbeat(as_tenant("acme", heartbeat("a", tokens[0]))).await.unwrap();
    release(&mut client, "acme", "b", tokens[1]).await;
    let commit = pb::CommitRequest {
        namespace: "live".into(),
        key: "a".into(),
        token: tokens[0],
        outcome: pb::Outcome::Succeeded as i32,
        response: b"done".to_vec(),
    };
    client.commit(as_tenant("acme", commit)).await.unwrap();

    // Half a second refills one request at two per second.
    server.clock.advance(500);
    granted(&client.reserve(as_tenant("acme", reserve("d"))).await.unwrap().into_inner());
    exhausted(
        &client.reserve(as_tenant("acme", reserve("e"))).await.unwrap_err(),
        "tenants[].requests_per_s",
    );
    drop(client);
    server.stop().await;
}

/// Heartbeats, and commits with releases, have rates of their own,
/// `tenants[].finishes_per_s` each, ten times `requests_per_s` when unset: each is a
/// durable write, and a tenant refused reserves at one per second could make 5,000
/// durable heartbeats in 0.1 s (before, only the server's in-flight limit applied). The
/// two are counted apart, so heartbeats sent in a loop never starve a commit; the
/// tenant's request rate refuses none of them; another tenant's are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_heartbeats_commits_and_releases_have_rates_of_their_own() {
    let server = two_tenants(|t| t.requests_per_s = 1).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(as_tenant("acme", reserve("a"))).await.unwrap().into_inner());
    exhausted(
        &client.reserve(as_tenant("acme", reserve("b"))).await.unwrap_err(),
        "tenants[].requests_per_s",
    );
    // The clock stands still: ten heartbeats (one second's worth of ten times the
    // request rate) pass, and the eleventh does not.
    for _ in 0..10 {
        client.heartbeat(as_tenant("acme", heartbeat("a", token))).await.unwrap();
    }
    let refused = client.heartbeat(as_tenant("acme", heartbeat("a", token))).await.unwrap_err();
    exhausted(&refused, "tenants[].finishes_per_s");
    assert!(refused.message().contains("retry in 100 ms"), "{refused:?}");
    let commit = || pb::CommitRequest {
        namespace: "live".into(),
        key: "a".into(),
        token,
        outcome: pb::Outcome::Succeeded as i32,
        response: b"done".to_vec(),
    };
    client.commit(as_tenant("acme", commit())).await.expect("heartbeats never starve a commit");
    // Nine more commits (repeats, each a batch) fill the commits' second; then commits
    // and releases are refused.
    for _ in 0..9 {
        let repeated = client.commit(as_tenant("acme", commit())).await;
        assert!(
            repeated.as_ref().is_ok()
                || repeated.as_ref().is_err_and(|s| s.code() != Code::ResourceExhausted)
        );
    }
    exhausted(&client.commit(as_tenant("acme", commit())).await.unwrap_err(), "tenants[].finishes_per_s");
    let release = pb::ReleaseRequest { namespace: "live".into(), key: "a".into(), token };
    exhausted(&client.release(as_tenant("acme", release)).await.unwrap_err(), "tenants[].finishes_per_s");
    let globex = granted(&client.reserve(as_tenant("globex", reserve("a"))).await.unwrap().into_inner());
    client.heartbeat(as_tenant("globex", heartbeat("a", globex))).await.expect("another tenant's rate");
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_records_quota_is_refused_new_keys_while_another_stores_more() {
    let server = two_tenants(|t| t.records_per_shard_max = 2).await;
    let mut client = server.client().await;
    let token = granted(&client.reserve(as_tenant("acme", reserve("a"))).await.unwrap().into_inner());
    granted(&client.reserve(as_tenant("acme", reserve("b"))).await.unwrap().into_inner());
    let refused = client.reserve(as_tenant("acme", reserve("c"))).await.unwrap_err();
    exhausted(&refused, "tenants[].records_per_shard_max");
    // Its stored keys are served as before; globex stores what it likes.
    release(&mut client, "acme", "a", token).await;
    for key in ["a", "b", "c"] {
        granted(&client.reserve(as_tenant("globex", reserve(key))).await.unwrap().into_inner());
    }
    drop(client);
    server.stop().await;
}
