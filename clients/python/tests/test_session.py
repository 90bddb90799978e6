"""Calls over one ``Session`` stream, matched by id."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

import oncegate
from conftest import Server
from oncegate import Attempt, Client, Granted, LeaseLostError, Outcome, State


async def test_reserve_and_commit_over_a_session(client: Client, key: str) -> None:
    async with client.session() as session:
        reserved = await session.reserve("pytest", key, lease_ms=5_000)
        assert isinstance(reserved.answer, Granted) and reserved.key == key
        token = reserved.answer.token
        assert (await session.get("pytest", key)).state == State.PENDING
        await session.heartbeat("pytest", key, token, 5_000)
        await session.commit("pytest", key, token, Outcome.SUCCEEDED, b"over the stream")
        again = await session.reserve("pytest", key)
        assert isinstance(again.answer, oncegate.Completed)
        assert (again.answer.response, again.answer.token) == (b"over the stream", token)
        assert session.calls_in_flight_max is not None and session.calls_in_flight_max > 0
    # What the stream stored, a unary call reads.
    assert (await client.get("pytest", key)).response == b"over the stream"


async def test_many_calls_in_flight_are_matched_by_id(client: Client, key: str) -> None:
    keys = [f"{key}-{i}" for i in range(200)]
    async with client.session() as session:
        granted = await asyncio.gather(*(session.reserve("pytest", k) for k in keys))
        assert [r.key for r in granted] == keys
        tokens = []
        for reserved in granted:
            assert isinstance(reserved.answer, Granted)
            tokens.append(reserved.answer.token)
        await asyncio.gather(
            *(session.commit("pytest", k, t, Outcome.SUCCEEDED, k.encode()) for k, t in zip(keys, tokens))
        )
        views = await asyncio.gather(*(session.get("pytest", k) for k in keys))
    assert [v.response for v in views] == [k.encode() for k in keys]


async def test_a_refusal_on_the_stream_is_the_unary_error_and_the_stream_goes_on(client: Client, key: str) -> None:
    async with client.session() as session:
        reserved = await session.reserve("pytest", key)
        assert isinstance(reserved.answer, Granted)
        with pytest.raises(LeaseLostError) as stale:
            await session.commit("pytest", key, reserved.answer.token + 1, Outcome.SUCCEEDED)
        assert stale.value.code == "lease_lost"
        with pytest.raises(oncegate.OncegateError) as bad:
            await session.get("no spaces allowed", key)
        assert bad.value.code == "invalid_argument" and bad.value.field == "namespace"
        await session.commit("pytest", key, reserved.answer.token, Outcome.SUCCEEDED, b"ok")


async def test_once_over_a_session_transport(server: Server, key: str) -> None:
    runs: List[int] = []

    async def work(attempt: Attempt) -> bytes:
        runs.append(attempt.token)
        return b"via session"

    async with Client(server.address, transport="session") as client:
        results = await asyncio.gather(*(client.once(work, namespace="pytest", key=key) for _ in range(16)))
    assert len(runs) == 1 and {r.response for r in results} == {b"via session"}


async def test_a_cancelled_call_is_taken_back(client: Client, key: str) -> None:
    async with client.session() as session:
        held = await session.reserve("pytest", key, lease_ms=60_000)
        assert isinstance(held.answer, Granted)
        # A reserve parked on the held key over the stream (the server waits for the key
        # on its behalf)...
        parked = asyncio.ensure_future(session._send("reserve", _waiting_reserve(key)))
        while session._stream is None or not session._stream.waiting:
            await asyncio.sleep(0)
        # ...reaches the key's shard before a later call on the same key (calls on one key
        # are queued in the order sent), so once this get is answered it is parked.
        assert (await session.get("pytest", key)).state == State.PENDING
        # Its caller goes: a cancel follows it, and the server drops the waiter.
        parked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parked
        assert (await session.get("pytest", key)).state == State.PENDING
        # Released now, the key would go to its one waiter; the dropped one is none, so a
        # new reserve is granted (a granted waiter would make it in progress).
        await session.release("pytest", key, held.answer.token)
        fresh = await session.reserve("pytest", key)
        assert isinstance(fresh.answer, Granted), fresh.answer
        assert fresh.answer.previous == oncegate.Previous.NONE
        await session.commit("pytest", key, fresh.answer.token, Outcome.SUCCEEDED, b"done")


def _waiting_reserve(key: str) -> object:
    from oncegate.v1 import gate_pb2

    return gate_pb2.ReserveRequest(namespace="pytest", key=key, wait_ms=20_000)
