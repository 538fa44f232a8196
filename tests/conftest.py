"""Fixtures shared by the whole suite: the four services started in one process on port 0.

`services` starts billing, tools, orchestrator and gateway (in that order) with their
databases in a temporary folder, and gives an owner's API key and organization;
`services_with_private_network` does the same with the tools service allowed to reach
loopback and private addresses (test MCP, HTTP and PostgreSQL servers on 127.0.0.1).

Backend: SQLite + the in-memory backend by default. LOOPLINE_TEST_BACKEND=postgres (Makefile
`test-pg`) gives every stack fresh PostgreSQL databases, one per service, created from
templates migrated once per test session (`CREATE DATABASE ... TEMPLATE`, dropped when the
stack stops) on LOOPLINE_TEST_POSTGRES_URL, and Redis (LOOPLINE_TEST_REDIS_URL) with a key
prefix of its own, so parallel stacks never share rows, streams or counters.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer

#: The metrics port settings, 0 (any free port) in every service a test starts: parallel test runs
#: and a `make run` stack would collide on the defaults (9101-9103). Set in the environment too,
#: for the tests that start a server with their own settings.
METRICS_PORTS = {
    "LOOPLINE_ORCHESTRATOR_METRICS_PORT": "0",
    "LOOPLINE_BILLING_METRICS_PORT": "0",
    "LOOPLINE_TOOLS_METRICS_PORT": "0",
}
for _variable, _port in METRICS_PORTS.items():
    os.environ.setdefault(_variable, _port)

SCRIPTED = {"integration_name": "loopline", "provider_id": "scripted", "model_id": "default"}
# A session factory bound to no engine: for objects under test that must not reach a database.
NO_DATABASE: async_sessionmaker[AsyncSession] = async_sessionmaker()


def script(*steps: dict[str, Any]) -> str:
    """A user message that drives the scripted model through `steps`."""
    return json.dumps({"script": list(steps)})


@dataclass
class Stack:
    """The running services and an owner's credentials for one organization."""

    billing: BillingServer
    tools: ToolsServer
    orchestrator: OrchestratorServer
    gateway: GatewayServer
    org_id: str
    api_key: str
    user_id: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def headers(self, api_key: str | None = None, org_id: str | None = None) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {api_key or self.api_key}",
            "X-Organization-ID": org_id or self.org_id,
        }

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers(), timeout=30, **kwargs
        )

    async def member(self, role: str, org_id: str | None = None) -> dict[str, str]:
        """A new user with `role` in `org_id` (default: the stack's org); returns its api_key."""
        return await identity.create_member(self.gateway.sessions, org_id or self.org_id, role)


_TEMPLATE: dict[str, object] = {}
SERVICES = ("gateway", "orchestrator", "billing", "tools")


def selected_backend() -> str:
    """ "sqlite" (default) or "postgres" (LOOPLINE_TEST_BACKEND)."""
    return os.environ.get("LOOPLINE_TEST_BACKEND", "sqlite").strip().lower() or "sqlite"


def postgres_url() -> str:
    """The SQLAlchemy URL of the test PostgreSQL server (its `test` database)."""
    return os.environ.get(
        "LOOPLINE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
    )


def redis_url() -> str:
    """The URL of the test Redis."""
    return os.environ.get("LOOPLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _database_url(name: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(postgres_url()).set(database=name).render_as_string(hide_password=False)


async def _maintenance():  # noqa: ANN202
    """An asyncpg connection to the server's `postgres` maintenance database."""
    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(postgres_url())
    return await asyncpg.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 5432,
        user=url.username or "postgres",
        password=url.password,
        database="postgres",
    )


async def _postgres_templates() -> dict[str, str]:
    """{service: template database}, created and migrated once per test process."""
    if "pg" not in _TEMPLATE:
        import asyncio

        from services.common import db

        tag = f"lltmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        names = {service: f"{tag}_{service}" for service in SERVICES}
        connection = await _maintenance()
        try:
            for name in names.values():
                await connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            await connection.close()
        for service, name in names.items():
            await asyncio.to_thread(db.migrate, service, _database_url(name))
        _TEMPLATE["pg"] = names
    return _TEMPLATE["pg"]  # type: ignore[return-value]


class _DatabasePool:
    """A background thread that keeps fresh database sets ready and drops used ones.

    Creating a PostgreSQL database from a template costs ~0.7 s and dropping one ~0.6 s
    on the CI server, four of each per stack; doing both off the tests' event loops (up
    to `ahead` sets prepared in advance) keeps `make test-pg` close to `make test`.
    """

    def __init__(self, ahead: int = 2) -> None:
        import queue
        import threading

        self.ready: queue.Queue = queue.Queue(maxsize=ahead)
        self.drops: queue.Queue = queue.Queue()
        self.failure: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._main, name="pg-database-pool", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        import asyncio

        try:
            asyncio.run(self._serve())
        except BaseException as error:  # noqa: BLE001 - handed to the test that waits
            self.failure = error
            self.ready.put(None)

    async def _serve(self) -> None:
        import asyncio
        import queue

        try:
            templates = await _postgres_templates()
        except BaseException as error:  # noqa: BLE001 - handed to the test that waits
            self.failure = error
            self.ready.put(None)
            return
        while not self.stopping.is_set() or not self.drops.empty():
            while True:
                try:
                    urls = self.drops.get_nowait()
                except queue.Empty:
                    break
                await drop_databases(urls)
            if not self.stopping.is_set() and not self.ready.full():
                tag = f"llt_{uuid.uuid4().hex[:12]}"

                async def create(service: str, template: str, tag: str = tag) -> None:
                    connection = await _maintenance()
                    try:
                        await connection.execute(
                            f'CREATE DATABASE "{tag}_{service}" TEMPLATE "{template}"'
                        )
                    finally:
                        await connection.close()

                try:
                    await asyncio.gather(
                        *(create(service, template) for service, template in templates.items())
                    )
                except BaseException as error:  # noqa: BLE001
                    self.failure = error
                    self.ready.put(None)
                    return
                self.ready.put({service: _database_url(f"{tag}_{service}") for service in SERVICES})
                continue
            await asyncio.sleep(0.05)
        await drop_databases([_database_url(name) for name in templates.values()])
        for urls in _drain(self.ready):
            if urls:
                await drop_databases(list(urls.values()))

    def take(self) -> dict[str, str]:
        """A ready set {service: URL} (blocks until one is ready)."""
        urls = self.ready.get(timeout=120)
        if urls is None:
            raise RuntimeError(f"creating PostgreSQL test databases failed: {self.failure!r}")
        return urls

    def close(self, timeout: float = 120) -> None:
        """Drop every queued and prepared database and the templates, then stop."""
        self.stopping.set()
        self.thread.join(timeout)


def _drain(q) -> list:  # noqa: ANN001
    import queue

    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _pool() -> _DatabasePool:
    if "pool" not in _TEMPLATE:
        _TEMPLATE["pool"] = _DatabasePool()
    return _TEMPLATE["pool"]  # type: ignore[return-value]


async def postgres_databases() -> dict[str, str]:
    """Fresh migrated databases, one per service: {service: SQLAlchemy URL}."""
    import asyncio

    return await asyncio.to_thread(_pool().take)


def release_databases(urls: list[str]) -> None:
    """Hand used databases to the pool thread, which drops them."""
    _pool().drops.put(urls)


async def drop_databases(urls: list[str]) -> None:
    """Drop the databases (closing any connection still open to them)."""
    import asyncio

    from sqlalchemy.engine import make_url

    async def drop(url: str) -> None:
        connection = await _maintenance()
        try:
            await connection.execute(
                f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'
            )
        finally:
            await connection.close()

    await asyncio.gather(*(drop(url) for url in urls))


async def drop_redis_prefix(url: str, prefix: str) -> None:
    """Delete every Redis key under `prefix`."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        async for batch in _scan_batches(client, f"{prefix}*"):
            await client.delete(*batch)
    finally:
        await client.aclose()


async def _scan_batches(client, pattern: str):  # noqa: ANN001, ANN202
    batch: list[bytes] = []
    async for key in client.scan_iter(match=pattern, count=500):
        batch.append(key)
        if len(batch) >= 500:
            yield batch
            batch = []
    if batch:
        yield batch


async def backend_settings(
    tmp_path,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """Settings that select the test backend for one stack.

    Returns (common settings, {service: its database setting}, cleanup info for `cleanup_backend`).
    SQLite: copies of the migrated template in `tmp_path`, no Redis. PostgreSQL: fresh
    databases and Redis with a unique key prefix.
    """
    import asyncio

    common: dict[str, Any] = {
        "data_dir": tmp_path,
        "host": "127.0.0.1",
        "redis_url": "",
        "log_level": "WARNING",
        "shutdown_grace_s": 1.0,
        "auto_migrate": False,
    }
    if selected_backend() == "postgres":
        urls = await postgres_databases()
        prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
        common.update(redis_url=redis_url(), redis_key_prefix=prefix)
        per_service = {service: {f"{service}_database_url": url} for service, url in urls.items()}
        return common, per_service, {"databases": list(urls.values()), "redis_prefix": prefix}
    template = await asyncio.to_thread(_migrated_template, tmp_path.parent)
    for item in template.iterdir():  # type: ignore[attr-defined]
        if item.suffix == ".db":
            shutil.copy(item, tmp_path / item.name)
    return common, {service: {} for service in SERVICES}, {}


async def cleanup_backend(info: dict[str, Any]) -> None:
    """Drop what `backend_settings` created (PostgreSQL databases, Redis keys)."""
    if info.get("databases"):
        release_databases(info["databases"])
    if info.get("redis_prefix"):
        await drop_redis_prefix(redis_url(), info["redis_prefix"])


def _migrated_template(tmp_root) -> object:
    """A folder with the four SQLite databases migrated once per session (copied per test)."""
    if "dir" not in _TEMPLATE:
        from services.common import db

        folder = tmp_root / "migrated-template"
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("gateway", "orchestrator", "billing", "tools"):
            db.migrate(name, f"sqlite+aiosqlite:///{(folder / f'{name}.db').as_posix()}")
        _TEMPLATE["dir"] = folder
    return _TEMPLATE["dir"]


async def start_stack(
    tmp_path,
    *,
    orchestrator: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    billing: dict[str, Any] | None = None,
    tools: dict[str, Any] | None = None,
) -> Stack:
    """Start the four services with data in `tmp_path`; keyword dicts override settings.

    The databases are copies of a template migrated once per test session (a fresh
    migration per test would cost most of a test's time); `auto_migrate` is off. The
    backend (SQLite + memory, or PostgreSQL + Redis) follows LOOPLINE_TEST_BACKEND.
    """
    common, db_settings, cleanup = await backend_settings(tmp_path)

    def settings(service: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
        return {**common, **db_settings[service], **(overrides or {})}

    billing_server = await BillingServer.start(
        BillingSettings(
            **{**settings("billing", billing), "billing_port": 0, "billing_metrics_port": 0}
        )
    )
    tools_server = await ToolsServer.start(
        ToolsSettings(**{**settings("tools", tools), "tools_port": 0, "tools_metrics_port": 0})
    )
    addrs = {
        "billing_addr": f"127.0.0.1:{billing_server.port}",
        "tools_addr": f"127.0.0.1:{tools_server.port}",
    }
    orchestrator_server = await OrchestratorServer.start(
        OrchestratorSettings(
            **{
                **settings("orchestrator", orchestrator),
                **addrs,
                "orchestrator_port": 0,
                "orchestrator_metrics_port": 0,
            }
        )
    )
    gateway_server = await GatewayServer.start(
        GatewaySettings(
            **{
                **settings("gateway", gateway),
                "orchestrator_addr": f"127.0.0.1:{orchestrator_server.port}",
                **addrs,
                "http_port": 0,
                "gateway_grpc_port": 0,
            }
        )
    )
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    owner = await identity.create_member(gateway_server.sessions, org_id, "owner")
    return Stack(
        billing_server,
        tools_server,
        orchestrator_server,
        gateway_server,
        org_id,
        owner["api_key"],
        owner["user_id"],
        extra={"cleanup": cleanup},
    )


async def stop_stack(services: Stack) -> None:
    """Stop the services in reverse order, then drop their PostgreSQL databases and Redis keys."""
    await services.gateway.stop(1)
    await services.orchestrator.stop(1)
    await services.tools.stop(1)
    await services.billing.stop(1)
    await cleanup_backend(services.extra.get("cleanup", {}))


@pytest.fixture
async def services(tmp_path) -> AsyncIterator[Stack]:
    """The four services with default settings (heartbeat shortened to 1 s)."""
    running = await start_stack(tmp_path, gateway={"heartbeat_interval_s": 1.0})
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest.fixture
async def services_with_private_network(tmp_path) -> AsyncIterator[Stack]:
    """The four services, the tools service allowed to reach private (loopback) addresses."""
    running = await start_stack(
        tmp_path,
        gateway={"heartbeat_interval_s": 1.0},
        tools={"tools_allow_private_network": True},
    )
    try:
        yield running
    finally:
        await stop_stack(running)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001, ARG001
    """Drop this process's PostgreSQL test databases and templates (see `_DatabasePool`)."""
    pool = _TEMPLATE.pop("pool", None)
    if isinstance(pool, _DatabasePool):
        pool.close()
