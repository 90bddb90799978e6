"""The retry policy: what is retried, how often, and the pauses' bounds."""

from __future__ import annotations

from typing import List

import pytest

from oncegate import NO_RETRY, LeaseLostError, OncegateError, RetryPolicy

FAST = RetryPolicy(attempts_max=5, backoff_min_ms=1, backoff_max_ms=2)


async def _run(policy: RetryPolicy, codes: List[str]) -> tuple[object, int]:
    calls = 0

    async def call() -> int:
        nonlocal calls
        calls += 1
        if calls <= len(codes):
            raise OncegateError.refused(codes[calls - 1], "refused")
        return 7

    try:
        return await policy.run(call), calls
    except OncegateError as error:
        return error.code, calls


async def test_unavailable_and_exhausted_are_retried_and_refusals_are_final() -> None:
    assert await _run(FAST, ["unavailable", "resource_exhausted"]) == (7, 3)
    assert await _run(FAST, ["lease_lost"]) == ("lease_lost", 1)
    assert await _run(RetryPolicy(2, 1, 2), ["unavailable"] * 3) == ("unavailable", 2)
    assert await _run(NO_RETRY, ["unavailable"]) == ("unavailable", 1)


def test_pauses_are_jittered_below_a_doubling_bound() -> None:
    policy = RetryPolicy(attempts_max=10, backoff_min_ms=10, backoff_max_ms=50)
    for _ in range(200):
        assert 0 <= policy.pause_ms(1) <= 10
        assert policy.pause_ms(3) <= 40
        assert policy.pause_ms(9) <= 50


def test_a_lease_lost_refusal_has_its_own_type() -> None:
    error = OncegateError.refused("lease_lost", "not the holder")
    assert isinstance(error, LeaseLostError) and not error.retryable
    assert OncegateError.refused("unavailable", "down").retryable
    with pytest.raises(OncegateError):
        raise error
