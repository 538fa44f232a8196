"""The run charge of a turn: stored with the turn's rows and sent in ChargeBatch calls
(usage.RunCharges; spec "Persist and charge": one run credit per turn; docs/performance.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import grpc
from sqlalchemy import func, select

from loopline.billing.v1 import billing_pb2
from services.billing.models import LedgerEntry, Reservation
from services.orchestrator.models import BillingRedelivery
from services.orchestrator.usage.batches import RunCharges
from services.orchestrator.usage.redelivery import Redelivery
from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import billing_delivered, read_frames, wait_for


async def _reservations(services) -> list[str]:
    async with services.billing.store.sessions() as session:
        return sorted(
            (
                await session.scalars(
                    select(Reservation.state).where(Reservation.org_id == services.org_id)
                )
            ).all()
        )


async def _charges(services) -> int:
    async with services.billing.store.sessions() as session:
        return await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(LedgerEntry.org_id == services.org_id, LedgerEntry.kind == "run_charge")
        )


class _Recorded:
    """A stub that records the names of the methods called through it."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.methods: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.methods.append(name)
        return getattr(self._stub, name)


async def test_turns_started_together_are_charged_once_each_in_one_batch(services, monkeypatch):
    ledger = services.billing.ledger
    real = ledger.charge_batch
    batches: list[int] = []

    async def counted(reservation_ids: list[str]) -> Any:
        batches.append(len(reservation_ids))
        return await real(reservation_ids)

    monkeypatch.setattr(ledger, "charge_batch", counted)
    called = _Recorded(services.orchestrator.servicer.billing)
    monkeypatch.setattr(services.orchestrator.servicer, "billing", called)
    async with services.client() as client:
        started = await asyncio.gather(
            *(
                client.post(
                    "/assistant/chat", json={"message": script({"say": f"n{i}"}), "llm": SCRIPTED}
                )
                for i in range(4)
            )
        )
        assert [r.status_code for r in started] == [200] * 4
        for response in started:
            assert (await read_frames(client, response.json()["stream_url"]))[-1]["type"] == "done"
    await billing_delivered(services)
    assert called.methods == ["Admit"] * 4  # the turn start does not wait for a Charge
    assert sum(batches) == 4 and len(batches) < 4  # started within the linger (0.2 s): shared calls
    assert await _reservations(services) == ["charged"] * 4 and await _charges(services) == 4


async def test_a_turn_whose_process_died_before_sending_its_charge_is_charged_by_the_next(
    services, monkeypatch
):
    """The charge is committed with the turn; a process that dies before the linger is over
    sends nothing, and the next start (its first pass over the stored calls) sends it."""
    monkeypatch.setattr(
        services.orchestrator.runner.charges, "committed", lambda *_args: None
    )  # dies before sending
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
        )
        assert response.status_code == 200, response.text
        await read_frames(client, response.json()["stream_url"])
    async with services.orchestrator.runner.sessions() as session:
        assert "ChargeBatch" in (await session.scalars(select(BillingRedelivery.method))).all()
    assert await _reservations(services) == ["held"]
    await services.orchestrator.runner.redelivery._deliver_due(
        everything=True
    )  # the next start's first pass
    await billing_delivered(services)
    assert await _reservations(services) == ["charged"] and await _charges(services) == 1


class _OlderBilling:
    """A billing without ChargeBatch (an older version during a rolling upgrade)."""

    def __init__(self, refuse: Collection[str] = frozenset()) -> None:
        self.charged: list[str] = []
        self.refuse = refuse

    async def ChargeBatch(self, request, timeout=None):  # noqa: N802 - stub method name
        raise _Unimplemented()

    async def Charge(self, request, timeout=None):  # noqa: N802 - stub method name
        if request.reservation_id in self.refuse:
            raise _Refused()
        self.charged.append(request.reservation_id)
        return billing_pb2.ChargeResponse(
            state=billing_pb2.RESERVATION_STATE_CHARGED, ledger_entry_id="led_1"
        )


class _Unimplemented(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Method not found!",
        )


class _Refused(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "reservation is released",
        )


async def test_an_older_billing_gets_each_charge_as_charge_and_a_refusal_is_logged_once(caplog):
    billing = _OlderBilling(refuse={"res_gone"})
    forgotten: list[list[str]] = []

    async def forget(ids: list[str]) -> None:
        forgotten.append(ids)

    charges = RunCharges(billing, Redelivery(sessions=None), forget=forget, linger_s=0.01)
    rows = [charges.row(reservation_id) for reservation_id in ("res_1", "res_gone", "res_2")]
    with caplog.at_level(logging.ERROR, logger="services.orchestrator.usage"):
        for row, reservation_id in zip(rows, ("res_1", "res_gone", "res_2"), strict=True):
            charges.committed(row["id"], reservation_id)
        await wait_for(lambda: forgotten)
        await charges.close()
    assert sorted(billing.charged) == ["res_1", "res_2"]
    assert forgotten == [[row["id"] for row in rows]]  # a refusal is final: its row is deleted too
    refused = [r for r in caplog.records if "not charged" in r.getMessage()]
    assert [r.fields["reservation_id"] for r in refused] == ["res_gone"]
