"""How an attempt ends, and what it tells the work: ``attempt.lost`` (and
``attempt.lost_signal``, for work in a thread) is set on every end but a committed
success, before another attempt can be granted; a grant that does not say how long its
lease is gets renewed with a known one before the work starts; a server that refuses
the wait asked for is polled instead."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, List, Tuple

import pytest

import oncegate
from conftest import Server, start_server
from oncegate import (
    Attempt,
    Client,
    Final,
    Granted,
    OncegateError,
    Previous,
    Renewed,
    Reserved,
    Retryable,
    State,
    UnconfirmedError,
    Unknown,
)

NS = "pytest"


class Watching(Client):
    """A client that notes, at each release, whether the attempt's ``lost`` was set by
    then; and that can be told to fail its commits (the gate unavailable)."""

    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, **options)
        self.attempts: List[Attempt] = []
        self.lost_at_release: List[bool] = []
        self.commits_fail = False
        self.released = asyncio.Event()

    async def release(self, namespace: str, key: str, token: int) -> None:
        self.lost_at_release.append(self.attempts[-1].lost.is_set() and self.attempts[-1].lost_signal.is_set())
        await super().release(namespace, key, token)
        self.released.set()

    async def commit(self, namespace: str, key: str, token: int, outcome: oncegate.Outcome, response: bytes = b"") -> int:
        if self.commits_fail:
            raise OncegateError("unavailable", "the gate went away")
        return await super().commit(namespace, key, token, outcome, response)


@pytest.fixture
async def watching(server: Server) -> AsyncIterator[Watching]:
    connected = Watching(server.address)
    async with connected:
        yield connected


@pytest.mark.parametrize("failure", ["unknown", "other", "retryable", "final"])
async def test_a_work_that_raises_marks_its_attempt_lost(watching: Watching, key: str, failure: str) -> None:
    async def failing(attempt: Attempt) -> bytes:
        watching.attempts.append(attempt)
        assert not attempt.lost.is_set() and not attempt.lost_signal.is_set()
        if failure == "unknown":
            raise Unknown("timed out after sending")
        if failure == "retryable":
            raise Retryable("busy")
        if failure == "final":
            raise Final("refused", response=b"no")
        raise ValueError("a bug")

    with pytest.raises((Unknown, Retryable, Final, ValueError)):
        await watching.once(failing, namespace=NS, key=key, lease_ms=60_000)
    attempt = watching.attempts[0]
    assert attempt.lost.is_set() and attempt.lost_signal.is_set()
    if failure == "retryable":
        # Told before the release that lets the next attempt in.
        assert watching.lost_at_release == [True]
        assert (await watching.get(NS, key)).state == State.FREE


async def test_a_committed_success_does_not_mark_the_attempt_lost(watching: Watching, key: str) -> None:
    async def work(attempt: Attempt) -> bytes:
        watching.attempts.append(attempt)
        return b"done"

    result = await watching.once(work, namespace=NS, key=key)
    assert result.response == b"done"
    assert not watching.attempts[0].lost.is_set() and not watching.attempts[0].lost_signal.is_set()


async def test_an_unconfirmed_commit_marks_the_attempt_lost(watching: Watching, key: str) -> None:
    watching.commits_fail = True

    async def work(attempt: Attempt) -> bytes:
        watching.attempts.append(attempt)
        return b"ran"

    with pytest.raises(UnconfirmedError):
        await watching.once(work, namespace=NS, key=key, lease_ms=60_000, commit_retry_for=0.0)
    assert watching.attempts[0].lost.is_set() and watching.attempts[0].lost_signal.is_set()
    assert (await watching.get(NS, key)).state == State.PENDING, "the key stays held"


@pytest.mark.parametrize("on_cancel", ["keep", "release"])
async def test_a_cancelled_caller_tells_work_running_in_a_thread(
    watching: Watching, key: str, on_cancel: oncegate.OnCancel
) -> None:
    loop = asyncio.get_running_loop()
    in_thread = asyncio.Event()
    heard: List[bool] = []
    thread_done = threading.Event()

    def blocking(attempt: Attempt) -> None:
        loop.call_soon_threadsafe(in_thread.set)
        # Work outside the coroutine: it cannot be cancelled, only told. (Bounded, so
        # that a missing signal fails the test instead of hanging it.)
        heard.append(attempt.lost_signal.wait(timeout=30))
        thread_done.set()

    async def work(attempt: Attempt) -> bytes:
        watching.attempts.append(attempt)
        await asyncio.to_thread(blocking, attempt)
        return b"never committed"

    task = asyncio.ensure_future(
        watching.once(work, namespace=NS, key=key, lease_ms=60_000, on_cancel=on_cancel)
    )
    await in_thread.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    attempt = watching.attempts[0]
    assert attempt.lost.is_set(), "the caller gave up: the attempt no longer holds the key"
    assert await asyncio.to_thread(thread_done.wait, 30) and heard == [True]
    if on_cancel == "release":
        await asyncio.wait_for(watching.released.wait(), timeout=30)  # in the background
        assert watching.lost_at_release == [True], "told before the key was released"


# A grant that does not say how long its lease is -------------------------------------


class OlderServer(Client):
    """A client whose grants say ``lease_ms = 0``, as an older server's do; it notes the
    heartbeats sent (their lease, and whether the work had started)."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.work_started = False
        self.beats: List[Tuple[int, bool]] = []

    async def _reserve(self, request: Any) -> Reserved:
        reserved = await super()._reserve(request)
        if isinstance(reserved.answer, Granted):
            return Reserved(reserved.key, dataclasses.replace(reserved.answer, lease_ms=0))
        return reserved

    async def heartbeat(self, namespace: str, key: str, token: int, lease_ms: int = 0) -> Renewed:
        self.beats.append((lease_ms, self.work_started))
        return await super().heartbeat(namespace, key, token, lease_ms)


async def test_a_grant_without_a_lease_is_renewed_with_a_known_one_before_the_work(server: Server, key: str) -> None:
    older = OlderServer(server.address)
    async with older:
        async def work(attempt: Attempt) -> bytes:
            older.work_started = True
            assert attempt.lease_ms == 30_000
            return b"ran"

        result = await older.once(work, namespace=NS, key=key)
        assert result.response == b"ran"
        assert older.beats[:1] == [(30_000, False)], "renewed with an explicit 30 s lease before the work started"


async def test_a_grant_without_a_lease_counts_with_the_one_asked_for(server: Server, key: str) -> None:
    older = OlderServer(server.address)
    async with older:
        async def work(attempt: Attempt) -> bytes:
            older.work_started = True
            assert attempt.lease_ms == 20_000
            return b"ran"

        await older.once(work, namespace=NS, key=key, lease_ms=20_000)
        assert older.beats == [], "the lease asked for is known: no renewal before the work"


# A server whose wait_ms_max is below what once asks ----------------------------------


@pytest.fixture(scope="module")
def short_wait_server() -> Iterator[Server]:
    """A server whose ``wait_ms_max`` is 1 s."""
    with tempfile.TemporaryDirectory(prefix="oncegate-py-wait-") as tmp:
        config = Path(tmp) / "oncegate.toml"
        config.write_text("[engine.limits]\nwait_ms_max = 1000\n")
        running = start_server(Path(tmp) / "data", ["--config", str(config)])
        try:
            yield running
        finally:
            running.stop()


async def test_a_wait_the_server_refuses_is_polled_instead(short_wait_server: Server, key: str) -> None:
    async with Client(short_wait_server.address) as client:
        held = await client.reserve(NS, key, lease_ms=300)
        assert isinstance(held.answer, Granted)
        runs: List[Attempt] = []

        async def work(attempt: Attempt) -> bytes:
            runs.append(attempt)
            return b"after the abandoned one"

        # The default wait (30 s) is more than the server waits: once polls for it.
        result = await client.once(work, namespace=NS, key=key)
        assert result.response == b"after the abandoned one" and not result.replayed
        assert runs[0].previous == Previous.ABANDONED and runs[0].attempt == 2


async def test_a_second_invalid_argument_is_raised_as_is(short_wait_server: Server) -> None:
    async with Client(short_wait_server.address) as client:
        async def work(attempt: Attempt) -> bytes:
            pytest.fail("a refused reserve must not run the work")

        with pytest.raises(OncegateError) as refused:
            await client.once(work, namespace="bad namespace!", key="k")
        assert refused.value.code == "invalid_argument" and refused.value.field == "namespace"


async def test_a_client_asks_the_server_to_wait_at_most_5_s(server: Server) -> None:
    async with Client(server.address) as client:
        assert client.server_wait_max_ms == 5_000
