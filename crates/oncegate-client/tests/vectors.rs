//! The fingerprints and trade keys in `clients/vectors.json`, which the Python and
//! TypeScript clients' tests read too: every client makes the same bytes from the same
//! input, or a retry through another language's client would be a `mismatch` (or,
//! worse, a different key).

use oncegate_client::keys::TradeKey;
use oncegate_core::Fingerprint;
use oncegate_core::fingerprint::canonical;
use oncegate_core::route::Routing;
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    fingerprints: Vec<FingerprintCase>,
    trade_keys: Vec<TradeCase>,
}

#[derive(Deserialize)]
struct FingerprintCase {
    name: String,
    json: String,
    canonical: String,
    fingerprint_hex: String,
}

#[derive(Deserialize)]
struct TradeCase {
    name: String,
    exchange: String,
    symbol: String,
    action: String,
    qty: String,
    live: bool,
    bucket_ms: u64,
    bucket_grace_ms: u64,
    now_ms: u64,
    key_parts: Vec<String>,
    base: String,
    bucket_key: String,
}

fn vectors() -> Vectors {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../clients/vectors.json");
    let text = std::fs::read_to_string(path).expect("clients/vectors.json is in the repository");
    serde_json::from_str(&text).expect("clients/vectors.json parses")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_fingerprint_vector_matches() {
    let cases = vectors().fingerprints;
    assert!(cases.len() >= 20, "the vector file lost its cases");
    for case in cases {
        let value: serde_json::Value = serde_json::from_str(&case.json).unwrap();
        let mut text = String::new();
        canonical(&value, &mut text);
        assert_eq!(text, case.canonical, "canonical text of {:?}", case.name);
        let fingerprint = Fingerprint::of_json_text(&case.json).unwrap();
        assert_eq!(hex(fingerprint.as_bytes()), case.fingerprint_hex, "fingerprint of {:?}", case.name);
    }
}

#[test]
fn every_trade_key_vector_matches() {
    for case in vectors().trade_keys {
        let key = TradeKey {
            exchange: case.exchange,
            symbol: case.symbol,
            action: case.action,
            qty: case.qty,
            live: case.live,
            bucket_ms: case.bucket_ms,
            bucket_grace_ms: case.bucket_grace_ms,
        };
        let request = key.reserve("orders");
        assert_eq!(request.key_parts, case.key_parts, "key parts of {:?}", case.name);
        assert_eq!(request.key_parts.join(":"), case.base, "base of {:?}", case.name);
        let bucket = case.now_ms / case.bucket_ms;
        assert_eq!(Routing::BucketBase.bucket_key(&case.base, bucket), case.bucket_key, "{:?}", case.name);
    }
}
