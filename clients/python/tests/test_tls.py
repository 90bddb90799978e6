"""TLS with a private CA, mutual TLS and a certificate naming another host than the
address (``tls_domain``). The certificates are made with ``openssl``, as
docs/operations.md does."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

import oncegate
from conftest import Server, start_server

DOMAIN = "gate.test"


@dataclass
class TlsServer:
    server: Server
    dir: Path
    token: str

    @property
    def address(self) -> str:
        return self.server.address.replace("http://", "https://")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(at: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=oncegate test CA", cwd=at)
    for name, usage, san in (("server", "serverAuth", f"subjectAltName=DNS:{DOMAIN}\n"), ("client", "clientAuth", "")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=at)
        (at / f"{name}.ext").write_text(f"{san}extendedKeyUsage={usage}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=at)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsServer]:
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests need the openssl command (Debian: openssl)")
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="oncegate-py-tls-") as tmp:
        at = Path(tmp)
        _certificates(at)
        config = at / "oncegate.toml"
        config.write_text(
            "[server]\n"
            f'tls_cert_path = "{at / "server.crt"}"\n'
            f'tls_key_path = "{at / "server.key"}"\n'
            f'tls_client_ca_path = "{at / "ca.crt"}"\n'
            "[[tenants]]\n"
            'name = "tls"\n'
            f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        )
        running = start_server(at / "data", ["--config", str(config)])
        try:
            yield TlsServer(running, at, token)
        finally:
            running.stop()


async def test_mutual_tls_with_a_private_ca(tls_server: TlsServer, key: str) -> None:
    at = tls_server.dir
    async with oncegate.Client(
        tls_server.address,
        token=tls_server.token,
        tls_ca=at / "ca.crt",
        tls_cert=at / "client.crt",
        tls_key=at / "client.key",
        tls_domain=DOMAIN,
    ) as client:

        async def work(attempt: oncegate.Attempt) -> bytes:
            return b"over TLS"

        result = await client.once(work, namespace="pytest", key=key)
        assert result.response == b"over TLS"
        assert (await client.get("pytest", key)).response == b"over TLS"


async def test_tls_is_refused_without_a_client_certificate_or_the_right_name(tls_server: TlsServer, key: str) -> None:
    at = tls_server.dir
    no_retry = oncegate.NO_RETRY
    without_certificate = oncegate.Client(
        tls_server.address, token=tls_server.token, tls_ca=at / "ca.crt", tls_domain=DOMAIN, retry=no_retry, timeout_ms=3_000
    )
    wrong_name = oncegate.Client(
        tls_server.address,
        token=tls_server.token,
        tls_ca=at / "ca.crt",
        tls_cert=at / "client.crt",
        tls_key=at / "client.key",
        retry=no_retry,
        timeout_ms=3_000,
    )
    for client in (without_certificate, wrong_name):
        async with client:
            with pytest.raises(oncegate.OncegateError) as refused:
                await client.get("pytest", key)
            assert refused.value.code == "unavailable", refused.value
