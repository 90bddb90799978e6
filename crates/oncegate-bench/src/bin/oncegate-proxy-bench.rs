//! The proxy's cost: POSTs per second and latency straight to an upstream, then through
//! `oncegate-proxy` on the engine in process, in one run, each request with a fresh
//! Idempotency-Key (every one reserved, forwarded, stored and committed).
//!
//! cargo run --release -p oncegate-bench --bin oncegate-proxy-bench -- \
//!     --in-flight 64 --seconds 5 --dir /work

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use clap::Parser;
use hdrhistogram::Histogram;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Mutex;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Cli {
    /// Requests in flight.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// Measured seconds per target.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Where the proxy's data directory goes (a real disk, for the figures to mean anything).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

/// A service that answers every POST at once with a small JSON body.
async fn upstream() -> anyhow::Result<String> {
    let router = axum::Router::new().route(
        "/orders",
        axum::routing::post(|| async { (StatusCode::CREATED, r#"{"order":"A-77","status":"filled"}"#) }),
    );
    serve(router).await
}

async fn serve(router: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(url)
}

/// Posts with fresh keys from `in_flight` workers for `seconds`; returns POSTs/s and the
/// latency histogram (µs).
async fn load(url: &str, in_flight: usize, seconds: f64) -> anyhow::Result<(f64, Histogram<u64>)> {
    let http: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Histogram::<u64>::new(3)?));
    let workers: Vec<_> = (0..in_flight)
        .map(|worker| {
            let (http, url, stop, done, latencies) =
                (http.clone(), url.to_owned(), Arc::clone(&stop), Arc::clone(&done), Arc::clone(&latencies));
            tokio::spawn(async move {
                let mut mine = Histogram::<u64>::new(3).expect("histogram");
                for n in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let request = Request::post(format!("{url}/orders"))
                        .header("idempotency-key", format!("w{worker}-{n}"))
                        .header("authorization", "Bearer bench")
                        .header("content-type", "application/json")
                        .body(Body::from(r#"{"symbol":"BTCUSDT","qty":"0.5"}"#))
                        .expect("request");
                    let started = Instant::now();
                    let Ok(response) = http.request(request).await else { continue };
                    let _ = axum::body::to_bytes(Body::new(response.into_body()), 1 << 16).await;
                    let _ = mine.record(started.elapsed().as_micros() as u64);
                    done.fetch_add(1, Ordering::Relaxed);
                }
                let _ = latencies.lock().await.add(&mine);
            })
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let posts = done.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    for worker in workers {
        worker.await?;
    }
    let histogram = latencies.lock().await.clone();
    Ok((posts as f64 / elapsed, histogram))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let dir = tempfile::tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let upstream = upstream().await?;
    let engine = oncegate_engine::Engine::open(oncegate_engine::EngineConfig {
        data_dir: dir.path().to_owned(),
        ..Default::default()
    })?;
    let config = oncegate_proxy::ProxyConfig { upstream: upstream.clone(), ..Default::default() };
    let proxy =
        serve(oncegate_proxy::router(engine.gate(oncegate_core::Tenant::default_tenant()), config)).await?;
    println!("| path | in flight | POSTs/s | p50 (ms) | p99 (ms) |");
    println!("| --- | --- | --- | --- | --- |");
    let mut rates = Vec::new();
    for (name, url) in [("direct to the upstream", &upstream), ("through oncegate-proxy", &proxy)] {
        let (rate, latency) = load(url, cli.in_flight, cli.seconds).await?;
        let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
        println!("| {name} | {} | {rate:.0} | {:.2} | {:.2} |", cli.in_flight, ms(0.5), ms(0.99));
        rates.push((rate, ms(0.5)));
    }
    println!(
        "proxied / direct: {:.2}x the POSTs/s, {:.2} ms added at p50",
        rates[1].0 / rates[0].0.max(1e-9),
        rates[1].1 - rates[0].1
    );
    engine.shutdown();
    Ok(())
}
