"""The streamed workloads: answers that stream in many chunks, and thousands of runs in flight.

Both run turns through the orchestrator's real OpenAI provider path against a local model
server (bench/fake_provider.py, its own process) that streams text deltas at a set pace, each
delta's text its production time. Every turn is listened to from its start by a listener that
keeps the kernel's receive time of each read (StampedSSERecorder), so a frame's delay is its
arrival at the listener's socket less the moment the model produced it.

- `stream`: turns whose answers stream in 1,000 chunks; the services' CPU per `response_chunk`
  frame, net of what the same turns cost with one chunk, and each frame's delay.
- `inflight`: 10,000 turns at once (each model call waits until all are waiting), each call
  5 s streaming 50 chunks; all must end in `done`; the services' resident memory at the peak and
  per run, and the frames' delay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

from bench.deploy import ROOT, Deployment, free_port, together_bytes
from bench.http import Connection, HTTPError, StampedSSERecorder, open_stamped_sse
from bench.stats import cpu_delta, mib, rounded, summary

PROVIDER = "benchstream"
LLM = {"integration_name": PROVIDER, "provider_id": PROVIDER, "model_id": "stream"}
CONNECT_MS = 300  # the model waits this long first, so the listener is there from frame one


class FakeProvider:
    """bench/fake_provider.py in a process of its own, named to the services by environment
    (LOOPLINE_OPENAI_COMPATIBLE_PROVIDERS, read when they start)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> FakeProvider:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.fake_provider", "--port", str(self.port)], cwd=ROOT
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        os.environ["LOOPLINE_OPENAI_COMPATIBLE_PROVIDERS"] = json.dumps(
            {PROVIDER: {"base_url": f"http://127.0.0.1:{self.port}/v1", "models": ["stream"]}}
        )
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


class _Turn:
    """One turn's outcome: its listener, or why it failed."""

    __slots__ = ("recorder", "error")

    def __init__(self) -> None:
        self.recorder: StampedSSERecorder | None = None
        self.error = ""


def _body(
    chunks: int,
    interval_ms: float,
    sleep_ms: float,
    scripted: bool = False,
    gate: dict[str, Any] | None = None,
) -> bytes:
    """A turn whose answer streams `chunks` chunks `interval_ms` apart after `sleep_ms`: from
    the scripted model, or from the local model server through the OpenAI provider (after the
    `gate`, when given: see bench/fake_provider.py)."""
    if scripted:
        step = {"say": "tok " * chunks, "chunks": chunks, "chunk_ms": interval_ms}
        script = {"script": [{**step, "sleep_ms": sleep_ms}]}
        return orjson.dumps({"message": json.dumps(script)})
    pace: dict[str, Any] = {"chunks": chunks, "interval_ms": interval_ms, "sleep_ms": sleep_ms}
    if gate is not None:
        pace["gate"] = gate
    return orjson.dumps({"message": json.dumps(pace), "llm": LLM})


async def _start(conn: Connection, dep: Deployment, body: bytes, out: _Turn) -> None:
    """POST one turn on `conn` and start listening to its stream (`out.recorder`)."""
    try:
        status, _, raw = await conn.request("POST", "/assistant/chat", body)
        if status != 200:
            out.error = f"POST {status}: {raw[:160].decode(errors='replace')}"
            return
        path = orjson.loads(raw)["stream_url"]
        out.recorder = await open_stamped_sse("127.0.0.1", dep.http_port, path, dep.headers())
    except (HTTPError, OSError, asyncio.IncompleteReadError, KeyError, ValueError) as exc:
        conn.close()
        out.error = f"{type(exc).__name__}: {exc}"


async def _turns(dep: Deployment, body: bytes, total: int, posters: int) -> list[_Turn]:
    """`total` turns at once, POSTed over `posters` keep-alive connections, each listened to
    from its start; returns when every stream has closed."""
    outs = [_Turn() for _ in range(total)]
    pending = iter(outs)

    async def poster() -> None:
        conn = Connection("127.0.0.1", dep.http_port, dep.headers())
        try:
            for out in pending:
                await _start(conn, dep, body, out)
        finally:
            conn.close()

    await asyncio.gather(*(poster() for _ in range(min(posters, total))))
    await asyncio.gather(*(out.recorder.closed for out in outs if out.recorder is not None))
    return outs


def _frames(outs: list[_Turn], stamped: bool = True) -> dict[str, Any]:
    """Per-frame facts of the turns' streams: delays (model to socket, when the chunks are
    `stamped` with their production time), response_chunk frames, frames holding more than one
    delta, and how each stream ended."""
    delays: list[float] = []
    chunks = merged = done = failed = 0
    errors: dict[str, int] = {}
    endings: dict[str, int] = {}  # how the streams ended: their last frame's type
    for out in outs:
        if out.recorder is None:
            errors[out.error[:120]] = errors.get(out.error[:120], 0) + 1
            continue
        last = None
        for arrival, raw in out.recorder.frames(at_socket=True):
            frame = orjson.loads(raw)
            last = frame.get("type")
            if last == "response_chunk":
                chunks += 1
                if stamped:
                    stamps = [s for s in frame["data"]["chunk"].split(";") if s]
                    merged += len(stamps) > 1
                    delays += [arrival - int(s) / 1e9 for s in stamps]
                else:
                    merged += frame["data"]["chunk"].count("tok") > 1
            elif last == "done":
                failed += bool(frame["data"].get("error"))
            elif last == "error":
                last = f"error {str(frame['data'].get('message'))[:80]}"
        done += last == "done"
        ending = f"last frame {last}" + (f" ({out.recorder.error})" if out.recorder.error else "")
        endings[ending] = endings.get(ending, 0) + 1
    return {
        "turns": len(outs),
        "done": done,
        "done_with_error": failed,
        "errors": errors,
        "endings": endings,
        "response_chunks": chunks,
        "merged_frames": merged,
        "delay": summary(delays),
    }


async def workload_stream(
    dep: Deployment, turns: int, concurrency: int, chunks: int, interval_ms: float
) -> dict[str, Any]:
    """Service CPU per response_chunk frame and each frame's delay, for turns streaming `chunks`
    chunks, `concurrency` at a time: from the scripted model as fast as it can (`burst`) and
    `interval_ms` apart (`scripted`), and from the local model server `interval_ms` apart
    through the OpenAI provider (`provider`)."""
    return {
        "burst": await _stream(dep, turns, concurrency, chunks, 0, scripted=True),
        "scripted": await _stream(dep, turns, concurrency, chunks, interval_ms, scripted=True),
        "provider": await _stream(dep, turns, concurrency, chunks, interval_ms, scripted=False),
    }


async def _stream(
    dep: Deployment, turns: int, concurrency: int, chunks: int, interval_ms: float, scripted: bool
) -> dict[str, Any]:
    """One `workload_stream` source; the CPU of the same turns with one chunk is subtracted, so
    `cpu_us_per_frame` is the cost of the frames alone."""
    one, many = (
        _body(1, 0, CONNECT_MS, scripted),
        _body(chunks, interval_ms, CONNECT_MS, scripted),
    )
    await _turns(dep, one, concurrency, concurrency)  # warm every path
    cpu0 = dep.cpu()
    for _ in range(0, turns, concurrency):
        await _turns(dep, one, concurrency, concurrency)
    base = sum(cpu_delta(cpu0, dep.cpu()).values())
    cpu0, started, outs = dep.cpu(), time.monotonic(), []
    for _ in range(0, turns, concurrency):
        outs += await _turns(dep, many, concurrency, concurrency)
    elapsed = time.monotonic() - started
    cpu = cpu_delta(cpu0, dep.cpu())
    facts = _frames(outs, stamped=not scripted)
    frames = max(1, facts["response_chunks"])
    return {
        **facts,
        "chunks_per_turn": chunks,
        "interval_ms": interval_ms,
        "concurrency": concurrency,
        "elapsed_s": rounded(elapsed),
        "cpu_us_per_frame": rounded((sum(cpu.values()) - base) * 1e6 / frames),
        "cpu_us_per_frame_gross": rounded(sum(cpu.values()) * 1e6 / frames),
        "cpu_us_per_frame_by_service": {k: rounded(v * 1e6 / frames) for k, v in cpu.items()},
        "cpu_ms_per_one_chunk_turn": rounded(base * 1000 / max(1, len(outs))),
    }


async def workload_inflight(
    dep: Deployment, runs: int, chunks: int, call_ms: float, posters: int
) -> dict[str, Any]:
    """`runs` turns in flight at once: every model call waits until all of them are waiting,
    then takes `call_ms`, streaming `chunks` chunks evenly over it. The services' resident
    memory at the peak (sampled every 0.5 s) and per run in flight, and the frames' delay."""
    idle = together_bytes(list(dep.pids.values())) or sum(dep.rss().values())
    peak, idle_rss = idle, dep.rss()
    peak_rss = dict(idle_rss)
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            now = await asyncio.to_thread(together_bytes, list(dep.pids.values()))
            rss = dep.rss()
            peak = max(peak, now or sum(rss.values()))
            peak_rss.update({k: max(v, peak_rss[k]) for k, v in rss.items()})
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    started, cpu0 = time.monotonic(), dep.cpu()
    try:
        gate = {"id": f"inflight-{time.time_ns()}", "count": runs}
        body = _body(chunks, call_ms / chunks, call_ms / chunks, gate=gate)
        outs = await _turns(dep, body, runs, posters)
    finally:
        stop.set()
        await sampler
    cpu = cpu_delta(cpu0, dep.cpu())
    facts = _frames(outs)
    return {
        **facts,
        "runs": runs,
        "chunks_per_call": chunks,
        "call_ms": call_ms,
        "elapsed_s": rounded(time.monotonic() - started),
        "cpu_ms_per_run_by_service": {k: rounded(v * 1000 / max(1, runs)) for k, v in cpu.items()},
        "idle_together_mib": mib(idle),
        "peak_together_mib": mib(peak),
        "kib_per_run": rounded((peak - idle) / 1024 / max(1, runs), 1),
        "kib_per_run_by_service": {
            k: rounded((peak_rss[k] - idle_rss[k]) / 1024 / max(1, runs), 1) for k in idle_rss
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-turns", type=int, help="turns of the stream workload (16; quick 4)")
    p.add_argument("--stream-concurrency", type=int, default=4, help="at a time (4)")
    p.add_argument("--stream-chunks", type=int, default=1000, help="chunks per answer (1000)")
    p.add_argument("--stream-interval-ms", type=float, default=5.0, help="ms between chunks (5)")
    p.add_argument("--inflight-runs", type=int, help="turns in flight at once (10000; quick 500)")
    p.add_argument("--inflight-chunks", type=int, default=50, help="chunks per model call (50)")
    p.add_argument("--inflight-call-ms", type=float, default=5000, help="ms per model call (5000)")
    p.add_argument("--inflight-posters", type=int, default=64, help="connections POSTing (64)")


def apply_sizes(args: argparse.Namespace) -> None:
    if args.stream_turns is None:
        args.stream_turns = 4 if args.quick else 16
    if args.inflight_runs is None:
        args.inflight_runs = 500 if args.quick else 10_000


async def run(args: argparse.Namespace, dep: Deployment, results: dict[str, Any], workload: Any):
    """The streamed workloads named in --only, printed as they finish."""
    if "stream" in args.only:
        print(
            f"[bench] stream: {args.stream_turns} turns of {args.stream_chunks} chunks "
            f"{args.stream_interval_ms:g} ms apart, {args.stream_concurrency} at a time",
            flush=True,
        )
        async with workload("stream"):
            results["stream"] = await workload_stream(
                dep,
                args.stream_turns,
                args.stream_concurrency,
                args.stream_chunks,
                args.stream_interval_ms,
            )
        for source, s in results["stream"].items():
            print(
                f"[bench]   {source}: {s['cpu_us_per_frame']} µs CPU per frame net, "
                f"{s['cpu_us_per_frame_gross']} gross {s['cpu_us_per_frame_by_service']}, "
                f"delay p50/p99 {s['delay']['p50_ms']}/{s['delay']['p99_ms']} ms, "
                f"{s['done']}/{s['turns']} done, {s['merged_frames']} merged",
                flush=True,
            )
    if "inflight" in args.only:
        print(
            f"[bench] inflight: {args.inflight_runs} turns at once, model calls of "
            f"{args.inflight_call_ms:g} ms streaming {args.inflight_chunks} chunks",
            flush=True,
        )
        async with workload("inflight"):
            f = results["inflight"] = await workload_inflight(
                dep,
                args.inflight_runs,
                args.inflight_chunks,
                args.inflight_call_ms,
                args.inflight_posters,
            )
        print(
            f"[bench]   {f['done']}/{f['runs']} done ({f['errors']}), peak "
            f"{f['peak_together_mib']} MiB ({f['kib_per_run']} KiB per run), delay p50/p99 "
            f"{f['delay']['p50_ms']}/{f['delay']['p99_ms']} ms, CPU ms per run "
            f"{f['cpu_ms_per_run_by_service']}",
            flush=True,
        )
