"""``IdempotencyMiddleware``: the rules of ``oncegate proxy`` (docs/proxy.md) as a pure
ASGI middleware, for Starlette, FastAPI and any ASGI application.

A guarded request (by default ``POST`` and ``PATCH``) carrying an ``Idempotency-Key``
header runs the application at most once per key; its retries get the stored answer
(status, ``Content-Type``, ``Location`` and the body, byte for byte) with
``Idempotent-Replayed: true``.

===========================================================  =============================
the request                                                   the answer
===========================================================  =============================
not guarded, or no key (and none required)                    passed through
no key on a path in ``key_required_prefixes``                 ``400`` problem
two different keys; none of ``caller_headers`` (unless        ``400`` problem
anonymous callers share keys); a bad key
headers over ``headers_bytes_max`` / body over                ``431`` / ``413`` problem
``body_bytes_max`` / body slower than ``body_read_timeout_ms``  / ``408``
first with its key                                            runs; a ``2xx`` or ``4xx``
                                                              (not ``408``/``409``/``429``)
                                                              is stored; the caller gets
                                                              what is stored (and its
                                                              cookies)
a retry after the first completed                             the stored answer,
                                                              ``Idempotent-Replayed: true``
the same key while the first runs                             waits up to ``wait_ms``, then
                                                              ``409`` with ``Retry-After``
the same key with another payload                             ``422`` problem (``mismatch``)
a ``5xx`` (a status not stored), a soft failure, or the      the key is released; the
application raising                                           answer passed on (the
                                                              exception re-raised)
an answer to store that cannot be stored whole: over         passed on whole with a
``stored_bytes_max`` (at least 256), encoded (the             ``Warning``; stored without
application compressed it on its own: the request's          its body, so a retry gets the
``Accept-Encoding`` never reaches it), or past the bound      status and stored headers, an
below                                                         empty body and a ``Warning``
an answer body past the larger of ``body_bytes_max`` and      what was read and the rest
``stored_bytes_max``                                          passed on as it comes; stored
                                                              without its body once it
                                                              ends (released for a status
                                                              not stored), or held until
                                                              its lease ends if it is cut
                                                              short
the application past ``handler_timeout_ms``                   ``504`` "outcome unknown"; the
                                                              key held until its lease ends
===========================================================  =============================

When the middleware stops waiting for the application (its time is up, or it failed),
the attempt is marked lost (``attempt.lost`` and ``attempt.lost_signal``, see
:class:`~oncegate.Attempt`) before anything else, so that work it left running in a thread
stops before another attempt may be granted. An answer already passed on in part (past
the bound above) is never followed by a problem: when it cannot be finished, the
connection is ended instead (the middleware raises, and the server closes it).

The record key is ``"{method} {path} {caller} {key}"``: the caller is ``t:<tenant>`` from
``tenant_header`` when one is configured, else ``c:<hash>`` of the ``Authorization``
value (the default ``caller_headers``) or ``h:<hash>`` of every configured caller
header, so one caller's key never answers another's request. The payload's fingerprint
covers the method, the path and query, the ``fingerprint_headers`` and the body (JSON in
canonical form: spacing and member order do not count). The application sees the
attempt in ``oncegate-token``, ``oncegate-attempt`` and ``oncegate-previous: abandoned``
request headers (a client's own are dropped): compare the token as an integer.

The guarded request runs in a task of its own: a client that disconnects does not cancel
it; its answer is stored and the client's retry gets it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any, Awaitable, Callable, Dict, List, MutableMapping, Optional, Sequence, Set, Tuple

from ._http import Answer, Headers, StoredStatuses, canonical_as_written, decode_stored, encode_stored, problem, retry_after_s
from .errors import (
    InProgressError,
    LeaseLostError,
    MismatchError,
    OncegateError,
    ReplayedFailure,
    Retryable,
    UnconfirmedError,
    Unknown,
    Final,
)
from .fingerprint import fingerprint_json, loads_strict
from .gate import Gate
from .once import Attempt

__all__ = ["AnswerCutShort", "IdempotencyMiddleware"]

log = logging.getLogger("oncegate")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The headers that tell the application which attempt runs; only the middleware sets them.
ATTEMPT_HEADERS = (b"oncegate-token", b"oncegate-attempt", b"oncegate-previous")
#: Headers about one connection (RFC 9110, 7.6.1), never stored.
HOP_BY_HOP = (
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
)
#: Added to the handler's time for the key's lease, as the proxy adds it.
LEASE_MARGIN_MS = 5_000


class _PassOn(Retryable):
    """An answer that is not stored: passed on, and the key released."""

    def __init__(self, answer: Optional[Answer], error: Optional[BaseException] = None) -> None:
        super().__init__("the answer is not stored")
        self.answer = answer
        self.error = error


class _Held(Unknown):
    """The application may have run the request: the key is held until its lease ends.
    ``answer`` is ``None`` when the application's answer went out as it came."""

    def __init__(self, answer: Optional[Answer]) -> None:
        super().__init__("the outcome is unknown")
        self.answer = answer


class _BodyTooLarge(Exception):
    pass


class AnswerCutShort(Exception):
    """Raised to the server when the application's answer was passed on in part (past
    the bound of what is read whole) and could not be finished: a problem must not be
    mixed into it, so the connection is ended instead."""


class _Outlet:
    """The caller's side of a guarded request, for an answer passed on as it comes. A
    caller that went away (its ``send`` failed) is no longer written to; the application
    runs on."""

    def __init__(self, send: Send) -> None:
        self._send = send
        #: ``http.response.start`` was sent (or tried).
        self.started = False
        #: The last body message was sent.
        self.ended = False
        self._gone = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        if self._gone:
            return
        try:
            await self._send(message)
        except Exception as error:  # the caller went away; the request runs on
            log.debug("the caller of a guarded request went away: %r", error)
            self._gone = True
            return
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True


class IdempotencyMiddleware:
    """Guards an ASGI application by ``Idempotency-Key`` (see the module's documentation).

    ``app.add_middleware(IdempotencyMiddleware, gate=client)`` in Starlette or FastAPI,
    or ``IdempotencyMiddleware(app, gate=client)`` around any ASGI application.

    Args:
        app: the ASGI application.
        gate: a :class:`~oncegate.Client` (or :class:`~oncegate.Session`); its channel
            opens on first use.
        namespace: the gate namespace of the keys (give each application its own).
        guarded_methods: methods whose requests are guarded.
        key_header: the header carrying the key.
        key_required_prefixes: path prefixes whose guarded requests must carry a key.
        tenant_header: a header naming the caller's tenant (then required); set by the
            front that authenticates callers.
        caller_headers: without ``tenant_header``, the headers that tell callers apart
            (hashed into the key).
        anonymous_callers_share_keys: serve guarded requests carrying none of the
            ``caller_headers``, all in one key space; otherwise they get ``400``.
        key_bytes_max, headers_bytes_max, body_bytes_max, stored_bytes_max: limits.
        wait_ms: how long a retry waits for the first request's answer before ``409``.
        handler_timeout_ms: how long the application may take; the key's lease is this
            plus 5 s, renewed by heartbeats meanwhile.
        body_read_timeout_ms: how long a guarded request's body may take to arrive.
        ttl_ms: how long answers are kept for replays.
        fingerprint_headers: request headers that are part of the payload.
        stored_headers: response headers stored and replayed (never ``set-cookie``,
            ``content-length`` or a hop-by-hop header).
        stored_statuses: which statuses are stored (``"2xx"``, ``"503"``, ``"!409"``).
        soft_failure: ``(json_pointer, value)``: a ``2xx`` whose JSON body has this value
            there failed, and is released like a ``5xx``.
        key_policy_url: where the key policy is published, linked from every guarded
            answer (``Link: <URL>; rel="describedby"``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        gate: Gate,
        namespace: str = "proxy",
        guarded_methods: Sequence[str] = ("POST", "PATCH"),
        key_header: str = "idempotency-key",
        key_required_prefixes: Sequence[str] = (),
        tenant_header: Optional[str] = None,
        caller_headers: Sequence[str] = ("authorization",),
        anonymous_callers_share_keys: bool = False,
        key_bytes_max: int = 255,
        headers_bytes_max: int = 16 * 1024,
        body_bytes_max: int = 1 << 20,
        stored_bytes_max: int = 60 * 1024,
        wait_ms: int = 5_000,
        handler_timeout_ms: int = 25_000,
        body_read_timeout_ms: int = 10_000,
        ttl_ms: int = 86_400_000,
        fingerprint_headers: Sequence[str] = ("content-type",),
        stored_headers: Sequence[str] = ("content-type", "location"),
        stored_statuses: Sequence[str] = ("2xx", "4xx", "!408", "!409", "!429"),
        soft_failure: Optional[Tuple[str, Any]] = None,
        key_policy_url: Optional[str] = None,
    ) -> None:
        self.app = app
        self.gate = gate
        self.namespace = namespace
        self.guarded_methods = {m.upper() for m in guarded_methods}
        self.key_header = key_header.lower().encode("latin-1")
        self.key_required_prefixes = tuple(key_required_prefixes)
        self.tenant_header = tenant_header.lower().encode("latin-1") if tenant_header else None
        self.caller_headers = [h.lower().encode("latin-1") for h in caller_headers]
        self.anonymous_callers_share_keys = anonymous_callers_share_keys
        self.key_bytes_max = key_bytes_max
        self.headers_bytes_max = headers_bytes_max
        self.body_bytes_max = body_bytes_max
        if stored_bytes_max < 256:
            raise ValueError(
                f"stored_bytes_max is {stored_bytes_max}; it must be at least 256 (what is stored for an answer not stored whole)"
            )
        self.stored_bytes_max = stored_bytes_max
        self.wait_ms = wait_ms
        self.handler_timeout_ms = handler_timeout_ms
        self.body_read_timeout_ms = body_read_timeout_ms
        self.ttl_ms = ttl_ms
        self.fingerprint_headers = [h.lower() for h in fingerprint_headers]
        never = [h for h in stored_headers if _never_stored(h.lower().encode("latin-1"))]
        if never:
            raise ValueError(f"stored_headers: {never} are never stored")
        self.stored_headers = [h.lower().encode("latin-1") for h in stored_headers]
        self.stored_statuses = StoredStatuses(stored_statuses)
        self.soft_failure = soft_failure
        self.key_policy_url = key_policy_url
        self._running: Set[asyncio.Task[Any]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Only the middleware says which attempt runs: a client's own headers could push
        # the application's fence past real attempts or fake an abandoned one.
        headers: Headers = [(n, v) for n, v in scope["headers"] if n.lower() not in ATTEMPT_HEADERS]
        scope = dict(scope, headers=headers)
        guarded = scope["method"].upper() in self.guarded_methods
        keys = [v for n, v in headers if n.lower() == self.key_header]
        if guarded and len(set(keys)) > 1:
            detail = f"the request carries two different {self.key_header.decode()} headers"
            await _send(send, problem(400, "Conflicting Idempotency-Key", "invalid_argument", detail))
            return
        if guarded and keys:
            # On a task of its own: a client that disconnects must not cancel a request
            # the application may already be running, or its retry would run it again.
            outlet = _Outlet(send)
            task = asyncio.ensure_future(self._guard(scope, receive, keys[0], outlet))
            self._running.add(task)
            task.add_done_callback(self._finished)
            answer = await asyncio.shield(task)
            if outlet.started:
                # The application's answer went out as it came: nothing may follow it.
                if outlet.ended:
                    return
                raise AnswerCutShort("the application's answer was passed on in part and could not be finished")
            if answer is None:
                return
            answer.headers.extend(self._link())
            await _send(send, answer)
            return
        if guarded and self._requires_key(scope):
            detail = f"{scope['path']} needs an {self.key_header.decode()} header"
            await _send(send, problem(400, "Idempotency-Key required", "invalid_argument", detail))
            return
        await self.app(scope, receive, send)

    def _link(self) -> Headers:
        if not self.key_policy_url:
            return []
        return [(b"link", f'<{self.key_policy_url}>; rel="describedby"'.encode())]

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        # Retrieved here too: a caller that went away no longer awaits the task.
        if not task.cancelled() and task.exception() is not None:
            log.debug("a guarded request failed: %r", task.exception())

    def _requires_key(self, scope: Scope) -> bool:
        return any(scope["path"].startswith(prefix) for prefix in self.key_required_prefixes)

    async def _guard(self, scope: Scope, receive: Receive, key: bytes, outlet: _Outlet) -> Optional[Answer]:
        """A guarded request with its key: at most once through the application. ``None``
        when the client went away before its body arrived, or when the application's
        answer went out through ``outlet`` as it came."""
        headers: Headers = scope["headers"]
        size = sum(len(n) + len(v) for n, v in headers)
        if size > self.headers_bytes_max:
            detail = f"the headers are {size} bytes; headers_bytes_max is {self.headers_bytes_max}"
            return problem(431, "Request headers too large", "invalid_argument", detail)
        record = self._record_key(scope, key)
        if isinstance(record, Answer):
            return record
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_read_timeout_ms / 1000)
        except asyncio.TimeoutError:
            detail = f"the body did not arrive within body_read_timeout_ms ({self.body_read_timeout_ms} ms)"
            return problem(408, "Request body too slow", "unavailable", detail)
        except _BodyTooLarge:
            detail = f"the body passes body_bytes_max ({self.body_bytes_max} bytes)"
            return problem(413, "Request body too large", "invalid_argument", detail)
        if body is None:
            return None
        cookies: List[bytes] = []
        # The whole answer, for this caller only, when it was too large to store.
        whole: List[Answer] = []

        async def work(attempt: Attempt) -> bytes:
            return await self._run(scope, body, attempt, cookies, outlet, whole)

        try:
            result = await self.gate.once(
                work,
                namespace=self.namespace,
                key=record,
                ttl_ms=self.ttl_ms,
                lease_ms=self.handler_timeout_ms + LEASE_MARGIN_MS,
                wait_ms=self.wait_ms,
                fingerprint=self._fingerprint(scope, body),
            )
        except _PassOn as passed:
            if passed.error is not None:
                raise passed.error
            return passed.answer
        except _Held as held:
            return held.answer
        except ReplayedFailure as failure:
            return _replay(failure.response, replayed=True)
        except InProgressError as busy:
            detail = "a request with this Idempotency-Key is being processed; retry later"
            return problem(409, "Request in progress", "in_progress", detail, retry_after_s=retry_after_s(busy.retry_after_ms))
        except MismatchError:
            detail = "this Idempotency-Key was used with another request payload"
            return problem(422, "Idempotency-Key reused", "mismatch", detail)
        except UnconfirmedError as unconfirmed:
            # The application answered; only storing it failed. The caller gets it,
            # warned, rather than an error that would send its retry through again.
            log.warning("the answer could not be stored; passed on unstored: %s", unconfirmed)
            if whole:
                answer = whole[0]
            else:
                answer = _with_cookies(_replay(unconfirmed.response, replayed=False), cookies)
            answer.headers.append((b"warning", b'299 - "answer may not be stored; a retry may run again"'))
            return answer
        except LeaseLostError:
            if whole:
                # An answer not stored whole is the only copy the caller can get.
                whole[0].headers.append((b"warning", LOST_BEFORE_STORED))
                return whole[0]
            detail = (
                "the application may have run this request, but its answer could not be stored; "
                "do not retry blindly: check what it did"
            )
            return problem(502, "Outcome unknown", "lease_lost", detail)
        except Final:
            detail = (
                "the application may have run this request, but its answer could not be stored; "
                "do not retry blindly: check what it did"
            )
            return problem(502, "Outcome unknown", "lease_lost", detail)
        except OncegateError as error:
            if error.code == "invalid_argument":
                return problem(400, "Request refused", "invalid_argument", str(error))
            if error.code == "resource_exhausted":
                return problem(429, "Too many requests", "resource_exhausted", str(error), retry_after_s=1)
            return problem(503, "Gate unavailable", "unavailable", str(error), retry_after_s=1)
        if whole and not result.replayed:
            whole[0].headers.append((b"warning", FIRST_OF_OMITTED))
            return whole[0]
        return _with_cookies(_replay(result.response, replayed=result.replayed), [] if result.replayed else cookies)

    def _record_key(self, scope: Scope, key: bytes) -> Any:
        """``"{method} {path} {caller} {key}"``, or the ``400`` answer."""
        text = _visible_ascii(key)
        if text is None:
            return problem(400, "Invalid Idempotency-Key", "invalid_argument", "the key is not visible ASCII")
        if not text or len(text) > self.key_bytes_max:
            detail = f"the key is {len(text)} bytes; it must be 1 to {self.key_bytes_max} (key_bytes_max)"
            return problem(400, "Invalid Idempotency-Key", "invalid_argument", detail)
        caller = self._caller(scope["headers"])
        if isinstance(caller, Answer):
            return caller
        return f"{scope['method'].upper()} {_path(scope)} {caller} {text}"

    def _caller(self, headers: Headers) -> Any:
        """Who is calling, as the record key names it (``ProxyConfig::caller``)."""
        if self.tenant_header is not None:
            values = [_visible_ascii(v) for n, v in headers if n.lower() == self.tenant_header]
            tenant = values[0] if values else None
            if tenant and len(tenant) <= 64 and " " not in tenant:
                return f"t:{tenant}"
            name = self.tenant_header.decode()
            detail = f"a guarded request needs a {name} header: 1 to 64 visible ASCII characters"
            return problem(400, "Tenant required", "invalid_argument", detail)
        sent = [(header, v) for header in self.caller_headers for n, v in headers if n.lower() == header]
        if not sent:
            if self.anonymous_callers_share_keys:
                return "-"
            names = ", ".join(n.decode() for n in self.caller_headers)
            detail = (
                f"a guarded request needs one of the caller headers ({names}), which tell callers apart so that "
                "one caller's key never answers another's request"
            )
            return problem(400, "Caller required", "invalid_argument", detail)
        if sent[0][0] == b"authorization" and len(self.caller_headers) == 1:
            return "c:" + hashlib.sha256(sent[0][1]).digest()[:8].hex()
        hasher = hashlib.sha256()
        for header, value in sent:
            hasher.update(header + b":" + value + b"\n")
        return "h:" + hasher.digest()[:8].hex()

    async def _read_body(self, receive: Receive) -> Optional[bytes]:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.body_bytes_max:
                raise _BodyTooLarge()
            if not message.get("more_body", False):
                return bytes(body)

    def _fingerprint(self, scope: Scope, body: bytes) -> bytes:
        """Method, path and query, the configured headers, and the body (canonical JSON
        when it parses as JSON), fingerprinted as the proxy does."""
        headers: Dict[str, str] = {}
        for name in self.fingerprint_headers:
            values = [v for n, v in scope["headers"] if n.lower() == name.encode("latin-1")]
            value = _visible_ascii(values[0]) if values else None
            if value is not None:
                headers[name] = value
        canonical = _canonical_body(body)
        payload = {
            "method": scope["method"].upper(),
            "target": _target(scope),
            "headers": headers,
            "body": {"json": canonical} if canonical is not None else {"bytes": body.hex()},
        }
        return fingerprint_json(payload)

    async def _run(
        self, scope: Scope, body: bytes, attempt: Attempt, cookies: List[bytes], outlet: _Outlet, whole: List[Answer]
    ) -> bytes:
        """Runs the application and keeps its answer: the stored bytes, or an exception
        saying what becomes of the key. A storable answer that cannot be stored whole (too
        large, past the bound, or encoded) is stored without its body (see
        :func:`_omitted`), and goes whole to this caller through ``whole``.

        The answer is read whole up to the larger of ``body_bytes_max`` and
        ``stored_bytes_max``; past it, what was read and the rest go to the caller as
        they come (``outlet``); once it ends, the key is completed without its body
        (released for a status not stored), and if it is cut short the key is held until
        its lease ends."""
        # Asked unencoded: what is stored is replayed without a Content-Encoding.
        headers = [(n, v) for n, v in scope["headers"] if n.lower() != b"accept-encoding"]
        headers.append((b"oncegate-token", str(attempt.token).encode()))
        headers.append((b"oncegate-attempt", str(attempt.attempt).encode()))
        if attempt.abandoned_before:
            headers.append((b"oncegate-previous", b"abandoned"))
        extensions = {k: v for k, v in (scope.get("extensions") or {}).items() if k == "http.response.debug"}
        app_scope = dict(scope, headers=headers, extensions=extensions)
        delivered = False
        ended = asyncio.Event()

        async def app_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            # The request runs on whether or not its client is still there.
            await ended.wait()
            return {"type": "http.disconnect"}

        status: Optional[int] = None
        response_headers: Headers = []
        chunks: List[bytes] = []
        read = 0
        bound = max(self.body_bytes_max, self.stored_bytes_max)
        complete = False
        gave_up = False

        async def app_send(message: Message) -> None:
            nonlocal status, complete, read
            if gave_up:
                return  # the middleware no longer waits for this answer
            if message["type"] == "http.response.start":
                status = int(message["status"])
                response_headers.extend((bytes(n).lower(), bytes(v)) for n, v in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                if status is None:
                    raise RuntimeError("the application sent a response body before its start")
                chunk = bytes(message.get("body", b""))
                more = bool(message.get("more_body", False))
                if outlet.started:
                    await outlet.send({"type": "http.response.body", "body": chunk, "more_body": more})
                else:
                    chunks.append(chunk)
                    read += len(chunk)
                    if read > bound:
                        # Past what is read whole: passed on as it comes, and stored without
                        # its body once it ends.
                        out = [(n, v) for n, v in response_headers if n not in HOP_BY_HOP] + self._link()
                        if self.stored_statuses.stores(status):
                            out.append((b"warning", FIRST_OF_OMITTED))
                        await outlet.send({"type": "http.response.start", "status": status, "headers": out})
                        await outlet.send({"type": "http.response.body", "body": b"".join(chunks), "more_body": more})
                        chunks.clear()
                if not more:
                    complete = True

        def give_up(application: asyncio.Task[None]) -> None:
            # Marked lost first: work the application left in a thread stops before the
            # key can be another attempt's.
            nonlocal gave_up
            gave_up = True
            attempt._mark_lost()
            application.cancel()
            application.add_done_callback(_retrieve)

        application = asyncio.ensure_future(self.app(app_scope, app_receive, app_send))
        try:
            # asyncio.wait, not wait_for: the middleware stops waiting at the timeout,
            # even for an application that does not end when cancelled.
            done, _ = await asyncio.wait({application}, timeout=self.handler_timeout_ms / 1000)
        except BaseException:
            give_up(application)  # this request was cancelled (a lost lease, a shutdown)
            raise
        finally:
            ended.set()
        if not done:
            give_up(application)
            detail = f"no answer within handler_timeout_ms ({self.handler_timeout_ms} ms); the request may have run"
            raise _Held(problem(504, "Outcome unknown", "unavailable", detail))
        error = None if application.cancelled() else application.exception()
        if outlet.started:
            # Passed on as it came: the application ran. Ended, its key is completed
            # without the body (or released, for a status not stored); cut short, the key
            # is held, and the caller's connection is ended.
            if error is not None:
                log.warning("the application failed after its answer was passed on in part: %r", error)
            if error is not None or status is None or not complete or application.cancelled():
                raise _Held(None)
            if not self.stored_statuses.stores(status):
                raise _PassOn(None)
            kept = [(name, v) for name in self.stored_headers for n, v in response_headers if n == name]
            return _omitted(status, kept, f"more than {bound} bytes", self.stored_bytes_max)
        if application.cancelled():
            raise _Held(problem(502, "Outcome unknown", "unavailable", "the application was cancelled"))
        if error is not None:
            if not isinstance(error, Exception):
                raise error
            # As the proxy does with an upstream 5xx: released, so the retry runs again.
            raise _PassOn(problem(500, "Internal Server Error", "unavailable", "the application failed"), error) from error
        if status is None or not complete:
            detail = "the application's answer was cut short"
            raise _Held(problem(502, "Outcome unknown", "unavailable", detail))
        response_body = b"".join(chunks)
        cookies.extend(v for n, v in response_headers if n == b"set-cookie")
        passed = Answer(status, [(n, v) for n, v in response_headers if n not in HOP_BY_HOP], response_body)
        storable = self.stored_statuses.stores(status) and not self._soft_failure(response_body)
        if not storable:
            raise _PassOn(passed)
        kept = [(name, v) for name in self.stored_headers for n, v in response_headers if n == name]
        # The application ran it: an answer that cannot be stored whole completes the key
        # with its status and headers, its body left out and said so, and goes whole to
        # this caller; a retry never runs it again.
        coding = _encoding(response_headers)
        if coding is not None:
            whole.append(passed)
            return _omitted(status, kept, f"encoded ({coding})", self.stored_bytes_max)
        stored = encode_stored(status, kept, response_body)
        if len(stored) <= self.stored_bytes_max:
            return stored
        whole.append(passed)
        reason = f"{len(stored)} bytes to store, over stored_bytes_max ({self.stored_bytes_max})"
        return _omitted(status, kept, reason, self.stored_bytes_max)

    def _soft_failure(self, body: bytes) -> bool:
        if self.soft_failure is None:
            return False
        pointer, expected = self.soft_failure
        try:
            value = json.loads(body)
        except ValueError:
            return False
        found, value = _pointer(value, pointer)
        return found and value == expected and type(value) is type(expected)


FIRST_OF_OMITTED = b'299 - "answer not stored whole; a retry is answered without its body"'
LOST_BEFORE_STORED = b'299 - "lease lost before the answer was stored; a retry may run again"'


def _omitted(status: int, headers: Headers, reason: str, stored_bytes_max: int) -> bytes:
    """What is stored for an answer that cannot be stored whole (``reason`` says why): its
    status and stored headers (but ``Content-Encoding``: there is no body to decode) with
    an empty body and a ``Warning`` saying so, or, when even those are over
    ``stored_bytes_max``, the status and the warning alone. A retry is told the request
    ran and how it ended, and never runs it again. The same bytes as the proxy's."""
    text = f'299 - "the answer was not stored whole: {reason}; its body is not replayed"'
    warning = (b"warning", "".join(c if " " <= c <= "~" else "?" for c in text).encode())
    kept = [(n, v) for n, v in headers if n != b"content-encoding"]
    marker = encode_stored(status, kept + [warning], b"")
    if len(marker) <= stored_bytes_max:
        return marker
    return encode_stored(status, [warning], b"")


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Takes an abandoned application's end, so that it is not reported as never
    retrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("an application the middleware gave up on failed: %r", task.exception())


def _encoding(headers: Headers) -> Optional[str]:
    """The answer's content coding, other than ``identity``."""
    for name, value in headers:
        coding = value.strip().decode("latin-1")
        if name == b"content-encoding" and coding.lower() not in ("", "identity"):
            return coding
    return None


def _never_stored(name: bytes) -> bool:
    return name in (b"set-cookie", b"content-length") or name in HOP_BY_HOP


def _visible_ascii(value: bytes) -> Optional[str]:
    """The header value as text when it is visible ASCII (and tabs), as ``to_str`` takes it."""
    if all(32 <= b < 127 or b == 9 for b in value):
        return value.decode("ascii")
    return None


def _path(scope: Scope) -> str:
    raw = scope.get("raw_path")
    if raw:
        return bytes(raw).split(b"?", 1)[0].decode("latin-1")
    return str(scope["path"])


def _target(scope: Scope) -> str:
    query = scope.get("query_string") or b""
    return _path(scope) + ("?" + bytes(query).decode("latin-1") if query else "")


def _canonical_body(body: bytes) -> Optional[str]:
    """The body's canonical JSON text, or ``None`` when it is not JSON (as serde_json
    reads it: UTF-8, no NaN, numbers within a float's range, valid Unicode escapes)."""
    try:
        text = body.decode("utf-8")
        value = loads_strict(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):
        return None
    return canonical_as_written(text)


def _pointer(value: Any, pointer: str) -> Tuple[bool, Any]:
    """Resolves a JSON pointer (RFC 6901)."""
    if pointer == "":
        return True, value
    if not pointer.startswith("/"):
        return False, None
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and token in value:
            value = value[token]
        elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        else:
            return False, None
    return True, value


def _replay(stored: bytes, *, replayed: bool) -> Answer:
    answer = decode_stored(stored)
    if answer is None:
        return problem(502, "Bad gateway", "unavailable", "the stored answer is in a format this middleware does not read")
    if replayed:
        answer.headers.append((b"idempotent-replayed", b"true"))
    return answer


def _with_cookies(answer: Answer, cookies: List[bytes]) -> Answer:
    if not any(n == b"set-cookie" for n, _ in answer.headers):
        answer.headers.extend((b"set-cookie", c) for c in cookies)
    return answer


async def _send(send: Send, answer: Answer) -> None:
    headers = [(n, v) for n, v in answer.headers if n not in (b"content-length",)]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})
