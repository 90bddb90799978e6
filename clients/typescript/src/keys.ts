/**
 * Keys derived from what a request is, for callers whose requests carry no idempotency key
 * of their own (docs/semantics.md, "derived keys"; crates/oncegate-client/src/keys.rs).
 */

/** The trading gateways' key: the same order within one time bucket is the same order. */
export interface TradeKeyInit {
  /** Such as `binance`. */
  exchange: string;
  /** Such as `BTCUSDT`. */
  symbol: string;
  /** Such as `buy` or `sell`. */
  action: string;
  /** The quantity as the order writes it (`0.5`), the same way every time. */
  qty: string;
  /** A live account (`live`) or a test one (`test`). */
  live: boolean;
  /** The bucket's width, in milliseconds. */
  bucketMs: number;
  /** How long after a bucket boundary a reserve is answered from the previous bucket's key while that key holds a live record; 0 for never. Below `bucketMs`. */
  bucketGraceMs?: number;
}

/** What a reserve sends for a derived key. */
export interface DerivedKey {
  keyParts: string[];
  bucketMs: number;
  bucketGraceMs: number;
}

/**
 * `trade:{exchange}:{symbol}:{action}:{qty}:{live|test}::{bucket}`: the server appends the
 * bucket (`floor(now / bucketMs)`) by its own clock.
 */
export class TradeKey implements DerivedKey {
  readonly exchange: string;
  readonly symbol: string;
  readonly action: string;
  readonly qty: string;
  readonly live: boolean;
  readonly bucketMs: number;
  readonly bucketGraceMs: number;

  constructor(init: TradeKeyInit) {
    this.exchange = init.exchange;
    this.symbol = init.symbol;
    this.action = init.action;
    this.qty = init.qty;
    this.live = init.live;
    this.bucketMs = init.bucketMs;
    this.bucketGraceMs = init.bucketGraceMs ?? 0;
  }

  /** `["trade", exchange, symbol, action, qty, "live" | "test"]`. */
  get keyParts(): string[] {
    return ['trade', this.exchange, this.symbol, this.action, this.qty, this.live ? 'live' : 'test'];
  }

  /** The parts joined by `:`, the derived key before its bucket. */
  get base(): string {
    return this.keyParts.join(':');
  }

  /** The key the server derives at `nowMs` (by its clock): `base::floor(now / bucketMs)`. */
  bucketKey(nowMs: number | bigint): string {
    return derivedKey(this.keyParts, this.bucketMs, nowMs);
  }
}

/** `parts.join(":") + "::" + floor(nowMs / bucketMs)`, as the server derives it. */
export function derivedKey(parts: readonly string[], bucketMs: number | bigint, nowMs: number | bigint): string {
  return `${parts.join(':')}::${BigInt(nowMs) / BigInt(bucketMs)}`;
}
