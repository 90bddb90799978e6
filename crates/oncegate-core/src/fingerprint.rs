//! Canonical fingerprints of JSON payloads: the same request, however its JSON was
//! written (key order, whitespace, `1.0` or `1`), gets the same fingerprint, so a retry is
//! recognised and a different payload under the same key is a `mismatch`.
//!
//! Format 1 (the first byte of every fingerprint, so the format can change): SHA-256 of
//! the canonical text: objects with their keys sorted by their UTF-8 bytes, no
//! insignificant whitespace, strings escaped as `serde_json` writes them, integers as
//! written, and a float that is a whole number of magnitude below 2^53 written as that
//! integer (other floats in the shortest form that reads back exactly).
//!
//! Numbers are compared as the JSON parser reads them: integers within 64 bits exactly,
//! everything else as the nearest 64-bit float, so two payloads that differ only beyond a
//! float's precision (`0.30000000000000001` and `0.3`, or integers past 2^64) share a
//! fingerprint; send such values as strings. An object with a repeated key keeps the
//! last value, as most JSON parsers do.

use std::fmt::Write as _;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::Fingerprint;

/// The format byte that starts every fingerprint made here.
pub const FINGERPRINT_FORMAT: u8 = 1;

/// Floats at least this large are not rewritten as integers (their integer form would
/// not read back as the same float everywhere).
const WHOLE_FLOAT_MAX: f64 = 9_007_199_254_740_992.0;

impl Fingerprint {
    /// The canonical fingerprint of `value` as JSON (33 bytes: the format, then SHA-256).
    /// Fails only when `value` cannot be JSON (a map with non-string keys, a non-finite
    /// float).
    pub fn of_json<T: Serialize + ?Sized>(value: &T) -> Result<Fingerprint, serde_json::Error> {
        let value = serde_json::to_value(value)?;
        let mut text = String::new();
        canonical(&value, &mut text);
        let mut bytes = Vec::with_capacity(33);
        bytes.push(FINGERPRINT_FORMAT);
        bytes.extend_from_slice(&Sha256::digest(text.as_bytes()));
        Ok(Fingerprint::from_stored(bytes))
    }

    /// The canonical fingerprint of a JSON document given as text.
    pub fn of_json_text(text: &str) -> Result<Fingerprint, serde_json::Error> {
        Fingerprint::of_json(&serde_json::from_str::<serde_json::Value>(text)?)
    }
}

/// Writes `value` in the canonical form (format 1).
pub fn canonical(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => number(n, out),
        Value::String(s) => out.push_str(&Value::String(s.clone()).to_string()),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical(item, out);
            }
            out.push('}');
        }
    }
}

fn number(n: &serde_json::Number, out: &mut String) {
    if n.is_i64() || n.is_u64() {
        let _ = write!(out, "{n}");
        return;
    }
    let f = n.as_f64().unwrap_or(0.0);
    if f.fract() == 0.0 && f.abs() < WHOLE_FLOAT_MAX {
        // -0.0 and 0.0 are both 0.
        let _ = write!(out, "{}", f as i64);
    } else {
        let _ = write!(out, "{n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_whitespace_and_whole_floats_do_not_change_the_fingerprint() {
        let a = Fingerprint::of_json_text(
            r#"{"qty": 1.0, "symbol":"BTCUSDT","side":"buy","tags":["a",{"y":2,"x":1}]}"#,
        )
        .unwrap();
        let b = Fingerprint::of_json_text(
            r#"{"side":"buy","symbol":"BTCUSDT","tags":["a",{"x":1,"y":2}],"qty":1}"#,
        )
        .unwrap();
        assert_eq!(a, b);
        assert_eq!((a.as_bytes().len(), a.as_bytes()[0]), (33, FINGERPRINT_FORMAT));
        let other = Fingerprint::of_json_text(
            r#"{"side":"sell","symbol":"BTCUSDT","tags":["a",{"x":1,"y":2}],"qty":1}"#,
        )
        .unwrap();
        assert_ne!(a, other);
        // Array order is meaning, not form.
        assert_ne!(Fingerprint::of_json(&[1, 2]).unwrap(), Fingerprint::of_json(&[2, 1]).unwrap());
        assert_ne!(Fingerprint::of_json(&0.5).unwrap(), Fingerprint::of_json(&1).unwrap());
    }

    #[test]
    fn the_canonical_text_is_pinned() {
        let value: serde_json::Value =
            serde_json::from_str(r#"{ "b": [1.50, 2.0, -0.0, 1e300], "a": "é\"", "c": null }"#).unwrap();
        let mut text = String::new();
        canonical(&value, &mut text);
        assert_eq!(text, r#"{"a":"é\"","b":[1.5,2,0,1e+300],"c":null}"#);
    }

    /// Without serde_json's `float_roundtrip`, its parser rounded these to a neighbour
    /// (`9007199254740990`), so a client in another language that reads floats exactly
    /// made another fingerprint of the same document.
    #[test]
    fn a_float_is_read_as_its_nearest_double() {
        let value: serde_json::Value =
            serde_json::from_str("[9007199254740991.0, 123456789012345680000.0]").unwrap();
        let mut text = String::new();
        canonical(&value, &mut text);
        assert_eq!(text, "[9007199254740991,1.2345678901234568e+20]");
    }

    #[test]
    fn a_serialize_value_and_its_text_agree() {
        #[derive(Serialize)]
        struct Order<'a> {
            symbol: &'a str,
            qty: f64,
        }
        let typed = Fingerprint::of_json(&Order { symbol: "ETH", qty: 2.0 }).unwrap();
        assert_eq!(typed, Fingerprint::of_json_text(r#"{"qty":2,"symbol":"ETH"}"#).unwrap());
    }
}
