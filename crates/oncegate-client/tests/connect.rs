//! How a client reaches servers: lazily, across several nodes, with the caller's headers.

use oncegate_client::{Client, ClientError, Gate, KeyRequest, State};
use oncegate_engine::{Engine, EngineConfig};
use oncegate_server::{Config, Listeners};

/// Serves a fresh data directory on `listener` until the test ends.
fn serve(listener: tokio::net::TcpListener) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        engine: EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() },
        ..Config::default()
    };
    let engine = Engine::open(config.engine_config()).unwrap();
    tokio::spawn(async move {
        let listeners = Listeners { gate: listener, metrics: None };
        let _ = oncegate_server::serve(engine, &config, listeners, std::future::pending()).await;
    });
    dir
}

fn key(name: &str) -> KeyRequest {
    KeyRequest { namespace: "live".into(), key: name.into(), ..Default::default() }
}

/// A lazy client is made before its server serves, and calls once it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_client_connects_at_its_first_call() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let client = Client::builder(url).connect_lazy().unwrap();
    let _dir = serve(listener);
    assert_eq!(client.get(key("k")).await.unwrap().state, State::Free);
}

/// With several addresses, calls go to the nodes that answer: one never started is left
/// out rather than failing the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_balanced_over_the_nodes_that_answer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = format!("http://{}", listener.local_addr().unwrap());
    let _dir = serve(listener);
    // A port nobody listens on: bound, then closed.
    let down = {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", closed.local_addr().unwrap())
    };
    let client = Client::builder(down)
        .also(up)
        .keep_alive(std::time::Duration::from_secs(10), std::time::Duration::from_secs(5));
    let client = client.connect().await.unwrap();
    for i in 0..8 {
        assert_eq!(client.get(key(&format!("k{i}"))).await.unwrap().state, State::Free, "call {i}");
    }
}

/// A header the caller adds must be one HTTP/2 can carry; a bad one is a configuration
/// error at connect, not a failure at every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_cannot_be_sent_is_refused_at_connect() {
    let built = Client::builder("http://127.0.0.1:1").header("bad name", "x").connect_lazy();
    assert!(matches!(built, Err(ClientError::Config(ref said)) if said.contains("bad name")), "{built:?}");
    let fine = Client::builder("http://127.0.0.1:1").header("x-request-source", "billing").connect_lazy();
    assert!(fine.is_ok(), "{fine:?}");
}

/// A deadline set for some calls holds for them: against a server that accepts and never
/// answers, a call of `with_timeout(50 ms)` is `unavailable` after that, not after the
/// client's 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_with_its_own_deadline_ends_there() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let accepted = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let client = Client::builder(url).connect_lazy().unwrap();
    let hurried = client.with_timeout(std::time::Duration::from_millis(50));
    let Err(ClientError::Refused(refusal)) = hurried.get(key("k")).await else {
        panic!("no answer can come")
    };
    assert_eq!(refusal.code, oncegate_client::Code::Unavailable, "{refusal}");
    assert!(refusal.message.contains("50 ms"), "{refusal}");
    accepted.abort();
}
