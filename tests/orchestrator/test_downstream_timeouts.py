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

from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import UsageRecord
from services.orchestrator.byok import tools_secret_resolver
from services.orchestrator.models import Interrupt, Run
from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import billing_delivered, read_frames, run_turn, wait_for
from tests.orchestrator.turn_records import counts

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
    assert await counts(services) == (0, 0, [], 0)


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
    assert await counts(services) == (1, 1, ["held"], 0)
    hanging = False
    await billing_delivered(
        services, timeout=20
    )  # quick retries (2 s), then the background sends (1 s, 2 s, ...)
    assert await counts(services) == (1, 1, ["charged"], 1)


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
        return (await counts(services))[2] == ["released"]

    await wait_for(released, timeout=10)
    assert await counts(services) == (0, 0, ["released"], 0)


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
    assert await counts(services) == (0, 0, [], 0)


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
                # a stand-in with the stub's methods, each call capped
                _Capped(services.orchestrator.runner.tools, only=("ResolveCredentialSecret",))  # type: ignore[arg-type]
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
    assert await counts(services) == (0, 0, [], 0)


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
    """A tool call in flight when its run fails gets an error result: a `tool_result` after
    its `tool_call` in the stream, before `error` and `done {error: true}`, and an entry in
    done.tool_calls, so no streamed call is left without a result."""

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
