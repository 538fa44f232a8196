"""The turn's hot path on Redis and PostgreSQL: few round trips, nothing lost.

Redis (`RedisEventLog`): the owner writes whatever is queued in one atomic call; followers
in the owner's process are served from its copy but only what is stored in the stream
(never an event a crash could still lose), in order with `after=N`; the archive at a run's
end comes from that copy without reading the stream back; a follower on another replica
reads the stream and returns once the run is closed. PostgreSQL (`TurnStore` on asyncpg):
each hot-path transaction is one statement and keeps the rules of the SQLite path (a lost
claim writes nothing, thread rows keep their order and JSON values, finish frees or only
touches the chat, archive keeps rows already stored). Skipped, with the reason, when Redis
or PostgreSQL cannot be reached.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid

import pytest
from sqlalchemy import select, update

from loopline.assistant.v1 import events_pb2
from services.common import db
from services.orchestrator.eventlog.redis import RedisEventLog, redis_client
from services.orchestrator.models import Chat, Interrupt, Message, Run, RunEvent, utcnow
from services.orchestrator.store import ClaimLost, RunEnd, RunTakenOver, ThreadRow, TurnStore
from tests.conftest import drop_redis_prefix, postgres_databases, redis_url, release_databases
from tests.scale.conftest import fresh_redis_prefix, no_archive, unavailable_reason


def _chunk(run_id: str, text: str) -> events_pb2.Event:
    return events_pb2.Event(run_id=run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=text))


class CountingRedis:
    """A `redis.asyncio.Redis` wrapper that counts the commands sent (EVALSHA, XREAD, ...)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.commands: list[str] = []
        original = inner.execute_command

        async def counted(*args, **options):
            self.commands.append(str(args[0]).upper())
            return await original(*args, **options)

        inner.execute_command = counted


@pytest.fixture
async def redis_logs():
    """(owner log with a counted client, other replica's log, the counter); skips without Redis."""
    prefix = fresh_redis_prefix()
    owner_client, other_client = redis_client(redis_url()), redis_client(redis_url())
    counter = CountingRedis(owner_client)
    owner = RedisEventLog(owner_client, prefix, 10_000, 60, no_archive, retry_s=5)
    other = RedisEventLog(other_client, prefix, 10_000, 60, no_archive, retry_s=5, block_ms=300)
    try:
        yield owner, other, counter
    finally:
        await owner.aclose()
        await owner_client.aclose()
        await other_client.aclose()
        await drop_redis_prefix(redis_url(), prefix)


async def test_queued_events_of_a_run_are_written_in_one_redis_call(redis_logs):
    owner, other, counter = redis_logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    for i in range(20):
        owner.append(_chunk(run_id, str(i)))
    owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
    owner.close(run_id)
    await owner.flush(run_id)
    writes = [command for command in counter.commands if command not in ("PING",)]
    assert writes == ["EVALSHA"], (
        writes
    )  # open, 21 events and close: one round trip, no SCRIPT EXISTS
    stored = await other.events_of(run_id)
    assert [event.seq for event in stored] == list(range(21))
    assert stored[-1].WhichOneof("payload") == "done"


async def test_local_follower_gets_only_stored_events_in_order_without_reading_redis(redis_logs):
    owner, other, counter = redis_logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    await owner.flush(run_id)
    received: list[events_pb2.Event] = []
    stored_when_received: list[int] = []

    async def listen(after: int, into: list[events_pb2.Event]) -> None:
        async for event in owner.follow(run_id, after):
            into.append(event)
            if into is received:
                entries = await other.redis.xrange(f"{owner.prefix}run:{run_id}:events", "-", "+")
                stored_when_received.append(len(entries))

    listener = asyncio.create_task(listen(0, received))
    await asyncio.sleep(0.05)
    counter.commands.clear()
    for i in range(5):
        owner.append(_chunk(run_id, str(i)))
        await asyncio.sleep(0)
    late: list[events_pb2.Event] = []
    late_listener = asyncio.create_task(listen(3, late))
    owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
    owner.close(run_id)
    await asyncio.wait_for(asyncio.gather(listener, late_listener), 10)
    assert [event.seq for event in received] == list(range(6))
    assert [event.seq for event in late] == [3, 4, 5]
    # every event was in the stream before a local follower got it (a crash cannot take it back)
    assert all(stored >= index + 1 for index, stored in enumerate(stored_when_received)), (
        stored_when_received
    )
    assert not [
        command for command in counter.commands if command in ("XREAD", "XRANGE", "HMGET")
    ], counter.commands


async def test_archive_copy_of_an_owned_run_comes_from_memory_and_equals_the_stream(redis_logs):
    owner, other, counter = redis_logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    for i in range(3):
        owner.append(_chunk(run_id, str(i)))
    owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
    owner.close(run_id)
    await owner.flush(run_id)
    counter.commands.clear()
    mine = await owner.events_of(run_id)
    assert counter.commands == [
        "HMGET"
    ]  # the stream's length is checked, the stream is not read back
    theirs = await other.events_of(run_id)
    assert [e.SerializeToString() for e in mine] == [e.SerializeToString() for e in theirs]


async def test_follower_on_another_replica_gets_every_event_and_returns_at_the_end(redis_logs):
    owner, other, _ = redis_logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    owner.append(_chunk(run_id, "a"))
    await owner.flush(run_id)
    received: list[events_pb2.Event] = []

    async def listen() -> None:
        async for event in other.follow(run_id, 0):
            received.append(event)

    listener = asyncio.create_task(listen())
    for text in "bcd":
        owner.append(_chunk(run_id, text))
        await asyncio.sleep(0.01)
    owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
    owner.close(run_id)
    await asyncio.wait_for(listener, 5)
    assert [event.seq for event in received] == [0, 1, 2, 3, 4]
    assert [event.response_chunk.chunk for event in received[:4]] == list("abcd")


async def test_append_after_end_on_another_replica_continues_the_owners_numbering(redis_logs):
    owner, other, _ = redis_logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    owner.append(_chunk(run_id, "a"))
    owner.append(
        events_pb2.Event(
            run_id=run_id, interrupted=events_pb2.InterruptedEvent(request_id="q", kind="question")
        )
    )
    owner.close(run_id)
    await owner.flush(run_id)
    appended = await other.append_after_end(
        run_id, events_pb2.Event(run_id=run_id, cancelled=events_pb2.CancelledEvent(reason="x"))
    )
    assert [event.seq for event in appended] == [2]
    late: list[events_pb2.Event] = []
    async for event in other.follow(run_id, 1):
        late.append(event)
    assert [event.seq for event in late] == [1, 2]
    # the owner's copy misses what the other replica appended: the owner reads the stream then
    assert [event.seq for event in await owner.events_of(run_id)] == [0, 1, 2]
    from_owner: list[events_pb2.Event] = []
    async for event in owner.follow(run_id, 2):  # a late listener on the owner still gets it
        from_owner.append(event)
    assert [event.WhichOneof("payload") for event in from_owner] == ["cancelled"]


# ---------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
async def pg_store():
    """A TurnStore on a fresh migrated PostgreSQL database, and its async sessionmaker."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    urls = await postgres_databases()
    engine = db.make_engine(urls["orchestrator"])
    store = TurnStore(engine)
    assert store.pg is not None
    try:
        yield store, db.sessionmaker(engine)
    finally:
        store.close()
        await engine.dispose()
        release_databases(list(urls.values()))


def _turn(chat_id: str, text: str = "hi") -> tuple[ThreadRow, dict]:
    run_id = str(uuid.uuid4())
    now = utcnow()
    message = ThreadRow(role="user", content=text, chat_id=chat_id, run_id=run_id)
    run = {
        "id": run_id,
        "durable_id": f"run_{uuid.uuid4().hex}",
        "chat_id": chat_id,
        "organization_id": "org",
        "parent_run_id": None,
        "status": "running",
        "llm": {"provider_id": "p"},
        "reservation_id": "r1",
        "usage": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "lease_until": now,
    }
    return message, run


async def test_postgres_turn_store_keeps_the_rules_of_each_transaction(pg_store):
    store, sessions = pg_store
    chat_id = str(uuid.uuid4())
    message, run = _turn(chat_id)
    now = utcnow()
    chat = {
        "id": chat_id,
        "organization_id": "org",
        "user_id": "u",
        "kind": "assistant",
        "title": "hi",
        "workflow_id": None,
        "running_id": run["id"],
        "deleted_at": None,
        "created_at": now,
        "updated_at": now,
    }
    await store.persist_turn(claim=False, chat=chat, message=message, run=run)
    guard = await store.turn_guard(chat_id)
    assert (guard.organization_id, guard.kind, guard.running_id, guard.pending_id) == (
        "org",
        "assistant",
        run["id"],
        None,
    )
    target = await store.stream_target(chat_id, run["id"])
    assert (
        target.run_chat_id == chat_id
        and (await store.stream_target(chat_id, str(uuid.uuid4()))).run_chat_id is None
    )
    assert await store.turn_guard(str(uuid.uuid4())) is None

    # a second turn while running: the claim is lost and nothing is written
    second, second_run = _turn(chat_id, "again")
    with pytest.raises(ClaimLost):
        await store.persist_turn(claim=True, chat=None, message=second, run=second_run)

    rows = [
        ThreadRow(
            role="assistant",
            content="",
            extra={"tool_calls": [{"id": "c1", "name": "t", "input": {}}]},
            chat_id=chat_id,
            run_id=run["id"],
        ),
        ThreadRow(
            role="tool",
            content={"ok": [1, None]},
            extra={"tool_call_id": "c1"},
            chat_id=chat_id,
            run_id=run["id"],
        ),
        ThreadRow(role="assistant", content="done", extra=None, chat_id=chat_id, run_id=run["id"]),
    ]
    await store.finish(
        RunEnd(
            run_id=run["id"],
            chat_id=chat_id,
            status="completed",
            error=None,
            usage={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7, "llm_calls": 2},
            rows=rows,
        )
    )
    thread = await store.load_thread(chat_id)
    assert [(r.role, r.content, r.extra) for r in thread] == [("user", "hi", None)] + [
        (r.role, r.content, r.extra) for r in rows
    ]
    assert [r.seq for r in thread] == sorted(r.seq for r in thread)
    async with sessions() as session:
        stored_run = await session.get(Run, run["id"])
        stored_chat = await session.get(Chat, chat_id)
        orm_rows = (
            (
                await session.execute(
                    select(Message).where(Message.chat_id == chat_id).order_by(Message.seq)
                )
            )
            .scalars()
            .all()
        )
    assert (
        stored_run.status == "completed"
        and stored_run.usage["total_tokens"] == 7
        and stored_run.llm == {"provider_id": "p"}
    )
    assert stored_chat.running_id is None
    assert [m.content for m in orm_rows] == ["hi", "", {"ok": [1, None]}, "done"]

    # the next turn claims the chat; it pauses on a question (chat only touched), then is cancelled
    third, third_run = _turn(chat_id, "third")
    await store.persist_turn(claim=True, chat=None, message=third, run=third_run)
    expires = utcnow() + datetime.timedelta(hours=1)
    interrupt = {
        "id": str(uuid.uuid4()),
        "chat_id": chat_id,
        "run_id": third_run["id"],
        "tool_call_id": "c2",
        "tool": "ask",
        "kind": "question",
        "request": {"kind": "question", "text": "?"},
        "outcome": "pending",
        "created_at": utcnow(),
        "expires_at": expires,
    }
    await store.finish(
        RunEnd(
            run_id=third_run["id"],
            chat_id=chat_id,
            status="interrupted",
            error=None,
            usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "llm_calls": 1},
            rows=[
                ThreadRow(
                    role="marker",
                    content=None,
                    extra={"type": "interrupted"},
                    chat_id=chat_id,
                    run_id=third_run["id"],
                )
            ],
            interrupt=interrupt,
        )
    )
    guard = await store.turn_guard(chat_id)
    assert guard.running_id == third_run["id"] and guard.pending_id == interrupt["id"]
    # an end only while the run is running: a second end of an ended run writes nothing
    # (RunTakenOver)
    with pytest.raises(RunTakenOver):
        await store.finish(
            RunEnd(
                run_id=third_run["id"],
                chat_id=chat_id,
                status="completed",
                error=None,
                usage={},
                rows=[
                    ThreadRow(
                        role="assistant", content="late", chat_id=chat_id, run_id=third_run["id"]
                    )
                ],
                events=[(0, b"late")],
            )
        )
    async with sessions() as session:
        assert (await session.get(Run, third_run["id"])).status == "interrupted"
        assert (
            not (
                await session.execute(
                    select(Message).where(
                        Message.run_id == third_run["id"], Message.role == "assistant"
                    )
                )
            )
            .scalars()
            .all()
        )
        assert (
            not (await session.execute(select(RunEvent).where(RunEvent.run_id == third_run["id"])))
            .scalars()
            .all()
        )
    # the cancelled end's rules (its pending question cancelled), on a run that is running
    async with sessions() as session, session.begin():
        await session.execute(update(Run).where(Run.id == third_run["id"]).values(status="running"))
    await store.finish(
        RunEnd(
            run_id=third_run["id"],
            chat_id=chat_id,
            status="cancelled",
            error=None,
            usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "llm_calls": 1},
            rows=[],
            events=[(0, b"e0"), (1, b"e1")],
        )
    )  # the memory event log's stream, stored with the end
    async with sessions() as session:
        audit = await session.get(Interrupt, interrupt["id"])
        stored_chat = await session.get(Chat, chat_id)
        ended = (
            await session.execute(
                select(RunEvent.seq, RunEvent.payload)
                .where(RunEvent.run_id == third_run["id"])
                .order_by(RunEvent.seq)
            )
        ).all()
    assert audit.outcome == "cancelled" and audit.request == {"kind": "question", "text": "?"}
    assert stored_chat.running_id is None
    assert [(seq, bytes(payload)) for seq, payload in ended] == [(0, b"e0"), (1, b"e1")]

    # archive: one statement, rows already stored are kept
    await store.archive(run["id"], [(0, b"a"), (1, b"b")])
    await store.archive(run["id"], [(1, b"other"), (2, b"c")])
    async with sessions() as session:
        archived = (
            await session.execute(
                select(RunEvent.seq, RunEvent.payload)
                .where(RunEvent.run_id == run["id"])
                .order_by(RunEvent.seq)
            )
        ).all()
    assert [(seq, bytes(payload)) for seq, payload in archived] == [(0, b"a"), (1, b"b"), (2, b"c")]
