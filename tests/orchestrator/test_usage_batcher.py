"""services/orchestrator/usage/: model calls' usage goes to billing in batches, nothing lost."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import grpc
import pytest

from loopline.billing.v1 import billing_pb2
from services.common import db
from services.orchestrator.loop import TurnRunner
from services.orchestrator.models import utcnow
from services.orchestrator.usage.batches import UsageBatcher
from services.orchestrator.usage.redelivery import Redelivery
from tests.conftest import postgres_databases, release_databases, selected_backend
from tests.log_records import fields_of


class _Failure(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


class FakeBilling:
    def __init__(self, batch_code: grpc.StatusCode | None = None, failures: int = 0) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.singles: list[tuple[str, int]] = []
        self.batch_code = batch_code
        self.failures = failures

    async def RecordUsageBatch(self, request, timeout=None):  # noqa: N802 - stub method name
        if self.batch_code is not None:
            raise _Failure(self.batch_code)
        if self.failures:
            self.failures -= 1
            raise _Failure(grpc.StatusCode.UNAVAILABLE)
        self.batches.append([(c.run_id, c.call_index) for c in request.calls])
        return billing_pb2.RecordUsageBatchResponse()

    async def RecordUsage(self, request, timeout=None):  # noqa: N802 - stub method name
        self.singles.append((request.run_id, request.call_index))
        return billing_pb2.RecordUsageResponse()


@pytest.fixture
async def sessions(tmp_path):
    """A session factory of a fresh, migrated orchestrator database of the backend under test."""
    urls = None
    if selected_backend() == "postgres":
        urls = await postgres_databases()
        url = urls["orchestrator"]
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
        await db.migrate_async("orchestrator", url)
    engine = db.make_engine(url)
    yield db.sessionmaker(engine)
    await engine.dispose()
    if urls is not None:
        release_databases(list(urls.values()))


def _fast(sessions, **overrides: float) -> Redelivery:
    """A Redelivery with short waits for a test (1 s doubling to 60 s in production)."""
    return Redelivery(
        sessions, **{"first_delay_s": 0.01, "max_delay_s": 0.02, "idle_poll_s": 0.05, **overrides}
    )


async def _until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _usage(run_id: str, index: int) -> billing_pb2.RecordUsageRequest:
    return billing_pb2.RecordUsageRequest(
        organization_id="org", run_id=run_id, call_index=index, input_tokens=1
    )


async def test_records_within_the_window_go_in_one_batch_and_flush_sends_at_once(sessions):
    billing = FakeBilling()
    batcher = UsageBatcher(billing, Redelivery(sessions), window_s=0.05)
    waits = [batcher.add(_usage("a", 0)), batcher.add(_usage("b", 0))]
    await asyncio.sleep(0.01)
    assert billing.batches == []  # still inside the window
    waits.append(batcher.add(_usage("a", 1)))
    batcher.flush()  # a run's end does not wait for the window
    await asyncio.wait_for(asyncio.gather(*waits), 1)
    assert billing.batches == [[("a", 0), ("b", 0), ("a", 1)]]
    late = batcher.add(_usage("c", 0))
    await asyncio.wait_for(late, 1)  # the window alone sends it too
    assert billing.batches[-1] == [("c", 0)]


async def test_an_older_billing_without_the_batch_rpc_gets_single_calls(sessions):
    billing = FakeBilling(batch_code=grpc.StatusCode.UNIMPLEMENTED)
    batcher = UsageBatcher(billing, Redelivery(sessions), window_s=0)
    await asyncio.wait_for(
        asyncio.gather(batcher.add(_usage("a", 0)), batcher.add(_usage("a", 1))), 1
    )
    assert sorted(billing.singles) == [("a", 0), ("a", 1)]


async def test_a_failed_send_is_retried_and_a_last_failure_stored_not_raised(
    sessions, caplog: pytest.LogCaptureFixture
):
    billing = FakeBilling(failures=1)
    batcher = UsageBatcher(billing, Redelivery(sessions), window_s=0)
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 2)
    assert billing.batches == [[("a", 0)]]  # the retry went through
    billing.failures = 5
    await asyncio.wait_for(batcher.add(_usage("b", 0)), 3)
    assert any(
        r.getMessage() == "recording usage failed; retrying in the background"
        for r in caplog.records
    )
    assert await batcher.redelivery.pending() == 1
    await batcher.close()


async def test_a_billing_outage_longer_than_the_quick_retries_loses_no_record(
    sessions, caplog: pytest.LogCaptureFixture
):
    """Billing stalled ~25 s during a run, longer than the 3 quick attempts: the run is not held
    up, and the records are sent again in the background until billing takes them (not dropped
    with an ERROR line)."""
    billing = FakeBilling(failures=6)  # more than the 3 quick attempts
    batcher = UsageBatcher(billing, _fast(sessions), window_s=0)
    batcher.redelivery.start()
    await asyncio.wait_for(
        batcher.add(_usage("a", 0)), 3
    )  # the run goes on after the quick retries
    assert any("retrying in the background" in r.getMessage() for r in caplog.records)

    async def delivered() -> bool:
        return await batcher.redelivery.pending() == 0

    await _until(delivered)
    assert billing.batches == [[("a", 0)]]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    await batcher.close()


async def test_a_record_billing_has_not_taken_survives_a_stop_and_the_next_start_sends_it(
    sessions, caplog: pytest.LogCaptureFixture
):
    """A record billing has not taken is stored in the orchestrator's database, so an
    orchestrator stopped (or crashed) while billing is down loses nothing, logs no ERROR, and
    the next process on the same database sends the record at once."""
    billing = FakeBilling(failures=100)
    batcher = UsageBatcher(billing, _fast(sessions, first_delay_s=60), window_s=0)
    batcher.redelivery.start()
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 3)
    await asyncio.wait_for(
        batcher.close(), 3
    )  # stopped while billing is still down, its next attempt a minute away
    assert billing.batches == [] and not [r for r in caplog.records if r.levelname == "ERROR"]
    billing.failures = 0
    # a new process on the same database
    restarted = UsageBatcher(billing, _fast(sessions), window_s=0)
    assert await restarted.redelivery.pending() == 1
    restarted.redelivery.start()  # sends at once, not when the stopped process had scheduled it

    async def delivered() -> bool:
        return await restarted.redelivery.pending() == 0

    await _until(delivered, timeout=3)
    assert billing.batches == [[("a", 0)]]
    await restarted.close()


async def test_a_call_past_the_horizon_is_given_up_with_its_ids_at_error(
    sessions, caplog: pytest.LogCaptureFixture
):
    billing = FakeBilling(failures=1000)
    batcher = UsageBatcher(billing, _fast(sessions, horizon_s=0.05), window_s=0)
    batcher.redelivery.start()
    await asyncio.wait_for(batcher.add(_usage("b", 3)), 3)

    async def given_up() -> bool:
        return await batcher.redelivery.pending() == 0

    await _until(given_up)
    lost = [
        r
        for r in caplog.records
        if r.levelname == "ERROR" and r.getMessage() == "recording usage failed"
    ]
    assert (
        len(lost) == 1
        and fields_of(lost[0])["run_id"] == "b"
        and fields_of(lost[0])["call_index"] == 3
    )
    assert fields_of(lost[0])["code"] == "UNAVAILABLE"
    await batcher.close()


async def test_two_replicas_on_one_database_send_each_attempt_once(sessions):
    billing = FakeBilling(failures=3)
    first = UsageBatcher(billing, _fast(sessions, first_delay_s=0.2), window_s=0)
    await asyncio.wait_for(first.add(_usage("a", 0)), 3)  # stored, due in 0.2 s
    second = UsageBatcher(billing, _fast(sessions, first_delay_s=0.2), window_s=0)
    await asyncio.sleep(0.25)
    await asyncio.gather(first.redelivery._deliver_due(), second.redelivery._deliver_due())
    assert billing.batches == [[("a", 0)]] and await first.redelivery.pending() == 0


async def test_a_call_of_a_method_this_version_does_not_know_is_left_for_one_that_does(
    sessions, caplog: pytest.LogCaptureFixture
):
    newer = _fast(
        sessions, first_delay_s=0, horizon_s=0
    )  # a newer version stored a call of a new method
    await newer.retry(
        "RecordSomethingNew", _usage("n", 0), "recording something failed", [{"run_id": "n"}]
    )
    older = _fast(sessions, horizon_s=0)
    older.register("RecordUsageBatch", FakeBilling().RecordUsageBatch)
    assert (
        await older._deliver_due() == older.idle_poll_s
    )  # nothing it can send, and nothing given up
    assert await older.pending() == 1 and not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_call_the_database_could_not_store_is_kept_in_memory_then_stored(
    sessions, caplog: pytest.LogCaptureFixture
):
    down = True

    def flaky_sessions():
        if down:
            raise OSError("database unavailable")
        return sessions()

    billing = FakeBilling(failures=3)
    batcher = UsageBatcher(billing, _fast(flaky_sessions), window_s=0)
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 3)
    assert any(
        r.getMessage() == "storing billing calls to send again failed; kept in memory"
        for r in caplog.records
    )
    down = False
    batcher.redelivery.start()

    async def delivered() -> bool:
        return billing.batches == [[("a", 0)]] and await batcher.redelivery.pending() == 0

    await _until(delivered)
    down = True
    billing.failures = 5
    await asyncio.wait_for(batcher.add(_usage("c", 1)), 3)
    await asyncio.wait_for(
        batcher.close(), 3
    )  # neither stored nor taken at the last attempt: ERROR
    lost = [
        r
        for r in caplog.records
        if r.levelname == "ERROR" and r.getMessage() == "recording usage failed"
    ]
    assert [(fields_of(r)["run_id"], fields_of(r)["call_index"]) for r in lost] == [("c", 1)]


async def test_a_tool_charge_billing_refused_is_sent_again_in_the_background(sessions):
    calls: list[str] = []

    async def record_tool_usage(request, timeout=None):
        calls.append(request.tool_call_id)
        if len(calls) <= 4:
            raise _Failure(grpc.StatusCode.UNAVAILABLE)
        return billing_pb2.RecordToolUsageResponse()

    billing = SimpleNamespace(RecordToolUsage=record_tool_usage)
    redelivery = _fast(sessions)
    redelivery.register(
        "RecordToolUsage",
        lambda data: record_tool_usage(billing_pb2.RecordToolUsageRequest.FromString(data)),
    )
    runner = SimpleNamespace(billing=billing, redelivery=redelivery)
    request = billing_pb2.RecordToolUsageRequest(
        organization_id="org", run_id="r", tool_call_id="t1", millicredits=5
    )
    await TurnRunner._send_to_billing(
        cast(TurnRunner, runner),  # a stand-in: the method uses only `billing` and `redelivery`
        "RecordToolUsage",
        request,
        "recording tool usage failed",
        tool_call_id="t1",
    )
    assert calls == ["t1"] * 3 and await redelivery.pending() == 1
    redelivery.start()

    async def delivered() -> bool:
        return await redelivery.pending() == 0

    await _until(delivered)
    assert calls == ["t1"] * 5
    await redelivery.close()


async def test_a_batch_of_several_runs_logs_each_record_with_its_own_ids(sessions):
    """A failed batch holding records of several runs logs each record with its own run's
    chat and organization, not those of the run whose context flushed the batch."""
    import io
    import json
    import logging

    from services.common import logging as loopline_logging

    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(loopline_logging.JsonFormatter("orchestrator"))
    logger = logging.getLogger("services.orchestrator.usage")
    logger.addHandler(handler)
    try:
        billing = FakeBilling(failures=10)
        batcher = UsageBatcher(billing, Redelivery(sessions), window_s=0.05)

        async def run(name: str) -> asyncio.Future:
            loopline_logging.bind_task(
                run_id=f"run-{name}", chat_id=f"chat-{name}", org_id=f"org-{name}"
            )
            request = _usage(f"run-{name}", 0)
            request.chat_id = f"chat-{name}"
            return batcher.add(request)

        waits = [await asyncio.create_task(run("one")), await asyncio.create_task(run("two"))]
        await asyncio.wait_for(asyncio.gather(*waits), 5)
    finally:
        logger.removeHandler(handler)
    warned = [
        json.loads(line)
        for line in lines.getvalue().splitlines()
        if "retrying in the background" in line
    ]
    assert sorted((w["run_id"], w["chat_id"], w.get("org_id")) for w in warned) == [
        ("run-one", "chat-one", None),
        ("run-two", "chat-two", None),
    ]


# ------------------------------------------------------- a run's end stores its usage (outbox)


async def _stored_rows(sessions) -> list[str]:
    from sqlalchemy import select

    from services.orchestrator.models import BillingRedelivery

    async with sessions() as session:
        return list((await session.execute(select(BillingRedelivery.method))).scalars())


async def _running_run(store, run_id: str) -> None:
    """The chat and running run rows a run's end updates (what a turn start wrote)."""
    from services.orchestrator.store import ThreadRow

    now = utcnow()
    chat_id = f"chat-{run_id}"
    chat = {
        "id": chat_id,
        "organization_id": "org",
        "user_id": "u",
        "kind": "assistant",
        "title": "t",
        "workflow_id": None,
        "running_id": run_id,
        "deleted_at": None,
        "created_at": now,
        "updated_at": now,
    }
    run = {
        "id": run_id,
        "durable_id": f"run_{run_id}",
        "chat_id": chat_id,
        "organization_id": "org",
        "parent_run_id": None,
        "status": "running",
        "llm": {"provider_id": "p"},
        "reservation_id": None,
        "usage": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "lease_until": now,
    }
    await store.persist_turn(
        claim=False,
        chat=chat,
        message=ThreadRow(role="user", content="hi", chat_id=chat_id, run_id=run_id),
        run=run,
    )


async def _end_run(store, batcher: UsageBatcher, run_id: str) -> None:
    """What `TurnRunner._finish` does with the run's waiting records: take them, store them
    with the end, queue them."""
    from services.orchestrator.store import RunEnd

    handed = batcher.take(run_id)
    assert handed is not None
    await _running_run(
        store, run_id
    )  # a run's end is stored only while it is running (store.RunTakenOver)
    await store.finish(
        RunEnd(
            run_id=run_id,
            chat_id=f"chat-{run_id}",
            status="completed",
            error=None,
            usage={},
            rows=[],
            billing_calls=[handed[1]],
        )
    )
    batcher.stored(handed[1]["id"], handed[0])


@pytest.fixture
async def store(sessions):
    from services.orchestrator.store import TurnStore

    turn_store = TurnStore(sessions.kw["bind"])
    yield turn_store
    turn_store.close()


async def test_runs_ending_within_the_linger_send_their_usage_in_one_call_and_leave_nothing_stored(
    sessions, store
):
    """A run's end does not wait for its own RecordUsageBatch (docs/performance.md); its
    records are stored in the end's transaction and sent with the records of the other runs
    that end within the linger, then their rows are deleted."""
    billing = FakeBilling()
    batcher = UsageBatcher(
        billing, Redelivery(sessions), window_s=5, forget=store.forget_redeliveries, linger_s=0.2
    )
    waits = []
    for run_id in ("r1", "r2", "r3"):
        waits += [batcher.add(_usage(run_id, 0)), batcher.add(_usage(run_id, 1))]
        await _end_run(store, batcher, run_id)
        assert all(wait.done() for wait in waits)  # the run's end does not wait for billing
    assert billing.batches == [] and await _stored_rows(sessions) == ["RecordUsageBatch"] * 3

    async def sent() -> bool:
        return bool(billing.batches) and not await _stored_rows(sessions)

    await _until(sent)
    assert billing.batches == [[(r, i) for r in ("r1", "r2", "r3") for i in (0, 1)]]
    assert batcher.take("r1") is None  # nothing of it waits any more
    await batcher.close()


async def test_usage_stored_with_a_run_end_survives_a_crash_and_the_next_start_sends_it(
    sessions, store
):
    billing = FakeBilling()
    crashed = UsageBatcher(
        billing, Redelivery(sessions), window_s=5, forget=store.forget_redeliveries, linger_s=60
    )
    crashed.add(_usage("r1", 0))
    await _end_run(store, crashed, "r1")
    assert crashed._stored._timer is not None
    crashed._stored._timer.cancel()  # the process dies before the linger is over: nothing sent
    assert billing.batches == [] and await _stored_rows(sessions) == ["RecordUsageBatch"]

    restarted = UsageBatcher(billing, _fast(sessions), window_s=0)  # the next start of the process
    restarted.redelivery.start()

    async def sent() -> bool:
        return bool(billing.batches) and not await _stored_rows(sessions)

    await _until(sent)
    assert billing.batches == [[("r1", 0)]]
    await restarted.close()


async def test_stored_usage_billing_refuses_stays_stored_and_is_sent_again_in_the_background(
    sessions, store, caplog
):
    billing = FakeBilling(failures=4)  # the three quick attempts fail, and the first background one
    redelivery = _fast(sessions)
    batcher = UsageBatcher(
        billing, redelivery, window_s=5, forget=store.forget_redeliveries, linger_s=0.01
    )
    batcher.add(_usage("r1", 0))
    await _end_run(store, batcher, "r1")

    def warned() -> list[tuple[str, int]]:
        return [
            (fields_of(r)["run_id"], fields_of(r)["call_index"])
            for r in caplog.records
            if r.getMessage() == "recording usage failed; retrying in the background"
        ]

    await _until(lambda: asyncio.sleep(0, bool(warned())))
    assert (
        warned() == [("r1", 0)]
        and billing.batches == []
        and await _stored_rows(sessions) == ["RecordUsageBatch"]
    )
    redelivery.start()

    async def sent() -> bool:
        return bool(billing.batches) and not await _stored_rows(sessions)

    await _until(sent)
    assert billing.batches == [[("r1", 0)]]
    await batcher.close()


async def test_records_a_failed_run_end_handed_over_are_sent_as_before(sessions, store):
    billing = FakeBilling()
    batcher = UsageBatcher(
        billing, Redelivery(sessions), window_s=5, forget=store.forget_redeliveries, linger_s=60
    )
    wait = batcher.add(_usage("r1", 0))
    handed = batcher.take("r1")
    assert handed is not None and wait.done()
    batcher.give_back(handed[0])  # the end's transaction failed: nothing was stored

    async def sent() -> bool:
        return bool(billing.batches)

    await _until(sent)
    assert billing.batches == [[("r1", 0)]] and await _stored_rows(sessions) == []
    await batcher.close()


async def test_close_stops_the_sender_even_when_it_was_woken_just_before(sessions):
    """`close` stops the redelivery sender even when a stored usage's failed send woke it
    just before: Python 3.11's `asyncio.wait_for` returns the finished wait and drops a cancel
    arriving in the same loop turn, which would keep a SIGTERM'd orchestrator serving for good
    when billing is down at a run's end."""
    redelivery = _fast(sessions, idle_poll_s=60)
    redelivery.start()
    await asyncio.sleep(0.2)  # the first pass is over: the sender waits to be woken
    redelivery._wake.set()  # what a stored usage's failed send does (`due_soon`)
    started = asyncio.get_running_loop().time()
    closing = asyncio.ensure_future(redelivery.close())
    done, _ = await asyncio.wait({closing}, timeout=5)
    assert (
        done and asyncio.get_running_loop().time() - started < 2
    )  # the sender stops, it does not go on


async def test_stored_usage_billing_refused_at_once_is_due_after_the_first_delay_not_the_grace(
    sessions, store
):
    """Billing down when runs end: their stored usage reaches billing on the README's schedule
    (1 s, doubling) after it is back, not after the stored rows' grace (~30 s)."""
    from sqlalchemy import select

    from services.orchestrator.models import BillingRedelivery

    billing = FakeBilling(failures=3)  # the quick attempts fail
    redelivery = Redelivery(sessions)  # 1 s first delay
    batcher = UsageBatcher(
        billing, redelivery, window_s=5, forget=store.forget_redeliveries, linger_s=0.01
    )
    batcher.add(_usage("r1", 0))
    await _end_run(store, batcher, "r1")

    async def rescheduled() -> bool:
        async with sessions() as session:
            row = (await session.execute(select(BillingRedelivery))).scalars().one()
        return (db.utc(row.next_attempt_at) - db.utc(row.created_at)).total_seconds() < 10

    await _until(rescheduled)  # the first delay, not the grace (created_at + 30 s)
    await batcher.close()
