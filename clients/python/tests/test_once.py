"""``once`` in its three forms, against a real server."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest

import oncegate
from oncegate import (
    Attempt,
    Client,
    Final,
    LeaseLostError,
    MismatchError,
    Outcome,
    Previous,
    Replayed,
    ReplayedFailure,
    Retryable,
    State,
    Unknown,
    fingerprint_json,
)

NS = "pytest"


async def test_a_work_runs_and_its_response_is_replayed(client: Client, key: str) -> None:
    runs: List[int] = []

    async def work(attempt: Attempt) -> bytes:
        runs.append(attempt.token)
        assert (attempt.key, attempt.attempt, attempt.previous) == (key, 1, Previous.NONE)
        assert oncegate.current_attempt() is attempt
        return b"filled:%d" % attempt.token

    first = await client.once(work, namespace=NS, key=key)
    assert (first.replayed, first.outcome, first.attempt) == (False, Outcome.SUCCEEDED, 1)
    assert first.response == b"filled:%d" % runs[0] and first.token == runs[0]
    again = await client.once(work, namespace=NS, key=key)
    assert runs == [first.token], "a completed key never runs its work again"
    assert (again.replayed, again.outcome, again.response, again.token) == (True, Outcome.SUCCEEDED, first.response, first.token)
    assert again.completed_at_ms and again.completed_at_ms > 0
    view = await client.get(NS, key)
    assert (view.state, view.outcome, view.response) == (State.COMPLETED, Outcome.SUCCEEDED, first.response)


async def test_64_concurrent_once_on_one_key_run_the_work_once(client: Client, key: str) -> None:
    runs = 0
    release = asyncio.Event()

    async def work(attempt: Attempt) -> bytes:
        nonlocal runs
        runs += 1
        # Hold the key until every other caller has reserved at least once, so that they
        # really wait for this attempt (server-side waits) rather than arrive after it.
        await release.wait()
        return b"the one run"

    started = 0

    async def one() -> oncegate.OnceResult:
        nonlocal started
        started += 1
        if started == 64:
            asyncio.get_running_loop().call_later(0, release.set)
        return await client.once(work, namespace=NS, key=key)

    results = await asyncio.gather(*(one() for _ in range(64)))
    assert runs == 1
    assert [r.replayed for r in results].count(False) == 1
    assert {r.response for r in results} == {b"the one run"}
    assert len({r.token for r in results}) == 1


async def test_heartbeats_keep_the_lease_while_the_work_outlives_it(client: Client, key: str) -> None:
    async def long_work(attempt: Attempt) -> bytes:
        granted_until = (await client.get(NS, key)).lease_until_ms
        # Work on (polling the gate's record, no fixed wait) until heartbeats have moved
        # the lease past twice its length beyond the grant's: without them the lease would
        # run out, and the work be cancelled with LeaseLostError.
        while (await client.get(NS, key)).lease_until_ms < granted_until + 2 * attempt.lease_ms:
            assert not attempt.lost.is_set()
            await asyncio.sleep(0.02)
        return b"outlived its lease"

    result = await asyncio.wait_for(client.once(long_work, namespace=NS, key=key, lease_ms=300), timeout=30)
    assert result.response == b"outlived its lease" and not result.replayed


async def test_a_retryable_failure_releases_and_the_next_once_runs(client: Client, key: str) -> None:
    runs: List[Attempt] = []

    async def flaky(attempt: Attempt) -> bytes:
        runs.append(attempt)
        if len(runs) == 1:
            raise Retryable("the exchange was busy")
        return b"ok"

    with pytest.raises(Retryable):
        await client.once(flaky, namespace=NS, key=key)
    assert (await client.get(NS, key)).state == State.FREE, "the key was released"
    result = await client.once(flaky, namespace=NS, key=key)
    assert len(runs) == 2 and not result.replayed and result.response == b"ok"
    assert runs[1].previous == Previous.NONE, "a released key is not abandoned"
    assert runs[1].token > runs[0].token


async def test_a_stored_failure_replays_as_a_failure(client: Client, key: str) -> None:
    runs = 0

    async def rejected(attempt: Attempt) -> bytes:
        nonlocal runs
        runs += 1
        raise Final("insufficient funds", response=b'{"error":"funds"}')

    with pytest.raises(Final) as fresh:
        await client.once(rejected, namespace=NS, key=key)
    assert not isinstance(fresh.value, ReplayedFailure)
    with pytest.raises(ReplayedFailure) as replayed:
        await client.once(rejected, namespace=NS, key=key)
    assert runs == 1
    failure = replayed.value
    assert isinstance(failure, Final) and isinstance(failure, oncegate.OncegateError)
    assert failure.response == b'{"error":"funds"}' and failure.code == "failed"
    assert failure.result.outcome == Outcome.FAILED and failure.result.replayed
    view = await client.get(NS, key)
    assert (view.state, view.outcome) == (State.COMPLETED, Outcome.FAILED)
    # The block form raises it from the `async with` line: the body never runs.
    with pytest.raises(ReplayedFailure):
        async with client.attempt(NS, key):
            pytest.fail("the body of a completed key must not run")


async def test_an_unknown_failure_leaves_the_key_held(client: Client, key: str) -> None:
    async def timed_out(attempt: Attempt) -> bytes:
        raise Unknown("the order request timed out after it was sent")

    with pytest.raises(Unknown):
        await client.once(timed_out, namespace=NS, key=key, lease_ms=60_000)
    assert (await client.get(NS, key)).state == State.PENDING
    with pytest.raises(oncegate.InProgressError) as busy:
        await client.once(timed_out, namespace=NS, key=key, wait_ms=0)
    assert busy.value.code == "in_progress" and busy.value.retry_after_ms >= 1


async def test_the_block_form(client: Client, key: str) -> None:
    async with client.attempt(NS, key, fingerprint=fingerprint_json({"qty": 1})) as attempt:
        assert attempt.attempt == 1 and not attempt.abandoned_before
        attempt.response = b"placed"
    with pytest.raises(Replayed) as replay:
        async with client.attempt(NS, key, fingerprint=fingerprint_json({"qty": 1.0})):
            pytest.fail("the body of a completed key must not run")
    assert replay.value.response == b"placed" and replay.value.result.replayed
    with pytest.raises(MismatchError):
        async with client.attempt(NS, key, fingerprint=fingerprint_json({"qty": 2})):
            pytest.fail("a mismatch must not run the body")


async def test_the_decorator(client: Client, key: str) -> None:
    calls: List[Dict[str, Any]] = []

    @client.once(namespace=NS, key_from=lambda order: f"{key}-{order['id']}", fingerprint_from=fingerprint_json)
    async def place(order: Dict[str, Any]) -> Dict[str, Any]:
        calls.append(order)
        return {"order": order["id"], "token": oncegate.current_attempt().token}

    first = await place({"id": 7, "qty": 1})
    second = await place({"qty": 1, "id": 7})
    assert first == second and len(calls) == 1
    with pytest.raises(MismatchError):
        await place({"id": 7, "qty": 2})


async def test_a_trade_key_is_derived_by_the_server(client: Client) -> None:
    import uuid

    trade = oncegate.TradeKey("pytest", f"SYM{uuid.uuid4().hex[:8]}", "buy", "0.5", live=False, bucket_ms=60_000, bucket_grace_ms=2_000)
    result = await client.once(lambda attempt: asyncio.sleep(0, b"ok"), namespace=NS, trade=trade)
    base, _, bucket = result.key.partition("::")
    assert base == trade.base and bucket.isdigit()


async def test_a_stale_token_is_refused_after_a_takeover(client: Client, key: str) -> None:
    first = await client.reserve(NS, key, lease_ms=100)
    assert isinstance(first.answer, oncegate.Granted)
    # The first holder never heartbeats: its lease lapses, and a waiting reserve takes the
    # key over (the server decides when; no sleep here).
    second = await client.reserve(NS, key, lease_ms=30_000, wait_ms=10_000)
    assert isinstance(second.answer, oncegate.Granted)
    assert second.answer.previous == Previous.ABANDONED and second.answer.attempt == 2
    assert second.answer.token > first.answer.token
    with pytest.raises(LeaseLostError) as stale:
        await client.commit(NS, key, first.answer.token, Outcome.SUCCEEDED, b"late")
    assert stale.value.code == "lease_lost" and not stale.value.retryable
    import grpc

    assert stale.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(LeaseLostError):
        await client.heartbeat(NS, key, first.answer.token, 1_000)
    await client.commit(NS, key, second.answer.token, Outcome.SUCCEEDED, b"current")
    view = await client.get(NS, key)
    assert (view.state, view.token, view.response) == (State.COMPLETED, second.answer.token, b"current")


async def test_a_lost_lease_cancels_the_block_and_raises(client: Client, key: str) -> None:
    held: List[Attempt] = []
    with pytest.raises(LeaseLostError) as lost:
        async with client.attempt(NS, key, lease_ms=1_000) as attempt:
            held.append(attempt)
            # The holder's token is released behind its back (as an operator's force
            # release would): its next heartbeat is refused, and the body is cancelled.
            await client.release(NS, key, attempt.token)
            await asyncio.Event().wait()
    assert held[0].lost.is_set() and lost.value.token == held[0].token
    assert (await client.get(NS, key)).state == State.FREE, "nothing was committed"


async def test_refusals_carry_the_stable_code_and_field(client: Client) -> None:
    with pytest.raises(oncegate.OncegateError) as refused:
        await client.reserve("bad namespace!", "k")
    assert refused.value.code == "invalid_argument" and refused.value.field == "namespace"
    with pytest.raises(oncegate.OncegateError) as missing:
        await client.commit(NS, "no-such-key-ever", 7, Outcome.SUCCEEDED)
    assert missing.value.code == "not_found"


async def test_a_commit_that_is_refused_is_unconfirmed_and_the_key_stays_held(client: Client, key: str) -> None:
    async def too_large(attempt: Attempt) -> bytes:
        return b"x" * (70 * 1024)  # over the server's response_bytes_max (64 KiB)

    with pytest.raises(oncegate.UnconfirmedError) as unconfirmed:
        await client.once(too_large, namespace=NS, key=key, lease_ms=60_000)
    assert unconfirmed.value.code == "invalid_argument" and unconfirmed.value.field == "response"
    assert len(unconfirmed.value.response) == 70 * 1024
    assert (await client.get(NS, key)).state == State.PENDING, "the work ran: the key is not freed"


@pytest.mark.parametrize("on_cancel", ["keep", "release"])
async def test_a_cancelled_work_keeps_or_releases_its_key(client: Client, key: str, on_cancel: oncegate.OnCancel) -> None:
    running = asyncio.Event()

    async def blocked(attempt: Attempt) -> bytes:
        running.set()
        await asyncio.Event().wait()
        return b""

    task = asyncio.ensure_future(client.once(blocked, namespace=NS, key=key, lease_ms=60_000, on_cancel=on_cancel))
    await running.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if on_cancel == "keep":
        assert (await client.get(NS, key)).state == State.PENDING
        return
    # The release runs in the background: poll the gate until it lands (bounded).
    async def freed() -> None:
        while (await client.get(NS, key)).state != State.FREE:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(freed(), timeout=10)
