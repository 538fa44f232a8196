"""One logging setup for every service: one JSON object per line on stderr.

`bind(run_id=..., chat_id=..., org_id=...)` puts ids into a context variable, so every
record logged inside that asyncio task (and tasks it starts) carries them.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import orjson

# read-only default: `bind` and `bind_for_task` always set a new dict, never update this one
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "loopline_log_context", default=MappingProxyType({})
)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, service, logger, message, bound ids,
    extras."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_context.get())
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            entry["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


# Libraries whose INFO/DEBUG lines are noise or carry what must not be logged: the HTTP clients
# log every request's URL, and an organization's URL can be a secret (an MCP server's, with its
# token: the mcp SDK calls through httpx2). Kept at WARNING whatever the service's level.
QUIET_LOGGERS = (
    "uvicorn.access",
    "aiosqlite",
    "sqlalchemy.engine",
    "httpx",
    "httpcore",
    "httpx2",
    "httpcore2",
)


def setup(service: str, level: str = "INFO") -> None:
    """Route the root logger to stderr as JSON lines for `service` at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def bind(**ids: Any) -> Iterator[None]:
    """Bind ids (run_id, chat_id, org_id, ...) to every log record inside the block."""
    token = _context.set({**_context.get(), **{k: v for k, v in ids.items() if v}})
    try:
        yield
    finally:
        _context.reset(token)


def bind_task(**ids: Any) -> None:
    """Bind ids for the rest of the current task (use at the top of a task's coroutine)."""
    _context.set({**_context.get(), **{k: v for k, v in ids.items() if v}})
