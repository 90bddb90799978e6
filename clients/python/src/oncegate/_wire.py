"""The one translation between the wire messages (``oncegate.v1``) and this package's
types, both ways."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .errors import OncegateError
from .keys import TradeKey
from .types import (
    Answer,
    Completed,
    Granted,
    InProgress,
    Mismatch,
    Outcome,
    Previous,
    Renewed,
    Reserved,
    State,
    View,
)
from .v1 import gate_pb2 as pb

#: The gate calls, by their names in ``SessionRequest``'s ``call`` oneof.
CALLS = ("reserve", "commit", "release", "heartbeat", "get")


def reserve_request(
    namespace: str,
    key: Optional[str],
    key_parts: Optional[Sequence[str]],
    trade: Optional[TradeKey],
    *,
    bucket_ms: int,
    bucket_grace_ms: int,
    ttl_ms: int,
    lease_ms: int,
    fingerprint: bytes,
    wait_ms: int,
) -> Any:
    """A ``ReserveRequest`` for exactly one of ``key``, ``key_parts`` or ``trade``."""
    given = sum(x is not None for x in (key, key_parts, trade))
    if given != 1:
        raise ValueError("give exactly one of key, key_parts or trade")
    if trade is not None:
        key_parts = trade.key_parts
        bucket_ms = bucket_ms or trade.bucket_ms
        bucket_grace_ms = bucket_grace_ms or trade.bucket_grace_ms
    return pb.ReserveRequest(
        namespace=namespace,
        key=key or "",
        key_parts=list(key_parts or ()),
        bucket_ms=bucket_ms,
        bucket_grace_ms=bucket_grace_ms,
        ttl_ms=ttl_ms,
        lease_ms=lease_ms,
        fingerprint=bytes(fingerprint),
        wait_ms=wait_ms,
    )


def _protocol(message: str) -> OncegateError:
    return OncegateError("unavailable", f"unexpected answer from the server: {message}")


def outcome(value: int) -> Outcome:
    """An outcome from its wire number; unknown numbers are a protocol error."""
    try:
        return Outcome(value)
    except ValueError:
        raise _protocol(f"unknown outcome {value}") from None


def reserved(reply: Any) -> Reserved:
    """A ``ReserveResponse`` as :class:`Reserved`."""
    which = reply.WhichOneof("outcome")
    answer: Answer
    if which == "granted":
        g = reply.granted
        try:
            previous = Previous(g.previous)
        except ValueError:
            raise _protocol(f"unknown previous {g.previous}") from None
        answer = Granted(g.token, g.attempt, g.lease_until_ms, g.expires_at_ms, previous, g.lease_ms)
    elif which == "in_progress":
        p = reply.in_progress
        answer = InProgress(p.attempt, p.lease_until_ms, p.retry_after_ms)
    elif which == "completed":
        c = reply.completed
        answer = Completed(c.token, outcome(c.outcome), bytes(c.response), c.completed_at_ms, c.expires_at_ms)
    elif which == "mismatch":
        answer = Mismatch(reply.mismatch.expires_at_ms)
    else:
        raise _protocol("a reserve answer without an outcome")
    return Reserved(reply.key, answer)


def renewed(reply: Any) -> Renewed:
    """A ``HeartbeatResponse`` as :class:`Renewed`."""
    return Renewed(reply.lease_until_ms, reply.expires_at_ms)


def view(reply: Any) -> View:
    """A ``GetResponse`` as :class:`View`."""
    try:
        state = State(reply.state)
    except ValueError:
        raise _protocol(f"unknown state {reply.state}") from None
    return View(
        state,
        reply.token,
        reply.attempt,
        reply.lease_until_ms,
        reply.expires_at_ms,
        outcome(reply.outcome),
        bytes(reply.response),
    )
