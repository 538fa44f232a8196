"""Billing calls on their way: model calls' usage records and turns' run charges, sent in batches.

A turn's run charge is written in the transaction that persists the turn and sent within
STORED_LINGER_S with the other turns' in one `ChargeBatch` (`RunCharges`, `StoredBatches`).

Every model call's usage is recorded with billing (spec "Persist and charge": token usage is
recorded whether the turn succeeds, fails or is cancelled). One RPC per model call cost
~0.8 ms of CPU across the two processes on the reference machine (docs/performance.md), so
the records of all runs of this process are gathered for at most `window_s` and sent as one
`RecordUsageBatch`. A run's end writes its records still waiting into its own transaction as
a stored call (`billing_redeliveries`, a transactional outbox: `UsageBatcher.take`), so its
terminal event does not wait for billing; the stored records of the runs that end within
STORED_LINGER_S (0.2 s) go to billing in one call, and their rows are then deleted. A lone
turn thereby costs no billing call of its own for its usage (docs/performance.md, seventh
round). The records are idempotent by (run_id, call_index), so a retried batch only
replays. What a crash of this process can lose is bounded by the window plus the RPC in
flight, for the records of runs that have not ended (README "Decisions").

A billing service that is down or stalled longer than the quick retries (`call_with_retries`:
three sends within QUICK_BUDGET_S, 2 s, deadlines included) does not lose a record either: the run goes on and
`Redelivery` stores the call in the orchestrator's database (`billing_redeliveries`) and
sends it again in the background (1 s, doubling to 60 s apart, for up to 7 days), as it does
the tool charges of loop.py. A stored call survives a stop or crash of the process: the next
start (or, on PostgreSQL, another replica) sends it. Only a billing service gone for the
whole 7 days loses it, logged at ERROR with its run and call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from sqlalchemy import delete, func, insert, select, update

from loopline.billing.v1 import billing_pb2
from services.common import db
from services.common.tasks import stop_task
from services.orchestrator.models import BillingRedelivery, utcnow

log = logging.getLogger(__name__)

WINDOW_S = 0.02  # how long a usage record may wait for others before it is sent
MAX_BATCH = 200  # records per RPC at most
ATTEMPTS = 3  # quick sends of a billing call before it is stored (0.1 s, then 0.2 s apart)
QUICK_BUDGET_S = (
    2.0  # how long the quick sends of one billing call may take in all (their deadlines included)
)
CALL_TIMEOUT_S = 5.0  # deadline of a background (stored) billing call
REDELIVERY_BATCH = 20  # stored billing calls sent at once by `Redelivery`
STORED_LINGER_S = (
    0.2  # how long the usage stored with a run's end waits for other runs' before it is sent
)
STORED_GRACE_S = 30.0  # when `Redelivery` sends a run end's stored usage itself (the batcher has not deleted it by then)


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
        `retry` stores (it was STORED_GRACE_S after their end). Never raises (they stay due later)."""
        table = BillingRedelivery.__table__
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
        first = (
            True  # a new process sends what waits at once: billing may be back (fresh-eyes re-test)
        )
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
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a wait that finished in the
            # same loop turn as a cancel and drops the cancel (a stop hung for good: fresh-eyes test)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait_s, 0.0)):
                    await self._wake.wait()

    async def _deliver_due(self, everything: bool = False) -> float:
        """Send the stored calls that are due (with `everything`, all of them: the first pass of a
        process that starts), REDELIVERY_BATCH at a time, each claimed first (one
        replica sends each attempt); a batch of which billing took none ends the pass (billing
        is still down: the rest wait for their next attempt). Calls of methods this process does
        not know (a newer version's) are left to a process that does. Returns the seconds until
        the next call is due (`idle_poll_s` at most)."""
        table = BillingRedelivery.__table__
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
            next_at = await session.scalar(select(func.min(table.c.next_attempt_at)).where(known))
        if next_at is None:
            return self.idle_poll_s
        return min(self.idle_poll_s, max(0.0, (db.utc(next_at) - utcnow()).total_seconds()))

    async def _attempt(self, row: dict[str, Any], now: datetime.datetime) -> bool:
        """Claim one due call (compare-and-set on its attempt count) and send it; delete it once
        billing took it (returns True) or once it is given up past the horizon."""
        table = BillingRedelivery.__table__
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
                return False
            self._give_up(row, failure.code().name)
            taken = False
        async with self.sessions() as session, session.begin():
            await session.execute(delete(table).where(table.c.id == row["id"]))
        return taken


class BatchOrEach:
    """A billing batch RPC with its per-item fallback: against a billing service without the
    batch RPC (UNIMPLEMENTED: an older version during a rolling upgrade), this and every later
    call sends each item with the single RPC instead. `RunCharges` and `UsageBatcher` use one."""

    def __init__(self) -> None:
        self.supported = True

    async def call(
        self, batch: Callable[[], Awaitable[Any]], each: Callable[[], Awaitable[Any]]
    ) -> Any:
        """`await batch()` and return its answer; once billing answered UNIMPLEMENTED, `await
        each()` and return None. Any other grpc.aio.AioRpcError is raised."""
        if self.supported:
            try:
                return await batch()
            except grpc.aio.AioRpcError as failure:
                if failure.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.supported = False
        await each()
        return None


class StoredBatches:
    """Billing calls committed in the orchestrator's own transactions, sent in batches.

    Args:
        method: the batch RPC of the rows (`RecordUsageBatch`, `ChargeBatch`).
        request_of: `request_of(items)`, the batch request of a list of items (protobuf messages).
        items_of: `items_of(request)`, the items of a stored request (the inverse).
        call: `await call(items, timeout)` sends a batch (raises grpc.aio.AioRpcError).
        failure_message / fields_of: logged when billing does not take a batch, once per item
            (`fields_of(items)`: a dict of ids per item).
        redelivery: the `Redelivery` that sends a stored row again (this registers `method` with it).
        forget: `forget(row_ids)` deletes rows once billing took their items
            (`TurnStore.forget_redeliveries`).
        linger_s: seconds committed items wait for others before they are sent (STORED_LINGER_S).

    A transaction that must not wait for billing (a run's end: its usage records; a turn's
    start: its run charge) writes its call as a `billing_redeliveries` row (`row`, first
    background attempt STORED_GRACE_S later: a transactional outbox). Once it is committed,
    `add(row_id, items)` queues the items: they go to billing within `linger_s`, in one call
    with the others committed meanwhile (at once past MAX_BATCH items), and their rows are then
    deleted. When billing does not take them (quick retries: `Redelivery.send_or_store`), a
    WARNING per item, and the rows stay for `Redelivery`. A crash loses none of them: the next
    start, or another replica after STORED_GRACE_S, sends what is stored.
    """

    def __init__(
        self,
        method: str,
        request_of: Callable[[list[Any]], Any],
        items_of: Callable[[Any], list[Any]],
        call: Callable[[list[Any], float], Awaitable[Any]],
        failure_message: str,
        fields_of: Callable[[list[Any]], list[dict[str, Any]]],
        redelivery: Redelivery,
        forget: Callable[[list[str]], Awaitable[Any]],
        linger_s: float = STORED_LINGER_S,
    ) -> None:
        self.method = method
        self.request_of = request_of
        self.call = call
        self.failure_message = failure_message
        self.fields_of = fields_of
        self.redelivery = redelivery
        self.forget = forget
        self.linger_s = linger_s
        redelivery.register(method, lambda data: call(items_of(data), CALL_TIMEOUT_S))
        self._stored: list[tuple[str, list[Any]]] = []  # (row id, items) committed, not sent yet
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()

    def row(self, items: list[Any]) -> dict[str, Any]:
        """The `billing_redeliveries` row (`Redelivery.row`) that stores `items` as one call, its
        first background attempt STORED_GRACE_S from now, for a transaction to write."""
        return Redelivery.row(
            self.method,
            self.request_of(items),
            self.failure_message,
            self.fields_of(items),
            STORED_GRACE_S,
        )

    def add(self, row_id: str, items: list[Any]) -> None:
        """Row `row_id` (`row(items)`) is committed: send its items within `linger_s` with the
        others committed meanwhile (at once past MAX_BATCH), then delete their rows."""
        self._stored.append((row_id, items))
        self._count += len(items)
        if self._count >= MAX_BATCH:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self.flush)

    def flush(self) -> None:
        """Send every committed row's items now (a call per MAX_BATCH items or so)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        rows: list[tuple[str, list[Any]]] = []
        count = 0
        for row in self._stored:
            rows.append(row)
            count += len(row[1])
            if count >= MAX_BATCH:
                _spawn(self._sending, self._send(rows), self.method)
                rows, count = [], 0
        if rows:
            _spawn(self._sending, self._send(rows), self.method)
        self._stored, self._count = [], 0

    async def close(self) -> None:
        """Send what is committed and wait for every send in flight (shutdown)."""
        self.flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    async def _send(self, rows: list[tuple[str, list[Any]]]) -> None:
        items = [item for _, row_items in rows for item in row_items]
        if not await self.redelivery.send_or_store(
            self.method,
            self.request_of(items),
            lambda timeout: self.call(items, timeout),
            self.failure_message,
            self.fields_of(items),
            stored=[row_id for row_id, _ in rows],
        ):
            return
        try:
            await self.forget([row_id for row_id, _ in rows])
        except Exception as error:  # noqa: BLE001 - the rows stay: Redelivery sends them again, billing replays them
            log.warning(
                "deleting sent billing calls failed; they will be sent again (billing replays them)",
                extra={
                    "fields": {
                        "method": self.method,
                        "items": len(items),
                        "error": type(error).__name__,
                    }
                },
            )


def _spawn(tasks: set[asyncio.Task], send: Awaitable[None], name: str) -> None:
    """Run `send` as a task kept in `tasks` until it ends, in a fresh context: a batch holds
    calls of several runs, so it must not log with the run (chat, organization) bound in the
    context of the one that happened to flush it."""
    task = asyncio.get_running_loop().create_task(send, name=name, context=contextvars.Context())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


class RunCharges:
    """The run charge of each turn, stored with the turn and sent in `ChargeBatch` calls.

    Spec "Persist and charge": the turn start commits its chat, message and run, and charges
    one run credit. The charge is written in the same transaction as those rows (`row`: a
    `billing_redeliveries` row, see `StoredBatches`), so a persisted turn is never left
    uncharged and the turn start does not wait for a Charge call: the charges of the turns
    started within STORED_LINGER_S go to billing in one ChargeBatch (docs/performance.md,
    ninth round). The hold set aside by Admit covers the credit meanwhile. Billing charges a
    hold that expired before its charge came (billing or this process away longer than the
    hold) late, and answers a released or unknown reservation in its result: logged at ERROR
    here (a committed turn that could not be charged), its row deleted. Against a billing
    service without ChargeBatch (UNIMPLEMENTED: an older version during a rolling upgrade)
    each charge is sent with Charge instead.

    Args:
        billing: BillingService stub.
        redelivery / forget / linger_s: as for `StoredBatches`.
    """

    def __init__(
        self,
        billing: Any,
        redelivery: Redelivery,
        forget: Callable[[list[str]], Awaitable[Any]],
        linger_s: float = STORED_LINGER_S,
    ) -> None:
        self.billing = billing
        self._batch = BatchOrEach()
        self.stored = StoredBatches(
            "ChargeBatch",
            lambda charges: billing_pb2.ChargeBatchRequest(charges=charges),
            lambda data: list(billing_pb2.ChargeBatchRequest.FromString(data).charges),
            self._call,
            "charging a turn failed",
            lambda charges: [{"reservation_id": charge.reservation_id} for charge in charges],
            redelivery,
            forget,
            linger_s,
        )

    def row(self, reservation_id: str) -> dict[str, Any]:
        """The `billing_redeliveries` row of the charge of `reservation_id`, for the turn start's transaction."""
        return self.stored.row([billing_pb2.ChargeRequest(reservation_id=reservation_id)])

    def committed(self, row_id: str, reservation_id: str) -> None:
        """The turn start that wrote row `row_id` (`row(reservation_id)`) is committed: send its
        charge within the linger, with the others committed meanwhile."""
        self.stored.add(row_id, [billing_pb2.ChargeRequest(reservation_id=reservation_id)])

    async def close(self) -> None:
        """Send the charges committed and wait for them (shutdown; unsent ones stay stored)."""
        await self.stored.close()

    async def _call(
        self, charges: list[billing_pb2.ChargeRequest], timeout: float = CALL_TIMEOUT_S
    ) -> None:
        response = await self._batch.call(
            lambda: self.billing.ChargeBatch(
                billing_pb2.ChargeBatchRequest(charges=charges), timeout=timeout
            ),
            lambda: asyncio.gather(*(self._charge_one(charge, timeout) for charge in charges)),
        )
        for charge, result in zip(
            charges, response.results if response is not None else (), strict=False
        ):
            if result.state != billing_pb2.RESERVATION_STATE_CHARGED:
                _charge_refused(
                    charge.reservation_id, billing_pb2.ReservationState.Name(result.state)
                )

    async def _charge_one(self, charge: billing_pb2.ChargeRequest, timeout: float) -> None:
        try:
            await self.billing.Charge(charge, timeout=timeout)
        except grpc.aio.AioRpcError as failure:
            if failure.code() not in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                raise
            _charge_refused(charge.reservation_id, failure.code().name)


def _charge_refused(reservation_id: str, state: str) -> None:
    """A committed turn's charge that billing refused for good: ERROR (the credit is not posted)."""
    log.error(
        "billing refused a started turn's run charge; the turn is not charged",
        extra={"fields": {"reservation_id": reservation_id, "state": state}},
    )


class UsageBatcher:
    """Collects RecordUsage requests and sends them to billing in `RecordUsageBatch` calls.

    Args:
        billing: BillingService stub.
        window_s: seconds the first waiting record waits for others (0: send at once).
        redelivery: where a batch that failed its quick retries is stored (`Redelivery`; the
            batcher registers how a stored `RecordUsageBatch` is sent).
        forget: `forget(row_ids)` deletes `billing_redeliveries` rows once billing took their
            records (`TurnStore.forget_redeliveries`); None: `take` hands nothing over.
        linger_s: seconds the records stored with a run's end wait for other runs' before they
            are sent (STORED_LINGER_S).

    `add` returns a future that is done when the record was sent, or when its quick retries
    failed and it was stored by `redelivery` (logged at WARNING with the run and call index;
    never raised), so that a run never waits for a billing outage. Sends are
    shielded from the callers' cancellation. Against a billing service without
    RecordUsageBatch (UNIMPLEMENTED: an older version during a rolling upgrade) each record
    is sent with RecordUsage instead.

    A run's end takes its records still waiting (`take`) and writes them as a stored
    `RecordUsageBatch` call in the transaction that records the end (a transactional outbox:
    `StoredBatches`); once that is committed, `stored` queues them: they go to billing within
    `linger_s`, in one call with the other runs' that ended meanwhile, and their rows are then
    deleted. The run's terminal event does not wait for billing, and a crash loses none of them.
    """

    def __init__(
        self,
        billing: Any,
        redelivery: Redelivery,
        window_s: float = WINDOW_S,
        forget: Callable[[list[str]], Awaitable[Any]] | None = None,
        linger_s: float = STORED_LINGER_S,
    ) -> None:
        self.billing = billing
        self.window_s = window_s
        self.redelivery = redelivery
        self.forget = forget
        self._waiting: list[tuple[billing_pb2.RecordUsageRequest, asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._stored = StoredBatches(
            "RecordUsageBatch",
            lambda requests: billing_pb2.RecordUsageBatchRequest(calls=requests),
            lambda data: list(billing_pb2.RecordUsageBatchRequest.FromString(data).calls),
            self._call,
            "recording usage failed",
            _usage_fields,
            redelivery,
            forget or _forget_nothing,
            linger_s,
        )
        self._sending: set[asyncio.Task] = set()
        self._batch = BatchOrEach()

    def add(self, request: billing_pb2.RecordUsageRequest) -> asyncio.Future[None]:
        """Queue one model call's usage; the future is done once it has been sent."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._waiting.append((request, done))
        if len(self._waiting) >= MAX_BATCH:
            self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self.flush)
        return done

    def flush(self) -> None:
        """Send every waiting record now (one batch per MAX_BATCH records)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            _spawn(self._sending, self._send(batch), "usage-batch")

    def take(
        self, run_id: str
    ) -> tuple[list[billing_pb2.RecordUsageRequest], dict[str, Any]] | None:
        """Hand the records of `run_id` still waiting over to the run's end: returns them and the
        `billing_redeliveries` row (`StoredBatches.row`, first background attempt STORED_GRACE_S
        later) to write in the end's transaction, or None when none waits (or no `forget`).
        Their futures are done at once. After the transaction: `stored` (committed) or
        `give_back` (failed)."""
        if self.forget is None or not any(request.run_id == run_id for request, _ in self._waiting):
            return None
        mine = [item for item in self._waiting if item[0].run_id == run_id]
        self._waiting = [item for item in self._waiting if item[0].run_id != run_id]
        if not self._waiting and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, done in mine:
            if not done.done():
                done.set_result(None)
        requests = [request for request, _ in mine]
        return requests, self._stored.row(requests)

    def give_back(self, requests: list[billing_pb2.RecordUsageRequest]) -> None:
        """Records `take` handed over whose transaction failed: sent now, as `add` + `flush` would."""
        for request in requests:
            self.add(request)
        self.flush()

    def stored(self, row_id: str, requests: list[billing_pb2.RecordUsageRequest]) -> None:
        """The records of row `row_id` (`take`) are committed: send them within `linger_s`
        with the others stored meanwhile (at once past MAX_BATCH), then delete their rows."""
        self._stored.add(row_id, requests)

    def flush_stored(self) -> None:
        """Send every stored run end's records now (a call per MAX_BATCH records or so)."""
        self._stored.flush()

    async def close(self) -> None:
        """Send what is waiting, wait for every send in flight, then close the redelivery
        (shutdown; what it stored stays for the next start). Close `RunCharges` first."""
        self.flush()
        await self._stored.close()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self.redelivery.close()

    async def _send(
        self, batch: list[tuple[billing_pb2.RecordUsageRequest, asyncio.Future[None]]]
    ) -> None:
        requests = [request for request, _ in batch]
        try:
            await self.redelivery.send_or_store(
                "RecordUsageBatch",
                billing_pb2.RecordUsageBatchRequest(calls=requests),
                lambda timeout: self._call(requests, timeout),
                "recording usage failed",
                _usage_fields(requests),
            )
        finally:
            for _, done in batch:
                if not done.done():
                    done.set_result(None)

    async def _call(
        self, requests: list[billing_pb2.RecordUsageRequest], timeout: float = CALL_TIMEOUT_S
    ) -> None:
        await self._batch.call(
            lambda: self.billing.RecordUsageBatch(
                billing_pb2.RecordUsageBatchRequest(calls=requests), timeout=timeout
            ),
            lambda: asyncio.gather(
                *(self.billing.RecordUsage(request, timeout=timeout) for request in requests)
            ),
        )


async def _forget_nothing(row_ids: list[str]) -> None:
    """`forget` of a batcher that stores nothing itself (`UsageBatcher` without `forget`)."""


def _usage_fields(requests: list[billing_pb2.RecordUsageRequest]) -> list[dict[str, Any]]:
    """The ids logged for each usage record of a failed or given-up call."""
    return [
        {"run_id": request.run_id, "chat_id": request.chat_id, "call_index": request.call_index}
        for request in requests
    ]
