"""Questions to the user through the HTTP API: each kind pauses the run and its answer resumes
it; invalid, stale or concurrent answers are refused and leave the question pending; a question
whose input breaks its schema is a failed tool call; credential questions offer only the auth
types that can be connected and resume on the credential they name.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from services.orchestrator.models import Interrupt, Message
from tests.conftest import SCRIPTED
from tests.orchestrator.helpers import billing_delivered, run_turn, types
from tests.orchestrator.questions import QUESTIONS, ask
from tests.sse_client import read_frames


@pytest.mark.parametrize("tool", list(QUESTIONS))
async def test_each_question_kind_pauses_then_resumes_to_done(services, tool):
    question, answer = QUESTIONS[tool]
    async with services.client() as client:
        body, frames = await ask(client, tool, question)
        assert types(frames)[-2:] == ["user_input_request", "interrupted"]
        request = frames[-2]["data"]
        assert frames[-1]["data"] == {"request_id": request["request_id"], "kind": request["kind"]}
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert (
            status["awaiting_input"] is True
            and status["pending_request_id"] == request["request_id"]
        )
        details = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert details["pending_user_input_request"] == request
        resumed = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request["request_id"], "response": answer, "llm": SCRIPTED},
        )
        assert resumed.status_code == 200, resumed.text
        new = resumed.json()
        assert new["run_id"] != body["run_id"] and new["thread_id"] == body["chat_id"]
        rest = await read_frames(client, new["stream_url"])
        assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "Thanks, all done."
    async with services.orchestrator.servicer.sessions() as session:
        row = await session.get(Interrupt, request["request_id"])
        tool_rows = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "tool"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert row.outcome == "answered"
    assert (
        tool_rows[-1].extra["tool_call_id"]
        == next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"]
    )


async def test_resume_charges_no_second_run_credit(services):
    from services.billing.models import LedgerEntry

    question, answer = QUESTIONS["ask_user_yes_no"]
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", question)
        new = (
            await client.post(
                f"/assistant/chat/{body['chat_id']}/resume",
                json={
                    "request_id": frames[-1]["data"]["request_id"],
                    "response": answer,
                    "llm": SCRIPTED,
                },
            )
        ).json()
        await read_frames(client, new["stream_url"])
    await billing_delivered(
        services
    )  # the run charge is sent ~0.2 s after the turn start (usage.RunCharges)
    async with services.billing.store.sessions() as session:
        charges = (
            (
                await session.execute(
                    select(LedgerEntry).where(LedgerEntry.org_id == services.org_id)
                )
            )
            .scalars()
            .all()
        )
    assert len([c for c in charges if c.idempotency_key.startswith("charge:")]) == 1


@pytest.mark.parametrize(
    ("tool", "answer"),
    [
        ("ask_user_choice", {"kind": "single_choice", "selected_value": "nope"}),
        (
            "ask_user_choice",
            {"kind": "single_choice", "selected_value": ["a"]},
        ),  # was a 500
        ("ask_user_choice", {"kind": ["single_choice"]}),
        ("ask_user_choice", {"kind": "yes_no", "answer": True}),
        ("ask_user_multi_choice", {"kind": "multi_choice", "selected_values": ["a", "b", "c"]}),
        ("ask_user_multi_choice", {"kind": "multi_choice", "selected_values": []}),
        ("ask_user_free_text", {"kind": "free_text", "text": "x"}),
        ("ask_user_free_text", {"kind": "free_text", "text": "far too long for this"}),
    ],
)
async def test_invalid_answer_is_400_and_question_stays_pending(services, tool, answer):
    async with services.client() as client:
        body, frames = await ask(client, tool, QUESTIONS[tool][0])
        request_id = frames[-1]["data"]["request_id"]
        response = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request_id, "response": answer, "llm": SCRIPTED},
        )
        assert response.status_code == 400, response.text
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id


async def test_stale_or_missing_question_is_409(services):
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        stale = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={
                "request_id": "00000000-0000-0000-0000-000000000000",
                "response": {"kind": "yes_no", "answer": True},
            },
        )
        assert stale.status_code == 409
        done, _ = await run_turn(client, {"say": "plain"})
        none = await client.post(
            f"/assistant/chat/{done['chat_id']}/resume",
            json={
                "request_id": frames[-1]["data"]["request_id"],
                "response": {"kind": "yes_no", "answer": True},
            },
        )
        assert none.status_code == 409


async def test_new_turn_while_question_pending_is_409(services):
    async with services.client() as client:
        body, _ = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        response = await client.post(
            "/assistant/chat", json={"message": "hi", "chat_id": body["chat_id"]}
        )
        assert response.status_code == 409


async def test_two_concurrent_resumes_exactly_one_succeeds(services):
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        payload = {
            "request_id": frames[-1]["data"]["request_id"],
            "response": {"kind": "yes_no", "answer": False},
            "llm": SCRIPTED,
        }
        results = await asyncio.gather(
            *[
                client.post(f"/assistant/chat/{body['chat_id']}/resume", json=payload)
                for _ in range(5)
            ]
        )
        assert sorted(r.status_code for r in results) == [200, 409, 409, 409, 409]
        winner = next(r for r in results if r.status_code == 200).json()
        await read_frames(client, winner["stream_url"])


async def test_credential_added_must_name_an_existing_credential_of_the_integration(services):
    import grpc

    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc

    async with services.client() as client:
        body, frames = await ask(
            client, "request_credential", {"integration": "postgresql", "message": "need db"}
        )
        request = frames[-2]["data"]
        assert (
            request["kind"] == "credential_request" and request["integration_name"] == "postgresql"
        )
        assert request["auth_options"]
        bogus = {
            "kind": "credential_added",
            "credential_id": "00000000-0000-0000-0000-000000000000",
            "integration_name": "postgresql",
            "auth_type": "api_key",
        }
        response = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request["request_id"], "response": bogus},
        )
        assert response.status_code == 400
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.tools.port}") as channel:
            created = await tools_pb2_grpc.ToolsServiceStub(channel).CreateCredential(
                tools_pb2.CreateCredentialRequest(
                    organization_id=services.org_id,
                    integration_name="postgresql",
                    auth_data={"dsn": "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"},
                )
            )
        answer = {**bogus, "credential_id": created.credential.credential_id}
        response = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request["request_id"], "response": answer},
        )
        assert response.status_code == 200, response.text
        frames = await read_frames(client, response.json()["stream_url"])
        assert frames[-1]["type"] == "done"


async def test_credential_connected_resumes_the_paused_run_by_itself(services):
    import grpc

    from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc

    async with services.client() as client:
        body, frames = await ask(
            client, "request_credential", {"integration": "postgresql", "message": "need db"}
        )
        other, _ = await ask(
            client, "request_credential", {"integration": "http", "message": "need http"}
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
            stub = assistant_pb2_grpc.AssistantServiceStub(channel)
            notice = assistant_pb2.NotifyCredentialConnectedRequest(
                organization_id=services.org_id, integration="postgresql", credential_id="cred-1"
            )
            first = await stub.NotifyCredentialConnected(notice)
            again = await stub.NotifyCredentialConnected(notice)
        assert len(first.resumed_run_ids) == 1 and list(again.resumed_run_ids) == []
        new_run = first.resumed_run_ids[0]
        old = await read_frames(client, body["stream_url"])
        assert old[-1] == {"type": "run_resumed", "data": {"new_run_id": new_run}}
        assert old[:-1] == frames
        rest = await read_frames(client, f"/assistant/chat/{body['chat_id']}/listen/{new_run}")
        assert rest[-1]["type"] == "done"
        status = (await client.get(f"/assistant/chat/{other['chat_id']}/status")).json()
        assert status["awaiting_input"] is True


async def test_credential_question_offers_only_auth_types_that_can_be_connected(services):
    from modulex.types.realtime import parse_user_input_request

    async with services.client() as client:
        body, frames = await ask(
            client, "request_credential", {"integration": "http", "message": "need http"}
        )
        request = frames[-2]["data"]
        parsed = parse_user_input_request(request)  # the SDK's own model accepts it
        kinds = [o.auth_type for o in parsed.auth_options]
        assert "custom" not in kinds and set(kinds) == {"bearer_token", "api_key"}
        for option in request["auth_options"]:
            auth_data = (
                {"token": "t0ken-value"}
                if option["auth_type"] == "bearer_token"
                else {"api_key": "k3y-value", "header_name": "X-Key"}
            )
            created = await client.post(
                "/credentials",
                json={
                    "integration_name": "http",
                    "auth_type": option["auth_type"],
                    "auth_data": auth_data,
                },
            )
            assert created.status_code == 201, created.text


async def test_malformed_question_is_a_failed_tool_call_listed_in_done(services):
    async with services.client() as client:
        _, frames = await run_turn(client, {"tool": "ask_user_yes_no", "input": {}}, {"say": "ok"})
    result = next(f for f in frames if f["type"] == "tool_result")["data"]["output"]
    assert result["success"] is False and "invalid question" in result["error"]
    assert frames[-1]["type"] == "done"
    assert [c["tool"] for c in frames[-1]["data"]["tool_calls"]] == ["ask_user_yes_no"]


@pytest.mark.parametrize(
    ("tool", "tool_input", "expected"),
    [
        (
            "ask_user_yes_no",
            {"message": "ok?", "yes_lable": "Sure"},
            "input: unexpected field(s) 'yes_lable' (allowed: 'message', 'yes_label', 'no_label')",
        ),
        (
            "ask_user_choice",
            {"message": "pick", "options": ["a", "b"]},
            "input.options[0]: must be of type object (got string)",
        ),
        (
            "ask_user_free_text",
            {"message": {"text": "say"}},
            "input.message: must be of type string (got object)",
        ),
        (
            "request_credential",
            {"integration_name": "http", "message": "need http"},
            "'integration' is required",
        ),
        (
            "request_credential",
            {"integration": "nope", "message": "need it"},
            "Unknown integration 'nope'. Available integrations include: ",
        ),
        (
            "ask_user_choice",
            {
                "message": "pick",
                "options": [{"value": "a\x00b", "label": "A"}, {"value": "c", "label": "C"}],
            },
            "input: text must not contain U+0000 (NUL)",
        ),
        ("ask_user_yes_no", {"message": "ok\x00?"}, "input: text must not contain U+0000 (NUL)"),
        (
            "request_credential",
            {"integration": "loopline", "message": "need it"},
            "the integration 'loopline' takes no credential",
        ),
    ],
)
async def test_a_question_whose_input_breaks_its_schema_is_not_asked_and_the_error_names_the_field(
    services, tool, tool_input, expected
):
    # unknown fields are refused and wrong types are not coerced (a dict message must not become
    # its Python repr)
    async with services.client() as client:
        body, frames = await run_turn(client, {"tool": tool, "input": tool_input}, {"say": "ok"})
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        result = frames[2]["data"]["output"]
        assert (
            result["success"] is False
            and result["error"].startswith("invalid question: ")
            and expected in result["error"]
        )
        assert frames[-1]["data"]["tool_calls"][0]["output"] == result
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert chat["pending_user_input_request"] is None  # nothing was asked


async def test_a_question_whose_call_id_holds_control_characters_pauses_and_resumes(services):
    # on PostgreSQL a NUL in a HITL call's id must not fail the run's end ("Internal error while
    # finishing the turn.")
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {
                "say": "One question.",
                "tool": "ask_user_yes_no",
                "input": {"message": "ok?"},
                "tool_call_id": "call\u0000_\u0007x",
            },
            {"say": "Thanks."},
        )
        assert types(frames)[-2:] == ["user_input_request", "interrupted"]
        assert (
            next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"] == "call_x"
        )
        resumed = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={
                "request_id": frames[-1]["data"]["request_id"],
                "response": {"kind": "yes_no", "answer": True},
                "llm": SCRIPTED,
            },
        )
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
    assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "Thanks."
    async with services.orchestrator.servicer.sessions() as session:
        rows = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "tool"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert [r.extra["tool_call_id"] for r in rows] == ["call_x"]


async def test_a_call_id_of_control_characters_only_gets_a_new_id():
    from services.orchestrator.loop import _call_id

    assert _call_id("call_1") == "call_1"
    assert _call_id("a\u0000b\u009fc\td") == "abcd"
    minted = _call_id("\u0000\n")
    assert minted.startswith("call_") and len(minted) == 29
