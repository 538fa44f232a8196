"""Billing or the tools service not answering in time during a turn's start (as under
`kill -STOP`).

Rule (README error table, services/gateway/errors.py): "a downstream timeout" is 504; a service
that is down stays 503 with Retry-After. Either way nothing is written and nothing is charged. The
run charge is stored with the turn and sent in a batch, so billing not answering it holds up
nothing: it is sent again until billing takes it. The orchestrator's deadlines (10 s)
are shortened here by a stub wrapper; the hung service really hangs (its handler never answers),
so the orchestrator sees gRPC's own DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from sqlalchemy import func, select

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import LedgerEntry, Reservation, UsageRecord
from services.orchestrator.byok import tools_secret_resolver
from services.orchestrator.models import BillingRedelivery, Chat, Interrupt, Run
from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import billing_delivered, read_frames, run_turn, wait_for

DEADLINE_S = 0.5
OPENAI = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-4o"}


class _Capped:
    """A gRPC stub whose calls of the methods `only` (all when empty) get at most `cap` seconds
    (the orchestrator asks for 10). Cap only the call that hangs: the others keep their own
    deadlines, which a loaded CI machine on PostgreSQL can need (an Admit cut at 0.5 s there
    was rolled back and made the Charge test see no reservation at all)."""

    def __init__(self, stub: Any, cap: float = DEADLINE_S, only: tuple[str, ...] = ()) -> None:
        self._stub, self._cap, self._only = stub, cap, only

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if self._only and name not in self._only:
            return method

        def call(request: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
            return method(request, timeout=min(timeout or self._cap, self._cap), **kwargs)

        return call


async def _hang(*_args: Any, **_kwargs: Any) -> Any:
    await asyncio.Event().wait()


async def _counts(services) -> tuple[int, int, list[str], int]:
    """(chats, runs, reservation states, "charge:" ledger entries) of the stack's organization."""
    async with services.orchestrator.servicer.sessions() as session:
        chats = await session.scalar(
            select(func.count()).select_from(Chat).where(Chat.organization_id == services.org_id)
        )
        runs = await session.scalar(
            select(func.count()).select_from(Run).where(Run.organization_id == services.org_id)
        )
    async with services.billing.store.sessions() as session:
        states = (
            await session.scalars(
                select(Reservation.state).where(Reservation.org_id == services.org_id)
            )
        ).all()
        charges = await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(
                LedgerEntry.org_id == services.org_id, LedgerEntry.idempotency_key.like("charge:%")
            )
        )
    return chats, runs, sorted(states), charges


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


def _assert_timed_out(response, started: float) -> None:
    assert response.status_code == 504, response.text
    assert response.json() == {"detail": "The request timed out"}
    assert time.monotonic() - started < 10  # the capped deadline, not the gateway's 30 s


async def test_billing_admit_hanging_is_504_with_nothing_written_or_charged(services, monkeypatch):
    monkeypatch.setattr(
        services.orchestrator.servicer,
        "billing",
        _Capped(services.orchestrator.servicer.billing, only=("Admit",)),
    )
    monkeypatch.setattr(services.billing.admission, "admit", _hang)
    async with services.client() as client:
        started = time.monotonic()
        _assert_timed_out(
            await client.post(
                "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
            ),
            started,
        )
    assert await _counts(services) == (0, 0, [], 0)


async def test_a_hanging_billing_charge_does_not_hold_up_the_turn_and_is_posted_once_it_answers(
    services, monkeypatch
):
    """The run charge is stored with the turn and sent in a batch: a billing that does not answer
    it neither delays the turn start (no 504 after the Charge deadline, no unwound turn) nor loses
    the credit: the stored charge is sent again until billing takes it."""
    real = services.billing.ledger.charge_batch
    hanging = True

    async def hangs_for_a_while(reservation_ids: Any) -> Any:
        if hanging:
            await _hang()
        return await real(reservation_ids)

    monkeypatch.setattr(services.billing.ledger, "charge_batch", hangs_for_a_while)
    async with services.client() as client:
        started = time.monotonic()
        response = await client.post(
            "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
        )
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < 2
        frames = await read_frames(client, response.json()["stream_url"])
    assert frames[-1]["type"] == "done" and frames[-1]["data"]["response"] == "hi"
    assert await _counts(services) == (1, 1, ["held"], 0)
    hanging = False
    await billing_delivered(
        services, timeout=20
    )  # quick retries (2 s), then the background sends (1 s, 2 s, ...)
    assert await _counts(services) == (1, 1, ["charged"], 1)


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
    assert await _counts(services) == (0, 0, ["released"], 0)
    async with services.orchestrator.servicer.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(BillingRedelivery)) == 0
    await services.orchestrator.runner.redelivery._deliver_due(
        everything=True
    )  # what a next start would send
    assert await _counts(services) == (0, 0, ["released"], 0)


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
    assert await _counts(services) == (0, 0, ["released"], 0)
    async with services.orchestrator.servicer.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(BillingRedelivery)) == 0


async def test_billing_down_stays_503_with_retry_after(services, monkeypatch):
    async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere:  # nothing listens there
        monkeypatch.setattr(
            services.orchestrator.servicer, "billing", billing_pb2_grpc.BillingServiceStub(nowhere)
        )
        async with services.client() as client:
            response = await client.post(
                "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
            )
    assert response.status_code == 503, response.text
    assert (
        response.json() == {"detail": "Service temporarily unavailable; try again"}
        and response.headers["retry-after"] == "1"
    )
    assert await _counts(services) == (0, 0, [], 0)


async def test_billing_down_gives_a_grpc_caller_unavailable_with_a_retry_delay(
    services, monkeypatch
):
    # a gRPC caller gets BILLING_UNAVAILABLE with RetryInfo, as HTTP callers get Retry-After
    from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
    from services.common.errors import status_details

    async with grpc.aio.insecure_channel("127.0.0.1:1") as nowhere:  # nothing listens there
        monkeypatch.setattr(
            services.orchestrator.servicer, "billing", billing_pb2_grpc.BillingServiceStub(nowhere)
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
            caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await assistant_pb2_grpc.AssistantServiceStub(channel).StartTurn(
                    assistant_pb2.StartTurnRequest(caller=caller, message="hi")
                )
    details = status_details(refused.value)
    assert (
        refused.value.code() == grpc.StatusCode.UNAVAILABLE
        and details.reason == "BILLING_UNAVAILABLE"
    )
    assert details.retry_after_s == 1.0


async def test_tools_hanging_on_the_model_key_is_504_before_billing_is_asked(services, monkeypatch):
    async with services.client() as client:
        created = await client.post(
            "/credentials",
            json={"integration_name": "openai", "auth_data": {"api_key": "sk-test-1234567890"}},
        )
        assert created.status_code in (200, 201), created.text
        monkeypatch.setattr(
            services.orchestrator.servicer,
            "secret_resolver",
            tools_secret_resolver(
                _Capped(services.orchestrator.runner.tools, only=("ResolveCredentialSecret",))
            ),
        )
        monkeypatch.setattr(services.tools.servicer.credentials, "resolve", _hang)
        started = time.monotonic()
        _assert_timed_out(
            await client.post(
                "/assistant/chat",
                json={
                    "message": "hi",
                    "llm": {**OPENAI, "credential_id": created.json()["credential_id"]},
                },
            ),
            started,
        )
    assert await _counts(services) == (0, 0, [], 0)


async def test_tools_hanging_on_a_credential_added_answer_is_504_and_the_question_stays_pending(
    services, monkeypatch
):
    async with services.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "postgresql",
                "auth_data": {"dsn": "postgresql://u:p@db.example/x"},
            },
        )
        assert created.status_code in (200, 201), created.text
        asked, frames = await run_turn(
            client,
            {
                "say": "I need it.",
                "tool": "request_credential",
                "input": {"integration": "postgresql", "message": "database access"},
            },
        )
        request_id = frames[-1]["data"]["request_id"]
        monkeypatch.setattr(
            services.orchestrator.runner,
            "tools",
            _Capped(services.orchestrator.runner.tools, only=("GetCredential",)),
        )
        monkeypatch.setattr(services.tools.servicer.credentials, "get", _hang)
        started = time.monotonic()
        _assert_timed_out(
            await client.post(
                f"/assistant/chat/{asked['chat_id']}/resume",
                json={
                    "request_id": request_id,
                    "llm": SCRIPTED,
                    "response": {
                        "kind": "credential_added",
                        "credential_id": created.json()["credential_id"],
                    },
                },
            ),
            started,
        )
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, request_id)).outcome == "pending"
        runs = await session.scalar(
            select(func.count()).select_from(Run).where(Run.chat_id == asked["chat_id"])
        )
    assert runs == 1


async def test_a_billing_outage_during_a_run_loses_none_of_its_usage(services, monkeypatch):
    """Billing down (e.g. SIGSTOP for ~25 s) during a run: the run completes, and after the 3
    quick attempts the orchestrator sends its usage records again in the background until billing
    takes them, so no usage goes unbilled."""
    real = services.billing.ledger.record_usage_batch
    refused = 0

    async def down_for_a_while(requests: Any) -> Any:
        nonlocal refused
        if refused < 5:  # more than the 3 quick attempts
            refused += 1
            raise RuntimeError("billing is having a bad time")
        return await real(requests)

    monkeypatch.setattr(services.billing.ledger, "record_usage_batch", down_for_a_while)
    redelivery = getattr(services.orchestrator.runner, "redelivery", None)
    if redelivery is not None:  # short waits for the test (1 s doubling in production)
        monkeypatch.setattr(redelivery, "first_delay_s", 0.05)
        monkeypatch.setattr(redelivery, "max_delay_s", 0.1)
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "one", "tool": "get_available_integrations", "input": {}},
            {"say": "two"},
        )
    assert frames[-1]["type"] == "done"

    async def recorded() -> bool:
        async with services.billing.store.sessions() as session:
            return (
                await session.scalar(
                    select(func.count())
                    .select_from(UsageRecord)
                    .where(UsageRecord.run_id == body["run_id"])
                )
                == 2
            )

    await wait_for(recorded, timeout=10)


async def test_a_tool_call_the_tools_service_does_not_answer_in_time_is_an_error_result(
    services, monkeypatch
):
    """A tools service stalled mid-call does not fail the whole run ("A backing service failed
    (deadline_exceeded)"): the streamed `tool_call` gets its `tool_result`, done.tool_calls lists
    it, the call is an error result for the model as any failed tool call (spec: "on failure
    `output` is `{error, success: false}`"), and the run goes on."""
    monkeypatch.setattr(
        services.orchestrator.runner,
        "tools",
        _Capped(services.orchestrator.runner.tools, only=("ExecuteTool",)),
    )
    slow = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "wait", "parameters": {"seconds": 20}},
    }
    async with services.client() as client:
        _, frames = await run_turn(client, slow, {"say": "answered without it"})
    kinds = [f["type"] for f in frames]
    assert "error" not in kinds and kinds[-1] == "done"
    call = next(f["data"] for f in frames if f["type"] == "tool_call")
    result = next(f["data"] for f in frames if f["type"] == "tool_result")
    assert (result["tool"], result["tool_call_id"]) == (call["tool"], call["tool_call_id"])
    assert result["output"] == {
        "error": "the tool did not answer in time; the call may have run",
        "success": False,
    }
    done = frames[-1]["data"]
    assert done["response"] == "answered without it"
    assert done["tool_calls"] == [
        {"tool": "execute_integration_tool", "input": slow["input"], "output": result["output"]}
    ]


async def test_a_tool_call_cut_off_by_a_failing_run_gets_its_result_in_the_stream_and_in_done(
    services, monkeypatch
):
    """Fifth session's leftover: a run that failed while a tool call was in flight ended with
    `error` then `done {error: true}`, but the streamed `tool_call` never got its `tool_result`
    and done.tool_calls was empty. Now the call's error result is streamed and listed."""

    real = services.orchestrator.runner.tools

    class Broken:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def ExecuteTool(self, *_args, **_kwargs):  # noqa: N802 - stub method name
            raise RuntimeError("a bug in the loop's tool path")

    monkeypatch.setattr(services.orchestrator.runner, "tools", Broken())
    call = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}},
    }
    async with services.client() as client:
        _, frames = await run_turn(client, call, {"say": "never"})
    assert [f["type"] for f in frames][-4:] == ["tool_call", "tool_result", "error", "done"]
    call_frame, result, done = frames[-4]["data"], frames[-3]["data"], frames[-1]["data"]
    assert (result["tool"], result["tool_call_id"]) == (
        call_frame["tool"],
        call_frame["tool_call_id"],
    )
    assert result["output"] == {"error": "not completed: the run failed", "success": False}
    assert done["error"] is True
    assert done["tool_calls"] == [
        {"tool": "execute_integration_tool", "input": call["input"], "output": result["output"]}
    ]


async def test_a_reservation_billing_could_not_release_is_released_in_the_background(
    services, monkeypatch
):
    """Bug: billing gone when a failed turn start released its
    reservation ("releasing a reservation failed" at ERROR, not retried): the hold blocked its
    credit and counted against the quota until it expired 15 minutes later. The Release is now
    stored and sent again (usage.Redelivery) until billing takes it."""
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
    assert await _counts(services) == (
        0,
        0,
        ["held"],
        0,
    )  # nothing written; the hold waits for its release

    async def released() -> bool:
        return (await _counts(services))[2] == ["released"]

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
        return (await _counts(services))[2] == ["released"]

    await wait_for(released, timeout=10)
    assert await _counts(services) == (0, 0, ["released"], 0)


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
    assert await _counts(services) == (1, 1, ["charged"], 1)


async def test_an_admission_answered_after_its_deadline_has_its_hold_released(
    services, monkeypatch
):
    """Billing stalled: it sets the hold aside but answers after the turn start's Admit deadline
    (504 BILLING_TIMEOUT). The turn start asks billing again for the same turn key and releases
    the hold, which would otherwise stay held, belonging to no turn, until it expired."""
    real_admit = services.billing.admission.admit
    slow = [True]

    async def answers_late_once(*args: Any, **kwargs: Any) -> Any:
        admitted = await real_admit(*args, **kwargs)
        if slow:
            slow.clear()
            await asyncio.sleep(DEADLINE_S * 2)  # past the (capped) Admit deadline
        return admitted

    monkeypatch.setattr(
        services.orchestrator.servicer,
        "billing",
        _Capped(services.orchestrator.servicer.billing, only=("Admit",)),
    )
    monkeypatch.setattr(services.billing.admission, "admit", answers_late_once)
    async with services.client() as client:
        started = time.monotonic()
        _assert_timed_out(
            await client.post(
                "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
            ),
            started,
        )

    async def released() -> bool:
        return (await _counts(services))[2] == ["released"]

    await wait_for(released, timeout=10)
    assert await _counts(services) == (0, 0, ["released"], 0)


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
    await AssistantServicer._unwind(servicer, "chat", "run", True, "charge")  # never raises
    [record] = [r for r in caplog.records if r.name == "services.orchestrator.servicer.turn_start"]
    assert record.levelname == level
    if level == "WARNING":
        assert (
            record.getMessage().startswith("unwinding a failed turn start: database unavailable")
            and not record.exc_info
        )
    else:
        assert record.exc_info is not None
