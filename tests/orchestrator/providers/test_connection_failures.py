"""How a provider call that never got an answer is named, through each SDK's HTTP transport.

The transport wraps what the socket said in its own classes (the aiohttp one wraps a refused
or dropped connection in a timeout class); the run's error names what happened.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.orchestrator.providers.anthropic_provider import AnthropicModel
from services.orchestrator.providers.base import ModelError
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.providers.retry import RetryPolicy
from tests.orchestrator.providers.fakes import anthropic_start, anthropic_text_block, openai_text

ONE_RETRY = RetryPolicy(max_retries=1, base_delay_s=0.01, max_delay_s=0.1)
USER = [{"role": "user", "content": "hello"}]


def openai_at(url: str, timeout_s: float) -> Any:
    return OpenAICompatModel(
        "openai",
        "gpt-test",
        base_url=f"{url}/v1",
        api_key="k",
        policy=ONE_RETRY,
        timeout_s=timeout_s,
    )


def anthropic_at(url: str, timeout_s: float) -> Any:
    return AnthropicModel(
        "claude-test",
        base_url=url,
        api_key="k",
        policy=ONE_RETRY,
        max_tokens=16,
        timeout_s=timeout_s,
    )


PROVIDERS = [pytest.param(openai_at, id="openai"), pytest.param(anthropic_at, id="anthropic")]


async def failure(
    build: Callable[[str, float], Any], url: str, timeout_s: float = 5.0, text_allowed: bool = False
) -> str:
    async def on_text(_: str) -> None:
        assert text_allowed, "no text was sent"

    with pytest.raises(ModelError) as raised:
        await build(url, timeout_s).generate(USER, [], on_text)
    return str(raised.value)


@asynccontextmanager
async def server(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
) -> AsyncIterator[str]:
    listening = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    finally:
        listening.close()


@pytest.mark.parametrize("build", PROVIDERS)
async def test_a_refused_connection_is_a_connection_failure_not_a_timeout(build):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    message = await failure(build, f"http://127.0.0.1:{port}")
    assert message.endswith(": connection failed after 2 attempts")


@pytest.mark.parametrize("build", PROVIDERS)
async def test_a_connection_closed_before_any_answer_is_a_connection_failure(build):
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async with server(close_at_once) as url:
        message = await failure(build, url)
    assert message.endswith(": connection failed after 2 attempts")


@pytest.mark.parametrize("build", PROVIDERS)
async def test_a_server_that_never_answers_is_a_timeout(build):
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    async with server(hold) as url:
        message = await failure(build, url, timeout_s=0.3)
    assert message.endswith(": timed out after 2 attempts")


@pytest.mark.parametrize("build", PROVIDERS)
@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", id="bad-status-line"),
        pytest.param(b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n", id="bad-header-line"),
    ],
)
async def test_an_answer_that_is_no_http_response_is_a_connection_failure(build, head):
    # the aiohttp transport's parser error reaches the openai SDK's caller unwrapped; httpx's
    # was a protocol error, retried as a connection failure
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        await writer.drain()
        writer.close()

    async with server(answer) as url:
        message = await failure(build, url)
    assert message.endswith(": connection failed after 2 attempts")


@pytest.mark.parametrize("build", PROVIDERS)
@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(b"zz\r\nhello\r\n", id="bad-chunk-size"),
        pytest.param(b"5\r\nhelloXX", id="chunk-longer-than-its-size"),
    ],
)
async def test_a_stream_whose_chunked_framing_breaks_ends_within_the_read_timeout(build, broken):
    # aiohttp's C parser stops its read timeout on such a body and never wakes the reader, even
    # once the server has closed: without a bound of its own the call would wait forever
    first = (
        openai_text("a")[0]
        if build is openai_at
        else anthropic_start() + "".join(anthropic_text_block(0, "a")[:2])
    ).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(first):x}\r\n".encode() + first + b"\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(broken)
        await writer.drain()
        writer.close()

    async with server(answer) as url:
        async with asyncio.timeout(10):
            message = await failure(build, url, timeout_s=0.5, text_allowed=True)
    assert message.split(": ", 1)[1].startswith(("timed out", "stream ended early")), message
