"""The remote gate: ``oncegate.v1.Gate`` over gRPC (``grpc.aio``), with a bearer token,
TLS for ``https://`` addresses (and mutual TLS), a deadline per call, and the retry
policy for calls that are safe to repeat."""

from __future__ import annotations

import asyncio
import os
from types import TracebackType
from typing import Any, List, Literal, Optional, Sequence, Tuple, Type, Union

import grpc
import grpc.aio

from .errors import CODES, OncegateError, code_of_grpc
from .gate import Gate
from .retry import RetryPolicy

__all__ = ["Client", "Transport", "error_from_rpc"]

#: How a client's calls travel: multiplexed over one ``Session`` stream (the default; a
#: reserve that may wait still goes as a unary call, so that a parked reserve never holds
#: up the stream's other calls; a server that refuses the stream gets unary calls from
#: then on), or one unary RPC per call.
Transport = Literal["unary", "session"]

PathLike = Union[str, "os.PathLike[str]"]

#: The longest pause between reconnects to a server that went away (gRPC's default is
#: 120 s): the longest pause of the retries, so that they find a restarted server soon.
RECONNECT_BACKOFF_MAX_MS = 1_000

_METHODS = {"reserve": "Reserve", "commit": "Commit", "release": "Release", "heartbeat": "Heartbeat", "get": "Get"}


def error_from_rpc(error: grpc.aio.AioRpcError) -> OncegateError:
    """A failed unary call as an :class:`OncegateError`: the stable code from the
    ``oncegate-code`` trailer (else what the gRPC code means), with the field and limit
    trailers."""
    trailers = {}
    for key, value in error.trailing_metadata() or ():
        trailers[key] = value if isinstance(value, str) else value.decode("utf-8", "replace")
    named = trailers.get("oncegate-code")
    code = named if named in CODES else code_of_grpc(error.code())
    return OncegateError.refused(
        code,
        error.details() or error.code().name.lower(),
        grpc_code=error.code(),
        field=trailers.get("oncegate-field") or None,
        limit=trailers.get("oncegate-limit") or None,
    )


def _read(path: Optional[PathLike]) -> Optional[bytes]:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


class Client(Gate):
    """A connection to an oncegate server. Use it as an async context manager (or call
    :meth:`close`); the channel is opened on first use, inside the running event loop.

    Args:
        address: ``http://host:port`` (plaintext), ``https://host:port`` (TLS), or
            ``host:port`` (plaintext).
        token: the tenant's bearer token, sent as ``authorization: Bearer <token>``.
        tls_ca: a CA certificate (PEM file) to trust instead of the system's roots.
        tls_cert, tls_key: this client's certificate and private key (PEM files), for a
            server that requires mutual TLS.
        tls_domain: the name the server's certificate must carry, when it is not the
            address's host.
        timeout_ms: the longest one call may take (a reserve's ``wait_ms`` is added).
        retry: how calls that fail with ``unavailable`` or ``resource_exhausted`` are
            retried.
        transport: ``"session"`` (default) or ``"unary"`` (see :data:`Transport`).
        server_wait_max_ms: the longest ``wait_ms`` one reserve of ``once`` asks for
            (5 s, within the server's default ``wait_ms_max`` of 30 s); ``once`` waits
            longer by asking again, and polls a server that refuses the wait (its
            ``wait_ms_max`` lower).
        channel_options: extra ``grpc.aio`` channel options. By default the channel
            reconnects to a server that went away at least every second
            (``grpc.max_reconnect_backoff_ms`` 1000, instead of gRPC's back-off up to
            120 s), so that calls retried through a server restart (a commit, for up to
            ``commit_retry_for``) find it soon after it is back.
    """

    def __init__(
        self,
        address: str = "http://127.0.0.1:50051",
        *,
        token: Optional[str] = None,
        tls_ca: Optional[PathLike] = None,
        tls_cert: Optional[PathLike] = None,
        tls_key: Optional[PathLike] = None,
        tls_domain: Optional[str] = None,
        timeout_ms: int = 10_000,
        retry: RetryPolicy = RetryPolicy(),
        transport: Transport = "session",
        server_wait_max_ms: int = 5_000,
        channel_options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        super().__init__(retry=retry, server_wait_max_ms=server_wait_max_ms)
        tls_asked = any(x is not None for x in (tls_ca, tls_cert, tls_key, tls_domain))
        if address.startswith("https://"):
            self._target, self._tls = address[len("https://") :], True
        elif address.startswith("http://"):
            self._target, self._tls = address[len("http://") :], False
        else:
            self._target, self._tls = address, tls_asked
        self._target = self._target.rstrip("/")
        if tls_asked and not self._tls:
            raise ValueError(f"TLS settings need an https:// address; {address} is plaintext")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("mutual TLS needs both tls_cert and tls_key")
        if transport not in ("unary", "session"):
            raise ValueError("transport is 'unary' or 'session'")
        self.address = address
        self.timeout_ms = timeout_ms
        self.transport: Transport = transport
        self._credentials: Optional[grpc.ChannelCredentials] = None
        options: List[Tuple[str, Any]] = list(channel_options)
        if not any(name == "grpc.max_reconnect_backoff_ms" for name, _ in options):
            options.append(("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS))
        if self._tls:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca), private_key=_read(tls_key), certificate_chain=_read(tls_cert)
            )
            if tls_domain:
                options.append(("grpc.ssl_target_name_override", tls_domain))
        self._options = options
        self._metadata: Tuple[Tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Any = None
        self._shared_session: Any = None
        self._unary_only = False

    def __repr__(self) -> str:
        return f"Client({self.address!r}, transport={self.transport!r})"

    async def __aenter__(self) -> Client:
        self._stub_or_open()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        await self.close()

    def _stub_or_open(self) -> Any:
        """The Gate stub, opening the channel on first use."""
        if self._stub is None:
            from .v1 import gate_pb2_grpc

            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
            self._stub = gate_pb2_grpc.GateStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def close(self, grace_ms: int = 5_000) -> None:
        """Closes the session stream and the channel; background releases (of cancelled
        works with ``on_cancel="release"``) get up to ``grace_ms`` to finish."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=grace_ms / 1000)
        if self._shared_session is not None:
            await self._shared_session.close()
            self._shared_session = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

    def session(self) -> Any:
        """A :class:`~oncegate.Session`: many calls over one ``Session`` stream, matched by
        id. Use it as ``async with client.session() as session:``."""
        from .session import Session

        return Session(self)

    async def _call(self, method: str, request: Any, wait_ms: int) -> Any:
        if self.transport == "session" and wait_ms == 0 and not self._unary_only:
            from .session import SessionRefused

            if self._shared_session is None:
                self._shared_session = self.session()
            try:
                return await self._shared_session._send(method, request)
            except SessionRefused:
                # The server has no Session call, or refuses this client another stream.
                self._unary_only = True
        return await self._unary(method, request, wait_ms)

    async def _unary(self, method: str, request: Any, wait_ms: int) -> Any:
        """One unary call within the client's deadline plus ``wait_ms``."""
        rpc = getattr(self._stub_or_open(), _METHODS[method])
        try:
            return await rpc(request, timeout=(self.timeout_ms + wait_ms) / 1000, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None
