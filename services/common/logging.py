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
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType, TracebackType
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
    """Route the root logger to stderr as JSON lines for `service` at `level`.

    Warnings (`warnings.warn`) and exceptions nothing caught (in the main thread, another
    thread, or one Python could only ignore, e.g. in `__del__`) are logged as records too, so
    every line a service writes to stderr is one JSON object, a traceback inside it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda hook: _log_uncaught(
        hook.exc_type, hook.exc_value, hook.exc_traceback, "uncaught exception in a thread"
    )
    sys.unraisablehook = lambda hook: _log_uncaught(
        hook.exc_type, hook.exc_value, hook.exc_traceback, hook.err_msg or "exception ignored"
    )


def _log_uncaught(
    kind: type[BaseException],
    value: BaseException | None,
    trace: TracebackType | None,
    message: str = "uncaught exception",
) -> None:
    """Log an exception nothing caught as one record (not Python's multi-line traceback)."""
    if value is None:
        value = kind()
    logging.getLogger("uncaught").critical(message, exc_info=(kind, value, trace))


@contextlib.contextmanager
def bind(**ids: Any) -> Iterator[None]:
    """Bind ids (run_id, chat_id, org_id, ...) to every log record inside the block."""
    token = _context.set({**_context.get(), **{k: v for k, v in ids.items() if v}})
    try:
        yield
    finally:
        _context.reset(token)


def bound(name: str) -> Any:
    """The value bound to `name` in this context (None when nothing is)."""
    return _context.get().get(name)


def bind_token(**ids: Any) -> contextvars.Token[Mapping[str, Any]]:
    """Bind ids until `unbind(token)` with the returned token (in the same context)."""
    return _context.set({**_context.get(), **{k: v for k, v in ids.items() if v}})


def unbind(token: contextvars.Token[Mapping[str, Any]]) -> None:
    """Undo the `bind_token` that returned `token`."""
    _context.reset(token)


def bind_task(**ids: Any) -> None:
    """Bind ids for the rest of the current task (use at the top of a task's coroutine)."""
    _context.set({**_context.get(), **{k: v for k, v in ids.items() if v}})
