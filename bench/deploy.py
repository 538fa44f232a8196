"""Start the real processes the way `make run` does (scripts/dev.py) on free ports, and watch them.

`Deployment` runs scripts/dev.py as a subprocess with a temporary data directory, a bench
plan file (the developer plan with allowances and rate limits that a benchmark cannot
exhaust, so a denial never disguises itself as a slow turn) and, with `backend="postgres"`,
fresh PostgreSQL databases per service plus Redis. The four service processes are found
as dev.py's children, so their CPU time and resident memory can be read from /proc.
"""

from __future__ import annotations

import array
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "orchestrator", "billing", "tools")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# The developer plan (the plan dev.py seeds and billing auto-provisions) with limits a
# benchmark never reaches; the rate limiter stays in the path (a listed class is checked).
BENCH_PLANS = """\
[plans.developer]
monthly_run_credits = 100000000
wallet_overage = false
wallet_price_minor = 0
[plans.developer.rate_limits]
sync_exec = "100000/minute"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, in bytes."""
    with open(f"/proc/{pid}/statm", "rb") as handle:
        return int(handle.read().split()[1]) * PAGE


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process, in bytes (Linux `smaps_rollup`): its private pages plus
    its share of pages mapped by several processes, so the PSS of processes adds up to the
    memory they occupy together (an RSS sum counts shared library pages once per process)."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
        for line in handle:
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024
    return 0


_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63
_PAGES_PER_READ = 1 << 16  # pagemap entries read at once (512 KiB)


def resident_frames(pid: int) -> set[int] | None:
    """The physical page frames (PFNs) a process has resident, from `/proc/<pid>/pagemap`
    (Linux Documentation/admin-guide/mm/pagemap.rst: bit 63 present, bits 0-54 the PFN).

    Frames seen in several processes' sets are the same RAM, so the size of the union of the
    sets is the memory the processes occupy together, each shared page counted once, and
    including pages they share with other processes in full. Returns None when the kernel
    hides PFNs (reading them needs CAP_SYS_ADMIN; without it every PFN reads as 0).
    """
    frames: set[int] = set()
    hidden = True
    with (
        open(f"/proc/{pid}/maps", "rb") as maps,
        open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap,
    ):
        for line in maps:
            span = line.split(None, 1)[0]
            start, end = (int(x, 16) for x in span.split(b"-"))
            for first in range(
                start // PAGE, end // PAGE, _PAGES_PER_READ
            ):  # bounded reads of large mappings
                try:
                    pagemap.seek(first * 8)
                    raw = pagemap.read(min(_PAGES_PER_READ, end // PAGE - first) * 8)
                except OSError:  # [vsyscall] and the like
                    break
                for entry in array.array("Q", raw):
                    if entry & _PRESENT:
                        pfn = entry & _PFN_MASK
                        if pfn:
                            hidden = False
                            frames.add(pfn)
    return None if hidden else frames


def together_bytes(pids: list[int]) -> int | None:
    """Resident memory of `pids` together, in bytes: the size of the union of their resident
    page frames (`resident_frames`); None when the kernel hides PFNs from this process."""
    union: set[int] = set()
    for pid in pids:
        frames = resident_frames(pid)
        if frames is None:
            return None
        union |= frames
    return len(union) * PAGE


def _children(ppid: int) -> dict[int, str]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
            if parent != ppid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                found[int(entry)] = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return found


@dataclass
class Deployment:
    backend: str = "sqlite"
    heartbeat_s: float = 15.0
    log_level: str = ""
    postgres_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    redis_url: str = "redis://127.0.0.1:6379/0"
    keep: bool = False
    http_port: int = 0
    org_id: str = ""
    api_key: str = ""
    env: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    workdir: pathlib.Path | None = None
    _databases: list[str] = field(default_factory=list)

    @property
    def grpc_addr(self) -> dict[str, str]:
        return {
            name: f"127.0.0.1:{self.env[f'LOOPLINE_{name.upper()}_PORT']}"
            for name in ("orchestrator", "billing", "tools")
        }

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "X-Organization-ID": self.org_id}

    def start(self, timeout: float = 120.0) -> None:
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="loopline-bench-"))
        plans = self.workdir / "plans.toml"
        plans.write_text(BENCH_PLANS)
        self.http_port = free_port()
        self.org_id = f"org_bench_{uuid.uuid4().hex[:8]}"
        self.api_key = f"mx_live_bench_{uuid.uuid4().hex}"
        env = {
            **os.environ,
            "LOOPLINE_DATA_DIR": str(self.workdir / "var"),
            "LOOPLINE_HTTP_PORT": str(self.http_port),
            "LOOPLINE_GATEWAY_GRPC_PORT": str(free_port()),
            "LOOPLINE_ORCHESTRATOR_PORT": str(free_port()),
            "LOOPLINE_BILLING_PORT": str(free_port()),
            "LOOPLINE_TOOLS_PORT": str(free_port()),
            "LOOPLINE_ORCHESTRATOR_METRICS_PORT": "0",
            "LOOPLINE_BILLING_METRICS_PORT": "0",
            "LOOPLINE_TOOLS_METRICS_PORT": "0",
            "LOOPLINE_DEV_API_KEY": self.api_key,
            "LOOPLINE_DEV_ORG_ID": self.org_id,
            "LOOPLINE_HEARTBEAT_INTERVAL_S": str(self.heartbeat_s),
            "LOOPLINE_BILLING_PLANS_PATH": str(plans),
            # one key drives every workload (thousands of requests a second, 10,000 listeners):
            # the gateway's rate limits are raised past that, as the plans' rate limits are,
            # and still counted on every request (their cost is part of what is measured)
            "LOOPLINE_KEY_REQUESTS_PER_MINUTE": "100000000",
            "LOOPLINE_FAILED_AUTHS_PER_MINUTE": "100000000",
            # the fan-out's listeners all use the one key
            "LOOPLINE_HTTP_LISTENS_PER_KEY": "1000000",
        }
        for name in ("orchestrator", "billing", "tools"):
            env[f"LOOPLINE_{name.upper()}_ADDR"] = (
                f"127.0.0.1:{env[f'LOOPLINE_{name.upper()}_PORT']}"
            )
        if self.log_level:
            env["LOOPLINE_LOG_LEVEL"] = self.log_level
        if self.backend == "postgres":
            env.update(self._postgres_env())
        self.env = env
        log = self.workdir / "dev.log"
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "scripts/dev.py",
                    "--log-dir",
                    str(self.workdir / "logs"),
                    "--timeout",
                    str(timeout),
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"scripts/dev.py exited ({self.process.returncode}):\n{tail}")
            if "Loopline is running." in log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        else:
            self.stop()
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"scripts/dev.py not ready within {timeout:.0f} s:\n{tail}")
        for pid, cmdline in _children(self.process.pid).items():
            for name in SERVICES:
                if f"services.{name}" in cmdline.split():
                    self.pids[name] = pid
        missing = [name for name in SERVICES if name not in self.pids]
        if missing:
            raise RuntimeError(
                f"could not find the processes of {missing} under scripts/dev.py "
                f"(pid {self.process.pid})"
            )

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def rss(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids.items()}

    def pss(self) -> dict[str, int]:
        return {name: pss_bytes(pid) for name, pid in self.pids.items()}

    def together(self) -> int | None:
        """Bytes the four service processes occupy together (`together_bytes`); None when
        unreadable."""
        return together_bytes(list(self.pids.values()))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, name: str, lines: int = 20) -> str:
        if self.workdir is None:
            return ""
        path = self.workdir / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._drop_postgres()
        if self.workdir is not None and not self.keep:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)

    # ----- PostgreSQL + Redis ------------------------------------------------------

    def _postgres_env(self) -> dict[str, str]:
        import asyncio

        import asyncpg

        tag = uuid.uuid4().hex[:8]
        names = {name: f"loopline_bench_{tag}_{name}" for name in SERVICES}

        async def create() -> None:
            conn = await asyncpg.connect(self.postgres_url)
            try:
                for db in names.values():
                    await conn.execute(f'CREATE DATABASE "{db}"')
            finally:
                await conn.close()

        asyncio.run(create())
        self._databases = list(names.values())
        base = self.postgres_url.rsplit("/", 1)[0].replace(
            "postgresql://", "postgresql+asyncpg://", 1
        )
        env = {
            f"LOOPLINE_{name.upper()}_DATABASE_URL": f"{base}/{db}" for name, db in names.items()
        }
        env["LOOPLINE_REDIS_URL"] = self.redis_url
        return env

    def _drop_postgres(self) -> None:
        if not self._databases:
            return
        import asyncio

        import asyncpg

        async def drop() -> None:
            conn = await asyncpg.connect(self.postgres_url)
            try:
                for db in self._databases:
                    await conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            finally:
                await conn.close()

        try:
            asyncio.run(drop())
        except Exception as exc:  # noqa: BLE001 - cleanup must not hide the results
            print(
                f"[bench] could not drop the bench databases {self._databases}: {exc}",
                file=sys.stderr,
            )
        self._databases = []
