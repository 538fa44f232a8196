"""Billing calls that failed their quick retries: stored in the orchestrator's database
(`billing_redeliveries`) and sent again in the background until billing takes them.

`call_with_retries` makes the quick sends of one billing call; `release_or_store` releases a
reservation, storing the Release when billing cannot be asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
from sqlalchemy import Table, delete, func, insert, select, update

from loopline.billing.v1 import billing_pb2
from services.common import db, metrics
from services.common.tasks import stop_task
from services.orchestrator.models import BillingRedelivery, utcnow

log = logging.getLogger(__name__)

_REDELIVERIES = cast(Table, BillingRedelivery.__table__)  # a declarative model's table

ATTEMPTS = 3  # quick sends of a billing call before it is stored (0.1 s, then 0.2 s apart)
# how long the quick sends of one billing call may take in all (their deadlines included)
QUICK_BUDGET_S = 2.0
CALL_TIMEOUT_S = 5.0  # deadline of a background (stored) billing call
REDELIVERY_BATCH = 20  # stored billing calls sent at once by `Redelivery`
# when `Redelivery` sends a run end's stored usage itself (the batcher has not deleted it by then)
STORED_GRACE_S = 30.0


async def call_with_retries(
    call: Callable[[float], Awaitable[Any]], budget_s: float = QUICK_BUDGET_S
) -> grpc.aio.AioRpcError | None:
    """Await `call(timeout)` (an idempotent billing RPC; `timeout` its deadline in seconds) up to
    ATTEMPTS times, 0.1 s then 0.2 s apart, while it fails with AioRpcError, all within
    `budget_s` (each attempt's deadline is what is left of it, so a stalled billing holds the
    caller `budget_s` at most, not ATTEMPTS full deadlines); returns None once it succeeds,
    else the last failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    failure: grpc.aio.AioRpcError | None = None
    for attempt in range(ATTEMPTS):
        left = deadline - loop.time()
        if attempt and left <= 0.05:
            break
        try:
            await call(max(left, 0.05))
            return None
        except grpc.aio.AioRpcError as refused:
            failure = refused
        if attempt < ATTEMPTS - 1:
            await asyncio.sleep(max(0.0, min(0.1 * (attempt + 1), deadline - loop.time())))
    return failure


async def release_or_store(
    billing: Any, redelivery: Redelivery, reservation_id: str, reason: str, failure_message: str
) -> int | None:
    """Release a reservation with billing (one call, 10 s); returns its billing_pb2.ReservationState
    after the call (RELEASED, CHARGED when a Charge was posted first, EXPIRED), or None when
    billing could not be asked: then WARNING `failure_message` and the Release is stored by
    `redelivery` and sent again in the background (a hold left as it is would block its credit
    and count against the quota until it expires). The turn start's and the crash reaper's."""
    request = billing_pb2.ReleaseRequest(reservation_id=reservation_id, reason=reason)
    try:
        response = await billing.Release(request, timeout=10)
    except grpc.aio.AioRpcError as error:
        log.warning(
            f"{failure_message}; retrying in the background",
            extra={"fields": {"reservation_id": reservation_id, "code": error.code().name}},
        )
        await redelivery.retry(
            "Release", request, failure_message, [{"reservation_id": reservation_id}]
        )
        return None
    return response.state


class Redelivery:
    """Billing calls that failed their quick retries, kept in the orchestrator's database
    (`billing_redeliveries`) and sent again in the background until billing takes them.

    Args:
        sessions: async session factory of the orchestrator database.
        first_delay_s / max_delay_s: the wait before a stored call's first background attempt,
            doubled after each failure up to `max_delay_s` (1 s, 60 s).
        horizon_s: how long a call is retried (7 days); past it, it is given up and its
            `failure_message` logged at ERROR with its ids.
        idle_poll_s: how often the table is read when nothing is due here (60 s): it finds the
            calls of a replica that stopped or crashed (PostgreSQL; on SQLite the next start
            of the process finds them at once).

    `register(method, send)` names how a stored call is sent (`send(request_bytes)` raises
    grpc.aio.AioRpcError on failure); `retry(method, request, failure_message, log_fields)`
    stores one (a WARNING per record says so); `start()` starts the sender task and `close()`
    stops it. Every call is idempotent in billing (by run and call index or tool call), so a
    call sent twice (two replicas, a crash between the send and the delete) only replays.
    Stored calls survive a crash or stop of the process; a call that could not be stored (the
    database down as well) is kept in memory and stored, or sent, at the next pass; at
    `close()` it gets one last attempt and is logged at ERROR if that fails. Never raises.
    """

    def __init__(
        self,
        sessions: Any,
        first_delay_s: float = 1.0,
        max_delay_s: float = 60.0,
        horizon_s: float = 7 * 86400.0,
        idle_poll_s: float = 60.0,
    ) -> None:
        self.sessions = sessions
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.horizon_s = horizon_s
        self.idle_poll_s = idle_poll_s
        self._senders: dict[str, Callable[[bytes], Awaitable[Any]]] = {}
        self._unstored: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def register(self, method: str, send: Callable[[bytes], Awaitable[Any]]) -> None:
        """Name how a stored `method` call is sent: `send(serialized request)`."""
        self._senders[method] = send

    def start(self) -> None:
        """Start the background sender (idempotent); it first sends what an earlier process left."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._main(), name="billing-redelivery"
            )

    async def pending(self) -> int:
        """Calls waiting to be sent again (stored by any replica, plus those not stored yet)."""
        async with self.sessions() as session:
            stored = await session.scalar(select(func.count()).select_from(BillingRedelivery))
        return int(stored or 0) + len(self._unstored)

    async def send_or_store(
        self,
        method: str,
        request: Any,
        call: Callable[[float], Awaitable[Any]],
        failure_message: str,
        log_fields: list[dict[str, Any]],
        stored: list[str] | None = None,
    ) -> bool:
        """Send `request` (a protobuf message for the idempotent billing RPC `method`) with
        `call(timeout)` and quick retries (`call_with_retries`: 3 attempts within 2 s); returns
        True once billing took it. When they all fail, log WARNING "`failure_message`; retrying
        in the background" once per entry of `log_fields` (with the gRPC code), then store it
        (`retry`), or, when `stored` names the rows that already hold it (a run's end stored
        it), make those due soon (`due_soon`); returns False. Never raises a billing failure."""
        failure = await call_with_retries(call)
        if failure is None:
            return True
        for fields in log_fields:
            log.warning(
                f"{failure_message}; retrying in the background",
                extra={"fields": {"code": failure.code().name, **fields}},
            )
        if stored is None:
            await self.retry(method, request, failure_message, log_fields)
        else:
            await self.due_soon(stored)
        return False

    async def retry(
        self, method: str, request: Any, failure_message: str, log_fields: list[dict[str, Any]]
    ) -> None:
        """Store `request` (a protobuf message for `method`) to be sent again in the background."""
        row = self.row(method, request, failure_message, log_fields, self.first_delay_s)
        if not await self._store([row]):
            self._unstored.append(row)
        self._wake.set()

    @staticmethod
    def row(
        method: str,
        request: Any,
        failure_message: str,
        log_fields: list[dict[str, Any]],
        delay_s: float,
    ) -> dict[str, Any]:
        """A `billing_redeliveries` row (column -> value) for `request` (a protobuf message for
        `method`), its first background attempt `delay_s` seconds from now. `retry` stores one;
        `UsageBatcher.take` makes one for a run's end to write in its own transaction."""
        now = utcnow()
        return {
            "id": str(uuid.uuid4()),
            "method": method,
            "request": request.SerializeToString(),
            "failure_message": failure_message[:200],
            "log_fields": log_fields,
            "attempts": 0,
            "created_at": now,
            "next_attempt_at": now + datetime.timedelta(seconds=delay_s),
        }

    async def due_soon(self, ids: list[str]) -> None:
        """Stored calls (`ids`, written by another writer: a run's end) that billing did not take
        at once: their first background attempt is `first_delay_s` from now, as for a call
        `retry` stores (it was STORED_GRACE_S after their end). Never raises (they stay due
        later)."""
        table = _REDELIVERIES
        try:
            async with self.sessions() as session, session.begin():
                await session.execute(
                    update(table)
                    .where(table.c.id.in_(ids), table.c.attempts == 0)
                    .values(
                        next_attempt_at=utcnow() + datetime.timedelta(seconds=self.first_delay_s)
                    )
                )
        except Exception as error:  # noqa: BLE001 - the database is down too: they are sent when first due
            log.warning(
                "rescheduling stored billing calls failed",
                extra={"fields": {"calls": len(ids), "error": type(error).__name__}},
            )
        self._wake.set()

    async def close(self) -> None:
        """Stop the sender; what was not stored gets one last attempt (ERROR when that fails too).

        Stored calls stay for the next start of the process (or another replica)."""
        if self._task is not None:
            self._stopping = (
                True  # the sender also stops by itself: a cancel can be lost (see `_main`)
            )
            await stop_task(self._task)
            self._task = None
        unstored, self._unstored = self._unstored, []
        if unstored and not await self._store(unstored):
            await asyncio.gather(*(self._last_attempt(row) for row in unstored))

    async def _last_attempt(self, row: dict[str, Any]) -> None:
        try:
            await self._send(row["method"], row["request"])
        except Exception as failure:  # noqa: BLE001 - logged with the call's ids; close() never raises
            self._give_up(
                row,
                failure.code().name
                if isinstance(failure, grpc.aio.AioRpcError)
                else type(failure).__name__,
            )

    async def _store(self, rows: list[dict[str, Any]]) -> bool:
        try:
            async with self.sessions() as session, session.begin():
                await session.execute(insert(BillingRedelivery), rows)
        except Exception as error:  # noqa: BLE001 - the database is down too: kept in memory, stored at the next pass
            log.warning(
                "storing billing calls to send again failed; kept in memory",
                extra={"fields": {"calls": len(rows), "error": type(error).__name__}},
            )
            return False
        return True

    async def _send(self, method: str, request: bytes) -> None:
        await self._senders[method](request)

    def _give_up(self, row: dict[str, Any], code: str) -> None:
        for fields in row["log_fields"] or [{}]:
            log.error(row["failure_message"], extra={"fields": {"code": code, **fields}})

    async def _main(self) -> None:
        first = True  # a new process sends what waits at once: billing may be back
        while not self._stopping:
            wait_s = self.idle_poll_s
            self._wake.clear()  # a call stored during this pass sets it again: no wait then
            try:
                if self._unstored:
                    unstored, self._unstored = self._unstored, []
                    if not await self._store(unstored):
                        self._unstored = unstored + self._unstored
                wait_s = await self._deliver_due(everything=first)
                first = False
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the database is unavailable: try again later
                log.warning(
                    "sending stored billing calls failed; trying again",
                    extra={"fields": {"error": type(error).__name__}},
                )
                wait_s = min(self.max_delay_s, self.idle_poll_s)
            if self._unstored:
                wait_s = min(wait_s, self.max_delay_s)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a wait that finished
            # in the same loop turn as a cancel and drops the cancel (a stop then hangs for good)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait_s, 0.0)):
                    await self._wake.wait()

    async def _deliver_due(self, everything: bool = False) -> float:
        """Send the stored calls that are due (with `everything`, all of them: the first pass of a
        process that starts), REDELIVERY_BATCH at a time, each claimed first (one
        replica sends each attempt); a batch of which billing took none ends the pass (billing
        is still down: the rest wait for their next attempt). Calls of methods this process does
        not know (a newer version's) are left to a process that does. Returns the seconds until
        the next call is due (`idle_poll_s` at most); what is still stored then, with what is
        not stored yet, is the outbox backlog metric (`loopline_billing_outbox_backlog`)."""
        table = _REDELIVERIES
        known = table.c.method.in_(sorted(self._senders))
        after_id = ""  # `everything`: each stored call once, in id order (keyset pages)
        while True:
            now = utcnow()
            page = (
                select(table).where(known, table.c.id > after_id).order_by(table.c.id)
                if everything
                else select(table)
                .where(known, table.c.next_attempt_at <= now)
                .order_by(table.c.next_attempt_at)
            )
            async with self.sessions() as session:
                rows = (await session.execute(page.limit(REDELIVERY_BATCH))).mappings().all()
            if not rows:
                break
            taken = await asyncio.gather(*(self._attempt(dict(row), now) for row in rows))
            after_id = rows[-1]["id"]
            if len(rows) < REDELIVERY_BATCH or not any(taken):
                break
        async with self.sessions() as session:
            waiting, next_at = (
                await session.execute(
                    select(func.count(), func.min(table.c.next_attempt_at)).where(known)
                )
            ).one()
        metrics.OUTBOX_BACKLOG.set(waiting + len(self._unstored))
        if next_at is None:
            return self.idle_poll_s
        return min(self.idle_poll_s, max(0.0, (db.utc(next_at) - utcnow()).total_seconds()))

    async def _attempt(self, row: dict[str, Any], now: datetime.datetime) -> bool:
        """Claim one due call (compare-and-set on its attempt count) and send it; delete it once
        billing took it (returns True) or once it is given up past the horizon."""
        table = _REDELIVERIES
        delay = min(self.first_delay_s * 2 ** (row["attempts"] + 1), self.max_delay_s)
        async with self.sessions() as session, session.begin():
            claimed = await session.execute(
                update(table)
                .where(table.c.id == row["id"], table.c.attempts == row["attempts"])
                .values(
                    attempts=row["attempts"] + 1,
                    next_attempt_at=now + datetime.timedelta(seconds=delay),
                )
            )
        if claimed.rowcount != 1:
            return False  # another replica took this attempt
        taken = True
        try:
            await self._send(row["method"], row["request"])
        except grpc.aio.AioRpcError as failure:
            if (now - db.utc(row["created_at"])).total_seconds() < self.horizon_s:
                metrics.redelivery("failed")
                return False
            metrics.redelivery("given_up")
            self._give_up(row, failure.code().name)
            taken = False
        else:
            metrics.redelivery("sent")
        async with self.sessions() as session, session.begin():
            await session.execute(delete(table).where(table.c.id == row["id"]))
        return taken
