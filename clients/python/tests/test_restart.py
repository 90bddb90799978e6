"""``once`` through a server killed (SIGKILL) while its works finish: every commit is
retried with its token until the server is back on the same port and data directory, so
no work that ran is left unconfirmed (the Rust client's ``tests/client_restart.rs``)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Awaitable, Callable, List, Set

import pytest

import oncegate
from conftest import Server, start_server
from oncegate import Attempt, Client, OncegateError, OnceResult, Outcome, State

WORKS = 16
NS = "live"


class Noting(Client):
    """The client, noting each key whose commit failed at least once (after the
    client's own retries of that one call). Keys, not tokens: tokens are unique per key
    only."""

    def __init__(self, address: str, transport: oncegate.Transport) -> None:
        super().__init__(address, transport=transport)
        self.failed: Set[str] = set()
        self.changed = asyncio.Event()

    async def commit(self, namespace: str, key: str, token: int, outcome: Outcome, response: bytes = b"") -> int:
        try:
            return await super().commit(namespace, key, token, outcome, response)
        except OncegateError:
            self.failed.add(key)
            self.changed.set()
            raise


@pytest.mark.parametrize("transport", ["session", "unary"])
async def test_commits_ride_through_a_server_killed_while_works_finish(transport: oncegate.Transport) -> None:
    with tempfile.TemporaryDirectory(prefix="oncegate-py-restart-") as tmp:
        data = Path(tmp) / "data"
        server = start_server(data)
        backs: List[Server] = []
        try:
            gate = Noting(server.address, transport)
            async with gate:
                started = 0
                all_started = asyncio.Event()
                finish = asyncio.Event()

                def work_for(i: int) -> Callable[[Attempt], Awaitable[bytes]]:
                    async def work(attempt: Attempt) -> bytes:
                        nonlocal started
                        started += 1
                        if started == WORKS:
                            all_started.set()
                        await finish.wait()
                        return f"filled {i} {attempt.token}".encode()

                    return work

                works = [
                    asyncio.ensure_future(gate.once(work_for(i), namespace=NS, key=f"order-{i}")) for i in range(WORKS)
                ]
                try:
                    await asyncio.wait_for(all_started.wait(), timeout=30)
                    server.kill()
                    finish.set()

                    # Every work has ended and its commit has failed at least once against
                    # the dead server before it comes back.
                    async def all_failed() -> None:
                        while len(gate.failed) < WORKS:
                            gate.changed.clear()
                            await gate.changed.wait()

                    await asyncio.wait_for(all_failed(), timeout=30)
                    assert not any(w.done() for w in works), "no commit gave up before the server came back"
                    backs.append(start_server(data, listen=server.listen))
                    results: List[OnceResult] = await asyncio.wait_for(asyncio.gather(*works), timeout=60)
                finally:
                    for work in works:
                        work.cancel()
                    await asyncio.gather(*works, return_exceptions=True)
                for i, result in enumerate(results):
                    assert not result.replayed and result.outcome == Outcome.SUCCEEDED, result
                    assert result.response == f"filled {i} {result.token}".encode()
                for i, result in enumerate(results):
                    view = await gate.get(NS, f"order-{i}")
                    assert (view.state, view.token, view.response) == (State.COMPLETED, result.token, result.response), i
        finally:
            server.kill()
            for back in backs:
                back.stop()
                assert back.process.returncode == 0, "a clean stop:\n" + "".join(back.log)


async def test_a_commit_not_retried_is_unconfirmed_and_the_key_stays_held() -> None:
    """With ``commit_retry_for=0`` a commit against a dead server ends unconfirmed at
    once (after the client's own retries of the call), and the key stays held."""
    with tempfile.TemporaryDirectory(prefix="oncegate-py-restart-") as tmp:
        data = Path(tmp) / "data"
        server = start_server(data)
        back = None
        try:
            async with Client(server.address) as gate:
                async def work(attempt: Attempt) -> bytes:
                    server.kill()
                    return b"ran"

                with pytest.raises(oncegate.UnconfirmedError) as unconfirmed:
                    await gate.once(work, namespace=NS, key="order-0", commit_retry_for=0, lease_ms=60_000)
                assert unconfirmed.value.code == "unavailable" and unconfirmed.value.response == b"ran"
            back = start_server(data, listen=server.listen)
            # A channel of its own: the closed client's connection, to the same address,
            # may still be in gRPC's reconnect back-off.
            async with Client(back.address, channel_options=[("grpc.use_local_subchannel_pool", 1)]) as fresh:
                view = await fresh.get(NS, "order-0")
            assert view.state == State.PENDING, "the work ran: the key is not freed"
        finally:
            server.kill()
            if back is not None:
                back.stop()
