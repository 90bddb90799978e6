//! What one connection may hold of the server's connection slots, through raw sockets
//! and the real client: a connection must send a complete request head within
//! `server.handshake_timeout_ms`, is closed after `server.idle_timeout_ms` without a
//! request (pings do not count), and is sent away after `server.connection_age_max_ms`.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use oncegate_proto::v1 as pb;
use pb::session_request::Call;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

mod common;

use common::{granted, reserve, start_with};

/// The client's connection preface: the magic, then an empty SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// The preface, then one complete request on stream 1: a HEADERS frame (END_STREAM,
/// END_HEADERS) for `GET /v1/openapi.json`, its fields in HPACK without the dynamic table.
const ONE_REQUEST: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00\
    \x00\x00\x1f\x01\x05\x00\x00\x00\x01\x82\x86\x44\x10/v1/openapi.json\x41\x09localhost";

/// Sends `bytes` on a new connection to `addr`, then reads until the server closes it;
/// returns what it read. The read timeout is a safety net for a broken server (the
/// test then fails on the error), not a measurement.
async fn sent_then_closed(addr: SocketAddr, bytes: &'static [u8]) -> std::io::Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(addr)?;
        socket.set_read_timeout(Some(Duration::from_secs(60)))?;
        socket.write_all(bytes)?;
        let mut read = Vec::new();
        socket.read_to_end(&mut read)?;
        Ok(read)
    })
    .await
    .unwrap()
}

/// A connection that sent one byte of its preface, or all of it but no request, or part
/// of a request head, is closed at the handshake deadline, on the gRPC port and on the
/// metrics listener. (Only the first byte was timed: eight peers that
/// each sent `P` held eight slots for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_request_head_is_closed_at_the_handshake_deadline() {
    // A second: the real client at the end must send its first request head within it,
    // on a slow machine too.
    let server = start_with(|c| c.server.handshake_timeout_ms = 1_000).await;
    let partial = sent_then_closed(server.addr, b"P").await;
    assert!(partial.is_ok(), "one byte of the preface: {partial:?}");
    let preface = sent_then_closed(server.addr, PREFACE).await.expect("the preface alone is closed");
    assert!(!preface.is_empty(), "the server answered the preface with its settings");
    let head = sent_then_closed(server.addr, b"GET /v1/openapi.json HTTP/1.1\r\nHost: local").await;
    assert!(head.is_ok(), "a request head cut short: {head:?}");
    // The metrics listener keeps the same deadline (it was served by plain `axum::serve`).
    let metrics = sent_then_closed(server.metrics_addr, b"GET /metr").await;
    assert!(metrics.is_ok(), "a metrics request head cut short: {metrics:?}");
    let mut client = server.client().await;
    granted(&client.reserve(reserve("after")).await.unwrap().into_inner());
    drop(client);
    server.stop().await;
}

/// A connection that carries no request for `server.idle_timeout_ms` is closed, while one
/// with a stream open is not, however long the stream lasts. The idle connection is
/// opened after the stream and served a request, so by the time it is closed the stream
/// has been open longer than the idle timeout. Keepalive pings are off, so that only the
/// idle timeout can close it. (Idle HTTP/2 connections were kept for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_and_one_with_a_stream_open_is_not() {
    let server = start_with(|c| {
        c.engine.shards = 1;
        c.server.idle_timeout_ms = 300;
        c.server.keepalive_interval_ms = 0;
    })
    .await;
    let (requests, rx) = mpsc::channel(4);
    let mut answers = server.client().await.session(ReceiverStream::new(rx)).await.unwrap().into_inner();

    let served = sent_then_closed(server.addr, ONE_REQUEST).await.expect("closed once idle");
    assert!(served.windows(7).any(|w| w == b"openapi"), "the request was answered (the OpenAPI document)");

    let call = pb::SessionRequest {
        id: 1,
        call: Some(Call::Reserve(reserve("busy"))),
        timeout_ms: 0,
        ..Default::default()
    };
    requests.send(call).await.unwrap();
    let answer = answers.message().await.expect("the stream is still open").expect("an answer");
    assert_eq!(answer.id, 1);
    drop((requests, answers));
    server.stop().await;
}

/// A connection whose client gives a `Session` stream no room for its answers (an
/// HTTP/2 window of 0) is closed after `server.send_timeout_ms`, while a stream with
/// room, idle for longer, stays open. (Nothing timed the answers' wait: the stream, its
/// calls and their connection slot were held for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_no_answer_is_closed_at_the_send_timeout() {
    let server = start_with(|c| {
        c.server.send_timeout_ms = 300;
        c.server.keepalive_interval_ms = 0;
    })
    .await;
    let (requests, rx) = mpsc::channel(4);
    let mut idle = server.client().await.session(ReceiverStream::new(rx)).await.unwrap().into_inner();

    let unread = common::session::unread_channel(&server).await;
    let (_unread, mut unanswered) =
        common::session::unread_stream(&unread, "default", [Call::Reserve(reserve("unread"))]).await.unwrap();
    // A safety net for a broken server, not a measurement.
    let ended = tokio::time::timeout(Duration::from_secs(60), unanswered.message()).await;
    assert!(matches!(ended, Ok(Err(_) | Ok(None))), "the unread stream ends with its connection: {ended:?}");

    // The stream with room, open longer than the send timeout by now, still answers.
    let call = pb::SessionRequest { id: 1, call: Some(Call::Reserve(reserve("read"))), ..Default::default() };
    requests.send(call).await.unwrap();
    assert_eq!(idle.message().await.unwrap().expect("an answer").id, 1);
    drop((requests, idle));
    server.stop().await;
}

/// A connection older than `server.connection_age_max_ms` is sent away (GOAWAY), and its
/// last stream ends after `server.connection_age_grace_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_its_age_is_sent_away() {
    let server = start_with(|c| {
        // Long enough for the reserve at the end, on a connection of its own, to finish
        // within its connection's age and grace on a slow machine.
        c.server.connection_age_max_ms = 1_000;
        c.server.connection_age_grace_ms = 1_000;
    })
    .await;
    let (_requests, rx) = mpsc::channel::<pb::SessionRequest>(4);
    let mut answers = server.client().await.session(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let ended = tokio::time::timeout(Duration::from_secs(60), answers.message()).await;
    assert!(matches!(ended, Ok(Err(_) | Ok(None))), "the stream ends with its connection: {ended:?}");
    let mut client = server.client().await;
    granted(&client.reserve(reserve("after")).await.unwrap().into_inner());
    drop(client);
    server.stop().await;
}
