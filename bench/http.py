"""A minimal asyncio HTTP/1.1 client for the benchmark: keep-alive requests and SSE streams.

The benchmark client shares the machine's cores with the services, so it must be cheap:
httpx costs several times more CPU per request than these few lines, and 10,000 open
streams need nothing but a socket and a small buffer each.
"""

from __future__ import annotations

import asyncio
import bisect
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Protocol, cast

import orjson


class HTTPError(Exception):
    """A malformed response or a connection that broke mid-request."""


class Transport(Protocol):
    """What an SSERecorder needs of its transport: an asyncio one or a `_SocketHandle`."""

    def close(self) -> None: ...

    def is_closing(self) -> bool: ...

    def write(self, data: bytes) -> None: ...


class Connection:
    """One keep-alive HTTP/1.1 connection to (host, port); reconnects when the server closed it."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._fixed = "".join(
            f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items()
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.reader = None

    async def _send(
        self, method: str, path: str, body: bytes | None, extra: dict[str, str] | None
    ) -> None:
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

    async def request(
        self, method: str, path: str, body: bytes | None = None, extra: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
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

    async def stream(
        self, path: str, extra: dict[str, str] | None = None
    ) -> tuple[int, AsyncIterator[tuple[float, dict]]]:
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


class SSERecorder(asyncio.Protocol):
    """A cheap SSE listener for the fan-out workload: records raw bytes with their arrival time.

    10,000 streams on the client's share of 2 cores cannot afford a StreamReader, an async
    generator and a JSON parse per frame while the delay is measured, so `data_received`
    only appends `(time.time(), bytes)`; `frames()` decodes the chunked body and the frames
    afterwards. `status` resolves with the HTTP status once the response head is in;
    `closed` resolves when the stream ended (final chunk) or the connection was lost.
    """

    def __init__(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.request = request
        self.pieces: list[tuple[float, bytes]] = []
        self.stamps: list[float] = []  # StampedSSERecorder: the kernel's receive time of each piece
        self.status: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.transport: Transport | None = None
        self.ended = False  # the final chunk arrived
        self.error = ""
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport is a WriteTransport (create_connection's contract)
        self.attach(cast(asyncio.Transport, transport))

    def attach(self, transport: Transport) -> None:
        """Keep the transport and send the request on it."""
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.pieces.append((time.time(), data))
        if not self.status.done():
            head = b"".join(p for _, p in self.pieces)
            if b"\r\n\r\n" in head:
                try:
                    self.status.set_result(int(head.split(b" ", 2)[1]))
                except (IndexError, ValueError):
                    self.status.set_exception(HTTPError(f"bad status line {head[:80]!r}"))
        tail = (self._tail + data)[-9:]
        self._tail = tail
        if tail.endswith(b"\n0\r\n\r\n") and self.status.done():
            self.ended = True
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.error = f"{type(exc).__name__}: {exc}"
        if not self.status.done():
            self.status.set_exception(
                HTTPError(f"connection closed before the response head: {exc!r}")
            )
        if not self.closed.done():
            self.closed.set_result(None)

    def frames(self, at_socket: bool = False) -> list[tuple[float, bytes]]:
        """(arrival time, frame JSON bytes) of every complete `data: ...` frame received; the
        arrival is when the client read it, or with `at_socket` (StampedSSERecorder) when the
        kernel received it into the listener's socket."""
        raw = b"".join(p for _, p in self.pieces)
        ends: list[int] = []
        times: list[float] = []
        offset = 0
        for arrival, piece in self.pieces:
            offset += len(piece)
            ends.append(offset)
            times.append(arrival)
        if at_socket:
            times = list(self.stamps)
        head_end = raw.find(b"\r\n\r\n")
        if head_end < 0:
            return []
        pos = head_end + 4
        body = bytearray()
        # (body length after the chunk, raw offset of its end)
        chunk_marks: list[tuple[int, int]] = []
        while True:
            line_end = raw.find(b"\r\n", pos)
            if line_end < 0:
                break
            try:
                size = int(raw[pos:line_end].split(b";", 1)[0], 16)
            except ValueError:
                break
            if size == 0 or line_end + 2 + size > len(raw):
                break
            body += raw[line_end + 2 : line_end + 2 + size]
            pos = line_end + 2 + size + 2
            chunk_marks.append((len(body), line_end + 2 + size))
        out: list[tuple[float, bytes]] = []
        start, mark = 0, 0
        while True:
            end = body.find(b"\n\n", start)
            if end < 0:
                break
            while chunk_marks[mark][0] < end + 2:
                mark += 1
            raw_offset = chunk_marks[mark][1]
            piece_index = bisect.bisect_left(ends, raw_offset)
            frame = bytes(body[start:end])
            if frame.startswith(b"data: "):
                out.append((times[min(piece_index, len(times) - 1)], frame[6:]))
            start = end + 2
        return out


async def open_sse(host: str, port: int, path: str, headers: dict[str, str]) -> SSERecorder:
    """Connect and send `GET path` for an SSE stream; the recorder fills as bytes arrive."""
    head = "".join(
        f"{k}: {v}\r\n"
        for k, v in {"Host": f"{host}:{port}", "Accept": "text/event-stream", **headers}.items()
    )
    recorder = SSERecorder(f"GET {path} HTTP/1.1\r\n{head}\r\n".encode())
    await asyncio.get_running_loop().create_connection(lambda: recorder, host, port)
    return recorder


# Linux: SO_TIMESTAMPNS_OLD, cmsg SCM_TIMESTAMPNS (struct timespec)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")


class _SocketHandle:
    """The Transport of a StampedSSERecorder: closes its raw socket, writes the request."""

    def __init__(self, recorder: StampedSSERecorder) -> None:
        self.recorder = recorder

    def close(self) -> None:
        self.recorder.shut(None)

    def is_closing(self) -> bool:
        return self.recorder.sock is None

    def write(self, data: bytes) -> None:  # the request only; a few hundred bytes on an idle socket
        if self.recorder.sock is not None:
            self.recorder.sock.sendall(data)


class StampedSSERecorder(SSERecorder):
    """An SSERecorder that also keeps the kernel's receive time of every read (SO_TIMESTAMPNS):
    when the bytes reached the listener's socket, whenever this client got the CPU to read them.

    With the client on the same cores as the gateway, the read time includes the client's own
    scheduling delay; the socket time is what a listener on another machine would see, less the
    network. Reads with `recvmsg` from a raw non-blocking socket on the event loop's reader
    callback (one read per readiness, as uvloop's transports do). Linux only.
    """

    def __init__(self, request: bytes) -> None:
        super().__init__(request)
        self.sock: socket.socket | None = None
        self.loop = asyncio.get_running_loop()

    async def connect(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        try:
            await self.loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.loop.add_reader(sock.fileno(), self._readable)
        self.attach(_SocketHandle(self))

    def _readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            data, ancillary, _, _ = sock.recvmsg(262144, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.shut(exc)
            return
        if not data:
            self.shut(None)
            return
        stamp = 0.0
        for level, kind, payload in ancillary:
            if (
                level == socket.SOL_SOCKET
                and kind == SO_TIMESTAMPNS
                and len(payload) >= _TIMESPEC.size
            ):
                seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
                stamp = seconds + nanoseconds / 1e9
        self.stamps.append(stamp or time.time())
        self.data_received(data)

    def shut(self, exc: Exception | None) -> None:
        """Stop reading and close the socket (the stream ended, broke or the workload is done)."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self.loop.remove_reader(sock.fileno())
        sock.close()
        self.connection_lost(exc)


async def open_stamped_sse(
    host: str, port: int, path: str, headers: dict[str, str]
) -> StampedSSERecorder:
    """`open_sse` with kernel receive timestamps (StampedSSERecorder)."""
    head = "".join(
        f"{k}: {v}\r\n"
        for k, v in {"Host": f"{host}:{port}", "Accept": "text/event-stream", **headers}.items()
    )
    recorder = StampedSSERecorder(f"GET {path} HTTP/1.1\r\n{head}\r\n".encode())
    await recorder.connect(host, port)
    return recorder
