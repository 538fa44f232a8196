"""The README's examples: each script in examples/ is one the scripted model runs, and each
capability's example gives the outcome the README shows when it goes through the four services."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from services.orchestrator.hitl import TOOL_DEFINITIONS as QUESTION_TOOLS
from services.orchestrator.providers.scripted import ScriptedModel
from services.tools.catalogue import Catalogue
from services.tools.tool_definitions import TOOL_DEFINITIONS as TOOLS_SERVICE_TOOLS
from tests.conftest import SCRIPTED, Stack, start_stack, stop_stack
from tests.sse_client import read_frames
from tests.tools.fake_apis import github_app, make_test_ca
from tests.tools.tools_stack import serve_asgi

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.json"))
ASSISTANT_TOOLS = {d["name"] for d in [*TOOLS_SERVICE_TOOLS, *QUESTION_TOOLS]}

# The operator's stdio MCP server of the README's MCP example (mcp-server-time, a dev extra).
TIME_SERVER = json.dumps(
    [
        {
            "name": "time",
            "command": sys.executable,
            "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"],
        }
    ]
)


def message(name: str) -> str:
    """The user message of an example: the file's text, as the README's `jq -Rs` sends it."""
    return (EXAMPLES / name).read_text()


async def _no_text(_chunk: str) -> None:
    return None


def test_the_readme_runs_every_example_script():
    readme = (ROOT / "README.md").read_text()
    assert SCRIPTS, "examples/ holds no script"
    assert [p.name for p in SCRIPTS if f"examples/{p.name}" not in readme] == []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
async def test_each_example_script_is_taken_step_by_step_by_the_scripted_model(path):
    text = path.read_text()
    steps = json.loads(text)["script"]
    model = ScriptedModel()
    history: list[dict[str, Any]] = [{"role": "user", "content": text}]
    for index, step in enumerate(steps):
        reply = await model.generate(history, [], _no_text)
        assert reply.text == step.get("say", ""), index
        called = [call.name for call in reply.tool_calls]
        assert called == ([step["tool"]] if "tool" in step else []), index
        assert set(called) <= ASSISTANT_TOOLS, called
        history.append({"role": "assistant", "content": reply.text})
    assert steps[-1].keys() == {"say"}, "an example ends with the model's answer"


def test_the_readme_lists_every_tool_and_the_integrations_page_every_built_in_action():
    readme = (ROOT / "README.md").read_text()
    missing = [f"`{name}`" for name in ASSISTANT_TOOLS if f"`{name}`" not in readme]
    page = (ROOT / "docs" / "integrations.md").read_text()
    for integration in Catalogue.builtin().all():
        missing += [f"`{a}`" for a in integration.actions if f"`{a}`" not in page]
        if f"`{integration.name}`" not in readme + page:
            missing.append(f"`{integration.name}`")
    assert missing == []


@asynccontextmanager
async def _stack(tmp_path, **tools: Any) -> AsyncIterator[Stack]:
    running = await start_stack(tmp_path, tools=tools or None)
    try:
        yield running
    finally:
        await stop_stack(running)


async def _turn(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    response = await client.post(
        "/assistant/chat", json={"message": message(name), "llm": SCRIPTED}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _types(frames: list[dict[str, Any]]) -> list[str]:
    return [frame["type"] for frame in frames]


def _results(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [frame["data"] for frame in frames if frame["type"] == "tool_result"]


async def test_first_turn_example_discovers_then_runs_a_built_in_action(tmp_path):
    async with _stack(tmp_path) as stack, stack.client() as client:
        turn = await _turn(client, "first-turn.json")
        frames = await read_frames(client, turn["stream_url"])
    discovered, now = _results(frames)
    assert "loopline" in [i["name"] for i in discovered["output"]["integrations"]]
    assert now["output"]["integration"] == "loopline" and now["output"]["result"]
    assert _types(frames)[0] == "metadata" and frames[-1]["type"] == "done"
    assert frames[-1]["data"]["response"].startswith("Done:")
    assert frames[-1]["data"]["usage"]["llm_calls"] == 3


async def test_question_example_pauses_and_resumes_with_the_answer(tmp_path):
    async with _stack(tmp_path) as stack, stack.client() as client:
        turn = await _turn(client, "question.json")
        frames = await read_frames(client, turn["stream_url"])
        assert _types(frames)[-2:] == ["user_input_request", "interrupted"]
        question = frames[-2]["data"]
        assert question["kind"] == "yes_no"
        resumed = await client.post(
            f"/assistant/chat/{turn['chat_id']}/resume",
            json={
                "request_id": question["request_id"],
                "response": {"kind": "yes_no", "answer": True},
            },
        )
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
    assert rest[0]["type"] == "metadata" and rest[-1]["type"] == "done"
    assert rest[-1]["data"]["response"] == "Thanks, noted: the report goes out now."


async def test_cancel_example_ends_the_turn_cancelled_during_its_tool_call(tmp_path):
    async with _stack(tmp_path) as stack, stack.client() as client:
        turn = await _turn(client, "cancel.json")
        listening = asyncio.create_task(read_frames(client, turn["stream_url"]))
        status: dict[str, Any] = {}
        for _ in range(100):  # the tool call starts within a few ms of the POST
            status = (await client.get(f"/assistant/chat/{turn['chat_id']}/status")).json()
            if status["is_running"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        cancelled = await client.post(f"/assistant/chat/{turn['chat_id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        frames = await asyncio.wait_for(listening, 10)
    assert "tool_call" in _types(frames) and frames[-1]["type"] == "cancelled"
    assert _results(frames)[-1]["output"]["error"] == "cancelled"


async def test_knowledge_example_finds_the_uploaded_passage(tmp_path):
    async with _stack(tmp_path) as stack, stack.client() as client:
        base = await client.post("/knowledge-bases", json={"name": "Handbook"})
        assert base.status_code == 201, base.text
        document = await client.post(
            f"/knowledge-bases/{base.json()['id']}/documents",
            files={"file": ("handbook.md", message("handbook.md").encode())},
        )
        # found by its words at once; embedded in the background
        assert document.status_code == 201 and document.json()["status"] == "processing"
        turn = await _turn(client, "knowledge.json")
        frames = await read_frames(client, turn["stream_url"])
    (search,) = _results(frames)
    assert search["tool"] == "search_knowledge"
    assert "30 days" in search["output"]["results"][0]["content"]
    assert frames[-1]["type"] == "done"


async def test_mcp_example_calls_the_operators_time_server(tmp_path):
    async with (
        _stack(tmp_path, tools_mcp_stdio_servers=TIME_SERVER) as stack,
        stack.client() as client,
    ):
        turn = await _turn(client, "mcp.json")
        frames = await read_frames(client, turn["stream_url"])
    details, called = _results(frames)
    assert "get_current_time" in [a["name"] for a in details["output"]["actions"]]
    # an MCP tool's effects are unknown: shown as possibly changing something, never as a read
    assert {tuple(a["effects"]) for a in details["output"]["actions"]} == {("update",)}
    assert called["output"]["result"]["structured_content"]["timezone"] == "Europe/Paris"
    assert frames[-1]["type"] == "done"


async def test_github_example_runs_a_catalogue_action_with_the_stored_token(tmp_path, monkeypatch):
    seen: list[dict[str, Any]] = []
    ca, cert, key = make_test_ca(tmp_path, ["api.github.com"])
    monkeypatch.setenv("SSL_CERT_FILE", ca)  # the fake GitHub's CA, for the integration worker
    async with serve_asgi(github_app(seen, "ghp_example"), tls=(cert, key)) as github:
        hosts = json.dumps({"api.github.com": urlsplit(github).netloc})
        async with (
            _stack(
                tmp_path, tools_integration_hosts=hosts, tools_allow_private_network=True
            ) as stack,
            stack.client() as client,
        ):
            created = await client.post(
                "/credentials",
                json={"integration_name": "github", "auth_data": {"token": "ghp_example"}},
            )
            assert created.status_code == 201 and created.json()["auth_type"] == "bearer"
            turn = await _turn(client, "github.json")
            frames = await read_frames(client, turn["stream_url"])
    (called,) = _results(frames)
    assert called["output"]["result"]["repository"]["full_name"] == "octocat/Hello-World"
    assert seen[0]["authorization"] == "Bearer ghp_example"
    assert frames[-1]["type"] == "done"
