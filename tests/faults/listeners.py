"""SSE listeners that follow a run across reconnects, for the fault suite.

`Listener` is a client that reads a run's SSE stream the way a careful client does: every
frame is kept with the time it arrived (heartbeats included, for the wait bound); a stream
that ends with the "reconnect with ?after=N" `error` frame is listened to again from N (on
its own gateway, or the next one when that one answers 5xx or cannot be reached); each
connection is a `Segment`, judged by tests/faults/checker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

from tests.faults.turns import Run
from tests.sse_client import validate_frame

RECONNECT = re.compile(r"reconnect with \?after=(\d+)$")


TERMINAL = frozenset({"done", "cancelled", "interrupted"})


RETRYABLE_STATUSES = frozenset({502, 503, 504})


@dataclass
class Segment:
    """One connection of a listener: `?after=` it asked, the frames it got (heartbeats apart)."""

    gateway: str
    after: int
    frames: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: int = 0
    max_gap: float = (
        0.0  # longest wait, from the request to the first byte, between frames, to the end
    )
    max_gap_at: float = 0.0  # when (seconds since the listener started) that wait ended
    ending: str = ""  # "terminal", "reconnect", "closed" (neither), "timeout", "error: ..."
    headers_s: float = 0.0  # from the request to the response's headers

    @property
    def reconnect_at(self) -> int | None:
        """N of a final "reconnect with ?after=N" error frame, else None."""
        if self.frames and self.frames[-1].get("type") == "error":
            match = RECONNECT.search(str(self.frames[-1].get("data", {}).get("message", "")))
            if match:
                return int(match.group(1))
        return None


@dataclass
class Listener:
    """Follows a run's stream through `gateways` (the first one first), reconnecting with
    `?after=N` when told to; `segments` are its connections (how each ended is judged by the
    checker), `problems` what the checker cannot see in them (a status that is not retryable,
    a frame that is not `data: <json>` or is off the schema, a listener still open at its
    deadline). A 502/503/504 or a refused connection is retried on the next gateway."""

    name: str
    run: Run
    gateways: Sequence[tuple[str, httpx.AsyncClient]]
    gap_limit_s: float = (
        30.0  # the client's own read timeout (longer than any wait the checker accepts)
    )
    segments: list[Segment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    refused: list[str] = field(
        default_factory=list
    )  # retryable answers to (re)connects, for the report
    finished: bool = False
    began: float = field(default_factory=time.monotonic)
    ended_at: float | None = None
    task: asyncio.Task | None = None
    received_types: list[str] = field(
        default_factory=list
    )  # every frame's type as it came (all connections)

    @property
    def received(self) -> int:
        return len(self.received_types)

    @property
    def frames(self) -> list[dict[str, Any]]:
        """The frames as a client that stitches segments sees them (reconnect frames dropped)."""
        stitched: list[dict[str, Any]] = []
        for segment in self.segments:
            frames = segment.frames[:-1] if segment.reconnect_at is not None else segment.frames
            stitched.extend(frames)
        return stitched

    def start(self, delay: float = 0.0) -> Listener:
        self.task = asyncio.create_task(self._follow(delay), name=f"listener {self.name}")
        return self

    async def _follow(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        self.began = time.monotonic()
        after, index = 0, 0
        try:
            while True:
                name, client = self.gateways[index % len(self.gateways)]
                segment = Segment(name, after)
                try:
                    status, retry_after = await self._read(client, segment)
                except (httpx.TransportError, OSError) as error:  # refused, reset before the answer
                    if (
                        segment.frames or segment.heartbeats
                    ):  # broke mid-stream: the checker reports the segment
                        self.segments.append(segment)
                        segment.ending = f"error: {type(error).__name__}"
                        return
                    self.refused.append(f"{name}: {type(error).__name__}")
                    index += 1
                    await asyncio.sleep(0.5)
                    continue
                if status in RETRYABLE_STATUSES:
                    self.refused.append(f"{name}: {status}")
                    index += 1  # another gateway
                    await asyncio.sleep(min(retry_after, 1.0))
                    continue
                if status != 200:
                    self.problems.append(
                        f"{self.name}: GET {self.run.url}?after={after} through {name} "
                        f"answered {status}"
                    )
                    return
                self.segments.append(segment)
                if segment.ending == "terminal":
                    self.finished = True
                    return
                if segment.ending == "reconnect":
                    after = segment.reconnect_at or 0
                    await asyncio.sleep(0.2)
                    continue
                # "closed" (neither an end frame nor the reconnect frame) or "timeout" (no frame for
                # gap_limit_s: the client gave up): the checker reports the segment
                return
        finally:
            self.ended_at = time.monotonic()

    async def _read(self, client: httpx.AsyncClient, segment: Segment) -> tuple[int, float]:
        """Read one connection into `segment`; (status, Retry-After) of a refused one."""
        last = time.monotonic()

        def tick() -> None:
            nonlocal last
            now = time.monotonic()
            if now - last > segment.max_gap:
                segment.max_gap, segment.max_gap_at = now - last, now - self.began
            last = now

        timeout = httpx.Timeout(self.gap_limit_s, connect=10)
        try:
            async with client.stream(
                "GET",
                self.run.url,
                params={"after": segment.after} if segment.after else None,
                timeout=timeout,
            ) as response:
                segment.headers_s = time.monotonic() - last
                if response.status_code != 200:
                    await response.aread()
                    retry = response.headers.get("retry-after", "1")
                    return response.status_code, float(retry) if retry.replace(
                        ".", "", 1
                    ).isdigit() else 1.0
                buffer = b""
                async for chunk in response.aiter_bytes():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        tick()
                        raw, buffer = buffer.split(b"\n\n", 1)
                        if not raw.startswith(b"data: ") or b"\n" in raw:
                            self.problems.append(
                                f"{self.name}: a frame that is not `data: <json>`: {raw[:200]!r}"
                            )
                            continue
                        frame = json.loads(raw[len(b"data: ") :])
                        try:
                            validate_frame(frame)
                        except jsonschema.ValidationError as error:
                            self.problems.append(
                                f"{self.name}: frame off schemas/sse-frame.json "
                                f"({error.message[:120]}): {raw[:200]!r}"
                            )
                        if frame.get("type") == "heartbeat":
                            segment.heartbeats += 1
                            continue
                        segment.frames.append(frame)
                        self.received_types.append(frame.get("type", ""))
                if buffer:
                    self.problems.append(
                        f"{self.name}: the stream ended inside a frame: {buffer[:200]!r}"
                    )
        except httpx.ReadTimeout:
            tick()
            segment.ending = "timeout"
            return 200, 0.0
        except (
            httpx.RemoteProtocolError
        ) as error:  # the connection dropped mid-response (a peer died)
            tick()
            if not (segment.frames or segment.heartbeats):
                raise
            segment.ending = f"error: {error}"
            return 200, 0.0
        tick()
        if segment.reconnect_at is not None:
            segment.ending = "reconnect"
        elif segment.frames and segment.frames[-1].get("type") in TERMINAL:
            segment.ending = "terminal"
        else:
            segment.ending = "closed"
        return 200, 0.0


async def wait_listeners(listeners: Sequence[Listener], timeout: float) -> list[str]:
    """Wait for the listeners to end; those still open after `timeout` seconds are cancelled
    and named (a listener that never ends is a failure of its own)."""
    tasks = [listener.task for listener in listeners if listener.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    hung = []
    for listener in listeners:
        if listener.task is not None and not listener.task.done():
            listener.task.cancel()
            with contextlib.suppress(BaseException):
                await listener.task
            frames = sum(len(s.frames) for s in listener.segments)
            hung.append(
                f"{listener.name}: still open {timeout:.0f} s later "
                f"({frames} frames in finished segments)"
            )
            listener.problems.append(hung[-1])
    for listener in listeners:
        if (
            listener.task is not None
            and listener.task.done()
            and not listener.task.cancelled()
            and listener.task.exception()
        ):
            listener.problems.append(
                f"{listener.name}: the listener crashed: {listener.task.exception()!r}"
            )
    return hung


async def wait_frames(
    listener: Listener, count: int, timeout: float = 20, kind: str | None = None
) -> None:
    """Wait until `listener` has received `count` frames (of type `kind`, when given; reconnect
    frames included), all its connections together."""
    deadline = time.monotonic() + timeout
    while (listener.received if kind is None else listener.received_types.count(kind)) < count:
        if listener.task is not None and listener.task.done():
            raise AssertionError(
                f"{listener.name}: ended with {listener.received_types} "
                f"before {count} {kind or 'frames'}: "
                f"{listener.problems}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{listener.name}: fewer than {count} {kind or 'frames'} after {timeout} s: "
                f"{listener.received_types}"
            )
        await asyncio.sleep(0.02)
