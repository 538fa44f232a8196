"""bench.deploy.together_bytes: the union of resident page frames counts a shared page once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.deploy import resident_frames, rss_bytes, together_bytes


@pytest.fixture
def sleepers():
    """Two idle Python processes with the same interpreter (they share its file-backed pages)."""
    code = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n"
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_together_counts_shared_pages_once(sleepers):
    a, b = sleepers
    if resident_frames(a) is None:
        pytest.skip("the kernel hides page frame numbers from this process (needs CAP_SYS_ADMIN)")
    one = together_bytes([a])
    assert one is not None
    assert together_bytes([a, a]) == one  # the same pages twice are counted once
    # each process's frames are its resident set (RSS counts the same pages, per mapping)
    assert 0.9 * rss_bytes(a) <= one <= 1.05 * rss_bytes(a)
    both = together_bytes([a, b])
    assert both is not None
    assert one < both < rss_bytes(a) + rss_bytes(b)  # the interpreter's pages are shared
