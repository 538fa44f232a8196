"""Billing or the tools service not answering in time during a turn's start (tester: `kill -STOP`
on billing gave 503 after 10 s).

Rule (README error table, services/gateway/errors.py): "a downstream timeout" is 504; a service
that is down stays 503 with Retry-After. Either way nothing is written and nothing is charged: a
reservation taken before a Charge that timed out is released. The orchestrator's deadlines (10 s)
are shortened here by a stub wrapper; the hung service really hangs (its handler never answers),
so the orchestrator sees gRPC's own DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from sqlalchemy import func, select

from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import LedgerEntry, Reservation
from services.orchestrator.byok import tools_secret_resolver
from services.orchestrator.models import Chat, Interrupt, Run
from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import run_turn

DEADLINE_S = 0.5
OPENAI = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-4o"}


class _Capped:
    """A gRPC stub whose calls get at most `cap` seconds (the orchestrator asks for 10)."""

    def __init__(self, stub: Any, cap: float = DEADLINE_S) -> None:
        self._stub, self._cap = stub, cap

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)

        def call(request: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
            return method(request, timeout=min(timeout or self._cap, self._cap), **kwargs)

        return call


async def _hang(*_args: Any, **_kwargs: Any) -> Any:
    await asyncio.Event().wait()


async def _counts(stack) -> tuple[int, int, list[str], int]:
    """(chats, runs, reservation states, "charge:" ledger entries) of the stack's organization."""
    async with stack.orchestrator.servicer.sessions() as session:
        chats = await session.scalar(select(func.count()).select_from(Chat).where(Chat.organization_id == stack.org_id))
        runs = await session.scalar(select(func.count()).select_from(Run).where(Run.organization_id == stack.org_id))
    async with stack.billing.core.sessions() as session:
        states = (await session.scalars(select(Reservation.state).where(Reservation.org_id == stack.org_id))).all()
        charges = await session.scalar(select(func.count()).select_from(LedgerEntry).where(
            LedgerEntry.org_id == stack.org_id, LedgerEntry.idempotency_key.like("charge:%")))
    return chats, runs, sorted(states), charges


def _assert_timed_out(response, started: float) -> None:
    assert response.status_code == 504, response.text
    assert response.json() == {"detail": "The request timed out"}
    assert time.monotonic() - started < 10  # the capped deadline, not the gateway's 30 s


async def test_billing_admit_hanging_is_504_with_nothing_written_or_charged(stack, monkeypatch):
    monkeypatch.setattr(stack.orchestrator.servicer, "billing", _Capped(stack.orchestrator.servicer.billing))
    monkeypatch.setattr(stack.billing.core, "admit", _hang)
    async with stack.client() as client:
        started = time.monotonic()
        _assert_timed_out(await client.post("/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}), started)
    assert await _counts(stack) == (0, 0, [], 0)


async def test_billing_charge_hanging_is_504_and_the_reservation_is_released(stack, monkeypatch):
    monkeypatch.setattr(stack.orchestrator.servicer, "billing", _Capped(stack.orchestrator.servicer.billing))
    monkeypatch.setattr(stack.billing.core, "charge", _hang)
    async with stack.client() as client:
        started = time.monotonic()
        _assert_timed_out(await client.post("/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}), started)
    assert await _counts(stack) == (0, 0, ["released"], 0)


async def test_billing_down_stays_503_with_retry_after(stack, monkeypatch):
    async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere:  # nothing listens there
        monkeypatch.setattr(stack.orchestrator.servicer, "billing", billing_pb2_grpc.BillingServiceStub(nowhere))
        async with stack.client() as client:
            response = await client.post("/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED})
    assert response.status_code == 503, response.text
    assert response.json() == {"detail": "Service temporarily unavailable; try again"} and response.headers["retry-after"] == "1"
    assert await _counts(stack) == (0, 0, [], 0)


async def test_tools_hanging_on_the_model_key_is_504_before_billing_is_asked(stack, monkeypatch):
    async with stack.client() as client:
        created = await client.post("/credentials", json={"integration_name": "openai", "auth_data": {"api_key": "sk-test-1234567890"}})
        assert created.status_code in (200, 201), created.text
        monkeypatch.setattr(stack.orchestrator.servicer, "secret_resolver", tools_secret_resolver(_Capped(stack.orchestrator.runner.tools)))
        monkeypatch.setattr(stack.tools.servicer.credentials, "resolve", _hang)
        started = time.monotonic()
        _assert_timed_out(await client.post("/assistant/chat", json={
            "message": "hi", "llm": {**OPENAI, "credential_id": created.json()["credential_id"]}}), started)
    assert await _counts(stack) == (0, 0, [], 0)


async def test_tools_hanging_on_a_credential_added_answer_is_504_and_the_question_stays_pending(stack, monkeypatch):
    async with stack.client() as client:
        created = await client.post("/credentials", json={"integration_name": "postgresql",
                                                          "auth_data": {"dsn": "postgresql://u:p@db.example/x"}})
        assert created.status_code in (200, 201), created.text
        asked, frames = await run_turn(client, {"say": "I need it.", "tool": "request_credential",
                                                "input": {"integration": "postgresql", "message": "database access"}})
        request_id = frames[-1]["data"]["request_id"]
        monkeypatch.setattr(stack.orchestrator.runner, "tools", _Capped(stack.orchestrator.runner.tools))
        monkeypatch.setattr(stack.tools.servicer.credentials, "get", _hang)
        started = time.monotonic()
        _assert_timed_out(await client.post(f"/assistant/chat/{asked['chat_id']}/resume", json={
            "request_id": request_id, "llm": SCRIPTED,
            "response": {"kind": "credential_added", "credential_id": created.json()["credential_id"]}}), started)
    async with stack.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, request_id)).outcome == "pending"
        runs = await session.scalar(select(func.count()).select_from(Run).where(Run.chat_id == asked["chat_id"]))
    assert runs == 1
