"""The development runner's plumbing: its console, its stop signals and its child processes.

Children run in process groups of their own (a terminal's Ctrl-C reaches only the runner, which
stops them in order) and, on Linux, get SIGTERM if the runner dies without stopping them.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = ("orchestrator", "billing", "tools")
ALL = (*BACKENDS, "gateway")
_PR_SET_PDEATHSIG = 1

try:  # Linux: children get SIGTERM if this runner dies without stopping them
    import ctypes

    _LIBC: Any = ctypes.CDLL(None, use_errno=True)
    _LIBC.prctl  # noqa: B018 - fail here, not in the child, when it is missing
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None


class Failure(Exception):
    """Something the developer must fix; `services` name those whose log tails help."""

    def __init__(self, message: str, *services: str) -> None:
        super().__init__(message)
        self.services = services


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived while setting up."""


class Console:
    """Thread-safe printing: runner messages and optional prefixed child log lines.

    A closed output (`make run | tee log` after Ctrl-C reached `tee` too) silences the
    console instead of raising: the orderly stop goes on (the service logs keep everything).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed: set[int] = set()

    def _write(self, stream: Any, message: str) -> None:
        if id(stream) in self._closed:
            return
        try:
            print(message, file=stream, flush=True)
        except (BrokenPipeError, ValueError, OSError):
            self._closed.add(id(stream))
            with contextlib.suppress(
                OSError, ValueError
            ):  # so the flush at exit does not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())

    def say(self, message: str = "") -> None:
        with self._lock:
            self._write(sys.stdout, message)

    def error(self, message: str) -> None:
        with self._lock:
            self._write(sys.stderr, message)


console = Console()


class Stop:
    """The stop request set by SIGINT/SIGTERM; a second signal asks for an immediate kill."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals = 0
        self.reason = ""

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signals += 1
        if not self.reason:
            self.reason = signal.Signals(signum).name
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    @property
    def hurry(self) -> bool:
        return self.signals >= 2


def _die_with_parent(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the runner died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def spawn(
    argv: Sequence[str], env: dict[str, str], stdout: IO[bytes] | int, stderr: IO[bytes] | int
) -> subprocess.Popen[bytes]:
    """Start a child in its own process group (so a terminal's Ctrl-C reaches only us)."""
    return subprocess.Popen(
        list(argv),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )


_SECRET_FIELD = re.compile(rb'("api_key"\s*:\s*")[^"]*(")')


def redact(output: bytes) -> bytes:
    """`output` with the value of every JSON "api_key" field replaced by "<redacted>" (for logs)."""
    return _SECRET_FIELD.sub(rb"\1<redacted>\2", output)


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send `sig` to the child's process group (the child and anything it started)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: pathlib.Path, lines: int = 25) -> str:
    """The last `lines` lines of a child log, JSON log records rendered readably."""
    try:
        data = path.read_bytes()
    except OSError:
        return "    (no log)"
    text = data[-64_000:].decode("utf-8", "replace").splitlines()[-lines:]
    if not text:
        return "    (the log is empty)"
    out: list[str] = []
    for line in text:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "message" in record:
            out.append(
                f"    {record.get('level', '?')} {record.get('logger', '')}: {record['message']}"
            )
            if record.get("traceback"):
                out += ["      " + tb for tb in str(record["traceback"]).splitlines()[-15:]]
        else:
            out.append("    " + line[:2000])
    return "\n".join(out)
