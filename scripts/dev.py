"""Run all of Loopline on one machine for development: what `make run` starts.

1. Checks that the five development ports are free.
2. Applies every service's migrations (`python -m services.<name> migrate`).
3. Seeds a development organization, owner and API key (`python -m services.gateway
   seed-dev`, which honors LOOPLINE_DEV_API_KEY and LOOPLINE_DEV_ORG_ID) and gives it a
   plan with credits (`python -m services.billing admin seed-dev --org ORG`).
4. Starts orchestrator, billing and tools, waits until each reports SERVING on
   grpc.health.v1, then starts the gateway and waits for its gRPC health and `GET /healthz`.
5. Prints the gateway URL, the organization id, the API key and a curl pair to try a turn.
6. Runs until Ctrl-C / SIGTERM (then stops every child: SIGTERM, wait, SIGKILL) or until
   a child dies (then reports it and stops the rest, exit code 1).

Every child gets the same environment (plus the downstream addresses derived from the
ports, unless set) and writes to var/logs/<service>.log; `--logs` also echoes the logs
here with a prefix. Works without a TTY. Run it with the project's virtual environment:
`make run` (options through `make run DEV_ARGS='--logs'`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

try:
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc
except ImportError as exc:  # pragma: no cover - depends on how it is started
    sys.exit(f"dev.py: {exc}; run it with the project's virtual environment: `make run`")

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = ("orchestrator", "billing", "tools")
ALL = (*BACKENDS, "gateway")
CHAT_EXAMPLE = '{"message":"What integrations are available?"}'
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


@dataclasses.dataclass
class Ports:
    """The fixed development ports, from the same variables the services read."""

    host: str
    http_host: str
    http: int
    grpc: dict[str, int]

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Ports:
        return cls(
            host=_connect_host(env.get("LOOPLINE_HOST", "127.0.0.1")),
            http_host=_connect_host(env.get("LOOPLINE_HTTP_HOST", "127.0.0.1")),
            http=_port(env, "LOOPLINE_HTTP_PORT", 8000),
            grpc={
                "gateway": _port(env, "LOOPLINE_GATEWAY_GRPC_PORT", 50050),
                "orchestrator": _port(env, "LOOPLINE_ORCHESTRATOR_PORT", 50051),
                "billing": _port(env, "LOOPLINE_BILLING_PORT", 50052),
                "tools": _port(env, "LOOPLINE_TOOLS_PORT", 50053),
            },
        )

    def labelled(self) -> list[tuple[str, int, str]]:
        """Every (host, port) with the service and variable it belongs to."""
        labels = [(self.http_host, self.http, "gateway HTTP (LOOPLINE_HTTP_PORT)")]
        variables = {
            "gateway": "LOOPLINE_GATEWAY_GRPC_PORT",
            "orchestrator": "LOOPLINE_ORCHESTRATOR_PORT",
            "billing": "LOOPLINE_BILLING_PORT",
            "tools": "LOOPLINE_TOOLS_PORT",
        }
        labels += [
            (self.host, port, f"{name} gRPC ({variables[name]})")
            for name, port in self.grpc.items()
        ]
        return labels

    @property
    def url(self) -> str:
        return f"http://{_hostport(self.http_host, self.http)}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(bind: str) -> str:
    """Where to reach a server that binds `bind` (a wildcard is reached on loopback)."""
    bind = bind.strip().strip("[]")
    return "127.0.0.1" if bind in ("", "0.0.0.0", "::") else bind


def _port(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        raise Failure(f"{name}={raw!r} is not a port number") from None
    if not 0 < port < 65536:
        raise Failure(
            f"{name}={port}: the development runner needs fixed ports between 1 and 65535"
        )
    return port


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


class Runner:
    """Sets up, starts, watches and stops the four services."""

    def __init__(self, args: argparse.Namespace, stop: Stop) -> None:
        self.args = args
        self.stop = stop
        self.ports = Ports.from_env(dict(os.environ))
        self.env = self._environment()
        data_dir = pathlib.Path(self.env.get("LOOPLINE_DATA_DIR") or ROOT / "var")
        self.log_dir: pathlib.Path = (
            args.log_dir or (data_dir if data_dir.is_absolute() else ROOT / data_dir) / "logs"
        )
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.log_files: dict[str, IO[bytes]] = {}
        self.log_starts: dict[str, int] = {}  # where this run's lines begin in each log (open_logs)
        self.followers: list[threading.Thread] = []
        self.finished = threading.Event()

    # ----- set-up -------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for name in BACKENDS:  # where the others reach each backend, unless set
            env.setdefault(
                f"LOOPLINE_{name.upper()}_ADDR", _hostport(self.ports.host, self.ports.grpc[name])
            )
        return env

    def module(self, name: str) -> str:
        return self.args.module.format(name=name)

    def log_path(self, name: str) -> pathlib.Path:
        return self.log_dir / f"{name}.log"

    def check_ports(self) -> None:
        busy = []
        for host, port, label in self.ports.labelled():
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.settimeout(0.5)
                if sock.connect_ex((host, port)) == 0:
                    busy.append(f"  {_hostport(host, port)}  {label}")
        if busy:
            raise Failure(
                "these ports are already in use (another `make run` still running?):\n"
                + "\n".join(busy)
                + "\nStop whatever holds them, or choose other ports with the variables named."
            )

    def open_logs(self) -> None:
        """Open each service's log for appending (an earlier run's lines, e.g. a crash's, stay)
        behind a line that marks this start; the console follows from that line on.
        Raises Failure when the folder cannot be made (e.g. LOOPLINE_DATA_DIR names a file)."""
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise Failure(
                f"cannot create the log folder {self.log_dir}: {error.strerror} "
                "(LOOPLINE_DATA_DIR must be a folder, or a path where one can be made)"
            ) from None
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        for name in ALL:
            handle = open(self.log_path(name), "ab")  # noqa: SIM115 - closed in close_logs
            self.log_starts[name] = handle.tell()
            handle.write(f"===== make run started {started} =====\n".encode())
            handle.flush()
            self.log_files[name] = handle

    def close_logs(self) -> None:
        for handle in self.log_files.values():
            handle.close()

    def run_steps(
        self, steps: Sequence[tuple[str, list[str]]], capture: bool, timeout: float
    ) -> dict[str, str]:
        """Run one-shot commands concurrently (output to the service's log); stdout when `capture`."""
        procs: dict[str, subprocess.Popen[bytes]] = {}
        outputs: dict[str, str] = {}
        for name, argv in steps:
            log = self.log_files[name]
            log.write(f"$ {shlex.join(argv)}\n".encode())
            log.flush()
            procs[name] = spawn(argv, self.env, subprocess.PIPE if capture else log, log)
        deadline = time.monotonic() + timeout
        try:
            for name, proc in procs.items():
                while True:
                    try:
                        out, _ = proc.communicate(timeout=0.2)
                        break
                    except subprocess.TimeoutExpired:
                        if self.stop.requested:
                            raise Interrupted from None
                        if time.monotonic() > deadline:
                            raise Failure(
                                f"`{self._show(steps, name)}` did not finish within {timeout:.0f} s",
                                name,
                            ) from None
                outputs[name] = (out or b"").decode("utf-8", "replace")
                if capture:  # logged without secrets (the seed step prints the dev API key)
                    self.log_files[name].write(redact(out or b""))
                    self.log_files[name].flush()
                if proc.returncode != 0:
                    raise Failure(
                        f"`{self._show(steps, name)}` failed ({describe_exit(proc.returncode)})",
                        name,
                    )
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    signal_group(proc, signal.SIGKILL)
                    proc.wait()
        return outputs

    @staticmethod
    def _show(steps: Sequence[tuple[str, list[str]]], name: str) -> str:
        argv = dict(steps)[name]
        return shlex.join(["python", *argv[1:]])

    def migrate(self) -> None:
        console.say("[dev] applying migrations: " + ", ".join(ALL))
        self.run_steps(
            [(name, [sys.executable, "-m", self.module(name), "migrate"]) for name in ALL],
            False,
            180,
        )

    def seed(self) -> dict[str, Any]:
        console.say("[dev] seeding the development organization")
        out = self.run_steps(
            [("gateway", [sys.executable, "-m", self.module("gateway"), "seed-dev"])], True, 120
        )
        seeded = None
        for line in reversed(out["gateway"].splitlines()):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and {"organization_id", "api_key"} <= value.keys():
                seeded = value
                break
        if seeded is None:
            raise Failure(
                f"`python -m {self.module('gateway')} seed-dev` printed no JSON line with organization_id and api_key; it printed:\n"
                + (out["gateway"].strip() or "(nothing)"),
                "gateway",
            )
        org = str(seeded["organization_id"])
        self.run_steps(
            [
                (
                    "billing",
                    [
                        sys.executable,
                        "-m",
                        self.module("billing"),
                        "admin",
                        "seed-dev",
                        "--org",
                        org,
                    ],
                )
            ],
            False,
            120,
        )
        return seeded

    # ----- serving ------------------------------------------------------------------

    def start(self, name: str) -> None:
        log = self.log_files[name]
        argv = [sys.executable, "-m", self.module(name)]
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        # the runner has just applied every migration: the services need not check again
        self.children[name] = spawn(argv, {"LOOPLINE_AUTO_MIGRATE": "false", **self.env}, log, log)

    def probe(self, name: str) -> str | None:
        """None when `name` is ready, else what is missing."""
        target = _hostport(self.ports.host, self.ports.grpc[name])
        channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
            if response.status != health_pb2.HealthCheckResponse.SERVING:
                return f"gRPC health on {target} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
        except grpc.RpcError as error:
            return f"gRPC health on {target}: {error.code().name} {error.details() or ''}".rstrip()
        finally:
            channel.close()
        if name == "gateway":
            url = f"{self.ports.url}/healthz"
            try:
                with httpx.Client(trust_env=False, timeout=1.0) as client:
                    status = client.get(url).status_code
            except httpx.HTTPError as error:
                return f"GET {url}: {type(error).__name__} {error}"
            if status != 200:
                return f"GET {url} answered {status}"
        return None

    def check_children(self) -> None:
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                raise Failure(f"{name} exited unexpectedly ({describe_exit(code)})", name)

    def wait_ready(self, names: Sequence[str], deadline: float) -> None:
        pending = {name: "not probed yet" for name in names}
        started = time.monotonic()
        while pending:
            if self.stop.requested:
                raise Interrupted
            self.check_children()
            for name in list(pending):
                problem = self.probe(name)
                if problem is None:
                    del pending[name]
                    console.say(f"[dev] {name} is ready ({time.monotonic() - started:.1f} s)")
                else:
                    pending[name] = problem
            if not pending:
                return
            if time.monotonic() > deadline:
                raise Failure(
                    f"not healthy within {self.args.timeout:.0f} s: "
                    + "; ".join(f"{name} ({problem})" for name, problem in pending.items()),
                    *pending,
                )
            self.stop.event.wait(0.25)

    def follow_logs(self) -> None:
        width = max(len(name) for name in ALL)
        for name in ALL:
            thread = threading.Thread(target=self._follow, args=(name, width), daemon=True)
            thread.start()
            self.followers.append(thread)

    def _follow(self, name: str, width: int) -> None:
        with open(self.log_path(name), "rb") as handle:
            handle.seek(self.log_starts.get(name, 0))
            while True:
                line = handle.readline()
                if not line:
                    if self.finished.is_set():
                        return
                    time.sleep(0.1)
                    continue
                console.say(f"{name:<{width}} | {line.decode('utf-8', 'replace').rstrip()}")

    def watch(self) -> None:
        """Until a stop is requested; a child that dies ends it with a Failure."""
        while not self.stop.requested:
            self.check_children()
            self.stop.event.wait(0.5)

    def stop_children(self) -> None:
        """SIGTERM the orchestrator, then the gateway, then billing and tools; SIGKILL what outlives the grace.

        The orchestrator goes first so that its active runs end with `cancelled {reason:
        "shutdown"}` (README "Decisions"), which the gateway still delivers to open streams
        before it stops; billing stays up until the orchestrator has recorded their usage.
        """
        for wave in (
            ["orchestrator"],
            ["gateway"],
            [name for name in BACKENDS if name != "orchestrator"],
        ):
            procs = {name: self.children[name] for name in wave if name in self.children}
            running = {name: proc for name, proc in procs.items() if proc.poll() is None}
            if not running:
                continue
            console.say(f"[dev] stopping {', '.join(running)}")
            for proc in running.values():
                signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + self.args.stop_timeout
            while any(proc.poll() is None for proc in running.values()):
                if time.monotonic() > deadline or self.stop.hurry:
                    for name, proc in running.items():
                        if proc.poll() is None:
                            why = (
                                "a second signal"
                                if self.stop.hurry
                                else f"no exit within {self.args.stop_timeout:.0f} s"
                            )
                            console.error(f"[dev] killing {name} ({why})")
                            signal_group(proc, signal.SIGKILL)
                    for proc in running.values():
                        proc.wait()
                    break
                time.sleep(0.1)
            for name, proc in running.items():
                console.say(f"[dev] {name} stopped ({describe_exit(proc.returncode)})")

    # ----- the whole run ------------------------------------------------------------

    def run(self) -> int:
        self.check_ports()
        self.open_logs()
        try:
            return self._run()
        except Interrupted:
            console.say(f"\n[dev] {self.stop.reason or 'stop'} received, stopping")
            return 0
        except Failure as failure:
            self._report(failure)
            return 1
        finally:
            self.stop_children()
            self.finished.set()
            for thread in self.followers:
                thread.join(timeout=2)
            self.close_logs()

    def _run(self) -> int:
        self.migrate()
        seeded = self.seed()
        deadline = time.monotonic() + self.args.timeout
        console.say(f"[dev] starting {', '.join(BACKENDS)} (logs in {self._rel(self.log_dir)}/)")
        for name in BACKENDS:
            self.start(name)
        self.wait_ready(BACKENDS, deadline)
        console.say("[dev] starting gateway")
        self.start("gateway")
        if self.args.logs:
            self.follow_logs()
        self.wait_ready(["gateway"], deadline)
        self.print_banner(seeded)
        if self.args.smoke:
            return self.smoke(seeded)
        if self.args.exit_when_ready:
            return 0
        self.watch()
        raise Interrupted

    def _report(self, failure: Failure) -> None:
        console.error(f"\n[dev] ERROR: {failure}")
        for name in failure.services:
            path = self.log_path(name)
            console.error(f"[dev] last lines of {self._rel(path)}:\n{log_tail(path)}")

    @staticmethod
    def _rel(path: pathlib.Path) -> str:
        try:
            return str(path.resolve().relative_to(ROOT))
        except ValueError:
            return str(path)

    def print_banner(self, seeded: dict[str, Any]) -> None:
        url, org, key = self.ports.url, str(seeded["organization_id"]), str(seeded["api_key"])
        auth = f"-H {_q(f'Authorization: Bearer {key}')} -H {_q(f'X-Organization-ID: {org}')}"
        post = (
            f"curl -sS -X POST {url}/assistant/chat {auth} "
            f"-H \"Content-Type: application/json\" -d '{CHAT_EXAMPLE}'"
        )
        chain = (
            f'R=$({post}) && echo "$R" && '
            'U=$(printf \'%s\' "$R" | sed -n \'s/.*"stream_url" *: *"\\([^"]*\\)".*/\\1/p\') && '
            f'curl -sS -N "{url}$U" {auth}'
        )
        logs = ", ".join(self._rel(self.log_path(name)) for name in ALL)
        console.say(
            "\n".join(
                [
                    "",
                    "Loopline is running.",
                    f"  gateway          {url}",
                    f"  organization id  {org}",
                    f"  API key          {key}",
                    f"  logs             {logs}",
                    "",
                    "1) Start a turn (the answer holds chat_id, run_id and stream_url):",
                    "",
                    f"curl -sS -X POST {url}/assistant/chat \\",
                    f"  -H {_q(f'Authorization: Bearer {key}')} \\",
                    f"  -H {_q(f'X-Organization-ID: {org}')} \\",
                    '  -H "Content-Type: application/json" \\',
                    f"  -d '{CHAT_EXAMPLE}'",
                    "",
                    "2) Listen to it (put in the chat_id and run_id from the answer):",
                    "",
                    f"curl -N {url}/assistant/chat/CHAT_ID/listen/RUN_ID \\",
                    f"  -H {_q(f'Authorization: Bearer {key}')} \\",
                    f"  -H {_q(f'X-Organization-ID: {org}')}",
                    "",
                    "Or both in one line (POSIX shell, no jq or python needed):",
                    "",
                    chain,
                    "",
                    "Press Ctrl-C to stop all four services."
                    if not (self.args.exit_when_ready or self.args.smoke)
                    else "",
                ]
            )
        )

    def smoke(self, seeded: dict[str, Any]) -> int:
        """Drive the printed curl pair once over HTTP and check the stream ends with `done`."""
        headers = {
            "Authorization": f"Bearer {seeded['api_key']}",
            "X-Organization-ID": str(seeded["organization_id"]),
        }
        with httpx.Client(base_url=self.ports.url, trust_env=False, timeout=30.0) as client:
            response = client.post(
                "/assistant/chat", headers=headers, json=json.loads(CHAT_EXAMPLE)
            )
            console.say(f"[smoke] POST /assistant/chat -> {response.status_code} {response.text}")
            if response.status_code != 200:
                raise Failure("the smoke turn was refused", "gateway")
            body = response.json()
            path = (
                body.get("stream_url")
                or f"/assistant/chat/{body['chat_id']}/listen/{body['run_id']}"
            )
            types = []
            with client.stream("GET", path, headers=headers) as stream:
                if stream.status_code != 200:
                    raise Failure(f"GET {path} answered {stream.status_code}", "gateway")
                for line in stream.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    frame = json.loads(line[len("data: ") :])
                    types.append(frame.get("type"))
                    console.say(f"[smoke] {line}")
            if not types or types[-1] != "done":
                raise Failure(f"the stream ended without a done frame: {types}", "orchestrator")
        console.say(f"[smoke] OK: {' -> '.join(str(t) for t in types)}")
        return 0


def _q(value: str) -> str:
    """Double-quote `value` for a shell when that is safe, else single-quote it."""
    if re.fullmatch(r"[A-Za-z0-9 _.:/=+@,%-]*", value):
        return f'"{value}"'
    return shlex.quote(value)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--logs",
        action="store_true",
        help="also echo every service's log here, prefixed with its name",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for all services to be healthy (60)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds a child gets after SIGTERM before SIGKILL (10)",
    )
    parser.add_argument(
        "--log-dir",
        type=pathlib.Path,
        default=None,
        help="folder of the service logs ($LOOPLINE_DATA_DIR/logs, by default var/logs)",
    )
    parser.add_argument(
        "--exit-when-ready",
        action="store_true",
        help="stop everything once all services are healthy (a check)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="once ready, run the printed turn over HTTP, check it ends with done, stop",
    )
    parser.add_argument(
        "--module",
        default="services.{name}",
        help="module run for each service, {name} replaced (for testing this runner)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop = Stop()
    stop.install()
    try:
        runner = Runner(args, stop)
    except Failure as failure:
        console.error(f"[dev] ERROR: {failure}")
        return 2
    try:
        return runner.run()
    except Failure as failure:  # raised before anything started (ports)
        console.error(f"[dev] ERROR: {failure}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
