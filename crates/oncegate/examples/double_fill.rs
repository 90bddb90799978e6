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

use oncegate::client::{GateExt, OnceError, OnceOptions, Ran, Replay, WorkError};
use oncegate::core::Tenant;
use oncegate::{Engine, EngineConfig};

/// The exchange side effect we must not repeat.
static ORDERS_PLACED: AtomicU32 = AtomicU32::new(0);

/// What the exchange refuses with.
#[derive(Debug, thiserror::Error)]
#[error("the exchange refused the order: {0}")]
struct Rejected(String);

fn place_order(symbol: &str, quantity: &str) -> Result<String, Rejected> {
    let n = ORDERS_PLACED.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(format!("{{\"order\":\"A-{n}\",\"symbol\":\"{symbol}\",\"qty\":\"{quantity}\"}}"))
}

/// The gateway's webhook handler: the order runs inside `once`, which reserves the
/// webhook's id, commits the order's response, and replays it to any retry. A replay
/// says how the first attempt ended: a stored rejection is answered as one.
async fn handle_fill_webhook<G: GateExt>(
    gate: &G,
    webhook_id: &str,
) -> Result<(u16, String), OnceError<G::Error, Rejected>> {
    let payload = serde_json::json!({ "symbol": "BTCUSDT", "side": "buy", "qty": "0.5" });
    let options = OnceOptions::default().fingerprint_json(&payload).expect("plain JSON");
    let ran = gate
        .once("live", webhook_id, options, |_lease| async {
            // A rejection is final: stored, and replayed to every retry.
            let order = place_order("BTCUSDT", "0.5")
                .map_err(|e| WorkError::Final { response: e.0.clone().into_bytes(), error: e })?;
            Ok(order.into_bytes())
        })
        .await;
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let ran = match ran {
        Ok(ran) => ran,
        // A final failure: an error the first time, a replay after; both answer 422.
        Err(OnceError::Failed { response, .. }) => return Ok((422, text(&response))),
        Err(other) => return Err(other),
    };
    Ok(match ran {
        Ran::Now(response) => (200, text(&response)),
        Ran::Replayed(Replay::Succeeded(stored)) => (200, text(&stored.response)),
        Ran::Replayed(Replay::Failed(stored)) => (422, text(&stored.response)),
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() })?;
    let gate = engine.gate(Tenant::default_tenant());

    let first = handle_fill_webhook(&gate, "fill-8812").await?;
    println!("webhook fill-8812, first delivery -> {first:?}");
    println!("(the gateway's 200 OK to the exchange is lost; the exchange retries)");
    let retry = handle_fill_webhook(&gate, "fill-8812").await?;
    println!("webhook fill-8812, retry          -> {retry:?}");

    let placed = ORDERS_PLACED.load(Ordering::SeqCst);
    println!("orders placed: {placed}");
    assert_eq!(placed, 1, "the retry must not place a second order");
    assert_eq!(first, retry, "the retry gets the first fill's response");
    engine.shutdown();
    Ok(())
}
