"""Holds never charged nor released expire and are voided by the sweeper."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import cast

import grpc
import pytest

from loopline.billing.v1 import billing_pb2 as pb
from loopline.billing.v1 import billing_pb2_grpc
from services.billing.ledger import Ledger
from services.billing.models import Account
from services.billing.server import BillingServer, _sweep_forever
from services.common.errors import status_details
from tests.billing.helpers import admit_request, make_settings


async def test_sweeper_expires_overdue_holds_and_returns_their_credits(server, stub, org):
    held = await stub.Admit(admit_request(org, "c:old"))
    kept = await stub.Admit(admit_request(org, "c:charged"))
    await stub.Charge(pb.ChargeRequest(reservation_id=kept.reservation_id))

    assert await server.ledger.expire_holds() == 0  # nothing is overdue yet
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=901)
    assert await server.ledger.expire_holds(now=later) == 1
    assert await server.ledger.expire_holds(now=later) == 0  # voided at most once

    async with server.store.sessions() as session:
        account = await session.get(Account, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 1)
    released = await stub.Release(pb.ReleaseRequest(reservation_id=held.reservation_id))
    assert released.state == pb.RESERVATION_STATE_EXPIRED
    replay = await stub.Admit(admit_request(org, "c:old"))
    assert replay.replayed and replay.state == pb.RESERVATION_STATE_EXPIRED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Charge(pb.ChargeRequest(reservation_id=held.reservation_id))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert status_details(caught.value).reason == "RESERVATION_EXPIRED"


async def test_background_sweeper_runs_while_the_server_runs(tmp_path, org):
    # the shortest hold billing takes is 1 s (LOOPLINE_BILLING_HOLD_SECONDS=0 is refused at start)
    server = await BillingServer.start(
        make_settings(
            tmp_path,
            billing_hold_seconds=1,
            billing_sweep_interval_s=0.05,
            billing_expiry_grace_s=0,
        )
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = billing_pb2_grpc.BillingServiceStub(channel)
            held = await stub.Admit(admit_request(org, "c:r"))
            for _ in range(250):
                replay = await stub.Admit(admit_request(org, "c:r"))
                if replay.state == pb.RESERVATION_STATE_EXPIRED:
                    break
                await asyncio.sleep(0.02)
            assert replay.state == pb.RESERVATION_STATE_EXPIRED
            assert replay.reservation_id == held.reservation_id
    finally:
        await server.stop(0)


def test_the_default_hold_outlives_the_slowest_turn_start_and_little_more():
    """A hold left by an orchestrator killed between Admit and Charge blocks a credit and a quota
    slot until it expires. A turn start charges within the Admit and Charge deadlines (10 s each)
    plus SQLite's busy timeout (30 s) for its rows; the hold is 120 s."""
    from services.billing.config import BillingSettings
    from services.common.db import SQLITE_BUSY_TIMEOUT_S as busy_s

    hold = BillingSettings().billing_hold_seconds
    assert 10 + busy_s + 10 < hold <= 120


class _PassCounter:
    """A ledger for the sweeper loop alone (it calls only `expire_holds`, so it stands in for a
    `Ledger`): `passes` gets the time of each expiry pass."""

    def __init__(self) -> None:
        self.passes: list[float] = []
        self.passed = asyncio.Event()

    async def expire_holds(self) -> int:
        self.passes.append(time.monotonic())
        self.passed.set()
        return 0


def _stall_the_process(seconds: float) -> None:
    """Block the event loop, as a process the machine stopped scheduling would be."""
    time.sleep(seconds)


async def test_the_sweeper_expires_nothing_within_the_grace_after_a_start_or_a_stall():
    """Billing back from a stop longer than the hold must not expire every hold before the
    orchestrators' stored charges (resent at most 60 s apart) arrive, or turns admitted against
    the credits given back overspend a plan: the sweeper waits `billing_expiry_grace_s` after a
    start or a stall, whatever the sweep interval."""
    ledger = _PassCounter()
    passes = ledger.passes
    task = asyncio.create_task(_sweep_forever(cast(Ledger, ledger), 0.05, grace_s=1.0, stall_s=0.2))
    try:
        await asyncio.sleep(0.6)
        assert passes == []  # the start's grace
        await asyncio.sleep(1.0)
        assert passes
        _stall_the_process(0.4)  # longer than stall_s
        await asyncio.sleep(0.05)
        stalled = len(passes)
        await asyncio.sleep(0.5)
        assert len(passes) == stalled  # the stall's grace
        await asyncio.sleep(1.0)
        assert len(passes) > stalled
    finally:
        task.cancel()


async def test_a_stall_shorter_than_two_sweep_intervals_is_noticed_too():
    """With 30 s sweeps and a 5 s hold, a 30 s stop is a stall too: it is noticed without
    waiting for passes to come two intervals apart."""
    ledger = _PassCounter()
    passes = ledger.passes
    task = asyncio.create_task(_sweep_forever(cast(Ledger, ledger), 0.5, grace_s=1.5, stall_s=0.2))
    try:
        await asyncio.sleep(2.2)
        assert passes  # past the start's grace
        _stall_the_process(0.6)  # shorter than two intervals (1 s)
        await asyncio.sleep(0.05)
        stalled = len(passes)
        await asyncio.sleep(1.0)
        assert len(passes) == stalled  # its grace, though a pass was due
        await asyncio.sleep(1.5)
        assert len(passes) > stalled
    finally:
        task.cancel()


class _FailingPasses(_PassCounter):
    """A ledger whose first passes fail with `errors` in turn, then go through."""

    def __init__(self, *errors: Exception) -> None:
        super().__init__()
        self.errors = list(errors)

    async def expire_holds(self) -> int:
        if self.errors:
            raise self.errors.pop(0)
        return await super().expire_holds()


async def test_a_database_outage_is_said_once_and_a_bug_every_pass(caplog):
    """A database outage is one warning and one "go through again" line, not an ERROR with a
    traceback every sweep; any other failure keeps its traceback."""
    ledger = _FailingPasses(
        TimeoutError(), ConnectionRefusedError(111, "refused"), TimeoutError(), RuntimeError("bug")
    )
    caplog.set_level(logging.INFO, logger="services.billing.server")
    task = asyncio.create_task(_sweep_forever(cast(Ledger, ledger), 0.02))
    try:
        await asyncio.wait_for(ledger.passed.wait(), 5)
    finally:
        task.cancel()
    said = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "services.billing.server"
    ]
    assert said == [
        ("WARNING", "sweeper: database unavailable; holds expire once it answers"),
        ("ERROR", "sweeper pass failed"),
        ("INFO", "sweeper: passes go through again"),
    ], said
    assert caplog.records[-2].exc_info is not None  # the bug's traceback
