"""The turn workloads: sequential latency and throughput at several concurrency levels.

Each worker holds one keep-alive connection, POSTs a turn and reads its stream to `done`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import orjson

from bench.deploy import Deployment
from bench.http import Connection, HTTPError
from bench.stats import cpu_delta, rounded, summary

# One tool call, then an answer in 10 chunks (11 words -> 10 chunks).
TURN_MESSAGE = json.dumps(
    {
        "script": [
            {"tool": "get_available_integrations", "input": {}},
            {"say": "The benchmark turn answers in exactly ten chunks of text here.", "chunks": 10},
        ]
    }
)


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
        first: float | None = None
        done: float | None = None
        last_type = None
        async for arrival, frame in frames:
            if first is None:
                first = arrival
            last_type = frame.get("type")
            if last_type == "done":
                done = arrival
                if frame["data"].get("error"):
                    return TurnResult(False, error="done with error: true")
        if done is None or first is None:
            return TurnResult(False, error=f"stream ended without done (last {last_type})")
        return TurnResult(True, first - start, done - start, post_s=posted - start)
    except (HTTPError, OSError, asyncio.IncompleteReadError, KeyError, ValueError) as exc:
        conn.close()
        return TurnResult(False, error=f"{type(exc).__name__}: {exc}")


async def run_turns(
    dep: Deployment, total: int, concurrency: int, time_cap_s: float
) -> tuple[list[TurnResult], float]:
    """`total` turns by `concurrency` workers (one keep-alive connection each), stopped at
    `time_cap_s`."""
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


def error_counts(results: list[TurnResult]) -> dict[str, int]:
    """How many failed turns gave each error (its first 160 characters)."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            counts[r.error[:160]] = counts.get(r.error[:160], 0) + 1
    return counts


async def workload_latency(dep: Deployment, turns: int, warmup: int) -> dict[str, Any]:
    await run_turns(dep, warmup, 1, 60)
    cpu0, client0 = dep.cpu(), time.process_time()
    results, elapsed = await run_turns(dep, turns, 1, 600)
    cpu = cpu_delta(cpu0, dep.cpu())
    client_cpu = time.process_time() - client0
    ok = [r for r in results if r.ok]
    n = max(1, len(results))
    return {
        "turns": len(results),
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": error_counts(results),
        "elapsed_s": rounded(elapsed),
        "done": summary([r.done_s for r in ok]),
        "first_frame": summary([r.first_s for r in ok]),
        "post_response": summary([r.post_s for r in ok]),
        "cpu_ms_per_turn": rounded(sum(cpu.values()) * 1000 / n),
        "cpu_ms_per_turn_by_service": {k: rounded(v * 1000 / n) for k, v in cpu.items()},
        "client_cpu_ms_per_turn": rounded(client_cpu * 1000 / n),
    }


async def workload_throughput(
    dep: Deployment, turns: int, levels: list[int], time_cap_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in levels:
        await run_turns(dep, level, level, 30)  # open the connections, warm the paths
        cpu0, client0 = dep.cpu(), time.process_time()
        results, elapsed = await run_turns(dep, turns, level, time_cap_s)
        cpu = cpu_delta(cpu0, dep.cpu())
        client_cpu = time.process_time() - client0
        ok = [r for r in results if r.ok]
        n = max(1, len(results))
        out[f"c{level}"] = {
            "concurrency": level,
            "turns": len(results),
            "completed": len(ok),
            "failures": len(results) - len(ok),
            "errors": error_counts(results),
            "elapsed_s": rounded(elapsed),
            "time_capped": len(results) < turns,
            "turns_per_s": rounded(len(ok) / elapsed if elapsed else 0.0),
            "done": summary([r.done_s for r in ok]),
            "first_frame": summary([r.first_s for r in ok]),
            "cpu_ms_per_turn": rounded(sum(cpu.values()) * 1000 / n),
            "cpu_ms_per_turn_by_service": {k: rounded(v * 1000 / n) for k, v in cpu.items()},
            "client_cpu_ms_per_turn": rounded(client_cpu * 1000 / n),
        }
        print(
            f"[bench]   concurrency {level}: {out[f'c{level}']['turns_per_s']} turns/s, "
            f"{len(ok)}/{len(results)} done, p50 {out[f'c{level}']['done']['p50_ms']} ms",
            flush=True,
        )
    return out
