"""The real processes, started as `make run` starts them (scripts/dev.py), on free ports."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Deployment:
    """A running `scripts/dev.py` with its gateway URL, organization and key."""

    base_url: str
    org_id: str
    api_key: str
    process: subprocess.Popen
    log: pathlib.Path
    pipe: Any = None

    def close_pipe(self) -> None:
        """Close the reading end of a piped deployment's output (see `start_deployment`)."""
        if self.pipe is not None:
            os.close(self.pipe.fileno())

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "X-Organization-ID": self.org_id}


def start_deployment(
    data: pathlib.Path,
    log_dir: pathlib.Path | None = None,
    piped: bool = False,
    env: dict[str, str] | None = None,
) -> Deployment:
    """Start scripts/dev.py on free ports with a fixed dev key and org, its data under `data`
    (logs in `log_dir` when given, else dev.py's default); returns once it printed the curl pair.

    `piped`: dev.py writes into a pipe that a thread copies to `data/dev.log` (as `make run |
    tee`); `Deployment.close_pipe()` closes the reading end, as when Ctrl-C also stops `tee`.
    `env`: more environment variables (settings) for the services."""
    http_port = free_port()
    extra = env or {}
    env = {
        **os.environ,
        **extra,
        "LOOPLINE_DATA_DIR": str(data / "var"),
        "LOOPLINE_HTTP_PORT": str(http_port),
        "LOOPLINE_GATEWAY_GRPC_PORT": str(free_port()),
        "LOOPLINE_ORCHESTRATOR_PORT": str(free_port()),
        "LOOPLINE_BILLING_PORT": str(free_port()),
        "LOOPLINE_TOOLS_PORT": str(free_port()),
        "LOOPLINE_ORCHESTRATOR_METRICS_PORT": "0",
        "LOOPLINE_BILLING_METRICS_PORT": "0",
        "LOOPLINE_TOOLS_METRICS_PORT": "0",
        "LOOPLINE_DEV_API_KEY": f"mx_live_e2e_{uuid.uuid4().hex}",
        "LOOPLINE_DEV_ORG_ID": f"org_e2e_{uuid.uuid4().hex[:8]}",
        "LOOPLINE_HEARTBEAT_INTERVAL_S": "1",
    }
    env["LOOPLINE_ORCHESTRATOR_ADDR"] = f"127.0.0.1:{env['LOOPLINE_ORCHESTRATOR_PORT']}"
    env["LOOPLINE_BILLING_ADDR"] = f"127.0.0.1:{env['LOOPLINE_BILLING_PORT']}"
    env["LOOPLINE_TOOLS_ADDR"] = f"127.0.0.1:{env['LOOPLINE_TOOLS_PORT']}"
    log = data / "dev.log"
    argv = [sys.executable, "scripts/dev.py"] + (
        ["--log-dir", str(log_dir)] if log_dir is not None else []
    )
    out = log.open("wb")  # opened here: the readiness loop below reads it
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE if piped else out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pipe = process.stdout  # None unless piped
    if pipe is None:
        out.close()  # the child has its own copy of the descriptor
    else:

        def copy() -> None:
            with out:
                try:
                    for line in iter(pipe.readline, b""):
                        out.write(line)
                        out.flush()
                except (ValueError, OSError):  # the pipe was closed under us (close_pipe)
                    pass

        threading.Thread(target=copy, daemon=True).start()
    base_url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 90
    ready = False
    while time.monotonic() < deadline and process.poll() is None:
        if "curl" in log.read_text(errors="replace"):
            ready = True
            break
        time.sleep(0.2)
    if not ready:
        process.kill()
        pytest.fail(
            f"scripts/dev.py did not become ready:\n{log.read_text(errors='replace')[-4000:]}"
        )
    assert httpx.get(f"{base_url}/healthz").status_code == 200
    return Deployment(
        base_url, env["LOOPLINE_DEV_ORG_ID"], env["LOOPLINE_DEV_API_KEY"], process, log, pipe
    )


def stop_deployment(deployment: Deployment, timeout: float = 30) -> None:
    """Ctrl-C to dev.py's process group; SIGKILL (and an error) when it outlives `timeout`."""
    process = deployment.process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    """scripts/dev.py running the four services on free ports with a fixed dev key and org."""
    data = tmp_path_factory.mktemp("e2e")
    started = start_deployment(data, data / "logs")
    yield started
    stop_deployment(started)
