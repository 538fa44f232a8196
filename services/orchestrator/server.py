"""The orchestrator's gRPC server: AssistantService plus health and reflection."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from sqlalchemy.ext.asyncio import AsyncEngine

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from loopline.billing.v1 import billing_pb2_grpc
from loopline.tools.v1 import tools_pb2_grpc
from services.common import db
from services.common.grpc_server import RunningServer, start_grpc_server
from services.common.internal_auth import internal_channel
from services.common.metrics import MetricsServer
from services.common.readiness import Readiness, database, readiness_of, redis_ping
from services.orchestrator.archive import load_archive
from services.orchestrator.byok import tools_secret_resolver
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.eventlog import RunBackend, make_backend
from services.orchestrator.loop import TurnRunner
from services.orchestrator.providers.clients import ProviderClients
from services.orchestrator.recovery import RunSupervisor
from services.orchestrator.servicer import AssistantServicer
from services.orchestrator.store import TurnStore

log = logging.getLogger(__name__)

SERVICE_NAME = assistant_pb2.DESCRIPTOR.services_by_name["AssistantService"].full_name


class OrchestratorServer:
    """A running orchestrator: its gRPC server, database, downstream channels and loop runner.

    `backend` is the shared state of the replicas (memory, or Redis when LOOPLINE_REDIS_URL
    is set); `supervisor` renews this replica's run leases, reaps runs of dead replicas and
    polls cancel flags (services/orchestrator/recovery.py); `provider_clients` keeps the model
    providers' SDK clients, closed at stop (services/orchestrator/providers/clients.py).
    """

    engine: AsyncEngine
    lease_engine: AsyncEngine | None  # None on SQLite, where leases share the one database
    billing_channel: grpc.aio.Channel
    tools_channel: grpc.aio.Channel
    backend: RunBackend
    store: TurnStore
    runner: TurnRunner
    supervisor: RunSupervisor
    servicer: AssistantServicer

    def __init__(self, settings: OrchestratorSettings) -> None:
        self.settings = settings
        self.port = 0
        self.metrics_port = 0
        self._grpc: RunningServer | None = None
        self.readiness: Readiness | None = None
        self._metrics: MetricsServer | None = None
        self.provider_clients = ProviderClients()

    @classmethod
    async def start(cls, settings: OrchestratorSettings) -> OrchestratorServer:
        """Migrate (when enabled), connect downstream services, and serve on `orchestrator_port`."""
        self = cls(settings)
        if settings.auto_migrate:
            await db.migrate_async("orchestrator", settings.database_url)
        self.engine = db.make_engine(
            settings.database_url, settings.db_pool_size, settings.db_timeout_s
        )
        sessions = db.sessionmaker(self.engine)
        self.billing_channel = internal_channel(
            settings.billing_addr, settings.internal_token, keepalive=settings.grpc_keepalive
        )
        self.tools_channel = internal_channel(
            settings.tools_addr, settings.internal_token, keepalive=settings.grpc_keepalive
        )
        billing = billing_pb2_grpc.BillingServiceStub(self.billing_channel)
        tools = tools_pb2_grpc.ToolsServiceStub(self.tools_channel)
        self.backend = make_backend(settings, functools.partial(load_archive, sessions))
        self.store = TurnStore(self.engine)
        self.runner = TurnRunner(
            settings, sessions, self.store, self.backend.events, billing, tools
        )
        await self.backend.start(self._on_cancel)
        # leases on connections of their own: handlers holding the pool cannot delay a renewal
        sqlite = self.engine.dialect.name == "sqlite"
        self.lease_engine = (
            None if sqlite else db.make_engine(settings.database_url, 1, settings.db_timeout_s)
        )
        lease_sessions = (
            db.sessionmaker(self.lease_engine) if self.lease_engine is not None else None
        )
        self.supervisor = RunSupervisor(
            settings, sessions, self.runner, self.backend, lease_sessions
        )
        self.servicer = AssistantServicer(settings, sessions, self.runner, billing)
        self.servicer.backend = self.backend
        self.servicer.supervisor = self.supervisor
        self.servicer.secret_resolver = tools_secret_resolver(tools)
        self.servicer.provider_clients = self.provider_clients
        if not self.backend.distributed:
            # the only orchestrator: runs left running are a dead process's, end them now
            await self.supervisor.reap_orphans()
        self.supervisor.start()
        self.runner.redelivery.start()
        self._grpc = await start_grpc_server(
            [
                (
                    assistant_pb2_grpc.add_AssistantServiceServicer_to_server,
                    self.servicer,
                    SERVICE_NAME,
                )
            ],
            settings.host,
            settings.orchestrator_port,
            internal_token=settings.internal_token,
        )
        self.port = self._grpc.port
        dependencies = [database(self.engine, settings.readiness_timeout_s)]
        if settings.redis_url:
            dependencies.append(redis_ping(settings.redis_url, settings.readiness_timeout_s))
        self.readiness = readiness_of(settings, dependencies)
        await self.readiness.start(self._grpc.health, self._grpc.service_names)
        try:
            self._metrics = await MetricsServer.start(
                settings.host,
                settings.orchestrator_metrics_port,
                "LOOPLINE_ORCHESTRATOR_METRICS_PORT",
            )
        except BaseException:
            await self.stop(0)
            raise
        self.metrics_port = self._metrics.port
        return self

    async def _on_cancel(self, run_id: str, reason: str) -> None:
        """A cancel request from any replica: cancel the run if it runs here (else ignore)."""
        if run_id in self.runner.active:
            await self.runner.cancel(run_id, reason)

    async def stop(self, grace: float) -> None:
        """Stop accepting RPCs, cancel active runs (recording their outcome), close everything."""
        if self.readiness is not None:
            await self.readiness.stop()
        # the metrics port closes meanwhile
        metrics = asyncio.ensure_future(self._metrics.stop()) if self._metrics else None
        if self._grpc is not None:
            await self._grpc.health.enter_graceful_shutdown()
        await self.supervisor.stop()
        await self.runner.stop()
        if self._grpc is not None:
            await self._grpc.server.stop(grace)
        await self.provider_clients.aclose()
        await self.backend.close()
        await self.billing_channel.close()
        await self.tools_channel.close()
        self.store.close()
        await self.engine.dispose()
        if self.lease_engine is not None:
            await self.lease_engine.dispose()
        if metrics is not None:
            await metrics
