"""A server with tenants: the bearer token is sent, and its absence refused."""

from __future__ import annotations

import pytest

import oncegate
from conftest import AuthServer
from oncegate import Attempt


async def test_the_token_is_sent(auth_server: AuthServer, key: str) -> None:
    async def work(attempt: Attempt) -> bytes:
        return b"authenticated"

    async with oncegate.Client(auth_server.server.address, token=auth_server.token) as client:
        result = await client.once(work, namespace="pytest", key=key)
        assert result.response == b"authenticated"
        async with client.session() as session:
            assert (await session.get("pytest", key)).response == b"authenticated"


async def test_no_token_or_a_wrong_one_is_unauthenticated(auth_server: AuthServer, key: str) -> None:
    for token in (None, "not-the-token"):
        async with oncegate.Client(auth_server.server.address, token=token) as client:
            with pytest.raises(oncegate.OncegateError) as refused:
                await client.get("pytest", key)
            assert refused.value.code == "unauthenticated" and not refused.value.retryable


def test_tls_settings_need_an_https_address() -> None:
    with pytest.raises(ValueError):
        oncegate.Client("http://127.0.0.1:1", tls_ca="/nonexistent")
