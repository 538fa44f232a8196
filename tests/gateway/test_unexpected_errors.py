"""Failures no route handles get the documented `{"detail": ...}` shape, never a plain-text 500.

A database that cannot be reached or is full (PostgreSQL's "sorry, too many clients already")
is 503 with Retry-After (retryable), anything else 500 `{"detail": "Internal server error"}`, on
the lean routes and on FastAPI's alike; the gRPC servicers answer UNAVAILABLE for the same
causes.
"""

from __future__ import annotations

from typing import cast

import asyncpg
import grpc
import pytest
from sqlalchemy import exc

from services.common import db
from services.common.errors import rpc_handler


def _too_many_clients() -> exc.DBAPIError:
    cause = asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already")
    return exc.DBAPIError("SELECT 1", None, cause)


def test_is_unavailable_tells_a_full_or_unreachable_database_from_a_bad_statement():
    assert db.is_unavailable(_too_many_clients())
    assert db.is_unavailable(ConnectionRefusedError(111, "refused"))
    assert db.is_unavailable(exc.TimeoutError("QueuePool limit reached"))
    wrapped = exc.OperationalError(
        "SELECT 1", None, asyncpg.exceptions.CannotConnectNowError("starting up")
    )
    assert db.is_unavailable(wrapped)
    assert not db.is_unavailable(
        exc.IntegrityError("INSERT", None, asyncpg.exceptions.UniqueViolationError("dup"))
    )
    assert not db.is_unavailable(RuntimeError("bug"))


def _deadlock() -> exc.DBAPIError:
    return exc.DBAPIError(
        "UPDATE api_keys",
        None,
        asyncpg.exceptions.DeadlockDetectedError("deadlock detected /secret/path"),
    )


def _nul() -> exc.DBAPIError:
    return exc.DBAPIError(
        "INSERT", None, asyncpg.exceptions.CharacterNotInRepertoireError('secret "UTF8": 0x00')
    )


@pytest.mark.parametrize(
    "failure, status",
    [
        (_too_many_clients, 503),
        (lambda: RuntimeError("boom /secret/path"), 500),
        # asyncpg's timeouts (LOOPLINE_DB_TIMEOUT_S) and refused connections come through unwrapped
        (TimeoutError, 503),
        (lambda: ConnectionRefusedError(111, "refused /secret/path"), 503),
        (lambda: OSError("disk /secret/path"), 500),
        # as the gRPC services answer them (`errors.storage_failure`): the gateway's own database
        # answered a lost race or a value it cannot store with 500 "Internal server error"
        (_deadlock, 409),
        (_nul, 400),
    ],
)
async def test_turn_post_and_settings_get_answer_json_when_the_database_fails(
    services, monkeypatch, caplog, failure, status
):
    async def broken(*_args, **_kwargs):
        raise failure()

    monkeypatch.setattr(services.gateway.default_models, "get", broken)
    async with services.client() as client:
        lean = await client.post(
            "/assistant/chat", json={"message": "hello"}
        )  # the lean route (default model lookup)
        routed = await client.get("/organizations/settings")  # a FastAPI route
    for response in (lean, routed):
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        body = response.json()
        assert set(body) == {"detail"} and "secret" not in body["detail"]
        if status == 503:
            assert response.headers["retry-after"] == "1"
    assert "connection" not in lean.headers  # the lean route answers and keeps the connection
    asgi_errors = [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
    if status == 500:
        # a FastAPI route's unhandled error ends its connection (uvicorn closes it after Starlette
        # re-raises): the answer says so
        assert routed.headers["connection"] == "close" and asgi_errors
    else:
        # a storage failure is an answer, not an error of the gateway: the connection stays, no
        # ERROR traceback (which would be one per request while the database is away)
        assert "connection" not in routed.headers and not asgi_errors, routed.headers


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.code = status.code
        raise grpc.aio.AbortError()


def _error_info(context):
    from google.rpc import error_details_pb2, status_pb2

    packed = dict(context.status.trailing_metadata)["grpc-status-details-bin"]
    info = error_details_pb2.ErrorInfo()
    status_pb2.Status.FromString(packed).details[0].Unpack(info)
    return info


class _StatusContext(_Context):
    async def abort_with_status(self, status: grpc.Status) -> None:
        self.status = status
        await super().abort_with_status(status)


async def _abort_of(failure, **handler_options) -> _StatusContext:
    """The context of an rpc_handler-wrapped handler (with `handler_options`) that raises
    `failure()`."""

    class Servicer:
        @rpc_handler(**handler_options)
        async def Call(self, request, context):  # noqa: N802 - gRPC method name
            raise failure()

    context = _StatusContext()
    with pytest.raises(grpc.aio.AbortError):
        # a stand-in context: the error path calls only `abort_with_status`
        await Servicer().Call(None, cast(grpc.aio.ServicerContext, context))
    return context


async def test_servicers_answer_unavailable_when_the_database_is_full():
    assert (await _abort_of(_too_many_clients)).code == grpc.StatusCode.UNAVAILABLE


def test_an_unavailable_redis_is_named_as_redis_not_as_the_database(caplog):
    """A Redis outage is logged and reported as Redis, not as "database unavailable" with
    DATABASE_UNAVAILABLE, which would send an operator to look at PostgreSQL."""
    import redis.exceptions

    down = redis.exceptions.ConnectionError(
        "Error 111 connecting to 127.0.0.1:6379. Connection refused."
    )
    down.__cause__ = ConnectionRefusedError(111, "refused")
    assert db.unavailable_store(down) == "Redis"
    assert db.unavailable_store(_too_many_clients()) == "database"
    assert db.unavailable_store(ConnectionRefusedError(111, "refused")) == "database"
    assert db.unavailable_store(RuntimeError("bug")) is None
    assert db.unavailable_store(redis.exceptions.ResponseError("WRONGTYPE")) is None


async def test_servicers_name_the_store_that_is_unavailable_in_the_log_and_the_reason(caplog):
    """A redis-py connection error (no OSError on its chain when redis-py says `from None`) is
    UNAVAILABLE with reason REDIS_UNAVAILABLE, logged as "Redis unavailable"."""
    import redis.exceptions

    with caplog.at_level("WARNING"):
        context = await _abort_of(lambda: redis.exceptions.ConnectionError("Connection refused"))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert [r.getMessage() for r in caplog.records] == ["Redis unavailable"]
    info = _error_info(context)
    assert info.reason == "REDIS_UNAVAILABLE"


@pytest.mark.parametrize(
    "failure",
    [
        lambda: exc.DBAPIError(
            "SELECT chats.id FROM chats WHERE organization_id = $1",
            ("o\x00",),
            asyncpg.exceptions.DataError("secret detail"),
        ),
        lambda: RuntimeError("boom /secret/path"),
    ],
)
async def test_an_unhandled_error_answers_a_generic_message_with_error_info_never_its_own_text(
    failure,
):
    """An unhandled error is answered by the servicer with an ErrorInfo and a generic message;
    left to grpc it would be UNKNOWN "Unexpected <class ...>: [SQL: ...] [parameters: ...]"."""
    from services.common.errors import BILLING_DOMAIN

    context = await _abort_of(failure, domain=BILLING_DOMAIN)
    assert context.code == grpc.StatusCode.UNKNOWN
    assert (
        "SQL" not in context.status.details
        and "secret" not in context.status.details
        and "class" not in context.status.details
    )
    info = _error_info(context)
    assert (info.reason, info.domain) == ("INTERNAL", BILLING_DOMAIN)


@pytest.mark.parametrize(
    "failure",
    [
        lambda: exc.DBAPIError(
            "INSERT",
            None,
            asyncpg.exceptions.CharacterNotInRepertoireError(
                'invalid byte sequence for encoding "UTF8": 0x00'
            ),
        ),
        lambda: exc.DBAPIError(
            "INSERT", None, asyncpg.exceptions.NumericValueOutOfRangeError("bigint out of range")
        ),
        lambda: OverflowError("Python int too large to convert to SQLite INTEGER"),
    ],
)
async def test_a_value_the_database_cannot_store_is_invalid_argument(failure):
    context = await _abort_of(failure)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _error_info(context).reason == "INVALID_VALUE" and "0x00" not in context.status.details


async def test_a_transaction_that_lost_a_race_is_aborted_to_be_sent_again():
    """A deadlock or serialization failure (e.g. a resume and a cancel sent together on
    PostgreSQL; the lock order is fixed by the orchestrator's `lock_chat`) is ABORTED
    CONCURRENT_UPDATE (the gateway's 409, to be sent again), not a 500."""
    for cause in (
        asyncpg.exceptions.DeadlockDetectedError("deadlock detected"),
        asyncpg.exceptions.SerializationError("could not serialize access"),
    ):
        context = await _abort_of(
            lambda cause=cause: exc.DBAPIError("UPDATE interrupts", None, cause)
        )
        assert (
            context.code == grpc.StatusCode.ABORTED
            and _error_info(context).reason == "CONCURRENT_UPDATE"
        )


async def test_every_storage_failure_is_answered_in_the_services_own_domain():
    """The tools service (`internal_domain`) answers a database outage in its own domain, like
    its other storage failures: one domain for all of them."""
    from services.common.errors import TOOLS_DOMAIN

    def conflict() -> Exception:
        return exc.DBAPIError(
            "UPDATE", None, asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
        )

    def nul() -> Exception:
        return exc.DBAPIError(
            "INSERT", None, asyncpg.exceptions.CharacterNotInRepertoireError("0x00")
        )

    for failure in (_too_many_clients, conflict, nul, lambda: RuntimeError("bug")):
        context = await _abort_of(failure, internal_domain=TOOLS_DOMAIN)
        assert _error_info(context).domain == TOOLS_DOMAIN, failure
