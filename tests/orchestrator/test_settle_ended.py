"""An ended run whose replica died before its log held the end is settled by any replica.

On a durable event log (Redis) a run's end is stored, then published, then archived. A
replica that dies between the first two (a crash, or the crash reaper's own publication
failing while Redis is away) leaves the run ended in the database and its stream open in
Redis: every listener would wait forever and the events would never be archived. The end is
stored with `runs.archive_due`; once the run's lease lapses, `RunSupervisor.settle_ended`
appends the terminal events the stored end calls for and archives the stream.

The orchestrator runs on Redis here whatever the test backend (skipped without Redis).
"""

from __future__ import annotations

import asyncio
import datetime

import pytest
from sqlalchemy import select, update

from services.orchestrator.models import Run, utcnow
from tests.orchestrator.helpers import run_turn, start, types, wait_for
from tests.sse_client import read_frames

ASK = {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}, "say": "Asking."}
TOOL_THEN_ANSWER = (
    {"tool": "get_available_integrations", "input": {}, "say": "Looking."},
    {"say": "Here they are."},
)


def _die_before_the_end_is_published(monkeypatch, runner) -> list[str]:
    """The run's replica stores the end and dies: its end never reaches the log and nothing is
    archived. Returns the runs that ended so."""
    ended: list[str] = []

    def never_published(run_id, ending) -> None:
        ended.append(run_id)

    async def never_archived(run_id) -> None:
        return None

    monkeypatch.setattr(runner, "_end_stream", never_published)
    monkeypatch.setattr(runner, "archive_after_end", never_archived)
    return ended


async def _bury(runner, run_id: str) -> None:
    """What died with the replica: its writer of the run (and its copy of the events)."""
    writer = runner.events._writers.pop(run_id)
    writer.task.cancel()


async def _row(services, run_id: str) -> Run:
    async with services.orchestrator.servicer.sessions() as session:
        return (await session.execute(select(Run).where(Run.id == run_id))).scalar_one()


async def _lapse_lease(services, run_id: str) -> None:
    async with services.orchestrator.servicer.sessions() as session, session.begin():
        await session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(lease_until=utcnow() - datetime.timedelta(seconds=1))
        )


def _comparable(frames: list[dict]) -> list[dict]:
    """Frames without what differs between two runs of one script (ids, times)."""
    drop = {
        "timestamp",
        "run_id",
        "chat_id",
        "thread_id",
        "tool_call_id",
        "request_id",
        "stream_url",
        "id",
    }

    def clean(value):
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items() if key not in drop}
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    return [clean(frame) for frame in frames]


async def _settled(services, run_id: str) -> bool:
    await services.orchestrator.supervisor.settle_ended()
    return (await _row(services, run_id)).archive_due is None


@pytest.mark.parametrize(
    ("steps", "status"),
    [(TOOL_THEN_ANSWER, "completed"), ((ASK,), "interrupted")],
    ids=["completed", "interrupted"],
)
async def test_a_run_whose_replica_died_before_publishing_its_end_is_ended_and_archived(
    services_with_redis_events, monkeypatch, steps, status
):
    stack, runner = services_with_redis_events, services_with_redis_events.orchestrator.runner
    async with stack.client() as client:
        _, expected = await run_turn(client, *steps)  # the same turn, ended as usual
        ended = _die_before_the_end_is_published(monkeypatch, runner)
        body = await start(client, *steps)
        await wait_for(lambda: body["run_id"] in ended and body["run_id"] not in runner.active)
        await _bury(runner, body["run_id"])
        monkeypatch.undo()
        row = await _row(stack, body["run_id"])
        assert row.status == status
        assert row.archive_due is not None  # the end is stored; its log's end and archive are due

        listener = asyncio.create_task(read_frames(client, body["stream_url"]))
        await asyncio.sleep(0.5)
        assert not listener.done()  # the stream has no end yet

        await _lapse_lease(stack, body["run_id"])
        await wait_for(lambda: _settled(stack, body["run_id"]), timeout=10)
        frames = await asyncio.wait_for(listener, 10)
        assert _comparable(frames) == _comparable(expected), (types(frames), types(expected))
        # archived: a late listener gets the same stream with Redis' copy gone
        prefix = runner.events.prefix
        await runner.events.redis.delete(
            f"{prefix}run:{body['run_id']}:events", f"{prefix}run:{body['run_id']}:meta"
        )
        assert await read_frames(client, body["stream_url"]) == frames
        if status == "interrupted":  # the question is still answerable
            resumed = await client.post(
                f"/assistant/chat/{body['chat_id']}/resume",
                json={
                    "request_id": frames[-1]["data"]["request_id"],
                    "response": {"kind": "yes_no", "answer": True},
                },
            )
            assert resumed.status_code == 200, resumed.text
            assert types(await read_frames(client, resumed.json()["stream_url"]))[-1] == "done"


async def test_a_settle_that_fails_is_tried_again_once_its_lease_lapses(
    services_with_redis_events, monkeypatch
):
    stack, runner = services_with_redis_events, services_with_redis_events.orchestrator.runner
    supervisor = stack.orchestrator.supervisor
    async with stack.client() as client:
        ended = _die_before_the_end_is_published(monkeypatch, runner)
        body = await start(client, {"say": "all fine"})
        await wait_for(lambda: body["run_id"] in ended and body["run_id"] not in runner.active)
        await _bury(runner, body["run_id"])
        monkeypatch.undo()

        calls = []
        real = runner.events.append_after_end

        async def redis_away_once(run_id, *events):
            calls.append(run_id)
            if len(calls) == 1:
                raise ConnectionError("Redis away")
            return await real(run_id, *events)

        monkeypatch.setattr(runner.events, "append_after_end", redis_away_once)
        await _lapse_lease(stack, body["run_id"])
        assert (
            await supervisor.settle_ended() == []
        )  # failed: the run is held for a lease, still due
        row = await _row(stack, body["run_id"])
        assert row.lease_until is not None
        held_until = (
            row.lease_until
            if row.lease_until.tzinfo
            else row.lease_until.replace(tzinfo=datetime.UTC)
        )  # SQLite: naive
        assert row.archive_due is not None and held_until > utcnow()
        assert await supervisor.settle_ended() == []  # not again before that lease lapses
        assert len(calls) == 1

        await _lapse_lease(stack, body["run_id"])
        await wait_for(lambda: _settled(stack, body["run_id"]), timeout=10)
        frames = await read_frames(client, body["stream_url"])
        assert (
            types(frames)[0] == "metadata"
            and types(frames)[-1] == "done"
            and "error" not in types(frames)
        ), types(frames)
        assert frames[-1]["data"]["response"] == "all fine"


async def test_an_ended_run_is_not_due_after_a_normal_end(services_with_redis_events):
    stack = services_with_redis_events
    async with stack.client() as client:
        body, frames = await run_turn(client, {"say": "all fine"})
        assert types(frames)[-1] == "done"

        async def archived() -> bool:  # by its owner, right after the end: no settle pass involved
            return (await _row(stack, body["run_id"])).archive_due is None

        await wait_for(archived, timeout=5)
