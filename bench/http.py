"""A minimal asyncio HTTP/1.1 client for the benchmark: keep-alive requests and SSE streams.

The benchmark client shares the machine's cores with the services, so it must be cheap:
httpx costs several times more CPU per request than these few lines, and 10,000 open
streams need nothing but a socket and a small buffer each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson


class HTTPError(Exception):
    """A malformed response or a connection that broke mid-request."""


class Connection:
    """One keep-alive HTTP/1.1 connection to (host, port); reconnects when the server closed it."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.reader = None

    async def _send(self, method: str, path: str, body: bytes | None, extra: dict[str, str] | None) -> None:
        await self.open()
        assert self.writer is not None
        head = f"{method} {path} HTTP/1.1\r\n{self._fixed}"
        if extra:
            head += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise HTTPError(f"connection closed before the response head: {exc!r}") from None
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self.close()
            raise HTTPError(f"bad status line {lines[0]!r}") from None
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        return status, headers

    async def _chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunked, Content-Length or until close)."""
        assert self.reader is not None
        reader = self.reader
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if length:
                yield await reader.readexactly(length)
        else:
            while data := await reader.read(65536):
                yield data
            self.close()
        if headers.get("connection", "").lower() == "close":
            self.close()

    async def request(self, method: str, path: str, body: bytes | None = None, extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """Send one request and read its whole response."""
        for attempt in (0, 1):
            reused = self.writer is not None
            await self._send(method, path, body, extra)
            try:
                status, headers = await self._head()
            except HTTPError:
                if reused and attempt == 0:  # the server closed an idle keep-alive connection
                    continue
                raise
            try:
                data = b"".join([piece async for piece in self._chunks(headers)])
            except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                self.close()
                raise HTTPError(f"broken body: {exc!r}") from None
            return status, headers, data
        raise HTTPError("unreachable")

    async def stream(self, path: str, extra: dict[str, str] | None = None) -> tuple[int, AsyncIterator[tuple[float, dict]]]:
        """GET `path` as SSE: (status, an iterator of (arrival time.time(), frame object))."""
        await self._send("GET", path, None, extra)
        status, headers = await self._head()
        if status != 200:
            async for _ in self._chunks(headers):
                pass
            return status, _empty()
        return status, self._frames(headers)

    async def _frames(self, headers: dict[str, str]) -> AsyncIterator[tuple[float, dict]]:
        buffer = b""
        try:
            async for piece in self._chunks(headers):
                now = time.time()
                buffer += piece
                while True:
                    end = buffer.find(b"\n\n")
                    if end < 0:
                        break
                    frame, buffer = buffer[:end], buffer[end + 2 :]
                    if frame.startswith(b"data: "):
                        yield now, orjson.loads(frame[6:])
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            self.close()
            raise HTTPError(f"stream broke: {exc!r}") from None


async def _empty() -> AsyncIterator[tuple[float, dict]]:
    return
    yield  # pragma: no cover
