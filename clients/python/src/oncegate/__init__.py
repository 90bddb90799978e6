"""The Python client of oncegate, the idempotency gate.

* :class:`Client`: the gate's calls over gRPC (``grpc.aio``), with a bearer token, TLS,
  a deadline per call and retries of calls that are safe to repeat; :class:`Session`
  for many calls over one ``Session`` stream.
* ``once``, in three forms: ``await client.once(work, namespace=..., key=...)``,
  ``async with client.attempt(namespace=..., key=...) as attempt:`` and the
  ``@client.once(namespace=..., key_from=...)`` decorator.
* :func:`fingerprint_json` / :func:`fingerprint_json_text` (the canonical JSON
  fingerprint) and :class:`TradeKey`.
* :class:`oncegate.asgi.IdempotencyMiddleware`, the ``Idempotency-Key`` middleware for
  Starlette and FastAPI (import it from ``oncegate.asgi``).
"""

from .client import Client, Transport
from .errors import (
    Final,
    InProgressError,
    LeaseLostError,
    MismatchError,
    OncegateError,
    Replayed,
    ReplayedFailure,
    Retryable,
    UnconfirmedError,
    Unknown,
)
from .fingerprint import canonical_json, canonical_json_text, fingerprint_json, fingerprint_json_text
from .gate import Gate, OnCancel, Work
from .keys import TradeKey
from .once import Attempt, AttemptContext, current_attempt
from .retry import NO_RETRY, RetryPolicy
from .session import Session
from .types import (
    Completed,
    Granted,
    InProgress,
    Mismatch,
    OnceResult,
    Outcome,
    Previous,
    Renewed,
    Reserved,
    State,
    View,
)

__version__ = "0.1.0"

__all__ = [
    "NO_RETRY",
    "Attempt",
    "AttemptContext",
    "Client",
    "Completed",
    "Final",
    "Gate",
    "Granted",
    "InProgress",
    "InProgressError",
    "LeaseLostError",
    "Mismatch",
    "MismatchError",
    "OnCancel",
    "OnceResult",
    "OncegateError",
    "Outcome",
    "Previous",
    "Renewed",
    "Replayed",
    "ReplayedFailure",
    "Reserved",
    "RetryPolicy",
    "Retryable",
    "Session",
    "State",
    "Transport",
    "TradeKey",
    "UnconfirmedError",
    "Unknown",
    "View",
    "Work",
    "canonical_json",
    "canonical_json_text",
    "current_attempt",
    "fingerprint_json",
    "fingerprint_json_text",
]
