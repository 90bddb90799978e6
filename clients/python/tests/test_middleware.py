"""The ASGI Idempotency-Key middleware on a Starlette application, against a real server."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator, Dict, List

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from oncegate import Client
from oncegate._http import canonical_as_written, decode_stored, encode_stored
from oncegate.asgi import IdempotencyMiddleware


class Shop:
    """A handler that counts its runs, and can be told to fail."""

    def __init__(self) -> None:
        self.runs: List[Dict[str, str]] = []
        self.fail_next = 0
        self.go = asyncio.Event()
        self.go.set()

    async def orders(self, request: Request) -> Response:
        order = await request.json()
        self.runs.append({
            "token": request.headers.get("oncegate-token", ""),
            "attempt": request.headers.get("oncegate-attempt", ""),
            "previous": request.headers.get("oncegate-previous", ""),
        })
        await self.go.wait()
        if self.fail_next:
            self.fail_next -= 1
            return JSONResponse({"error": "exchange down"}, status_code=503)
        response = JSONResponse({"order": f"A-{len(self.runs)}", "qty": order["qty"]}, status_code=201)
        response.headers["location"] = f"/orders/A-{len(self.runs)}"
        response.headers["x-not-stored"] = "1"
        response.set_cookie("session", "first-caller")
        return response

    async def plain(self, request: Request) -> Response:
        self.runs.append({})
        return Response(b"plain", status_code=200)


@pytest.fixture
async def shop(client: Client) -> AsyncIterator[tuple[Shop, httpx.AsyncClient]]:
    shop = Shop()
    namespace = f"mw-{uuid.uuid4().hex[:12]}"
    app = Starlette(
        routes=[Route("/orders", shop.orders, methods=["POST"]), Route("/plain", shop.plain, methods=["POST", "GET"])],
        middleware=[Middleware(IdempotencyMiddleware, gate=client, namespace=namespace, key_required_prefixes=["/orders"])],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as http:
        yield shop, http


def headers(key: str, caller: str = "Bearer alice") -> Dict[str, str]:
    return {"idempotency-key": key, "authorization": caller, "content-type": "application/json"}


async def test_50_concurrent_duplicates_run_the_handler_once(shop: tuple[Shop, httpx.AsyncClient], key: str) -> None:
    handler, http = shop
    handler.go.clear()  # the first request holds the key until all 50 were sent

    async def post() -> httpx.Response:
        return await http.post("/orders", content=b'{"qty": 1, "symbol": "BTC"}', headers=headers(key))

    requests = [asyncio.ensure_future(post()) for _ in range(50)]
    while not handler.runs:
        await asyncio.sleep(0.001)
    handler.go.set()
    answers = await asyncio.gather(*requests)
    assert len(handler.runs) == 1
    assert {a.status_code for a in answers} == {201}
    assert len({a.content for a in answers}) == 1
    assert json.loads(answers[0].content) == {"order": "A-1", "qty": 1}
    replays = [a for a in answers if a.headers.get("idempotent-replayed") == "true"]
    firsts = [a for a in answers if "idempotent-replayed" not in a.headers]
    assert len(replays) == 49 and len(firsts) == 1
    for answer in answers:
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["location"] == "/orders/A-1"
        assert "x-not-stored" not in answer.headers, "only the stored headers are sent"
    assert firsts[0].headers.get("set-cookie", "").startswith("session=first-caller")
    assert all("set-cookie" not in a.headers for a in replays), "a replay never carries the first caller's cookie"
    # The handler saw the fencing token and the attempt.
    assert handler.runs[0]["token"].isdigit() and handler.runs[0]["attempt"] == "1"
    # The same payload written another way is the same request.
    again = await http.post("/orders", content=b'{"symbol":"BTC","qty":1}', headers=headers(key))
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"


async def test_another_body_under_the_same_key_is_422(shop: tuple[Shop, httpx.AsyncClient], key: str) -> None:
    handler, http = shop
    first = await http.post("/orders", content=b'{"qty": 1}', headers=headers(key))
    assert first.status_code == 201
    other = await http.post("/orders", content=b'{"qty": 2}', headers=headers(key))
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert other.json()["code"] == "mismatch" and other.json()["status"] == 422
    assert len(handler.runs) == 1


async def test_another_caller_never_gets_a_replay(shop: tuple[Shop, httpx.AsyncClient], key: str) -> None:
    handler, http = shop
    alice = await http.post("/orders", content=b'{"qty": 1}', headers=headers(key, "Bearer alice"))
    bob = await http.post("/orders", content=b'{"qty": 1}', headers=headers(key, "Bearer bob"))
    assert alice.status_code == bob.status_code == 201
    assert "idempotent-replayed" not in bob.headers and len(handler.runs) == 2


async def test_a_5xx_releases_the_key_and_the_retry_runs(shop: tuple[Shop, httpx.AsyncClient], key: str) -> None:
    handler, http = shop
    handler.fail_next = 1
    failed = await http.post("/orders", content=b'{"qty": 3}', headers=headers(key))
    assert failed.status_code == 503 and "idempotent-replayed" not in failed.headers
    retried = await http.post("/orders", content=b'{"qty": 3}', headers=headers(key))
    assert retried.status_code == 201 and len(handler.runs) == 2
    assert handler.runs[1]["previous"] == "", "a released key is not abandoned"


async def test_requests_the_middleware_refuses_or_passes(shop: tuple[Shop, httpx.AsyncClient], key: str) -> None:
    handler, http = shop
    # Not guarded (GET), and no key where none is required: passed through.
    assert (await http.get("/plain")).content == b"plain"
    assert (await http.post("/plain", content=b"x")).content == b"plain"
    assert len(handler.runs) == 2
    # No key where one is required.
    missing = await http.post("/orders", content=b"{}", headers={"authorization": "Bearer alice"})
    assert missing.status_code == 400 and missing.json()["code"] == "invalid_argument"
    # No caller header.
    anonymous = await http.post("/orders", content=b"{}", headers={"idempotency-key": key})
    assert anonymous.status_code == 400 and anonymous.json()["title"] == "Caller required"
    # Two different keys.
    two = await http.post(
        "/orders",
        content=b"{}",
        headers=[("idempotency-key", key), ("idempotency-key", key + "x"), ("authorization", "Bearer a")],
    )
    assert two.status_code == 400 and two.json()["title"] == "Conflicting Idempotency-Key"
    # A client's own attempt headers never reach the application.
    forged = {**headers(key), "oncegate-token": "1", "oncegate-previous": "abandoned"}
    assert (await http.post("/orders", content=b'{"qty": 1}', headers=forged)).status_code == 201
    assert handler.runs[-1]["token"] != "1" and handler.runs[-1]["previous"] == ""


def test_the_stored_format_reads_back() -> None:
    headers = [(b"content-type", b"application/json"), (b"location", b"/orders/77")]
    stored = encode_stored(201, headers, b'{"order":"A-77"}\x00\xff')
    assert stored[:5] == b"\x01\x00\xc9\x00\x02"
    answer = decode_stored(stored)
    assert answer is not None and (answer.status, answer.headers, answer.body) == (201, headers, b'{"order":"A-77"}\x00\xff')
    assert decode_stored(stored[:8]) is None, "cut short"
    assert decode_stored(b"\x02rest") is None


def test_the_body_is_canonical_as_written() -> None:
    assert (
        canonical_as_written(' { "b" : -1.50e3 ,\n"a": [ "x\\"y" , true, null, {} , [] ] } ')
        == '{"a":["x\\"y",true,null,{},[]],"b":-1.50e3}'
    )
    assert canonical_as_written('{"b":{"d":1,"c":2},"a":0}') == canonical_as_written('{"a":0,"b":{"c":2,"d":1}}')
    assert canonical_as_written('{"q":1,"q":2}') != canonical_as_written('{"q":2,"q":1}')
    assert canonical_as_written('{"b":1,"\\u0061":2}') == '{"\\u0061":2,"b":1}'
    assert canonical_as_written("[" * 128 + "]" * 128) == "[" * 128 + "]" * 128
    assert canonical_as_written("[" * 129 + "]" * 129) is None
    for text in ['{"a":', "[1,", '"open', '{"a" 1', "", "{", "[", '"\\', "[}", "[]]", "{1:2}", "[\u00e9]"]:
        canonical_as_written(text)
