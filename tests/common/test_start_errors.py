"""A service that cannot open its database says so in one line, never a traceback.

With LOOPLINE_DATA_DIR naming a file, `python -m services.<name> migrate`, the servers and the
admin commands answer in one line (the admin commands as JSON), not with a traceback
(FileExistsError).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import METRICS_PORTS, postgres_databases, release_databases, selected_backend


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    # any free metrics port: a service that does start must not collide with one running here
    return {**env, **METRICS_PORTS, "LOOPLINE_LOG_LEVEL": "WARNING", **extra}


@pytest.mark.parametrize("service", ["billing", "gateway", "orchestrator", "tools"])
def test_migrate_with_a_data_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path, service):
    data_dir = tmp_path / "a_file"
    data_dir.write_text("not a folder")
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "migrate"],
        env=_env(LOOPLINE_DATA_DIR=str(data_dir)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"{service}: the {service} database at {data_dir / (service + '.db')} cannot be used: "
        f"its folder {data_dir} is a file; check LOOPLINE_DATA_DIR or the database URL"
    )


@pytest.mark.parametrize("service", ["billing", "gateway", "orchestrator", "tools"])
def test_migrate_names_the_database_it_migrated_in_one_line(tmp_path, service):
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "migrate"],
        env=_env(LOOPLINE_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    database = tmp_path / f"{service}.db"
    assert result.stdout == f"{service} database migrated: sqlite+aiosqlite:///{database}\n"


def test_a_server_with_a_data_dir_that_is_a_file_says_why_and_exits_2(tmp_path):
    data_dir = tmp_path / "a_file"
    data_dir.write_text("not a folder")
    result = subprocess.run(
        [sys.executable, "-m", "services.billing"],
        env=_env(LOOPLINE_DATA_DIR=str(data_dir), LOOPLINE_BILLING_PORT="0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        f"billing: cannot start: the billing database at {data_dir / 'billing.db'} cannot be used"
        in result.stderr
    )


def test_an_orchestrator_whose_redis_does_not_answer_says_so_in_one_line_and_exits_2(tmp_path):
    # one line naming Redis, not a long traceback ending in redis.exceptions.ConnectionError
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "services.orchestrator"],
        env=_env(
            LOOPLINE_DATA_DIR=str(tmp_path),
            LOOPLINE_ORCHESTRATOR_PORT="0",
            LOOPLINE_REDIS_URL=f"redis://:hunter2-secret@127.0.0.1:{port}/0",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        result.returncode == 2
        and "Traceback" not in result.stderr
        and "hunter2-secret" not in result.stderr
    )
    assert (
        f"orchestrator: cannot start: Redis at 127.0.0.1:{port} (LOOPLINE_REDIS_URL)"
        " does not answer (ConnectionError)" in result.stderr
    )


async def test_tools_migrate_prints_its_database_without_the_password():
    """`python -m services.tools migrate` printed its database URL with the password."""
    if selected_backend() != "postgres":
        pytest.skip("a URL with a password needs the PostgreSQL backend")
    import asyncio

    urls = await postgres_databases()
    try:
        url = (
            make_url(urls["tools"]).set(password="pa55word-x").render_as_string(hide_password=False)
        )
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.tools", "migrate"],
            env=_env(LOOPLINE_TOOLS_DATABASE_URL=url),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        release_databases(list(urls.values()))
    assert result.returncode == 0, result.stderr
    assert (
        "pa55word-x" not in result.stdout + result.stderr
        and "tools database migrated" in result.stdout
    )


def test_a_sigterm_during_start_up_stops_the_service_gracefully_once_started(tmp_path):
    """SIGTERM in the first ~1.5 s after a start (imports, migrations, before the event loop's
    handler) stops the service gracefully once started, not by the default action (exit 143)."""
    import signal
    import threading
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "services.billing"],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(
            LOOPLINE_DATA_DIR=str(tmp_path), LOOPLINE_BILLING_PORT="0", LOOPLINE_LOG_LEVEL="INFO"
        ),
    )
    stderr = process.stderr
    assert stderr is not None
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in stderr),
        daemon=True,
    )
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the process catches SIGTERM (SigCgt bit 15)
            with open(f"/proc/{process.pid}/status") as status:
                caught = int(
                    next(line for line in status if line.startswith("SigCgt:")).split()[1], 16
                )
            if caught & (1 << (signal.SIGTERM - 1)):
                break
            time.sleep(0.002)
        sent_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        reader.join(timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
    text = "".join(line for _, line in lines)
    assert process.returncode == 0, text[-2000:]
    serving_at = next(at for at, line in lines if '"message":"serving"' in line)
    assert (
        sent_at < serving_at
    )  # the signal came during start-up, before serving: a clean stop all the same
    assert '"message":"stopped"' in text
