"""Errors: what the gate refused (:class:`OncegateError` and its kinds), and what a work
raises to say how it failed (:class:`Retryable`, :class:`Final`, :class:`Unknown`).

Every refusal is an :class:`OncegateError` carrying oncegate's stable ``code`` (read from
the ``oncegate-code`` trailer of a unary call, or the ``Refusal`` of a session call), the
gRPC status code, the request ``field`` at fault for ``invalid_argument`` and the
``limit`` reached for ``resource_exhausted``. ``retryable`` says whether the same call may
succeed if sent again (``unavailable``, ``resource_exhausted``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import grpc

if TYPE_CHECKING:
    from .types import OnceResult

__all__ = [
    "CODES",
    "Final",
    "InProgressError",
    "LeaseLostError",
    "MismatchError",
    "OncegateError",
    "ReplayedFailure",
    "Replayed",
    "Retryable",
    "UnconfirmedError",
    "Unknown",
    "code_of_grpc",
]

#: The stable codes of the contract (docs/semantics.md, "Error codes").
CODES = (
    "lease_lost",
    "conflict",
    "already_completed",
    "not_found",
    "invalid_argument",
    "unauthenticated",
    "unavailable",
    "resource_exhausted",
)

#: Codes worth sending the same call again for: the server or the network could not
#: serve it, or a bounded queue was full. Every other refusal is final.
RETRYABLE_CODES = frozenset({"unavailable", "resource_exhausted"})


def code_of_grpc(status: grpc.StatusCode) -> str:
    """The stable code a gRPC status means when the server named none (a status made by
    the transport, a proxy, or an older server): the Rust client's mapping."""
    if status in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return "invalid_argument"
    if status == grpc.StatusCode.NOT_FOUND:
        return "not_found"
    if status in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
    ):
        return "conflict"
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "resource_exhausted"
    if status in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return "unauthenticated"
    # Unavailable, a deadline, a cancelled or reset stream, an unknown or internal error:
    # the call may not have reached the server, or its answer did not come back.
    return "unavailable"


class OncegateError(Exception):
    """A call the gate refused, or that got no answer; also the base of every error
    ``once`` raises on its own account.

    Attributes:
        code: the stable oncegate code (``lease_lost``, ``not_found``, ``unavailable``,
            ...; for the kinds below also ``mismatch``, ``in_progress``).
        grpc_code: the gRPC status code it came with (``None`` when no call failed).
        message: the server's (or the transport's) message.
        field: the request field at fault, for ``invalid_argument``.
        limit: the configuration key of the limit reached, for ``resource_exhausted``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        grpc_code: Optional[grpc.StatusCode] = None,
        field: Optional[str] = None,
        limit: Optional[str] = None,
    ) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message
        self.grpc_code = grpc_code
        self.field = field
        self.limit = limit

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed if sent again."""
        return self.code in RETRYABLE_CODES

    @classmethod
    def refused(
        cls,
        code: str,
        message: str,
        *,
        grpc_code: Optional[grpc.StatusCode] = None,
        field: Optional[str] = None,
        limit: Optional[str] = None,
    ) -> OncegateError:
        """The error of a refusal: :class:`LeaseLostError` for ``lease_lost``, otherwise
        :class:`OncegateError`."""
        kind = LeaseLostError if code == "lease_lost" else OncegateError
        return kind(code, message, grpc_code=grpc_code, field=field, limit=limit)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class LeaseLostError(OncegateError):
    """The token is no longer the key's holder: another attempt took the key over (a
    stale commit, heartbeat or release), or ``once`` lost its lease while the work ran
    (then the work was cancelled, and its side effects must be checked).

    ``token`` is the fenced token when ``once`` raised it, else ``None``.
    """

    def __init__(
        self,
        code: str = "lease_lost",
        message: str = "the lease was lost",
        *,
        grpc_code: Optional[grpc.StatusCode] = None,
        field: Optional[str] = None,
        limit: Optional[str] = None,
        token: Optional[int] = None,
    ) -> None:
        super().__init__(code, message, grpc_code=grpc_code, field=field, limit=limit)
        self.token = token


class MismatchError(OncegateError):
    """The key is held (or completed) with another request's fingerprint: the same key
    was used for a different payload. Nothing ran."""

    def __init__(self, key: str, expires_at_ms: int) -> None:
        super().__init__("mismatch", f"the key {key!r} was used with another payload")
        self.key = key
        self.expires_at_ms = expires_at_ms


class InProgressError(OncegateError):
    """Another attempt still held the key when the wait ended: nothing ran, and this is
    not a success. Try again after ``retry_after_ms``."""

    def __init__(self, key: str, retry_after_ms: int, attempt: int) -> None:
        super().__init__("in_progress", f"the key {key!r} is in progress (attempt {attempt})")
        self.key = key
        self.retry_after_ms = retry_after_ms
        self.attempt = attempt


class UnconfirmedError(OncegateError):
    """The work ran, but its commit could not be confirmed (the gate failed after the
    retries, or the record was gone: ``not_found`` when the ttl ran out first). The key
    stays held until its lease ends; the next attempt is granted with
    ``previous = ABANDONED`` (or is replayed, if the commit was applied after all).

    ``response`` is what the work returned, which may not be stored; ``__cause__`` is the
    gate's error.
    """

    def __init__(self, key: str, token: int, response: bytes, cause: OncegateError) -> None:
        super().__init__(
            cause.code,
            f"the work ran (token {token}) but its commit of {key!r} could not be confirmed: {cause.message}",
            grpc_code=cause.grpc_code,
            field=cause.field,
            limit=cause.limit,
        )
        self.key = key
        self.token = token
        self.response = response


class Replayed(Exception):
    """Raised by ``async with client.attempt(...)`` when the key was completed with
    outcome *succeeded*: the block's body does not run, and ``result`` carries the stored
    response. (A stored failure raises :class:`ReplayedFailure` instead, so that it never
    reads as a success.)"""

    def __init__(self, result: OnceResult) -> None:
        super().__init__(f"the key {result.key!r} was completed by token {result.token}; replayed")
        self.result = result

    @property
    def response(self) -> bytes:
        """The stored response."""
        return self.result.response


# What a work raises ----------------------------------------------------------------


class Retryable(Exception):
    """Raise from a work (or a guarded block) that failed in a way worth another attempt,
    before any side effect: the key is released, so the next attempt runs the work, and
    this exception propagates. Wrap a cause with ``raise Retryable("...") from error``."""


class Final(Exception):
    """Raise from a work that failed for good: the failure is committed with ``response``
    (outcome *failed*), later attempts replay it (as :class:`ReplayedFailure`), and this
    exception propagates."""

    def __init__(self, message: str = "the work failed for good", *, response: bytes = b"") -> None:
        super().__init__(message)
        self.response = response


class Unknown(Exception):
    """Raise from a work that cannot tell whether its side effect happened (a call that
    timed out after it was sent): neither committed nor released. The key stays held until
    its lease ends, and the next attempt is granted with ``previous = ABANDONED`` so that it
    checks before it acts. Any exception that is none of the three is treated the same
    way."""


class ReplayedFailure(Final, OncegateError):
    """The key was completed with outcome *failed*: this is the stored failure, replayed
    (the work did not run now). A :class:`Final` (``response`` is the stored one) and an
    :class:`OncegateError` with code ``failed``; ``result`` is the whole replay."""

    def __init__(self, result: OnceResult) -> None:
        OncegateError.__init__(
            self, "failed", f"the key {result.key!r} was completed as failed by token {result.token}; replayed"
        )
        self.response = result.response
        self.result = result
