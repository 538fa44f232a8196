"""The fault suite's cluster: every service as a process, on a Redis server of the test's own.

`FaultCluster` is tests/scale's `Cluster` (same spawning, same environment) with the Redis
URL of the test's own `RedisServer` instead of the shared test Redis, and with billing and
tools started as processes too (`spawn_billing`, `spawn_tools`), so that a fault never stalls
the test process itself. `FaultCluster.start_default` starts the shape every scenario uses:
orchestrators o1 and o2, gateway g1 -> o1 and gateway g2 -> o2 (and, for listeners that join
late, g3 -> o2). Settings: LOOPLINE_RUN_LEASE_S and LOOPLINE_REDIS_RETRY_S on the
orchestrators (`start_default`), LOOPLINE_HEARTBEAT_INTERVAL_S=1 on the gateways (tests/scale's
`spawn_gateway`), LOOPLINE_BILLING_DEFAULT_PLAN=team on billing (3,000 turns a minute: the load
scenario starts 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.common import db
from services.gateway import identity
from tests.conftest import SERVICES, postgres_databases, release_databases
from tests.faults.redis_server import RedisServer
from tests.scale.conftest import Cluster, Replica, free_port, wait_port

HEARTBEAT_S = (
    1.0  # LOOPLINE_HEARTBEAT_INTERVAL_S of every gateway (tests/scale's spawn_gateway sets it)
)


@dataclass
class _Pending:
    """A port chosen for a service started later (Cluster.env needs billing's and tools' ports)."""

    port: int


@dataclass
class FaultCluster(Cluster):
    """tests/scale's Cluster on the test's own Redis, with billing and tools as processes too."""

    redis: RedisServer | None = None
    gateways: list[Replica] = field(default_factory=list)
    orchestrators: list[Replica] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    upstream: dict[str, Replica] = field(default_factory=dict)  # gateway name -> its orchestrator

    def live_gateways(self) -> list[Replica]:
        """The gateways that run and whose orchestrator runs."""
        return [
            g
            for g in self.gateways
            if g.process.poll() is None
            and (g.name not in self.upstream or self.upstream[g.name].process.poll() is None)
        ]

    def env(self, **extra: str) -> dict[str, str]:
        """Cluster.env, with the test's own Redis (an `extra` LOOPLINE_REDIS_URL, e.g. a proxy,
        wins)."""
        assert self.redis is not None
        extra.setdefault("LOOPLINE_REDIS_URL", self.redis.url)
        extra.setdefault(
            "LOOPLINE_KEY_REQUESTS_PER_MINUTE", "0"
        )  # the load scenario is one key's thousands of requests
        return super().env(**extra)

    async def spawn_billing(self, **settings: str) -> Replica:
        """Billing as a process, on the port chosen when the cluster was made."""
        port = self.billing.port
        env = self.env(
            LOOPLINE_BILLING_PORT=str(port),
            LOOPLINE_BILLING_DATABASE_URL=self.urls["billing"],
            LOOPLINE_BILLING_DEFAULT_PLAN="team",
            **settings,
        )
        process, log = self._spawn("billing", "billing", env)
        replica = Replica("billing", port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        self.billing = replica  # type: ignore[assignment]
        return replica

    async def spawn_tools(self, **settings: str) -> Replica:
        """Tools as a process, on the port chosen when the cluster was made."""
        port = self.tools.port
        env = self.env(
            LOOPLINE_TOOLS_PORT=str(port),
            LOOPLINE_TOOLS_DATABASE_URL=self.urls["tools"],
            **settings,
        )
        process, log = self._spawn("tools", "tools", env)
        replica = Replica("tools", port, process, log)
        self.replicas.append(replica)
        await wait_port(port, process, log)
        self.tools = replica  # type: ignore[assignment]
        return replica

    async def start_default(
        self,
        *,
        lease_s: float = 6.0,
        redis_retry_s: float = 5.0,
        late_gateway: bool = False,
        orchestrator_redis_url: str | None = None,
        o1_settings: dict[str, str] | None = None,
        **orchestrator_settings: str,
    ) -> None:
        """billing + tools, orchestrators o1 and o2, gateways g1 -> o1 and g2 -> o2; with
        `late_gateway`, also g3 -> o2 for listeners that join late: a gateway serves every
        listener of a run from one shared upstream stream, so a late listener on g1 or g2 joins
        that copy, while one on g3 makes o2 read the run from Redis (or its archive).
        `o1_settings`: more LOOPLINE_* variables for o1 only (e.g. its database through a proxy)."""
        await asyncio.gather(self.spawn_billing(), self.spawn_tools())
        settings = {
            "LOOPLINE_RUN_LEASE_S": str(lease_s),
            "LOOPLINE_REDIS_RETRY_S": str(redis_retry_s),
            **orchestrator_settings,
        }
        if orchestrator_redis_url:
            settings["LOOPLINE_REDIS_URL"] = orchestrator_redis_url
        self.orchestrators = list(
            await asyncio.gather(
                self.spawn_orchestrator("o1", **{**settings, **(o1_settings or {})}),
                self.spawn_orchestrator("o2", **settings),
            )
        )
        plan = [("g1", self.orchestrators[0]), ("g2", self.orchestrators[1])]
        if late_gateway:
            plan.append(("g3", self.orchestrators[1]))
        self.gateways = list(
            await asyncio.gather(*(self.spawn_gateway(name, upstream) for name, upstream in plan))
        )
        self.upstream = {name: upstream for name, upstream in plan}
        self.started = time.monotonic()

    def client(self, gateway: Replica, **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client of `gateway` with the owner's credentials (`kwargs`: httpx options)."""
        options: dict[str, Any] = {"timeout": 30}
        options.update(kwargs)
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gateway.port}",
            headers={"Authorization": f"Bearer {self.api_key}", "X-Organization-ID": self.org_id},
            **options,
        )

    def logs(self, lines: int = 6, width: int = 400) -> str:
        """The last `lines` warnings and errors of each process's log (each cut to `width`
        characters), and where the whole logs are."""
        parts = [f"(whole logs in {self.tmp})"]
        for replica in self.replicas:
            if not replica.log.exists():
                continue
            notable = [
                line
                for line in replica.log.read_text(errors="replace").splitlines()
                if '"level":"warning"' in line or '"level":"error"' in line or "Traceback" in line
            ]
            if notable:
                parts.append(
                    f"--- {replica.name}: {len(notable)} warning/error lines, the last ones:"
                )
                parts += [f"    {line[:width]}" for line in notable[-lines:]]
        return "\n".join(parts)

    def grep_logs(self, needle: str) -> dict[str, int]:
        """{replica: how many log lines contain `needle`}."""
        found = {}
        for replica in self.replicas:
            if replica.log.exists():
                count = sum(
                    1
                    for line in replica.log.read_text(errors="replace").splitlines()
                    if needle in line
                )
                if count:
                    found[replica.name] = count
        return found


async def make_cluster(tmp_path: pathlib.Path) -> FaultCluster:
    """Fresh PostgreSQL databases (tests/conftest.py's pool), a Redis server of the test's own
    and an owner's API key; nothing of the services is started yet (`start_default`)."""
    redis = RedisServer(tmp_path / "redis")
    await redis.start()
    urls = await postgres_databases()
    engine = db.make_engine(urls["gateway"])
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    try:
        owner = await identity.create_member(db.sessionmaker(engine), org_id, "owner")
    finally:
        await engine.dispose()
    prefix = f"llfault:{uuid.uuid4().hex[:8]}:"
    return FaultCluster(
        tmp_path,
        urls,
        prefix,
        _Pending(free_port()),  # type: ignore[arg-type]  # billing's port until spawn_billing
        _Pending(free_port()),  # type: ignore[arg-type]  # tools' port until spawn_tools
        org_id,
        owner["api_key"],
        owner["user_id"],
        redis=redis,
    )


async def stop_cluster(cluster: FaultCluster) -> None:
    """Kill every process (the services, then Redis) and hand the databases back to the pool."""
    for replica in cluster.replicas:
        with contextlib.suppress(Exception):
            replica.kill()
    if cluster.redis is not None:
        cluster.redis.kill()
    release_databases([cluster.urls[s] for s in SERVICES])
