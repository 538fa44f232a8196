"""The benchmark's report: the JSON, and the table of figures beside their targets with notes."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from bench.deploy import ROOT, SERVICES

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
    # issue 32
    "stream.cpu_us_per_frame": ("<=", 10.0),
    "stream.delay_p99_ms": ("<=", 5.0),
    "inflight.peak_together_mib": ("<=", 2048.0),
    "inflight.delay_p99_ms": ("<=", 100.0),
}

STEAL_NOTE_PCT = 2.0  # a workload with this much steal or more gets a note under the table


class _Rows:
    """The table's (label, value, target text) rows; a row with a target key is checked."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any, str]] = []

    def add(self, label: str, value: Any, key: str | None = None) -> None:
        target = ""
        if key in TARGETS and value is not None:
            op, limit = TARGETS[key]
            ok = value <= limit if op == "<=" else value >= limit
            target = f"{op} {limit:g}  {'ok' if ok else 'MISS'}"
        self.rows.append((label, value, target))


def _latency_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """The sequential turns."""
    lat = results.get("latency")
    if lat:
        rows.add("turn POST->done p50 ms", lat["done"]["p50_ms"], "latency.done_p50_ms")
        rows.add("turn POST->done p95 ms", lat["done"]["p95_ms"])
        rows.add("turn POST->done p99 ms", lat["done"]["p99_ms"], "latency.done_p99_ms")
        rows.add("turn POST->first frame p50 ms", lat["first_frame"]["p50_ms"])
        rows.add("turn POST->first frame p99 ms", lat["first_frame"]["p99_ms"])
        if "post_response" in lat:
            rows.add("turn POST->POST response p50 ms", lat["post_response"]["p50_ms"])
        rows.add(
            "service CPU ms per turn (sequential)",
            lat["cpu_ms_per_turn"],
            "latency.cpu_ms_per_turn",
        )
        rows.add("latency failures", lat["failures"])


def _throughput_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """Each concurrency level of the throughput workload."""
    for key, level in (results.get("throughput") or {}).items():
        rows.add(f"throughput {key} turns/s", level["turns_per_s"], f"throughput.{key}.turns_per_s")
        rows.add(
            f"throughput {key} p50 / p99 ms",
            f"{level['done']['p50_ms']} / {level['done']['p99_ms']}",
        )
        rows.add(
            f"throughput {key} service CPU ms/turn",
            level["cpu_ms_per_turn"],
            f"throughput.{key}.cpu_ms_per_turn",
        )
        rows.add(f"throughput {key} done / turns", f"{level['completed']} / {level['turns']}")


def _fanout_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """Each fan-out size."""
    for key, fan in (results.get("fanout") or {}).items():
        rows.add(
            f"fan-out {key}: connected / done",
            f"{fan['outcome'].get('connected', 0)} / {fan['outcome'].get('done', 0)}",
        )
        rows.add(f"fan-out {key}: connects/s", fan.get("connects_per_s"))
        rows.add(
            f"fan-out {key}: gateway RSS MiB",
            fan["gateway_rss_mib"],
            f"fanout.{key}.gateway_rss_mib" if key == "10000" else None,
        )
        rows.add(
            f"fan-out {key}: KiB/listener gw / orch",
            f"{fan['kib_per_listener']['gateway']} / {fan['kib_per_listener']['orchestrator']}",
        )
        rows.add(
            f"fan-out {key}: delay p50 / p99 ms",
            f"{fan['delay']['p50_ms']} / {fan['delay']['p99_ms']}",
        )
        if key == "10000":
            rows.add(
                "fan-out 10000: delay p99 ms", fan["delay"]["p99_ms"], "fanout.10000.delay_p99_ms"
            )
        if fan.get("delay_at_socket"):
            rows.add(
                f"fan-out {key}: delay at the socket p50 / p99 ms (kernel receive time)",
                f"{fan['delay_at_socket']['p50_ms']} / {fan['delay_at_socket']['p99_ms']}",
            )


def _admission_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """Admit+Charge pairs and the bare gRPC ceiling beside them."""
    adm = results.get("admission")
    if adm:
        rows.add(
            "admission Admit+Charge pairs/s (c16)", adm["pairs_per_s"], "admission.pairs_per_s"
        )
        rows.add("admission pair p50 ms", adm["pair"]["p50_ms"])
        rows.add("admission pair p99 ms", adm["pair"]["p99_ms"], "admission.pair_p99_ms")
        if "bare_grpc" in adm:
            bare = adm["bare_grpc"]
            rows.add("bare gRPC ceiling: 2 health Checks/s on billing (c16)", bare["pairs_per_s"])
            rows.add(
                "bare gRPC ceiling: pair p50 / p99 ms",
                f"{bare['pair']['p50_ms']} / {bare['pair']['p99_ms']}",
            )


def _tools_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """The no-op tool call and the knowledge search."""
    tl = results.get("tools")
    if tl:
        rows.add(
            "no-op tool call p50 / p99 ms (ExecuteTool loopline.echo)",
            f"{tl['noop_tool_call']['p50_ms']} / {tl['noop_tool_call']['p99_ms']}",
        )
        rows.add(
            "no-op tool call overhead over a bare gRPC round trip, p50 ms",
            tl["noop_overhead_p50_ms"],
        )
        rows.add(
            f"search over {tl['chunks']} chunks p50 / p99 ms",
            f"{tl['search']['p50_ms']} / {tl['search']['p99_ms']}",
        )


def _knowledge_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """Indexing throughput with the local model, and search latency per mode and size."""
    kn = results.get("knowledge")
    if not kn:
        return
    indexing = kn.get("indexing")
    if indexing:
        rows.add(
            f"knowledge indexing {indexing['documents']} docs of ~5 KB: docs/s (chunks/s)",
            f"{indexing['documents_per_s']} ({indexing['chunks_per_s']})",
        )
    for size, level in (kn.get("search") or {}).items():
        for mode in ("keyword", "semantic", "hybrid"):
            failed = sum((level[mode].get("failures") or {}).values())
            rows.add(
                f"knowledge search {mode} over {size} chunks p50 / p99 ms"
                f" ({level[mode]['searches']} searches"
                + (f", {failed} failed: {level[mode]['failures']})" if failed else ")"),
                f"{level[mode]['p50_ms']} / {level[mode]['p99_ms']}",
            )


def _streamed_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """The streamed answers (each source) and the runs in flight."""
    for source, s in (results.get("stream") or {}).items():
        rows.add(
            f"stream {source}: service CPU µs per frame (net of a 1-chunk turn)",
            s["cpu_us_per_frame"],
            "stream.cpu_us_per_frame",
        )
        if s["delay"]["p99_ms"] is not None:
            rows.add(f"stream {source}: delay p99 ms", s["delay"]["p99_ms"], "stream.delay_p99_ms")
        rows.add(f"stream {source}: done / turns", f"{s['done']} / {s['turns']}")
    fl = results.get("inflight")
    if fl:
        rows.add(f"inflight {fl['runs']}: done", fl["done"])
        rows.add(
            f"inflight {fl['runs']}: peak resident together MiB",
            fl["peak_together_mib"],
            "inflight.peak_together_mib",
        )
        rows.add(f"inflight {fl['runs']}: KiB per run", fl["kib_per_run"])
        rows.add(
            f"inflight {fl['runs']}: delay p99 ms", fl["delay"]["p99_ms"], "inflight.delay_p99_ms"
        )


def _steal_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """The hypervisor's steal during each workload."""
    steal = (results.get("machine") or {}).get("steal_pct") or {}
    for workload, pct in steal.items():
        rows.add(f"hypervisor steal % during {workload}", "-" if pct is None else pct)


def _memory_rows(rows: _Rows, results: dict[str, Any]) -> None:
    """Resident memory idle and after throughput."""
    mem = results.get("memory")
    if mem:
        rows.add("RSS idle, all four MiB", mem.get("idle_total_mib"), "memory.idle_total_mib")
        rows.add(
            "PSS idle, all four MiB (shared pages split between sharers)",
            mem.get("idle_pss_total_mib"),
            "memory.idle_pss_total_mib",
        )
        rows.add(
            "resident together idle, all four MiB (distinct pages)",
            mem.get("idle_together_mib"),
            "memory.idle_together_mib",
        )
        if mem.get("after_throughput_total_mib") is not None:
            rows.add(
                "RSS / PSS / together after throughput, all four MiB",
                f"{mem['after_throughput_total_mib']}"
                f" / {mem.get('after_throughput_pss_total_mib')}"
                f" / {mem.get('after_throughput_together_mib')}",
            )
        for name in SERVICES:
            rows.add(
                f"RSS {name} idle / after throughput MiB",
                f"{mem['idle_mib'].get(name)}"
                f" / {(mem.get('after_throughput_mib') or {}).get(name)}",
            )


def figures(results: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(label, value, target text) rows of the table; the targets are the product's goals."""
    rows = _Rows()
    _latency_rows(rows, results)
    _throughput_rows(rows, results)
    _fanout_rows(rows, results)
    _admission_rows(rows, results)
    _streamed_rows(rows, results)
    _tools_rows(rows, results)
    _knowledge_rows(rows, results)
    _steal_rows(rows, results)
    _memory_rows(rows, results)
    return rows.rows


def print_table(results: dict[str, Any]) -> None:
    """The figures beside their targets, one row each."""
    rows = figures(results)
    width = max(len(r[0]) for r in rows) if rows else 10
    print()
    print(f"{'figure':<{width}}  {'value':>18}  target (issues 9, 32)")
    print("-" * (width + 40))
    for label, value, target in rows:
        print(f"{label:<{width}}  {str(value):>18}  {target}")
    print()


def write_report(results: dict[str, Any], out: pathlib.Path) -> None:
    """Write `results` as JSON to `out`, then print the table, the notes under it (much steal,
    failed turns) and where the JSON went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    stolen = {
        name: pct
        for name, pct in (results["machine"].get("steal_pct") or {}).items()
        if pct is not None and pct >= STEAL_NOTE_PCT
    }
    if stolen:
        taken = ", ".join(f"{k} {v:g}%" for k, v in stolen.items())
        print(
            f"[bench] note: the hypervisor took CPU time from this machine ({taken}): "
            "those figures read slower than its cores' own speed; "
            "compare them only with runs of little steal"
        )
    failures = results.get("latency", {}).get("failures", 0) + sum(
        level["failures"] for level in (results.get("throughput") or {}).values()
    )
    if failures:
        print(f"[bench] {failures} turn(s) did not end in done; see 'errors' in the JSON")
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    print(f"[bench] wrote {shown} ({results['elapsed_s']} s)")
