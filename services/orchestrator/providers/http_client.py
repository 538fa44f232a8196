"""The HTTP client the provider SDKs are given: their aiohttp transport, each body read bounded.

The SDKs' default transport, httpx's, scans its whole connection pool on every request and every
response's end: with thousands of calls streaming at once that was the orchestrator's largest
cost (docs/performance.md). Both SDKs ship an aiohttp transport (`DefaultAioHttpClient`).

aiohttp 3.14's C parser, given a body whose chunked framing breaks mid-stream, stops its read
timeout and never wakes the reader, even once the server has closed: the model call would wait
forever. So every read of a response body is bounded here by the request's read timeout (the
SDK client's `timeout`), as httpx bounds each read of its socket; past it the read raises
httpx's ReadTimeout, which the SDKs and `retry.classify` report as a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from services.orchestrator.providers.clients import ClientSpec, http_limits


def new_http_client(sdk: Any, spec: ClientSpec) -> httpx2.AsyncClient:
    """`sdk.DefaultAioHttpClient` (`sdk`: the `openai` or `anthropic` module) for `spec`."""
    client: httpx2.AsyncClient = sdk.DefaultAioHttpClient(
        limits=http_limits(spec), event_hooks={"response": [_bound_reads]}
    )
    return client


async def _bound_reads(response: httpx2.Response) -> None:
    """Response hook, before the body is read: bound each of its reads by the read timeout."""
    seconds = (response.request.extensions.get("timeout") or {}).get("read")
    if seconds and isinstance(response.stream, httpx2.AsyncByteStream):
        response.stream = BoundedReads(response.stream, float(seconds))


class BoundedReads(httpx2.AsyncByteStream):
    """A response body whose every read raises httpx2.ReadTimeout after `seconds` without bytes."""

    def __init__(self, stream: httpx2.AsyncByteStream, seconds: float) -> None:
        self._stream = stream
        self._seconds = seconds

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._stream)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._seconds):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise httpx2.ReadTimeout("no bytes within the read timeout") from None
                yield chunk
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    async def aclose(self) -> None:
        await self._stream.aclose()
