"""Fixtures shared by the whole suite: the four services started in one process on port 0.

`stack` starts billing, tools, orchestrator and gateway (in that order) with their
databases in a temporary folder, and gives an owner's API key and organization.
Backend: SQLite + memory by default; LOOPLINE_TEST_BACKEND=postgres is for the
services that support it (see Makefile `test-pg`).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer

SCRIPTED = {"integration_name": "loopline", "provider_id": "scripted", "model_id": "default"}


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
        return {"Authorization": f"Bearer {api_key or self.api_key}", "X-Organization-ID": org_id or self.org_id}

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers(), timeout=30, **kwargs)

    async def member(self, role: str, org_id: str | None = None) -> dict[str, str]:
        """A new user with `role` in `org_id` (default: the stack's org); returns its api_key."""
        return await identity.create_member(self.gateway.sessions, org_id or self.org_id, role)


_TEMPLATE: dict[str, object] = {}


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


async def start_stack(tmp_path, *, orchestrator: dict[str, Any] | None = None, gateway: dict[str, Any] | None = None,
                      billing: dict[str, Any] | None = None, tools: dict[str, Any] | None = None) -> Stack:
    """Start the four services with data in `tmp_path`; keyword dicts override settings.

    The databases are copies of a template migrated once per test session (a fresh
    migration per test would cost most of a test's time); `auto_migrate` is off.
    """
    import asyncio

    template = await asyncio.to_thread(_migrated_template, tmp_path.parent)
    for item in template.iterdir():  # type: ignore[attr-defined]
        if item.suffix == ".db":
            shutil.copy(item, tmp_path / item.name)
    common = {"data_dir": tmp_path, "host": "127.0.0.1", "redis_url": "", "log_level": "WARNING", "shutdown_grace_s": 1.0, "auto_migrate": False}
    billing_server = await BillingServer.start(BillingSettings(**common, billing_port=0, **(billing or {})))
    tools_server = await ToolsServer.start(ToolsSettings(**common, tools_port=0, **(tools or {})))
    addrs = {"billing_addr": f"127.0.0.1:{billing_server.port}", "tools_addr": f"127.0.0.1:{tools_server.port}"}
    orchestrator_server = await OrchestratorServer.start(
        OrchestratorSettings(**common, **addrs, orchestrator_port=0, **(orchestrator or {}))
    )
    gateway_server = await GatewayServer.start(
        GatewaySettings(**common, orchestrator_addr=f"127.0.0.1:{orchestrator_server.port}", http_port=0, gateway_grpc_port=0, **(gateway or {}))
    )
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    owner = await identity.create_member(gateway_server.sessions, org_id, "owner")
    return Stack(billing_server, tools_server, orchestrator_server, gateway_server, org_id, owner["api_key"], owner["user_id"])


async def stop_stack(stack: Stack) -> None:
    """Stop the services in reverse order."""
    await stack.gateway.stop(1)
    await stack.orchestrator.stop(1)
    await stack.tools.stop(1)
    await stack.billing.stop(1)


@pytest.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    """The four services with default settings (heartbeat shortened to 1 s)."""
    running = await start_stack(tmp_path, gateway={"heartbeat_interval_s": 1.0})
    try:
        yield running
    finally:
        await stop_stack(running)
