"""Keys derived from what a request is, for callers whose requests carry no idempotency
key of their own (``oncegate_client::keys``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

__all__ = ["TradeKey", "bucket_key", "derived_base"]


def derived_base(parts: Sequence[str]) -> str:
    """The base of a derived key: the parts joined by ``:``. Parts may not be empty or
    contain ``:`` (so two lists of parts never derive the same key)."""
    for part in parts:
        if not part or ":" in part:
            raise ValueError(f"a key part may not be empty or contain ':' ({part!r})")
    if not parts:
        raise ValueError("a derived key needs at least one part")
    return ":".join(parts)


def bucket_key(parts: Sequence[str], bucket_ms: int, now_ms: int) -> str:
    """The key the server derives at ``now_ms`` (by its own clock):
    ``parts.join(":") + "::" + floor(now_ms / bucket_ms)``. For inspection and tests; a
    reserve sends the parts and the server appends the bucket."""
    if bucket_ms <= 0:
        raise ValueError("bucket_ms must be positive")
    return f"{derived_base(parts)}::{now_ms // bucket_ms}"


@dataclass(frozen=True)
class TradeKey:
    """The trading gateways' key: an order is the same order when its exchange, symbol,
    action and quantity are, on the same account kind, within one time bucket:
    ``trade:{exchange}:{symbol}:{action}:{qty}:{live|test}::{bucket}``. The server appends
    the bucket (``now / bucket_ms``) by its own clock, and with ``bucket_grace_ms``
    answers a retry that crossed a boundary from the bucket before.

    Attributes:
        exchange: such as ``binance``.
        symbol: such as ``BTCUSDT``.
        action: such as ``buy`` or ``sell``.
        qty: the quantity as the order gives it (``"0.5"``); write it the same way every
            time.
        live: a live account (``live``) or a test one (``test``).
        bucket_ms: the bucket's width.
        bucket_grace_ms: how long after a bucket boundary a reserve is still answered
            from the previous bucket's key while that key holds a live record; 0 for
            never. Below ``bucket_ms``.
    """

    exchange: str
    symbol: str
    action: str
    qty: str
    live: bool
    bucket_ms: int
    bucket_grace_ms: int = 0

    @property
    def key_parts(self) -> List[str]:
        """``["trade", exchange, symbol, action, qty, "live" | "test"]``."""
        return ["trade", self.exchange, self.symbol, self.action, self.qty, "live" if self.live else "test"]

    @property
    def base(self) -> str:
        """The parts joined by ``:``, the derived key before its bucket."""
        return derived_base(self.key_parts)

    def bucket_key(self, now_ms: int) -> str:
        """The key the server derives at ``now_ms`` (its clock)."""
        return bucket_key(self.key_parts, self.bucket_ms, now_ms)
