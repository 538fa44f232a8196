"""Billing calls sent in batches: each model call's usage record (`UsageBatcher`) and each
turn's run charge (`RunCharges`), both written into the orchestrator's own transactions first
when the caller must not wait for billing (`StoredBatches`, a transactional outbox).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2
from services.orchestrator.usage.redelivery import (
    CALL_TIMEOUT_S,
    STORED_GRACE_S,
    Redelivery,
)

log = logging.getLogger(__name__)

WINDOW_S = 0.02  # how long a usage record may wait for others before it is sent
MAX_BATCH = 200  # records per RPC at most
# how long the usage stored with a run's end waits for other runs' before it is sent
STORED_LINGER_S = 0.2


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
        redelivery: the `Redelivery` that sends a stored row again (`method` is registered
            with it).
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
        except Exception as error:  # noqa: BLE001 - the rows stay: Redelivery sends them again
            log.warning(
                "deleting sent billing calls failed; they will be sent again "
                "(billing replays them)",
                extra={
                    "fields": {
                        "method": self.method,
                        "items": len(items),
                        "error": type(error).__name__,
                    }
                },
            )


def _spawn(tasks: set[asyncio.Task[None]], send: Coroutine[Any, Any, None], name: str) -> None:
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
        """The `billing_redeliveries` row of the charge of `reservation_id`, for the turn
        start's transaction."""
        return self.stored.row([billing_pb2.ChargeRequest(reservation_id=reservation_id)])

    def committed(self, row_id: str, reservation_id: str) -> None:
        """The turn start that wrote row `row_id` (`row(reservation_id)`) is committed: send its
        charge within the linger, with the others committed meanwhile."""
        self.stored.add(row_id, [billing_pb2.ChargeRequest(reservation_id=reservation_id)])

    async def close(self) -> None:
        """Send the charges committed and wait for them (shutdown; unsent ones stay stored)."""
        await self.stored.close()

    async def _call(
        self, charges: list[billing_pb2.ChargeRequest], deadline_s: float = CALL_TIMEOUT_S
    ) -> None:
        response = await self._batch.call(
            lambda: self.billing.ChargeBatch(
                billing_pb2.ChargeBatchRequest(charges=charges), timeout=deadline_s
            ),
            lambda: asyncio.gather(*(self._charge_one(charge, deadline_s) for charge in charges)),
        )
        for charge, result in zip(
            charges, response.results if response is not None else (), strict=False
        ):
            if result.state != billing_pb2.RESERVATION_STATE_CHARGED:
                _charge_refused(
                    charge.reservation_id, billing_pb2.ReservationState.Name(result.state)
                )

    async def _charge_one(self, charge: billing_pb2.ChargeRequest, deadline_s: float) -> None:
        try:
            await self.billing.Charge(charge, timeout=deadline_s)
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
        """Records `take` handed over whose transaction failed: sent now, as `add` + `flush`
        would."""
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
        self, requests: list[billing_pb2.RecordUsageRequest], deadline_s: float = CALL_TIMEOUT_S
    ) -> None:
        await self._batch.call(
            lambda: self.billing.RecordUsageBatch(
                billing_pb2.RecordUsageBatchRequest(calls=requests), timeout=deadline_s
            ),
            lambda: asyncio.gather(
                *(self.billing.RecordUsage(request, timeout=deadline_s) for request in requests)
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
