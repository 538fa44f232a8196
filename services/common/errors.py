"""The rich gRPC error model (google.rpc.Status with details), server and client side.

Follows Google AIP-193: every error carries a `google.rpc.ErrorInfo` with an
UPPER_SNAKE `reason` and a `domain`; `RetryInfo` is added where a retry makes sense.
Servers raise `RpcError`; the servicer wrapper turns it into a status with
`context.abort_with_status`. Clients read the details back with `status_details`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common import db, metrics, request_ids

log = logging.getLogger(__name__)

ASSISTANT_DOMAIN = "assistant.loopline.dev"
BILLING_DOMAIN = "billing.loopline.dev"
TOOLS_DOMAIN = "tools.loopline.dev"
# the service that answers in each domain (the `service` label of storage errors)
_SERVICE_OF_DOMAIN = {
    ASSISTANT_DOMAIN: "orchestrator",
    BILLING_DOMAIN: "billing",
    TOOLS_DOMAIN: "tools",
}


MAX_MESSAGE_CHARS = 1000  # an RpcError's message at most (characters)
MAX_METADATA_VALUE_CHARS = 500  # an ErrorInfo metadata value at most (characters)


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most `limit` characters, ending in "…" when it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class RpcError(Exception):
    """A domain error to send as a rich gRPC status.

    Attributes:
        code: the gRPC status code.
        reason: UPPER_SNAKE ErrorInfo reason, e.g. "CHAT_NOT_FOUND".
        message: text safe to show a client (never a secret or internal detail); cut to
            MAX_MESSAGE_CHARS (metadata values to MAX_METADATA_VALUE_CHARS) by `bounded`.
        domain: ErrorInfo domain.
        metadata: ErrorInfo metadata (string values).
        details: further detail messages (e.g. a billing Denial).
        retry_after_s: when set, a RetryInfo detail with this delay.
    """

    code: grpc.StatusCode
    reason: str
    message: str
    domain: str = ASSISTANT_DOMAIN
    metadata: dict[str, str] = field(default_factory=dict)
    details: Sequence[Message] = ()
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        # Messages and metadata often quote the caller's input; bound them so that a status
        # never outgrows gRPC's metadata limit (the message travels twice, in grpc-message and
        # in grpc-status-details-bin; the receiving channel refuses more than 16 KiB) and
        # the error never carries an echo of a huge field back to a client.
        self.message = bounded(self.message)
        self.metadata = {
            key: bounded(value, MAX_METADATA_VALUE_CHARS) for key, value in self.metadata.items()
        }
        super().__init__(self.message)

    def to_status(self) -> grpc.Status:
        """The grpc.Status carrying this error (code, message, packed details)."""
        return rpc_status.to_status(self.to_proto())

    def to_proto(self) -> status_pb2.Status:
        """The google.rpc.Status of `to_status` (what grpc-status-details-bin carries)."""
        packed: list[any_pb2.Any] = []
        info = error_details_pb2.ErrorInfo(
            reason=self.reason, domain=self.domain, metadata=self.metadata
        )
        for message in (info, *self.details):
            item = any_pb2.Any()
            item.Pack(message)
            packed.append(item)
        if self.retry_after_s is not None:
            item = any_pb2.Any()
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            item.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            packed.append(item)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)


async def abort(context: grpc.aio.ServicerContext, error: RpcError) -> None:
    """Abort the RPC on `context` with `error`'s rich status (raises, never returns)."""
    await context.abort_with_status(error.to_status())


#: A unary servicer handler: (self, request, context) -> response.
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
#: A server-streaming servicer handler: (self, request, context) -> async iterator of responses.
StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]


def stream_interrupted(position: int, why: str = "") -> str:
    """The message of the `error` frame that ends a listener's stream when the stream itself
    broke (not the run): "The event stream was interrupted (why); reconnect with ?after=N", N
    the listener's position. One wording for the gateway (its upstream broke) and the
    orchestrator (Redis unreachable for LOOPLINE_REDIS_RETRY_S), so clients read N one way."""
    reason = f" ({why})" if why else ""
    return f"The event stream was interrupted{reason}; reconnect with ?after={position}"


def storage_failure(error: BaseException, domain: str) -> tuple[str, RpcError] | None:
    """(log message, the answer in `domain`) for a storage error that is not a bug, else None:
    a database or Redis that cannot serve (`db.unavailable_store`: UNAVAILABLE
    <STORE>_UNAVAILABLE, retryable), a transaction that lost a race with another (`db.is_conflict`:
    ABORTED CONCURRENT_UPDATE; nothing was kept, sent again it goes through), a value the
    database cannot store (`db.is_invalid_value`: INVALID_ARGUMENT INVALID_VALUE)."""
    store = db.unavailable_store(error)
    if store is not None:
        return f"{store} unavailable", RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"{store.upper()}_UNAVAILABLE",
            "The service is temporarily unavailable; try again",
            domain=domain,
        )
    if db.is_conflict(error):
        return "a transaction lost a race with another", RpcError(
            grpc.StatusCode.ABORTED,
            "CONCURRENT_UPDATE",
            "Another request changed the same data at the same time; try again",
            domain=domain,
        )
    if db.is_invalid_value(error):
        return "a value the database cannot store", RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_VALUE",
            "A field holds a value that cannot be stored "
            "(a NUL character, or a number out of range)",
            domain=domain,
        )
    return None


class PassLog:
    """What a background loop (billing's sweeper, the orchestrator's run supervisor) logs of its
    passes: a failed pass caused by a storage outage (`db.unavailable_store`) is one WARNING
    "<what>: <store> unavailable; <waiting>" when the outage starts, and one INFO "<what>:
    passes go through again" when a pass next succeeds, not a traceback per pass; any other
    failure is logged with its traceback (ERROR), every time.
    """

    def __init__(self, logger: logging.Logger, what: str, waiting: str) -> None:
        self.logger, self.what, self.waiting = logger, what, waiting
        self.outage = False  # the last failed pass was an outage, already said

    def failed(self, error: Exception) -> None:
        """Log the failed pass's `error` (call it from the `except` block)."""
        store = db.unavailable_store(error)
        if store is None:
            self.logger.error(f"{self.what} pass failed", exc_info=error)
        elif not self.outage:
            self.outage = True
            self.logger.warning(
                f"{self.what}: {store} unavailable; {self.waiting}",
                extra={"fields": {"error": type(error).__name__}},
            )

    def passed(self) -> None:
        """A pass went through: say so once after an outage."""
        if self.outage:
            self.outage = False
            self.logger.info(f"{self.what}: passes go through again")


async def _answer(
    context: grpc.aio.ServicerContext,
    error: Exception,
    rpc: str,
    internal_domain: str | None,
    domain: str,
) -> None:
    """Abort the RPC with the status `error` earns (`error_answer`; raises grpc.aio.AbortError)."""
    await abort(context, error_answer(error, rpc, internal_domain, domain))


def error_answer(error: Exception, rpc: str, internal_domain: str | None, domain: str) -> RpcError:
    """The status `error`, raised by handler `rpc`, earns.

    RpcError: itself. A storage error that is not a bug (`storage_failure`) gets its answer in
    `internal_domain` (else `domain`), logged as a WARNING. Any other exception is a bug: logged
    with its traceback and answered with a generic message, never its own text (which may quote
    SQL or parameters): INTERNAL in `internal_domain` when given, else UNKNOWN in `domain` (the
    caller cannot know whether the call took effect).
    """
    if isinstance(error, RpcError):
        return error
    known = storage_failure(error, internal_domain or domain)
    if known is not None:
        metrics.storage_error(_SERVICE_OF_DOMAIN.get(internal_domain or domain, "other"), error)
        log.warning(known[0], extra={"fields": {"rpc": rpc, "error": type(error).__name__}})
        return known[1]
    log.exception("unhandled error", extra={"fields": {"rpc": rpc}}, exc_info=error)
    if internal_domain is not None:
        return RpcError(
            grpc.StatusCode.INTERNAL, "INTERNAL", "Internal error", domain=internal_domain
        )
    return RpcError(
        grpc.StatusCode.UNKNOWN,
        "INTERNAL",
        "Internal error; the call may or may not have taken effect",
        domain=domain,
    )


def rpc_handler(
    *,
    internal_domain: str | None = None,
    domain: str = ASSISTANT_DOMAIN,
    check: Callable[[Any], None] | None = None,
) -> Callable[[Handler], Handler]:
    """The wrapper of every unary servicer handler (STYLE.md, after A2A's grpc_handler).

    `check(request)`, when given, runs first and may raise RpcError (a field every call
    carries, e.g. the caller's organization id). Exceptions are answered by `_answer`; an
    abort already under way (grpc.aio.AbortError) and cancellation propagate untouched. The
    request id the call carries is bound in the log context (`request_ids.adopt`).
    """

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_ids.adopt(context)
            try:
                if check is not None:
                    check(request)
                return await handler(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _answer(context, error, handler.__name__, internal_domain, domain)

        return wrapper

    return decorate


def stream_rpc_handler(
    *,
    internal_domain: str | None = None,
    domain: str = ASSISTANT_DOMAIN,
    check: Callable[[Any], None] | None = None,
) -> Callable[[StreamHandler], StreamHandler]:
    """The wrapper of every server-streaming servicer handler: `rpc_handler` for an async generator.

    Errors raised while the handler produces its messages are answered as `rpc_handler`
    answers them; the handler's generator is closed when the stream ends for any reason
    (client cancel, deadline, shutdown), so its `finally` blocks run at once. Sending is
    left to grpc: a client that went away is not an error of the handler.
    """

    def decorate(handler: StreamHandler) -> StreamHandler:
        @functools.wraps(handler)
        async def wrapper(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncGenerator[Any, None]:
            request_ids.adopt(context)
            try:
                if check is not None:
                    check(request)
                async with contextlib.aclosing(handler(self, request, context)) as messages:
                    async for message in messages:
                        yield message
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _answer(context, error, handler.__name__, internal_domain, domain)

        return wrapper

    return decorate


@dataclass
class StatusDetails:
    """The parsed details of a failed call: ErrorInfo, RetryInfo and other packed messages."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    domain: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None
    details: list[any_pb2.Any] = field(default_factory=list)

    def unpack(self, message_type: type[Message]) -> Message | None:
        """The first packed detail of `message_type`, or None."""
        for item in self.details:
            message = message_type()
            if item.Unpack(message):  # False (and `message` untouched) for another type
                return message
        return None


def status_details(error: grpc.aio.AioRpcError | grpc.RpcError) -> StatusDetails:
    """Parse the rich status of a failed call (plain code and message when it has none)."""
    code = error.code()
    parsed = StatusDetails(code=code, message=error.details() or "")
    # aio: a grpc.aio.Metadata; sync: namedtuples (typed as objects): both iterate as pairs
    metadata: Any = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            parsed.message = status.message
            for item in status.details:
                if item.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    item.Unpack(info)
                    parsed.reason, parsed.domain, parsed.metadata = (
                        info.reason,
                        info.domain,
                        dict(info.metadata),
                    )
                elif item.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    retry = error_details_pb2.RetryInfo()
                    item.Unpack(retry)
                    parsed.retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
                else:
                    parsed.details.append(item)
    return parsed


__all__ = [
    "ASSISTANT_DOMAIN",
    "BILLING_DOMAIN",
    "MAX_MESSAGE_CHARS",
    "TOOLS_DOMAIN",
    "RpcError",
    "StatusDetails",
    "abort",
    "bounded",
    "code_pb2",
    "rpc_handler",
    "status_details",
    "stream_rpc_handler",
]
