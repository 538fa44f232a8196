"""`make bench`: turn latency, throughput, stream fan-out, admission, knowledge search and memory
of Loopline.

Starts the real processes with scripts/dev.py (free ports, a temporary data directory),
runs the workloads against them over HTTP/SSE and gRPC, prints a table of each figure
beside its target and writes everything as JSON under bench/results/.
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
import os
import pathlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from bench import streaming
from bench.admission import workload_admission
from bench.deploy import ROOT, SERVICES, Deployment
from bench.fanout import workload_fanout
from bench.knowledge import workload_knowledge
from bench.machine import (
    StealMeter,
    cpu_jiffies,
    loadavg,
    machine_info,
    raise_fd_limit,
    steal_pct,
)
from bench.otlp_sink import OtlpSink
from bench.profiler import Profiler
from bench.report import write_report
from bench.stats import MiB, mib, rounded
from bench.tools import workload_tools
from bench.turns import workload_latency, workload_throughput
from services import grpc_core  # noqa: F401 - the services' gRPC core settings for this client's calls too

WORKLOADS = (
    "latency",
    "throughput",
    "admission",
    "fanout",
    "stream",
    "inflight",
    "knowledge",
    "tools",
)
# the workloads that stream through the local model server (bench/fake_provider.py)
STREAMED = ("stream", "inflight")

# `async with workload(name):` profiles (--profile) and meters the steal over one workload.
Metered = Callable[[str], AbstractAsyncContextManager[None]]

# ----------------------------------------------------------------------------- arguments


def _add_deployment_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_turn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--turns", type=int, help="sequential turns of the latency workload (200; quick 20)"
    )
    p.add_argument(
        "--throughput-turns", type=int, help="turns per concurrency level (500; quick 100)"
    )
    p.add_argument("--concurrency", help="comma-separated concurrency levels (1,8,32)")
    p.add_argument("--time-cap", type=float, help="seconds per throughput level (60; quick 15)")


def _add_fanout_arguments(p: argparse.ArgumentParser) -> None:
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
        help="fan-out listeners: raw sockets that also keep the kernel's receive time "
        "(stamped, Linux; default), or asyncio protocols (protocol)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=2.0,
        help="LOOPLINE_HEARTBEAT_INTERVAL_S of the deployment (2; 15 in production)",
    )


def _add_admission_and_tools_arguments(p: argparse.ArgumentParser) -> None:
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
        "--knowledge-documents",
        type=int,
        help="~5 KB documents the knowledge workload indexes with the local model (20; quick 5)",
    )
    p.add_argument(
        "--knowledge-sizes",
        help="comma-separated chunk counts of the knowledge search "
        "(10000,100000; quick 1000,10000)",
    )
    p.add_argument(
        "--knowledge-searches", type=int, help="searches per mode and size (200; quick 30)"
    )
    p.add_argument(
        "--knowledge-time-cap",
        type=float,
        help="seconds of searches per mode and size at most (30; quick 10)",
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
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
        help="record each service with py-spy during each workload into this folder "
        "(collapsed stacks)",
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the workloads, keep the services up until Enter (for profiling)",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="turn tracing on in the services (OTLP/HTTP to a local sink that counts spans)",
    )


def _apply_sizes(args: argparse.Namespace) -> None:
    """The sizes not given: the full suite's, or the small ones with --quick."""
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
    args.knowledge_documents = (
        args.knowledge_documents if args.knowledge_documents is not None else (5 if q else 20)
    )
    args.knowledge_sizes = [
        int(x)
        for x in (args.knowledge_sizes or ("1000,10000" if q else "10000,100000")).split(",")
        if x
    ]
    args.knowledge_searches = (
        args.knowledge_searches if args.knowledge_searches is not None else (30 if q else 200)
    )
    args.knowledge_time_cap = (
        args.knowledge_time_cap if args.knowledge_time_cap is not None else (10.0 if q else 30.0)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    # The order of the options is the order of "config" in the JSON.
    _add_deployment_arguments(p)
    _add_turn_arguments(p)
    _add_fanout_arguments(p)
    _add_admission_and_tools_arguments(p)
    streaming.add_arguments(p)
    _add_run_arguments(p)
    args = p.parse_args(argv)
    _apply_sizes(args)
    streaming.apply_sizes(args)
    args.only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = set(args.only) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {WORKLOADS}")
    return args


# ----------------------------------------------------------------------------- workloads


def _idle_memory(dep: Deployment) -> dict[str, Any]:
    idle, idle_pss = dep.rss(), dep.pss()
    return {
        "idle_mib": {k: rounded(v / MiB, 1) for k, v in idle.items()},
        "idle_total_mib": rounded(sum(idle.values()) / MiB, 1),
        "idle_pss_mib": {k: rounded(v / MiB, 1) for k, v in idle_pss.items()},
        "idle_pss_total_mib": rounded(sum(idle_pss.values()) / MiB, 1),
        "idle_together_mib": mib(dep.together()),
    }


async def _run_throughput(
    args: argparse.Namespace, dep: Deployment, results: dict[str, Any], workload: Metered
) -> None:
    print(
        f"[bench] throughput: {args.throughput_turns} turns at concurrency "
        f"{args.concurrency} (cap {args.time_cap:g} s each)",
        flush=True,
    )
    async with workload("throughput"):
        results["throughput"] = await workload_throughput(
            dep, args.throughput_turns, args.concurrency, args.time_cap
        )
    after = dep.rss()
    results["memory"]["after_throughput_mib"] = {k: rounded(v / MiB, 1) for k, v in after.items()}
    results["memory"]["after_throughput_total_mib"] = rounded(sum(after.values()) / MiB, 1)
    results["memory"]["after_throughput_pss_total_mib"] = rounded(sum(dep.pss().values()) / MiB, 1)
    results["memory"]["after_throughput_together_mib"] = mib(dep.together())


async def _run_fanout(
    args: argparse.Namespace, dep: Deployment, results: dict[str, Any], workload: Metered
) -> None:
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
            f"[bench]   connected in {fan['connect_s']} s, outcome {fan['outcome']}, "
            f"delay p50/p99 {fan['delay']['p50_ms']}/{fan['delay']['p99_ms']} ms "
            f"(first listener p50 {fan['first_delivery']['p50_ms']} ms, "
            f"first-to-last spread p50 {fan['fanout_spread']['p50_ms']} ms)"
            + (
                f"; at the socket p50/p99 {fan['delay_at_socket']['p50_ms']}/"
                f"{fan['delay_at_socket']['p99_ms']} ms"
                if fan.get("delay_at_socket")
                else ""
            ),
            flush=True,
        )


async def run_all(args: argparse.Namespace, dep: Deployment, results: dict[str, Any]) -> None:
    profile = Profiler(dep, args.profile)
    steal = StealMeter()
    results["machine"]["steal_pct"] = steal.by_workload

    @contextlib.asynccontextmanager
    async def workload(name: str) -> AsyncIterator[None]:
        """Profile (--profile) and meter the hypervisor's steal over one workload."""
        with steal(name):
            async with profile(name):
                yield

    await asyncio.sleep(1.0)  # let start-up work settle before "idle"
    results["memory"] = _idle_memory(dep)
    if "latency" in args.only:
        print(f"[bench] latency: {args.turns} sequential turns", flush=True)
        async with workload("latency"):
            results["latency"] = await workload_latency(dep, args.turns, warmup=min(10, args.turns))
    if "throughput" in args.only:
        await _run_throughput(args, dep, results, workload)
    if "admission" in args.only:
        print(
            f"[bench] admission: {args.admissions} Admit+Charge pairs at concurrency "
            f"{args.admission_concurrency}",
            flush=True,
        )
        async with workload("admission"):
            results["admission"] = await workload_admission(
                dep, args.admissions, args.admission_concurrency, args.admission_time_cap
            )
    if "fanout" in args.only:
        await _run_fanout(args, dep, results, workload)
    await streaming.run(args, dep, results, workload)
    # before tools: that workload's corpus keeps the indexer embedding for minutes
    if "knowledge" in args.only:
        print(
            f"[bench] knowledge: indexing {args.knowledge_documents} documents of ~5 KB; "
            f"search at {args.knowledge_sizes} chunks ({args.knowledge_searches} per mode)",
            flush=True,
        )
        async with workload("knowledge"):
            results["knowledge"] = await workload_knowledge(
                dep,
                args.knowledge_documents,
                args.knowledge_sizes,
                args.knowledge_searches,
                args.knowledge_time_cap,
            )
    if "tools" in args.only:
        print(
            f"[bench] tools: {args.tool_calls} no-op tool calls; "
            f"search over {args.chunks} chunks ({args.searches} searches)",
            flush=True,
        )
        async with workload("tools"):
            results["tools"] = await workload_tools(
                dep, args.tool_calls, args.chunks, args.searches
            )
    results["memory"]["final_mib"] = {k: rounded(v / MiB, 1) for k, v in dep.rss().items()}


# ----------------------------------------------------------------------------- main


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
    terminal's Ctrl-C twice), so without this a killed bench would leave five processes running."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _start_results(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON's machine and config sections, also printed as the run's first lines."""
    sockets = max(
        max(args.listeners or [0]) if "fanout" in args.only else 0,
        args.inflight_runs if "inflight" in args.only else 0,
    )
    fd_limit = raise_fd_limit(sockets * 2 + 1024 if sockets else 0)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "note": "client and services share the machine's cores; "
        "the client's own CPU is reported where measured",
    }
    results["machine"]["client_fd_limit"] = fd_limit
    return results


def _print_machine(args: argparse.Namespace, results: dict[str, Any]) -> None:
    print(
        f"[bench] load average {results['machine']['loadavg_start']}, calibration loop "
        f"{results['machine']['calibration_cpu_ms']} ms CPU (~400 on an idle core)",
        flush=True,
    )
    print(
        f"[bench] {results['machine']['cores']} cores ({results['machine']['cpu_model']}), "
        f"python {results['machine']['python']}, "
        f"commit {results['machine']['git_commit'][:12]}, backend {args.backend}",
        flush=True,
    )


def _run_deployment(
    args: argparse.Namespace, dep: Deployment, results: dict[str, Any], started: float
) -> int:
    """Start the services, run the workloads (then hold with --hold) and stop the services;
    1 when something failed (its error in `results`), else 0."""
    code = 0
    try:
        print("[bench] starting the services (scripts/dev.py)", flush=True)
        dep.start()
        print(f"[bench] ready in {time.monotonic() - started:.1f} s: pids {dep.pids}", flush=True)
        _event_loop_policy()
        asyncio.run(run_all(args, dep, results))
        if args.hold:
            print(
                f"[bench] holding; gateway http://127.0.0.1:{dep.http_port} org {dep.org_id} "
                f"key {dep.api_key}; pids {dep.pids}. Enter stops.",
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
    return code


def _start_tracing(results: dict[str, Any]) -> OtlpSink:
    """Start the span sink and point the services' OTLP exporter at it (they inherit the
    environment): the figures then include recording, batching and exporting every span."""
    sink = OtlpSink().start()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    results["tracing"] = {"endpoint": sink.endpoint}
    print(f"[bench] tracing on: spans exported to {sink.endpoint}", flush=True)
    return sink


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    results = _start_results(args)
    jiffies = cpu_jiffies()
    _print_machine(args, results)
    dep = Deployment(
        backend=args.backend,
        heartbeat_s=args.heartbeat,
        log_level=args.log_level,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        keep=args.keep,
    )
    sink = _start_tracing(results) if args.tracing else None
    provider = streaming.FakeProvider().start() if set(STREAMED) & set(args.only) else None
    started = time.monotonic()
    try:
        code = _run_deployment(args, dep, results, started)
    finally:
        if provider is not None:
            provider.stop()
    if sink is not None:
        sink.stop()
        results["tracing"].update(spans_received=sink.spans, exports=sink.requests)
    results["elapsed_s"] = rounded(time.monotonic() - started, 1)
    results["machine"]["loadavg_end"] = loadavg()
    results["machine"]["steal_pct_run"] = steal_pct(jiffies, cpu_jiffies())
    out = (
        args.out
        or ROOT
        / "bench"
        / "results"
        / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{args.backend}.json"
    )
    write_report(results, out)
    return code


if __name__ == "__main__":
    sys.exit(main())
