//! The double fill, prevented: a trading gateway receives a fill webhook, places the
//! order, and its acknowledgement to the sender is lost. The sender retries. Without a
//! gate the retry places a second order; with oncegate the retry gets the first fill's
//! stored response instead.
//!
//! The gateway is written against the `Gate` trait with `once`: here on the engine in
//! process; the client crate's `client_once` example runs the same on a remote server.
//!
//! Run it with `cargo run -p oncegate --example double_fill`.

use std::sync::atomic::{AtomicU32, Ordering};

use oncegate::client::{GateExt, OnceError, OnceOptions, Ran, WorkError};
use oncegate::core::{Fingerprint, Tenant};
use oncegate::{Engine, EngineConfig};

/// The exchange side effect we must not repeat.
static ORDERS_PLACED: AtomicU32 = AtomicU32::new(0);

fn place_order(symbol: &str, quantity: &str) -> String {
    let n = ORDERS_PLACED.fetch_add(1, Ordering::SeqCst) + 1;
    format!("{{\"order\":\"A-{n}\",\"symbol\":\"{symbol}\",\"qty\":\"{quantity}\"}}")
}

/// The gateway's webhook handler: the order runs inside `once`, which reserves the
/// webhook's id, commits the order's response, and replays it to any retry.
async fn handle_fill_webhook<G: GateExt>(
    gate: &G,
    webhook_id: &str,
) -> Result<String, OnceError<G::Error, String>> {
    let payload = serde_json::json!({ "symbol": "BTCUSDT", "side": "buy", "qty": "0.5" });
    let fingerprint = Fingerprint::of_json(&payload).expect("plain JSON").as_bytes().to_vec();
    let options = OnceOptions { fingerprint, ..OnceOptions::default() };
    let ran = gate
        .once("live", webhook_id, options, |_lease| async {
            Ok::<_, WorkError<String>>(place_order("BTCUSDT", "0.5").into_bytes())
        })
        .await?;
    Ok(match ran {
        Ran::Now(response) | Ran::Replayed { response, .. } => {
            String::from_utf8_lossy(&response).into_owned()
        }
        Ran::InProgress { retry_after_ms } => format!("409: in progress, retry in {retry_after_ms} ms"),
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() })?;
    let gate = engine.gate(Tenant::default_tenant());

    let first = handle_fill_webhook(&gate, "fill-8812").await?;
    println!("webhook fill-8812, first delivery -> {first}");
    println!("(the gateway's 200 OK to the exchange is lost; the exchange retries)");
    let retry = handle_fill_webhook(&gate, "fill-8812").await?;
    println!("webhook fill-8812, retry          -> {retry}");

    let placed = ORDERS_PLACED.load(Ordering::SeqCst);
    println!("orders placed: {placed}");
    assert_eq!(placed, 1, "the retry must not place a second order");
    assert_eq!(first, retry, "the retry gets the first fill's response");
    engine.shutdown();
    Ok(())
}
