"""GET /assistant/chat, a question and a resume answer carry JSON exactly (numbers, key order).

They crossed the orchestrator <-> gateway boundary as a protobuf Struct/Value, which lists an
object's keys sorted and holds every number as a double: a tool's 64-bit database id
(9007199254740993) showed as 9007199254740992.0, 1.0 as 1, in the chat's messages, its pending
question and the `user_input_request` frame, and a resume answer's `provider_details` reached
the thread rounded, while the stream's tool frames showed them exactly. They travel as JSON
text now (`content_json`, `thinking_json`, `pending_user_input_request_json`,
`UserInputRequestEvent.request_json`, `ResumeRequest.response_json`); a reader given only the
Struct or Value (a service of an older version) still works.
"""

from __future__ import annotations

import json
import types as pytypes
from typing import Any

import orjson
import pytest
from google.protobuf import timestamp_pb2
from sqlalchemy import select

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.common import pb
from services.gateway import sse
from services.gateway.routes.chats import _pending
from services.orchestrator.models import Interrupt, Message
from services.tools.tools import ToolResult
from tests.conftest import SCRIPTED
from tests.orchestrator.helpers import run_turn, types
from tests.sse_client import read_frames

BIG = 2**53 + 1  # 9007199254740993: a double holds 9007199254740992


def exact(data: Any) -> str:
    """`data` (parsed by json.loads: key order kept, ints exact, 1.0 a float) as text, so that
    comparing two texts compares key order and number types too (1.0 == 1 in Python)."""
    return json.dumps(data)


async def test_get_chat_shows_a_tools_output_and_the_calls_input_exactly_as_the_stream(
    services, monkeypatch
):
    row = {"zeta": BIG, "alpha": 1.0, "mid": [1, 2.5, {"b": -0.0, "a": 18446744073709551615}]}

    async def database_query(org_id, tool, args):  # noqa: ANN001, ANN202 - a tool that reads a 64-bit id from a database
        return ToolResult(True, output={"rows": [row], "count": 1})

    monkeypatch.setattr(services.tools.servicer.executor, "execute", database_query)
    tool_input = {
        "integration": "loopline",
        "action": "echo",
        "parameters": {"zeta": BIG, "alpha": 1.0, "message": "hi"},
    }
    async with services.client() as client:
        body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        chat = await client.get(f"/assistant/chat/{body['chat_id']}")
    assert chat.status_code == 200, chat.text
    assert chat.headers["content-type"] == "application/json"
    streamed_input, streamed_output = frames[1]["data"]["input"], frames[2]["data"]["output"]
    assert exact(streamed_output) == exact({"rows": [row], "count": 1}) and exact(
        streamed_input
    ) == exact(tool_input)
    messages = chat.json()["messages"]
    tool_message = next(m for m in messages if m["role"] == "tool")
    assert exact(tool_message["content"]) == exact(streamed_output)
    assistant = next(m for m in messages if m["role"] == "assistant" and m["thinking"])
    call = assistant["thinking"]["tool_calls"][0]
    assert exact(call["input"]) == exact(streamed_input)
    assert call["input"]["parameters"]["zeta"] == BIG and isinstance(
        call["input"]["parameters"]["alpha"], float
    )
    assert list(call) == ["id", "name", "input"]  # as stored, not sorted
    assert (
        tool_message["thinking"]["tool_call_id"] == call["id"] == frames[1]["data"]["tool_call_id"]
    )
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == "ok"


QUESTIONS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "ask_user_yes_no": (
        {
            "message": "Déployer « api » en production ? 🚀\nLigne 2",
            "yes_label": "Oui, déployer",
            "no_label": 'Non "merci"',
        },
        ["kind", "request_id", "message", "required", "yes_label", "no_label"],
    ),
    "ask_user_free_text": (
        {"message": "Which row id?", "placeholder": "e.g. 42", "min_length": 1, "max_length": BIG},
        [
            "kind",
            "request_id",
            "message",
            "required",
            "placeholder",
            "multiline",
            "min_length",
            "max_length",
        ],
    ),
}


@pytest.mark.parametrize("tool", list(QUESTIONS))
async def test_the_pending_question_in_get_chat_is_the_user_input_request_frame_exactly(
    services, tool
):
    question, keys = QUESTIONS[tool]
    async with services.client() as client:
        body, frames = await run_turn(
            client, {"say": "One question.", "tool": tool, "input": question}, {"say": "done"}
        )
        assert types(frames)[-2:] == ["user_input_request", "interrupted"], frames
        request = frames[-2]["data"]
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        listed = (await client.get("/assistant/chats")).json()["items"]
    assert list(request) == keys  # the order the question was built in (a Struct sorted them)
    assert request["message"] == question["message"].strip()
    if tool == "ask_user_free_text":
        assert request["max_length"] == BIG and isinstance(request["max_length"], int)
    else:
        assert (request["yes_label"], request["no_label"]) == (
            question["yes_label"],
            question["no_label"],
        )
    assert exact(chat["pending_user_input_request"]) == exact(request)
    assert (
        next(c for c in listed if c["id"] == body["chat_id"])["is_running"] is False
    )  # awaiting input, not running


async def test_a_resume_answers_provider_details_reach_the_thread_exactly(services):
    question = {"integration": "postgresql", "message": "I need database access"}
    details = {"id": BIG, "ratio": 1.0, "code": "28P01"}
    answer = {
        "kind": "credential_failed",
        "integration_name": "postgresql",
        "auth_type": "api_key",
        "error_code": "invalid_credentials",
        "error_message": "password authentication failed",
        "retryable": False,
        "provider_details": details,
    }
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "One question.", "tool": "request_credential", "input": question},
            {"say": "Understood."},
        )
        assert types(frames)[-2:] == ["user_input_request", "interrupted"], frames
        request_id = frames[-1]["data"]["request_id"]
        resumed = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request_id, "response": answer, "llm": SCRIPTED},
        )
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
        assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "Understood."
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
    async with services.orchestrator.servicer.sessions() as session:
        interrupt = await session.get(Interrupt, request_id)
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
    assert interrupt.outcome == "answered"
    assert exact(interrupt.response) == exact(answer)
    stored = tool_rows[-1].content["answer"]["provider_details"]
    assert (
        exact(stored) == exact(details)
        and stored["id"] == BIG
        and isinstance(stored["ratio"], float)
    )
    shown = next(m for m in reversed(chat["messages"]) if m["role"] == "tool")["content"]
    assert exact(shown["answer"]["provider_details"]) == exact(details)


# ---------------------------------------------------------------- a service of an older version


async def test_a_resume_still_reaches_an_orchestrator_of_an_older_version(services, monkeypatch):
    import services.orchestrator.servicer.interrupts as interrupts

    # an orchestrator that knows only `response` (the Struct): the gateway sends it beside
    # `response_json`
    older = pytypes.SimpleNamespace(
        **{name: getattr(pb, name) for name in dir(pb) if not name.startswith("__")}
    )
    older.object_of = lambda message, name: pb.from_struct(getattr(message, name))
    monkeypatch.setattr(interrupts, "pb", older)
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "One question.", "tool": "ask_user_yes_no", "input": {"message": "ok?"}},
            {"say": "fine"},
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
    assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "fine"


def test_readers_take_the_json_text_when_set_else_an_older_versions_struct_or_value():
    older = {"b": 2, "a": [1.5, None, "x"]}  # what a Struct gives back: keys sorted
    # GetChat of an older orchestrator: Struct and Value only
    message = assistant_pb2.ChatMessage(
        content=pb.to_value(older), thinking=pb.to_struct({"tool_call_id": "c1"})
    )
    chat = assistant_pb2.Chat(
        pending_user_input_request=pb.to_struct({"kind": "yes_no", "request_id": "r1"})
    )
    assert pb.field_fragment(message, "content") == {"a": [1.5, None, "x"], "b": 2}
    assert pb.field_fragment(message, "thinking") == {"tool_call_id": "c1"}
    assert pb.field_fragment(chat, "pending_user_input_request") == {
        "kind": "yes_no",
        "request_id": "r1",
    }
    assert pb.field_fragment(assistant_pb2.ChatMessage(), "content") is None
    assert pb.field_fragment(assistant_pb2.ChatMessage(), "thinking") is None
    assert pb.field_fragment(assistant_pb2.Chat(), "pending_user_input_request") is None
    assert _pending(chat) and _pending(
        assistant_pb2.Chat(pending_user_input_request_json=b'{"kind":"yes_no"}')
    )
    assert not _pending(assistant_pb2.Chat())
    # the JSON text wins, written into the body as it is
    newer = assistant_pb2.ChatMessage(
        content=pb.to_value(older), content_json=b'{"z":9007199254740993,"y":1.0}'
    )
    assert (
        orjson.dumps({"content": pb.field_fragment(newer, "content")})
        == b'{"content":{"z":9007199254740993,"y":1.0}}'
    )
    # the user_input_request frame of an older event
    ts = timestamp_pb2.Timestamp(seconds=1_780_000_000)
    event = events_pb2.Event(
        run_id="run",
        time=ts,
        user_input_request=events_pb2.UserInputRequestEvent(
            request=pb.to_struct({"request_id": "r1", "kind": "yes_no", "message": "ok?"})
        ),
    )
    assert sse.render(event) == {
        "type": "user_input_request",
        "data": {"kind": "yes_no", "message": "ok?", "request_id": "r1"},
    }
    event.user_input_request.request_json = (
        b'{"request_id":"r1","kind":"yes_no","max":9007199254740993}'
    )
    assert (
        sse.encode(event) == b'data: {"type":"user_input_request","data":'
        b'{"request_id":"r1","kind":"yes_no","max":9007199254740993}}\n\n'
    )
    # Resume from a gateway of an older version: the answer as a Struct
    answer = {"kind": "skipped", "reason": "later"}
    assert (
        pb.object_of(assistant_pb2.ResumeRequest(response=pb.to_struct(answer)), "response")
        == answer
    )
    assert pb.object_of(
        assistant_pb2.ResumeRequest(
            response_json=b'{"kind":"credential_failed","provider_details":{"id":9007199254740993}}'
        ),
        "response",
    ) == {"kind": "credential_failed", "provider_details": {"id": BIG}}
    for bad in (
        b"{nope",
        b"[1]",
        b"null",
        b"\xff\xfe",
    ):  # set but not an object: refused, never replaced by the Struct
        with pytest.raises(pb.NotAnObject):
            pb.object_of(
                assistant_pb2.ResumeRequest(response=pb.to_struct(answer), response_json=bad),
                "response",
            )
    assert pb.object_of(assistant_pb2.ResumeRequest(), "response") == {}
