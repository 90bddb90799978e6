//! The same protocol over the network: a gateway calls a shared oncegate server through
//! the client crate's `once`. (For the example, the server runs in this process on a
//! free port; point `Client::builder` at a real one, with `.token(..)` and `https://`.)
//!
//! Run it with `cargo run -p oncegate-client --example client_once`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use oncegate_client::{AnyError, Client, GateExt, OnceOptions, Ran, Replay, WorkError};
use oncegate_engine::{Engine, EngineConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let url = serve(dir.path()).await?;
    let client = Client::builder(url).connect().await?;

    let orders_placed = Arc::new(AtomicU32::new(0));
    let order = serde_json::json!({ "symbol": "BTCUSDT", "side": "buy", "qty": "0.5" });
    let options = OnceOptions::default().fingerprint_json(&order)?;
    for delivery in ["first delivery", "retry"] {
        let placed = Arc::clone(&orders_placed);
        let ran = client
            .once("live", "fill-8812", options.clone(), |lease| async move {
                let n = placed.fetch_add(1, Ordering::SeqCst) + 1;
                // The exchange call would carry `lease.token` as its fencing token.
                Ok::<_, WorkError<AnyError>>(format!("order A-{n} (token {})", lease.token).into_bytes())
            })
            .await?;
        let answer = match ran {
            Ran::Now(response) => format!("ran now: {}", String::from_utf8_lossy(&response)),
            Ran::Replayed(Replay::Succeeded(stored)) => {
                format!("replayed: {}", String::from_utf8_lossy(&stored.response))
            }
            Ran::Replayed(Replay::Failed(stored)) => {
                format!("replayed a refusal: {}", String::from_utf8_lossy(&stored.response))
            }
        };
        println!("fill-8812, {delivery:<14} -> {answer}");
    }
    let placed = orders_placed.load(Ordering::SeqCst);
    println!("orders placed: {placed}");
    assert_eq!(placed, 1, "the retry must not place a second order");
    Ok(())
}

/// An oncegate server on a free loopback port, on `data_dir`; returns its address.
async fn serve(data_dir: &std::path::Path) -> Result<String, Box<dyn std::error::Error>> {
    let config = oncegate_server::Config {
        engine: EngineConfig { data_dir: data_dir.to_owned(), ..EngineConfig::default() },
        ..oncegate_server::Config::default()
    };
    let engine = Engine::open(config.engine_config())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let listeners = oncegate_server::Listeners { gate: listener, metrics: None };
        let _ = oncegate_server::serve(engine, &config, listeners, std::future::pending()).await;
    });
    Ok(url)
}
