"""A TCP proxy that can start dropping every byte, as a server host that vanished does (tests
of database and Redis timeouts, chaos test F5)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest


class Blackhole:
    """A TCP proxy to `target` (or to nothing) that can start swallowing every byte both ways:
    connections stay open and nothing is answered, as with a database host that vanished."""

    def __init__(self, target: tuple[str, int] | None = None) -> None:
        self.target = target
        self.swallowing = target is None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.add(asyncio.current_task())
        with contextlib.suppress(Exception, asyncio.CancelledError):
            if self.swallowing:
                while await reader.read(65536):
                    pass
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)

            async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
                while data := await source.read(65536):
                    if not self.swallowing:
                        sink.write(data)
                        await sink.drain()

            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    async def stop(self) -> None:
        self.server.close()
        for task in self.tasks:
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
    assert time.monotonic() - started <= limit_s, f"answered after {time.monotonic() - started:.1f} s"
    error = task.exception()
    assert error is not None, "the request succeeded against a server that answers nothing"
    return error
