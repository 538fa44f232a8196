"""The gateway process: uvicorn serving the FastAPI app, plus a gRPC health service."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import uvicorn
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from services.common import db
from services.common.grpc_server import (
    PortUnavailable,
    RunningServer,
    start_grpc_server,
)
from services.common.internal_auth import internal_channel
from services.common.readiness import REDIS, Dependency, Readiness, database, readiness_of
from services.gateway.application import create_app
from services.gateway.config import GatewaySettings
from services.gateway.default_models import DefaultModels
from services.gateway.http_limits import HttpLimits, protocol_class, tune_listener
from services.gateway.http_tracing import traced
from services.gateway.idempotency import IdempotencyStore
from services.gateway.identity import Authenticator

log = logging.getLogger(__name__)


class GatewayServer:
    """A running gateway. `port` is the HTTP port; `grpc_port` the health service's."""

    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    channel: grpc.aio.Channel
    tools_channel: grpc.aio.Channel
    billing_channel: grpc.aio.Channel
    idempotency: IdempotencyStore
    default_models: DefaultModels
    app: FastAPI
    http: uvicorn.Server
    _http_task: asyncio.Task[None]
    _grpc: RunningServer
    readiness: Readiness

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.port = 0
        self.grpc_port = 0

    @classmethod
    async def start(cls, settings: GatewaySettings) -> GatewayServer:
        """Migrate (when enabled), connect to the orchestrator, tools and billing, bind HTTP and
        start serving."""
        self = cls(settings)
        if settings.auto_migrate:
            await db.migrate_async("gateway", settings.database_url)
        self.engine = db.make_engine(
            settings.database_url, settings.db_pool_size, settings.db_timeout_s
        )
        self.sessions = db.sessionmaker(self.engine)
        self.channel = internal_channel(
            settings.orchestrator_addr,
            settings.internal_token,
            options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
            keepalive=settings.grpc_keepalive,
        )
        self.idempotency = IdempotencyStore(self.sessions, settings.idempotency_ttl_s)
        self.tools_channel = internal_channel(
            settings.tools_addr,
            settings.internal_token,
            options=[("grpc.max_send_message_length", 16 * 1024 * 1024)],
            keepalive=settings.grpc_keepalive,
        )
        # billing answers the usage overview (routes/dashboard.py); turns reach it via the
        # orchestrator only
        self.billing_channel = internal_channel(
            settings.billing_addr, settings.internal_token, keepalive=settings.grpc_keepalive
        )
        self.default_models = DefaultModels(self.sessions, settings.auth_cache_ttl_s)
        self.app = create_app(
            settings,
            Authenticator(self.sessions, settings.auth_cache_ttl_s),
            self.channel,
            self.idempotency,
            self.default_models,
            self.tools_channel,
            self.billing_channel,
        )
        sock = http_listener(settings)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            traced(self.app),  # HTTP server spans when tracing is on (http_tracing.py)
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(settings.shutdown_grace_s) or 1,
            backlog=2048,
            http=protocol_class(
                HttpLimits.of(settings)
            ),  # head, body and write bounds (http_limits.py)
        )
        self.http = uvicorn.Server(config)
        self._http_task = asyncio.create_task(self.http.serve(sockets=[sock]))
        while not self.http.started:
            if self._http_task.done():
                await self._http_task
                raise RuntimeError("HTTP server failed to start")
            await asyncio.sleep(0.01)
        self._grpc = await start_grpc_server([], settings.host, settings.gateway_grpc_port)
        self.grpc_port = self._grpc.port
        dependencies = [database(self.engine, settings.readiness_timeout_s)]
        storage = self.app.state.request_limits.storage  # limits' Redis storage, if any
        if storage is not None:
            dependencies.append(Dependency(REDIS, storage.check))
        self.readiness = self.app.state.readiness = readiness_of(settings, dependencies)
        await self.readiness.start(self._grpc.health)  # /readyz and the gRPC health of ""
        return self

    async def stop(self, grace: float) -> None:
        """Stop taking requests, let open ones finish for up to `grace` seconds, close all."""
        await self.readiness.stop()
        await self._grpc.health.enter_graceful_shutdown()
        self.http.should_exit = True
        await self.app.state.fanout.close()  # open streams end now with their reconnect frame
        try:
            await asyncio.wait_for(self._http_task, grace + 1)
        except TimeoutError:
            self.http.force_exit = True
        await self.app.state.request_limits.close()  # the rate counters' Redis connections, if any
        await self._grpc.server.stop(grace)
        await self.channel.close()
        await self.tools_channel.close()
        await self.billing_channel.close()
        await self.engine.dispose()


def http_listener(settings: GatewaySettings) -> socket.socket:
    """The HTTP listening socket, bound to LOOPLINE_HTTP_HOST:PORT and listening, non-blocking;
    PortUnavailable (one line, exit 2) when the port cannot be bound."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it every keep-alive response waits ~40 ms for the client's delayed ACK
    # (Nagle; docs/performance.md). The listener's option is inherited by accepted sockets.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # TCP keepalive and TCP_USER_TIMEOUT, inherited too (docs/security.md)
    tune_listener(sock, settings)
    try:
        sock.bind((settings.http_host, settings.http_port))
    except OSError as error:  # one line and exit 2 (runner.run), like the gRPC port's
        sock.close()
        raise PortUnavailable(
            f"cannot bind the HTTP port {settings.http_host}:{settings.http_port}: {error.strerror}"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
