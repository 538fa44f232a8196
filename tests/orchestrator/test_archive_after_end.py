"""The run's events archived after its end (a durable event log: Redis) — the end is final.

On a durable event log the archive is a transaction of its own after the run's end is stored
and published. When it fails (a database blip), the end stands: the run is not stored as
`failed` over its real outcome with `error` + `done` published after the stream's `done` (two
terminal outcomes for one run). The archive is tried again in the background until it is
written (the Redis copy expires after LOOPLINE_RUN_EVENTS_TTL_S), and a cancel answers once
the end is stored, not after the archive.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import exc, func, select

from services.orchestrator.models import Run, RunEvent
from tests.orchestrator.helpers import run_turn, start, types, wait_for
from tests.sse_client import read_frames


def _durable(monkeypatch, runner) -> None:
    """Archive after the end, as on Redis (the memory log otherwise archives with the end)."""
    monkeypatch.setattr(runner.events, "durable", True, raising=False)


def _fail_first_archive(monkeypatch, runner) -> list[str]:
    """The store's first archive fails as an unreachable database would; returns the runs
    tried, in order."""
    real = runner.store.archive
    attempts: list[str] = []

    async def flaky(run_id, events, **kwargs):
        attempts.append(run_id)
        if len(attempts) == 1:
            raise exc.OperationalError(
                "INSERT INTO run_events", None, ConnectionRefusedError(111, "refused")
            )
        await real(run_id, events, **kwargs)

    monkeypatch.setattr(runner.store, "archive", flaky)
    return attempts


async def _archived(services, run_id: str) -> int:
    async with services.orchestrator.servicer.sessions() as session:
        return (
            await session.execute(
                select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id)
            )
        ).scalar_one()


async def _status(services, run_id: str) -> str:
    async with services.orchestrator.servicer.sessions() as session:
        return (await session.execute(select(Run.status).where(Run.id == run_id))).scalar_one()


async def test_an_archive_failing_after_the_end_keeps_the_outcome_and_is_written_later(
    services, monkeypatch
):
    runner = services.orchestrator.runner
    _durable(monkeypatch, runner)
    attempts = _fail_first_archive(monkeypatch, runner)
    async with services.client() as client:
        body, frames = await run_turn(client, {"say": "all fine"})
        assert types(frames)[-1] == "done" and "error" not in types(frames)
        await wait_for(lambda: len(attempts) >= 2, timeout=10)
        await wait_for(lambda: runner.archiving_runs() == 0, timeout=10)
        assert await _status(services, body["run_id"]) == "completed"
        assert await _archived(services, body["run_id"]) == len(frames)
        # one terminal outcome: the whole stream, listened to again, is the same
        assert await read_frames(client, body["stream_url"]) == frames
        # the chat is free for the next turn
        _, again = await run_turn(client, {"say": "next"}, chat_id=body["chat_id"])
        assert types(again)[-1] == "done"


async def test_a_cancel_answers_once_the_end_is_stored_not_after_the_archive(services, monkeypatch):
    runner = services.orchestrator.runner
    _durable(monkeypatch, runner)
    release = asyncio.Event()
    real = runner.store.archive

    async def slow(run_id, events, **kwargs):
        await release.wait()
        await real(run_id, events, **kwargs)

    monkeypatch.setattr(runner.store, "archive", slow)
    async with services.client() as client:
        body = await start(client, {"say": "never", "sleep_ms": 30_000})
        await wait_for(lambda: body["run_id"] in runner.active)
        try:
            cancelled = await asyncio.wait_for(
                client.post(f"/assistant/chat/{body['chat_id']}/cancel"), 5
            )
            assert cancelled.status_code == 200, cancelled.text
            assert await _status(services, body["run_id"]) == "cancelled"
            frames = await read_frames(client, body["stream_url"])
            assert types(frames) == ["metadata", "cancelled"]
        finally:
            release.set()
        await wait_for(lambda: body["run_id"] not in runner.active)
        assert await _archived(services, body["run_id"]) == 2


async def test_a_paused_run_cancelled_while_its_archive_fails_answers_200_and_is_archived_later(
    services, monkeypatch
):
    # the same fault on the paused run's path: the cancel was stored and published, then the
    # archive's failure failed the call (a retry then said "No active execution to cancel")
    runner = services.orchestrator.runner
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "One question.", "tool": "ask_user_yes_no", "input": {"message": "Proceed?"}},
        )
        assert types(frames)[-1] == "interrupted"
        attempts = _fail_first_archive(monkeypatch, runner)
        cancelled = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        await wait_for(lambda: len(attempts) >= 2 and runner.archiving_runs() == 0, timeout=10)
        whole = await read_frames(client, body["stream_url"])
        assert types(whole) == [*types(frames), "cancelled"]
        assert await _archived(services, body["run_id"]) == len(whole)
        assert await _status(services, body["run_id"]) == "cancelled"
