"""The billing gRPC server: `BillingService` (Admit, Charge, Release, RecordUsage).

`BillingServer.start(settings)` migrates (when `auto_migrate`), syncs the plan catalogue,
binds `settings.billing_port` (0 = any free port) with health and reflection, and runs
the expired-hold sweeper every `billing_sweep_interval_s` seconds until `stop(grace)`.
The rules themselves live in `services.billing.core`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from services.billing.config import BillingSettings
from services.billing.core import STATE_TO_PB, BillingCore
from services.billing.plans import load_plans, sync_plans
from services.billing.pricing import PriceTable
from services.billing.rates import RateDecision, RateLimiter
from services.common import db, ids
from services.common.errors import BILLING_DOMAIN, PassLog, rpc_handler
from services.common.grpc_server import RunningServer, start_grpc_server
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


# The one wrapper every handler goes through: RpcError -> rich status; other exceptions
# reach grpc as UNKNOWN and are logged with their traceback.
rpc = rpc_handler(
    domain=BILLING_DOMAIN,
    check=ids.request_organization_check(BILLING_DOMAIN, "ORGANIZATION_ID_REQUIRED"),
)


def _rate_pb(rate: RateDecision) -> billing_pb2.RateLimitState:
    return billing_pb2.RateLimitState(
        limit=rate.limit, remaining=rate.remaining, reset_seconds=rate.reset_seconds
    )


class BillingServicer(billing_pb2_grpc.BillingServiceServicer):
    """`loopline.billing.v1.BillingService` over a `BillingCore`; see core.py for the rules."""

    def __init__(self, core: BillingCore) -> None:
        self.core = core

    @rpc
    async def Admit(  # noqa: N802
        self, request: billing_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.AdmitResponse:
        """Admit (or replay) a turn; denials are rich errors carrying a Denial detail."""
        admission = await self.core.admit(
            request.organization_id,
            request.turn_key,
            request.usage_type,
            request.rate_class,
            request.credits,
        )
        r = admission.reservation
        return billing_pb2.AdmitResponse(
            reservation_id=r.id,
            state=STATE_TO_PB[r.state],
            credits=r.credits,
            rate_limit=_rate_pb(admission.rate),
            replayed=admission.replayed,
        )

    @rpc
    async def Charge(  # noqa: N802
        self, request: billing_pb2.ChargeRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ChargeResponse:
        """Charge a held reservation exactly once (a replay returns the same ledger entry)."""
        result = await self.core.charge(request.reservation_id)
        return billing_pb2.ChargeResponse(
            state=STATE_TO_PB[result.state], ledger_entry_id=result.ledger_entry_id
        )

    @rpc
    async def ChargeBatch(  # noqa: N802
        self, request: billing_pb2.ChargeBatchRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ChargeBatchResponse:
        """Charge several reservations, each as Charge, an expired hold charged late and a charge
        that cannot be posted answered in its result (`BillingCore.charge_batch`); results in order."""
        results = await self.core.charge_batch(
            [charge.reservation_id for charge in request.charges]
        )
        return billing_pb2.ChargeBatchResponse(
            results=[
                billing_pb2.ChargeResponse()
                if r is None
                else billing_pb2.ChargeResponse(
                    state=STATE_TO_PB[r.state], ledger_entry_id=r.ledger_entry_id
                )
                for r in results
            ]
        )

    @rpc
    async def Release(  # noqa: N802
        self, request: billing_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ReleaseResponse:
        """Release a held reservation at most once; a charged one is left charged."""
        state = await self.core.release(request.reservation_id, request.reason)
        return billing_pb2.ReleaseResponse(state=STATE_TO_PB[state])

    @rpc
    async def RecordUsage(  # noqa: N802
        self, request: billing_pb2.RecordUsageRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordUsageResponse:
        """Record one model call's token usage, idempotent by (run_id, call_index)."""
        result = await self.core.record_usage(request)
        return billing_pb2.RecordUsageResponse(
            usage_id=result.usage_id, millicredits=result.millicredits, replayed=result.replayed
        )

    @rpc
    async def RecordUsageBatch(  # noqa: N802
        self, request: billing_pb2.RecordUsageBatchRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordUsageBatchResponse:
        """Record several model calls' usage, each as RecordUsage (idempotent by (run_id, call_index));
        results in the order of the calls (`BillingCore.record_usage_batch`: on PostgreSQL one statement
        per organization, on SQLite one group commit); an error fails the call, and a retry replays
        what was recorded."""
        results = await self.core.record_usage_batch(list(request.calls))
        return billing_pb2.RecordUsageBatchResponse(
            results=[
                billing_pb2.RecordUsageResponse(
                    usage_id=r.usage_id, millicredits=r.millicredits, replayed=r.replayed
                )
                for r in results
            ]
        )

    @rpc
    async def RecordToolUsage(  # noqa: N802
        self, request: billing_pb2.RecordToolUsageRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordToolUsageResponse:
        """Charge one tool call's catalogue cost, idempotent by (run_id, tool_call_id)."""
        entry_id, replayed = await self.core.record_tool_usage(request)
        return billing_pb2.RecordToolUsageResponse(ledger_entry_id=entry_id, replayed=replayed)


async def build_core(settings: BillingSettings) -> tuple[BillingCore, Any]:
    """Migrate (if `auto_migrate`), sync plans and build a BillingCore.

    Returns (core, engine); the caller disposes the engine and closes `core.rates` and `core`.
    Raises ValueError on a malformed plan or price file.
    """
    url = settings.billing_database_url
    if settings.auto_migrate:
        await db.migrate_async("billing", url)
    plans = load_plans(settings.billing_plans_path)
    if settings.billing_default_plan not in plans:
        raise ValueError(
            f"default plan {settings.billing_default_plan!r} is not in {settings.billing_plans_path}"
        )
    prices = PriceTable.load(settings.billing_prices_path)
    engine = db.make_engine(url, settings.db_pool_size, settings.db_timeout_s)
    sessions = db.sessionmaker(engine)
    await sync_plans(sessions, plans)
    core = BillingCore(
        sessions,
        RateLimiter(
            settings.billing_rate_limit_storage_url,
            key_prefix=f"{settings.redis_key_prefix}billing",
        ),
        prices,
        default_plan=settings.billing_default_plan,
        hold_seconds=settings.billing_hold_seconds,
    )
    await core.load_plans()  # the in-memory plan catalogue, refreshed after every sync
    return core, engine


class BillingServer:
    """A running billing service: gRPC server, database engine, rate storage, sweeper task.

    Attributes:
        port: the bound gRPC port.
        core: the BillingCore (tests call `core.expire_holds()` directly).
    """

    def __init__(
        self, running: RunningServer, core: BillingCore, engine: Any, sweeper: asyncio.Task | None
    ) -> None:
        self._running = running
        self.port = running.port
        self.core = core
        self._engine = engine
        self._sweeper = sweeper

    @classmethod
    async def start(cls, settings: BillingSettings) -> BillingServer:
        """Start serving on `settings.host:settings.billing_port` (0 = any free port)."""
        core, engine = await build_core(settings)
        try:
            servicer = BillingServicer(core)
            running = await start_grpc_server(
                [
                    (
                        billing_pb2_grpc.add_BillingServiceServicer_to_server,
                        servicer,
                        billing_pb2.DESCRIPTOR.services_by_name["BillingService"].full_name,
                    )
                ],
                settings.host,
                settings.billing_port,
                internal_token=settings.internal_token,
            )
        except BaseException:
            await core.rates.close()
            core.close()
            await engine.dispose()
            raise
        sweeper = None
        if settings.billing_sweep_interval_s > 0:
            sweeper = asyncio.create_task(
                _sweep_forever(
                    core, settings.billing_sweep_interval_s, settings.billing_expiry_grace_s
                ),
                name="billing-sweeper",
            )
        log.info("billing started", extra={"fields": {"port": running.port}})
        return cls(running, core, engine, sweeper)

    async def stop(self, grace: float) -> None:
        """Stop the sweeper, then the server (in-flight RPCs get `grace` s), then the engine."""
        if self._sweeper is not None:
            await stop_task(self._sweeper)
        await self._running.stop(grace)
        await self.core.rates.close()
        self.core.close()
        await self._engine.dispose()


STALL_TICK_S = 1.0  # how often the sweeper looks at the clock to notice a stall of the process


async def _sweep_forever(
    core: BillingCore, interval_s: float, grace_s: float = 0.0, stall_s: float = 1.0
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
            await core.expire_holds()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            passes.failed(error)
        else:
            passes.passed()
