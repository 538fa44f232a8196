"""Readiness follows the database and Redis; liveness does not.

Each service is started alone with its readiness probed every 0.1 s. Its database or Redis is
then broken and restored: a SQLite file moved away (it cannot be opened) and back; PostgreSQL
or Redis behind the suite's TCP proxy (tests/tcp_proxy.py) cut and restored. The gRPC health
status of "" and of the service's name goes NOT_SERVING and back to SERVING, the gateway's
`/readyz` 503 naming the dependency and back to 200, while "liveness" and `/healthz` stay up.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.common import db, readiness
from services.common.grpc_server import LIVENESS
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import SERVICE_NAME as ORCHESTRATOR_NAME
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import SERVICE_NAME as TOOLS_NAME
from services.tools.server import ToolsServer
from tests.conftest import (
    _migrated_template,
    drop_redis_prefix,
    postgres_databases,
    postgres_url,
    redis_url,
    release_databases,
    selected_backend,
)
from tests.tcp_proxy import CuttableProxy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BILLING_NAME = "loopline.billing.v1.BillingService"
SERVICES = ("billing", "tools", "orchestrator", "gateway")
WITH_REDIS = ("billing", "orchestrator", "gateway")  # tools has no Redis
UNUSED = "127.0.0.1:1"  # a downstream address nothing in these tests calls


@dataclass
class Running:
    """A service started alone: its server, gRPC port, health names, HTTP port (gateway)."""

    server: Any
    grpc_port: int
    names: tuple[str, ...]
    http_port: int = 0


async def _start(service: str, settings: dict[str, Any]) -> Running:
    """Start `service` alone with `settings` (plus ports 0 and downstream addresses unused)."""
    if service == "billing":
        billing = await BillingServer.start(BillingSettings(**settings, billing_port=0))
        return Running(billing, billing.port, ("", BILLING_NAME))
    if service == "tools":
        tools = await ToolsServer.start(ToolsSettings(**settings, tools_port=0))
        return Running(tools, tools.port, ("", TOOLS_NAME))
    downstream: dict[str, Any] = {"billing_addr": UNUSED, "tools_addr": UNUSED}
    if service == "orchestrator":
        orchestrator = await OrchestratorServer.start(
            OrchestratorSettings(**settings, **downstream, orchestrator_port=0)
        )
        return Running(orchestrator, orchestrator.port, ("", ORCHESTRATOR_NAME))
    gateway = await GatewayServer.start(
        GatewaySettings(
            **settings,
            **downstream,
            orchestrator_addr=UNUSED,
            http_port=0,
            gateway_grpc_port=0,
        )
    )
    return Running(gateway, gateway.grpc_port, ("",), gateway.port)


@contextlib.asynccontextmanager
async def _running(service: str, settings: dict[str, Any]) -> AsyncIterator[Running]:
    running = await _start(
        service,
        {
            "host": "127.0.0.1",
            "log_level": "WARNING",
            "shutdown_grace_s": 0.5,
            "auto_migrate": False,
            "readiness_interval_s": 0.1,
            "readiness_timeout_s": 1.0,
            **settings,
        },
    )
    try:
        yield running
    finally:
        await running.server.stop(0.5)


async def _statuses(running: Running) -> dict[str, int]:
    """The health status of each of the service's names and of "liveness"."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answers = {}
        for name in (*running.names, LIVENESS):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            answers[name] = reply.status
        return answers


async def _http(running: Running) -> dict[str, Any]:
    """The gateway's /healthz and /readyz answers ({} for another service)."""
    if not running.http_port:
        return {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.http_port}") as client:
        health, ready = await client.get("/healthz"), await client.get("/readyz")
    return {"healthz": health.status_code, "readyz": (ready.status_code, ready.json())}


async def _expect(running: Running, failing: str | None, within_s: float = 15.0) -> None:
    """Wait until the service reports ready (`failing` None) or not ready because of `failing`;
    liveness stays SERVING throughout."""
    status = SERVING if failing is None else NOT_SERVING
    wanted = {**{name: status for name in running.names}, LIVENESS: SERVING}
    http: dict[str, Any] = {}
    if running.http_port:
        ready = (200, {"status": "ready"})
        not_ready = (503, {"status": "not ready", "failing": [failing]})
        http = {"healthz": 200, "readyz": ready if failing is None else not_ready}
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        seen = (await _statuses(running), await _http(running))
        if seen == (wanted, http):
            return
        assert seen[0][LIVENESS] == SERVING, "liveness must not follow the dependencies"
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"expected {(wanted, http)}, still {seen}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("service", SERVICES)
async def test_a_sqlite_file_that_cannot_be_opened_is_not_ready_until_it_is_back(service, tmp_path):
    template = cast(pathlib.Path, await asyncio.to_thread(_migrated_template, tmp_path.parent))
    shutil.copy(template / f"{service}.db", tmp_path / f"{service}.db")
    database = tmp_path / f"{service}.db"
    async with _running(service, {"data_dir": tmp_path}) as running:
        await _expect(running, None)
        database.rename(tmp_path / "moved-away.db")
        await _expect(running, "database")
        (tmp_path / "moved-away.db").rename(database)
        await _expect(running, None)


def _postgres_pass() -> None:
    if selected_backend() != "postgres":
        pytest.skip("needs PostgreSQL and Redis: LOOPLINE_TEST_BACKEND=postgres (make test-pg)")


@pytest.mark.parametrize("service", SERVICES)
async def test_a_postgresql_that_refuses_connections_is_not_ready_until_it_answers(
    service, tmp_path
):
    _postgres_pass()
    urls = await postgres_databases()
    target = make_url(postgres_url())
    proxy = CuttableProxy(target.host or "127.0.0.1", target.port or 5432)
    via_proxy = make_url(urls[service]).set(host="127.0.0.1", port=await proxy.start())
    setting = {f"{service}_database_url": via_proxy.render_as_string(hide_password=False)}
    try:
        async with _running(service, {"data_dir": tmp_path, **setting}) as running:
            await _expect(running, None)
            proxy.cut()
            await _expect(running, "database")
            proxy.restore()
            await _expect(running, None)
    finally:
        await proxy.stop()
        release_databases(list(urls.values()))


@pytest.mark.parametrize("service", WITH_REDIS)
async def test_a_redis_that_refuses_connections_is_not_ready_until_it_answers(service, tmp_path):
    _postgres_pass()
    urls = await postgres_databases()
    target = urlsplit(redis_url())
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379)
    via_proxy = f"redis://127.0.0.1:{await proxy.start()}{target.path or '/0'}"
    prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
    settings = {
        "data_dir": tmp_path,
        f"{service}_database_url": urls[service],
        "redis_url": via_proxy,
        "redis_key_prefix": prefix,
    }
    try:
        async with _running(service, settings) as running:
            await _expect(running, None)
            proxy.cut()
            await _expect(running, "redis")
            proxy.restore()
            await _expect(running, None)
    finally:
        await proxy.stop()
        release_databases(list(urls.values()))
        await drop_redis_prefix(redis_url(), prefix)


async def test_a_database_whose_migrations_have_not_run_is_not_ready(tmp_path):
    """A database that answers but has no tables yet (a service started before its migrations)
    is not ready: every request would fail on it. Ready once it is migrated."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    engine = db.make_engine(url, 1, 5.0)
    try:
        async with engine.begin() as connection:  # the file exists, with no migration table
            await connection.exec_driver_sql("CREATE TABLE unrelated (id INTEGER)")
        dependency = readiness.database(engine, 1.0)
        with pytest.raises(Exception, match="alembic_version"):
            await dependency.probe()
        await db.migrate_async("gateway", url)
        await dependency.probe()
    finally:
        await engine.dispose()
