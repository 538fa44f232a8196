"""`make bench` runs: the benchmark, tiny, starts the real processes and writes valid JSON.

The benchmark itself is not part of the test suite (see docs/performance.md); this only
checks that its machinery works: scripts/dev.py starts, every workload runs, every turn
ends in `done`, and the JSON report has the figures docs/performance.md quotes.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _check_machine(machine: dict) -> None:
    """The machine's description: cores, Python, commit, and the steal of each workload."""
    assert machine["cores"] >= 1 and machine["python"] and machine["git_commit"]
    workloads = {
        "latency",
        "throughput",
        "admission",
        "fanout10",
        "stream",
        "inflight",
        "knowledge",
        "tools",
    }
    assert set(machine["steal_pct"]) == workloads
    assert all(
        value is None or 0 <= value <= 100
        for value in [*machine["steal_pct"].values(), machine["steal_pct_run"]]
    )


def _check_knowledge(knowledge: dict, tools: dict) -> None:
    """The knowledge workload's shape (2 documents indexed, 3 searches per mode at 300 chunks)
    and the tools workload's (5 no-op calls, 200 chunks searched)."""
    assert tools["noop_calls"] == 5 and tools["chunks"] == 200 and tools["search"]["p50_ms"] > 0
    assert knowledge["indexing"]["documents"] == 2 and knowledge["indexing"]["chunks_per_s"] > 0
    for mode in ("keyword", "semantic", "hybrid"):
        level = knowledge["search"]["300"][mode]
        assert level["searches"] == 3 and not level["failures"] and level["mean_results"] == 5


def _check_streamed(stream: dict, inflight: dict) -> None:
    """The streamed workloads: every turn done, every chunk its own frame, the real provider's
    chunks stamped with their production time (a delay), the memory of the runs in flight."""
    for source in ("burst", "scripted", "provider"):
        figures = stream[source]
        assert figures["done"] == figures["turns"] == 2 and not figures["errors"]
        assert figures["response_chunks"] == 2 * 20 and figures["merged_frames"] == 0
        assert set(figures["cpu_us_per_frame_by_service"]) == {
            "gateway",
            "orchestrator",
            "billing",
            "tools",
        }
    assert stream["burst"]["delay"]["p50_ms"] is None  # the scripted model stamps nothing
    assert 0 < stream["provider"]["delay"]["p50_ms"] < 10_000
    assert inflight["done"] == inflight["runs"] == 6 and not inflight["done_with_error"]
    assert inflight["response_chunks"] == 6 * 3 and inflight["delay"]["p99_ms"] > 0
    assert inflight["peak_together_mib"] >= inflight["idle_together_mib"] > 0


# every workload, each as small as it can be
TINY = [
    "--turns",
    "5",
    "--throughput-turns",
    "6",
    "--concurrency",
    "1,3",
    "--time-cap",
    "20",
    "--listeners",
    "10",
    "--ticks",
    "1",
    "--tick-ms",
    "300",
    "--heartbeat",
    "0.4",
    "--admissions",
    "30",
    "--admission-concurrency",
    "4",
    "--admission-time-cap",
    "5",
    "--tool-calls",
    "5",
    "--chunks",
    "200",
    "--searches",
    "5",
    "--knowledge-documents",
    "2",
    "--knowledge-sizes",
    "300",
    "--knowledge-searches",
    "3",
    "--stream-turns",
    "2",
    "--stream-concurrency",
    "2",
    "--stream-chunks",
    "20",
    "--stream-interval-ms",
    "2",
    "--inflight-runs",
    "6",
    "--inflight-chunks",
    "3",
    "--inflight-call-ms",
    "300",
]


def test_bench_runs_in_a_tiny_configuration_and_writes_json(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", *TINY, "--out", str(out)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "error" not in report
    _check_machine(report["machine"])
    _check_knowledge(report["knowledge"], report["tools"])
    _check_streamed(report["stream"], report["inflight"])
    latency = report["latency"]
    assert latency["turns"] == 5 and latency["completed"] == 5 and latency["failures"] == 0
    assert latency["done"]["p50_ms"] > 0 and latency["first_frame"]["p99_ms"] > 0
    # CPU time is read in clock ticks (10 ms): 5 turns of ~4 ms on a fast machine can cross no tick
    # of any service (0.0 was seen), so only the shape is checked here; `make bench` runs 200
    assert latency["cpu_ms_per_turn"] >= 0 and set(latency["cpu_ms_per_turn_by_service"]) == {
        "gateway",
        "orchestrator",
        "billing",
        "tools",
    }
    for key in ("c1", "c3"):
        level = report["throughput"][key]
        assert level["completed"] == level["turns"] > 0 and level["turns_per_s"] > 0
    assert report["admission"]["pairs"] > 0 and report["admission"]["failures"] == 0
    bare = report["admission"]["bare_grpc"]
    assert bare["pairs"] > 0 and bare["failures"] == 0 and bare["pairs_per_s"] > 0
    fanout = report["fanout"]["10"]
    assert fanout["outcome"].get("connected") == 10 and fanout["outcome"].get("done") == 10
    assert fanout["deliveries_measured"] > 0 and fanout["heartbeats"] > 0
    # the stamped client: the kernel's receive time of each delivery, never after the client read it
    if sys.platform == "linux":
        at_socket, read = fanout["delay_at_socket"], fanout["delay"]
        assert at_socket["p50_ms"] is not None and 0 <= at_socket["p50_ms"] <= read["p50_ms"] + 0.01
    memory = report["memory"]
    assert set(memory["idle_mib"]) == {"gateway", "orchestrator", "billing", "tools"}
    assert memory["after_throughput_mib"]["gateway"] > 0
    if memory["idle_together_mib"] is not None:  # None where the kernel hides page frame numbers
        assert 0 < memory["idle_together_mib"] <= memory["idle_total_mib"]
    assert "target" in result.stdout


def test_a_bench_stopped_by_sigterm_stops_the_services_it_started(tmp_path: pathlib.Path) -> None:
    # scripts/dev.py runs in a session of its own: a bench killed by SIGTERM (a timeout, a CI
    # runner) stops it and the four services it started
    import os
    import re
    import signal
    import time

    argv = [
        sys.executable,
        "-m",
        "bench",
        "--only",
        "latency",
        "--turns",
        "2",
        "--hold",
        "--out",
        str(tmp_path / "bench.json"),
    ]
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if "holding;" in line:
                pids = [int(pid) for pid in re.findall(r"'\w+': (\d+)", line)]
                break
        assert len(pids) == 4
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        for _ in range(100):
            alive = [
                pid
                for pid in pids
                if os.path.exists(f"/proc/{pid}")
                and "zombie" not in open(f"/proc/{pid}/status").read().lower()
            ]
            if not alive:
                break
            time.sleep(0.1)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
        for pid in pids:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
