"""``once``: the protocol every user of the gate needs, written once (the Rust client's
``once.rs``).

Reserve the key (waiting for an attempt in progress: server-side waits, then polls
honouring ``retry_after_ms``, up to ``wait_ms``). On a grant, run the work while a
heartbeat renews the lease every third of it, concurrently with the work; commit the
work's response as *succeeded*, or a :class:`~oncegate.Final` failure as *failed*; release
the key on a :class:`~oncegate.Retryable` failure so that the next attempt may run; on an
:class:`~oncegate.Unknown` failure (or any other exception: the side effect may have
happened) do neither, and let the lease lapse so that the next attempt is granted with
``previous = ABANDONED``. A completed key replays what the first attempt stored.

The lease is the grant's ``lease_ms`` (the one asked for, or the server's
``lease_ms_default`` when none was). A grant that does not say (a server older than the
field) is renewed before the work starts with the lease asked for, or 30 s when none was:
never assumed. A commit is retried with the same token while the gate is unavailable (a
server restarting) or busy (``resource_exhausted``) for up to ``commit_retry_for`` seconds: the work ran, so its outcome
is worth waiting for.

A lease that cannot be kept (refused by the gate, or not renewed before it ran out by
this client's own, conservative clock: counted from when the reserve was sent) sets
``attempt.lost`` and cancels the work, which then raises
:class:`~oncegate.LeaseLostError`: the attempt is fenced off, and its side effects must be
checked. ``attempt.lost`` (and ``attempt.lost_signal``, a :class:`threading.Event` for
work in a thread) is set on every other end but a committed success too: the work
raised, its caller was cancelled, its commit was not confirmed. Work that left the
coroutine (a thread, a subprocess) hears from it that the attempt no longer holds the key,
before another attempt can be granted.

A reserve asks the server to wait at most ``server_wait_max_ms`` (5 s by default) at a
time; a server whose ``wait_ms_max`` is lower refuses the wait (``invalid_argument``), and
is then polled (honouring ``retry_after_ms``) for the rest of ``wait_ms``.

Three forms share this: ``async with gate.attempt(...) as attempt:`` (the block's body is
the work), ``await gate.once(work, ...)`` and the ``@gate.once(...)`` decorator.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional, Type, Union

from .errors import (
    Final,
    InProgressError,
    LeaseLostError,
    MismatchError,
    OncegateError,
    Replayed,
    ReplayedFailure,
    Retryable,
)
from .keys import TradeKey
from .retry import RetryPolicy
from .types import Completed, Granted, InProgress, Mismatch, OnceResult, Outcome, Previous

if TYPE_CHECKING:
    from .gate import Gate, OnCancel, Work

__all__ = ["Attempt", "AttemptContext", "current_attempt"]

log = logging.getLogger("oncegate")

_current: contextvars.ContextVar[Optional[Attempt]] = contextvars.ContextVar("oncegate_attempt", default=None)


def current_attempt() -> Attempt:
    """The :class:`Attempt` the calling code runs under (inside a guarded block, a work or
    a function decorated with ``@gate.once``); ``LookupError`` outside one."""
    attempt = _current.get()
    if attempt is None:
        raise LookupError("not inside a oncegate attempt")
    return attempt


class Attempt:
    """The lease a work runs under.

    Attributes:
        namespace: the key's namespace.
        key: the key (the derived one when the request had parts).
        token: the fencing token: pass it to whatever the work writes, so that a stale
            attempt's writes can be refused downstream.
        attempt: 1 for a first attempt, one more after each abandoned one.
        previous: ``Previous.ABANDONED`` when an attempt before this one was abandoned
            (its side effects may be partial: check them).
        lease_ms: the lease's length (the grant's: the one asked for, or the server's
            default); heartbeats renew it every third.
        lost: an :class:`asyncio.Event` set when this attempt no longer holds the key:
            its lease was lost (the work is then cancelled), or the attempt ended other
            than by a committed success (the work raised, its caller was cancelled, its
            commit was not confirmed). Set before the key can be granted to another
            attempt (before a release).
        lost_signal: a :class:`threading.Event` set with ``lost``, for work that runs
            outside the event loop (``asyncio.to_thread``, a thread watching a
            subprocess): ``attempt.lost_signal.wait(...)`` or ``.is_set()``.
        response: the bytes to store when the block ends without an exception (the
            block form sets it; ``once`` sets it from the work's return value).
    """

    def __init__(self, namespace: str, key: str, granted: Granted, lease_ms: int, valid_until: float) -> None:
        self.namespace = namespace
        self.key = key
        self.token = granted.token
        self.attempt = granted.attempt
        self.previous = granted.previous
        self.expires_at_ms = granted.expires_at_ms
        self.lease_ms = lease_ms
        self.lost = asyncio.Event()
        self.lost_signal = threading.Event()
        self.response: bytes = b""
        self._valid_until = valid_until

    @property
    def abandoned_before(self) -> bool:
        """Whether an earlier attempt was abandoned (check its side effects)."""
        return self.previous == Previous.ABANDONED

    @property
    def deadline(self) -> float:
        """When the lease ends unless renewed, on the event loop's clock
        (``loop.time()``), counted conservatively from before the call that set it."""
        return self._valid_until

    def _mark_lost(self) -> None:
        """This attempt no longer holds the key (or may not): tells the work, in the
        loop and outside it. Called on the event loop's thread."""
        self.lost_signal.set()
        self.lost.set()

    def remaining_ms(self) -> int:
        """Milliseconds of lease left by this client's count (0 once it ran out)."""
        left = self._valid_until - asyncio.get_running_loop().time()
        return max(0, int(left * 1000))

    def __repr__(self) -> str:
        return (
            f"Attempt(namespace={self.namespace!r}, key={self.key!r}, token={self.token}, "
            f"attempt={self.attempt}, previous={self.previous.name})"
        )


def _uncancel(task: asyncio.Task[Any]) -> int:
    """Takes back one cancellation request of ``task``; the requests left (Python 3.11+;
    before that cancellations cannot be counted, and 0 is returned)."""
    if sys.version_info >= (3, 11):
        return task.uncancel()
    return 0


class AttemptContext:
    """``async with gate.attempt(...) as attempt:``: the block's body is the work.

    * On a grant the body runs with the :class:`Attempt`; heartbeats renew the lease
      meanwhile. Leaving the body normally commits ``attempt.response`` as succeeded
      (``self.result`` is then the :class:`~oncegate.OnceResult`).
    * A completed key raises :class:`~oncegate.Replayed` from the ``async with`` line (its
      ``result`` carries the stored response) and the body does **not** run; a stored
      failure raises :class:`~oncegate.ReplayedFailure` instead.
    * The body raising :class:`~oncegate.Retryable` releases the key;
      :class:`~oncegate.Final` commits a failure with its ``response``;
      :class:`~oncegate.Unknown`, any other exception, or a cancellation (with
      ``on_cancel="keep"``) leaves the key held until its lease ends. The exception
      propagates.
    * A lost lease cancels the body and raises :class:`~oncegate.LeaseLostError`.
    * Mismatch raises :class:`~oncegate.MismatchError`; still in progress when the wait
      ends raises :class:`~oncegate.InProgressError`; a gate failure before the grant
      raises :class:`~oncegate.OncegateError` (nothing ran).
    """

    def __init__(
        self, gate: Gate, request: Any, *, wait_ms: int, on_cancel: OnCancel, commit_retry_for: float = 10.0
    ) -> None:
        self._gate = gate
        self._request = request
        self._wait_ms = wait_ms
        self._on_cancel = on_cancel
        self._commit_retry_for = commit_retry_for
        self._attempt: Optional[Attempt] = None
        self._task: Optional[asyncio.Task[Any]] = None
        self._keeper: Optional[asyncio.Task[None]] = None
        self._context_token: Optional[contextvars.Token[Optional[Attempt]]] = None
        self._exiting = False
        self._cancelled_by_us = False
        #: The replay raised by ``__aenter__``, if it raised one.
        self.replayed: Optional[Replayed] = None
        #: The result once the body ended and its commit was acknowledged.
        self.result: Optional[OnceResult] = None

    async def __aenter__(self) -> Attempt:
        if self._attempt is not None:
            raise RuntimeError("an attempt context is entered once")
        loop = asyncio.get_running_loop()
        reserved, sent = await self._reserve_waiting()
        answer = reserved.answer
        if isinstance(answer, Completed):
            result = OnceResult(
                key=reserved.key,
                token=answer.token,
                outcome=answer.outcome,
                response=answer.response,
                replayed=True,
                completed_at_ms=answer.completed_at_ms,
                attempt=None,
                previous=Previous.NONE,
                expires_at_ms=answer.expires_at_ms,
            )
            if answer.outcome != Outcome.SUCCEEDED:
                raise ReplayedFailure(result)
            self.replayed = Replayed(result)
            raise self.replayed
        if isinstance(answer, Mismatch):
            raise MismatchError(reserved.key, answer.expires_at_ms)
        if isinstance(answer, InProgress):  # pragma: no cover - _reserve_waiting raises
            raise InProgressError(reserved.key, answer.retry_after_ms, answer.attempt)
        from .gate import LEASE_DEFAULT_MS

        # The grant says how long the lease is. A server older than the field says 0:
        # the lease asked for is counted with; asked for none (the server's default, of
        # unknown length), the lease is renewed with a known one before the work starts
        # (counted as already over), never assumed.
        if int(answer.lease_ms) > 0:
            lease_ms = int(answer.lease_ms)
            valid_until = sent + lease_ms / 1000
        elif int(self._request.lease_ms) > 0:
            lease_ms = int(self._request.lease_ms)
            valid_until = sent + lease_ms / 1000
        else:
            lease_ms = LEASE_DEFAULT_MS
            valid_until = sent
        lease_s = lease_ms / 1000
        namespace = self._request.namespace
        attempt = Attempt(namespace, reserved.key, answer, lease_ms, valid_until)
        # A grant that came after its lease would have ended by this client's count (a
        # long wait, retries), or whose lease is unknown, is renewed before the work
        # starts, or given up.
        if loop.time() >= attempt._valid_until:
            renewing = loop.time()
            try:
                await self._gate.heartbeat(namespace, attempt.key, attempt.token, lease_ms)
            except OncegateError as error:
                raise LeaseLostError(
                    message=f"the grant of {attempt.key!r} came after its lease ended and could not be renewed",
                    token=attempt.token,
                ) from error
            attempt._valid_until = renewing + lease_s
        self._attempt = attempt
        self._task = asyncio.current_task()
        self._keeper = asyncio.ensure_future(self._keep(attempt))
        self._context_token = _current.set(attempt)
        return attempt

    async def _reserve_waiting(self) -> tuple[Any, float]:
        """Reserves, waiting for an attempt in progress up to ``wait_ms``; returns the
        answer that is not *in progress* and when its reserve was sent.

        The server is asked to wait (at most ``server_wait_max_ms`` per reserve); one
        whose ``wait_ms_max`` is lower refuses the reserve with ``invalid_argument``,
        which is sent again at once without a wait, and the rest of the wait is polled.
        A second ``invalid_argument`` is the request's own fault, and raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_ms / 1000
        request = self._request
        server_waits = True
        while True:
            left_ms = int((deadline - loop.time()) * 1000)
            request.wait_ms = max(0, min(left_ms, self._gate.server_wait_max_ms)) if server_waits else 0
            sent = loop.time()
            try:
                reserved = await self._gate._reserve(request)
            except OncegateError as error:
                if error.code == "invalid_argument" and request.wait_ms > 0:
                    log.debug("the server refused to wait %d ms; polling instead: %s", request.wait_ms, error)
                    server_waits = False
                    continue
                raise
            answer = reserved.answer
            if not isinstance(answer, InProgress):
                return reserved, sent
            left = deadline - loop.time()
            if left <= 0:
                raise InProgressError(reserved.key, answer.retry_after_ms, answer.attempt)
            await asyncio.sleep(min(max(answer.retry_after_ms, 1) / 1000, left))

    async def _keep(self, attempt: Attempt) -> None:
        """Heartbeats every third of the lease until cancelled; marks the lease lost (and
        cancels the body) when the gate refuses a heartbeat or the lease runs out
        unrenewed. After a failed beat the next is tried within half of what is left."""
        loop = asyncio.get_running_loop()
        lease_s = attempt.lease_ms / 1000
        every = max(lease_s / 3, 0.001)
        next_beat = attempt._valid_until - (lease_s - every)
        while not self._exiting:
            now = loop.time()
            if now >= attempt._valid_until:
                return self._lose(attempt, "the lease ran out before a heartbeat renewed it")
            if now < next_beat:
                await asyncio.sleep(min(next_beat, attempt._valid_until) - now)
                continue
            sent = now
            beat = asyncio.ensure_future(
                self._gate.heartbeat(attempt.namespace, attempt.key, attempt.token, attempt.lease_ms)
            )
            try:
                # asyncio.wait, not wait_for: before Python 3.12, wait_for could swallow
                # this task's cancellation when the beat ended at the same moment.
                await asyncio.wait({beat}, timeout=attempt._valid_until - sent)
            finally:
                if not beat.done():
                    beat.cancel()
            if self._exiting:
                return
            if not beat.done() or beat.cancelled():
                return self._lose(attempt, "the lease ran out while a heartbeat was in flight")
            error = beat.exception()
            if error is not None:
                if isinstance(error, OncegateError) and error.code in ("lease_lost", "not_found", "already_completed"):
                    return self._lose(attempt, f"the heartbeat was refused: {error}")
                log.warning("heartbeat failed; the lease runs on until it is renewed or ends: %s", error)
                now = loop.time()
                left = attempt._valid_until - now
                next_beat = now + max(min(every, left / 2), 0.001)
                continue
            attempt._valid_until = sent + lease_s
            next_beat = sent + every

    def _lose(self, attempt: Attempt, why: str) -> None:
        log.warning("lease of %r (token %d) lost: %s; the work is cancelled", attempt.key, attempt.token, why)
        # The body is cancelled before the event is set: a body woken by the event first
        # could see the cancellation swallowed (asyncio.wait_for before Python 3.12).
        if not self._exiting and self._task is not None:
            self._cancelled_by_us = True
            self._task.cancel()
        attempt._mark_lost()

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        attempt = self._attempt
        assert attempt is not None and self._task is not None and self._keeper is not None
        # Synchronously, before any await: the keeper can no longer cancel the body.
        self._exiting = True
        self._keeper.cancel()
        if self._context_token is not None:
            _current.reset(self._context_token)
        if exc_type is not None:
            # The work raised, or its caller was cancelled: whatever becomes of the key
            # (released below, committed as failed, or held until its lease ends), this
            # attempt is over, and work that left the coroutine hears so before another
            # attempt may be granted.
            attempt._mark_lost()
        if self._cancelled_by_us:
            if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
                # A cancellation not yet delivered (the body ended first) is taken here.
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    pass
            if _uncancel(self._task) > 0:
                raise asyncio.CancelledError()
            raise LeaseLostError(
                message=f"the lease of {attempt.key!r} was lost while the work ran; the work was cancelled",
                token=attempt.token,
            ) from None
        if exc_type is None:
            try:
                await self._commit(attempt, Outcome.SUCCEEDED, attempt.response, None)
            except BaseException:
                # Not confirmed (or fenced, or the caller cancelled while it was sent):
                # the key is no longer surely this attempt's.
                attempt._mark_lost()
                raise
            return False
        if issubclass(exc_type, Retryable):
            try:
                await self._gate.release(attempt.namespace, attempt.key, attempt.token)
            except OncegateError as error:
                # Already released by a lost answer's retry, or fenced: nothing to do; or
                # not confirmed: the key frees when its lease ends.
                log.debug("the release after a retryable failure was not confirmed: %s", error)
            return False
        if issubclass(exc_type, Final):
            assert isinstance(exc, Final)
            await self._commit(attempt, Outcome.FAILED, exc.response, exc)
            return False
        if issubclass(exc_type, asyncio.CancelledError) and self._on_cancel == "release":
            self._gate._spawn(self._release_cancelled(attempt))
        # Unknown, any other exception, or a cancellation: the key is held until its
        # lease ends, and the next attempt is told the previous one was abandoned.
        return False

    async def _release_cancelled(self, attempt: Attempt) -> None:
        try:
            await self._gate.release(attempt.namespace, attempt.key, attempt.token)
        except OncegateError as error:
            log.warning("could not release a key whose work was cancelled; it frees when its lease ends: %s", error)

    async def _commit(self, attempt: Attempt, outcome: Outcome, response: bytes, cause: Optional[BaseException]) -> None:
        """Commits the work's end, retried with the same token while the gate is
        unavailable (a restarting server; a commit repeated after its answer was lost is
        acknowledged again) for up to ``commit_retry_for`` seconds, with jittered
        back-off. A commit that still fails leaves the key held until its lease ends: the
        work ran, so it must not be freed for another run; the next attempt finds it
        abandoned and can check the first one's effects."""
        loop = asyncio.get_running_loop()
        until = loop.time() + max(self._commit_retry_for, 0.0)
        pauses = _COMMIT_PAUSES
        tried = 0
        while True:
            tried += 1
            try:
                expires_at_ms = await self._gate.commit(attempt.namespace, attempt.key, attempt.token, outcome, response)
                break
            except OncegateError as error:
                if error.code in ("lease_lost", "conflict"):
                    raise LeaseLostError(
                        message=f"the attempt holding token {attempt.token} of {attempt.key!r} was fenced off: {error.message}",
                        grpc_code=error.grpc_code,
                        token=attempt.token,
                    ) from (cause or error)
                left = until - loop.time()
                if not (RetryPolicy.retries(error) and left > 0):
                    from .errors import UnconfirmedError

                    raise UnconfirmedError(attempt.key, attempt.token, response, error) from (cause or error)
                log.debug("commit of %r not confirmed (try %d); trying again with the same token: %s", attempt.key, tried, error)
                await asyncio.sleep(min(pauses.pause_ms(tried) / 1000, left))
        self.result = OnceResult(
            key=attempt.key,
            token=attempt.token,
            outcome=outcome,
            response=response,
            replayed=False,
            completed_at_ms=None,
            attempt=attempt.attempt,
            previous=attempt.previous,
            expires_at_ms=expires_at_ms,
        )


#: The pauses between a commit's tries (their bounds; the tries are bounded by time).
_COMMIT_PAUSES = RetryPolicy()


def _options(
    gate: Gate,
    *,
    namespace: str,
    key: Optional[str] = None,
    key_parts: Optional[Any] = None,
    trade: Optional[TradeKey] = None,
    bucket_ms: int = 0,
    bucket_grace_ms: int = 0,
    ttl_ms: int = 0,
    lease_ms: int = 0,
    fingerprint: bytes = b"",
    wait_ms: Optional[int] = None,
    on_cancel: OnCancel = "keep",
    commit_retry_for: Optional[float] = None,
) -> AttemptContext:
    from .gate import COMMIT_RETRY_FOR_DEFAULT, WAIT_DEFAULT_MS

    return gate.attempt(
        namespace,
        key,
        key_parts=key_parts,
        trade=trade,
        bucket_ms=bucket_ms,
        bucket_grace_ms=bucket_grace_ms,
        ttl_ms=ttl_ms,
        lease_ms=lease_ms,
        fingerprint=fingerprint,
        wait_ms=WAIT_DEFAULT_MS if wait_ms is None else wait_ms,
        on_cancel=on_cancel,
        commit_retry_for=COMMIT_RETRY_FOR_DEFAULT if commit_retry_for is None else commit_retry_for,
    )


async def run_once(gate: Gate, work: Work, **options: Any) -> OnceResult:
    """``await gate.once(work, ...)`` (see :meth:`Gate.once`)."""
    context = _options(gate, **options)
    try:
        async with context as attempt:
            response = await work(attempt)
            attempt.response = b"" if response is None else bytes(response)
    except Replayed as replay:
        if replay is not context.replayed:
            raise
        return replay.result
    assert context.result is not None
    return context.result


def _json_encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _json_decode(data: bytes) -> Any:
    return json.loads(data.decode("utf-8")) if data else None


def decorator(
    gate: Gate,
    *,
    namespace: str,
    key_from: Callable[..., Union[str, TradeKey]],
    fingerprint_from: Optional[Callable[..., bytes]] = None,
    encode: Callable[[Any], bytes] = _json_encode,
    decode: Callable[[bytes], Any] = _json_decode,
    **options: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@gate.once(namespace=..., key_from=...)`` (see :meth:`Gate.once`)."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            key = key_from(*args, **kwargs)
            where: dict[str, Any] = {"trade": key} if isinstance(key, TradeKey) else {"key": key}
            if fingerprint_from is not None:
                where["fingerprint"] = fingerprint_from(*args, **kwargs)
            ran: list[Any] = []

            async def work(attempt: Attempt) -> bytes:
                value = await function(*args, **kwargs)
                ran.append(value)
                return encode(value)

            result = await run_once(gate, work, namespace=namespace, **where, **options)
            return ran[0] if not result.replayed and ran else decode(result.response)

        return guarded

    return wrap
