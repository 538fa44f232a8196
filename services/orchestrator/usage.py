"""Token usage on its way to billing: model calls' usage records, sent in batches.

Every model call's usage is recorded with billing (spec "Persist and charge": token usage is
recorded whether the turn succeeds, fails or is cancelled). One RPC per model call cost
~0.8 ms of CPU across the two processes on the reference machine (docs/performance.md), so
the records of all runs of this process are gathered for at most `window_s` and sent as one
`RecordUsageBatch`; a run's end sends what is waiting at once (`flush`) and waits for its own
records before its terminal event. The records are idempotent by (run_id, call_index), so a
retried batch only replays. What a crash of this process can lose is bounded by the window
plus the RPC in flight (README "Decisions").

A billing service that is down or stalled longer than the quick retries (`call_with_retries`,
~0.3 s plus the calls' 5 s deadlines) does not lose a record either: the run goes on and
`Redelivery` keeps sending it in the background (1 s, doubling to 30 s apart, for up to an
hour), as it does the tool charges of loop.py. Only a process stopped meanwhile (one last
attempt at shutdown) or a billing service gone for the whole hour loses it, logged at ERROR
with its run and call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2

log = logging.getLogger(__name__)

WINDOW_S = 0.02  # how long a usage record may wait for others before it is sent
MAX_BATCH = 200  # records per RPC at most
ATTEMPTS = 3  # sends of a batch before its failure is logged (0.1 s, then 0.2 s apart)


async def call_with_retries(call: Callable[[], Awaitable[Any]]) -> grpc.aio.AioRpcError | None:
    """Await `call()` (an idempotent billing RPC) up to ATTEMPTS times, 0.1 s then 0.2 s apart,
    while it fails with AioRpcError; returns None once it succeeds, else the last failure."""
    for attempt in range(ATTEMPTS):
        try:
            await call()
            return None
        except grpc.aio.AioRpcError as failure:
            if attempt == ATTEMPTS - 1:
                return failure
            await asyncio.sleep(0.1 * (attempt + 1))
    return None


class Redelivery:
    """Sends idempotent billing calls that failed their quick retries again, in the background,
    until billing takes them.

    Args:
        first_delay_s / max_delay_s: the wait before the first background attempt, doubled after
            each failure up to `max_delay_s` (1 s, 30 s).
        horizon_s: how long a call is retried (3,600 s); past it, it is lost and logged.

    `retry(call, lost)` schedules `call()` (an awaitable factory whose RPC raises
    grpc.aio.AioRpcError on failure); `lost(failure)` is called once when it is given up (the
    caller logs it with its ids). `close()` (shutdown) stops the waits and makes one last
    attempt for every call still pending. Never raises.
    """

    def __init__(self, first_delay_s: float = 1.0, max_delay_s: float = 30.0, horizon_s: float = 3600.0) -> None:
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.horizon_s = horizon_s
        self._pending: dict[asyncio.Task, tuple[Callable[[], Awaitable[Any]], Callable[[grpc.aio.AioRpcError], None]]] = {}

    @property
    def pending(self) -> int:
        """Calls waiting to be sent again."""
        return len(self._pending)

    def retry(self, call: Callable[[], Awaitable[Any]], lost: Callable[[grpc.aio.AioRpcError], None]) -> None:
        """Schedule `call` to be sent again in the background (see the class docstring)."""
        task = asyncio.get_running_loop().create_task(self._redeliver(call, lost), name="billing-redelivery")
        self._pending[task] = (call, lost)
        task.add_done_callback(lambda done: self._pending.pop(done, None))

    async def _redeliver(self, call: Callable[[], Awaitable[Any]], lost: Callable[[grpc.aio.AioRpcError], None]) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.horizon_s
        delay = self.first_delay_s
        while True:
            await asyncio.sleep(delay)
            try:
                await call()
                return
            except grpc.aio.AioRpcError as failure:
                if loop.time() + delay >= give_up_at:
                    lost(failure)
                    return
            delay = min(delay * 2, self.max_delay_s)

    async def close(self) -> None:
        """Stop waiting and make one last attempt for each pending call; `lost` for those that fail."""
        pending = list(self._pending.items())
        for task, _ in pending:
            task.cancel()
        await asyncio.gather(*(task for task, _ in pending), return_exceptions=True)

        async def last(call: Callable[[], Awaitable[Any]], lost: Callable[[grpc.aio.AioRpcError], None]) -> None:
            try:
                await call()
            except grpc.aio.AioRpcError as failure:
                lost(failure)

        await asyncio.gather(*(last(call, lost) for _, (call, lost) in pending), return_exceptions=True)


class UsageBatcher:
    """Collects RecordUsage requests and sends them to billing in `RecordUsageBatch` calls.

    Args:
        billing: BillingService stub.
        window_s: seconds the first waiting record waits for others (0: send at once).
        redelivery: where a batch that failed its quick retries goes (a new `Redelivery` when None).

    `add` returns a future that is done when the record was sent, or when its quick retries
    failed and it was handed to `redelivery` (logged at WARNING with the run and call index;
    never raised), so that a run never waits for a billing outage. Sends are
    shielded from the callers' cancellation. Against a billing service without
    RecordUsageBatch (UNIMPLEMENTED: an older version during a rolling upgrade) each record
    is sent with RecordUsage instead.
    """

    def __init__(self, billing: Any, window_s: float = WINDOW_S, redelivery: Redelivery | None = None) -> None:
        self.billing = billing
        self.window_s = window_s
        self.redelivery = redelivery if redelivery is not None else Redelivery()
        self._waiting: list[tuple[billing_pb2.RecordUsageRequest, asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()
        self._batch_supported = True

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
            task = asyncio.get_running_loop().create_task(self._send(batch), name="usage-batch")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def close(self) -> None:
        """Send what is waiting, wait for every send in flight, then close the redelivery (one
        last attempt for what billing has not taken yet; shutdown)."""
        self.flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self.redelivery.close()

    async def _send(self, batch: list[tuple[billing_pb2.RecordUsageRequest, asyncio.Future[None]]]) -> None:
        requests = [request for request, _ in batch]
        try:
            failure = await call_with_retries(lambda: self._call(requests))
            if failure is not None:
                for request in requests:
                    log.warning("recording usage failed; retrying in the background", extra={"fields": {
                        "code": failure.code().name, "run_id": request.run_id, "call_index": request.call_index}})

                def lost(last: grpc.aio.AioRpcError) -> None:
                    for request in requests:
                        log.error("recording usage failed", extra={"fields": {
                            "code": last.code().name, "run_id": request.run_id, "call_index": request.call_index}})

                self.redelivery.retry(lambda: self._call(requests), lost)
        finally:
            for _, done in batch:
                if not done.done():
                    done.set_result(None)

    async def _call(self, requests: list[billing_pb2.RecordUsageRequest]) -> None:
        if self._batch_supported:
            try:
                await self.billing.RecordUsageBatch(billing_pb2.RecordUsageBatchRequest(calls=requests), timeout=5)
                return
            except grpc.aio.AioRpcError as failure:
                if failure.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._batch_supported = False
        await asyncio.gather(*(self.billing.RecordUsage(request, timeout=5) for request in requests))
