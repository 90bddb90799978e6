//! What a `Session` stream may hold, whatever its client does: clients that never read
//! their answers (an HTTP/2 stream window of 0: the server can send them no byte) keep
//! their tenant's places taken, and a tenant opens at most `tenants[].sessions_max`
//! streams. (The memory they take is measured alone, in `session_memory.rs`.)

use std::time::Duration;

use oncegate_proto::v1 as pb;

mod common;

use common::session::{authorized, committed, get, tenant, unread_channel, unread_stream, until_counted};
use common::{exhausted, reserve, start_with};

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
