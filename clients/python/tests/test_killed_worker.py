"""A worker killed while its work runs leaves the key to lapse: the next ``once`` is
granted with ``previous = ABANDONED`` after the lease ends, and runs the work again."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import List

from conftest import Server
from oncegate import Attempt, Client, Previous, State

CHILD = Path(__file__).resolve().parent / "worker_child.py"


async def test_a_killed_worker_leaves_the_key_to_lapse(server: Server, client: Client, key: str) -> None:
    child = subprocess.Popen(
        [sys.executable, str(CHILD), server.address, "pytest", key],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child holds the key
        assert line.startswith("granted "), f"the worker did not get the key: {line!r}"
        token = int(line.split()[1])
        view = await client.get("pytest", key)
        assert (view.state, view.token) == (State.PENDING, token)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    runs: List[Attempt] = []

    async def work(attempt: Attempt) -> bytes:
        runs.append(attempt)
        return b"ran again"

    # No sleep: the reserve waits on the server until the dead worker's lease lapses.
    result = await client.once(work, namespace="pytest", key=key, wait_ms=30_000)
    assert len(runs) == 1 and not result.replayed
    assert runs[0].previous == Previous.ABANDONED and runs[0].attempt == 2
    assert result.previous == Previous.ABANDONED and result.token > token
