"""Integration workers (services/tools/workers): the pool keeps a crash, a hang or a leak to one
call, and the worker holds every outbound connection to the outbound policy at the socket,
whatever library an action uses. Run with the real integrations interpreter."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import pathlib
import socket
import socketserver
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from unittest.mock import ANY
from urllib.parse import urlsplit

import pytest
from prometheus_client import REGISTRY

from services.tools import netpolicy
from services.tools.workers import pool as pool_module
from services.tools.workers import worker_main
from services.tools.workers.pool import (
    ActionFailed,
    ActionTimeout,
    WorkerCrashed,
    WorkerPool,
    WorkerUnavailable,
)
from tests.tools.fake_apis import github_app, make_test_ca
from tests.tools.tools_stack import serve_asgi

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-integrations" / "bin" / "python"
ACTIONS_DIR = pathlib.Path(__file__).resolve().parent / "worker_actions"
ACTIONS = "loopline_test_actions"
PUBLIC = "93.184.216.34"  # a global address: never connected to (the tests check the pick)
CLIENTS = ["httpx", "requests", "urllib", "asyncio", "socket"]

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason=f"the integrations interpreter {PYTHON} is missing (`make venv`)"
)


@pytest.fixture
async def make_pool() -> AsyncIterator[Callable[..., WorkerPool]]:
    """Build WorkerPools on the integrations interpreter with the test actions on their path;
    each is closed after the test."""
    pools: list[WorkerPool] = []

    def make(**kwargs: Any) -> WorkerPool:
        kwargs.setdefault("path", [str(ACTIONS_DIR)])
        kwargs.setdefault("memory_mb", 512)
        pool = WorkerPool(str(PYTHON), **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()


async def gone(pid: int) -> bool:
    """Whether process `pid` has ended and been reaped (waits a bounded while for the reaper)."""
    for _ in range(400):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.025)
    return False


class CountingServer:
    """A TCP server on 127.0.0.1 (port 0) answering any request `HTTP/1.0 200` with "ok", that
    counts the connections it accepted: a refused connection never reaches it."""

    def __init__(self) -> None:
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with owner.lock:
                    owner.accepted += 1
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")

        self.accepted = 0
        self.lock = threading.Lock()
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def loopback_server() -> Iterator[CountingServer]:
    server = CountingServer()
    yield server
    server.close()


# ----- calls, failures, crashes ------------------------------------------------------------


async def test_a_result_comes_back_from_each_kind_of_callable(make_pool) -> None:
    pool = make_pool()
    result = await pool.call(ACTIONS, "echo", {"text": "hi"}, timeout_s=30)
    assert result.value["echo"] == {"text": "hi"}
    assert result.value["when"] == "2024-01-02"  # what JSON cannot hold arrives as text
    assert result.value["pid"] != os.getpid() and result.refused == () and result.rss_mb > 0
    assert (await pool.call(ACTIONS, "async_echo", {"text": "a"}, 30)).value["text"] == "a"
    assert (await pool.call("loopline_test_tools", "add", {"a": 2, "b": 3}, 30)).value == {"sum": 5}
    assert pool.workers == 1  # one call at a time: the worker is reused


@pytest.mark.parametrize(
    ("module", "function", "arguments", "kind"),
    [
        ("no_such_module_here", "f", {}, "import"),
        (ACTIONS, "no_such_function", {}, "import"),
        (ACTIONS, "async_echo", {"wrong": 1}, "invalid_arguments"),
        ("loopline_test_tools", "add", {"a": "not a number", "b": 1}, "invalid_arguments"),
        (ACTIONS, "http_404", {}, "http_status"),
    ],
)
async def test_a_failure_is_answered_as_its_kind(make_pool, module, function, arguments, kind):
    pool = make_pool()
    with pytest.raises(ActionFailed) as failed:
        await pool.call(module, function, arguments, timeout_s=30)
    assert failed.value.kind == kind
    assert failed.value.status == (404 if kind == "http_status" else None)
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value  # the worker still serves


async def test_an_exception_becomes_its_kind_without_its_message(make_pool, caplog) -> None:
    secret = "sk-live-0123456789abcdef"
    pool = make_pool()
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "fail_with_secret", {"secret": secret}, timeout_s=30)
    assert (failed.value.kind, failed.value.type_name) == ("error", "ValueError")
    assert secret not in str(failed.value) and secret not in repr(failed.value.args)
    assert secret not in caplog.text
    # nor in the worker's raw answer
    request = {"id": 7, "module": ACTIONS, "function": "fail_with_secret"}
    request["arguments"] = {"secret": secret}
    worker = await asyncio.create_subprocess_exec(
        str(PYTHON),
        "-I",
        str(pool_module.WORKER_MAIN),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=pool.environment(),
    )
    raw, _ = await worker.communicate(json.dumps(request).encode() + b"\n")
    assert b'"kind": "error"' in raw and secret.encode() not in raw


async def exit_logged(caplog: pytest.LogCaptureFixture, pid: int) -> dict[str, Any]:
    """The fields of the "integration worker exited" record of `pid` (waits a bounded while)."""
    for _ in range(400):
        for record in caplog.records:
            fields = getattr(record, "fields", {})
            if record.getMessage() == "integration worker exited" and fields.get("pid") == pid:
                return dict(fields)
        await asyncio.sleep(0.025)
    raise AssertionError(f"no exit logged for worker {pid}")


@pytest.mark.parametrize(
    ("action", "returncode", "exit_fields"),
    [
        ("exit_now", 3, {"exit_code": 3}),
        ("segfault", -11, {"signal": "SIGSEGV"}),
        ("sigkill", -9, {"signal": "SIGKILL"}),
    ],
)
async def test_a_crash_fails_its_call_only(
    make_pool, caplog, action, returncode, exit_fields
) -> None:
    caplog.set_level("INFO", logger="services.tools.workers.pool")
    pool = make_pool(max_workers=1)
    first = (await pool.call(ACTIONS, "pid", {}, 30)).value
    arguments = {"code": 3} if action == "exit_now" else {}
    with pytest.raises(WorkerCrashed) as crashed:
        await pool.call(ACTIONS, action, arguments, timeout_s=30)
    assert crashed.value.returncode == returncode
    assert await gone(first)
    logged = await exit_logged(caplog, first)
    assert logged == {"pid": first, "reason": "crashed", "calls": 2, **exit_fields}
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value != first  # a fresh worker


@pytest.mark.parametrize("action", ["hang", "hang_blocking"])
async def test_a_hang_is_killed_by_the_timeout(make_pool, tmp_path, action) -> None:
    pool = make_pool(max_workers=1)
    hung = (await pool.call(ACTIONS, "pid", {}, 30)).value  # started: the timeout is the call's
    with pytest.raises(ActionTimeout):
        await pool.call(ACTIONS, action, {"marker": str(tmp_path / "pid")}, timeout_s=1.5)
    assert await gone(hung)
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value != hung


async def test_a_cancelled_call_kills_its_worker(make_pool, tmp_path) -> None:
    pool = make_pool(max_workers=1)
    marker = tmp_path / "pid"
    call = asyncio.create_task(pool.call(ACTIONS, "hang", {"marker": str(marker)}, 60))
    for _ in range(400):
        if marker.exists() and marker.read_text():
            break
        await asyncio.sleep(0.025)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await gone(int(marker.read_text()))
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value != int(marker.read_text())


async def test_a_leak_ends_its_call_and_its_worker(make_pool) -> None:
    pool = make_pool(memory_mb=300, max_workers=1)
    first = (await pool.call(ACTIONS, "pid", {}, 30)).value
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "leak", {"chunk_mb": 16}, timeout_s=60)
    assert failed.value.kind == "memory"
    assert await gone(first)
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value != first


async def test_calls_beyond_max_workers_wait_for_a_free_one(make_pool, tmp_path) -> None:
    pool = make_pool(max_workers=2)
    rendezvous = {"directory": str(tmp_path), "count": 2}
    results = await asyncio.gather(
        *(pool.call(ACTIONS, "rendezvous", rendezvous, 60) for _ in range(2)),
        *(pool.call(ACTIONS, "pid", {}, 60) for _ in range(4)),
    )
    assert len({result.value for result in results}) == 2
    assert pool.workers == 2


async def test_an_idle_worker_exits(make_pool) -> None:
    running = REGISTRY.get_sample_value("loopline_integration_workers") or 0.0
    idled = exits("idle")
    pool = make_pool(idle_s=0.2)
    worker = (await pool.call(ACTIONS, "pid", {}, 30)).value
    assert REGISTRY.get_sample_value("loopline_integration_workers") == running + 1
    assert await gone(worker)
    assert pool.workers == 0
    for _ in range(100):  # the exit is counted once the worker is reaped
        if exits("idle") == idled + 1:
            break
        await asyncio.sleep(0.02)
    assert exits("idle") == idled + 1
    assert REGISTRY.get_sample_value("loopline_integration_workers") == running
    assert (await pool.call(ACTIONS, "pid", {}, 30)).value != worker


def exits(reason: str) -> float:
    """loopline_integration_worker_exits_total{reason} so far."""
    sample = "loopline_integration_worker_exits_total"
    return REGISTRY.get_sample_value(sample, {"reason": reason}) or 0.0


@pytest.mark.parametrize(
    ("settings", "fresh_each_time"),
    [({"max_calls": 2}, [False, True]), ({"recycle_rss_mb": 1}, [True, True])],
)
async def test_a_worker_is_replaced_after_its_calls_or_past_its_memory_mark(
    make_pool, settings, fresh_each_time
) -> None:
    pool = make_pool(**settings)
    pids = [(await pool.call(ACTIONS, "pid", {}, 30)).value for _ in range(3)]
    assert [a != b for a, b in zip(pids, pids[1:], strict=False)] == fresh_each_time


async def test_an_answer_past_the_limit_fails_its_call(make_pool) -> None:
    pool = make_pool(max_answer_bytes=4096)
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "echo", {"text": "x" * 10_000}, timeout_s=30)
    assert failed.value.kind == "too_large"
    assert (await pool.call(ACTIONS, "echo", {"text": "x"}, 30)).value["echo"] == {"text": "x"}


async def test_a_missing_interpreter_makes_workers_unavailable(tmp_path) -> None:
    pool = WorkerPool(str(tmp_path / "python"))
    with pytest.raises(WorkerUnavailable):
        await pool.call(ACTIONS, "pid", {}, timeout_s=10)
    await pool.close()


async def test_no_worker_starts_before_a_call_and_none_is_left_after_close(make_pool) -> None:
    pool = make_pool()
    assert pool.workers == 0
    worker = (await pool.call(ACTIONS, "pid", {}, 30)).value
    await pool.close()
    assert await gone(worker)
    with pytest.raises(WorkerUnavailable):
        await pool.call(ACTIONS, "pid", {}, 30)


async def test_the_environment_does_not_carry_the_services_own(make_pool, monkeypatch) -> None:
    monkeypatch.setenv("LOOPLINE_TOOLS_CREDENTIAL_KEY", "credential-key-secret")
    monkeypatch.setenv("LOOPLINE_TOOLS_DATABASE_URL", "postgresql://u:database-secret@db/x")
    pool = make_pool()
    env = (await pool.call(ACTIONS, "environment", {}, 30)).value
    allowed = set(pool_module.PASSED_ENVIRONMENT) | {"HOME", "LC_CTYPE"}
    allowed |= {name for name in env if name.startswith("LOOPLINE_WORKER_")}
    assert set(env) <= allowed
    assert "credential-key-secret" not in json.dumps(env)
    assert "database-secret" not in json.dumps(env)
    assert env["HOME"] != os.environ.get("HOME")


def test_malformed_hosts_are_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        WorkerPool(str(PYTHON), hosts={"api.github.com": "not an address"})
    assert worker_main.parse_hosts('{"A.example.": ["10.0.0.1:8443", "[::1]:9", "10.0.0.2"]}') == {
        "a.example": [("10.0.0.1", 8443), ("::1", 9), ("10.0.0.2", None)]
    }


# ----- the outbound policy -----------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "224.0.0.1", "240.0.0.1", "8.8.8.8", "93.184.216.34", "::1", "::",
        "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:8.8.8.8",
        "2002:7f00:1::", "2002:808:808::", "2001:0:4136:e378:8000:63bf:80ff:fffe",
        "2606:4700:4700::1111", "64:ff9b::a00:1",
    ],
)  # fmt: skip
def test_the_worker_classifies_addresses_as_the_tools_service_does(address) -> None:
    ip = ipaddress.ip_address(address)
    assert worker_main.classify(ip) == netpolicy.classify(ip)


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_loopback_destination_is_refused(make_pool, loopback_server, client) -> None:
    pool = make_pool()
    url = f"http://127.0.0.1:{loopback_server.port}/"
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "connect", {"client": client, "url": url}, timeout_s=30)
    assert (failed.value.kind, failed.value.refused) == ("refused", ("loopback",))
    assert loopback_server.accepted == 0


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_private_destination_is_refused_at_once(make_pool, client) -> None:
    pool = make_pool()
    # nothing listens at 10.255.255.1: without the policy the connect would hang to a timeout
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "connect", {"client": client, "url": "http://10.255.255.1:9/"}, 60)
    assert (failed.value.kind, failed.value.refused) == ("refused", ("private",))


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_rebinding_name_is_refused_at_the_connection(
    make_pool, loopback_server, client
) -> None:
    port = loopback_server.port
    hosts = {"rebind.example": [f"{PUBLIC}:{port}", f"127.0.0.1:{port}"]}
    pool = make_pool(hosts=hosts)
    arguments = {"client": client, "host": "rebind.example", "port": port}
    result = await pool.call(ACTIONS, "rebinding", arguments, timeout_s=30)
    assert result.value == {
        "checked": PUBLIC,
        "error": "ConnectError" if client == "httpx" else ANY,
    }
    assert result.refused == ("loopback",)
    assert loopback_server.accepted == 0


@pytest.mark.parametrize("client", CLIENTS)
async def test_allow_private_reaches_the_loopback_server(
    make_pool, loopback_server, client
) -> None:
    pool = make_pool(allow_private=True)
    url = f"http://127.0.0.1:{loopback_server.port}/"
    result = await pool.call(ACTIONS, "connect", {"client": client, "url": url}, timeout_s=30)
    assert result.value == {"status": 200, "body": "ok"} and result.refused == ()
    assert loopback_server.accepted == 1


async def test_a_refusal_the_action_catches_is_still_reported(make_pool, loopback_server):
    pool = make_pool()
    url = f"http://127.0.0.1:{loopback_server.port}/"
    result = await pool.call(ACTIONS, "connect_caught", {"client": "httpx", "url": url}, 30)
    assert result.value["success"] is False and result.refused == ("loopback",)
    assert loopback_server.accepted == 0


async def test_a_unix_socket_and_an_unresolved_name_are_refused(make_pool) -> None:
    pool = make_pool(allow_private=False)
    with tempfile.TemporaryDirectory(prefix="ll") as directory:
        path = os.path.join(directory, "s")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path)
            listener.listen()
            with pytest.raises(ActionFailed) as failed:
                await pool.call(ACTIONS, "connect_unix", {"path": path}, timeout_s=30)
    assert (failed.value.kind, failed.value.refused) == ("refused", ("unix",))
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "connect_by_name", {"host": "localhost", "port": 9}, 30)
    assert (failed.value.kind, failed.value.refused) == ("refused", ("host name",))


@pytest.mark.parametrize("how", ["subprocess", "system", "posix_spawn", "fork", "multiprocessing"])
async def test_process_creation_is_refused(make_pool, tmp_path, how) -> None:
    pool = make_pool()
    marker = tmp_path / "created"
    with pytest.raises(ActionFailed) as failed:
        await pool.call(ACTIONS, "spawn", {"how": how, "marker": str(marker)}, timeout_s=30)
    assert (failed.value.kind, failed.value.refused) == ("refused", ("process",))
    assert not marker.exists()


# ----- a real catalogue action -------------------------------------------------------------


async def test_a_catalogue_action_reaches_a_local_https_fake(make_pool, tmp_path, monkeypatch):
    seen: list[dict[str, Any]] = []
    ca, cert, key = make_test_ca(tmp_path, ["api.github.com"])
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    async with serve_asgi(github_app(seen, "t"), tls=(cert, key)) as base:
        hosts = {"api.github.com": urlsplit(base).netloc}
        pool = make_pool(allow_private=True, hosts=hosts)
        arguments = {
            "auth_type": "bearer_token",
            "auth_data": {"token": "t"},
            "owner": "o",
            "repo": "r",
        }
        module = "modulex_integrations.tools.github"
        result = await pool.call(module, "get_repository", arguments, timeout_s=60)
        assert result.value["success"] is True
        assert result.value["repository"]["full_name"] == "o/r"
        with pytest.raises(ActionFailed) as failed:
            await pool.call(module, "get_repository", {**arguments, "repo": "missing"}, 60)
        assert (failed.value.kind, failed.value.status) == ("http_status", 404)
    assert [s["authorization"] for s in seen] == ["Bearer t", "Bearer t"]


def test_a_host_the_model_named_is_refused_unless_the_integration_names_it():
    policy = worker_main.Policy(allow_private=True)
    assert policy.judge_name("api.attacker.test") is None  # no rule without named hosts
    policy.named = frozenset({"attacker.test", "203.0.113.9", "datadoghq.eu"})
    policy.own = ("datadoghq.eu", "api.github.com")
    assert policy.judge_name("api.attacker.test") == "model-chosen host"
    assert policy.judge_name("ATTACKER.test.") == "model-chosen host"
    assert policy.judge_name("203.0.113.9") == "model-chosen host"
    assert policy.judge_name("api.datadoghq.eu") is None  # the integration's own
    assert policy.judge_name("api.github.com") is None
    assert policy.judge_name("example.org") is None  # not named by the model
    # what the connection is made to is read as the named hosts are: canonical forms
    policy.named = frozenset({"127.0.0.1", "xn--vil-qdd.test"})
    assert policy.judge_name("2130706433") == "model-chosen host"
    assert policy.judge_name("::ffff:127.0.0.1") == "model-chosen host"
    assert policy.judge_name("\u0435vil.test") == "model-chosen host"
    assert policy.judge_name("api.xn--vil-qdd.test") == "model-chosen host"
