"""The two requests of every turn (POST /assistant/chat, GET .../listen/{run_id}) are served by
lean ASGI handlers ahead of FastAPI (services/gateway/hot_path.py `GatewayApp`: gateway CPU
per turn). Rule: the wire contract is unchanged — the lean path answers every request exactly as
the FastAPI endpoints of the same routes do (status, body, contract headers), and requests it
does not take (another query string on listen) still get FastAPI's validation.

The FastAPI side is reached in-process through `FastAPI.__call__` (the framework path, the
lean dispatch skipped); the lean side over real HTTP through uvicorn.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.gateway.hot_path import GatewayApp, _listen_target
from tests.conftest import SCRIPTED, script
from tests.sse_client import read_frames

CONTRACT_HEADERS = (
    "content-type",
    "www-authenticate",
    "retry-after",
    "idempotent-replayed",
    "cache-control",
    "x-accel-buffering",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
)


def framework_client(services, **headers: str) -> httpx.AsyncClient:
    """A client of the same app through FastAPI's own routing (no lean dispatch)."""
    app = services.gateway.app

    async def through_fastapi(scope, receive, send):
        await FastAPI.__call__(app, scope, receive, send)

    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=through_fastapi),
        base_url="http://gateway",
        headers={**services.headers(), **headers},
        timeout=30,
    )


def contract(response: httpx.Response) -> tuple[int, Any, dict[str, str]]:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return (
        response.status_code,
        body,
        {name: response.headers[name] for name in CONTRACT_HEADERS if name in response.headers},
    )


def test_the_app_is_the_lean_dispatching_app(services):
    assert isinstance(services.gateway.app, GatewayApp)
    assert set(services.gateway.app.lean) == {"start_turn", "listen"}


@pytest.mark.parametrize(
    ("path", "query", "expected"),
    [
        ("/assistant/chat/c/listen/r", b"", ("c", "r", 0)),
        ("/assistant/chat/c/listen/r", b"after=12", ("c", "r", 12)),
        ("/assistant/chat/c/listen/r", b"after=007", ("c", "r", 7)),
        ("/assistant/chat/c/listen/r", b"after=9007199254740992", ("c", "r", 2**53)),
        (
            "/assistant/chat/c/listen/r",
            b"after=9007199254740993",
            None,
        ),  # FastAPI's le=2**53 decides (400)
        ("/assistant/chat/c/listen/r", b"after=-1", None),
        ("/assistant/chat/c/listen/r", b"after=", None),
        ("/assistant/chat/c/listen/r", b"after=1&x=2", None),
        ("/assistant/chat/c/listen/r", b"after=%31", None),
        ("/assistant/chat//listen/r", b"", None),
        ("/assistant/chat/c/status/r", b"", None),
    ],
)
def test_listen_target_takes_only_plain_requests(path, query, expected):
    assert _listen_target({"path": path, "query_string": query}) == expected


@pytest.mark.parametrize(
    "request_args",
    [
        {"headers": {"Authorization": ""}, "json": {"message": "hi"}},
        {"headers": {"Authorization": "Bearer mx_live_nope"}, "json": {"message": "hi"}},
        {"headers": {"X-Organization-ID": ""}, "json": {"message": "hi"}},
        {"headers": {"X-Organization-ID": "org_elsewhere"}, "json": {"message": "hi"}},
        {"content": b"not json"},
        {"content": b""},
        {"content": b"[1]"},
        {"json": {"message": 5}},
        {"json": {"message": "  "}},
        {"json": {"message": "hi", "surprise": 1}},
        {"json": {"message": "hi", "llm": {"integration_name": "x"}}},
        {"json": {"message": "hi", "chat_id": 3}},
        {"json": {"message": "hi", "chat_id": str(uuid.uuid4())}},
        {"json": {"message": "x" * (2 * 1024 * 1024)}},
    ],
)
async def test_turn_post_errors_match_the_fastapi_endpoint(services, request_args):
    args = {**request_args}
    headers = args.pop("headers", {})
    async with services.client() as lean, framework_client(services) as framework:
        expected = contract(await framework.post("/assistant/chat", headers=headers, **args))
        got = contract(await lean.post("/assistant/chat", headers=headers, **args))
    assert got == expected
    assert expected[0] in (400, 401, 403, 404, 413)


async def test_turn_body_in_many_chunks_and_declared_too_large(services):
    async def chunks():
        text = b'{"message": "' + b"x" * 1000 + b'", "llm": {"integration_name": "x"}}'
        for i in range(0, len(text), 100):
            yield text[i : i + 100]

    async with services.client() as lean, framework_client(services) as framework:
        expected = contract(await framework.post("/assistant/chat", content=chunks()))
        got = contract(await lean.post("/assistant/chat", content=chunks()))
        assert got == expected and got[0] == 400 and "llm" in got[1]["detail"]
        too_big = str(services.gateway.settings.max_body_bytes + 1)
        expected = contract(
            await framework.post(
                "/assistant/chat", content=b"{}", headers={"Content-Length": too_big}
            )
        )
    assert expected[0] == 413
    # The lean path refuses on the declared length alone, before reading the body.
    reader, writer = await asyncio.open_connection("127.0.0.1", services.gateway.port)
    headers = "".join(f"{k}: {v}\r\n" for k, v in services.headers().items())
    writer.write(
        f"POST /assistant/chat HTTP/1.1\r\nHost: x\r\n{headers}"
        f"Content-Type: application/json\r\nContent-Length: {too_big}\r\n\r\n{{}}".encode()
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 413 ")


async def test_successful_turn_and_listen_match_the_fastapi_endpoints(services):
    message = script(
        {"say": "Checking.", "tool": "get_available_integrations", "input": {}},
        {"say": "Done in chunks."},
    )
    async with services.client() as lean, framework_client(services) as framework:
        # (status, body, headers); the rate-limit headers become numbers to compare two turns
        turns: list[tuple[int, Any, dict[str, Any]]] = []
        for client in (framework, lean):
            response = await client.post(
                "/assistant/chat", json={"message": message, "llm": SCRIPTED}
            )
            turns.append(contract(response))
            body = response.json()
            turns[-1][1]["frames"] = [
                (f["type"], f["data"].get("chunk"))
                for f in await read_frames(lean, body["stream_url"])
            ]
            turns[-1][1]["frames_after_2"] = [
                f["type"] for f in await read_frames(client, body["stream_url"] + "?after=2")
            ]
            for key in ("chat_id", "run_id", "thread_id", "stream_url"):
                assert body[key]
                turns[-1][1][key] = type(body[key])
            turns[-1][2]["x-ratelimit-remaining"] = int(
                turns[-1][2]["x-ratelimit-remaining"]
            ) + len(turns)  # one turn later
        stream = await lean.get(
            body["stream_url"]
        )  # a finished run replays with the stream's headers
        streamed = await framework.get(body["stream_url"])
    assert turns[0] == turns[1]
    assert turns[1][0] == 200 and turns[1][1]["frames"][-1][0] == "done"
    assert {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"} <= set(turns[1][2])
    assert (
        contract(stream)[0::2]
        == contract(streamed)[0::2]
        == (
            200,
            {
                "content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache",
                "x-accel-buffering": "no",
            },
        )
    )


@pytest.mark.parametrize(
    "path_and_query",
    [
        "/assistant/chat/{chat}/listen/run_missing",
        "/assistant/chat/{chat}/listen/{run}?after=-1",
        "/assistant/chat/{chat}/listen/{run}?after=abc",
        "/assistant/chat/{chat}/listen/{run}?after=9007199254740993",
        "/assistant/chat/{chat}/listen/{run}?after=99999",
        "/assistant/chat/not-a-chat/listen/{run}",
    ],
)
async def test_listen_answers_match_the_fastapi_endpoint(services, path_and_query):
    async with services.client() as lean, framework_client(services) as framework:
        body = (
            await lean.post(
                "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
            )
        ).json()
        url = path_and_query.format(chat=body["chat_id"], run=body["run_id"])
        await read_frames(lean, body["stream_url"])
        expected = contract(await framework.get(url))
        got = contract(await lean.get(url))
    assert got == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer mx_live_nope"},
        {"Authorization": "Basic x"},
        {"X-Organization-ID": ""},
    ],
)
async def test_listen_auth_errors_match_the_fastapi_endpoint(services, headers):
    url = "/assistant/chat/c/listen/r"
    async with services.client() as lean, framework_client(services) as framework:
        expected = contract(await framework.get(url, headers=headers))
        got = contract(await lean.get(url, headers=headers))
    assert got == expected and got[0] in (400, 401)


async def test_stream_responses_leave_the_connection_header_to_the_server(services):
    # uvicorn sets the connection header; setting ours too gives an HTTP/1.0 listener
    # "connection: keep-alive" and "connection: close" in one response
    async with services.client() as client:
        body = (
            await client.post(
                "/assistant/chat", json={"message": script({"say": "hi"}), "llm": SCRIPTED}
            )
        ).json()
        async with client.stream("GET", body["stream_url"]) as response:
            assert response.status_code == 200
            assert "connection" not in response.headers
            async for _ in response.aiter_bytes():
                pass
