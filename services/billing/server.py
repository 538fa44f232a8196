"""The billing process: `BillingServer.start(settings)` / `.port` / `.stop(grace)`.

`start` migrates (when `auto_migrate`), syncs the plan catalogue, opens the store, binds
`settings.billing_port` (0 = any free port) with health and reflection, and runs the
expired-hold sweeper every `billing_sweep_interval_s` seconds until `stop(grace)`.
"""

from __future__ import annotations

import asyncio
import logging

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from services.billing.admin import Admin
from services.billing.admission import Admission
from services.billing.config import BillingSettings
from services.billing.ledger import Ledger
from services.billing.plans import load_plans, sync_plans
from services.billing.pricing import PriceTable
from services.billing.rates import RateLimiter
from services.billing.servicer import BillingServicer
from services.billing.store import BillingStore, open_store
from services.common import db
from services.common.errors import PassLog
from services.common.grpc_server import RunningServer, start_grpc_server
from services.common.metrics import MetricsServer
from services.common.readiness import REDIS, Dependency, Readiness, database, readiness_of
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


async def open_billing_store(settings: BillingSettings) -> tuple[BillingStore, PriceTable]:
    """Migrate (if `auto_migrate`), sync the plan file into the database and open the store.

    Returns (store, price table); the caller closes the store. Raises ValueError on a
    malformed plan or price file, or a default plan the plan file lacks.
    """
    url = settings.billing_database_url
    if settings.auto_migrate:
        await db.migrate_async("billing", url)
    plans = load_plans(settings.billing_plans_path)
    if settings.billing_default_plan not in plans:
        default, path = settings.billing_default_plan, settings.billing_plans_path
        raise ValueError(f"default plan {default!r} is not in {path}")
    prices = PriceTable.load(settings.billing_prices_path)
    engine = db.make_engine(url, settings.db_pool_size, settings.db_timeout_s)
    sessions = db.sessionmaker(engine)
    await sync_plans(sessions, plans)
    store = open_store(sessions, default_plan=settings.billing_default_plan)
    await store.load_plans()  # the in-memory plan catalogue, refreshed after every sync
    return store, prices


class BillingServer:
    """A running billing service: gRPC server, store, rate storage, sweeper task.

    Attributes:
        port: the bound gRPC port.
        store: the billing store (tests read its `sessions` and set its `clock`).
        admission, ledger, admin: the rules (tests call them directly).
        readiness: the probes of the database and the rate-limit Redis (readiness.py).
    """

    readiness: Readiness | None = None

    def __init__(
        self,
        running: RunningServer,
        store: BillingStore,
        admission: Admission,
        ledger: Ledger,
        sweeper: asyncio.Task | None,
        metrics: MetricsServer,
    ) -> None:
        self._running = running
        self.port = running.port
        self._metrics = metrics
        self.metrics_port = metrics.port
        self.store = store
        self.admission = admission
        self.ledger = ledger
        self.admin = Admin(store)
        self._sweeper = sweeper

    @classmethod
    async def start(cls, settings: BillingSettings) -> BillingServer:
        """Start serving on `settings.host:settings.billing_port` (0 = any free port)."""
        store, prices = await open_billing_store(settings)
        rates = RateLimiter(
            settings.billing_rate_limit_storage_url,
            key_prefix=f"{settings.redis_key_prefix}billing",
        )
        admission = Admission(store, rates, hold_seconds=settings.billing_hold_seconds)
        ledger = Ledger(store, prices)
        try:
            running = await start_grpc_server(
                [
                    (
                        billing_pb2_grpc.add_BillingServiceServicer_to_server,
                        BillingServicer(admission, ledger),
                        billing_pb2.DESCRIPTOR.services_by_name["BillingService"].full_name,
                    )
                ],
                settings.host,
                settings.billing_port,
                internal_token=settings.internal_token,
            )
        except BaseException:
            await rates.close()
            await store.close()
            raise
        try:
            metrics = await MetricsServer.start(
                settings.host, settings.billing_metrics_port, "LOOPLINE_BILLING_METRICS_PORT"
            )
        except BaseException:
            await running.stop(0)
            await rates.close()
            await store.close()
            raise
        sweeper = None
        if settings.billing_sweep_interval_s > 0:
            sweeper = asyncio.create_task(
                _sweep_forever(
                    ledger, settings.billing_sweep_interval_s, settings.billing_expiry_grace_s
                ),
                name="billing-sweeper",
            )
        log.info("billing started", extra={"fields": {"port": running.port}})
        server = cls(running, store, admission, ledger, sweeper, metrics)
        dependencies = [database(store.sessions.kw["bind"], settings.readiness_timeout_s)]
        if rates.storage is not None:  # limits' storage: PING through its own client
            dependencies.append(Dependency(REDIS, rates.storage.check))
        server.readiness = readiness_of(settings, dependencies)
        await server.readiness.start(running.health, running.service_names)
        return server

    async def stop(self, grace: float) -> None:
        """Stop the sweeper, then the server (in-flight RPCs get `grace` s), then the store; the
        metrics port closes meanwhile."""
        metrics = asyncio.ensure_future(self._metrics.stop())
        if self.readiness is not None:
            await self.readiness.stop()
        if self._sweeper is not None:
            await stop_task(self._sweeper)
        await self._running.stop(grace)
        await self.admission.rates.close()
        await self.store.close()
        await metrics


STALL_TICK_S = 1.0  # how often the sweeper looks at the clock to notice a stall of the process


async def _sweep_forever(
    ledger: Ledger, interval_s: float, grace_s: float = 0.0, stall_s: float = 1.0
) -> None:
    """Expire overdue holds every `interval_s` seconds; a failed pass is logged (`PassLog`: a
    storage outage once) and retried.

    Nothing is expired within `grace_s` seconds of the start, nor of a stall of the process
    (the clock, looked at every STALL_TICK_S seconds, came `stall_s` seconds or more late:
    the process was stopped or starved), whatever the interval: what billing could not hear
    meanwhile — the run charges the orchestrators stored, resent at most 60 s apart — comes
    first (`billing_expiry_grace_s`)."""
    loop = asyncio.get_running_loop()
    awake_since = tick = loop.time()
    next_pass = tick + interval_s
    passes = PassLog(log, "sweeper", "holds expire once it answers")
    while True:
        planned = max(0.0, min(STALL_TICK_S, next_pass - tick))
        await asyncio.sleep(planned)
        now = loop.time()
        if now - tick - planned >= stall_s:
            awake_since = now
        tick = now
        if now < next_pass:
            continue
        next_pass = now + interval_s
        if now - awake_since < grace_s:
            continue
        try:
            await ledger.expire_holds()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            passes.failed(error)
        else:
            passes.passed()
