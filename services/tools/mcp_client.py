"""The MCP client: one session per operation (list or call) through the official `mcp` SDK.

Every session is opened for one operation and closed after it, so a server that crashes or
hangs harms only the call in flight. Each operation is bounded by the timeout; errors become
`ActionError`s with secret-free messages. When a stdio server fails or times out, a WARNING
names the server and its command (never its args or env values) and quotes the end of its
stderr, for the operator only.

Outbound policy: an organization's URL must pass `netpolicy.resolve_checked` (no loopback,
link-local or private address unless the operator allows it) before every operation, and
every connection goes through `netpolicy.guarded_mcp_client`, which connects to the address it
checked, so a DNS answer that changes after the check (rebinding) cannot lead the
organization's headers elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import urllib.parse
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from services.common.errors import bounded
from services.tools.catalogue import ActionError
from services.tools.crypto import redact
from services.tools.mcp_stdio import (
    DEVNULL,
    STDERR_LOG_CHARS,
    Capturing,
    StderrTail,
    StdioServer,
)
from services.tools.netpolicy import OutboundPolicyError, guarded_mcp_client, resolve_checked

if TYPE_CHECKING:
    from mcp import Client

log = logging.getLogger(__name__)


def check_url_shape(url: str) -> urllib.parse.SplitResult:
    """The parts of an MCP server URL; ActionError unless it is http(s) with a host (a valid IDNA
    name or an IP address), a port from 1 to 65535 when given, and no user info."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError past 65535 or when not a number
        if parts.hostname:
            parts.hostname.encode("idna")  # UnicodeError for an empty or over-long label
    except (ValueError, UnicodeError):
        raise ActionError("server_url is not a valid URL (host, port or brackets)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ActionError("server_url must be an http or https URL with a host")
    if parts.username or parts.password:
        raise ActionError("server_url must not carry user info; pass credentials as headers")
    return parts


async def check_url_policy(url: str, allow_private: bool) -> None:
    """Raise OutboundPolicyError when the URL's host resolves to an address the policy refuses."""
    parts = check_url_shape(url)
    await resolve_checked(
        parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), allow_private
    )


def tool_json(tool: Any) -> dict[str, Any]:
    """{name, description, input_schema} of an `mcp` Tool (an invalid schema becomes
    {"type": "object"})."""
    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object"}
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError:
        schema = {"type": "object"}
    return {"name": tool.name, "description": tool.description or "", "input_schema": schema}


def result_json(result: Any) -> dict[str, Any]:
    """The JSON of a CallToolResult: {"content": [...], "structured_content"?: ...}, each value
    once.

    The MCP specification (2025-06-18, Tools, "Structured Content") asks a server that returns
    structured content to return it serialized in a text block too, and the SDK's servers do;
    passed on as it came, every such result would reach the model twice and count twice
    against LOOPLINE_TOOLS_MAX_OUTPUT_BYTES. So one copy is kept:

    - structured content that is an object, with a text block holding its JSON: the object
      (`structured_content`, the typed form), without that text block;
    - the SDK's wrapping of a value that is no object, `{"result": value}`, with a text block
      holding the value (as text or as JSON): the text block, without `structured_content`.

    Anything else (structured content that says more than the text, or no text copy) is kept whole.
    """
    content = []
    for block in result.content:
        item = block.model_dump(mode="json", by_alias=True, exclude_none=True)
        item.pop("_meta", None)
        content.append(item)
    output: dict[str, Any] = {"content": content}
    structured = result.structured_content
    if structured is None:
        return output
    wrapped = _wrapped_value(structured)
    if wrapped is not _NOTHING and any(_holds(item, wrapped) for item in content):
        return output
    if wrapped is _NOTHING:
        output["content"] = [item for item in content if not _holds(item, structured)]
    output["structured_content"] = structured
    return output


_NOTHING = object()


def _wrapped_value(structured: Any) -> Any:
    """`value` of the SDK's `{"result": value}` wrapping of a value that is no object, else
    _NOTHING."""
    if (
        isinstance(structured, dict)
        and len(structured) == 1
        and "result" in structured
        and not isinstance(structured["result"], dict)
    ):
        return structured["result"]
    return _NOTHING


def _holds(item: dict[str, Any], value: Any) -> bool:
    """Whether content block `item` is a text block holding `value`: the text itself (a string
    value) or its JSON."""
    if (
        item.get("type") != "text"
        or not isinstance(item.get("text"), str)
        or set(item) - {"type", "text"}
    ):
        return False
    text = item["text"]
    if isinstance(value, str) and text == value:
        return True
    try:
        return json.loads(text) == value
    except ValueError:
        return False


def _error_text(result: Any) -> str:
    texts = [getattr(block, "text", "") for block in result.content if getattr(block, "text", "")]
    return "; ".join(texts)[:2000] or "the tool reported an error"


class McpConnector:
    """Opens one MCP session per operation.

    Args:
        timeout_s: the read timeout of one session (the caller also bounds the whole operation).
        max_output_bytes: results whose JSON is larger are refused (an error, not truncated).
        allow_private_network: the outbound policy for organization URLs.
    """

    def __init__(
        self, timeout_s: float, max_output_bytes: int, allow_private_network: bool
    ) -> None:
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.allow_private_network = allow_private_network
        self._closing: set[asyncio.Task[Any]] = set()

    def _client(
        self, target: StdioServer | dict[str, Any], stderr: StderrTail | None = None
    ) -> Client:
        """A Client for `target`; a stdio server's stderr goes to `stderr` (discarded when None)."""
        # the mcp SDK is imported on first use: it costs ~30 MiB and start-up time in every
        # tools process, most of which never talk to an MCP server
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if isinstance(target, StdioServer):
            params = StdioServerParameters(
                command=target.command, args=list(target.args), env=target.env or None
            )
            transport: AbstractAsyncContextManager[Any] = (
                stdio_client(params, errlog=DEVNULL)
                if stderr is None
                else Capturing(stdio_client, params, stderr)
            )
        else:
            # values with surrounding whitespace stripped, as the `http` integration's credentials
            headers = {
                str(k).strip(): str(v).strip() for k, v in (target.get("headers") or {}).items()
            }
            # every connection resolves the host once, checks it and connects to the checked
            # address (netpolicy): no second lookup between the check and the socket
            http = guarded_mcp_client(self.allow_private_network, self.timeout_s, headers)
            transport = _owning(
                http,
                streamable_http_client(
                    target["url"],
                    http_client=http,
                    max_sse_event_size=max(4 * self.max_output_bytes, 1 << 20),
                ),
            )
        return Client(transport, cache=None, read_timeout_seconds=self.timeout_s)

    async def _checked(self, target: StdioServer | dict[str, Any]) -> None:
        if not isinstance(target, StdioServer):
            await check_url_policy(str(target.get("url", "")), self.allow_private_network)

    async def _bounded(self, operation: Any, on_timeout: Any = None) -> Any:
        """Run `operation` (a coroutine function) for at most `timeout_s`; TimeoutError after it.

        The operation runs in its own task under an anyio cancel scope with that deadline.
        On timeout, or when the caller is cancelled, the scope is cancelled (not the task:
        a native cancel would defeat the SDK's shielded shutdown, which gives a stdio
        server time to exit and then kills its process group) and the caller returns at
        once while the session closes in the background (`aclose` waits for those).
        `on_timeout()`, when given, is called once the session of a timed-out operation
        has closed (not when the caller was cancelled).
        """
        import anyio  # loaded with the first MCP operation, not at start

        holder: dict[str, Any] = {}

        async def runner() -> Any:
            with anyio.CancelScope(deadline=anyio.current_time() + self.timeout_s) as scope:
                holder["scope"] = scope
                return await operation()
            if on_timeout is not None and not holder.get("caller_cancelled"):
                on_timeout()
            raise TimeoutError

        task = asyncio.create_task(runner())
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            holder["caller_cancelled"] = isinstance(exc, asyncio.CancelledError)
            if "scope" in holder:
                holder["scope"].cancel()
            self._closing.add(task)
            task.add_done_callback(_forget(self._closing))
            raise

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Wait (at most `timeout_s`) for sessions still closing after a timeout or cancellation."""
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=timeout_s)

    async def list_tools(self, target: StdioServer | dict[str, Any]) -> list[dict[str, Any]]:
        """The server's tools as [{name, description, input_schema}] (all pages, at most 1000).

        Raises ActionError (connection or protocol failure), OutboundPolicyError, TimeoutError.
        A stdio server's failure or timeout is also logged with the end of its stderr
        (`_log_stdio_failure`); the ActionError's message never includes that stderr.
        """
        await self._checked(target)
        stderr = StderrTail() if isinstance(target, StdioServer) else None

        async def operation() -> list[dict[str, Any]]:
            tools: list[dict[str, Any]] = []
            try:
                async with self._client(target, stderr) as client:
                    cursor = None
                    while len(tools) < 1000:
                        page = await client.list_tools(cursor=cursor)
                        tools.extend(tool_json(t) for t in page.tools)
                        cursor = page.next_cursor
                        if not cursor:
                            break
            except (ActionError, asyncio.CancelledError):
                raise
            except BaseException as exc:
                _raise_policy_refusal(exc)
                _log_stdio_failure(target, "list_tools", exc, stderr)
                raise ActionError(
                    f"the MCP server could not be reached or did not answer ({_describe(exc)})"
                ) from None
            return tools

        return await self._bounded(operation, _timeout_logger(target, "list_tools", stderr))

    async def call_tool(
        self, target: StdioServer | dict[str, Any], name: str, arguments: dict[str, Any]
    ) -> dict[str, Any]:
        """Call one tool; returns result_json of its result.

        Raises ActionError when the server cannot be reached, fails, reports is_error, or
        returns more than `max_output_bytes` of JSON; OutboundPolicyError; TimeoutError.
        A stdio server that fails or times out is logged as in `list_tools`.
        """
        await self._checked(target)
        stderr = StderrTail() if isinstance(target, StdioServer) else None

        async def operation() -> Any:
            try:
                async with self._client(target, stderr) as client:
                    return await client.call_tool(name, arguments)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                _raise_policy_refusal(exc)  # refused before the connection: nothing was sent
                _log_stdio_failure(target, f"call_tool {name}", exc, stderr)
                if _unreached(exc):  # no connection: the call was not sent, say so
                    raise ActionError(
                        "the MCP server could not be reached; the call was not sent "
                        f"({_describe(exc)})"
                    ) from None
                raise ActionError(
                    f"the MCP server failed during the call ({_describe(exc)})"
                ) from None

        result = await self._bounded(
            operation, _timeout_logger(target, f"call_tool {name}", stderr)
        )
        if result.is_error:
            raise ActionError(f"the MCP tool {name!r} returned an error: {_error_text(result)}")
        output = result_json(result)
        size = len(json.dumps(output, ensure_ascii=False, separators=(",", ":")).encode())
        if size > self.max_output_bytes:
            raise ActionError(
                f"the MCP tool {name!r} returned {size} bytes, "
                f"more than the limit of {self.max_output_bytes} bytes"
            )
        return output


def _forget(tasks: set[asyncio.Task[Any]]) -> Any:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not log it as unhandled

    return done


def _log_stdio_failure(
    target: Any, operation: str, error: BaseException | str, stderr: StderrTail | None
) -> None:
    """Log (WARNING) that a stdio server's `operation` failed: the command, the error and the end
    of the server's stderr.

    For the operator only: the stderr may hold anything, so it never goes into a tool
    result; the values of the server's configured `env` are redacted from it and from the
    error text, and both are cut to STDERR_LOG_CHARS. The mcp SDK does not expose the
    process's exit status, so a crash shows as its last stderr lines (an empty
    `stderr_tail` means the server wrote nothing there). Field `command` is the configured
    executable as written (cut to MAX_MESSAGE_CHARS), not redacted: the error text alone may
    lose it (an `env` value such as a virtualenv folder redacted from the path, a long path
    cut), and a command that does not exist or is not executable must be findable. The
    server's `args` and `env` values, which may carry secrets, are never logged.
    """
    if not isinstance(target, StdioServer) or stderr is None:
        return
    if isinstance(error, BaseException):
        inner = _innermost(error)
        detail = redact(f"{type(inner).__name__}: {inner}".strip().rstrip(":"), target.env)
        error = bounded(detail, STDERR_LOG_CHARS)
    log.warning(
        "stdio MCP server failed",
        extra={
            "fields": {
                "server": target.name,
                "command": bounded(target.command),
                "operation": operation,
                "error": error,
                "stderr_tail": stderr.text(secret=target.env),
            }
        },
    )


def _timeout_logger(target: Any, operation: str, stderr: StderrTail | None) -> Any:
    """The `on_timeout` of a stdio operation (None for an HTTP server)."""
    if not isinstance(target, StdioServer) or stderr is None:
        return None
    return lambda: _log_stdio_failure(
        target, operation, f"no answer within the time limit ({operation})", stderr
    )


class _owning:
    """An async context manager that enters `inner` and closes `http` after it."""

    def __init__(self, http: Any, inner: Any) -> None:
        self._http = http
        self._inner = inner

    async def __aenter__(self) -> Any:
        try:
            return await self._inner.__aenter__()
        except BaseException:
            await self._http.aclose()
            raise

    async def __aexit__(self, *exc: Any) -> Any:
        try:
            return await self._inner.__aexit__(*exc)
        finally:
            await self._http.aclose()


def _innermost(exc: BaseException) -> BaseException:
    """The first leaf exception of a (nested) exception group; `exc` itself when it is no group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _raise_policy_refusal(exc: BaseException) -> None:
    """Raise the OutboundPolicyError inside `exc` (an exception group of the SDK's tasks, or an
    error it wrapped), if there is one: a connection the policy refused is reported as the
    refusal (its message is safe to show), not as a server that failed."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OutboundPolicyError):
            raise OutboundPolicyError(str(current)) from None
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)


def _unreached(exc: BaseException) -> bool:
    """Whether a failure is a connection that was never made (refused, no route, unknown host):
    an HTTP server's request, a call included, was then never sent."""
    exc = _innermost(exc)
    httpx2 = sys.modules.get("httpx2")
    return (httpx2 is not None and isinstance(exc, httpx2.ConnectError)) or isinstance(
        exc, (ConnectionRefusedError, socket.gaierror)
    )


def _describe(exc: BaseException) -> str:
    """A short, secret-free description of a failure: the innermost exception types of a group."""
    exc = _innermost(exc)
    name = type(exc).__name__
    httpx2 = sys.modules.get("httpx2")  # an httpx2 error exists only once httpx2 was loaded
    if httpx2 is not None and isinstance(exc, httpx2.HTTPStatusError):
        return f"{name}: HTTP {exc.response.status_code}"
    return name
