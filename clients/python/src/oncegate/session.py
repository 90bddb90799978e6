"""Calls multiplexed over one ``Session`` stream (the Rust client's ``session.rs``).

Many calls in flight on one HTTP/2 stream, answered out of order and matched by ``id``.
A reader task routes the answers; a stream that ends (a reset, a server restart) is
opened again by the next call. At most the server's
``oncegate-session-calls-in-flight-max`` calls are in flight, so the server never holds
one unstarted and a cancel is always read at once. Each call carries the time its
caller has left (``timeout_ms``, written as it leaves); a caller that goes before its
answer (cancelled, or past its deadline) has a ``cancel`` sent for its call, so that the
server drops it: a reserve not yet decided is then never granted to nobody.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, Optional, Type

import grpc
import grpc.aio

from .errors import CODES, OncegateError, code_of_grpc
from .gate import Gate

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Session", "SessionRefused"]

log = logging.getLogger("oncegate")

#: Calls in flight when the server does not say its limit.
CALLS_IN_FLIGHT_DEFAULT = 1024
LIMIT_HEADER = "oncegate-session-calls-in-flight-max"


class SessionRefused(OncegateError):
    """The server has no ``Session`` call, or refused this client a stream (its tenant has
    ``sessions_max`` open): the call was not sent."""


def error_from_refusal(refusal: Any) -> OncegateError:
    """A session call's ``Refusal`` as the unary call's error would have said it."""
    try:
        grpc_code: Optional[grpc.StatusCode] = next(s for s in grpc.StatusCode if s.value[0] == refusal.grpc_code)
    except StopIteration:
        grpc_code = grpc.StatusCode.UNKNOWN
    code = refusal.code if refusal.code in CODES else code_of_grpc(grpc_code)
    return OncegateError.refused(
        code,
        refusal.message,
        grpc_code=grpc_code,
        field=refusal.field or None,
        limit=refusal.limit or None,
    )


class _Stream:
    """One open stream: its call, its reader task and the callers waiting by id."""

    def __init__(self, call: Any, limit: int) -> None:
        self.call = call
        self.limit = limit
        self.slots = asyncio.Semaphore(limit)
        self.waiting: Dict[int, asyncio.Future[Any]] = {}
        self.write_lock = asyncio.Lock()
        self.ended: Optional[OncegateError] = None
        self.reader: Optional[asyncio.Task[None]] = None

    async def read(self) -> None:
        """Routes answers to their callers until the stream ends; then every caller
        still waiting hears why."""
        ended = OncegateError("unavailable", "the session stream ended before the call was answered")
        try:
            while True:
                answer = await self.call.read()
                if answer is grpc.aio.EOF:
                    break
                waiter = self.waiting.pop(answer.id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)
        except grpc.aio.AioRpcError as error:
            from .client import error_from_rpc

            refused = error_from_rpc(error)
            ended = OncegateError(
                "unavailable", f"the session stream ended: {refused.message}", grpc_code=refused.grpc_code
            )
        except asyncio.CancelledError:
            ended = OncegateError("unavailable", "the session was closed before the call was answered")
        finally:
            self.ended = ended
            for waiter in self.waiting.values():
                if not waiter.done():
                    waiter.set_exception(ended)
            self.waiting.clear()

    async def write(self, request: Any) -> None:
        async with self.write_lock:
            await self.call.write(request)


async def _acquire(slots: asyncio.Semaphore, timeout: float) -> bool:
    """Takes a slot within ``timeout`` seconds; a cancellation is never swallowed (as
    ``asyncio.wait_for`` could before Python 3.12), and never leaves a slot taken."""
    if not slots.locked():
        await slots.acquire()
        return True
    taking = asyncio.ensure_future(slots.acquire())
    try:
        await asyncio.wait({taking}, timeout=timeout)
    except BaseException:
        if taking.done() and not taking.cancelled():
            slots.release()
        taking.cancel()
        raise
    if taking.done():
        return True
    taking.cancel()
    return False


class Session(Gate):
    """Many gate calls over one ``Session`` stream, each with exactly the unary call's
    semantics (and the client's retry policy). ``once`` and ``attempt`` work on it too.

    Open it with ``async with client.session() as session:``; the stream is opened on
    the first call (and again after it ends). A reserve that may wait (``wait_ms > 0``)
    goes as a unary call on the client: parked on the server, it must not hold up the
    stream's other calls.
    """

    def __init__(self, client: Client) -> None:
        super().__init__(retry=client.retry, server_wait_max_ms=client.server_wait_max_ms)
        self._client = client
        self._stream: Optional[_Stream] = None
        self._opening = asyncio.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    async def __aenter__(self) -> Session:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        await self.close()

    @property
    def calls_in_flight_max(self) -> Optional[int]:
        """The stream's limit of calls in flight, once open."""
        return None if self._stream is None else self._stream.limit

    async def close(self) -> None:
        """Ends the stream: calls still waiting fail with ``unavailable``."""
        self._closed = True
        await self._close_stream()

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:
            async with stream.write_lock:
                await stream.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as error:
            log.debug("session already ended: %s", error)
        stream.call.cancel()
        if stream.reader is not None:
            stream.reader.cancel()
            await asyncio.gather(stream.reader, return_exceptions=True)

    async def _open(self) -> _Stream:
        """The open stream, opening one if there is none (or it ended)."""
        async with self._opening:
            if self._closed:
                raise OncegateError("unavailable", "the session is closed")
            stream = self._stream
            if stream is not None and stream.ended is None:
                return stream
            if stream is not None:
                await self._close_stream()
            stub = self._client._stub_or_open()
            call = stub.Session(metadata=self._client._metadata)
            try:
                headers = await asyncio.wait_for(call.initial_metadata(), self._client.timeout_ms / 1000)
            except asyncio.TimeoutError:
                call.cancel()
                raise OncegateError("unavailable", "the session stream was not answered in time") from None
            if call.done():
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    details = await call.details()
                    kind = (
                        SessionRefused
                        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
                        else OncegateError
                    )
                    raise kind(code_of_grpc(code), f"no session stream: {details}", grpc_code=code)
            limit = CALLS_IN_FLIGHT_DEFAULT
            for key, value in headers or ():
                if key == LIMIT_HEADER:
                    try:
                        limit = int(value) if int(value) > 0 else limit
                    except ValueError:
                        pass
            stream = _Stream(call, limit)
            stream.reader = asyncio.ensure_future(stream.read())
            self._stream = stream
            return stream

    async def _call(self, method: str, request: Any, wait_ms: int) -> Any:
        if wait_ms > 0:
            return await self._client._unary(method, request, wait_ms)
        return await self._send(method, request)

    async def _send(self, method: str, request: Any) -> Any:
        """One call on the stream within the client's deadline; a refusal is raised."""
        from .v1 import gate_pb2 as pb

        loop = asyncio.get_running_loop()
        timeout_s = self._client.timeout_ms / 1000
        deadline = loop.time() + timeout_s
        stream = await self._open()
        if not await _acquire(stream.slots, max(deadline - loop.time(), 0)):
            raise OncegateError("unavailable", f"not sent within {self._client.timeout_ms} ms: the stream is full")
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = loop.create_future()
        sent = False
        handed_back = False
        try:
            if stream.ended is not None:
                raise stream.ended
            left_ms = int((deadline - loop.time()) * 1000)
            if left_ms <= 0:
                raise OncegateError("unavailable", f"not sent within {self._client.timeout_ms} ms")
            stream.waiting[call_id] = answer
            message = pb.SessionRequest(id=call_id, timeout_ms=left_ms, **{method: request})
            # From here the call may have left (a write cancelled midway may still have
            # been sent): a caller that goes has a cancel follow it, which does nothing
            # for an id the server never read.
            sent = True
            try:
                await stream.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as error:
                raise OncegateError("unavailable", f"the session stream ended before the call was sent: {error}") from None
            # asyncio.wait, not wait_for: before Python 3.12, wait_for could swallow the
            # caller's cancellation when the answer came at the same moment.
            await asyncio.wait({answer}, timeout=max(deadline - loop.time(), 0))
            if not answer.done():
                raise OncegateError("unavailable", f"no answer within {self._client.timeout_ms} ms")
            reply = answer.result()
        except BaseException:
            stream.waiting.pop(call_id, None)
            if sent and not answer.done() and stream.ended is None:
                # The caller has gone: take the call back; its slot is freed once the
                # cancel is written, so the cancel is read before any later call.
                handed_back = True
                self._spawn(self._cancel(stream, call_id))
            raise
        finally:
            if not handed_back:
                stream.slots.release()
        result = reply.WhichOneof("result")
        if result == "refusal":
            raise error_from_refusal(reply.refusal)
        if result != method:
            raise OncegateError("unavailable", f"a {method} was answered with a {result} reply")
        return getattr(reply, method)

    async def _cancel(self, stream: _Stream, call_id: int) -> None:
        from .v1 import gate_pb2 as pb

        try:
            await stream.write(pb.SessionRequest(id=call_id, cancel=pb.Cancel()))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as error:
            log.debug("cancel not sent; the stream ended: %s", error)
        finally:
            stream.slots.release()
