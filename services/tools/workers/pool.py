"""The supervisor of integration workers, in the tools service: `WorkerPool.call` runs one
integration action in a worker process (`worker_main.py` under the integrations interpreter).

Why processes: integration code is third-party. A crash, a hang or a leak must end one call and
never the service, and its connections must obey the outbound policy whatever library it uses
(the worker enforces that at the socket). So:
- workers start on demand (none at start), at most `max_workers` at once; a call beyond waits
  for a free one within its own timeout;
- each runs in its own session with stderr discarded (integration output may hold secrets) and
  a minimal environment: never the service's own (its credential key, its database URLs);
- a call that times out or whose caller is cancelled kills its worker's process group; a worker
  that dies mid-call fails that call only; the next call gets a fresh worker;
- an idle worker exits after `idle_s`; a worker is replaced after `max_calls` calls, when its
  resident memory passes `recycle_rss_mb` after a call, or after a MemoryError.
Errors are `WorkerError`s whose messages are built from known fields only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import metrics
from services.tools.workers import worker_main

log = logging.getLogger(__name__)

WORKER_MAIN = Path(worker_main.__file__).resolve()
#: Calls a worker serves before it is replaced (bounds slow leaks and state kept by integrations).
DEFAULT_MAX_CALLS = 500
#: A worker whose resident memory passes this fraction of its memory limit after a call is replaced.
RECYCLE_FRACTION = 0.8
#: The largest answer line read from a worker (a result beyond fails its call).
DEFAULT_MAX_ANSWER_BYTES = 16 * 2**20
#: How long a worker told to exit (stdin closed) has before it is killed.
EXIT_GRACE_S = 2.0
#: Variables of the service's environment a worker gets (when set); nothing else is passed on.
PASSED_ENVIRONMENT = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
)
_TYPE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")


class WorkerError(Exception):
    """A call that did not return a result. The message is built from known fields only."""


class ActionFailed(WorkerError):
    """The action raised: `kind` (one of worker_main.ERROR_KINDS, or "too_large" for a result
    past `max_answer_bytes`), the exception's class name `type_name`, the HTTP `status` when it
    carried a response, and the kinds of connection the policy refused during the call."""

    def __init__(
        self, kind: str, type_name: str, status: int | None, refused: tuple[str, ...] = ()
    ) -> None:
        detail = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"the integration action failed: {kind}{detail}")
        self.kind = kind
        self.type_name = type_name
        self.status = status
        self.refused = refused


class ActionTimeout(WorkerError):
    """The action did not finish (or found no free worker) within `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the integration action did not finish within {timeout_s:g} s")
        self.timeout_s = timeout_s


class WorkerCrashed(WorkerError):
    """The worker ended (or broke its protocol) during the call; `returncode` when known
    (negative: the signal that ended it)."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__("the integration worker ended during the action")
        self.returncode = returncode


class WorkerUnavailable(WorkerError):
    """No worker could be started (the integrations interpreter is missing or broken), or the
    pool is closed."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"integration workers are unavailable: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class CallResult:
    """An action's result (JSON), the kinds of connection the policy refused during the call
    (an action may catch the refusal and still return), and the worker's memory after it."""

    value: Any
    refused: tuple[str, ...]
    rss_mb: float


class _Worker:
    """One worker process and what the pool knows of it."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.pid = process.pid
        self.calls = 0
        self.idle_timer: asyncio.TimerHandle | None = None

    async def exchange(self, request: bytes | None) -> dict[str, Any]:
        """Send the `request` line (None: only read) and read the next answer line;
        WorkerCrashed when the worker ends or writes what is not an answer."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            if request is not None:
                self.process.stdin.write(request)
                await self.process.stdin.drain()
            line = await self.process.stdout.readline()
        except ConnectionError:
            raise WorkerCrashed(self.process.returncode) from None
        except ValueError:  # a line past the stream's limit (the rest stays unread)
            raise ActionFailed("too_large", "AnswerTooLarge", None) from None
        if not line:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), EXIT_GRACE_S)
            raise WorkerCrashed(self.process.returncode)
        try:
            answer = json.loads(line)
        except ValueError:
            raise WorkerCrashed(None) from None
        if not isinstance(answer, dict):
            raise WorkerCrashed(None)
        return answer

    def kill(self) -> None:
        """SIGKILL the worker's process group (its session: anything it started goes too)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _result_of(answer: dict[str, Any], call_id: int) -> CallResult:
    """The CallResult of a worker's answer, or the ActionFailed it stands for. Answers are
    checked field by field: a worker runs third-party code that could write to its stream."""
    if answer.get("id") != call_id or not isinstance(answer.get("ok"), bool):
        raise WorkerCrashed(None)
    raw_refused = answer.get("refused")
    refused = tuple(
        kind
        for kind in (raw_refused if isinstance(raw_refused, list) else [])
        if kind in worker_main.REFUSAL_KINDS
    )
    if answer["ok"]:
        return CallResult(answer.get("result"), refused, _number(answer.get("rss_mb")))
    error = answer.get("error")
    error = error if isinstance(error, dict) else {}
    kind = str(error.get("kind")) if error.get("kind") in worker_main.ERROR_KINDS else "error"
    type_name = error.get("type")
    if not isinstance(type_name, str) or not _TYPE_NAME_RE.match(type_name):
        type_name = "Exception"
    status = error.get("status")
    if not (isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599):
        status = None
    raise ActionFailed(kind, type_name, status, refused)


class WorkerPool:
    """Integration workers run by `python` (the integrations interpreter), started on demand.

    Args:
        python: the interpreter that runs worker_main.py (one with the integrations installed).
        max_workers: the most workers alive at once (calls beyond wait for a free one).
        idle_s: how long an idle worker lives.
        memory_mb: each worker's address-space limit in MiB (0: none).
        allow_private: the outbound policy lets workers reach private and loopback addresses.
        hosts: name overrides, host -> "ip" | "ip:port" | ["ip:port", ...] (worker_main).
        path: extra import paths of the workers (an operator's own integration modules).
        env: more environment variables for the workers, given explicitly.
        max_calls: calls a worker serves before it is replaced.
        recycle_rss_mb: resident MiB after a call past which a worker is replaced (default
            RECYCLE_FRACTION of memory_mb; none when memory_mb is 0).
        max_answer_bytes: the largest answer read from a worker.
    Raises ValueError when `hosts` is malformed.
    """

    def __init__(
        self,
        python: str,
        *,
        max_workers: int = 4,
        idle_s: float = 300.0,
        memory_mb: int = 1024,
        allow_private: bool = False,
        hosts: Mapping[str, str | Sequence[str]] | None = None,
        path: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        max_calls: int = DEFAULT_MAX_CALLS,
        recycle_rss_mb: float | None = None,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        hosts_json = json.dumps(dict(hosts or {}))
        worker_main.parse_hosts(hosts_json)  # raises ValueError on a malformed map
        self._python = str(python)
        self._max_workers = max_workers
        self._idle_s = idle_s
        self._max_calls = max_calls
        self._max_answer_bytes = max_answer_bytes
        if recycle_rss_mb is None and memory_mb > 0:
            recycle_rss_mb = memory_mb * RECYCLE_FRACTION
        self._recycle_rss_mb = recycle_rss_mb
        self._settings = {
            worker_main.ENV_ALLOW_PRIVATE: "true" if allow_private else "false",
            worker_main.ENV_HOSTS: hosts_json,
            worker_main.ENV_MEMORY_MB: str(max(memory_mb, 0)),
            worker_main.ENV_PATH: os.pathsep.join(path),
        }
        self._extra_env = dict(env or {})
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[_Worker] = []  # most recently used last: reused first
        self._busy: set[_Worker] = set()
        self._endings: set[asyncio.Task[None]] = set()
        self._home: str | None = None
        self._call_ids = itertools.count(1)
        self._closed = False

    @property
    def workers(self) -> int:
        """Worker processes alive now (idle and busy)."""
        return len(self._idle) + len(self._busy)

    def environment(self) -> dict[str, str]:
        """A worker's whole environment: PASSED_ENVIRONMENT's variables the service has, a HOME
        of its own, the LOOPLINE_WORKER_* settings and the explicit `env`; nothing else."""
        if self._home is None:
            self._home = tempfile.mkdtemp(prefix="loopline-workers-")
        env = {name: os.environ[name] for name in PASSED_ENVIRONMENT if name in os.environ}
        env.setdefault("PATH", os.defpath)
        env.setdefault("LANG", "C.UTF-8")
        env["HOME"] = self._home
        env.update(self._settings)
        env.update(self._extra_env)
        return env

    async def call(
        self,
        module: str,
        function: str,
        arguments: Mapping[str, Any],
        timeout_s: float,
        *,
        named: Sequence[str] = (),
        own: Sequence[str] = (),
    ) -> CallResult:
        """Run `module.function(arguments)` in a worker and return its result. A connection to
        a host of `named` (the hosts the model put in the arguments) or below one is refused
        unless it is a host of `own` (the integration's) or below one: see worker_main.Policy.

        Raises ActionFailed (the action raised), ActionTimeout (no result within `timeout_s`,
        waiting for a free worker included: the worker is killed), WorkerCrashed (the worker
        ended during the call) or WorkerUnavailable; TypeError when `arguments` is not JSON. A
        cancelled caller kills its worker.
        """
        if self._closed:
            raise WorkerUnavailable("the pool is closed")
        call_id = next(self._call_ids)
        request: dict[str, Any] = {"id": call_id, "module": module, "function": function}
        request["arguments"] = dict(arguments)
        if named:
            request.update(named=list(named), own=list(own))
        line = json.dumps(request).encode() + b"\n"  # TypeError here: arguments JSON cannot hold
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_workers)
        slots = self._slots
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                await slots.acquire()
        except TimeoutError:
            raise ActionTimeout(timeout_s) from None
        try:
            return await self._call_in_slot(call_id, line, deadline, timeout_s)
        finally:
            slots.release()

    async def _call_in_slot(
        self, call_id: int, line: bytes, deadline: float, timeout_s: float
    ) -> CallResult:
        """`call` once a slot is held: take or start a worker, exchange, settle the worker."""
        worker: _Worker | None = None
        answer: dict[str, Any] | None = None
        reason = "cancelled"  # why the worker is killed, if it is
        try:
            async with asyncio.timeout_at(deadline):
                worker = self._take_idle() or await self._start()
                worker.calls += 1
                answer = await worker.exchange(line)
            result = _result_of(answer, call_id)
        except TimeoutError:
            reason = "timeout"
            raise ActionTimeout(timeout_s) from None
        except WorkerCrashed:
            reason = "crashed" if worker and worker.process.returncode is not None else "protocol"
            raise
        except ActionFailed:
            if worker is not None and answer is not None:  # the action failed, not the worker
                self._settle(worker, answer)
                worker = None
            reason = "answer too large"
            raise
        else:
            self._settle(worker, answer)
            worker = None
            return result
        finally:
            if worker is not None:  # timed out, crashed, cancelled or answered nonsense
                self._busy.discard(worker)
                worker.kill()
                self._end(worker, reason)

    def _take_idle(self) -> _Worker | None:
        """The most recently used idle worker still alive, now busy (None when there is none)."""
        while self._idle:
            worker = self._idle.pop()
            if worker.idle_timer is not None:
                worker.idle_timer.cancel()
                worker.idle_timer = None
            if worker.process.returncode is None:
                self._busy.add(worker)
                return worker
            self._end(worker, "ended while idle")
        return None

    async def _start(self) -> _Worker:
        """Start a worker and wait for its ready line; WorkerUnavailable when it cannot run."""
        env = self.environment()  # makes the workers' home, their working directory too
        try:
            process = await asyncio.create_subprocess_exec(
                self._python,
                "-I",
                str(WORKER_MAIN),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=env,
                cwd=env["HOME"],
                start_new_session=True,
                limit=self._max_answer_bytes,
            )
        except OSError as exc:
            log.warning(
                "integration worker cannot start",
                extra={"fields": {"python": self._python, "error": type(exc).__name__}},
            )
            raise WorkerUnavailable("the integrations interpreter cannot be started") from None
        worker = _Worker(process)
        metrics.integration_worker_started()
        self._busy.add(worker)
        try:
            ready = await worker.exchange(None)
            if ready.get("ready") is not True:
                raise WorkerCrashed(None)
        except WorkerCrashed:
            self._busy.discard(worker)
            worker.kill()
            self._end(worker, "failed to start")
            raise WorkerUnavailable("the integration worker did not start") from None
        except BaseException:
            self._busy.discard(worker)
            worker.kill()
            self._end(worker, "killed while starting")
            raise
        log.info(
            "integration worker started",
            extra={"fields": {"pid": worker.pid, "rss_mb": _number(ready.get("rss_mb"))}},
        )
        return worker

    def _settle(self, worker: _Worker, answer: dict[str, Any]) -> None:
        """After an answer: keep the worker idle, or let it go when it is exiting, too big or
        has served its calls."""
        self._busy.discard(worker)
        rss = _number(answer.get("rss_mb"))
        if answer.get("exiting") is True:
            reason = "out of memory"
        elif self._recycle_rss_mb is not None and rss > self._recycle_rss_mb:
            reason = "memory above the recycle mark"
        elif worker.calls >= self._max_calls:
            reason = "served its calls"
        elif self._closed:
            reason = "pool closed"
        else:
            self._idle.append(worker)
            loop = asyncio.get_running_loop()
            worker.idle_timer = loop.call_later(self._idle_s, self._expire, worker)
            return
        self._retire(worker, reason)

    def _expire(self, worker: _Worker) -> None:
        """The idle timer: an idle worker past `idle_s` exits."""
        worker.idle_timer = None
        if worker in self._idle:
            self._idle.remove(worker)
            self._retire(worker, "idle")

    def _retire(self, worker: _Worker, reason: str) -> None:
        """Ask `worker` to exit (stdin closed) and kill it if it has not after EXIT_GRACE_S."""
        if worker.process.stdin is not None:
            worker.process.stdin.close()
        self._end(worker, reason, grace_s=EXIT_GRACE_S)

    def _end(self, worker: _Worker, reason: str, grace_s: float = 0.0) -> None:
        """Reap `worker` in the background (killed after `grace_s`) and log its exit."""
        task = asyncio.get_running_loop().create_task(self._reap(worker, reason, grace_s))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _reap(self, worker: _Worker, reason: str, grace_s: float) -> None:
        """Wait for `worker` to end (killing it after `grace_s`); one log line with its pid,
        the reason and its exit status or signal."""
        try:
            await asyncio.wait_for(worker.process.wait(), grace_s)
        except TimeoutError:
            worker.kill()
            await worker.process.wait()
        returncode = worker.process.returncode
        fields: dict[str, Any] = {"pid": worker.pid, "reason": reason, "calls": worker.calls}
        if returncode is not None and returncode < 0:
            try:
                fields["signal"] = signal.Signals(-returncode).name
            except ValueError:
                fields["signal"] = str(-returncode)
        else:
            fields["exit_code"] = returncode
        log.info("integration worker exited", extra={"fields": fields})
        metrics.integration_worker_ended(reason)

    async def close(self) -> None:
        """Stop every worker (busy ones are killed: their calls fail) and remove their home."""
        self._closed = True
        for worker in list(self._idle):
            if worker.idle_timer is not None:
                worker.idle_timer.cancel()
            self._retire(worker, "pool closed")
        self._idle.clear()
        for worker in list(self._busy):
            worker.kill()
        while self._endings:
            await asyncio.gather(*list(self._endings), return_exceptions=True)
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None
