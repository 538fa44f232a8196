"""The figures' arithmetic: percentiles, latency summaries, rounding, CPU deltas."""

from __future__ import annotations

import math

MiB = 1024 * 1024


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
        "p50_ms": rounded(pct(ms, 50)),
        "p95_ms": rounded(pct(ms, 95)),
        "p99_ms": rounded(pct(ms, 99)),
        "max_ms": rounded(max(ms) if ms else None),
        "mean_ms": rounded(sum(ms) / len(ms) if ms else None),
    }


def rounded(value: float | None, digits: int = 2) -> float | None:
    """`value` rounded to `digits`, None kept."""
    return None if value is None else round(value, digits)


def mib(value: int | None) -> float | None:
    """Bytes as MiB to one decimal, None kept."""
    return None if value is None else rounded(value / MiB, 1)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per service between two `Deployment.cpu()` readings."""
    return {name: after[name] - before[name] for name in before}
