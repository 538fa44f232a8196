"""Every line a service writes to its standard error is one JSON object.

The four services run as processes (`python -m services.<name>`, SQLite, log level INFO,
migrating at start) and serve a turn with a tool call, a document upload and a few failing
requests: an unknown path, a wrong key, a malformed body, a method not allowed, a NUL in the
path, an unknown chat, a request id that is not valid, and bytes that are not HTTP at all
(uvicorn's own warning). Then they are stopped with SIGTERM. Each standard error must hold JSON
objects only, one per line; the gateway's access lines have their fields, and the request ids
of the turn and of the upload are on the lines the orchestrator, billing and the tools service
logged for them.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys
import uuid
from typing import Any

import httpx
import orjson

from services.common import db
from services.gateway import identity
from tests.conftest import script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("billing", "tools", "orchestrator", "gateway")
ACCESS_FIELDS = {"method", "route", "status", "duration_ms", "request_id"}
Service = tuple[subprocess.Popen, pathlib.Path]  # a process and the file of its stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(data: pathlib.Path) -> dict[str, str]:
    ports = {name: _free_port() for name in ("http", "gateway_grpc", *SERVICES[:3])}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(
        LOOPLINE_DATA_DIR=str(data),
        LOOPLINE_LOG_LEVEL="INFO",
        LOOPLINE_SHUTDOWN_GRACE_S="1",
        LOOPLINE_HTTP_PORT=str(ports["http"]),
        LOOPLINE_GATEWAY_GRPC_PORT=str(ports["gateway_grpc"]),
        PYTHONUNBUFFERED="1",
    )
    for name in SERVICES[:3]:
        env[f"LOOPLINE_{name.upper()}_PORT"] = str(ports[name])
        env[f"LOOPLINE_{name.upper()}_ADDR"] = f"127.0.0.1:{ports[name]}"
        env[f"LOOPLINE_{name.upper()}_METRICS_PORT"] = "0"
    return env


def _spawn(env: dict[str, str], folder: pathlib.Path) -> dict[str, Service]:
    """Start the four services; each one's standard error goes to `folder/<name>.stderr`."""
    processes = {}
    for name in SERVICES:
        stderr = folder / f"{name}.stderr"
        with stderr.open("wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        processes[name] = (process, stderr)
    return processes


async def _wait_port(port: int, process: subprocess.Popen, stderr: pathlib.Path) -> None:
    for _ in range(600):
        if process.poll() is not None:
            raise AssertionError((await asyncio.to_thread(stderr.read_text))[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"port {port} not open")


async def _requests(base_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """A turn with a tool call, a document upload and the failing requests; returns the request
    ids of the turn and of the upload."""
    turn_id, upload_id = f"turn-{uuid.uuid4().hex[:8]}", f"upload-{uuid.uuid4().hex[:8]}"
    tool = {"integration": "loopline", "action": "echo", "parameters": {"a": 1}}
    message = script({"tool": "execute_integration_tool", "input": tool}, {"say": "done"})
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:
        started = await client.post(
            "/assistant/chat", json={"message": message}, headers={"X-Request-ID": turn_id}
        )
        assert started.status_code == 200, started.text
        async with client.stream("GET", started.json()["stream_url"]) as stream:
            assert b'"type":"done"' in await stream.aread()
        base = (await client.post("/knowledge-bases", json={"name": "Docs"})).json()
        uploaded = await client.post(
            f"/knowledge-bases/{base['id']}/documents",
            files={"file": ("notes.txt", b"the theremin", "text/plain")},
            headers={"X-Request-ID": upload_id},
        )
        assert uploaded.status_code == 201, uploaded.text
        failing = [
            await client.get("/no/such/path"),
            await client.get("/assistant/chats", headers={"Authorization": "Bearer wrong"}),
            await client.post("/assistant/chat", content=b"{not json"),
            await client.delete("/assistant/chats"),
            await client.get("/assistant/chat/a%00b"),
            await client.get(f"/assistant/chat/{uuid.uuid4()}"),
            await client.get("/assistant/chats", headers={"X-Request-ID": "not valid!"}),
        ]
        assert [r.status_code for r in failing] == [404, 401, 400, 405, 400, 404, 200]
    port = int(base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x16\x03\x01 not http\r\n\r\n")  # e.g. TLS spoken to the plain port
    await reader.read()  # uvicorn answers 400 and closes
    writer.close()
    return turn_id, upload_id


def _lines(stderr: pathlib.Path) -> list[dict[str, Any]]:
    """Every line of `stderr`, parsed; fails on a line that is not one JSON object."""
    parsed = []
    for number, line in enumerate(stderr.read_bytes().splitlines(), 1):
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"{stderr.name}:{number} is not JSON: {line[:300]!r}") from None
        assert isinstance(value, dict), f"{stderr.name}:{number}: {line[:300]!r}"
        parsed.append(value)
    return parsed


async def test_every_stderr_line_of_every_service_is_one_json_object(tmp_path):
    env = _environment(tmp_path / "var")
    processes = _spawn(env, tmp_path)
    try:
        ports = [
            env[f"LOOPLINE_{name}_PORT"] for name in ("BILLING", "TOOLS", "ORCHESTRATOR", "HTTP")
        ]
        await asyncio.gather(
            *(
                _wait_port(int(port), *processes[name])
                for port, name in zip(ports, SERVICES, strict=True)
            )
        )
        engine = db.make_engine(f"sqlite+aiosqlite:///{tmp_path / 'var' / 'gateway.db'}")
        try:
            owner = await identity.create_member(db.sessionmaker(engine), "org_logs", "owner")
        finally:
            await engine.dispose()
        turn_id, upload_id = await _requests(
            f"http://127.0.0.1:{env['LOOPLINE_HTTP_PORT']}",
            {"Authorization": f"Bearer {owner['api_key']}", "X-Organization-ID": "org_logs"},
        )
    finally:
        for process, _ in processes.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    lines = {name: _lines(stderr) for name, (_, stderr) in processes.items()}
    for name, parsed in lines.items():
        assert parsed and all(line["service"] == name for line in parsed), name
        assert any(line["message"] == "stopped" for line in parsed), name
    access = [line for line in lines["gateway"] if line["logger"] == "loopline.access"]
    assert len(access) == 11 and all(ACCESS_FIELDS <= set(line) for line in access), access
    assert all(line["org_id"] == "org_logs" for line in access[:4])
    assert any(line["logger"].startswith("uvicorn") for line in lines["gateway"])
    # the gateway's lines, the orchestrator's, and billing's (called by the orchestrator)
    for name in ("gateway", "orchestrator", "billing"):
        assert any(line.get("request_id") == turn_id for line in lines[name]), lines[name]
    assert any(line.get("request_id") == upload_id for line in lines["tools"]), lines["tools"]
