"""Scale-out fixtures: orchestrator and gateway replicas as real processes on PostgreSQL + Redis.

`cluster` gives fresh PostgreSQL databases (one per service, see tests/conftest.py), a
Redis key prefix of its own, billing and tools started in this process on port 0, an
owner's API key, and `spawn_orchestrator` / `spawn_gateway` that start
`python -m services.<name>` subprocesses pointed at all of it. Every process is killed
at the end. The tests are skipped, with the reason, when PostgreSQL or Redis cannot be
reached (LOOPLINE_TEST_POSTGRES_URL, LOOPLINE_TEST_REDIS_URL), and outside the PostgreSQL
pass (LOOPLINE_TEST_BACKEND=postgres, `make test-pg`) to keep `make test` fast.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy.engine import make_url

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.common import db
from services.gateway import identity
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer
from tests.conftest import (
    METRICS_PORTS,
    SERVICES,
    cleanup_backend,
    postgres_databases,
    postgres_url,
    redis_url,
    selected_backend,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def fresh_redis_prefix() -> str:
    """A new key prefix on the test Redis (`lltest:<hex>:`); skips the test when Redis is not
    reachable."""
    target = urlsplit(redis_url())
    if not _reachable(target.hostname or "127.0.0.1", target.port or 6379):
        pytest.skip("Redis is not reachable (LOOPLINE_TEST_REDIS_URL)")
    return f"lltest:{uuid.uuid4().hex[:12]}:"


async def no_archive(run_id: str) -> list:
    """An archive loader with nothing archived (the event-log tests publish and read live)."""
    return []


def unavailable_reason() -> str | None:
    """Why the scale tests cannot run here (None when PostgreSQL and Redis answer)."""
    pg = make_url(postgres_url())
    if not _reachable(pg.host or "127.0.0.1", pg.port or 5432):
        where = f"{pg.host}:{pg.port or 5432}"
        return f"PostgreSQL is not reachable at {where} (LOOPLINE_TEST_POSTGRES_URL)"
    redis = urlsplit(redis_url())
    host, port = redis.hostname or "127.0.0.1", redis.port or 6379
    if not _reachable(host, port):
        return f"Redis is not reachable at {host}:{port} (LOOPLINE_TEST_REDIS_URL)"
    return None


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_port(
    port: int, process: subprocess.Popen, log: pathlib.Path, timeout: float = 30
) -> None:
    """Wait until `port` accepts connections; fail with the process log if it exits or times out."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if process.poll() is not None:
            tail = (await asyncio.to_thread(log.read_text))[-4000:]
            raise AssertionError(f"process exited with {process.returncode}:\n{tail}")
        if _reachable("127.0.0.1", port):
            return
        if asyncio.get_running_loop().time() > deadline:
            tail = (await asyncio.to_thread(log.read_text))[-4000:]
            raise AssertionError(f"port {port} not open after {timeout} s:\n{tail}")
        await asyncio.sleep(0.05)


@dataclass
class Replica:
    """A service subprocess: its port (gRPC for an orchestrator, HTTP for a gateway) and log."""

    name: str
    port: int
    process: subprocess.Popen
    log: pathlib.Path

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is cleaned up)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Cluster:
    """Shared PostgreSQL databases, Redis prefix, in-process billing/tools and spawned replicas."""

    tmp: pathlib.Path
    urls: dict[str, str]
    redis_prefix: str
    billing: BillingServer
    tools: ToolsServer
    org_id: str
    api_key: str
    user_id: str
    replicas: list[Replica] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment every replica shares (plus `extra`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
        env.update(
            {
                **METRICS_PORTS,  # any free port: replicas share the host
                "LOOPLINE_DATA_DIR": str(self.tmp / "var"),
                "LOOPLINE_LOG_LEVEL": "INFO",
                "LOOPLINE_AUTO_MIGRATE": "false",
                "LOOPLINE_REDIS_URL": redis_url(),
                "LOOPLINE_REDIS_KEY_PREFIX": self.redis_prefix,
                "LOOPLINE_BILLING_ADDR": f"127.0.0.1:{self.billing.port}",
                "LOOPLINE_TOOLS_ADDR": f"127.0.0.1:{self.tools.port}",
                "LOOPLINE_ORCHESTRATOR_DATABASE_URL": self.urls["orchestrator"],
                "LOOPLINE_GATEWAY_DATABASE_URL": self.urls["gateway"],
                "LOOPLINE_SHUTDOWN_GRACE_S": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(extra)
        return env

    def _spawn(
        self, service: str, name: str, env: dict[str, str]
    ) -> tuple[subprocess.Popen, pathlib.Path]:
        log = self.tmp / f"{name}.log"
        handle = log.open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", f"services.{service}"],
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        handle.close()
        return process, log

    async def spawn_orchestrator(self, name: str, **settings: str) -> Replica:
        """Start an orchestrator replica; `settings` are extra LOOPLINE_* variables."""
        port = free_port()
        process, log = self._spawn(
            "orchestrator", name, self.env(LOOPLINE_ORCHESTRATOR_PORT=str(port), **settings)
        )
        replica = Replica(name, port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        return replica

    async def spawn_gateway(self, name: str, orchestrator: Replica, **settings: str) -> Replica:
        """Start a gateway replica in front of `orchestrator`."""
        port = free_port()
        env = self.env(
            LOOPLINE_HTTP_PORT=str(port),
            LOOPLINE_GATEWAY_GRPC_PORT=str(free_port()),
            LOOPLINE_ORCHESTRATOR_ADDR=f"127.0.0.1:{orchestrator.port}",
            LOOPLINE_HEARTBEAT_INTERVAL_S="1",
            **settings,
        )
        process, log = self._spawn("gateway", name, env)
        replica = Replica(name, port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        return replica

    def client(self, gateway: Replica) -> httpx.AsyncClient:
        """An HTTP client of `gateway` with the owner's credentials."""
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gateway.port}",
            timeout=30,
            headers={"Authorization": f"Bearer {self.api_key}", "X-Organization-ID": self.org_id},
        )

    def logs(self) -> str:
        """The tail of every replica's log (for failure messages)."""
        return "\n".join(
            f"--- {r.name}\n{r.log.read_text()[-3000:]}" for r in self.replicas if r.log.exists()
        )


@pytest.fixture(autouse=True)
def _postgres_pass_only() -> None:
    """Every scale test runs in the PostgreSQL + Redis pass only (`make test` stays SQLite +
    memory)."""
    if selected_backend() != "postgres":
        pytest.skip(
            "scale-out tests run on PostgreSQL + Redis: "
            "LOOPLINE_TEST_BACKEND=postgres (make test-pg)"
        )


@pytest.fixture
async def cluster(tmp_path) -> AsyncIterator[Cluster]:
    """Fresh PostgreSQL databases + Redis prefix, billing and tools in-process, an owner's key.

    Runs in the PostgreSQL pass only (`make test-pg`), so `make test` stays fast.
    """
    if selected_backend() != "postgres":
        pytest.skip(
            "replica tests run on PostgreSQL + Redis: LOOPLINE_TEST_BACKEND=postgres (make test-pg)"
        )
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    urls = await postgres_databases()
    prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
    common: dict[str, Any] = {
        "data_dir": tmp_path,
        "host": "127.0.0.1",
        "redis_url": redis_url(),
        "redis_key_prefix": prefix,
        "log_level": "WARNING",
        "shutdown_grace_s": 1.0,
        "auto_migrate": False,
    }
    billing = await BillingServer.start(
        BillingSettings(
            **common,
            billing_port=0,
            billing_metrics_port=0,
            billing_database_url=urls["billing"],
        )
    )
    tools = await ToolsServer.start(
        ToolsSettings(
            **common, tools_port=0, tools_metrics_port=0, tools_database_url=urls["tools"]
        )
    )
    engine = db.make_engine(urls["gateway"])
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    try:
        owner = await identity.create_member(db.sessionmaker(engine), org_id, "owner")
    finally:
        await engine.dispose()
    running = Cluster(
        tmp_path, urls, prefix, billing, tools, org_id, owner["api_key"], owner["user_id"]
    )
    try:
        yield running
    finally:
        for replica in running.replicas:
            replica.kill()
        await tools.stop(1)
        await billing.stop(1)
        await cleanup_backend({"databases": [urls[s] for s in SERVICES], "redis_prefix": prefix})
