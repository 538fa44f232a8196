"""A TCP proxy for outage tests: it can cut its connections (a server that went down and
refuses connections) or swallow every byte (a server host that vanished: connections stay
open and nothing is answered); `fails_in_time` times what such an outage
makes a request do."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 (`port`, set by `start`) to `host`:`port` of the server.

    `cut()` closes every proxied connection and refuses new ones until `restore()`. With
    `swallowing` set, connections stay open but every byte either way is dropped, and new
    ones are accepted and never answered. Without a server (`CuttableProxy()`) it swallows
    from the start: a server that accepts connections and never answers.
    """

    def __init__(self, host: str | None = None, port: int | None = None) -> None:
        self.target = (host, port) if host is not None else None
        self.down = False
        self.swallowing = self.target is None
        self.connections: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        """Listen on a free port of 127.0.0.1; returns it (also `port`)."""
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None  # a connection is handled in a task of its own
        self.tasks.add(task)
        self.connections.add(writer)
        with contextlib.suppress(Exception, asyncio.CancelledError):
            try:
                if self.swallowing:
                    while await reader.read(65536):
                        pass
                    return
                assert self.target is not None  # a proxy with no target swallows
                try:
                    upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
                except OSError:
                    writer.close()
                    return
                self.connections.add(upstream_writer)

                async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
                    with contextlib.suppress(Exception):
                        while data := await source.read(65536):
                            if not self.swallowing:
                                sink.write(data)
                                await sink.drain()
                    if not self.swallowing:
                        sink.close()

                await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
                self.connections.discard(upstream_writer)
            finally:
                self.connections.discard(writer)
                self.tasks.discard(task)

    def cut(self) -> None:
        """Close every proxied connection and refuse new ones."""
        self.down = True
        for writer in list(self.connections):
            writer.close()
        self.connections.clear()

    def restore(self) -> None:
        """Accept connections again."""
        self.down = False

    async def stop(self) -> None:
        """Close everything (connections, the listening socket, their handlers)."""
        self.cut()
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def fails_in_time(work, limit_s: float) -> BaseException:  # noqa: ANN001
    """The error `work()` ends with, asserting it ends within `limit_s` seconds (a hang fails
    the test after 5 s more instead of holding it)."""
    task = asyncio.ensure_future(work())
    started = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=limit_s + 5)
    if not done:
        task.cancel()
        pytest.fail(f"the request hung past {limit_s + 5:.1f} s (no timeout)")
    assert time.monotonic() - started <= limit_s, (
        f"answered after {time.monotonic() - started:.1f} s"
    )
    error = task.exception()
    assert error is not None, "the request succeeded against a server that answers nothing"
    return error
