"""The development runner: sets up, starts, watches and stops the four services (`make run`)."""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scripts.dev_first_turn import print_banner, seeded_identity, smoke
from scripts.dev_ports import Ports, hostport
from scripts.dev_processes import (
    ALL,
    BACKENDS,
    ROOT,
    Failure,
    Interrupted,
    Stop,
    console,
    describe_exit,
    log_tail,
    redact,
    signal_group,
    spawn,
)


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
                f"LOOPLINE_{name.upper()}_ADDR", hostport(self.ports.host, self.ports.grpc[name])
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
                    busy.append(f"  {hostport(host, port)}  {label}")
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
        """Run one-shot commands concurrently (output to the service's log); their stdout when
        `capture`."""
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
                            shown = self._show(steps, name)
                            raise Failure(
                                f"`{shown}` did not finish within {timeout:.0f} s", name
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
        seeded = seeded_identity(out["gateway"], f"python -m {self.module('gateway')} seed-dev")
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
        target = hostport(self.ports.host, self.ports.grpc[name])
        channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
            if response.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                return f"gRPC health on {target} reports {status}"
        except grpc.RpcError as error:
            return f"gRPC health on {target}: {error.code().name} {error.details() or ''}".rstrip()
        finally:
            channel.close()
        if name == "gateway":
            url = f"{self.ports.url}/healthz"
            try:
                with httpx.Client(trust_env=False, timeout=1.0) as client:
                    code = client.get(url).status_code
            except httpx.HTTPError as error:
                return f"GET {url}: {type(error).__name__} {error}"
            if code != 200:
                return f"GET {url} answered {code}"
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
        """SIGTERM the orchestrator, then the gateway, then billing and tools; SIGKILL what
        outlives the grace.

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
        logs = ", ".join(self._rel(self.log_path(name)) for name in ALL)
        stays_up = not (self.args.exit_when_ready or self.args.smoke)
        print_banner(self.ports.url, seeded, logs, stays_up)
        if self.args.smoke:
            return smoke(self.ports.url, seeded)
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
