"""bench.machine cpu_jiffies / steal_pct / StealMeter: the hypervisor's steal over a workload."""

from __future__ import annotations

import pathlib
import time

from bench.machine import StealMeter, cpu_jiffies, steal_pct


def _stat(tmp_path: pathlib.Path, line: str) -> pathlib.Path:
    path = tmp_path / "stat"
    path.write_text(line + "\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1 2 3\n")
    return path


def test_cpu_jiffies_reads_the_first_eight_fields_of_the_cpu_line(tmp_path: pathlib.Path) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice: guest is inside user already
    assert cpu_jiffies(_stat(tmp_path, "cpu  100 1 50 800 9 0 4 36 70 0")) == [
        100,
        1,
        50,
        800,
        9,
        0,
        4,
        36,
    ]


def test_cpu_jiffies_of_an_old_kernel_without_steal_counts_it_as_zero(
    tmp_path: pathlib.Path,
) -> None:
    assert cpu_jiffies(_stat(tmp_path, "cpu  100 1 50 800 9 0 4")) == [100, 1, 50, 800, 9, 0, 4, 0]


def test_cpu_jiffies_is_none_where_there_is_nothing_to_read(tmp_path: pathlib.Path) -> None:
    assert cpu_jiffies(tmp_path / "absent") is None
    assert cpu_jiffies(_stat(tmp_path, "intr 1 2 3")) is None


def test_steal_pct_is_the_share_of_all_cpu_time_between_two_readings() -> None:
    before = [100, 0, 50, 800, 0, 0, 0, 50]
    after = [200, 0, 100, 1550, 0, 0, 0, 150]  # 1,000 ticks passed, 100 of them stolen
    assert steal_pct(before, after) == 10.0
    assert steal_pct(before, before) is None  # no time passed
    assert steal_pct(None, after) is None and steal_pct(before, None) is None


def test_steal_meter_records_each_workload_by_name() -> None:
    steal = StealMeter()
    with steal("latency"):
        time.sleep(
            0.1
        )  # /proc/stat counts in 10 ms ticks, idle ones too: a block this long always has some
    with steal("admission"):
        pass
    assert list(steal.by_workload) == ["latency", "admission"]
    for value in steal.by_workload.values():
        assert value is None or 0.0 <= value <= 100.0
    if cpu_jiffies() is not None:  # Linux: a reading over a block that took some time
        assert steal.by_workload["latency"] is not None
