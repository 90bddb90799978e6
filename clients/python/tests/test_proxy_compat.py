"""The middleware keeps the proxy's rules byte for byte: with ``oncegate proxy`` and the
middleware on one gate (the same namespace), a request answered through one is replayed
through the other, so the record key, the payload's fingerprint and the stored answer's
format agree."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import threading
import uuid
from typing import Any, AsyncIterator, Iterator, List

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from conftest import Server, oncegate_bin
from oncegate import Client
from oncegate.asgi import IdempotencyMiddleware

NAMESPACE = "proxy"  # the proxy's default namespace, and the middleware's


class Upstream(http.server.ThreadingHTTPServer):
    runs: List[bytes]


class Handler(http.server.BaseHTTPRequestHandler):
    server: Upstream

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self.server.runs.append(body)
        answer = json.dumps({"order": "U-1", "via": "upstream"}).encode()
        self.send_response(201)
        self.send_header("content-type", "application/json")
        self.send_header("location", "/orders/U-1")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def proxy(server: Server) -> Iterator[tuple[str, Upstream]]:
    upstream = Upstream(("127.0.0.1", 0), Handler)
    upstream.runs = []
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "ONCEGATE_CONFIG", "ONCEGATE_TOKEN")}
    process = subprocess.Popen(
        [str(oncegate_bin()), "proxy", "--listen", "127.0.0.1:0",
         "--upstream", f"http://127.0.0.1:{upstream.server_address[1]}", "--gate", server.address],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        assert process.stdout is not None
        address = None
        for line in process.stdout:
            match = re.search(r"listening on (\S+?),", line)
            if match:
                address = match.group(1)
                break
        assert address, "the proxy did not start"
        threading.Thread(target=lambda: [None for _ in process.stdout or ()], daemon=True).start()
        yield f"http://{address}", upstream
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        upstream.shutdown()


@pytest.fixture
async def app(client: Client) -> AsyncIterator[tuple[httpx.AsyncClient, List[bytes]]]:
    runs: List[bytes] = []

    async def orders(request: Request) -> Response:
        runs.append(await request.body())
        response = JSONResponse({"order": "M-1", "via": "middleware"}, status_code=201)
        response.headers["location"] = "/orders/M-1"
        return response

    starlette = Starlette(
        routes=[Route("/orders", orders, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, gate=client, namespace=NAMESPACE)],
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=starlette), base_url="http://app") as http:
        yield http, runs


def _headers(key: str) -> dict[str, str]:
    return {"idempotency-key": key, "authorization": "Bearer carol", "content-type": "application/json"}


async def test_an_answer_stored_by_the_proxy_is_replayed_by_the_middleware(
    proxy: tuple[str, Upstream], app: tuple[httpx.AsyncClient, List[bytes]]
) -> None:
    proxy_url, upstream = proxy
    http, runs = app
    key = f"compat-{uuid.uuid4()}"
    before = len(upstream.runs)
    async with httpx.AsyncClient() as outside:
        first = await outside.post(f"{proxy_url}/orders?x=1", content=b'{"qty": 1.0, "side": "buy"}', headers=_headers(key))
    assert first.status_code == 201 and len(upstream.runs) == before + 1
    # Spacing and member order do not count: the same payload.
    replay = await http.post("/orders?x=1", content=b'{"side":"buy","qty":1.0}', headers=_headers(key))
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content and replay.headers["location"] == "/orders/U-1"
    assert runs == [], "the middleware's handler did not run"
    # A number written otherwise is another payload to the proxy's rules: 422.
    other = await http.post("/orders?x=1", content=b'{"side":"buy","qty":1}', headers=_headers(key))
    assert other.status_code == 422 and other.json()["code"] == "mismatch"


async def test_an_answer_stored_by_the_middleware_is_replayed_by_the_proxy(
    proxy: tuple[str, Upstream], app: tuple[httpx.AsyncClient, List[bytes]]
) -> None:
    proxy_url, upstream = proxy
    http, runs = app
    key = f"compat-{uuid.uuid4()}"
    before = len(upstream.runs)
    first = await http.post("/orders", content=b'{"a": [1, {"y": 2, "x": 1}]}', headers=_headers(key))
    assert first.status_code == 201 and len(runs) == 1
    async with httpx.AsyncClient() as outside:
        replay = await outside.post(f"{proxy_url}/orders", content=b'{"a":[1,{"x":1,"y":2}]}', headers=_headers(key))
        assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
        assert replay.content == first.content and replay.headers["location"] == "/orders/M-1"
        other = await outside.post(f"{proxy_url}/orders", content=b'{"a":[1,{"x":1,"y":3}]}', headers=_headers(key))
        assert other.status_code == 422
    assert len(upstream.runs) == before, "the upstream did not run"
