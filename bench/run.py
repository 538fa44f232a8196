"""`make bench`: turn latency, throughput, stream fan-out, admission and memory of Loopline.

Starts the real processes with scripts/dev.py (free ports, a temporary data directory),
runs the workloads of issue 9 against them over HTTP/SSE and gRPC, prints a table of
each figure beside its target and writes everything as JSON under bench/results/.
See docs/performance.md for what is measured, how, and the latest numbers.

    .venv/bin/python -m bench                 # the full suite (a few minutes)
    .venv/bin/python -m bench --quick         # small sizes, well under a minute of load
    .venv/bin/python -m bench --backend postgres --only latency,throughput
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import pathlib
import platform
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson

from bench.deploy import ROOT, SERVICES, Deployment
from bench.http import Connection, HTTPError, SSERecorder, open_sse, open_stamped_sse
from services import grpc_core  # noqa: F401 - the services' gRPC core settings for this client's calls too

WORKLOADS = ("latency", "throughput", "admission", "fanout", "tools")
MiB = 1024 * 1024

# One tool call, then an answer in 10 chunks (11 words -> 10 chunks).
TURN_MESSAGE = json.dumps(
    {
        "script": [
            {"tool": "get_available_integrations", "input": {}},
            {"say": "The benchmark turn answers in exactly ten chunks of text here.", "chunks": 10},
        ]
    }
)

TARGETS = {
    "latency.done_p50_ms": ("<=", 20.0),
    "latency.done_p99_ms": ("<=", 50.0),
    "throughput.c32.turns_per_s": (">=", 250.0),
    "latency.cpu_ms_per_turn": ("<=", 6.0),
    "throughput.c32.cpu_ms_per_turn": ("<=", 6.0),
    "fanout.10000.gateway_rss_mib": ("<=", 1024.0),
    "fanout.10000.delay_p99_ms": ("<=", 50.0),
    "admission.pairs_per_s": (">=", 2000.0),
    "admission.pair_p99_ms": ("<=", 5.0),
    "memory.idle_total_mib": ("<=", 300.0),
    "memory.idle_pss_total_mib": ("<=", 300.0),
    "memory.idle_together_mib": ("<=", 300.0),
}


def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) of `values`, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]


def summary(values_s: list[float]) -> dict[str, float | None]:
    """p50/p95/p99/max in milliseconds of latencies given in seconds."""
    ms = [v * 1000 for v in values_s]
    return {
        "p50_ms": _r(pct(ms, 50)),
        "p95_ms": _r(pct(ms, 95)),
        "p99_ms": _r(pct(ms, 99)),
        "max_ms": _r(max(ms) if ms else None),
        "mean_ms": _r(sum(ms) / len(ms) if ms else None),
    }


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


# ----------------------------------------------------------------------------- turns


class TurnResult:
    __slots__ = ("ok", "first_s", "done_s", "error", "post_s")

    def __init__(
        self,
        ok: bool,
        first_s: float = 0.0,
        done_s: float = 0.0,
        error: str = "",
        post_s: float = 0.0,
    ) -> None:
        self.ok, self.first_s, self.done_s, self.error, self.post_s = (
            ok,
            first_s,
            done_s,
            error,
            post_s,
        )


async def one_turn(conn: Connection, body: bytes) -> TurnResult:
    """POST a turn, then read its stream to `done` on the same keep-alive connection."""
    start = time.time()
    try:
        status, _, raw = await conn.request("POST", "/assistant/chat", body)
        if status != 200:
            return TurnResult(False, error=f"POST {status}: {raw[:200].decode(errors='replace')}")
        posted = time.time()
        turn = orjson.loads(raw)
        status, frames = await conn.stream(turn["stream_url"])
        if status != 200:
            return TurnResult(False, error=f"GET stream {status}")
        first = done = None
        last_type = None
        async for arrival, frame in frames:
            if first is None:
                first = arrival
            last_type = frame.get("type")
            if last_type == "done":
                done = arrival
                if frame["data"].get("error"):
                    return TurnResult(False, error="done with error: true")
        if done is None:
            return TurnResult(False, error=f"stream ended without done (last {last_type})")
        return TurnResult(True, first - start, done - start, post_s=posted - start)
    except (HTTPError, OSError, asyncio.IncompleteReadError, KeyError, ValueError) as exc:
        conn.close()
        return TurnResult(False, error=f"{type(exc).__name__}: {exc}")


async def run_turns(
    dep: Deployment, total: int, concurrency: int, time_cap_s: float
) -> tuple[list[TurnResult], float]:
    """`total` turns by `concurrency` workers (one keep-alive connection each), stopped at `time_cap_s`."""
    body = orjson.dumps({"message": TURN_MESSAGE})
    results: list[TurnResult] = []
    remaining = total
    deadline = time.monotonic() + time_cap_s

    async def worker() -> None:
        nonlocal remaining
        conn = Connection("127.0.0.1", dep.http_port, dep.headers())
        try:
            while remaining > 0 and time.monotonic() < deadline:
                remaining -= 1
                results.append(await one_turn(conn, body))
        finally:
            conn.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.monotonic() - started


def _errors(results: list[TurnResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            counts[r.error[:160]] = counts.get(r.error[:160], 0) + 1
    return counts


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


async def workload_latency(dep: Deployment, turns: int, warmup: int) -> dict[str, Any]:
    await run_turns(dep, warmup, 1, 60)
    cpu0, client0 = dep.cpu(), time.process_time()
    results, elapsed = await run_turns(dep, turns, 1, 600)
    cpu = _cpu_delta(cpu0, dep.cpu())
    client_cpu = time.process_time() - client0
    ok = [r for r in results if r.ok]
    n = max(1, len(results))
    return {
        "turns": len(results),
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": _errors(results),
        "elapsed_s": _r(elapsed),
        "done": summary([r.done_s for r in ok]),
        "first_frame": summary([r.first_s for r in ok]),
        "post_response": summary([r.post_s for r in ok]),
        "cpu_ms_per_turn": _r(sum(cpu.values()) * 1000 / n),
        "cpu_ms_per_turn_by_service": {k: _r(v * 1000 / n) for k, v in cpu.items()},
        "client_cpu_ms_per_turn": _r(client_cpu * 1000 / n),
    }


async def workload_throughput(
    dep: Deployment, turns: int, levels: list[int], time_cap_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in levels:
        await run_turns(dep, level, level, 30)  # open the connections, warm the paths
        cpu0, client0 = dep.cpu(), time.process_time()
        results, elapsed = await run_turns(dep, turns, level, time_cap_s)
        cpu = _cpu_delta(cpu0, dep.cpu())
        client_cpu = time.process_time() - client0
        ok = [r for r in results if r.ok]
        n = max(1, len(results))
        out[f"c{level}"] = {
            "concurrency": level,
            "turns": len(results),
            "completed": len(ok),
            "failures": len(results) - len(ok),
            "errors": _errors(results),
            "elapsed_s": _r(elapsed),
            "time_capped": len(results) < turns,
            "turns_per_s": _r(len(ok) / elapsed if elapsed else 0.0),
            "done": summary([r.done_s for r in ok]),
            "first_frame": summary([r.first_s for r in ok]),
            "cpu_ms_per_turn": _r(sum(cpu.values()) * 1000 / n),
            "cpu_ms_per_turn_by_service": {k: _r(v * 1000 / n) for k, v in cpu.items()},
            "client_cpu_ms_per_turn": _r(client_cpu * 1000 / n),
        }
        print(
            f"[bench]   concurrency {level}: {out[f'c{level}']['turns_per_s']} turns/s, "
            f"{len(ok)}/{len(results)} done, p50 {out[f'c{level}']['done']['p50_ms']} ms",
            flush=True,
        )
    return out


# ----------------------------------------------------------------------------- admission


async def _drive_pairs(
    pair: Callable[[], Awaitable[tuple[float, float]]],
    pairs: int,
    concurrency: int,
    time_cap_s: float,
    cpu: Callable[[], float],
) -> dict[str, Any]:
    """Run `pairs` calls of `pair()` (returning the seconds of its two calls) on `concurrency`
    workers, capped at `time_cap_s`; pairs/s, percentiles of the pair and of each call, errors,
    and the server's CPU ms per pair (`cpu()` is its CPU seconds)."""
    import grpc

    pair_s: list[float] = []
    first_s: list[float] = []
    second_s: list[float] = []
    errors: dict[str, int] = {}
    remaining = pairs
    deadline = time.monotonic() + time_cap_s

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            try:
                a, b = await pair()
            except grpc.aio.AioRpcError as error:
                key = f"{error.code().name}: {error.details()}"[:160]
                errors[key] = errors.get(key, 0) + 1
                continue
            first_s.append(a)
            second_s.append(b)
            pair_s.append(a + b)

    for _ in range(20):  # warm-up (the organization's account is created on the first Admit)
        await pair()
    cpu0 = cpu()
    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    server_cpu = cpu() - cpu0
    return {
        "concurrency": concurrency,
        "pairs": len(pair_s),
        "failures": sum(errors.values()),
        "errors": errors,
        "elapsed_s": _r(elapsed),
        "pairs_per_s": _r(len(pair_s) / elapsed if elapsed else 0.0),
        "pair": summary(pair_s),
        "first": summary(first_s),
        "second": summary(second_s),
        "server_cpu_ms_per_pair": _r(server_cpu * 1000 / max(1, len(pair_s))),
    }


async def workload_admission(
    dep: Deployment, pairs: int, concurrency: int, time_cap_s: float
) -> dict[str, Any]:
    """`Admit`+`Charge` pairs on billing over gRPC at `concurrency`, then the same number of pairs
    of two bare `grpc.health.v1` Checks on the same billing process and channel: the ceiling any
    pair of unary calls reaches on this machine with this client (reported as `bare_grpc`)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from loopline.billing.v1 import billing_pb2, billing_pb2_grpc

    org = f"org_bench_admit_{uuid.uuid4().hex[:8]}"  # auto-provisioned on the bench developer plan
    channel = grpc.aio.insecure_channel(
        dep.grpc_addr["billing"], options=[("grpc.enable_http_proxy", 0)]
    )
    stub = billing_pb2_grpc.BillingServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest(service="")

    async def admit_charge() -> tuple[float, float]:
        t0 = time.perf_counter()
        admitted = await stub.Admit(
            billing_pb2.AdmitRequest(
                organization_id=org,
                turn_key=f"{uuid.uuid4()}:{uuid.uuid4()}",
                usage_type="run",
                rate_class="sync_exec",
            ),
            timeout=10,
        )
        t1 = time.perf_counter()
        await stub.Charge(
            billing_pb2.ChargeRequest(reservation_id=admitted.reservation_id), timeout=10
        )
        return t1 - t0, time.perf_counter() - t1

    async def two_checks() -> tuple[float, float]:
        t0 = time.perf_counter()
        await health.Check(check, timeout=10)
        t1 = time.perf_counter()
        await health.Check(check, timeout=10)
        return t1 - t0, time.perf_counter() - t1

    def billing_cpu() -> float:
        return dep.cpu()["billing"]

    try:
        result = await _drive_pairs(admit_charge, pairs, concurrency, time_cap_s, billing_cpu)
        bare = await _drive_pairs(two_checks, pairs, concurrency, time_cap_s, billing_cpu)
    finally:
        await channel.close()
    result["admit"], result["charge"] = result.pop("first"), result.pop("second")
    result["billing_cpu_ms_per_pair"] = result.pop("server_cpu_ms_per_pair")
    result["bare_grpc"] = {
        key: bare[key]
        for key in ("pairs", "failures", "pairs_per_s", "pair", "server_cpu_ms_per_pair")
    }
    return result


# ----------------------------------------------------------------------------- tools (issue 6)


def _corpus_paragraph(rng: Any, vocabulary: list[str], chars: int = 900) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


async def workload_tools(dep: Deployment, calls: int, chunks: int, searches: int) -> dict[str, Any]:
    """The overhead of a no-op tool call and search latency over `chunks` chunks, over gRPC.

    No-op: ExecuteTool(execute_integration_tool loopline.echo) sequentially, beside a
    grpc.health.v1 Check on the same channel as the bare round-trip baseline; the overhead is
    the difference of the medians. Search: a knowledge base filled with `chunks` chunks of
    ~900 characters of pseudo-words (100 chunks per document), then `searches` SearchKnowledge
    calls with two-word queries, top_k 5.
    """
    import random

    import grpc
    from google.protobuf import struct_pb2
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc

    org = f"org_bench_tools_{uuid.uuid4().hex[:8]}"
    channel = grpc.aio.insecure_channel(
        dep.grpc_addr["tools"],
        options=[("grpc.enable_http_proxy", 0), ("grpc.max_send_message_length", 64 << 20)],
    )
    stub = tools_pb2_grpc.ToolsServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    echo_input = struct_pb2.Struct()
    echo_input.update(
        {"integration": "loopline", "action": "echo", "parameters": {"message": "ping"}}
    )
    try:
        for _ in range(20):  # warm-up
            await stub.ExecuteTool(
                tools_pb2.ExecuteToolRequest(
                    organization_id=org, tool="execute_integration_tool", input=echo_input
                ),
                timeout=10,
            )
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        tool_s, health_s = [], []
        cpu0 = dep.cpu()["tools"]
        for i in range(calls):
            t0 = time.perf_counter()
            response = await stub.ExecuteTool(
                tools_pb2.ExecuteToolRequest(
                    organization_id=org,
                    tool="execute_integration_tool",
                    input=echo_input,
                    run_id="bench",
                    tool_call_id=f"c{i}",
                ),
                timeout=10,
            )
            t1 = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            t2 = time.perf_counter()
            if not response.success:
                raise RuntimeError(f"echo failed: {response.error}")
            tool_s.append(t1 - t0)
            health_s.append(t2 - t1)
        tools_cpu = dep.cpu()["tools"] - cpu0

        rng = random.Random(20261130)
        vocabulary = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))
            for _ in range(5000)
        ]
        base = (
            await stub.CreateKnowledgeBase(
                tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name="bench corpus"),
                timeout=30,
            )
        ).knowledge_base
        loaded = 0
        load_started = time.monotonic()
        per_document = 100
        while loaded < chunks:
            count = min(per_document, chunks - loaded)
            text = "\n\n".join(_corpus_paragraph(rng, vocabulary) for _ in range(count))
            await stub.AddDocument(
                tools_pb2.AddDocumentRequest(
                    organization_id=org,
                    knowledge_base_id=base.knowledge_base_id,
                    name=f"doc{loaded}.txt",
                    content_type="text/plain",
                    text=text,
                ),
                timeout=120,
            )
            loaded += count
        load_s = time.monotonic() - load_started
        search_s: list[float] = []
        hits = 0
        for _ in range(searches):
            query = f"{rng.choice(vocabulary)} {rng.choice(vocabulary)}"
            t0 = time.perf_counter()
            found = await stub.SearchKnowledge(
                tools_pb2.SearchKnowledgeRequest(
                    organization_id=org,
                    query=query,
                    knowledge_base_ids=[base.knowledge_base_id],
                    top_k=5,
                ),
                timeout=30,
            )
            search_s.append(time.perf_counter() - t0)
            hits += len(found.results)
    finally:
        await channel.close()
    tool_summary, health_summary = summary(tool_s), summary(health_s)
    overhead = (tool_summary["p50_ms"] or 0) - (health_summary["p50_ms"] or 0)
    return {
        "noop_calls": len(tool_s),
        "noop_tool_call": tool_summary,
        "grpc_roundtrip": health_summary,
        "noop_overhead_p50_ms": _r(overhead),
        "tools_cpu_ms_per_noop_call": _r(tools_cpu * 1000 / max(1, len(tool_s))),
        "chunks": loaded,
        "load_s": _r(load_s),
        "searches": len(search_s),
        "search": summary(search_s),
        "mean_results_per_search": _r(hits / max(1, len(search_s))),
    }


# ----------------------------------------------------------------------------- fan-out


def _fanout_script(connect_wait_ms: int, ticks: int, tick_ms: int) -> str:
    """A run that waits for the listeners, then publishes a tool_call and a tool_result every tick."""
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


async def workload_fanout(
    dep: Deployment,
    listeners: int,
    ticks: int,
    tick_ms: int,
    connect_parallel: int,
    connect_cap_s: float,
    socket_stamps: bool = True,
) -> dict[str, Any]:
    """`listeners` SSE clients on one run; delay = arrival - the event's own `timestamp` (set at publication).

    The arrival is when the client read the bytes (`delay`: the verdict against the target, the
    client's own scheduling on the shared cores included) and, with `socket_stamps`
    (StampedSSERecorder, Linux), also when the kernel received them into the listener's socket
    (`delay_at_socket`: the gateway's share, what a listener on another machine would see less
    the network)."""
    rss0 = dep.rss()
    # The run's first step waits for the listeners to connect (~6 ms per listener allowed: measured
    # 1-2 ms on a busy 2-core machine since the shared hub; was 17 before; capped), so that every later
    # tick is live for all of them; heartbeats flow meanwhile.
    connect_wait_ms = int(min(max(2500 * dep.heartbeat_s, listeners * 6), connect_cap_s * 1000))
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
    path = turn["stream_url"]
    started = time.time()
    gate = asyncio.Semaphore(connect_parallel)
    connected = 0
    all_connected = asyncio.Event()
    outcome: dict[str, int] = {}
    heartbeats = 0
    frames_total = 0

    def settle(key: str) -> None:
        nonlocal connected
        outcome[key] = outcome.get(key, 0) + 1
        connected += 1
        if connected >= listeners:
            all_connected.set()

    recorders: list[SSERecorder] = []

    async def listener() -> None:
        # Records raw bytes only (SSERecorder); frames are parsed after the run, so the client's
        # per-frame cost while the delay is measured is one data_received call.
        try:
            async with gate:
                recorder = await (open_stamped_sse if socket_stamps else open_sse)(
                    "127.0.0.1", dep.http_port, path, dep.headers()
                )
                recorders.append(recorder)
                status = await recorder.status
            settle("connected" if status == 200 else f"status {status}")
        except (HTTPError, OSError) as exc:
            settle(f"connect failed {type(exc).__name__}: {str(exc)[:80]}")
            return
        if status != 200:
            recorder.transport.close()
        await recorder.closed

    tasks = [asyncio.create_task(listener()) for _ in range(listeners)]
    try:  # past the cap, measure with the listeners connected so far (the rest keep trying)
        await asyncio.wait_for(all_connected.wait(), connect_cap_s)
    except TimeoutError:
        pass
    t_all = time.time()
    connect_s = t_all - started
    connected_at_cap = outcome.get("connected", 0)
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
    # The run's last tick is due at started + wait + (ticks + 1) ticks; give delivery as long again, plus 30 s.
    due = started + connect_wait_ms / 1000 + (ticks + 1) * tick_ms / 1000
    budget = max(due - time.time(), 0) + (ticks + 1) * tick_ms / 1000 + 30
    done, pending = await asyncio.wait(tasks, timeout=budget)
    sampler.cancel()
    cpu_live = _cpu_delta(cpu_live0, dep.cpu())
    client_live = time.process_time() - client_live0
    for task in pending:
        task.cancel()
    for recorder in recorders:
        if recorder.transport is not None:
            recorder.transport.close()
    live_delays: list[float] = []
    socket_delays: list[
        float
    ] = []  # the same deliveries, arrival = the kernel's receive time (socket_stamps)
    live_events = set()
    first: dict[
        tuple[str, float], float
    ] = {}  # per live event: its earliest and latest delivery delay
    last: dict[tuple[str, float], float] = {}
    margin = t_all + 0.05
    for recorder in recorders:
        finished = False
        stamped = recorder.frames(at_socket=True) if socket_stamps else []
        for number, (arrival, raw) in enumerate(recorder.frames()):
            frames_total += 1
            frame = orjson.loads(raw)
            kind = frame.get("type")
            if kind == "heartbeat":
                heartbeats += 1
            elif kind in ("tool_call", "tool_result"):
                published = _parse_ts(frame["data"]["timestamp"])
                if published >= margin:
                    live_delays.append(arrival - published)
                    if stamped:
                        socket_delays.append(stamped[number][0] - published)
                    live_events.add(frame["data"]["timestamp"])
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
    per = {
        name: (peak[name] - rss0[name]) / max(1, connected_at_cap)
        for name in ("gateway", "orchestrator")
    }
    return {
        "listeners": listeners,
        "connect_s": _r(connect_s),
        "connect_parallel": connect_parallel,
        "connected_when_measured": connected_at_cap,
        "connect_capped": connected_at_cap < listeners,
        "connects_per_s": _r(connected_at_cap / connect_s if connect_s else 0.0),
        "outcome": outcome,
        "unfinished": len(pending),
        "heartbeats": heartbeats,
        "frames": frames_total,
        "live_events_measured": len(live_events),
        "deliveries_measured": len(live_delays),
        "delivery_wait_s": _r(budget, 1),
        "delay": summary(live_delays),
        "delay_at_socket": summary(socket_delays) if socket_stamps else None,
        # CPU seconds from "all connected" to the end of the run (ticks, heartbeats, done), and the client's.
        "cpu_s_live": {k: _r(v, 2) for k, v in cpu_live.items()},
        "client_cpu_s_live": _r(client_live, 2),
        # Per live event: delay to its first listener (upstream: orchestrator, gRPC, the gateway's pump)
        # and from its first to its last listener (the fan-out itself).
        "first_delivery": summary(list(first.values())),
        "fanout_spread": summary([last[k] - first[k] for k in first]),
        "delay_by_type": {
            t: summary([v for (kind, _), v in first.items() if kind == t])
            for t in ("tool_call", "tool_result")
        },
        "rss_before_mib": {k: _r(v / MiB, 1) for k, v in rss0.items()},
        "rss_connected_mib": {k: _r(v / MiB, 1) for k, v in rss_connected.items()},
        "rss_peak_mib": {k: _r(v / MiB, 1) for k, v in peak.items()},
        "gateway_rss_mib": _r(peak["gateway"] / MiB, 1),
        "kib_per_listener": {k: _r(v / 1024, 1) for k, v in per.items()},
        "tick_ms": tick_ms,
        "heartbeat_s": dep.heartbeat_s,
    }


# ----------------------------------------------------------------------------- report


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in pathlib.Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def cpu_jiffies(stat: pathlib.Path = pathlib.Path("/proc/stat")) -> list[int] | None:
    """The machine's CPU time so far, all cores together, from the first line of /proc/stat
    (proc(5)): user, nice, system, idle, iowait, irq, softirq, steal, in USER_HZ ticks; None
    where it cannot be read (not Linux). `guest` time is already inside `user` and not repeated."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        if fields[0] != "cpu":
            return None
        return [int(x) for x in fields[1:9]] + [0] * (9 - len(fields))
    except (OSError, ValueError, IndexError):
        return None


def steal_pct(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share (%) of the machine's CPU time between two `cpu_jiffies` readings that the
    hypervisor gave to other guests (proc(5) "steal"): a contended virtual machine runs every
    workload slower than its cores' own speed, which the calibration loop may not show. None
    without both readings or when no time passed."""
    if before is None or after is None:
        return None
    total = sum(after) - sum(before)
    return _r(100 * (after[7] - before[7]) / total, 1) if total > 0 else None


STEAL_NOTE_PCT = 2.0  # a workload with this much steal or more gets a note under the table


class StealMeter:
    """`with steal("latency"):` records `steal_pct` over the block under that name (`by_workload`)."""

    def __init__(self) -> None:
        self.by_workload: dict[str, float | None] = {}

    @contextlib.contextmanager
    def __call__(self, workload: str) -> Iterator[None]:
        before = cpu_jiffies()
        try:
            yield
        finally:
            self.by_workload[workload] = steal_pct(before, cpu_jiffies())


def calibrate() -> float:
    """CPU milliseconds of a fixed pure-Python loop (10M additions): ~400 ms on an idle modern core.

    Makes runs on busy or slow machines comparable: CPU-per-turn figures scale with it.
    """
    started = time.process_time()
    total = 0
    for i in range(10_000_000):
        total += i
    return _r((time.process_time() - started) * 1000, 1)


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    try:
        mem_total = (
            int(
                next(
                    l
                    for l in pathlib.Path("/proc/meminfo").read_text().splitlines()
                    if l.startswith("MemTotal")
                ).split()[1]
            )
            * 1024
        )
    except (OSError, StopIteration, ValueError):
        mem_total = 0
    return {
        "loadavg_start": _loadavg(),
        "calibration_cpu_ms": calibrate(),
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory_gib": _r(mem_total / 1024**3, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "services")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _lookup(results: dict[str, Any], dotted: str) -> Any:
    node: Any = results
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def figures(results: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(label, value, target text) rows of the table; targets from issue 9."""
    rows: list[tuple[str, Any, str]] = []

    def add(label: str, value: Any, key: str | None = None) -> None:
        target = ""
        if key in TARGETS and value is not None:
            op, limit = TARGETS[key]
            ok = value <= limit if op == "<=" else value >= limit
            target = f"{op} {limit:g}  {'ok' if ok else 'MISS'}"
        rows.append((label, value, target))

    lat = results.get("latency")
    if lat:
        add("turn POST->done p50 ms", lat["done"]["p50_ms"], "latency.done_p50_ms")
        add("turn POST->done p95 ms", lat["done"]["p95_ms"])
        add("turn POST->done p99 ms", lat["done"]["p99_ms"], "latency.done_p99_ms")
        add("turn POST->first frame p50 ms", lat["first_frame"]["p50_ms"])
        add("turn POST->first frame p99 ms", lat["first_frame"]["p99_ms"])
        if "post_response" in lat:
            add("turn POST->POST response p50 ms", lat["post_response"]["p50_ms"])
        add(
            "service CPU ms per turn (sequential)",
            lat["cpu_ms_per_turn"],
            "latency.cpu_ms_per_turn",
        )
        add("latency failures", lat["failures"])
    for key, level in (results.get("throughput") or {}).items():
        add(f"throughput {key} turns/s", level["turns_per_s"], f"throughput.{key}.turns_per_s")
        add(
            f"throughput {key} p50 / p99 ms",
            f"{level['done']['p50_ms']} / {level['done']['p99_ms']}",
        )
        add(
            f"throughput {key} service CPU ms/turn",
            level["cpu_ms_per_turn"],
            f"throughput.{key}.cpu_ms_per_turn",
        )
        add(f"throughput {key} done / turns", f"{level['completed']} / {level['turns']}")
    for key, fan in (results.get("fanout") or {}).items():
        add(
            f"fan-out {key}: connected / done",
            f"{fan['outcome'].get('connected', 0)} / {fan['outcome'].get('done', 0)}",
        )
        add(f"fan-out {key}: connects/s", fan.get("connects_per_s"))
        add(
            f"fan-out {key}: gateway RSS MiB",
            fan["gateway_rss_mib"],
            f"fanout.{key}.gateway_rss_mib" if key == "10000" else None,
        )
        add(
            f"fan-out {key}: KiB/listener gw / orch",
            f"{fan['kib_per_listener']['gateway']} / {fan['kib_per_listener']['orchestrator']}",
        )
        add(
            f"fan-out {key}: delay p50 / p99 ms",
            f"{fan['delay']['p50_ms']} / {fan['delay']['p99_ms']}",
        )
        if key == "10000":
            add("fan-out 10000: delay p99 ms", fan["delay"]["p99_ms"], "fanout.10000.delay_p99_ms")
        if fan.get("delay_at_socket"):
            add(
                f"fan-out {key}: delay at the socket p50 / p99 ms (kernel receive time)",
                f"{fan['delay_at_socket']['p50_ms']} / {fan['delay_at_socket']['p99_ms']}",
            )
    adm = results.get("admission")
    if adm:
        add("admission Admit+Charge pairs/s (c16)", adm["pairs_per_s"], "admission.pairs_per_s")
        add("admission pair p50 ms", adm["pair"]["p50_ms"])
        add("admission pair p99 ms", adm["pair"]["p99_ms"], "admission.pair_p99_ms")
        if "bare_grpc" in adm:
            bare = adm["bare_grpc"]
            add("bare gRPC ceiling: 2 health Checks/s on billing (c16)", bare["pairs_per_s"])
            add(
                "bare gRPC ceiling: pair p50 / p99 ms",
                f"{bare['pair']['p50_ms']} / {bare['pair']['p99_ms']}",
            )
    tl = results.get("tools")
    if tl:
        add(
            "no-op tool call p50 / p99 ms (ExecuteTool loopline.echo)",
            f"{tl['noop_tool_call']['p50_ms']} / {tl['noop_tool_call']['p99_ms']}",
        )
        add(
            "no-op tool call overhead over a bare gRPC round trip, p50 ms",
            tl["noop_overhead_p50_ms"],
        )
        add(
            f"search over {tl['chunks']} chunks p50 / p99 ms",
            f"{tl['search']['p50_ms']} / {tl['search']['p99_ms']}",
        )
    steal = (results.get("machine") or {}).get("steal_pct") or {}
    for workload, pct in steal.items():
        add(f"hypervisor steal % during {workload}", "-" if pct is None else pct)
    mem = results.get("memory")
    if mem:
        add("RSS idle, all four MiB", mem.get("idle_total_mib"), "memory.idle_total_mib")
        add(
            "PSS idle, all four MiB (shared pages split between sharers)",
            mem.get("idle_pss_total_mib"),
            "memory.idle_pss_total_mib",
        )
        add(
            "resident together idle, all four MiB (distinct pages)",
            mem.get("idle_together_mib"),
            "memory.idle_together_mib",
        )
        if mem.get("after_throughput_total_mib") is not None:
            add(
                "RSS / PSS / together after throughput, all four MiB",
                f"{mem['after_throughput_total_mib']} / {mem.get('after_throughput_pss_total_mib')} / {mem.get('after_throughput_together_mib')}",
            )
        for name in SERVICES:
            add(
                f"RSS {name} idle / after throughput MiB",
                f"{mem['idle_mib'].get(name)} / {(mem.get('after_throughput_mib') or {}).get(name)}",
            )
    return rows


def print_table(results: dict[str, Any]) -> None:
    rows = figures(results)
    width = max(len(r[0]) for r in rows) if rows else 10
    print()
    print(f"{'figure':<{width}}  {'value':>18}  target (issue 9)")
    print("-" * (width + 40))
    for label, value, target in rows:
        print(f"{label:<{width}}  {str(value):>18}  {target}")
    print()


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: 20 sequential turns, 100 per level, 100 listeners",
    )
    p.add_argument(
        "--backend",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="embedded default, or PostgreSQL + Redis",
    )
    p.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    p.add_argument(
        "--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    p.add_argument(
        "--turns", type=int, help="sequential turns of the latency workload (200; quick 20)"
    )
    p.add_argument(
        "--throughput-turns", type=int, help="turns per concurrency level (500; quick 100)"
    )
    p.add_argument("--concurrency", help="comma-separated concurrency levels (1,8,32)")
    p.add_argument("--time-cap", type=float, help="seconds per throughput level (60; quick 15)")
    p.add_argument("--listeners", help="comma-separated fan-out sizes (1000,10000; quick 100)")
    p.add_argument(
        "--ticks",
        type=int,
        help="timestamped ticks of the fan-out run after the listeners connect (10; quick 4)",
    )
    p.add_argument(
        "--tick-ms", type=int, default=1000, help="milliseconds between fan-out ticks (1000)"
    )
    p.add_argument(
        "--connect-parallel",
        type=int,
        default=256,
        help="fan-out listeners connecting at once (256)",
    )
    p.add_argument(
        "--connect-cap",
        type=float,
        default=150.0,
        help="seconds the fan-out listeners get to connect; then it measures those connected (150)",
    )
    p.add_argument(
        "--fanout-client",
        choices=("stamped", "protocol"),
        default="stamped" if sys.platform == "linux" else "protocol",
        help="fan-out listeners: raw sockets that also keep the kernel's receive time (stamped, Linux; default), "
        "or asyncio protocols (the rounds before the fourteenth)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=2.0,
        help="LOOPLINE_HEARTBEAT_INTERVAL_S of the deployment (2; 15 in production)",
    )
    p.add_argument("--admissions", type=int, help="Admit+Charge pairs (10000; quick 1000)")
    p.add_argument("--admission-concurrency", type=int, default=16)
    p.add_argument("--admission-time-cap", type=float, help="seconds (20; quick 5)")
    p.add_argument(
        "--tool-calls", type=int, help="no-op tool calls of the tools workload (500; quick 100)"
    )
    p.add_argument(
        "--chunks", type=int, help="knowledge chunks the search workload loads (10000; quick 1000)"
    )
    p.add_argument("--searches", type=int, help="searches of the tools workload (200; quick 50)")
    p.add_argument(
        "--log-level",
        default="",
        help="LOOPLINE_LOG_LEVEL of the services (their default, INFO, when empty)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        help="JSON file to write (default bench/results/<date>-<backend>.json)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary data directory and logs")
    p.add_argument(
        "--profile",
        type=pathlib.Path,
        help="record each service with py-spy during each workload into this folder (collapsed stacks)",
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the workloads, keep the services up until Enter (for profiling)",
    )
    args = p.parse_args(argv)
    q = args.quick
    args.turns = args.turns if args.turns is not None else (20 if q else 200)
    args.throughput_turns = (
        args.throughput_turns if args.throughput_turns is not None else (100 if q else 500)
    )
    args.concurrency = [int(x) for x in (args.concurrency or "1,8,32").split(",") if x]
    args.time_cap = args.time_cap if args.time_cap is not None else (15.0 if q else 60.0)
    args.listeners = [
        int(x) for x in (args.listeners or ("100" if q else "1000,10000")).split(",") if x
    ]
    args.ticks = args.ticks if args.ticks is not None else (4 if q else 10)
    args.admissions = args.admissions if args.admissions is not None else (1000 if q else 10000)
    args.admission_time_cap = (
        args.admission_time_cap if args.admission_time_cap is not None else (5.0 if q else 20.0)
    )
    args.tool_calls = args.tool_calls if args.tool_calls is not None else (100 if q else 500)
    args.chunks = args.chunks if args.chunks is not None else (1000 if q else 10000)
    args.searches = args.searches if args.searches is not None else (50 if q else 200)
    args.only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = set(args.only) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {WORKLOADS}")
    return args


def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need)) if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Profiler:
    """`py-spy record --gil` (samples of the thread holding the GIL: Python CPU) of every service while a workload runs (--profile DIR)."""

    def __init__(self, dep: Deployment, folder: pathlib.Path | None) -> None:
        self.dep, self.folder = dep, folder
        self.exe = pathlib.Path(sys.executable).with_name("py-spy")

    def __call__(self, workload: str) -> Profiler:
        self.workload = workload
        return self

    async def __aenter__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        if self.folder is None:
            return
        if not self.exe.exists():
            raise RuntimeError(f"--profile needs py-spy: {sys.executable} -m pip install py-spy")
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, pid in self.dep.pids.items():
            out = self.folder / f"{self.workload}-{name}.txt"
            self.procs.append(
                subprocess.Popen(
                    [
                        str(self.exe),
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        "250",
                        "--gil",
                        "--format",
                        "raw",
                        "-o",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        await asyncio.sleep(1.0)

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.send_signal(2)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _mib(value: int | None) -> float | None:
    return None if value is None else _r(value / MiB, 1)


async def run_all(args: argparse.Namespace, dep: Deployment, results: dict[str, Any]) -> None:
    profile = Profiler(dep, args.profile)
    steal = StealMeter()
    results["machine"]["steal_pct"] = steal.by_workload

    @contextlib.asynccontextmanager
    async def workload(name: str) -> Any:
        """Profile (--profile) and meter the hypervisor's steal over one workload."""
        with steal(name):
            async with profile(name):
                yield

    await asyncio.sleep(1.0)  # let start-up work settle before "idle"
    idle, idle_pss = dep.rss(), dep.pss()
    results["memory"] = {
        "idle_mib": {k: _r(v / MiB, 1) for k, v in idle.items()},
        "idle_total_mib": _r(sum(idle.values()) / MiB, 1),
        "idle_pss_mib": {k: _r(v / MiB, 1) for k, v in idle_pss.items()},
        "idle_pss_total_mib": _r(sum(idle_pss.values()) / MiB, 1),
        "idle_together_mib": _mib(dep.together()),
    }
    if "latency" in args.only:
        print(f"[bench] latency: {args.turns} sequential turns", flush=True)
        async with workload("latency"):
            results["latency"] = await workload_latency(dep, args.turns, warmup=min(10, args.turns))
    if "throughput" in args.only:
        print(
            f"[bench] throughput: {args.throughput_turns} turns at concurrency {args.concurrency} (cap {args.time_cap:g} s each)",
            flush=True,
        )
        async with workload("throughput"):
            results["throughput"] = await workload_throughput(
                dep, args.throughput_turns, args.concurrency, args.time_cap
            )
        after = dep.rss()
        results["memory"]["after_throughput_mib"] = {k: _r(v / MiB, 1) for k, v in after.items()}
        results["memory"]["after_throughput_total_mib"] = _r(sum(after.values()) / MiB, 1)
        results["memory"]["after_throughput_pss_total_mib"] = _r(sum(dep.pss().values()) / MiB, 1)
        results["memory"]["after_throughput_together_mib"] = _mib(dep.together())
    if "admission" in args.only:
        print(
            f"[bench] admission: {args.admissions} Admit+Charge pairs at concurrency {args.admission_concurrency}",
            flush=True,
        )
        async with workload("admission"):
            results["admission"] = await workload_admission(
                dep, args.admissions, args.admission_concurrency, args.admission_time_cap
            )
    if "fanout" in args.only:
        results["fanout"] = {}
        for n in args.listeners:
            print(f"[bench] fan-out: {n} listeners", flush=True)
            async with workload(f"fanout{n}"):
                results["fanout"][str(n)] = await workload_fanout(
                    dep,
                    n,
                    args.ticks,
                    args.tick_ms,
                    args.connect_parallel,
                    args.connect_cap,
                    socket_stamps=args.fanout_client == "stamped",
                )
            fan = results["fanout"][str(n)]
            print(
                f"[bench]   connected in {fan['connect_s']} s, outcome {fan['outcome']}, delay p50/p99 {fan['delay']['p50_ms']}/{fan['delay']['p99_ms']} ms "
                f"(first listener p50 {fan['first_delivery']['p50_ms']} ms, first-to-last spread p50 {fan['fanout_spread']['p50_ms']} ms)"
                + (
                    f"; at the socket p50/p99 {fan['delay_at_socket']['p50_ms']}/{fan['delay_at_socket']['p99_ms']} ms"
                    if fan.get("delay_at_socket")
                    else ""
                ),
                flush=True,
            )
    if "tools" in args.only:
        print(
            f"[bench] tools: {args.tool_calls} no-op tool calls; search over {args.chunks} chunks ({args.searches} searches)",
            flush=True,
        )
        async with workload("tools"):
            results["tools"] = await workload_tools(
                dep, args.tool_calls, args.chunks, args.searches
            )
    results["memory"]["final_mib"] = {k: _r(v / MiB, 1) for k, v in dep.rss().items()}


def _event_loop_policy() -> None:
    """The client runs on uvloop when it is installed: 10,000 SSE sockets cost the client less CPU
    per read than asyncio's selector loop (the client shares the cores with the services)."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _stop_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI runner, `kill`) ends the run as Ctrl-C does: `main`'s `finally`
    stops the deployment. scripts/dev.py runs in a session of its own (it must not get the
    terminal's Ctrl-C twice), so a bench killed without it left five processes running."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    fd_limit = raise_fd_limit(max(args.listeners or [0]) * 2 + 1024 if "fanout" in args.only else 0)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "note": "client and services share the machine's cores; the client's own CPU is reported where measured",
    }
    results["machine"]["client_fd_limit"] = fd_limit
    jiffies = cpu_jiffies()
    print(
        f"[bench] load average {results['machine']['loadavg_start']}, calibration loop {results['machine']['calibration_cpu_ms']} ms CPU (~400 on an idle core)",
        flush=True,
    )
    print(
        f"[bench] {results['machine']['cores']} cores ({results['machine']['cpu_model']}), python {results['machine']['python']}, "
        f"commit {results['machine']['git_commit'][:12]}, backend {args.backend}",
        flush=True,
    )
    dep = Deployment(
        backend=args.backend,
        heartbeat_s=args.heartbeat,
        log_level=args.log_level,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        keep=args.keep,
    )
    started = time.monotonic()
    code = 0
    try:
        print("[bench] starting the services (scripts/dev.py)", flush=True)
        dep.start()
        print(f"[bench] ready in {time.monotonic() - started:.1f} s: pids {dep.pids}", flush=True)
        _event_loop_policy()
        asyncio.run(run_all(args, dep, results))
        if args.hold:
            print(
                f"[bench] holding; gateway http://127.0.0.1:{dep.http_port} org {dep.org_id} key {dep.api_key}; pids {dep.pids}. Enter stops.",
                flush=True,
            )
            sys.stdin.readline()
    except Exception as exc:
        print(f"[bench] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        for name in SERVICES:
            tail = dep.log_tail(name, 10)
            if tail:
                print(f"[bench] last lines of {name}.log:\n{tail}", file=sys.stderr)
        results["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        if dep.workdir is not None and args.keep:
            print(f"[bench] data and logs kept in {dep.workdir}")
        dep.stop()
    results["elapsed_s"] = _r(time.monotonic() - started, 1)
    results["machine"]["loadavg_end"] = _loadavg()
    results["machine"]["steal_pct_run"] = steal_pct(jiffies, cpu_jiffies())
    out = (
        args.out
        or ROOT
        / "bench"
        / "results"
        / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{args.backend}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    stolen = {
        name: pct
        for name, pct in (results["machine"].get("steal_pct") or {}).items()
        if pct is not None and pct >= STEAL_NOTE_PCT
    }
    if stolen:
        print(
            f"[bench] note: the hypervisor took CPU time from this machine ({', '.join(f'{k} {v:g}%' for k, v in stolen.items())}): "
            "those figures read slower than its cores' own speed; compare them only with runs of little steal"
        )
    failures = results.get("latency", {}).get("failures", 0) + sum(
        level["failures"] for level in (results.get("throughput") or {}).values()
    )
    if failures:
        print(f"[bench] {failures} turn(s) did not end in done; see 'errors' in the JSON")
    print(
        f"[bench] wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} ({results['elapsed_s']} s)"
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
