"""JSON nested past what a parser recurses through is read, never a crash: one parametrized test
over the layers that parse JSON from outside.

json.loads raises RecursionError at about 1,000 levels and orjson refuses past 1,024. A model's
tool-call arguments, a scripted model's script, a request body, an HTTP or OAuth2 API's answer
and an uploaded JSON document may be nested that deep: each ends as the depth rule's error
result, the depth 400 or the text itself (services/common/pb.py, providers/base.loads_deep).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.orchestrator.providers.anthropic_provider import AnthropicModel
from services.orchestrator.providers.base import DEEP_JSON_KEPT_LEVELS, loads_deep, parse_arguments
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.tool_calls import checked_call
from tests.common.layers import Case, Fixtures, at_once, on_services
from tests.conftest import Stack
from tests.orchestrator.helpers import types
from tests.orchestrator.providers.fakes import (
    FakeLLMServer,
    Reply,
    anthropic_end,
    anthropic_start,
    anthropic_tool_block,
    openai_text,
    openai_tool_call,
    openai_turn,
)
from tests.orchestrator.providers.test_unreadable_arguments import FAST, TOOLS
from tests.tools.tools_stack import tools_stack

USER = [{"role": "user", "content": "hello"}]
LEVELS = 5000
LIMIT_TEXT = f"nested deeper than {pb.MAX_JSON_DEPTH} levels"


def deep_text(levels: int, leaf: str = '"x"') -> str:
    """The JSON text of `levels` objects nested around `leaf` ({"a": {"a": ... leaf}}), built as
    text (json.dumps recurses)."""
    return '{"a": ' * levels + leaf + "}" * levels


def deep_json_text(levels: int, leaf: str) -> str:
    """`levels` arrays nested around the JSON text `leaf`, built as text."""
    return "[" * levels + leaf + "]" * levels


async def _noop(_chunk: str) -> None:
    return None


def _check_too_deep_input(value: dict) -> None:
    """`value` is the deep arguments read back: real objects to DEEP_JSON_KEPT_LEVELS, then the
    rest as JSON text."""
    assert pb.json_depth(value) == DEEP_JSON_KEPT_LEVELS
    inner = value
    for _ in range(DEEP_JSON_KEPT_LEVELS - 1):
        inner = inner["a"]
    assert inner["a"] == deep_text(LEVELS - DEEP_JSON_KEPT_LEVELS)


# --- The model's tool calls (orchestrator/providers) -----------------------------------------


def _loads_deep_reads_it_and_refuses_what_is_not_json() -> None:
    with pytest.raises(RecursionError):
        json.loads(deep_text(LEVELS))
    _check_too_deep_input(loads_deep(deep_text(LEVELS)))
    text = (
        '{"s": "[[[{{{", "n": [1, 2.5, null, true], "deep": '
        + deep_text(LEVELS, '"br]ack\\"et}"')
        + "}"
    )
    value = loads_deep(text)
    assert value["s"] == "[[[{{{" and value["n"] == [
        1,
        2.5,
        None,
        True,
    ]  # brackets inside strings do not count
    inner = value["deep"]
    while isinstance(inner, dict):
        inner = inner["a"]
    assert inner == deep_text(LEVELS - DEEP_JSON_KEPT_LEVELS + 1, '"br]ack\\"et}"')
    assert loads_deep('{"a": [1, {"b": "c"}]}') == {"a": [1, {"b": "c"}]}
    for not_json in ("[" * LEVELS, "[" * LEVELS + '"open', deep_text(LEVELS)[:-1], '{"a": 1', "]]"):
        with pytest.raises(ValueError):
            loads_deep(not_json)


def _arguments_are_the_calls_error_result() -> None:
    value, unreadable = parse_arguments(deep_text(LEVELS))
    assert unreadable == ""
    _check_too_deep_input(value)
    from services.orchestrator.providers.base import ToolCallRequest

    call, struct, error = checked_call(
        ToolCallRequest(id="call_1", name="get_available_integrations", input=value)
    )
    assert error is not None and f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in error
    assert pb.json_depth(call.input) == pb.MAX_JSON_DEPTH and pb.from_struct(struct) == call.input


async def _openai_tool_call_arguments(fixtures: Fixtures) -> None:
    events = openai_tool_call("get_available_integrations", deep_text(LEVELS), splits=3)
    async with FakeLLMServer([Reply(events=events)]) as server:
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test-SECRET123456",
            policy=FAST,
            timeout_s=5,
        )
        reply = await model.generate(USER, TOOLS, _noop)
    assert [c.name for c in reply.tool_calls] == ["get_available_integrations"]
    _check_too_deep_input(reply.tool_calls[0].input)


async def _anthropic_tool_use_input(fixtures: Fixtures) -> None:
    events = [
        anthropic_start(),
        *anthropic_tool_block(0, "get_available_integrations", deep_text(LEVELS)),
        *anthropic_end(12, "tool_use"),
    ]
    async with FakeLLMServer([Reply(events=events)]) as server:
        model = AnthropicModel(
            "claude-test",
            base_url=server.url,
            api_key="sk-ant-api03-SECRET123456",
            policy=FAST,
            max_tokens=256,
            timeout_s=5,
        )
        reply = await model.generate(USER, TOOLS, _noop)
    assert [c.name for c in reply.tool_calls] == ["get_available_integrations"]
    _check_too_deep_input(reply.tool_calls[0].input)


async def _a_turn_whose_model_sends_them(fixtures: Fixtures) -> None:
    """The turn goes on with the call's error result."""
    tmp_path = fixtures.tmp_path
    replies = [
        Reply(
            events=openai_tool_call(
                "get_available_integrations", deep_text(LEVELS), call_id="call_deep"
            )
        ),
        Reply(events=openai_text("Sorry, ", "flatter next time.")),
    ]
    frames, server = await openai_turn(tmp_path, replies, "Which integrations?")
    assert types(frames) == [
        "metadata",
        "tool_call",
        "tool_result",
        "response_chunk",
        "response_chunk",
        "done",
    ], frames
    assert pb.json_depth(frames[1]["data"]["input"]) == pb.MAX_JSON_DEPTH
    output = frames[2]["data"]["output"]
    assert (
        output["success"] is False
        and f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in output["error"]
    )
    assert frames[-1]["data"]["response"] == "Sorry, flatter next time." and not frames[-1][
        "data"
    ].get("error")
    tool = next(m for m in server.requests[1].body["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_deep" and "nested deeper" in tool["content"]


async def run_turn_message(client, message: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A turn whose user message is `message` as given (a script too deep for json.dumps)."""
    from tests.orchestrator.helpers import start
    from tests.sse_client import read_frames

    body = await start(client, message=message)
    return body, await read_frames(client, body["stream_url"])


async def _a_scripted_models_tool_input(services: Stack) -> None:
    message = (
        '{"script": [{"tool": "execute_integration_tool", "input": {"integration": "loopline", '
        '"action": "echo", "parameters": {"message": "hi", "deep": '
        + deep_text(990)
        + '}}}, {"say": "ok"}]}'
    )
    async with services.client() as client:
        body, frames = await run_turn_message(client, message)
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        call, result = frames[1]["data"], frames[2]["data"]["output"]
        assert pb.json_depth(call["input"]) == pb.MAX_JSON_DEPTH
        assert result["success"] is False and result["error"].startswith(
            "Invalid input for execute_integration_tool"
        )
        assert f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in result["error"]
        assert frames[-1]["data"]["response"] == "ok" and not frames[-1]["data"].get("error")
        chat = await client.get(f"/assistant/chat/{body['chat_id']}")
        assert chat.status_code == 200, chat.text


# --- Request bodies (gateway) ---------------------------------------------------------------


def _is_depth_400(response) -> bool:
    return response.status_code == 400 and LIMIT_TEXT in response.json()["detail"]


async def _a_request_body_is_the_depth_400_not_invalid_json(services: Stack) -> None:
    arrays = b"[" * 10000 + b"1" + b"]" * 10000
    in_a_field = b'{"message": "hi", "extra": ' + b'{"a": ' * 2000 + b'"x"' + b"}" * 2000 + b"}"
    async with services.client() as client:
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


# --- What the tools service reads (tools) ---------------------------------------------------


async def _an_http_answer_comes_back_as_text(fixtures: Fixtures) -> None:
    start_tools, local_http = fixtures.start_tools, fixtures.local_http
    tools = await start_tools(tools_allow_private_network=True)
    result = await tools.ok(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deeper"}},
    )
    assert "json" not in result["result"] and result["result"]["body"].startswith("[[[")


def _a_json_document_is_extracted_as_its_text() -> None:
    from services.tools.extract import ExtractionError, extract_text

    assert (
        extract_text(deep_json_text(500, '"zeppelin"').encode(), "json").count("zeppelin") == 1
    )  # re-indented as before
    raw = deep_json_text(5000, '{"note": "zeppelin airship"}')
    assert extract_text(raw.encode(), "json") == raw  # was RecursionError: "unhandled error", 500
    try:
        extract_text(b'{"a": [1, 2', "json")
        raise AssertionError("not JSON must stay an ExtractionError")
    except ExtractionError as exc:
        assert "does not parse" in str(exc)


async def _an_uploaded_json_document_is_indexed_as_its_text(fixtures: Fixtures) -> None:
    tmp_path = fixtures.tmp_path
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        kb = (
            await client.post("/knowledge-bases", json={"name": "Deep", "description": "deep json"})
        ).json()
        for levels in (1000, 5000):
            data = deep_json_text(levels, f'{{"word": "zeppelin{levels}"}}').encode()
            response = await client.post(
                f"/knowledge-bases/{kb['id']}/documents",
                files={"file": ("deep.json", data, "application/json")},
            )
            assert response.status_code == 201, (levels, response.status_code, response.text)
            assert response.json()["status"] == "processing" and response.json()["chunk_count"] >= 1
            found = (
                await client.post(
                    f"/knowledge-bases/{kb['id']}/search",
                    json={"query": f"zeppelin{levels}", "search_type": "keyword"},
                )
            ).json()
            assert (
                found["total_matches"] >= 1
                and found["matches"][0]["document_id"] == response.json()["id"]
            ), found


async def _oauth2_api_and_token_responses(fixtures: Fixtures) -> None:
    """An OAuth2 API's body nested past json.loads comes back as text (as the http integration's); a
    token endpoint answering such JSON is "did not issue a token", not an unhandled
    RecursionError."""
    monkeypatch, start_tools = fixtures.monkeypatch, fixtures.start_tools
    import grpc
    import httpx

    from services.common.errors import status_details
    from services.tools.oauth import integration_of
    from tests.tools.test_oauth_api_path import CTX, PROVIDER

    body = deep_json_text(5000, '"x"')
    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx,
        "AsyncClient",
        lambda **kw: real(
            transport=httpx.MockTransport(
                lambda request: httpx.Response(
                    200, text=body, headers={"Content-Type": "application/json"}
                )
            ),
            **kw,
        ),
    )
    assert await integration_of(PROVIDER, 5).actions["api_request"].handler(
        CTX, {"path": "/me"}
    ) == {"status": 200, "body": body}

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.tools.tools_stack import serve_asgi

    async def token(request: Any) -> Response:  # the token request goes through authlib (httpx2)
        return Response(body, media_type="application/json")

    async with serve_asgi(Starlette(routes=[Route("/token", token, methods=["POST"])])) as base:
        tools = await start_tools(
            tools_oauth2_integrations=json.dumps(
                [
                    {
                        "name": "acme",
                        "authorize_url": "https://auth.example/authorize",
                        "token_url": f"{base}/token",
                        "client_id": "loopline-client",
                        "api_base_url": "https://api.example",
                    }
                ]
            )
        )
        started = await tools.stub.InitiateOAuth2(
            tools_pb2.InitiateOAuth2Request(
                organization_id="org-a",
                integration_name="acme",
                redirect_uri="https://app.example/callback",
            )
        )
        try:
            await tools.stub.CompleteOAuth2(
                tools_pb2.CompleteOAuth2Request(state=started.state, code="code-1")
            )
            raise AssertionError("no token was issued")
        except grpc.aio.AioRpcError as error:
            details = status_details(error)
            assert (details.code, details.reason) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "OAUTH2_EXCHANGE_FAILED",
            ), details
            assert "status 200" in details.message


TOO_DEEP_TO_PARSE: dict[str, Case] = {
    "providers loads_deep": at_once(_loads_deep_reads_it_and_refuses_what_is_not_json),
    "provider arguments": at_once(_arguments_are_the_calls_error_result),
    "OpenAI tool call arguments": _openai_tool_call_arguments,
    "Anthropic tool use input": _anthropic_tool_use_input,
    "a turn whose model sends them": _a_turn_whose_model_sends_them,
    "scripted model tool input": on_services(_a_scripted_models_tool_input),
    "gateway request body": on_services(_a_request_body_is_the_depth_400_not_invalid_json),
    "tools http answer": _an_http_answer_comes_back_as_text,
    "tools JSON document extraction": at_once(_a_json_document_is_extracted_as_its_text),
    "knowledge upload": _an_uploaded_json_document_is_indexed_as_its_text,
    "tools OAuth2 answers": _oauth2_api_and_token_responses,
}


@pytest.mark.parametrize("layer", list(TOO_DEEP_TO_PARSE))
async def test_json_too_deep_for_the_parser_is_read_not_a_crash(layer, fixtures):
    await TOO_DEEP_TO_PARSE[layer](fixtures)
