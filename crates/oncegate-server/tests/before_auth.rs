//! What a caller without credentials can make a server with tenants hold: a `Gate` or
//! HTTP/JSON API call whose bearer token names no tenant is refused from its head, before
//! its message arrives, and the services anyone may call (health, reflection) read only
//! small messages. (The call's message was read whole first, up to
//! `server.message_bytes_max` on each of 100 streams a connection, and health and
//! reflection read up to tonic's 4 MiB: a caller with no token could make the server hold
//! gigabytes.)

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{Running, session::tenant, start_with};
use oncegate_proto::v1 as pb;
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// A server with a tenant, which waits an hour for a call's message: a caller that is
/// answered within the tests' minute was answered before its message came.
async fn with_a_tenant() -> Running {
    start_with(|c| {
        c.tenants = vec![tenant("acme", |_| {})];
        c.server.request_timeout_ms = 3_600_000;
    })
    .await
}

async fn channel(server: &Running) -> Channel {
    Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_call_with_an_unknown_token_is_refused_before_its_message_arrives() {
    let server = with_a_tenant().await;
    let mut grpc = tonic::client::Grpc::new(channel(&server).await);
    grpc.ready().await.unwrap();
    // A message that never comes: the body stays open.
    let mut request = tonic::Request::new(futures_util::stream::pending::<pb::ReserveRequest>());
    request.metadata_mut().insert("authorization", "Bearer nobody".parse().unwrap());
    let codec = tonic_prost::ProstCodec::<pb::ReserveRequest, pb::ReserveResponse>::default();
    let path = PathAndQuery::from_static("/oncegate.v1.Gate/Reserve");
    // The timeout is a safety net for a broken server, not a measurement.
    let refused = tokio::time::timeout(Duration::from_secs(60), grpc.client_streaming(request, path, codec))
        .await
        .expect("refused before the server's hour")
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("unknown bearer token"), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_call_with_an_unknown_token_is_refused_before_its_body_arrives() {
    let server = with_a_tenant().await;
    let addr = server.addr;
    let status = tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(addr).unwrap();
        // A safety net for a broken server, not a measurement: one that waited for the
        // body would answer after the server's hour.
        socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        socket
            .write_all(
                b"POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nobody\r\n\
                  Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"namespace\": ",
            )
            .unwrap();
        let mut status = [0u8; 12];
        socket.read_exact(&mut status).unwrap();
        status
    })
    .await
    .unwrap();
    assert_eq!(&status, b"HTTP/1.1 401", "{}", String::from_utf8_lossy(&status));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reads_only_small_messages() {
    let server = with_a_tenant().await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel(&server).await);
    let check = |service: String| tonic_health::pb::HealthCheckRequest { service };
    let known = health.check(check("oncegate.v1.Gate".to_owned())).await.unwrap();
    assert_eq!(
        known.get_ref().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let large = health.check(check("x".repeat(64 << 10))).await.unwrap_err();
    assert_eq!(large.code(), Code::OutOfRange, "{large:?}");
}
