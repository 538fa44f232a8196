"""A local OpenAI-compatible model server that streams answers at a set pace: `python -m
bench.fake_provider --port P`.

The streamed workloads run turns through the orchestrator's real provider code path (the
official `openai` SDK) against this server. The last user message sets the pace:
`{"chunks": N, "interval_ms": I, "sleep_ms": S}` waits S ms, then streams N text deltas I ms
apart on an absolute schedule (no drift). With `"gate": {"id": G, "count": C}` a call first waits
until C calls of gate G are waiting (at most GATE_WAIT_S), so that C runs are in flight at once.
Each delta's text is its production time, `"<time.time_ns()>;"`, so a listener can measure each
frame's delay from the model to its socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import orjson

GATE_WAIT_S = 900.0
_gates: dict[str, tuple[list[int], asyncio.Event]] = {}

_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n"
)


def _chunk(payload: dict[str, Any]) -> bytes:
    """One SSE event as one HTTP chunk."""
    event = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _delta(content: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stream",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _asked(body: dict[str, Any]) -> dict[str, Any]:
    """The pace the last user message asks for ({} when it is no JSON object)."""
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    try:
        asked = orjson.loads(users[-1]["content"]) if users else {}
    except (orjson.JSONDecodeError, TypeError):
        asked = {}
    return asked if isinstance(asked, dict) else {}


async def _pass_gate(gate: dict[str, Any]) -> None:
    """Wait until `gate["count"]` calls of gate `gate["id"]` are waiting."""
    waiting, opened = _gates.setdefault(str(gate["id"]), ([0], asyncio.Event()))
    waiting[0] += 1
    if waiting[0] >= int(gate["count"]):
        opened.set()
    await asyncio.wait_for(opened.wait(), GATE_WAIT_S)


async def _answer(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    asked = _asked(body)
    chunks = max(1, int(asked.get("chunks", 10)))
    interval = float(asked.get("interval_ms", 0)) / 1000
    sleep = float(asked.get("sleep_ms", 0)) / 1000
    if isinstance(asked.get("gate"), dict):
        await _pass_gate(asked["gate"])
    if sleep:
        await asyncio.sleep(sleep)
    writer.write(_HEAD)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for index in range(chunks):
        due = start + index * interval
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        writer.write(_chunk(_delta(f"{time.time_ns()};")))
        await writer.drain()
    writer.write(_chunk(_delta(None, "stop")))
    usage = {"prompt_tokens": 10, "completion_tokens": chunks, "total_tokens": 10 + chunks}
    writer.write(_chunk({**_delta(None), "choices": [], "usage": usage}))
    writer.write(_chunk_done())
    await writer.drain()


def _chunk_done() -> bytes:
    event = b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer requests on one keep-alive connection until the client closes it."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            body = orjson.loads(await reader.readexactly(length)) if length else {}
            await _answer(writer, body)
    writer.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port, backlog=4096, limit=1 << 22)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    try:
        import uvloop

        uvloop.run(_main(port))
    except ImportError:
        asyncio.run(_main(port))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
