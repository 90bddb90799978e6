"""The gate's calls, whatever carries them: :class:`Gate` is what :class:`~oncegate.Client`
(unary calls) and :class:`~oncegate.Session` (one ``Session`` stream) both are, with
``once`` and ``attempt`` on top."""

from __future__ import annotations

import abc
import asyncio
import logging
import sys
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Coroutine,
    Literal,
    Optional,
    Sequence,
    Set,
    TypeVar,
    Union,
    overload,
)

from . import _wire
from .keys import TradeKey
from .retry import RetryPolicy
from .types import OnceResult, Outcome, Renewed, Reserved, View

if TYPE_CHECKING:
    if sys.version_info >= (3, 10):
        from typing import ParamSpec
    else:
        from typing_extensions import ParamSpec

    from .once import Attempt, AttemptContext

    P = ParamSpec("P")

__all__ = ["Gate", "OnCancel", "Work"]

T = TypeVar("T")
log = logging.getLogger("oncegate")

#: What a cancelled work does with its key: ``"keep"`` it until its lease ends (the
#: default: the next attempt is told ``previous = ABANDONED``), or ``"release"`` it at once.
OnCancel = Literal["keep", "release"]

#: A work for ``once``: called with the :class:`~oncegate.Attempt` it runs under, returns
#: the response bytes to store (``None`` stores an empty response).
Work = Callable[["Attempt"], Awaitable[Optional[bytes]]]

#: The lease ``once`` renews to, with an explicit heartbeat before the work starts, when
#: neither the grant (a server older than ``Granted.lease_ms``) nor the options say how
#: long it is: the contract's default. Without a lease in the options ``once`` sends 0,
#: and the server's ``lease_ms_default`` applies.
LEASE_DEFAULT_MS = 30_000
#: How long ``once`` waits for an attempt in progress by default.
WAIT_DEFAULT_MS = 30_000
#: How long ``once`` retries a commit while the gate is unavailable, by default (s).
COMMIT_RETRY_FOR_DEFAULT = 10.0


class Gate(abc.ABC):
    """The gate's calls (reserve, commit, release, heartbeat, get), each retried with
    the gate's :class:`RetryPolicy` when it fails in a way worth retrying, and ``once``.

    Raw calls raise :class:`~oncegate.OncegateError` (:class:`~oncegate.LeaseLostError`
    for ``lease_lost``) when refused.
    """

    def __init__(self, *, retry: RetryPolicy, server_wait_max_ms: int) -> None:
        self.retry = retry
        self.server_wait_max_ms = server_wait_max_ms
        self._background: Set[asyncio.Task[Any]] = set()

    @abc.abstractmethod
    async def _call(self, method: str, request: Any, wait_ms: int) -> Any:
        """Sends one call (``method`` is one of ``_wire.CALLS``) and returns its reply
        message; raises :class:`~oncegate.OncegateError` when refused."""

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coroutine`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # The calls ------------------------------------------------------------------------

    async def reserve(
        self,
        namespace: str,
        key: Optional[str] = None,
        *,
        key_parts: Optional[Sequence[str]] = None,
        trade: Optional[TradeKey] = None,
        bucket_ms: int = 0,
        bucket_grace_ms: int = 0,
        ttl_ms: int = 0,
        lease_ms: int = 0,
        fingerprint: bytes = b"",
        wait_ms: int = 0,
    ) -> Reserved:
        """Asks whether this attempt may proceed: granted, in progress, completed or
        mismatch. Give exactly one of ``key``, ``key_parts`` (with ``bucket_ms``) or
        ``trade``. 0 for ``ttl_ms`` / ``lease_ms`` selects the server's default;
        ``wait_ms`` parks the reserve on a key in progress for up to that long."""
        request = _wire.reserve_request(
            namespace,
            key,
            key_parts,
            trade,
            bucket_ms=bucket_ms,
            bucket_grace_ms=bucket_grace_ms,
            ttl_ms=ttl_ms,
            lease_ms=lease_ms,
            fingerprint=fingerprint,
            wait_ms=wait_ms,
        )
        return await self._reserve(request)

    async def _reserve(self, request: Any) -> Reserved:
        reply = await self.retry.run(lambda: self._call("reserve", request, request.wait_ms))
        return _wire.reserved(reply)

    async def commit(self, namespace: str, key: str, token: int, outcome: Outcome, response: bytes = b"") -> int:
        """Stores the holder's outcome and response; returns the record's expiry
        (``expires_at_ms``). A token that is not the holder's raises
        :class:`~oncegate.LeaseLostError`."""
        if outcome not in (Outcome.SUCCEEDED, Outcome.FAILED):
            raise ValueError("a commit's outcome is Outcome.SUCCEEDED or Outcome.FAILED")
        from .v1 import gate_pb2 as pb

        wire_outcome: Any = int(outcome)  # the wire number of the same enum
        request = pb.CommitRequest(namespace=namespace, key=key, token=token, outcome=wire_outcome, response=bytes(response))
        reply = await self.retry.run(lambda: self._call("commit", request, 0))
        return int(reply.expires_at_ms)

    async def release(self, namespace: str, key: str, token: int) -> None:
        """Gives the key up so that a retry may proceed."""
        from .v1 import gate_pb2 as pb

        request = pb.ReleaseRequest(namespace=namespace, key=key, token=token)
        await self.retry.run(lambda: self._call("release", request, 0))

    async def heartbeat(self, namespace: str, key: str, token: int, lease_ms: int = 0) -> Renewed:
        """Renews the holder's lease for ``lease_ms`` from now (0: the default)."""
        from .v1 import gate_pb2 as pb

        request = pb.HeartbeatRequest(namespace=namespace, key=key, token=token, lease_ms=lease_ms)
        reply = await self.retry.run(lambda: self._call("heartbeat", request, 0))
        return _wire.renewed(reply)

    async def get(self, namespace: str, key: str) -> View:
        """Reads a key's state without changing it."""
        from .v1 import gate_pb2 as pb

        request = pb.GetRequest(namespace=namespace, key=key)
        reply = await self.retry.run(lambda: self._call("get", request, 0))
        return _wire.view(reply)

    # once -------------------------------------------------------------------------------

    def attempt(
        self,
        namespace: str,
        key: Optional[str] = None,
        *,
        key_parts: Optional[Sequence[str]] = None,
        trade: Optional[TradeKey] = None,
        bucket_ms: int = 0,
        bucket_grace_ms: int = 0,
        ttl_ms: int = 0,
        lease_ms: int = 0,
        fingerprint: bytes = b"",
        wait_ms: int = WAIT_DEFAULT_MS,
        on_cancel: OnCancel = "keep",
        commit_retry_for: float = COMMIT_RETRY_FOR_DEFAULT,
    ) -> AttemptContext:
        """A guarded block: ``async with gate.attempt(...) as attempt:`` runs its body at
        most once per key (see :class:`~oncegate.once.AttemptContext`).

        The body runs only on a grant; set ``attempt.response`` to the bytes to store. A
        completed key raises :class:`~oncegate.Replayed` (outcome succeeded) or
        :class:`~oncegate.ReplayedFailure` from the ``async with`` line, and the body does
        not run.

        Args:
            namespace: the key's namespace.
            key: the idempotency key; or ``key_parts`` (with ``bucket_ms`` and
                ``bucket_grace_ms``), or a ``trade`` key.
            ttl_ms: how long the record is remembered; 0 for the server's default.
            lease_ms: the lease the work runs under, renewed by heartbeats every third of
                it; 0 takes the server's ``lease_ms_default`` (the grant says how long it
                is; from a server whose grant does not say, the lease is renewed for 30 s
                before the body runs, never assumed).
            fingerprint: the request's fingerprint (``fingerprint_json(payload)``), or
                empty to skip the payload check.
            wait_ms: how long to wait for an attempt in progress (server-side waits of
                at most ``server_wait_max_ms`` each, then polls honouring
                ``retry_after_ms``; a server that refuses the wait is polled); 0 answers
                at once. Still in progress at the end raises
                :class:`~oncegate.InProgressError`.
            on_cancel: what a body cancelled from outside does with the key.
            commit_retry_for: how long (seconds) a commit is retried with the same token
                while the gate is unavailable (a server restarting, a failover); a commit
                repeated after its answer was lost is acknowledged again. A commit still
                not confirmed then raises :class:`~oncegate.UnconfirmedError`, and the key
                stays held until its lease ends.
        """
        from .once import AttemptContext

        request = _wire.reserve_request(
            namespace,
            key,
            key_parts,
            trade,
            bucket_ms=bucket_ms,
            bucket_grace_ms=bucket_grace_ms,
            ttl_ms=ttl_ms,
            lease_ms=lease_ms,
            fingerprint=fingerprint,
            wait_ms=0,
        )
        return AttemptContext(
            self, request, wait_ms=wait_ms, on_cancel=on_cancel, commit_retry_for=commit_retry_for
        )

    @overload
    def once(
        self,
        work: Work,
        /,
        *,
        namespace: str,
        key: Optional[str] = None,
        key_parts: Optional[Sequence[str]] = None,
        trade: Optional[TradeKey] = None,
        bucket_ms: int = 0,
        bucket_grace_ms: int = 0,
        ttl_ms: int = 0,
        lease_ms: int = 0,
        fingerprint: bytes = b"",
        wait_ms: int = WAIT_DEFAULT_MS,
        on_cancel: OnCancel = "keep",
        commit_retry_for: float = COMMIT_RETRY_FOR_DEFAULT,
    ) -> Coroutine[Any, Any, OnceResult]: ...

    @overload
    def once(
        self,
        *,
        namespace: str,
        key_from: Callable[P, Union[str, TradeKey]],
        fingerprint_from: Optional[Callable[P, bytes]] = None,
        encode: Callable[[Any], bytes] = ...,
        decode: Callable[[bytes], Any] = ...,
        ttl_ms: int = 0,
        lease_ms: int = 0,
        wait_ms: int = WAIT_DEFAULT_MS,
        on_cancel: OnCancel = "keep",
        commit_retry_for: float = COMMIT_RETRY_FOR_DEFAULT,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]: ...

    def once(self, *work: Work, **options: Any) -> Any:
        """Runs a work at most once per key, in two forms.

        ``await gate.once(work, namespace=..., key=...)``: reserves the key; on a grant
        runs ``await work(attempt)`` while heartbeats keep the lease, and commits its
        bytes as succeeded. Returns the :class:`~oncegate.OnceResult` (``replayed`` when an
        earlier attempt completed the key: the work did not run). Options as
        :meth:`attempt`.

        ``@gate.once(namespace=..., key_from=...)``: a decorator for an ``async def``;
        ``key_from`` (and ``fingerprint_from``) get the call's arguments and return its key
        (a ``str`` or a :class:`~oncegate.TradeKey`). The function's return value is
        stored with ``encode`` (default: JSON) and a replay returns ``decode(stored)``;
        :func:`~oncegate.current_attempt` gives the function its lease.

        In both forms the work fails by raising :class:`~oncegate.Retryable` (the key is
        released), :class:`~oncegate.Final` (committed as failed; replays raise
        :class:`~oncegate.ReplayedFailure`) or :class:`~oncegate.Unknown` (any other
        exception too: the key is held until its lease ends); the exception propagates.
        """
        from .once import decorator, run_once

        if not work:
            return decorator(self, **options)
        if len(work) > 1:
            raise TypeError("once takes one work (and its options by keyword)")
        return run_once(self, work[0], **options)
