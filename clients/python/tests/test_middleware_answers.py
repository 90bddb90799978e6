"""The middleware's answers that are not stored: an encoded one, one past the bound of
what is read whole (passed on as it comes), one the application could not finish, and
one the middleware stopped waiting for. Driven as an ASGI server drives it (the
messages in and out), against a real gate."""

from __future__ import annotations

import asyncio
import gzip
import threading
import uuid
from typing import Any, Dict, List

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import oncegate
from oncegate import Attempt, Client
from oncegate.asgi import ASGIApp as App
from oncegate.asgi import AnswerCutShort, IdempotencyMiddleware, Message, Receive, Scope, Send



class Caller:
    """One request through the middleware, as an ASGI server sends it: what went out,
    and an event per body byte count reached."""

    def __init__(self, middleware: IdempotencyMiddleware, key: str, *, accept_encoding: bool = False) -> None:
        self.middleware = middleware
        self.key = key
        self.accept_encoding = accept_encoding
        self.sent: List[Message] = []
        self.body_seen = 0
        self.body_reached = asyncio.Event()
        self.reach = 0

    async def call(self) -> None:
        headers = [
            (b"idempotency-key", self.key.encode()),
            (b"authorization", b"Bearer alice"),
            (b"content-type", b"application/json"),
        ]
        if self.accept_encoding:
            headers.append((b"accept-encoding", b"gzip"))
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/orders",
            "raw_path": b"/orders",
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
            "server": ("shop", 80),
        }
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": b'{"qty": 1}', "more_body": False}
            await asyncio.Event().wait()  # the caller stays connected
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            self.sent.append(message)
            if message["type"] == "http.response.body":
                self.body_seen += len(message.get("body", b""))
                if self.reach and self.body_seen >= self.reach:
                    self.body_reached.set()

        await self.middleware(scope, receive, send)

    def starts(self) -> List[Message]:
        return [m for m in self.sent if m["type"] == "http.response.start"]

    def status(self) -> int:
        (start,) = self.starts()
        return int(start["status"])

    def headers(self) -> Dict[bytes, bytes]:
        (start,) = self.starts()
        return {bytes(n).lower(): bytes(v) for n, v in start["headers"]}

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def guard(app: App, client: Client, **options: Any) -> IdempotencyMiddleware:
    options.setdefault("wait_ms", 0)  # a retry while the key is held: 409 at once
    return IdempotencyMiddleware(app, gate=client, namespace=f"mw-{uuid.uuid4().hex[:12]}", **options)


async def retry_status(middleware: IdempotencyMiddleware, key: str) -> int:
    again = Caller(middleware, key)
    await again.call()
    return again.status()


# Content-Encoding --------------------------------------------------------------------


async def test_an_encoded_answer_is_passed_on_and_stored_without_its_body(client: Client, key: str) -> None:
    seen: List[Dict[bytes, bytes]] = []
    compressed = gzip.compress(b'{"order":"A-1"}')

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(dict(scope["headers"]))
        await receive()
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": compressed})

    middleware = guard(app, client)
    first = Caller(middleware, key, accept_encoding=True)
    await first.call()
    assert b"accept-encoding" not in seen[0], "the application is asked for an unencoded answer"
    assert first.status() == 201 and first.headers()[b"content-encoding"] == b"gzip"
    assert first.body() == compressed, "passed on as the application sent it"
    # Stored without its body (it would be replayed without its Content-Encoding): the
    # retry is told so, and the application does not run again. (The key was held, and
    # ran again once its lease ended.)
    retry = Caller(middleware, key)
    await retry.call()
    assert retry.status() == 201 and retry.body() == b"" and retry.headers()[b"idempotent-replayed"] == b"true"
    assert b"content-encoding" not in retry.headers(), "no body to decode"
    assert b"not stored whole: encoded (gzip)" in retry.headers()[b"warning"]
    assert len(seen) == 1


async def test_a_compressing_middleware_inside_never_compresses_what_is_stored(client: Client, key: str) -> None:
    async def orders(request: Request) -> Response:
        return JSONResponse({"order": "A-1", "pad": "x" * 2_000}, status_code=201)

    app = Starlette(
        routes=[Route("/orders", orders, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, gate=client, namespace=f"mw-{uuid.uuid4().hex[:12]}"),
            Middleware(GZipMiddleware, minimum_size=10),
        ],
    )
    headers = {"idempotency-key": key, "authorization": "Bearer alice", "content-type": "application/json", "accept-encoding": "gzip"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as http:
        first = await http.post("/orders", content=b"{}", headers=headers)
        again = await http.post("/orders", content=b"{}", headers=headers)
    assert first.status_code == again.status_code == 201
    assert "content-encoding" not in first.headers and "content-encoding" not in again.headers
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content


# An answer past the bound of what is read whole --------------------------------------


def streaming(go: asyncio.Event, end: str) -> App:
    """An application that answers 600 bytes, 600 more, then (once ``go`` is set) the
    last 600; or fails, or never ends, as ``end`` says."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"application/octet-stream"), (b"x-report", b"1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"a" * 600, "more_body": True})
        await send({"type": "http.response.body", "body": b"b" * 600, "more_body": True})
        await go.wait()
        if end == "raise":
            raise RuntimeError("the report failed half way")
        await send({"type": "http.response.body", "body": b"c" * 600, "more_body": False})

    return app


LIMITS = {"body_bytes_max": 1024, "stored_bytes_max": 512, "key_policy_url": "https://shop.example/keys"}


async def test_an_answer_past_the_bound_is_passed_on_as_it_comes_and_stored_without_its_body(
    client: Client, key: str
) -> None:
    go = asyncio.Event()
    middleware = guard(streaming(go, "finish"), client, **LIMITS)
    caller = Caller(middleware, key)
    caller.reach = 1_200  # past the bound (1024): what was read goes out before the end
    call = asyncio.ensure_future(caller.call())
    await asyncio.wait_for(caller.body_reached.wait(), timeout=30)
    assert not call.done() and caller.status() == 200
    assert caller.headers()[b"x-report"] == b"1" and caller.headers()[b"link"].startswith(b"<https://shop.example/keys>")
    go.set()
    await call
    assert caller.body() == b"a" * 600 + b"b" * 600 + b"c" * 600
    assert caller.sent[-1]["type"] == "http.response.body" and not caller.sent[-1].get("more_body", False)
    assert len(caller.starts()) == 1
    assert b"a retry is answered without its body" in caller.headers()[b"warning"]
    # Completed without its body: the retry is told so and nothing runs again. (The key
    # was held, and ran again once its lease ended.)
    retry = Caller(middleware, key)
    await retry.call()
    assert retry.status() == 200 and retry.body() == b"" and retry.headers()[b"idempotent-replayed"] == b"true"
    assert b"not stored whole: more than 1024 bytes" in retry.headers()[b"warning"]


@pytest.mark.parametrize("end", ["raise", "timeout"])
async def test_an_answer_cut_after_it_started_ends_the_connection(client: Client, key: str, end: str) -> None:
    go = asyncio.Event()
    options: Dict[str, Any] = dict(LIMITS)
    if end == "timeout":
        options["handler_timeout_ms"] = 1_000  # the application never finishes
    middleware = guard(streaming(go, end), client, **options)
    caller = Caller(middleware, key)
    caller.reach = 1_200
    call = asyncio.ensure_future(caller.call())
    await asyncio.wait_for(caller.body_reached.wait(), timeout=30)
    if end == "raise":
        go.set()
    with pytest.raises(AnswerCutShort):
        await asyncio.wait_for(call, timeout=30)
    # One start, the application's: no problem mixed into its answer.
    assert len(caller.starts()) == 1 and caller.status() == 200
    assert caller.body() == b"a" * 600 + b"b" * 600
    assert all(m.get("more_body", False) for m in caller.sent if m["type"] == "http.response.body")
    assert await retry_status(middleware, key) == 409, "the key is held, never released"


async def test_an_answer_too_large_to_store_runs_once_and_its_retry_gets_no_body(client: Client, key: str) -> None:
    """Under the bound but over ``stored_bytes_max``: the caller gets it whole, warned, and
    the key is completed without the body. (The key was released, and a caller that lost
    the answer ran the handler twice.)"""
    runs: List[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        runs.append(1)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"z" * 800})

    middleware = guard(app, client, **LIMITS)
    first = Caller(middleware, key)
    await first.call()
    assert first.status() == 201 and first.body() == b"z" * 800
    assert b"a retry is answered without its body" in first.headers()[b"warning"]
    retry = Caller(middleware, key)
    await retry.call()
    assert retry.status() == 201 and retry.body() == b"" and retry.headers()[b"idempotent-replayed"] == b"true"
    assert retry.headers()[b"content-type"] == b"text/plain", "stored headers are kept"
    assert b"bytes to store, over stored_bytes_max (512)" in retry.headers()[b"warning"]
    assert len(runs) == 1, "the retry did not run the handler again"


async def test_stored_bytes_max_below_256_is_refused(client: Client) -> None:
    """What is stored for an answer not stored whole must fit."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        return None

    with pytest.raises(ValueError, match="stored_bytes_max is 255; it must be at least 256"):
        guard(app, client, stored_bytes_max=255)


async def test_an_answer_not_stored_whole_reaches_its_caller_when_the_lease_is_lost(
    client: Client, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is the only copy the caller can get: passed on, warned that a retry may run
    again. (It was dropped for a ``502``.)"""
    commit = client.commit

    async def lost(namespace: str, key: str, token: int, outcome: Any, response: bytes = b"") -> int:
        # Released and granted to another attempt before the commit, which is fenced off.
        await client.release(namespace, key, token)
        await client.reserve(namespace, key)
        return await commit(namespace, key, token, outcome, response)

    monkeypatch.setattr(client, "commit", lost)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"z" * 800})

    first = Caller(guard(app, client, **LIMITS), key)
    await first.call()
    assert first.status() == 201 and first.body() == b"z" * 800
    assert b"lease lost before the answer was stored" in first.headers()[b"warning"]


# The middleware stops waiting for the application ------------------------------------


async def test_a_handler_past_its_time_is_told_its_attempt_is_lost(client: Client, key: str) -> None:
    attempts: List[Attempt] = []
    in_thread = asyncio.Event()
    heard: List[bool] = []
    thread_done = threading.Event()
    loop = asyncio.get_running_loop()

    def blocking(attempt: Attempt) -> None:
        loop.call_soon_threadsafe(in_thread.set)
        heard.append(attempt.lost_signal.wait(timeout=30))
        thread_done.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        attempt = oncegate.current_attempt()
        attempts.append(attempt)
        await asyncio.to_thread(blocking, attempt)

    middleware = guard(app, client, handler_timeout_ms=300)
    caller = Caller(middleware, key)
    await asyncio.wait_for(caller.call(), timeout=30)
    assert caller.status() == 504
    assert attempts[0].lost.is_set(), "marked lost when the middleware stopped waiting"
    assert await asyncio.to_thread(thread_done.wait, 30) and heard == [True]


async def test_the_middleware_stops_waiting_for_a_handler_that_ignores_cancellation(client: Client, key: str) -> None:
    attempts: List[Attempt] = []
    let_go = asyncio.Event()
    finished = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        attempts.append(oncegate.current_attempt())
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await let_go.wait()  # carries on regardless
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})
        finished.set()

    middleware = guard(app, client, handler_timeout_ms=300)
    caller = Caller(middleware, key)
    await asyncio.wait_for(caller.call(), timeout=30)
    assert caller.status() == 504 and attempts[0].lost.is_set()
    let_go.set()
    await asyncio.wait_for(finished.wait(), timeout=30)
    assert len(caller.starts()) == 1, "the late answer goes nowhere"
    assert await retry_status(middleware, key) == 409, "the key is held"
