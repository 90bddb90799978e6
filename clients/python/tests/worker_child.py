"""A worker for the killed-worker test: runs ``once`` on a key with a 1000 ms lease,
prints ``granted <token>`` once it holds the key, then blocks in its work until killed.

Usage: python worker_child.py ADDRESS NAMESPACE KEY
"""

from __future__ import annotations

import asyncio
import sys

import oncegate


async def main(address: str, namespace: str, key: str) -> None:
    async with oncegate.Client(address) as client:

        async def work(attempt: oncegate.Attempt) -> bytes:
            print(f"granted {attempt.token}", flush=True)
            await asyncio.Event().wait()  # blocks (heartbeating) until SIGKILL
            return b"never"

        await client.once(work, namespace=namespace, key=key, lease_ms=1_000)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
