//! What a caller without credentials can make a server with tenants hold: a `Gate` or
//! HTTP/JSON API call whose bearer token names no tenant, and an Admin call without the
//! admin token, is refused from its head, before its message arrives, and the services
//! anyone may call (health, reflection) read only small messages. (The call's message was
//! read whole first, up to `server.message_bytes_max` on each of 100 streams a connection,
//! and Admin, health and reflection read up to tonic's 4 MiB: a caller with no token could
//! make the server hold gigabytes.)

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{Running, session::tenant, start_with};
use oncegate_proto::v1 as pb;
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// A server with a tenant and an admin token, which waits an hour for a call's message:
/// a caller that is answered within the tests' minute was answered before its message
/// came.
async fn with_a_tenant() -> Running {
    start_with(|c| {
        c.tenants = vec![tenant("acme", |_| {})];
        c.admin.token_sha256 = oncegate_server::token_sha256("admin-secret");
        c.server.request_timeout_ms = 3_600_000;
    })
    .await
}

/// Calls `path` with a message that never comes (the body stays open) and `token`; the
/// refusal, which must come before the server's hour.
async fn refused_without_message<M, R>(server: &Running, path: &'static str, token: &str) -> tonic::Status
where
    M: prost::Message + Send + 'static,
    R: prost::Message + Default + Send + std::fmt::Debug + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel(server).await);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(futures_util::stream::pending::<M>());
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    let codec = tonic_prost::ProstCodec::<M, R>::default();
    let path = PathAndQuery::from_static(path);
    // The timeout is a safety net for a broken server, not a measurement.
    tokio::time::timeout(Duration::from_secs(60), grpc.client_streaming(request, path, codec))
        .await
        .expect("refused before the server's hour")
        .unwrap_err()
}

async fn channel(server: &Running) -> Channel {
    Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_call_with_an_unknown_token_is_refused_before_its_message_arrives() {
    let server = with_a_tenant().await;
    let refused = refused_without_message::<pb::ReserveRequest, pb::ReserveResponse>(
        &server,
        "/oncegate.v1.Gate/Reserve",
        "nobody",
    )
    .await;
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("unknown bearer token"), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_call_without_the_admin_token_is_refused_before_its_message_arrives() {
    let server = with_a_tenant().await;
    // A tenant's token is not the admin token.
    let refused = refused_without_message::<pb::AdminKeyRequest, pb::AdminKeyResponse>(
        &server,
        "/oncegate.v1.Admin/Purge",
        "acme",
    )
    .await;
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("wrong admin token"), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_call_with_an_unknown_token_is_refused_before_its_body_arrives() {
    let server = with_a_tenant().await;
    // axum reads any `application/*+json` body, a gRPC-looking one too.
    for content_type in ["application/json", "application/grpc+json"] {
        let addr = server.addr;
        let status = tokio::task::spawn_blocking(move || {
            let mut socket = std::net::TcpStream::connect(addr).unwrap();
            // A safety net for a broken server, not a measurement: one that waited for
            // the body would answer after the server's hour.
            socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let head = format!(
                "POST /v1/reserve HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nobody\r\n\
                 Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n{{\"namespace\": "
            );
            socket.write_all(head.as_bytes()).unwrap();
            let mut status = [0u8; 12];
            socket.read_exact(&mut status).unwrap();
            status
        })
        .await
        .unwrap();
        assert_eq!(&status, b"HTTP/1.1 401", "{content_type}: {}", String::from_utf8_lossy(&status));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_reads_only_small_messages() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, server_reflection_response::MessageResponse};
    let server = with_a_tenant().await;
    let mut reflection = ServerReflectionClient::new(channel(&server).await);
    let ask = |symbol: String| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(symbol)),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([ask("oncegate.v1.Gate".to_owned())]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("an answer");
    assert!(
        matches!(answer.message_response, Some(MessageResponse::FileDescriptorResponse(_))),
        "{answer:?}"
    );
    let large = reflection.server_reflection_info(tokio_stream::iter([ask("x".repeat(64 << 10))])).await;
    // Not read, so not answered: the stream ends (or fails) without an answer, where a
    // symbol that was read and not found is answered with an error response.
    let answered = match large {
        Ok(answers) => answers.into_inner().message().await,
        Err(status) => Err(status),
    };
    assert!(!matches!(answered, Ok(Some(_))), "{answered:?}");
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
