"""Every HTTP request gets a request id, an access line, and its id on every log line it causes.

The gateway takes a valid `X-Request-ID` (1-128 characters of [A-Za-z0-9._-]) or makes one
(32 hex characters), returns it on every answer (errors, the lean turn routes and event streams
included), and logs one `request` line per request: method, route template, status, duration,
organization and request id, an event stream's when it ends. The orchestrator, billing and the
tools service get the id as gRPC metadata and log it on their lines of that request.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from services.common.logging import JsonFormatter
from tests.conftest import script
from tests.orchestrator.helpers import run_turn, wait_for
from tests.sse_client import read_frames

MADE = re.compile(r"[0-9a-f]{32}")


class _Lines(logging.Handler):
    """Every record as the services' JSON line, formatted where it is logged (the log context
    is read then)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter("test"))
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(orjson.loads(self.format(record)))

    def access(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["logger"] == "loopline.access"]


@pytest.fixture
def log_lines() -> Iterator[_Lines]:
    lines, root = _Lines(), logging.getLogger()
    level = root.level
    root.addHandler(lines)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(lines)
        root.setLevel(level)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("req-1.A_b", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("has space", False),
        ("semi;colon", False),
        ("", False),
    ],
)
async def test_a_valid_request_id_is_returned_and_another_is_replaced(services, given, kept):
    async with services.client() as client:
        answer = await client.get("/healthz", headers={"X-Request-ID": given})
    returned = answer.headers["x-request-id"]
    assert returned == given if kept else MADE.fullmatch(returned), returned


async def test_every_answer_carries_its_own_request_id(services):
    async with services.client() as client:
        started = await client.post("/assistant/chat", json={"message": script({"say": "hi"})})
        answers = [
            started,
            await client.get("/healthz"),
            await client.get("/readyz"),
            await client.get("/assistant/chats", headers={"Authorization": "Bearer nope"}),
            await client.get("/no/such/path"),
            await client.get("/assistant/chat/a%00b"),
            await client.post("/assistant/chat", content=b"{not json"),
            await client.post(
                "/assistant/chat", json={"message": "x"}, headers={"Authorization": ""}
            ),
            await client.delete("/assistant/chats"),
        ]
        async with client.stream("GET", started.json()["stream_url"]) as stream:
            answers.append(stream)
            await stream.aread()
    statuses = [answer.status_code for answer in answers]
    assert statuses == [200, 200, 200, 401, 404, 400, 400, 401, 405, 200]
    ids = [answer.headers.get("x-request-id") for answer in answers]
    assert all(id_ and MADE.fullmatch(id_) for id_ in ids), ids
    assert len(set(ids)) == len(ids)


async def test_the_access_line_has_the_route_template_status_duration_and_organization(
    services, log_lines
):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hi", "sleep_ms": 500})
        chat_id = body["chat_id"]
        await client.get(f"/assistant/chat/{chat_id}", headers={"X-Request-ID": "get-chat"})
        await client.get(f"/no/{chat_id}", headers={"X-Request-ID": "unknown-path"})
        await client.get("/assistant/chats", headers={"Authorization": "Bearer nope"})
        await client.get("/openapi.json")  # routes of Starlette's own, not FastAPI's
        await client.get("/docs/static/swagger-ui.css")
    # a line is written once the answer is sent: the client may have it a moment before
    await wait_for(lambda: len(log_lines.access()) == 7)
    lines = log_lines.access()
    assert [line["route"] for line in lines] == [
        "/assistant/chat",
        "/assistant/chat/{chat_id}/listen/{run_id}",
        "/assistant/chat/{chat_id}",
        None,
        "/assistant/chats",
        "/openapi.json",
        "/docs/static/{path}",
    ]
    assert [line["status"] for line in lines] == [200, 200, 200, 404, 401, 200, 200]
    assert [line.get("org_id") for line in lines] == [services.org_id] * 3 + [None] * 4
    for line in lines:
        assert line["message"] == "request" and line["level"] == "info"
        assert line["method"] in ("GET", "POST") and line["duration_ms"] >= 0
        assert chat_id not in orjson.dumps(line).decode()  # templates, never the ids
    # the stream's line is written when it ends: its duration covers the model's 0.5 s
    assert lines[1]["duration_ms"] >= 400, lines[1]
    assert [lines[2]["request_id"], lines[3]["request_id"]] == ["get-chat", "unknown-path"]


async def test_the_services_lines_of_a_request_carry_its_request_id(services, log_lines):
    upload = ("notes.txt", b"the theremin was invented by Leon Theremin", "text/plain")
    async with services.client() as client:
        client.headers["X-Request-ID"] = "turn-1"
        body, frames = await run_turn(client, {"say": "hi"})
        assert frames[-1]["type"] == "done"
        client.headers["X-Request-ID"] = "kb-1"
        base = (await client.post("/knowledge-bases", json={"name": "Docs"})).json()
        client.headers["X-Request-ID"] = "upload-1"
        url = f"/knowledge-bases/{base['id']}/documents"
        assert (await client.post(url, files={"file": upload})).status_code == 201
    by_message = {line["message"]: line.get("request_id") for line in log_lines.lines}
    assert by_message["admitted"] == "turn-1"  # billing, called by the orchestrator
    assert by_message["run ended"] == "turn-1"  # the orchestrator's run task
    assert by_message["document indexed"] == "upload-1"  # the tools service
    assert {line["request_id"] for line in log_lines.access()} == {"turn-1", "kb-1", "upload-1"}


async def test_a_stream_listened_to_again_gets_the_request_id_of_its_listen(services):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hi"})
        client.headers["X-Request-ID"] = "listen-again"
        async with client.stream("GET", body["stream_url"]) as stream:
            assert stream.headers["x-request-id"] == "listen-again"
        frames = await read_frames(client, body["stream_url"])
    assert frames[-1]["type"] == "done"
