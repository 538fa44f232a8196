"""Readiness: whether a service can serve, from probes of what it depends on.

Liveness and readiness are apart (docs/operations.md, "Health and readiness"). A process that
runs is live: the gRPC health service name "liveness" and the gateway's `/healthz` say so. It
is ready while every dependency it serves from answers: its database and, when configured,
Redis. `Readiness` probes them every LOOPLINE_READINESS_INTERVAL_S seconds in a task of its
own, each probe bounded by LOOPLINE_READINESS_TIMEOUT_S, keeps the names of those that failed
(`failing`, what the gateway's `/readyz` answers), sets the gRPC health status of "" and of each
of the service's names to SERVING or NOT_SERVING, and logs one line when that changes.

The probes ask what a request asks, through the service's own clients: the database through its
engine (its Alembic revision, so a database whose migrations have not run, or a pool that cannot
get a connection in time, is not ready), Redis with PING. A SQLite file is opened anew at each
probe: a pooled connection keeps a file that can no longer be opened (deleted, moved, its disk
gone) usable to itself alone.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpc_health.v1 import health_pb2
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.common.sqlite_driver import connect
from services.common.tasks import stop_task

log = logging.getLogger(__name__)

#: The names a failing dependency goes by (in `/readyz` and the log; never an error's text).
DATABASE = "database"
REDIS = "redis"

#: What a migrated database answers: Alembic's revision row. A database that answers but has no
#: tables yet (before its migrations ran) is not ready: every request would fail on it.
_MIGRATED = "SELECT version_num FROM alembic_version"
_SELECT_MIGRATED = text(_MIGRATED)

#: A probe: raises, or returns False, when the dependency cannot serve.
Probe = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class Dependency:
    """Something a service serves from: its `name` and the `probe` that asks it.

    `close`, when given, releases what the probe holds (a client of its own) at stop."""

    name: str
    probe: Probe
    close: Callable[[], Awaitable[object]] | None = None


def database(engine: AsyncEngine, timeout_s: float) -> Dependency:
    """The service's database: its migration revision read through `engine` (a database whose
    migrations have not run is not ready); a SQLite file is opened anew, read-write (waiting at
    most `timeout_s` for a lock)."""
    url = engine.url
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        path = pathlib.Path(url.database)
        return Dependency(DATABASE, lambda: asyncio.to_thread(_open_sqlite, path, timeout_s))

    async def migrated() -> None:
        async with engine.connect() as connection:
            if (await connection.execute(_SELECT_MIGRATED)).first() is None:
                raise LookupError("no migration revision")

    return Dependency(DATABASE, migrated)


def _open_sqlite(path: pathlib.Path, timeout_s: float) -> None:
    """Open the SQLite file at `path` read-write (never creating it) and read its migration
    revision; raises sqlite3.Error (or LookupError) when it cannot."""
    uri = f"{path.absolute().as_uri()}?mode=rw"
    connection = connect(uri, uri=True, timeout=timeout_s)
    try:
        if connection.execute(_MIGRATED).fetchone() is None:
            raise LookupError("no migration revision")
    finally:
        connection.close()


def redis_ping(url: str, timeout_s: float) -> Dependency:
    """Redis at `url`, asked PING on a connection of the probe's own (the service's pools may all
    be busy with blocking reads under load, which is not an outage)."""
    import redis.asyncio as aioredis  # noqa: PLC0415 - only a service configured with Redis

    from services.common.db import redis_client_options  # noqa: PLC0415

    client = aioredis.Redis.from_url(url, **redis_client_options(timeout_s))
    return Dependency(REDIS, client.ping, client.aclose)


class Readiness:
    """The readiness of one service: probes `dependencies` every `interval_s` seconds (each
    bounded by `timeout_s`) once `start`ed; `failing` names those that did not answer."""

    def __init__(
        self, dependencies: Sequence[Dependency], interval_s: float, timeout_s: float
    ) -> None:
        self.dependencies = tuple(dependencies)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failing: tuple[str, ...] = ()
        self._health: Any = None  # a grpc_health HealthServicer (aio), once started
        self._names: tuple[str, ...] = ()
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """Whether every dependency answered at the last check."""
        return not self.failing

    async def start(self, health: Any = None, names: Sequence[str] = ()) -> None:
        """Check now, set the statuses of "" and `names` on `health` (a grpc.aio health
        servicer, if any), then check every `interval_s` seconds until `stop`."""
        self._health, self._names = health, tuple(names)
        await self.check()
        await self._publish()
        self._task = asyncio.create_task(self._run(), name="readiness")

    async def stop(self) -> None:
        """Stop checking and close the probes' own clients."""
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        for dependency in self.dependencies:
            if dependency.close is not None:
                await dependency.close()

    async def check(self) -> tuple[str, ...]:
        """Probe every dependency once (concurrently); returns and keeps the names of those
        that failed, and on a change sets the health statuses and logs one line."""
        results = await asyncio.gather(*(self._probe(d) for d in self.dependencies))
        problems = {
            d.name: problem
            for d, problem in zip(self.dependencies, results, strict=True)
            if problem is not None
        }
        failing = tuple(problems)
        if failing != self.failing:
            self.failing = failing
            self._log_change(problems)
            await self._publish()
        return failing

    async def _probe(self, dependency: Dependency) -> str | None:
        """None when `dependency` answered in time, else what went wrong: the error's type name
        (never its text, which may quote a URL or a server's words)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await dependency.probe()
        except Exception as error:  # noqa: BLE001 - any failure of a probe means "not ready"
            return type(error).__name__
        return "no answer" if answer is False else None

    def _log_change(self, problems: dict[str, str]) -> None:
        if problems:
            log.warning(
                "not ready: %s cannot serve",
                " and ".join(problems),
                extra={"fields": {"failing": list(problems), "errors": problems}},
            )
        else:
            log.info("ready: every dependency answers")

    async def _publish(self) -> None:
        """Set the health status of "" and of the service's names from `failing`."""
        if self._health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self.failing
            else health_pb2.HealthCheckResponse.SERVING
        )
        for name in ("", *self._names):
            await self._health.set(name, status)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # a bug here must not end the checks (the status would freeze)
                log.exception("readiness check failed")


def readiness_of(settings: Any, dependencies: Sequence[Dependency]) -> Readiness:
    """A `Readiness` of `dependencies` with the intervals of `settings` (CommonSettings)."""
    return Readiness(dependencies, settings.readiness_interval_s, settings.readiness_timeout_s)
