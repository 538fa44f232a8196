"""End to end over the real processes: the official SDK and the raw bytes of the stream."""

from __future__ import annotations

import json
import re

import httpx
from modulex import Modulex

EXPECTED_KEYS = {
    "metadata": {"run_id", "thread_id", "workflow_id", "workflow_type", "timestamp"},
    "response_chunk": {"chunk"},
    "tool_call": {"tool", "input", "tool_call_id", "timestamp"},
    "tool_result": {"tool", "tool_call_id", "output", "timestamp"},
    "done": {"response", "has_workflow_changes", "tool_calls", "workflow_tool", "usage"},
}


async def test_sdk_drives_a_turn_with_a_tool_call(deployment):
    client = Modulex(
        api_key=deployment.api_key, organization_id=deployment.org_id, base_url=deployment.base_url
    )
    try:
        started = await client.assistant.chat("Which integrations can I use?")
        assert started.status == "running" and started.thread_id == started.chat_id
        assert started.chat_id is not None and started.run_id is not None
        events = []
        async with client.assistant.listen(started.chat_id, started.run_id) as stream:
            async for event in stream:
                events.append(event)
    finally:
        await client.close() if hasattr(client, "close") else None
    names = [e.event for e in events]
    assert names[0] == "metadata" and names[-1] == "done"
    call_at = names.index("tool_call")
    assert names[call_at + 1] == "tool_result"
    assert "response_chunk" in names[1:call_at] and "response_chunk" in names[call_at + 2 : -1]
    for event in events:
        assert set(event.data["data"]) == EXPECTED_KEYS[event.event], event.data
    assert events[call_at].data["data"]["tool"] == "get_available_integrations"
    assert events[-1].data["data"]["usage"]["llm_calls"] == 2


async def test_raw_stream_frames_are_exactly_data_json(deployment):
    message = json.dumps(
        {
            "script": [
                {
                    "say": "Checking.",
                    "tool": "get_available_integrations",
                    "input": {},
                    "sleep_ms": 1500,
                },
                {"say": "All done here."},
            ]
        }
    )
    async with httpx.AsyncClient(
        base_url=deployment.base_url, headers=deployment.headers(), timeout=30
    ) as client:
        body = (await client.post("/assistant/chat", json={"message": message})).json()
        raw = b""
        async with client.stream("GET", body["stream_url"]) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for chunk in response.aiter_raw():
                raw += chunk
    assert b"event:" not in raw
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    for frame in frames[:-1]:
        assert re.fullmatch(rb"data: \{.*\}", frame, re.DOTALL), frame
        assert b"\n" not in frame
        json.loads(frame[6:])
    types = [json.loads(f[6:])["type"] for f in frames[:-1]]
    assert "heartbeat" in types  # 1.5 s model wait with a 1 s heartbeat interval
    assert [t for t in types if t != "heartbeat"][-1] == "done"
    assert types[-1] == "done"
