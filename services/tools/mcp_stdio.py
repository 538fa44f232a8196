"""Operator-configured stdio MCP servers: their configuration and their stderr.

LOOPLINE_TOOLS_MCP_STDIO_SERVERS is a JSON list of `{"name", "command", "args"?, "env"?,
"description"?}`; each entry is an integration called `name` that needs no credential. A
server's stderr is read as it comes and only its last STDERR_TAIL_BYTES are kept
(`StderrTail`), for the operator's log record of a failure (never for the model).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, TextIO

from services.tools.crypto import redact

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
#: The most bytes of a stdio server's stderr kept in memory per session (the newest ones).
STDERR_TAIL_BYTES = 4096
#: The most characters of that stderr quoted in a failure's log record (its end).
STDERR_LOG_CHARS = 300


@dataclass(frozen=True)
class StdioServer:
    """An operator-configured stdio MCP server: integration `name`, launched as `command args`."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""


def parse_stdio_servers(raw: str) -> list[StdioServer]:
    """The stdio servers of a LOOPLINE_TOOLS_MCP_STDIO_SERVERS value ("" -> []).

    Raises ValueError when it is not a JSON list of {name, command, args?, env?,
    description?} with names matching `[a-z][a-z0-9_]*`.
    """
    if not raw.strip():
        return []
    items = json.loads(raw)
    if not isinstance(items, list):
        raise ValueError("tools_mcp_stdio_servers must be a JSON list")
    servers = []
    for item in items:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("name"), str)
            or not isinstance(item.get("command"), str)
        ):
            raise ValueError("each stdio MCP server needs a string 'name' and 'command'")
        if not _NAME_RE.match(item["name"]):
            raise ValueError(f"stdio MCP server name {item['name']!r} must match [a-z][a-z0-9_]*")
        args = item.get("args", [])
        env = item.get("env", {})
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"stdio MCP server {item['name']}: 'args' must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"stdio MCP server {item['name']}: 'env' must map names to strings")
        servers.append(
            StdioServer(
                item["name"],
                item["command"],
                tuple(args),
                dict(env),
                str(item.get("description", "")),
            )
        )
    return servers


# Where a stdio server's stderr goes when nobody keeps it: its logs must not mix with the service's.
DEVNULL = open(os.devnull, "w")


class StderrTail:
    """The newest `limit` bytes a stdio server wrote to its stderr during one session.

    `open()` makes a pipe and returns its write end, for `stdio_client(errlog=...)`; the
    event loop reads the other end as data arrives (so a chatty server never blocks on a
    full pipe) and keeps only the last `limit` bytes, so memory stays bounded however long
    the server runs and however much it writes. `close()` reads what is left without
    waiting and closes the pipe. Where the loop cannot watch a pipe, stderr is discarded.
    """

    def __init__(self, limit: int = STDERR_TAIL_BYTES) -> None:
        self.limit = limit
        self._data = bytearray()
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self) -> TextIO:
        """The file the server's stderr is written to (the caller closes it once the server
        started)."""
        read_fd, write_fd = (
            os.pipe()
        )  # both non-inheritable; the child gets the write end as its fd 2 only
        os.set_blocking(read_fd, False)
        loop = asyncio.get_running_loop()
        try:
            loop.add_reader(read_fd, self._read)
        except (NotImplementedError, RuntimeError):  # e.g. a loop without pipe readers
            os.close(read_fd)
            os.close(write_fd)
            return open(os.devnull, "w")
        self._fd, self._loop = read_fd, loop
        return os.fdopen(write_fd, "w")

    def _read(self) -> None:
        assert self._fd is not None
        try:
            chunk = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._keep(chunk)
        elif self._loop is not None:  # end of file: every writer closed it
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _keep(self, chunk: bytes) -> None:
        self._data += chunk
        if len(self._data) > self.limit:
            del self._data[: len(self._data) - self.limit]

    def close(self) -> None:
        """Read what the pipe still holds (never waiting; a bounded number of reads), close it."""
        if self._fd is None:
            return
        for _ in range(64):  # a descendant may still be writing: do not chase it forever
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # BlockingIOError: nothing more for now
                break
            if not chunk:
                break
            self._keep(chunk)
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None
        os.close(self._fd)
        self._fd = None

    def text(self, max_chars: int = STDERR_LOG_CHARS, secret: dict[str, Any] | None = None) -> str:
        """The last `max_chars` characters kept (`secret`'s values redacted), "…" first when
        cut."""
        text = redact(self._data.decode("utf-8", errors="replace"), secret).strip()
        return text if len(text) <= max_chars else "…" + text[-(max_chars - 1) :]


class Capturing:
    """`stdio_client(params, errlog=...)` with the server's stderr kept in `tail` (a StderrTail)."""

    def __init__(self, stdio_client: Any, params: Any, tail: StderrTail) -> None:
        self._stdio_client = stdio_client
        self._params = params
        self._tail = tail
        self._inner: Any = None

    async def __aenter__(self) -> Any:
        errlog = self._tail.open()
        try:
            self._inner = self._stdio_client(self._params, errlog=errlog)
            return await self._inner.__aenter__()
        except BaseException:
            self._tail.close()
            raise
        finally:
            errlog.close()  # the server has its own copy; ours would keep the pipe from ever ending

    async def __aexit__(self, *exc: Any) -> Any:
        try:
            return await self._inner.__aexit__(*exc)
        finally:
            self._tail.close()
