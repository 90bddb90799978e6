"""Retrying calls that are safe to repeat, with jittered exponential back-off.

Every gate call is safe to repeat by itself (the Rust client's ``retry.rs``): a reserve
repeated after its grant was lost finds the key in progress (held by the lost grant)
rather than granting it twice; a commit with the same token and outcome is acknowledged
again; release, heartbeat and get change nothing twice. What must never be repeated is
the caller's work, and nothing here runs it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from .errors import RETRYABLE_CODES, OncegateError

__all__ = ["NO_RETRY", "RetryPolicy"]

T = TypeVar("T")
log = logging.getLogger("oncegate")


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures are retried, how often, and how long to pause between tries.

    Attributes:
        attempts_max: tries in all, the first included; 1 retries nothing.
        backoff_min_ms: the pause before the first retry is drawn from
            ``0..backoff_min_ms``; each retry after doubles the bound ("full jitter").
        backoff_max_ms: the largest bound of a pause.
    """

    attempts_max: int = 5
    backoff_min_ms: int = 25
    backoff_max_ms: int = 1000

    @staticmethod
    def retries(error: OncegateError) -> bool:
        """Whether a failure may succeed if tried again: ``unavailable`` or
        ``resource_exhausted``. Refusals of the contract are final."""
        return error.code in RETRYABLE_CODES

    def pause_ms(self, n: int) -> float:
        """The pause before retry ``n`` (1 for the first retry), in milliseconds."""
        bound = min(self.backoff_min_ms * (1 << min(max(n - 1, 0), 20)), self.backoff_max_ms)
        return random.uniform(0, bound)

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs ``call`` until it succeeds, fails for good, or was tried
        ``attempts_max`` times."""
        tried = 1
        while True:
            try:
                return await call()
            except OncegateError as error:
                if tried >= self.attempts_max or not self.retries(error):
                    raise
                log.debug("retrying a call that is safe to repeat (try %d): %s", tried, error)
                await asyncio.sleep(self.pause_ms(tried) / 1000)
                tried += 1


#: A policy that retries nothing.
NO_RETRY = RetryPolicy(attempts_max=1, backoff_min_ms=0, backoff_max_ms=0)
