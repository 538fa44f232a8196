"""A whole turn through the public HTTP API with the scripted model."""

from __future__ import annotations

from tests.conftest import SCRIPTED, script
from tests.sse_client import read_frames


async def test_turn_without_script_calls_get_available_integrations(services):
    async with services.client() as client:
        started = await client.post(
            "/assistant/chat", json={"message": "What integrations are available?"}
        )
        assert started.status_code == 200, started.text
        body = started.json()
        assert body["status"] == "running"
        assert body["thread_id"] == body["chat_id"]
        assert body["stream_url"] == f"/assistant/chat/{body['chat_id']}/listen/{body['run_id']}"
        frames = await read_frames(client, body["stream_url"])
    types = [f["type"] for f in frames]
    assert types[0] == "metadata"
    assert types[-1] == "done"
    assert "tool_call" in types and "tool_result" in types
    call = frames[types.index("tool_call")]["data"]
    assert call["tool"] == "get_available_integrations"
    result = frames[types.index("tool_result")]["data"]
    assert result["tool_call_id"] == call["tool_call_id"]
    done = frames[-1]["data"]
    assert set(done) == {"response", "has_workflow_changes", "tool_calls", "workflow_tool", "usage"}
    assert done["has_workflow_changes"] is False and done["workflow_tool"] is None
    assert done["tool_calls"][0]["tool"] == "get_available_integrations"
    assert done["usage"]["llm_calls"] == 2
    assert "integrations are available" in done["response"]


async def test_scripted_turn_frames_in_documented_order(services):
    message = script(
        {
            "say": "Let me check your integrations.",
            "tool": "get_available_integrations",
            "input": {},
        },
        {
            "say": "Here is the final answer in several chunks.",
            "usage": {"input_tokens": 1200, "output_tokens": 340},
        },
    )
    async with services.client() as client:
        body = (
            await client.post("/assistant/chat", json={"message": message, "llm": SCRIPTED})
        ).json()
        frames = await read_frames(client, body["stream_url"])
        late = await read_frames(client, body["stream_url"])
    types = [f["type"] for f in frames]
    first_call = types.index("tool_call")
    assert types[0] == "metadata"
    assert set(types[1:first_call]) == {"response_chunk"}
    assert types[first_call + 1] == "tool_result"
    assert (
        set(types[first_call + 2 : -1]) == {"response_chunk"}
        and len(types[first_call + 2 : -1]) > 1
    )
    assert types[-1] == "done"
    assert (
        "".join(f["data"]["chunk"] for f in frames[first_call + 2 : -1])
        == "Here is the final answer in several chunks."
    )
    assert (
        frames[0]["data"]["workflow_id"] is None
        and frames[0]["data"]["workflow_type"] == "composer"
    )
    assert late == frames
