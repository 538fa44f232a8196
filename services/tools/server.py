"""The tools service's process: `ToolsServer` builds the stores and serves `ToolsServicer`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import db
from services.common.grpc_server import RunningServer, start_grpc_server
from services.common.metrics import MetricsServer
from services.common.readiness import Readiness, database, readiness_of
from services.common.runner import CannotStart
from services.tools import community as community_catalogue
from services.tools.catalogue import Catalogue
from services.tools.config import ToolsSettings
from services.tools.credentials import CredentialStore
from services.tools.crypto import SecretBox
from services.tools.embedder_source import Embedders
from services.tools.knowledge import KnowledgeStore
from services.tools.mcp_client import McpConnector
from services.tools.mcp_servers import StdioRegistry
from services.tools.mcp_stdio import parse_stdio_servers
from services.tools.oauth import OAuth2Flows, integration_of, parse_providers
from services.tools.servicer import ToolsServicer
from services.tools.tools import ToolExecutor

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"].full_name


def _parsed(what: str, parse: Callable[[], T]) -> T:
    """`parse()`, its ValueError (a malformed setting) turned into CannotStart naming `what`:
    the service exits with one line (runner.run), not a traceback."""
    try:
        return parse()
    except ValueError as exc:
        raise CannotStart(f"{what}: {exc}") from None


def _check_names(
    builtins: list[Any], providers: list[Any], catalogue: list[Any], stdio_servers: list[Any]
) -> None:
    """Refuse (ValueError) the operator's integrations whose names are taken: twice in
    LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS or LOOPLINE_TOOLS_MCP_STDIO_SERVERS, an OAuth2 entry named
    like a built-in, a stdio server named like any other integration. (An OAuth2 entry named like
    a catalogue integration configures its app, and one named like a catalogue integration
    without OAuth2 replaces it: docs/integrations.md.)"""
    builtin = {i.name for i in builtins}
    oauth = [p.name for p in providers]
    stdio = [s.name for s in stdio_servers]
    for names, what in (
        (oauth, "LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS"),
        (stdio, "stdio MCP servers"),
    ):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{what} name {', '.join(twice)} more than once")
    taken = sorted(set(oauth) & builtin)
    if taken:
        raise ValueError(f"OAuth2 integration {', '.join(taken)} is the name of a built-in")
    taken = sorted(set(stdio) & {i.name for i in catalogue})
    if taken:
        raise ValueError(f"stdio MCP server {', '.join(taken)} is the name of another integration")


@dataclass(frozen=True)
class _Configured:
    """The integrations the settings configure (`_configured`)."""

    community: community_catalogue.CommunityCatalogue | None
    manifests: dict[str, dict[str, Any]]  # the catalogue's OAuth2 settings, by integration
    providers: list[Any]
    catalogue: Catalogue
    stdio_servers: list[Any]


def _configured(settings: ToolsSettings) -> _Configured:
    """Read the integrations of `settings`: the built-ins, the operator's OAuth2 integrations (an
    entry named like a catalogue integration configures that integration's OAuth2 app), the
    community catalogue and the stdio MCP servers. Raises CannotStart for a malformed setting or
    a taken name."""
    community = _parsed(
        "the community catalogue's settings", lambda: community_catalogue.from_settings(settings)
    )
    manifests = community.oauth_settings() if community is not None else {}
    providers = _parsed(
        "LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS",
        lambda: parse_providers(settings.tools_oauth2_integrations, manifests),
    )
    builtins = Catalogue.builtin().all()
    integrations = builtins + [
        integration_of(p, settings.tools_timeout_s) for p in providers if p.name not in manifests
    ]
    if community is not None:
        integrations += community.integrations(taken={i.name for i in integrations})
    stdio_servers = _parsed(
        "LOOPLINE_TOOLS_MCP_STDIO_SERVERS",
        lambda: parse_stdio_servers(settings.tools_mcp_stdio_servers),
    )
    _parsed(
        "integration names",
        lambda: _check_names(builtins, providers, integrations, stdio_servers),
    )
    return _Configured(community, manifests, providers, Catalogue(integrations), stdio_servers)


class ToolsServer:
    """A running tools service: gRPC server, database engine, stores.

    Use `await ToolsServer.start(settings)`; `.port` is the bound port; `await stop(grace)`.
    `readiness` probes its database (readiness.py).
    """

    readiness: Readiness | None = None
    community: community_catalogue.CommunityCatalogue | None = None

    def __init__(
        self, running: RunningServer, engine: Any, servicer: ToolsServicer, metrics: MetricsServer
    ) -> None:
        self._running = running
        self._engine = engine
        self.servicer = servicer
        self.port = running.port
        self._metrics = metrics
        self.metrics_port = metrics.port
        self._discovery: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, settings: ToolsSettings) -> ToolsServer:
        """Migrate (when `auto_migrate`), build the stores and serve on `settings.tools_port`
        (0 = any free port).

        Raises ValueError for a malformed credential key or manifest, RuntimeError when
        the port cannot be bound.
        """
        url = settings.database_url()
        if settings.auto_migrate:
            await db.migrate_async("tools", url)
        if settings.uses_dev_credential_key():
            log.warning(
                "LOOPLINE_TOOLS_CREDENTIAL_KEY is not set: credentials are encrypted with the "
                "public development key; set a Fernet key in any real deployment"
            )
        box = SecretBox(settings.credential_keys())
        configured = _configured(settings)
        community, providers, catalogue = (
            configured.community,
            configured.providers,
            configured.catalogue,
        )
        connector = McpConnector(
            settings.tools_timeout_s,
            settings.tools_max_output_bytes,
            settings.tools_allow_private_network,
        )
        stdio = StdioRegistry(configured.stdio_servers, connector)
        engine = db.make_engine(url, settings.db_pool_size, settings.db_timeout_s)
        sessions = db.sessionmaker(engine)
        credentials = CredentialStore(
            sessions, box, catalogue, settings.tools_credential_cache_ttl_s
        )
        embedders = Embedders(
            credentials, settings.embedding_openai_base_url, settings.tools_timeout_s
        )
        knowledge = KnowledgeStore(engine, sessions, embedders)
        knowledge.indexer.kick()  # documents left "processing" by the last process
        executor = ToolExecutor(settings, catalogue, credentials, knowledge, connector, stdio)
        oauth = OAuth2Flows(
            providers,
            sessions,
            box,
            credentials,
            settings.tools_timeout_s,
            unconfigured=set(configured.manifests) - {p.name for p in providers},
        )
        credentials.refresher = oauth.refresher  # tool calls renew expiring OAuth2 tokens
        servicer = ToolsServicer(executor, oauth)
        try:
            running = await start_grpc_server(
                [(tools_pb2_grpc.add_ToolsServiceServicer_to_server, servicer, SERVICE_NAME)],
                settings.host,
                settings.tools_port,
                # Document uploads (up to the gateway's 10 MiB limit) arrive in one message.
                options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
                internal_token=settings.internal_token,
            )
        except BaseException:
            await engine.dispose()
            raise
        try:
            metrics = await MetricsServer.start(
                settings.host, settings.tools_metrics_port, "LOOPLINE_TOOLS_METRICS_PORT"
            )
        except BaseException:
            await running.stop(0)
            await engine.dispose()
            raise
        server = cls(running, engine, servicer, metrics)
        server.community = community
        server.readiness = readiness_of(settings, [database(engine, settings.readiness_timeout_s)])
        await server.readiness.start(running.health, running.service_names)
        if stdio.servers:
            # Warm the stdio servers' tool lists; failures are retried on first use.
            server._discovery = asyncio.create_task(stdio.discover_all())
        return server

    async def stop(self, grace: float) -> None:
        """Stop serving (in-flight calls get `grace` seconds, then are cancelled), let MCP sessions
        that are still closing finish (up to 10 s), and close the database; the metrics port
        closes meanwhile."""
        metrics = asyncio.ensure_future(self._metrics.stop())
        if self.readiness is not None:
            await self.readiness.stop()
        if self._discovery is not None:
            self._discovery.cancel()
        await self._running.stop(grace)
        await self.servicer.executor.mcp.aclose()
        await self.servicer.executor.knowledge.close()
        if self.community is not None:
            await self.community.pool.close()
        await self._engine.dispose()
        await metrics
