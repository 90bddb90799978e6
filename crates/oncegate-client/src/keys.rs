//! Keys derived from what a request is, for callers whose requests carry no idempotency
//! key of their own.

use std::time::Duration;

use oncegate_core::gate::ReserveRequest;

use crate::OnceKey;

/// The trading gateways' key (docs/semantics.md, derived keys): an order is the same order
/// when its exchange, symbol, action and quantity are, on the same account kind, within
/// one time bucket: `trade:{exchange}:{symbol}:{action}:{qty}:{live|test}::{bucket}`. The
/// server appends the bucket (`now / bucket_ms`) by its own clock, and with
/// `bucket_grace_ms` answers a retry that crossed a boundary from the bucket before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TradeKey {
    /// Such as `binance`.
    pub exchange: String,
    /// Such as `BTCUSDT`.
    pub symbol: String,
    /// Such as `buy` or `sell`.
    pub action: String,
    /// The quantity as the order gives it (`0.5`); the same order must write it the same
    /// way every time.
    pub qty: String,
    /// A live account (`live`) or a test one (`test`).
    pub live: bool,
    /// The bucket's width.
    pub bucket_ms: u64,
    /// How long after a bucket boundary a reserve is still answered from the previous
    /// bucket's key while that key holds a live record; 0 for never. Below
    /// `bucket_ms`.
    pub bucket_grace_ms: u64,
}

impl TradeKey {
    /// The key's parts: `trade`, exchange, symbol, action, quantity, `live` or `test`.
    pub fn parts(&self) -> Vec<String> {
        let kind = if self.live { "live" } else { "test" };
        ["trade", &self.exchange, &self.symbol, &self.action, &self.qty, kind].map(str::to_owned).to_vec()
    }

    /// The reserve of this trade's key in `namespace` (other fields at their defaults).
    pub fn reserve(&self, namespace: &str) -> ReserveRequest {
        ReserveRequest {
            namespace: namespace.to_owned(),
            key_parts: self.parts(),
            bucket_ms: self.bucket_ms,
            bucket_grace_ms: self.bucket_grace_ms,
            ..ReserveRequest::default()
        }
    }
}

/// `once` under the trade's derived key.
impl From<&TradeKey> for OnceKey {
    fn from(trade: &TradeKey) -> OnceKey {
        OnceKey::Derived {
            parts: trade.parts(),
            bucket: Duration::from_millis(trade.bucket_ms),
            grace: Duration::from_millis(trade.bucket_grace_ms),
        }
    }
}

impl From<TradeKey> for OnceKey {
    fn from(trade: TradeKey) -> OnceKey {
        OnceKey::from(&trade)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trade_key_has_the_documented_parts() {
        let key = TradeKey {
            exchange: "binance".into(),
            symbol: "BTCUSDT".into(),
            action: "buy".into(),
            qty: "0.5".into(),
            live: true,
            bucket_ms: 60_000,
            bucket_grace_ms: 2_000,
        };
        let request = key.reserve("orders");
        assert_eq!(request.key_parts.join(":"), "trade:binance:BTCUSDT:buy:0.5:live");
        assert_eq!(
            (request.bucket_ms, request.bucket_grace_ms, request.key.as_str(), request.namespace.as_str()),
            (60_000, 2_000, "", "orders")
        );
    }
}
