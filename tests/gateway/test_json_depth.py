"""Request bodies nested deeper than pb.MAX_JSON_DEPTH are 400 naming the limit, never 500 (tester).

Python protobuf decodes at most 100 message levels and a JSON level inside a Struct costs 3,
so a body the gateway encoded fine (credential `metadata` 34 levels deep, a resume `response`
holding a 60-deep `reason`) failed to decode in the tools service or the orchestrator and was
a 500. The check is in `services.gateway.app.json_object`, which every JSON route reads through.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.common import pb
from tests.orchestrator.helpers import run_turn
from tests.tools.tools_stack import tools_stack

LIMIT_TEXT = f"nested deeper than {pb.MAX_JSON_DEPTH} levels"


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` ({"a": {"a": ... leaf}})."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.fixture
async def stack(tmp_path):
    async with tools_stack(tmp_path) as running:
        yield running


def _is_depth_400(response) -> bool:
    return response.status_code == 400 and LIMIT_TEXT in response.json()["detail"]


@pytest.mark.parametrize("levels", [pb.MAX_JSON_DEPTH, 34, 60])
async def test_credential_metadata_nested_too_deep_is_400_naming_the_limit(stack, levels):
    body = {
        "integration_name": "http",
        "auth_type": "bearer",
        "auth_data": {"token": "t0ken-123"},
        "metadata": deep(levels),
    }
    async with stack.client() as client:
        response = await client.post("/credentials", json=body)
        assert _is_depth_400(response), (response.status_code, response.text)
        assert (await client.get("/credentials")).json()["total"] == 0


async def test_credential_metadata_at_the_limit_round_trips(stack):
    metadata = deep(pb.MAX_JSON_DEPTH - 1)  # the body is one level more: exactly the limit
    async with stack.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer",
                "auth_data": {"token": "t0ken-123"},
                "metadata": metadata,
            },
        )
        assert created.status_code == 201, created.text
        assert created.json()["credentials_metadata"] == metadata
        listing = await client.get("/credentials")
        assert (
            listing.status_code == 200
            and listing.json()["credentials"][0]["credentials_metadata"] == metadata
        )
        one = await client.get(f"/credentials/{created.json()['credential_id']}")
        assert one.status_code == 200 and one.json()["credentials_metadata"] == metadata


async def _paused_chat(client) -> tuple[str, str]:
    body, frames = await run_turn(
        client, {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}}, {"say": "Thanks."}
    )
    assert frames[-1]["type"] == "interrupted", frames
    return body["chat_id"], frames[-1]["data"]["request_id"]


async def test_resume_with_a_deep_answer_or_unknown_field_is_400_and_the_question_stays_pending(
    stack,
):
    async with stack.client() as client:
        chat_id, request_id = await _paused_chat(client)
        url = f"/assistant/chat/{chat_id}/resume"
        for body in (
            {"request_id": request_id, "response": {"kind": "skipped", "reason": deep(60)}},
            {
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True},
                "extra": deep(60),
            },
            {
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True, "extra": deep(60)},
            },
        ):
            response = await client.post(url, json=body)
            assert _is_depth_400(response), (response.status_code, response.text)
        status = (await client.get(f"/assistant/chat/{chat_id}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id
        answered = await client.post(
            url, json={"request_id": request_id, "response": {"kind": "skipped", "reason": "later"}}
        )
        assert answered.status_code == 200, answered.text


async def test_turn_and_settings_bodies_nested_too_deep_are_400(stack):
    async with stack.client() as client:
        for path, body in (
            ("/assistant/chat", {"message": "hi", "llm": deep(60)}),
            ("/assistant/chat", {"message": "hi", "extra": deep(pb.MAX_JSON_DEPTH)}),
            ("/knowledge-bases", {"name": "kb", "extra": deep(60)}),
        ):
            response = await client.post(path, json=body)
            assert _is_depth_400(response), (path, response.status_code, response.text)
        put = await client.put("/organizations/settings/composer-llm", json={"llm": deep(60)})
        assert _is_depth_400(put), (put.status_code, put.text)


async def test_a_body_nested_past_the_json_parsers_own_limit_is_the_depth_400_not_invalid_json(
    stack,
):
    # orjson refuses past 1,024 levels ("depth limit exceeded"); such a body is valid JSON and
    # must not be answered "Request body is not valid JSON (UTF-8, no lone surrogates)"
    arrays = b"[" * 10000 + b"1" + b"]" * 10000
    in_a_field = b'{"message": "hi", "extra": ' + b'{"a": ' * 2000 + b'"x"' + b"}" * 2000 + b"}"
    async with stack.client() as client:
        for path, raw in (
            ("/assistant/chat", arrays),
            ("/assistant/chat", in_a_field),
            ("/knowledge-bases", in_a_field),
            ("/credentials", arrays),
        ):
            response = await client.post(
                path, content=raw, headers={"Content-Type": "application/json"}
            )
            assert _is_depth_400(response), (path, response.status_code, response.text)
        not_json = await client.post(
            "/knowledge-bases",
            content=b'{"name": "kb", ',
            headers={"Content-Type": "application/json"},
        )
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["detail"]
