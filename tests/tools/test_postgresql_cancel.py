"""The PostgreSQL action's time limit answers as a time limit, whatever the rollback says.

When the service's 1 s limit cancels a statement just as the server's statement_timeout ends
it, the rollback on the interrupted connection raises `InterfaceError: cannot perform
operation: connection is closed`; the call still answers "timed out after 1 s", not that
error. No database needed: the connection is a fake that fails as asyncpg does.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest

from services.tools.catalogue import ActionContext
from services.tools.integrations import postgresql


class _BrokenOnCancel:
    """A connection whose rollback and close fail once a statement was cancelled."""

    def __init__(self) -> None:
        self.terminated = False

    @contextlib.asynccontextmanager
    async def transaction(self, readonly: bool):  # noqa: ARG002
        try:
            yield
        except asyncio.CancelledError:
            raise asyncpg.InterfaceError("cannot perform operation: connection is closed") from None

    async def close(self) -> None:
        raise asyncpg.InterfaceError("cannot perform operation: connection is closed")

    def terminate(self) -> None:
        self.terminated = True


@pytest.fixture
def broken(monkeypatch):
    connection = _BrokenOnCancel()

    async def connect(**_kwargs):
        return connection

    async def connect_args(_dsn, _allow):
        return {}

    monkeypatch.setattr(asyncpg, "connect", connect)
    monkeypatch.setattr(postgresql, "_connect_args", connect_args)
    return connection


def _context() -> ActionContext:
    return ActionContext(
        secret={"dsn": "postgresql://u@db.example/x"},
        auth_type="basic",
        timeout_s=0.1,
        max_output_bytes=1000,
        allow_private_network=False,
    )


async def test_a_statement_the_time_limit_cuts_is_a_timeout_not_the_rollbacks_error(broken):
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            async with postgresql._readonly(_context()):
                await asyncio.sleep(5)  # the slow statement
    assert broken.terminated  # the connection is not left open


async def test_without_a_cancel_the_closes_error_is_raised(broken):
    with pytest.raises(asyncpg.InterfaceError):
        async with postgresql._readonly(_context()):
            pass
    assert broken.terminated
