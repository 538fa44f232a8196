"""A local HTTP/1.1 server that speaks the OpenAI and Anthropic streaming wire formats.

Each request consumes the next scripted `Reply` (the last one repeats). The server is a
raw asyncio socket server so that a test controls the bytes exactly: a stream can stop
halfway (connection closed mid-chunked-body), or hang until the client goes away (the
server records the disconnect, which is how a test sees that cancel closed the stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Self


@dataclass
class Reply:
    """One scripted response.

    Attributes:
        status: HTTP status.
        body: JSON body of a non-streaming (error) response.
        headers: extra response headers (e.g. Retry-After).
        events: SSE frames (already encoded text, each ending in a blank line) of a 200 stream.
        end: how a stream ends: "complete" (terminating chunk), "cut" (socket closed
            without the terminating chunk) or "hang" (keep the connection open until the
            client closes it).
    """

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    end: str = "complete"


@dataclass
class Seen:
    """A request the server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float


class FakeLLMServer:
    """Serve scripted replies on 127.0.0.1:<ephemeral port>; see the module docstring."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.requests: list[Seen] = []
        self.disconnected = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> Seen:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        raw = await reader.readexactly(length) if length else b""
        body = json.loads(raw) if raw else None
        return Seen(method, path, headers, body, time.monotonic())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    seen = await self._read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return  # the client closed the connection, or the server is shutting down
                self.requests.append(seen)
                reply = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
                if not await self._respond(reply, reader, writer):
                    return
        finally:
            writer.close()

    async def _respond(
        self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write `reply`; True when the connection may serve another request."""
        if reply.status != 200 or not reply.events:
            payload = json.dumps(reply.body if reply.body is not None else {}).encode()
            head = [
                f"HTTP/1.1 {reply.status} X",
                "Content-Type: application/json",
                f"Content-Length: {len(payload)}",
            ]
            head += [f"{k}: {v}" for k, v in reply.headers.items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            return True
        head = [
            "HTTP/1.1 200 OK",
            "Content-Type: text/event-stream",
            "Transfer-Encoding: chunked",
            "Cache-Control: no-cache",
        ]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        for event in reply.events:
            data = event.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.005)
        if reply.end == "complete":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        if reply.end == "hang":
            try:
                while await reader.read(1024):
                    pass
            except ConnectionError:
                pass
            self.disconnected.set()
        return False  # "cut" and "hang": the socket closes without a terminating chunk


# ---------------------------------------------------------------- OpenAI wire format


def openai_chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    model: str = "gpt-test",
) -> str:
    """One `data: {chat.completion.chunk}` SSE frame."""
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": []
        if delta is None and finish is None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


OPENAI_DONE = "data: [DONE]\n\n"


def openai_text(*pieces: str, usage: dict[str, Any] | None = None) -> list[str]:
    """A complete text answer: a role chunk, one chunk per piece, stop, a usage chunk, [DONE]."""
    frames = [openai_chunk({"role": "assistant", "content": ""})]
    frames += [openai_chunk({"content": p}) for p in pieces]
    frames.append(openai_chunk({}, finish="stop"))
    frames.append(
        openai_chunk(
            usage=usage or {"prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57}
        )
    )
    frames.append(OPENAI_DONE)
    return frames


def openai_tool_call(
    name: str,
    arguments: str,
    call_id: str = "call_abc123",
    say: str = "",
    usage: dict[str, Any] | None = None,
    splits: int = 3,
) -> list[str]:
    """A tool call whose id and name come in the first delta and whose arguments are split over
    `splits` chunks."""
    frames = [openai_chunk({"role": "assistant", "content": say or None})]
    frames.append(
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        )
    )
    size = max(1, -(-len(arguments) // splits))
    for start in range(0, len(arguments), size):
        frames.append(
            openai_chunk(
                {
                    "tool_calls": [
                        {"index": 0, "function": {"arguments": arguments[start : start + size]}}
                    ]
                }
            )
        )
    frames.append(openai_chunk({}, finish="tool_calls"))
    frames.append(
        openai_chunk(
            usage=usage or {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}
        )
    )
    frames.append(OPENAI_DONE)
    return frames


# ---------------------------------------------------------------- Anthropic wire format


def anthropic_event(kind: str, data: dict[str, Any]) -> str:
    """One `event: <kind>` / `data: <json>` SSE frame."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def anthropic_start(input_tokens: int = 30, cache_read: int = 0, cache_write: int = 0) -> str:
    """`message_start` with the input usage."""
    return anthropic_event(
        "message_start",
        {
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "claude-test",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": input_tokens,
                    "output_tokens": 1,
                    "cache_read_input_tokens": cache_read,
                    "cache_creation_input_tokens": cache_write,
                },
            }
        },
    )


def anthropic_text_block(index: int, *pieces: str) -> list[str]:
    """A text block streamed as text_delta pieces."""
    frames = [
        anthropic_event(
            "content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}
        )
    ]
    frames += [
        anthropic_event(
            "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": p}}
        )
        for p in pieces
    ]
    frames.append(anthropic_event("content_block_stop", {"index": index}))
    return frames


def anthropic_tool_block(
    index: int, name: str, arguments: str, tool_id: str = "toolu_01", splits: int = 3
) -> list[str]:
    """A tool_use block whose input JSON arrives as `splits` input_json_delta pieces."""
    frames = [
        anthropic_event(
            "content_block_start",
            {
                "index": index,
                "content_block": {"type": "tool_use", "id": tool_id, "name": name, "input": {}},
            },
        )
    ]
    size = max(1, -(-len(arguments) // splits))
    for start in range(0, len(arguments), size):
        frames.append(
            anthropic_event(
                "content_block_delta",
                {
                    "index": index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": arguments[start : start + size],
                    },
                },
            )
        )
    frames.append(anthropic_event("content_block_stop", {"index": index}))
    return frames


def anthropic_end(output_tokens: int, stop_reason: str = "end_turn") -> list[str]:
    """`message_delta` (cumulative output usage) and `message_stop`."""
    return [
        anthropic_event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": output_tokens},
            },
        ),
        anthropic_event("message_stop", {}),
    ]


OPENAI_LLM = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}


async def openai_turn(
    tmp_path: Any, replies: list[Reply], message: str
) -> tuple[list[dict[str, Any]], FakeLLMServer]:
    """One turn through a whole stack whose platform OpenAI key points at a FakeLLMServer
    serving `replies`: returns (the turn's SSE frames, the server, whose `requests` show what
    the model was sent)."""
    from tests.conftest import start_stack, stop_stack
    from tests.sse_client import read_frames

    async with FakeLLMServer(replies) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "openai_base_url": f"{server.url}/v1",
                "openai_api_key": "sk-platform-key-123456",
                "openai_models": "gpt-test",
                "llm_retry_base_delay_s": 0.01,
                "llm_timeout_s": 10.0,
            },
        )
        try:
            async with stack.client() as client:
                started = await client.post(
                    "/assistant/chat", json={"message": message, "llm": OPENAI_LLM}
                )
                assert started.status_code == 200, started.text
                frames = await read_frames(client, started.json()["stream_url"])
                chat = await client.get(f"/assistant/chat/{started.json()['chat_id']}")
                assert chat.status_code == 200, chat.text
        finally:
            await stop_stack(stack)
    return frames, server
