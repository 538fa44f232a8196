"""Operator stdio MCP servers that fail: the operator's log says why (the end of the server's
stderr), the model's error does not (stderr may hold anything), and stderr kept in memory stays
bounded however much a server writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import textwrap
import time

import pytest

from services.common.logging import JsonFormatter
from services.tools.catalogue import ActionError
from services.tools.mcp_client import McpConnector
from services.tools.mcp_stdio import STDERR_LOG_CHARS, StderrTail, StdioServer
from tests.log_records import fields_of

MARKER = "ModuleNotFoundError: No module named 'loopline_marker_server'"
TOKEN = "tok-operator-secret-42"

# Writes 20 KB of noise, then the marker (and the configured token, which must be redacted), then
# exits 1.
FAILING = (
    "import os, sys; sys.stderr.write('noise line\\n' * 2000); "
    f"print('token=' + os.environ['API_TOKEN'], file=sys.stderr); print({MARKER!r}, "
    "file=sys.stderr); sys.exit(1)"
)
HANGING = f"import sys, time; print({MARKER!r}, file=sys.stderr, flush=True); time.sleep(60)"


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "stdio MCP server failed"]


async def test_a_stdio_server_that_exits_logs_the_end_of_its_stderr_once(caplog):
    connector = McpConnector(10.0, 65536, False)
    server = StdioServer("broken", sys.executable, ("-c", FAILING), {"API_TOKEN": TOKEN})
    caplog.set_level(logging.WARNING, logger="services.tools")

    with pytest.raises(ActionError) as caught:
        await connector.list_tools(server)

    assert MARKER not in str(caught.value) and "noise" not in str(caught.value)
    records = _failures(caplog)
    assert len(records) == 1
    fields = fields_of(records[0])
    assert records[0].levelno == logging.WARNING
    assert fields["server"] == "broken" and fields["operation"] == "list_tools"
    assert fields["stderr_tail"].endswith(MARKER)
    assert len(fields["stderr_tail"]) <= STDERR_LOG_CHARS
    assert TOKEN not in json.dumps(fields) and "token=***" in fields["stderr_tail"]


async def test_a_stdio_server_that_cannot_start_says_why_in_the_log_not_to_the_model(
    start_tools, caplog
):
    servers = json.dumps(
        [
            {
                "name": "time",
                "command": sys.executable,
                "args": ["-c", FAILING],
                "env": {"API_TOKEN": TOKEN},
            }
        ]
    )
    caplog.set_level(logging.WARNING, logger="services.tools")
    tools = await start_tools(tools_mcp_stdio_servers=servers)

    error = await tools.failed(
        "execute_integration_tool", {"integration": "time", "action": "get_current_time"}
    )

    assert "The MCP server 'time' is unavailable" in error and "(MCPError)" in error
    assert MARKER not in error and "noise" not in error and TOKEN not in error
    records = _failures(caplog)  # the background discovery at start, and the call's own
    assert records and all(fields_of(r)["server"] == "time" for r in records)
    assert all(fields_of(r)["stderr_tail"].endswith(MARKER) for r in records)
    assert all(TOKEN not in json.dumps(fields_of(r)) for r in records)


async def test_a_missing_command_logs_the_os_error(caplog):
    caplog.set_level(logging.WARNING, logger="services.tools")
    with pytest.raises(ActionError) as caught:
        await McpConnector(5.0, 65536, False).list_tools(
            StdioServer("ghost", "/nonexistent/loopline-mcp-server")
        )
    assert "/nonexistent" not in str(caught.value)
    (record,) = _failures(caplog)
    assert (
        "FileNotFoundError" in fields_of(record)["error"]
        and "/nonexistent/loopline-mcp-server" in fields_of(record)["error"]
    )


async def test_a_command_that_cannot_be_run_is_named_in_the_log_but_never_its_args_or_env(
    tmp_path, caplog
):
    """The failure record of a stdio server whose command does not exist or is not
    executable names it in a `command` field, the configured executable as written, since the
    error text can lose it (an `env` value such as VIRTUAL_ENV redacted from the path leaves
    "***/bin/python"; a long path is cut). Its args and env values never appear."""
    not_executable = tmp_path / "server.sh"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(0o644)
    venv = str(tmp_path / "missing-venv")
    commands = [
        f"{venv}/bin/python",
        str(not_executable),
        "loopline-no-such-mcp-server",
        f"/opt/{'d' * 400}/server",
    ]
    caplog.set_level(logging.WARNING, logger="services.tools")
    for command in commands:
        server = StdioServer(
            "ghost",
            command,
            ("--api-key", "arg-secret-7731"),
            {"VIRTUAL_ENV": venv, "API_TOKEN": TOKEN},
        )
        with pytest.raises(ActionError) as caught:
            await McpConnector(5.0, 65536, False).list_tools(server)
        assert command not in str(caught.value)  # the model's error never names it
    records = _failures(caplog)
    assert [fields_of(r)["command"] for r in records] == commands
    for record in records:
        line = JsonFormatter("tools").format(record)
        assert "arg-secret-7731" not in line and TOKEN not in line


async def test_a_stdio_server_that_times_out_logs_its_stderr_and_a_cancelled_caller_logs_nothing(
    caplog,
):
    connector = McpConnector(1.0, 65536, False)
    server = StdioServer("hanger", sys.executable, ("-c", HANGING))
    caplog.set_level(logging.WARNING, logger="services.tools")
    with pytest.raises(TimeoutError):
        await connector.list_tools(server)
    await connector.aclose()  # the session closes in the background; the record comes after
    (record,) = _failures(caplog)
    assert "time limit" in fields_of(record)["error"] and fields_of(record)["stderr_tail"] == MARKER

    caplog.clear()
    task = asyncio.create_task(connector.list_tools(server))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await connector.aclose()
    assert _failures(caplog) == []


async def test_the_stderr_tail_keeps_only_the_newest_bytes_and_never_blocks_the_writer():
    tail = StderrTail(limit=1024)
    errlog = tail.open()
    # 4 MiB is far more than a pipe holds: the writer finishes only if the loop keeps reading.
    script = "import sys; sys.stderr.write('x' * (4 << 20)); sys.stderr.write('\\nthe end')"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stderr=errlog)
    errlog.close()
    await asyncio.wait_for(process.wait(), 20)
    tail.close()
    assert len(tail._data) == 1024
    assert tail.text(max_chars=20) == "…" + "x" * 11 + "\nthe end"


async def test_a_healthy_server_that_writes_much_to_stderr_keeps_working(tmp_path):
    script = tmp_path / "chatty_server.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from mcp.server.mcpserver import MCPServer

        server = MCPServer("chatty")

        @server.tool()
        def shout(text: str) -> str:
            \"\"\"Write 1 MiB to stderr, then answer.\"\"\"
            sys.stderr.write("log line " * (1 << 17))
            sys.stderr.flush()
            return text.upper()

        server.run("stdio")
    """)
    )
    connector = McpConnector(20.0, 65536, False)
    server = StdioServer("chatty", sys.executable, (str(script),))
    started = time.monotonic()
    for _ in range(2):
        output = await connector.call_tool(server, "shout", {"text": "hi"})
        assert output["content"][0]["text"] == "HI"
    assert time.monotonic() - started < 20
