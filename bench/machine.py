"""The machine a benchmark runs on: its description, a calibration loop, the hypervisor's steal.

Figures from a shared or virtual machine are comparable only with this beside them: the load
average, a fixed CPU loop's time and the share of CPU time the hypervisor gave to other guests.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import platform
import resource
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from bench.deploy import ROOT
from bench.stats import rounded


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages; empty where /proc/loadavg cannot be read."""
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
    return rounded(100 * (after[7] - before[7]) / total, 1) if total > 0 else None


class StealMeter:
    """`with steal("latency"):` records `steal_pct` over the block under that name
    (`by_workload`)."""

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
    return round((time.process_time() - started) * 1000, 1)


def machine_info() -> dict[str, Any]:
    """The machine, the Python and the commit the figures come from."""
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
                    line
                    for line in pathlib.Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal")
                ).split()[1]
            )
            * 1024
        )
    except (OSError, StopIteration, ValueError):
        mem_total = 0
    return {
        "loadavg_start": loadavg(),
        "calibration_cpu_ms": calibrate(),
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory_gib": rounded(mem_total / 1024**3, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "services")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft limit of open files to `need` (at most the hard limit);
    the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need)) if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
