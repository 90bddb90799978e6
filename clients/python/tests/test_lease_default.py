"""A lease not given is the server's ``lease_ms_default``: ``once`` sends 0 and counts with
the grant's ``lease_ms`` (its deadline, and the heartbeats' cadence)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterator, List

import pytest

from conftest import Server, start_server
from oncegate import Attempt, Client, Granted, Outcome, State

NS = "pytest"
LEASE_DEFAULT_MS = 600


@pytest.fixture(scope="module")
def short_lease_server() -> Iterator[Server]:
    """A server whose ``lease_ms_default`` is 600 ms."""
    with tempfile.TemporaryDirectory(prefix="oncegate-py-lease-") as tmp:
        config = Path(tmp) / "oncegate.toml"
        config.write_text(f"[engine.limits]\nlease_ms_default = {LEASE_DEFAULT_MS}\n")
        running = start_server(Path(tmp) / "data", ["--config", str(config)])
        try:
            yield running
        finally:
            running.stop()


@pytest.fixture
async def short_lease(short_lease_server: Server) -> AsyncIterator[Client]:
    async with Client(short_lease_server.address) as connected:
        yield connected


async def test_the_grant_says_how_long_the_lease_is(short_lease: Client, key: str) -> None:
    defaulted = await short_lease.reserve(NS, f"{key}-default")
    assert isinstance(defaulted.answer, Granted) and defaulted.answer.lease_ms == LEASE_DEFAULT_MS
    asked = await short_lease.reserve(NS, f"{key}-asked", lease_ms=5_000)
    assert isinstance(asked.answer, Granted) and asked.answer.lease_ms == 5_000


async def test_once_without_a_lease_runs_under_the_servers_default(short_lease: Client, key: str) -> None:
    seen: List[Attempt] = []

    async def work(attempt: Attempt) -> bytes:
        seen.append(attempt)
        left = attempt.deadline - asyncio.get_running_loop().time()
        assert 0 < left <= LEASE_DEFAULT_MS / 1000, f"the lease deadline is {left:.3f} s away"
        assert 0 < attempt.remaining_ms() <= LEASE_DEFAULT_MS
        assert attempt.lease_ms == LEASE_DEFAULT_MS
        # Heartbeats at the granted lease's cadence (every 200 ms) keep it: the work
        # outlives the lease twice over (polling the gate's record, no fixed wait).
        granted_until = (await short_lease.get(NS, key)).lease_until_ms
        while (await short_lease.get(NS, key)).lease_until_ms < granted_until + 2 * LEASE_DEFAULT_MS:
            assert not attempt.lost.is_set()
            await asyncio.sleep(0.02)
        assert attempt.remaining_ms() <= LEASE_DEFAULT_MS
        return b"ran under the default lease"

    result = await asyncio.wait_for(short_lease.once(work, namespace=NS, key=key), timeout=30)
    assert len(seen) == 1 and not result.replayed and result.response == b"ran under the default lease"
    view = await short_lease.get(NS, key)
    assert (view.state, view.outcome, view.response) == (State.COMPLETED, Outcome.SUCCEEDED, result.response)
