"""The fan-out workload: thousands of SSE listeners on one run, and the delay of each delivery.

A scripted run first waits for the listeners to connect, then publishes a tool_call and a
tool_result each tick; the delay of a delivery is its arrival less the event's `timestamp`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import time
from typing import Any

import orjson

from bench.deploy import Deployment
from bench.http import Connection, HTTPError, SSERecorder, open_sse, open_stamped_sse
from bench.stats import MiB, cpu_delta, rounded, summary


def _fanout_script(connect_wait_ms: int, ticks: int, tick_ms: int) -> str:
    """A run that waits for the listeners, then publishes a tool_call and a tool_result a tick."""
    tick = {"tool": "get_available_integrations", "input": {}, "say": "tick ", "sleep_ms": tick_ms}
    steps = [
        {
            "tool": "get_available_integrations",
            "input": {},
            "say": "waiting ",
            "sleep_ms": connect_wait_ms,
        }
    ]
    steps += [dict(tick) for _ in range(ticks)]
    steps.append({"say": "fan-out finished", "sleep_ms": tick_ms})
    return json.dumps({"script": steps})


def _parse_ts(value: str) -> float:
    return datetime.datetime.fromisoformat(value).timestamp()


async def _start_run(dep: Deployment, connect_wait_ms: int, ticks: int, tick_ms: int) -> str:
    """POST the fan-out run; the path of its stream."""
    conn = Connection("127.0.0.1", dep.http_port, dep.headers())
    status, _, raw = await conn.request(
        "POST",
        "/assistant/chat",
        orjson.dumps({"message": _fanout_script(connect_wait_ms, ticks, tick_ms)}),
    )
    conn.close()
    if status != 200:
        raise RuntimeError(f"fan-out run refused: {status} {raw[:300]!r}")
    turn = orjson.loads(raw)
    return str(turn["stream_url"])


class _Audience:
    """The listeners of one stream: how each connect ended (`outcome`) and their recorders."""

    def __init__(
        self, dep: Deployment, path: str, listeners: int, connect_parallel: int, stamped: bool
    ) -> None:
        self.dep, self.path, self.listeners, self.stamped = dep, path, listeners, stamped
        self.gate = asyncio.Semaphore(connect_parallel)
        self.connected = 0
        self.all_connected = asyncio.Event()
        self.outcome: dict[str, int] = {}
        self.recorders: list[SSERecorder] = []

    def _settle(self, key: str) -> None:
        self.outcome[key] = self.outcome.get(key, 0) + 1
        self.connected += 1
        if self.connected >= self.listeners:
            self.all_connected.set()

    async def listen(self) -> None:
        """One listener until its stream closes. It records raw bytes only (SSERecorder);
        frames are parsed after the run, so the client's per-frame cost while the delay is
        measured is one data_received call."""
        dep = self.dep
        try:
            async with self.gate:
                recorder = await (open_stamped_sse if self.stamped else open_sse)(
                    "127.0.0.1", dep.http_port, self.path, dep.headers()
                )
                self.recorders.append(recorder)
                status = await recorder.status
            self._settle("connected" if status == 200 else f"status {status}")
        except (HTTPError, OSError) as exc:
            self._settle(f"connect failed {type(exc).__name__}: {str(exc)[:80]}")
            return
        if status != 200 and recorder.transport is not None:
            recorder.transport.close()
        await recorder.closed


@dataclasses.dataclass
class _Live:
    """The deployment over the live part of the run, from "all connected" to its end."""

    budget: float  # seconds given to the deliveries
    unfinished: int  # listeners still open when the budget ran out
    rss_connected: dict[str, int]
    rss_peak: dict[str, int]
    cpu: dict[str, float]  # CPU seconds per service
    client_cpu: float


async def _follow_live(
    dep: Deployment,
    tasks: list[asyncio.Task[None]],
    started: float,
    connect_wait_ms: int,
    ticks: int,
    tick_ms: int,
) -> _Live:
    """Wait for the listeners to finish (the run's end plus as long again and 30 s), sampling
    the services' peak RSS each second; cancels the listeners left."""
    await asyncio.sleep(min(2.0, tick_ms / 1000))
    rss_connected = dep.rss()
    peak = dict(rss_connected)
    cpu_live0, client_live0 = dep.cpu(), time.process_time()

    async def sample() -> None:
        while True:
            await asyncio.sleep(1.0)
            for name, value in dep.rss().items():
                peak[name] = max(peak[name], value)

    sampler = asyncio.create_task(sample())
    # The run's last tick is due at started + wait + (ticks + 1) ticks; delivery gets as long
    # again, plus 30 s.
    due = started + connect_wait_ms / 1000 + (ticks + 1) * tick_ms / 1000
    budget = max(due - time.time(), 0) + (ticks + 1) * tick_ms / 1000 + 30
    _, pending = await asyncio.wait(tasks, timeout=budget)
    sampler.cancel()
    cpu_live = cpu_delta(cpu_live0, dep.cpu())
    client_live = time.process_time() - client_live0
    for task in pending:
        task.cancel()
    return _Live(budget, len(pending), rss_connected, peak, cpu_live, client_live)


@dataclasses.dataclass
class _Deliveries:
    """What the listeners received, read from their recorders after the run."""

    frames: int = 0
    heartbeats: int = 0
    delays: list[float] = dataclasses.field(default_factory=list)
    # the same deliveries, arrival = the kernel's receive time (socket_stamps)
    socket_delays: list[float] = dataclasses.field(default_factory=list)
    events: set[str] = dataclasses.field(default_factory=set)
    # per live event (type, publication): its earliest and latest delivery delay
    first: dict[tuple[str, float], float] = dataclasses.field(default_factory=dict)
    last: dict[tuple[str, float], float] = dataclasses.field(default_factory=dict)


def _read_deliveries(
    recorders: list[SSERecorder], live_from: float, socket_stamps: bool, outcome: dict[str, int]
) -> _Deliveries:
    """The deliveries of events published from `live_from` on; counts each recorder's end
    (`done` or broken) into `outcome`."""
    got = _Deliveries()
    first, last = got.first, got.last
    for recorder in recorders:
        finished = False
        stamped = recorder.frames(at_socket=True) if socket_stamps else []
        for number, (arrival, raw) in enumerate(recorder.frames()):
            got.frames += 1
            frame = orjson.loads(raw)
            kind = frame.get("type")
            if kind == "heartbeat":
                got.heartbeats += 1
            elif kind in ("tool_call", "tool_result"):
                published = _parse_ts(frame["data"]["timestamp"])
                if published >= live_from:
                    got.delays.append(arrival - published)
                    if stamped:
                        got.socket_delays.append(stamped[number][0] - published)
                    got.events.add(frame["data"]["timestamp"])
                    first[(kind, published)] = min(
                        first.get((kind, published), 1e9), arrival - published
                    )
                    last[(kind, published)] = max(
                        last.get((kind, published), -1e9), arrival - published
                    )
            elif kind == "done":
                finished = True
        if finished:
            outcome["done"] = outcome.get("done", 0) + 1
        elif recorder.error:
            key = f"broken {recorder.error[:80]}"
            outcome[key] = outcome.get(key, 0) + 1
    return got


def _figures(
    dep: Deployment,
    audience: _Audience,
    connect_s: float,
    connect_parallel: int,
    connected_at_cap: int,
    rss0: dict[str, int],
    live: _Live,
    got: _Deliveries,
    tick_ms: int,
) -> dict[str, Any]:
    """The fan-out's JSON record."""
    peak, first, last = live.rss_peak, got.first, got.last
    per = {
        name: (peak[name] - rss0[name]) / max(1, connected_at_cap)
        for name in ("gateway", "orchestrator")
    }
    return {
        "listeners": audience.listeners,
        "connect_s": rounded(connect_s),
        "connect_parallel": connect_parallel,
        "connected_when_measured": connected_at_cap,
        "connect_capped": connected_at_cap < audience.listeners,
        "connects_per_s": rounded(connected_at_cap / connect_s if connect_s else 0.0),
        "outcome": audience.outcome,
        "unfinished": live.unfinished,
        "heartbeats": got.heartbeats,
        "frames": got.frames,
        "live_events_measured": len(got.events),
        "deliveries_measured": len(got.delays),
        "delivery_wait_s": rounded(live.budget, 1),
        "delay": summary(got.delays),
        "delay_at_socket": summary(got.socket_delays) if audience.stamped else None,
        # CPU seconds from "all connected" to the end of the run (ticks, heartbeats, done), and
        # the client's.
        "cpu_s_live": {k: rounded(v, 2) for k, v in live.cpu.items()},
        "client_cpu_s_live": rounded(live.client_cpu, 2),
        # Per live event: delay to its first listener (upstream: orchestrator, gRPC, the gateway's
        # pump) and from its first to its last listener (the fan-out itself).
        "first_delivery": summary(list(first.values())),
        "fanout_spread": summary([last[k] - first[k] for k in first]),
        "delay_by_type": {
            t: summary([v for (kind, _), v in first.items() if kind == t])
            for t in ("tool_call", "tool_result")
        },
        "rss_before_mib": {k: rounded(v / MiB, 1) for k, v in rss0.items()},
        "rss_connected_mib": {k: rounded(v / MiB, 1) for k, v in live.rss_connected.items()},
        "rss_peak_mib": {k: rounded(v / MiB, 1) for k, v in peak.items()},
        "gateway_rss_mib": rounded(peak["gateway"] / MiB, 1),
        "kib_per_listener": {k: rounded(v / 1024, 1) for k, v in per.items()},
        "tick_ms": tick_ms,
        "heartbeat_s": dep.heartbeat_s,
    }


async def workload_fanout(
    dep: Deployment,
    listeners: int,
    ticks: int,
    tick_ms: int,
    connect_parallel: int,
    connect_cap_s: float,
    socket_stamps: bool = True,
) -> dict[str, Any]:
    """`listeners` SSE clients on one run; delay = arrival - the event's `timestamp` (publication).

    The arrival is when the client read the bytes (`delay`: the verdict against the target, the
    client's own scheduling on the shared cores included) and, with `socket_stamps`
    (StampedSSERecorder, Linux), also when the kernel received them into the listener's socket
    (`delay_at_socket`: the gateway's share, what a listener on another machine would see less
    the network)."""
    rss0 = dep.rss()
    # The run's first step waits for the listeners to connect (~6 ms per listener, capped; a
    # connect takes 1-2 ms on a busy 2-core machine), so that every later tick is live for all of
    # them; heartbeats flow meanwhile.
    connect_wait_ms = int(min(max(2500 * dep.heartbeat_s, listeners * 6), connect_cap_s * 1000))
    path = await _start_run(dep, connect_wait_ms, ticks, tick_ms)
    started = time.time()
    audience = _Audience(dep, path, listeners, connect_parallel, socket_stamps)
    tasks = [asyncio.create_task(audience.listen()) for _ in range(listeners)]
    try:  # past the cap, measure with the listeners connected so far (the rest keep trying)
        await asyncio.wait_for(audience.all_connected.wait(), connect_cap_s)
    except TimeoutError:
        pass
    t_all = time.time()
    connect_s = t_all - started
    connected_at_cap = audience.outcome.get("connected", 0)
    live = await _follow_live(dep, tasks, started, connect_wait_ms, ticks, tick_ms)
    for recorder in audience.recorders:
        if recorder.transport is not None:
            recorder.transport.close()
    got = _read_deliveries(audience.recorders, t_all + 0.05, socket_stamps, audience.outcome)
    return _figures(
        dep, audience, connect_s, connect_parallel, connected_at_cap, rss0, live, got, tick_ms
    )
