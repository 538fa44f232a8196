"""A turn start that fails or is cancelled after it wrote or reserved something: it removes
the chat, message, run and stored charge it wrote and releases its hold (in the background when
billing does not take the release), and a turn whose commit landed still runs; an unwind that
meets the same storage outage logs a warning, not a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from sqlalchemy import func, select

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.orchestrator.models import BillingRedelivery, Run
from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import billing_delivered, wait_for
from tests.orchestrator.turn_records import counts


async def _start_turn_failing(services, say: str, timeout: float) -> grpc.StatusCode:
    """StartTurn straight over gRPC (a scripted turn answering `say`) with a `timeout` deadline;
    asserts that the call fails and returns its status code."""
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.StartTurn(
                assistant_pb2.StartTurnRequest(
                    caller=caller,
                    message=script({"say": say}),
                    llm=assistant_pb2.LlmConfig(**SCRIPTED),
                ),
                timeout=timeout,
            )
    return failed.value.code()


async def test_a_turn_start_whose_commit_answer_was_lost_is_removed_with_its_stored_charge(
    services, monkeypatch
):
    """The persist's transaction committed but its caller saw a failure (a dropped connection, a
    cancelled call): the start unwinds the chat, message and run and releases the hold; the
    run charge stored in that transaction goes with them, so no credit is charged for a turn
    that was removed (without deleting it, the charge was sent later and refused: RELEASED)."""
    store = services.orchestrator.servicer.store
    real = store.persist_turn

    async def committed_then_lost(**kwargs: Any) -> None:
        await real(**kwargs)
        raise ConnectionResetError("the database connection dropped before the commit's answer")

    monkeypatch.setattr(store, "persist_turn", committed_then_lost)
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
        )
    assert response.status_code >= 500, response.text
    assert await counts(services) == (0, 0, ["released"], 0)
    async with services.orchestrator.servicer.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(BillingRedelivery)) == 0
    await services.orchestrator.runner.redelivery._deliver_due(
        everything=True
    )  # what a next start would send
    assert await counts(services) == (0, 0, ["released"], 0)


async def test_a_turn_start_given_up_while_its_commit_is_queued_is_removed_when_that_commit_lands(
    services, monkeypatch
):
    """SQLite: the persist's transaction waits on the database worker behind another one when the
    turn start gives up on it (a cancelled call); the worker commits it all the same, later. The
    unwind must undo that commit, not overtake it (a chat, a run that never ran and a stored
    charge left behind). It runs as a job of the same worker, after the commit (`unwind_turn`);
    before, it went through another connection and was kept in order by SQLite's write lock."""
    import time as clock

    store = services.orchestrator.servicer.store
    if store.pg is not None:
        import pytest

        pytest.skip("SQLite's transaction worker")
    real = store.persist_turn

    async def given_up_while_queued(**kwargs: Any) -> None:
        busy = asyncio.ensure_future(
            store.txn.run(lambda conn: clock.sleep(0.3), inline=False)
        )  # the worker is busy
        await asyncio.sleep(0.05)
        asyncio.ensure_future(real(**kwargs))  # queued behind it
        await asyncio.sleep(0)
        assert not busy.done()
        raise ConnectionResetError("the caller gave up")

    monkeypatch.setattr(store, "persist_turn", given_up_while_queued)
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
        )
    assert response.status_code >= 500, response.text
    await asyncio.sleep(0.5)  # the queued commit has landed
    assert await counts(services) == (0, 0, ["released"], 0)
    async with services.orchestrator.servicer.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(BillingRedelivery)) == 0


async def test_a_reservation_billing_could_not_release_is_released_in_the_background(
    services, monkeypatch
):
    """With billing gone when a failed turn start releases its reservation, the Release is
    stored and sent again (usage.Redelivery) until billing takes it: an unreleased hold blocks
    its credit and counts against the quota until it expires 15 minutes later."""
    ledger = services.billing.ledger
    real_release = ledger.release
    refused = 0

    async def persist_fails(**_kwargs: Any) -> Any:
        raise ConnectionResetError("the database fell over")

    async def release_refused_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal refused
        if refused < 1:
            refused += 1
            raise RuntimeError("billing fell over again")
        return await real_release(*args, **kwargs)

    monkeypatch.setattr(services.orchestrator.servicer.store, "persist_turn", persist_fails)
    monkeypatch.setattr(ledger, "release", release_refused_once)
    redelivery = services.orchestrator.runner.redelivery
    monkeypatch.setattr(redelivery, "first_delay_s", 0.05)
    monkeypatch.setattr(redelivery, "max_delay_s", 0.1)
    async with services.client() as client:
        response = await client.post("/assistant/chat", json={"message": script({"say": "never"})})
    assert response.status_code >= 500
    assert await counts(services) == (
        0,
        0,
        ["held"],
        0,
    )  # nothing written; the hold waits for its release

    async def released() -> bool:
        return (await counts(services))[2] == ["released"]

    await wait_for(released, timeout=10)


async def test_a_turn_start_cancelled_while_billing_admits_it_releases_the_hold(
    services, monkeypatch
):
    """A turn start cancelled while billing admits it (e.g. the orchestrator stalled past the
    gateway's deadline) releases the hold once billing answers; otherwise the hold would count
    against the allowance and the daily quota until it expired (120 s)."""
    real_admit = services.billing.admission.admit
    answered = asyncio.Event()

    async def slow_admit(*args: Any, **kwargs: Any) -> Any:
        admitted = await real_admit(*args, **kwargs)  # the hold is set aside ...
        answered.set()
        await asyncio.sleep(0.5)  # ... and its answer comes after the caller gave up
        return admitted

    monkeypatch.setattr(services.billing.admission, "admit", slow_admit)
    assert (
        await _start_turn_failing(services, "hi", timeout=0.2) == grpc.StatusCode.DEADLINE_EXCEEDED
    )
    await asyncio.wait_for(answered.wait(), 10)

    async def released() -> bool:
        return (await counts(services))[2] == ["released"]

    await wait_for(released, timeout=10)
    assert await counts(services) == (0, 0, ["released"], 0)


async def test_a_turn_start_cancelled_after_its_commit_still_runs_the_charged_turn(
    services, monkeypatch
):
    """A cancel reaching the turn start after its commit (the caller's deadline passing while
    the chat claim is freed) skipped the start of the loop: the persisted turn, its charge
    stored, sat `running` with nothing running it until the reaper failed it. The loop now
    starts before anything else is awaited."""
    servicer = services.orchestrator.servicer
    real = servicer._unclaim

    async def cancelled_while_unclaiming(chat_id: str) -> None:
        await real(chat_id)
        raise asyncio.CancelledError()

    monkeypatch.setattr(servicer, "_unclaim", cancelled_while_unclaiming)
    await _start_turn_failing(services, "ran", timeout=2)

    async def completed() -> bool:
        async with servicer.sessions() as session:
            return (
                await session.scalars(
                    select(Run.status).where(Run.organization_id == services.org_id)
                )
            ).all() == ["completed"]

    await wait_for(completed, timeout=10)
    await billing_delivered(services)
    assert await counts(services) == (1, 1, ["charged"], 1)


@pytest.mark.parametrize(
    ("failure", "level"), [(TimeoutError, "WARNING"), (lambda: RuntimeError("bug"), "ERROR")]
)
async def test_an_unwind_that_meets_the_same_outage_is_a_warning_not_a_traceback(
    caplog, failure, level
):
    """With every database dropping packets, a failed turn start's unwind (on the same database)
    fails too: a storage outage there is a warning naming the store, not an ERROR traceback; a
    bug keeps its traceback."""
    from types import SimpleNamespace

    from services.orchestrator.servicer import AssistantServicer

    async def unwind_turn(**_kwargs):
        raise failure()

    servicer = SimpleNamespace(store=SimpleNamespace(unwind_turn=unwind_turn))
    # never raises; a stand-in servicer with only the `store` _unwind uses
    await AssistantServicer._unwind(servicer, "chat", "run", True, "charge")  # type: ignore[arg-type]
    [record] = [r for r in caplog.records if r.name == "services.orchestrator.servicer.turn_start"]
    assert record.levelname == level
    if level == "WARNING":
        assert (
            record.getMessage().startswith("unwinding a failed turn start: database unavailable")
            and not record.exc_info
        )
    else:
        assert record.exc_info is not None
