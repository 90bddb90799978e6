//! The double fill, prevented: a trading gateway receives a fill webhook, places the
//! order, and its acknowledgement to the sender is lost. The sender retries. Without a
//! gate the retry places a second order; with oncegate the retry gets the first fill's
//! stored response instead.
//!
//! Run it with `cargo run --example double_fill`.

use std::sync::atomic::{AtomicU32, Ordering};

use oncegate::core::{Outcome, ReserveReply, Tenant};
use oncegate::{CommitRequest, Engine, EngineConfig, ReserveRequest};

/// The exchange side effect we must not repeat.
static ORDERS_PLACED: AtomicU32 = AtomicU32::new(0);

fn place_order(symbol: &str, quantity: &str) -> String {
    let n = ORDERS_PLACED.fetch_add(1, Ordering::SeqCst) + 1;
    format!("{{\"order\":\"A-{n}\",\"symbol\":\"{symbol}\",\"qty\":\"{quantity}\"}}")
}

/// The gateway's webhook handler: one reserve before the side effect, one commit after.
fn handle_fill_webhook(
    engine: &Engine,
    tenant: &Tenant,
    webhook_id: &str,
) -> Result<String, oncegate::Error> {
    let reserve = ReserveRequest {
        namespace: "live".into(),
        key: webhook_id.into(),
        fingerprint: b"BTCUSDT buy 0.5".to_vec(),
        ..Default::default()
    };
    match engine.reserve_blocking(tenant, reserve)?.reply {
        ReserveReply::Granted { token, .. } => {
            let response = place_order("BTCUSDT", "0.5");
            let commit = CommitRequest {
                namespace: "live".into(),
                key: webhook_id.into(),
                token,
                outcome: Outcome::Succeeded,
                response: response.clone().into_bytes(),
            };
            engine.commit_blocking(tenant, commit)?;
            Ok(response)
        }
        ReserveReply::Completed { response, .. } => Ok(String::from_utf8_lossy(&response).into_owned()),
        ReserveReply::InProgress { retry_after_ms, .. } => {
            Ok(format!("409: in progress, retry in {retry_after_ms} ms"))
        }
        ReserveReply::Mismatch { .. } => Ok("422: this key was used for another payload".to_owned()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::open(EngineConfig { data_dir: dir.path().to_owned(), ..EngineConfig::default() })?;
    let tenant = Tenant::default_tenant();

    let first = handle_fill_webhook(&engine, &tenant, "fill-8812")?;
    println!("webhook fill-8812, first delivery -> {first}");
    println!("(the gateway's 200 OK to the exchange is lost; the exchange retries)");
    let retry = handle_fill_webhook(&engine, &tenant, "fill-8812")?;
    println!("webhook fill-8812, retry          -> {retry}");

    let placed = ORDERS_PLACED.load(Ordering::SeqCst);
    println!("orders placed: {placed}");
    assert_eq!(placed, 1, "the retry must not place a second order");
    assert_eq!(first, retry, "the retry gets the first fill's response");
    engine.shutdown();
    Ok(())
}
