//! The real server, in-process on port 0, for the server's integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;

pub mod certs;
pub mod session;

use oncegate_engine::{Engine, EngineConfig, Faults, ManualClock};
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{Config, Listeners};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The fixed start of every test's manual clock.
pub const T0: u64 = 1_700_000_000_000;

/// A server running in this process until `stop`.
pub struct Running {
    /// The gRPC port.
    pub addr: SocketAddr,
    /// The metrics listener (`/metrics`, `/healthz`, `/readyz`).
    pub metrics_addr: SocketAddr,
    pub engine: Engine,
    pub faults: Faults,
    /// The clock of every decision and of the tenants' rate limits.
    pub clock: ManualClock,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
    _dir: Option<tempfile::TempDir>,
}

impl Running {
    pub async fn client(&self) -> GateClient<Channel> {
        GateClient::connect(format!("http://{}", self.addr)).await.expect("connects")
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr)).unwrap().connect().await.expect("connects")
    }

    /// Stops accepting, waits for the server to finish, and hands the engine back.
    pub async fn stop(mut self) -> Engine {
        let _ = self.stop.take().expect("running").send(());
        self.served.await.expect("server task");
        self.engine
    }
}

/// Starts `serve` with a manual clock at `T0` and a fault seam; `dir` is kept alive with
/// the server when given.
pub async fn start_in(config: Config, dir: Option<tempfile::TempDir>) -> Running {
    let faults = Faults::default();
    let clock = ManualClock::new(T0);
    let engine = Engine::open_with(config.engine_config(), Arc::new(clock.clone()), faults.clone())
        .expect("engine opens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (addr, metrics_addr) = (listener.local_addr().unwrap(), metrics.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let served = {
        let engine = engine.clone();
        let listeners = Listeners { gate: listener, metrics: Some(metrics) };
        tokio::spawn(async move {
            oncegate_server::serve(engine, &config, listeners, async {
                let _ = stopped.await;
            })
            .await
            .expect("serves");
        })
    };
    Running { addr, metrics_addr, engine, faults, clock, stop: Some(stop), served, _dir: dir }
}

/// `GET path` over HTTP/1.1; returns the status code and the body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(socket, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// A gauge's value on the server's `/metrics` (0 when it is not there yet).
pub async fn gauge(server: &Running, name: &'static str) -> f64 {
    let addr = server.metrics_addr;
    let (_, body) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.unwrap();
    body.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// The tests' base configuration: data in `dir`, failed shards that stay failed (no
/// reopen within a test), health polled often.
pub fn config_in(dir: &std::path::Path) -> Config {
    let mut config = Config {
        engine: EngineConfig {
            data_dir: dir.to_owned(),
            reopen_backoff_ms_min: 60_000,
            reopen_backoff_ms_max: 60_000,
            ..EngineConfig::default()
        },
        ..Config::default()
    };
    config.server.health_poll_ms = 10;
    config
}

/// Starts a server on [`config_in`] a new directory, edited by `edit`.
pub async fn start_with(edit: impl FnOnce(&mut Config)) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_in(dir.path());
    edit(&mut config);
    config.check().expect("test configuration is valid");
    start_in(config, Some(dir)).await
}

pub fn reserve(key: &str) -> pb::ReserveRequest {
    pb::ReserveRequest { namespace: "live".into(), key: key.into(), ..Default::default() }
}

/// The token of a grant; panics on any other outcome.
pub fn granted(response: &pb::ReserveResponse) -> u64 {
    match &response.outcome {
        Some(pb::reserve_response::Outcome::Granted(g)) => g.token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// Checks a refusal's gRPC code and stable code trailer.
pub fn refused(status: &tonic::Status, grpc: tonic::Code, code: &str) {
    assert_eq!(status.code(), grpc, "{status:?}");
    let trailer = status.metadata().get(oncegate_server::CODE_METADATA).and_then(|v| v.to_str().ok());
    assert_eq!(trailer, Some(code), "{status:?}");
}

/// Checks a `resource_exhausted` refusal and the limit its trailer names.
pub fn exhausted(status: &tonic::Status, limit: &str) {
    refused(status, tonic::Code::ResourceExhausted, "resource_exhausted");
    let trailer = status.metadata().get(oncegate_server::LIMIT_METADATA).and_then(|v| v.to_str().ok());
    assert_eq!(trailer, Some(limit), "{status:?}");
}

/// The reserve message with bytes where the contract has strings, to send invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawReserve {
    #[prost(bytes = "vec", tag = "1")]
    pub namespace: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub key_parts: Vec<Vec<u8>>,
    #[prost(uint64, tag = "4")]
    pub bucket_ms: u64,
}

/// An HTTP answer: status, the header block as received, and the body parsed as JSON
/// (`null` when empty or not JSON).
pub struct HttpAnswer {
    pub status: u16,
    pub headers: String,
    pub body: serde_json::Value,
}

impl HttpAnswer {
    /// A header's value (names compare without case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
        })
    }
}

/// One HTTP/1.1 request on a connection of its own: `method path`, with a bearer token
/// when given, and `body` as `application/json` when given.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> HttpAnswer {
    let authorization = token.map(|token| format!("Bearer {token}"));
    let headers: Vec<(&str, &str)> =
        authorization.iter().map(|value| ("Authorization", value.as_str())).collect();
    let content_type = body.map(|_| "application/json");
    http_with(addr, method, path, &headers, content_type.zip(body)).await
}

/// `method path` over HTTP/1.1 with `headers`, and a body of the given content type.
pub async fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, &str)>,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some((content_type, body)) = body {
        request.push_str(&format!("Content-Type: {content_type}\r\nContent-Length: {}\r\n", body.len()));
    }
    request.push_str("\r\n");
    request.push_str(body.map_or("", |(_, body)| body));
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    socket.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8(response).expect("an HTTP answer in UTF-8");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = head.split_once("\r\n").map(|(_, h)| h.to_owned()).unwrap_or_default();
    HttpAnswer { status, headers, body: serde_json::from_str(body).unwrap_or(serde_json::Value::Null) }
}
