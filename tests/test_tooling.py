"""The project's own tooling: generated code, buf lint, the Makefile, .ci/run and scripts/dev.py.

scripts/dev.py (what `make run` runs) is tested against stand-in services that serve
grpc.health.v1 (and /healthz for the gateway), so these tests check the runner itself:
setup order, readiness, the printed curl pair, clean failures and clean stops.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUF = ROOT / "node_modules" / ".bin" / "buf"
DEV = ROOT / "scripts" / "dev.py"
SERVICES = ("gateway", "orchestrator", "billing", "tools")


def _tree(folder: pathlib.Path) -> set[str]:
    return {
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".pyi"}
    }


def test_generated_code_is_up_to_date_with_protos(tmp_path: pathlib.Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_protos.py", tmp_path / "scripts" / "gen_protos.py")
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "gen_protos.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    fresh, committed = tmp_path / "loopline", ROOT / "loopline"
    assert _tree(fresh) == _tree(committed), "files differ: run `make gen` and commit loopline/"
    changed = [
        name
        for name in sorted(_tree(fresh))
        if not filecmp.cmp(fresh / name, committed / name, shallow=False)
    ]
    assert not changed, f"stale generated code in loopline/: {changed}; run `make gen`"


@pytest.mark.skipif(not BUF.exists(), reason="node_modules/.bin/buf is not installed (`make buf`)")
def test_buf_lint_passes() -> None:
    result = subprocess.run(
        [str(BUF), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_help_lists_every_target() -> None:
    result = subprocess.run(
        ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    expected = {
        "venv",
        "buf",
        "gen",
        "gen-check",
        "lint",
        "format",
        "breaking",
        "migrate",
        "run",
        "test",
        "test-pg",
        "clean",
    }
    assert expected <= listed


def test_ci_run_is_valid_bash_with_strict_mode() -> None:
    script = ROOT / ".ci" / "run"
    assert (
        subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    )
    assert "set -euo pipefail" in script.read_text()


# ----- scripts/dev.py against stand-in services ------------------------------------

FAKE = '''
"""A stand-in for one Loopline service, driven by FAKE_<NAME> = ok | crash | unhealthy | die.

die: serves until the file FAKE_DIE_FILE exists, then exits with code 4.
"""
import asyncio, json, os, signal, sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

PORTS = {"gateway": "LOOPLINE_GATEWAY_GRPC_PORT", "orchestrator": "LOOPLINE_ORCHESTRATOR_PORT",
         "billing": "LOOPLINE_BILLING_PORT", "tools": "LOOPLINE_TOOLS_PORT"}


async def healthz(reader, writer):
    await reader.readuntil(b"\\r\\n\\r\\n")
    writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\nconnection: close\\r\\n\\r\\nok")
    await writer.drain()
    writer.close()


async def serve(name, behaviour):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port("127.0.0.1:" + os.environ[PORTS[name]])
    await server.start()
    serving = health_pb2.HealthCheckResponse
    status = serving.NOT_SERVING if behaviour == "unhealthy" else serving.SERVING
    await servicer.set("", status)
    http = None
    if name == "gateway":
        port = int(os.environ["LOOPLINE_HTTP_PORT"])
        http = await asyncio.start_server(healthz, "127.0.0.1", port)
    orchestrator_addr = os.environ.get("LOOPLINE_ORCHESTRATOR_ADDR")
    line = {"message": "serving", "level": "info", "orchestrator_addr": orchestrator_addr}
    print(json.dumps(line), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    die = os.environ.get("FAKE_DIE_FILE") if behaviour == "die" else None
    while not stop.is_set():
        if die and os.path.exists(die):
            print("dying on purpose", flush=True)
            os._exit(4)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    if http:
        http.close()
    await server.stop(0.5)
    print("stopped gracefully", flush=True)


def main(name):
    args = sys.argv[1:]
    behaviour = os.environ.get("FAKE_" + name.upper(), "ok")
    if args == ["migrate"]:
        print(name, "migrated")
    elif args == ["seed-dev"]:
        print("some log line")
        print(json.dumps({"organization_id": os.environ.get("LOOPLINE_DEV_ORG_ID", "org-fake"),
                          "api_key": os.environ.get("LOOPLINE_DEV_API_KEY", "key-fake"),
                          "user_id": "user-fake"}))
    elif args[:2] == ["admin", "seed-dev"]:
        print("credits for", args[3])
    elif args:
        sys.exit("unknown command " + " ".join(args))
    elif behaviour == "crash":
        print(json.dumps({"level": "error", "logger": "fake",
                          "message": "boom: cannot open the database",
                          "traceback": "Traceback (most recent call last):\\nRuntimeError: boom"}),
              flush=True)
        sys.exit(3)
    else:
        asyncio.run(serve(name, behaviour))
'''


def _free_ports(count: int) -> list[int]:
    """Free ports below Linux's ephemeral range, which servers binding port 0 cannot take."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20_000, 32_000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture
def fake_env(tmp_path: pathlib.Path) -> dict[str, str]:
    package = tmp_path / "fakeloop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_fake.py").write_text(textwrap.dedent(FAKE))
    for name in SERVICES:
        (package / name).mkdir()
        (package / name / "__init__.py").write_text("")
        (package / name / "__main__.py").write_text(
            f"from fakeloop._fake import main\nmain({name!r})\n"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOPLINE_", "FAKE_"))}
    http, gateway, orchestrator, billing, tools, *metrics = _free_ports(8)
    env.update(
        LOOPLINE_ORCHESTRATOR_METRICS_PORT=str(metrics[0]),
        LOOPLINE_BILLING_METRICS_PORT=str(metrics[1]),
        LOOPLINE_TOOLS_METRICS_PORT=str(metrics[2]),
        PYTHONPATH=str(tmp_path),
        LOOPLINE_DATA_DIR=str(tmp_path / "var"),
        LOOPLINE_HTTP_PORT=str(http),
        LOOPLINE_GATEWAY_GRPC_PORT=str(gateway),
        LOOPLINE_ORCHESTRATOR_PORT=str(orchestrator),
        LOOPLINE_BILLING_PORT=str(billing),
        LOOPLINE_TOOLS_PORT=str(tools),
    )
    return env


def _dev_argv(tmp_path: pathlib.Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(DEV),
        "--module",
        "fakeloop.{name}",
        "--log-dir",
        str(tmp_path / "logs"),
        *extra,
    ]


def _run_dev(
    tmp_path: pathlib.Path, env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _dev_argv(tmp_path, *extra),
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )


def _wait_for_banner(proc: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Press Ctrl-C" in line:
            break
    return lines


def test_dev_runner_starts_everything_and_prints_the_curl_pair(
    tmp_path: pathlib.Path, fake_env: dict[str, str]
) -> None:
    fake_env.update(LOOPLINE_DEV_API_KEY="mx_dev_fixed", LOOPLINE_DEV_ORG_ID="org-fixed")
    result = _run_dev(tmp_path, fake_env, "--exit-when-ready")
    assert result.returncode == 0, result.stdout + result.stderr
    url = f"http://127.0.0.1:{fake_env['LOOPLINE_HTTP_PORT']}"
    out = result.stdout
    assert url in out and "org-fixed" in out and "mx_dev_fixed" in out
    assert f"curl -sS -X POST {url}/assistant/chat" in out
    assert (
        '-H "Authorization: Bearer mx_dev_fixed"' in out
        and '-H "X-Organization-ID: org-fixed"' in out
    )
    assert '-H "Content-Type: application/json"' in out
    assert """-d '{"message":"What integrations are available?"}'""" in out
    assert f"curl -N {url}/assistant/chat/CHAT_ID/listen/RUN_ID" in out
    logs = tmp_path / "logs"
    for name in SERVICES:
        text = (logs / f"{name}.log").read_text()
        assert f"{name} migrated" in text, text
        assert "stopped gracefully" in text, text
    assert "credits for org-fixed" in (logs / "billing.log").read_text()
    # the gateway reaches the orchestrator on the port the runner was given
    assert (
        f"127.0.0.1:{fake_env['LOOPLINE_ORCHESTRATOR_PORT']}" in (logs / "gateway.log").read_text()
    )


def test_dev_runner_names_the_service_that_cannot_start(
    tmp_path: pathlib.Path, fake_env: dict[str, str]
) -> None:
    fake_env["FAKE_BILLING"] = "crash"
    result = _run_dev(tmp_path, fake_env, "--exit-when-ready")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "billing exited unexpectedly (exit code 3)" in result.stderr
    assert "boom: cannot open the database" in result.stderr
    assert "RuntimeError: boom" in result.stderr
    assert "Loopline is running" not in result.stdout
    for name in (
        "orchestrator",
        "tools",
    ):  # stopped, gracefully or not (they may still be starting)
        assert f"[dev] {name} stopped (" in result.stdout
        port = int(fake_env[f"LOOPLINE_{name.upper()}_PORT"])
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"{name} still listens on {port}"


def test_dev_runner_times_out_naming_the_unhealthy_service(
    tmp_path: pathlib.Path, fake_env: dict[str, str]
) -> None:
    fake_env["FAKE_TOOLS"] = "unhealthy"
    result = _run_dev(tmp_path, fake_env, "--exit-when-ready", "--timeout", "5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not healthy within 5 s: " in result.stderr
    assert re.search(
        r"tools \(gRPC health on 127\.0\.0\.1:\d+ reports NOT_SERVING\)", result.stderr
    ), result.stderr
    assert "last lines of" in result.stderr and "tools.log" in result.stderr


@pytest.mark.parametrize("variable", ["LOOPLINE_HTTP_PORT", "LOOPLINE_ORCHESTRATOR_METRICS_PORT"])
def test_dev_runner_refuses_a_busy_port(
    tmp_path: pathlib.Path, fake_env: dict[str, str], variable: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fake_env[variable] = str(busy.getsockname()[1])
        result = _run_dev(tmp_path, fake_env, "--exit-when-ready")
    assert result.returncode == 2
    assert variable in result.stderr and "already in use" in result.stderr


def test_dev_runner_reports_a_failed_migration(
    tmp_path: pathlib.Path, fake_env: dict[str, str]
) -> None:
    result = _run_dev(
        tmp_path, fake_env, "--exit-when-ready", "--module", "fakeloop.missing_{name}"
    )
    assert result.returncode == 1
    assert "migrate` failed (exit code 1)" in result.stderr
    assert "No module named fakeloop.missing_" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_dev_runner_stops_every_child_on_a_signal(
    tmp_path: pathlib.Path, fake_env: dict[str, str], sig: int
) -> None:
    proc = subprocess.Popen(
        _dev_argv(tmp_path),
        env=fake_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = _wait_for_banner(proc)
        assert any("Loopline is running" in line for line in lines), "".join(lines)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "stopping" in out
    for name in SERVICES:
        assert "stopped gracefully" in (tmp_path / "logs" / f"{name}.log").read_text()
        port = int(
            fake_env[
                {"gateway": "LOOPLINE_GATEWAY_GRPC_PORT"}.get(name, f"LOOPLINE_{name.upper()}_PORT")
            ]
        )
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"{name} still listens on {port}"


def test_dev_runner_stops_the_rest_when_a_service_dies(
    tmp_path: pathlib.Path, fake_env: dict[str, str]
) -> None:
    die = tmp_path / "die-now"
    fake_env.update(FAKE_ORCHESTRATOR="die", FAKE_DIE_FILE=str(die))
    proc = subprocess.Popen(
        _dev_argv(tmp_path),
        env=fake_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = _wait_for_banner(proc)
        assert any("Loopline is running" in line for line in lines), "".join(lines)
        die.touch()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "orchestrator exited unexpectedly (exit code 4)" in err
    assert "dying on purpose" in err  # the tail of its log
    for name in ("gateway", "billing", "tools"):
        assert "stopped gracefully" in (tmp_path / "logs" / f"{name}.log").read_text()
