//! The server on the PostgreSQL store, failing closed at its front: a database that goes
//! away turns calls into UNAVAILABLE and health into NOT_SERVING, and both come back by
//! themselves when it returns.

mod common;
#[path = "../../oncegate-engine/tests/common/pg.rs"]
mod pg;

use oncegate_engine::{PostgresConfig, StoreConfig};
use oncegate_proto::v1::gate_client::GateClient;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_unavailable_and_not_serving_until_it_returns() {
    let Some(cluster) = tokio::task::spawn_blocking(pg::Cluster::start).await.unwrap() else { return };
    let url = cluster.database("front");
    let server = common::start_with(move |c| {
        c.store =
            StoreConfig::Postgres(PostgresConfig { postgres_url: url.into(), ..PostgresConfig::default() });
        c.engine.reopen_backoff_ms_min = 10;
        c.engine.reopen_backoff_ms_max = 200;
    })
    .await;
    let channel = server.channel().await;
    let mut gate = GateClient::new(channel.clone());
    common::granted(&gate.reserve(common::reserve("before")).await.unwrap().into_inner());
    let mut health = HealthClient::new(channel.clone());
    let mut watch =
        health.watch(HealthCheckRequest { service: "oncegate.v1.Gate".into() }).await.unwrap().into_inner();

    let cluster = tokio::task::spawn_blocking(move || {
        cluster.stop();
        cluster
    })
    .await
    .unwrap();
    let refused = gate.reserve(common::reserve("during")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    while watch.message().await.unwrap().unwrap().status != ServingStatus::NotServing as i32 {}

    let cluster = tokio::task::spawn_blocking(move || {
        cluster.restart();
        cluster
    })
    .await
    .unwrap();
    while watch.message().await.unwrap().unwrap().status != ServingStatus::Serving as i32 {}
    common::granted(&gate.reserve(common::reserve("after")).await.unwrap().into_inner());
    drop((watch, gate, health, channel));
    server.stop().await;
    drop(cluster);
}
