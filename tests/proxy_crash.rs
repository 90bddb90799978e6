//! `oncegate proxy` killed with SIGKILL while requests are in flight, and started again on
//! its data directory, again and again: a request that got an answer never runs upstream
//! a second time, and its retries are answered with what it stored.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const BIN: &str = env!("CARGO_BIN_EXE_oncegate");

/// Upstream executions per Idempotency-Key.
type Runs = Arc<Mutex<HashMap<String, u32>>>;

async fn upstream(runs: Runs) -> String {
    let router = axum::Router::new().route(
        "/orders",
        post(move |headers: HeaderMap| async move {
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let n = {
                let mut runs = runs.lock().unwrap();
                let n = runs.entry(key.clone()).or_default();
                *n += 1;
                *n
            };
            tokio::time::sleep(std::time::Duration::from_millis(u64::from(n) % 7)).await;
            (StatusCode::CREATED, format!("{key} run {n}"))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

/// Starts the proxy on a free port and waits for the line that names it.
fn start(upstream: &str, dir: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(BIN)
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream, "--data-dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = lines.find_map(|l| l.ok().filter(|l| l.contains("listening on"))).expect("the proxy starts");
    std::thread::spawn(move || lines.for_each(drop));
    let addr = line.split("listening on ").nth(1).unwrap().split(',').next().unwrap().to_owned();
    (child, format!("http://{addr}"))
}

async fn send(http: &Client<HttpConnector, Body>, proxy: &str, key: &str) -> Option<(StatusCode, String)> {
    let request = Request::post(format!("{proxy}/orders"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer crash-test")
        .body(Body::from("{}"))
        .unwrap();
    let response = http.request(request).await.ok()?;
    let status = response.status();
    let body = axum::body::to_bytes(Body::new(response.into_body()), 1 << 16).await.ok()?;
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_request_never_runs_twice_across_proxy_kills() {
    let dir = tempfile::tempdir().unwrap();
    let runs: Runs = Arc::default();
    let upstream = upstream(Arc::clone(&runs)).await;
    let http: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
    let answered: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    for cycle in 0..4 {
        let (mut proxy, url) = start(&upstream, dir.path());
        // Every answer from earlier cycles is replayed as it was.
        let earlier = answered.lock().unwrap().clone();
        for (key, body) in earlier {
            let replay = send(&http, &url, &key).await.expect("the restarted proxy answers");
            assert_eq!(replay, (StatusCode::CREATED, body), "{key}");
        }
        let (done, mut progress) = tokio::sync::mpsc::unbounded_channel();
        let clients: Vec<_> = (0..8)
            .map(|client| {
                let (http, url, answered, done) =
                    (http.clone(), url.clone(), Arc::clone(&answered), done.clone());
                tokio::spawn(async move {
                    for n in 0.. {
                        let key = format!("c{cycle}-{client}-{n}");
                        let Some((status, body)) = send(&http, &url, &key).await else { return };
                        if status == StatusCode::CREATED {
                            answered.lock().unwrap().insert(key, body);
                            let _ = done.send(());
                        }
                    }
                })
            })
            .collect();
        // Kill once this cycle has had some answers, in the middle of more.
        for _ in 0..40 {
            progress.recv().await.unwrap();
        }
        proxy.kill().unwrap();
        let _ = proxy.wait();
        for client in clients {
            client.await.unwrap();
        }
    }
    let runs = runs.lock().unwrap();
    let answered = answered.lock().unwrap();
    assert!(answered.len() >= 160);
    for key in answered.keys() {
        assert_eq!(runs.get(key), Some(&1), "{key} was answered, so it ran upstream exactly once");
    }
}
