"""Holds never charged nor released expire and are voided by the sweeper (issue 5)."""

from __future__ import annotations

import asyncio
import datetime

import grpc
import pytest

from loopline.billing.v1 import billing_pb2 as pb
from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import Account
from services.billing.server import BillingServer
from services.common.errors import status_details
from tests_billing_helpers import admit_request, make_settings


async def test_sweeper_expires_overdue_holds_and_returns_their_credits(server, stub, org):
    held = await stub.Admit(admit_request(org, "c:old"))
    kept = await stub.Admit(admit_request(org, "c:charged"))
    await stub.Charge(pb.ChargeRequest(reservation_id=kept.reservation_id))

    assert await server.core.expire_holds() == 0  # nothing is overdue yet
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=901)
    assert await server.core.expire_holds(now=later) == 1
    assert await server.core.expire_holds(now=later) == 0  # voided at most once

    async with server.core.sessions() as session:
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
    server = await BillingServer.start(
        make_settings(tmp_path, billing_hold_seconds=0, billing_sweep_interval_s=0.05, billing_expiry_grace_s=0)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = billing_pb2_grpc.BillingServiceStub(channel)
            held = await stub.Admit(admit_request(org, "c:r"))
            for _ in range(100):
                replay = await stub.Admit(admit_request(org, "c:r"))
                if replay.state == pb.RESERVATION_STATE_EXPIRED:
                    break
                await asyncio.sleep(0.02)
            assert replay.state == pb.RESERVATION_STATE_EXPIRED
            assert replay.reservation_id == held.reservation_id
    finally:
        await server.stop(0)


def test_the_default_hold_outlives_the_slowest_turn_start_and_little_more():
    """Fresh-eyes test: a turn start whose orchestrator was killed between Admit and Charge left
    its hold for 15 minutes (the default was 900 s), blocking a credit and a quota slot. A turn
    start charges within the Admit and Charge deadlines (10 s each) plus SQLite's busy timeout
    (30 s) for its rows; the hold is 120 s."""
    from services.billing.config import BillingSettings
    from services.common.db import SQLITE_PRAGMAS

    busy_s = next(int(p.split("=")[1]) for p in SQLITE_PRAGMAS if p.startswith("busy_timeout=")) / 1000
    hold = BillingSettings().billing_hold_seconds
    assert 10 + busy_s + 10 < hold <= 120
