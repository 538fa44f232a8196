"""Parallel socket writes for a large fan-out: one frame to thousands of listeners on all cores.

On loopback TCP (and on a real NIC) nearly all the cost of handing an SSE frame to a listener
is the kernel's send path, ~7-9 µs a connection on a 2-core virtual machine, and
`os.write` releases the GIL for it. One event to 10,000 listeners is therefore ~80 ms of
one core if the event loop thread does every write, however little Python runs around
them (the target: delay p99 <= 50 ms at 10,000 listeners on one gateway process).
`ParallelWriter.write` splits such a batch between the event loop's thread and
`threads` helper threads that each write their share straight to the connections' file
descriptors, and waits until all are done; the kernel work then runs on every core.

Safety rests on three rules the caller (`fanout.RunHub`) keeps:

- Only plain TCP transports (uvloop's `TCPTransport`, asyncio's selector socket transport;
  never TLS, whose bytes must go through the transport) with **nothing buffered**
  (`get_write_buffer_size() == 0`) and not closing are written directly: bytes a transport
  still holds would otherwise be overtaken (uvloop buffers every write until the end of
  the loop iteration).
- The event loop's thread blocks in `write` until every helper has finished its share, so
  no callback can close a transport (and free its descriptor for reuse) while a helper
  writes to it.
- Whatever the kernel did not take (a full socket buffer: `BlockingIOError`, or a partial
  write) and every error (`EPIPE`, `ECONNRESET`, ...) goes back to the transport's own
  `write` on the loop's thread: the transport buffers the rest with its flow control, or
  sees the error and closes the connection the way it always does.

Small batches (fewer than `min_batch` connections) are not worth a hand-off to the threads
(~20-40 µs) and are written inline by the caller.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

_PLAIN_TCP_TRANSPORTS = frozenset(
    {
        "uvloop.loop.TCPTransport",
        "asyncio.selector_events._SelectorSocketTransport",
    }
)


def socket_fd(transport: Any) -> int:
    """The file descriptor `transport` writes to, when it is a plain (not TLS) TCP transport
    that `ParallelWriter` may write to directly; else -1."""
    kind = f"{type(transport).__module__}.{type(transport).__qualname__}"
    if kind not in _PLAIN_TCP_TRANSPORTS:
        return -1
    try:
        if transport.get_extra_info("sslcontext") is not None:
            return -1
        sock = transport.get_extra_info("socket")
        return -1 if sock is None else int(sock.fileno())
    except (AttributeError, OSError, TypeError, ValueError):
        return -1


def write_share(items: Sequence[tuple[int, bytes]], start: int, stop: int) -> list[tuple[int, int]]:
    """Write `items[start:stop]` (`(fd, data)` pairs) with `os.write` on non-blocking
    descriptors; returns `(index, written)` for each item not written whole: `written` is the
    bytes the kernel took (0 when its buffer is full) or -1 after an error."""
    write = os.write
    short: list[tuple[int, int]] = []
    index = start
    for fd, data in items[
        start:stop
    ]:  # as little Python as possible between the writes (the GIL is shared)
        try:
            written = write(fd, data)
        except BlockingIOError:
            written = 0
        except OSError:
            written = -1
        if written != len(data):
            short.append((index, written))
        index += 1
    return short


class ParallelWriter:
    """`threads` helper threads (daemons, started on first use) that write shares of a batch.

    `write(items)` returns the `(index, written)` pairs of the items not written whole (see
    `write_share`), for the caller to hand to the transports; the calling thread writes the
    first share itself. `close()` stops the helpers (idempotent; `write` then writes inline).
    """

    def __init__(self, threads: int, min_batch: int = 128) -> None:
        self.threads = max(0, threads)
        self.min_batch = max(1, min_batch)
        self._jobs: list[
            queue.SimpleQueue[tuple[Sequence[tuple[int, bytes]], int, int] | None]
        ] = []
        self._done: queue.SimpleQueue[list[tuple[int, int]] | BaseException] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._closed = False

    def enabled_for(self, batch: int) -> bool:
        """Whether a batch of `batch` direct writes goes to the helper threads."""
        return self.threads > 0 and not self._closed and batch >= self.min_batch

    def write(self, items: Sequence[tuple[int, bytes]]) -> list[tuple[int, int]]:
        """Write every `(fd, data)` of `items`, split evenly between this thread and the helpers;
        blocks until all are written. Returns the items not written whole, by index."""
        if not self.enabled_for(len(items)):
            return write_share(items, 0, len(items))
        self._start()
        shares = self.threads + 1
        size = -(-len(items) // shares)
        handed = 0
        for number, jobs in enumerate(self._jobs, start=1):
            start = number * size
            if start >= len(items):
                break
            jobs.put((items, start, min(start + size, len(items))))
            handed += 1
        short = write_share(items, 0, min(size, len(items)))
        failure: BaseException | None = None
        for _ in range(handed):
            result = self._done.get()
            if isinstance(result, BaseException):
                failure = result
            else:
                short.extend(result)
        if failure is not None:
            raise failure
        return short

    def close(self) -> None:
        """Stop the helper threads (they finish the share they hold first)."""
        self._closed = True
        for jobs in self._jobs:
            jobs.put(None)
        self._jobs = []
        self._workers = []

    def _start(self) -> None:
        while len(self._workers) < self.threads:
            jobs: queue.SimpleQueue[tuple[Sequence[tuple[int, bytes]], int, int] | None] = (
                queue.SimpleQueue()
            )
            worker = threading.Thread(
                target=self._run,
                args=(jobs,),
                name=f"fanout-writer-{len(self._workers)}",
                daemon=True,
            )
            worker.start()
            self._jobs.append(jobs)
            self._workers.append(worker)

    def _run(
        self, jobs: queue.SimpleQueue[tuple[Sequence[tuple[int, bytes]], int, int] | None]
    ) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                self._done.put(write_share(*job))
            # handed to the waiting loop thread, which raises it
            except BaseException as error:  # noqa: BLE001
                self._done.put(error)
