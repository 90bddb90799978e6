"""Each test session starts its own ``oncegate serve`` on a free port with its own data
directory, and stops it at the end (SIGTERM, then wait).

The binary is ``$ONCEGATE_BIN``, else ``<repo>/target/release/oncegate``, else
``<repo>/target/debug/oncegate``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, List, Optional

import pytest

# The tests start processes (servers, a worker) from a process that runs gRPC. grpcio's
# fork handlers, run in the child between fork and exec where subprocess forks (Python
# before 3.10), sometimes kill the child before it execs: turned off before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import oncegate  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
VECTORS = HERE.parent.parent / "vectors.json"


def oncegate_bin() -> Path:
    """The server binary the tests run."""
    configured = os.environ.get("ONCEGATE_BIN")
    candidates = [Path(configured)] if configured else [
        REPO / "target" / "release" / "oncegate",
        REPO / "target" / "debug" / "oncegate",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        f"no oncegate binary: set ONCEGATE_BIN, or build one (tried {', '.join(map(str, candidates))})"
    )


@dataclass
class Server:
    """A running ``oncegate serve``."""

    process: subprocess.Popen[str]
    address: str
    log: List[str]

    def stop(self) -> None:
        """SIGTERM, then wait (SIGKILL if it does not stop within 30 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL (no clean shutdown), then wait."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    @property
    def listen(self) -> str:
        """The ``host:port`` it listens on (to start another server there)."""
        return self.address[len("http://") :]


def start_server(data_dir: Path, extra: Optional[List[str]] = None, *, listen: str = "127.0.0.1:0") -> Server:
    """Starts the server (on ``listen``: a free port by default) and waits for its
    ``listening`` log line, which has the port."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "ONCEGATE_CONFIG")}
    env["ONCEGATE_LOG_FORMAT"] = "text"
    env["NO_COLOR"] = "1"
    process = subprocess.Popen(
        [str(oncegate_bin()), "serve", "--listen", listen, "--metrics-listen", "127.0.0.1:0",
         "--data-dir", str(data_dir), *(extra or [])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    found = threading.Event()
    log: List[str] = []
    address: List[str] = []

    def drain() -> None:
        # Keep reading after the address is found, so that the pipe never fills.
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            match = re.search(r"listening\b.*?addr=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
            if match and not address:
                address.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(timeout=60) or not address:
        process.kill()
        process.wait()
        raise RuntimeError("the server did not start:\n" + "".join(log))
    return Server(process, f"http://{address[0]}", log)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="oncegate-py-") as tmp:
        running = start_server(Path(tmp) / "data")
        try:
            yield running
        finally:
            running.stop()


@dataclass
class AuthServer:
    server: Server
    token: str


@pytest.fixture(scope="session")
def auth_server() -> Iterator[AuthServer]:
    """A server with one tenant, whose bearer token is ``token``."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="oncegate-py-auth-") as tmp:
        config = Path(tmp) / "oncegate.toml"
        config.write_text(
            "[[tenants]]\n"
            'name = "py"\n'
            f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        )
        running = start_server(Path(tmp) / "data", ["--config", str(config)])
        try:
            yield AuthServer(running, token)
        finally:
            running.stop()


@pytest.fixture
async def client(server: Server) -> AsyncIterator[oncegate.Client]:
    async with oncegate.Client(server.address) as connected:
        yield connected


@pytest.fixture
def key() -> str:
    """A key no other test uses."""
    return f"py-{uuid.uuid4()}"
