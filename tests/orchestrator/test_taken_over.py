"""A run another replica ended keeps that one end; a run's end waits out a database blip.

Rules (PostgreSQL + Redis, two orchestrators):

- A replica stalled past its run's lease (SIGSTOP 40 s) wakes up after the other replica's
  crash reaper stored `failed` and streamed `error` + `done {error: true}`. It must not end
  the run a second time (`completed` over it, its last chunks and a second `done`, thread rows
  after a new turn's): a run's end is stored only while the run is `running` (RunTakenOver
  otherwise: nothing written, nothing published), the event log takes no event on a run
  another replica closed, and the lease renewal stops a run of this replica that another ended.
- A short drop (2 s) of the orchestrator database's connections does not fail the runs ending
  during it: the end's transaction is tried again until the database answers, so the streamed
  answer stays in the thread and the crash reaper has nothing to end.

Run here in one process: `take_over(..., orphaned=True)` is the other replica's reaper.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import exc, select

from services.orchestrator.models import Message, Run
from tests.orchestrator.helpers import start, types, wait_for
from tests.sse_client import read_frames


async def _status(services, run_id: str) -> str:
    async with services.orchestrator.servicer.sessions() as session:
        return (await session.execute(select(Run.status).where(Run.id == run_id))).scalar_one()


async def _roles(services, run_id: str) -> list[str]:
    async with services.orchestrator.servicer.sessions() as session:
        return list(
            (
                await session.execute(
                    select(Message.role).where(Message.run_id == run_id).order_by(Message.seq)
                )
            ).scalars()
        )


@pytest.fixture(params=["memory", "redis"])
def services_either_event_log(request):
    """The four services with the run events in memory (one process) and in Redis (replicas)."""
    return request.getfixturevalue(
        "services" if request.param == "memory" else "services_with_redis_events"
    )


async def test_a_run_another_replica_ended_is_not_ended_again_when_its_own_replica_wakes_up(
    services_either_event_log,
):
    stack, runner = services_either_event_log, services_either_event_log.orchestrator.runner
    async with stack.client() as client:
        body = await start(client, {"say": "slow answer one two three four", "sleep_ms": 1500})
        listener = asyncio.create_task(read_frames(client, body["stream_url"]))
        await wait_for(lambda: body["run_id"] in runner.active)
        # the other replica's reaper: this one looked dead (stalled past its lease)
        assert await stack.orchestrator.supervisor.take_over(
            body["run_id"], "failed", orphaned=True
        )
        frames = await asyncio.wait_for(listener, 10)
        assert types(frames) == ["metadata", "error", "done"], types(frames)
        await wait_for(
            lambda: body["run_id"] not in runner.active, timeout=10
        )  # the stalled loop went on and ended here
        assert await _status(stack, body["run_id"]) == "failed"  # the reaper's end stands
        assert await _roles(stack, body["run_id"]) == ["user"]  # none of the stalled loop's rows
        again = await read_frames(client, body["stream_url"])
        assert again == frames  # one terminal outcome: no chunk or second `done` after it
        # the chat took the next turn, and nothing of the old run lands in its thread
        body2 = await start(client, {"say": "next turn"}, chat_id=body["chat_id"])
        assert types(await read_frames(client, body2["stream_url"]))[-1] == "done"
        assert await _roles(stack, body["run_id"]) == ["user"]


async def test_the_lease_renewal_stops_a_run_another_replica_ended(services_either_event_log):
    stack, runner = services_either_event_log, services_either_event_log.orchestrator.runner
    async with stack.client() as client:
        body = await start(client, {"say": "never said", "sleep_ms": 60_000})
        await wait_for(lambda: body["run_id"] in runner.active)
        assert await stack.orchestrator.supervisor.take_over(
            body["run_id"], "failed", orphaned=True
        )
        await stack.orchestrator.supervisor.renew()
        await wait_for(
            lambda: body["run_id"] not in runner.active, timeout=5
        )  # not after its 60 s model call
        assert await _status(stack, body["run_id"]) == "failed"
        assert types(await read_frames(client, body["stream_url"])) == ["metadata", "error", "done"]


async def test_a_run_ending_while_its_database_drops_connections_is_stored_once_it_answers(
    services, monkeypatch
):
    runner = services.orchestrator.runner
    real = runner.store.finish
    tries: list[str] = []

    async def dropped_twice(end):
        tries.append(end.run_id)
        if len(tries) <= 2:
            raise exc.OperationalError(
                "UPDATE runs", None, ConnectionResetError(104, "connection reset by peer")
            )
        await real(end)

    monkeypatch.setattr(runner.store, "finish", dropped_twice)
    async with services.client() as client:
        body = await start(client, {"say": "the answer"})
        frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), 10)
    assert types(frames)[-1] == "done" and "error" not in types(frames), types(frames)
    assert frames[-1]["data"]["response"] == "the answer"
    assert len(tries) == 3
    assert await _status(services, body["run_id"]) == "completed"
    assert await _roles(services, body["run_id"]) == ["user", "assistant"]


async def test_the_supervisor_says_a_database_outage_once_not_a_traceback_per_pass(
    services, monkeypatch, caplog
):
    """While the database refuses connections the run supervisor says so once, not "run
    supervisor pass failed" with a traceback on every pass (11 in 5 s)."""
    import logging

    supervisor = services.orchestrator.supervisor
    await supervisor.stop()
    failing = True

    async def refused() -> list[str]:
        if failing:
            raise exc.OperationalError("SELECT runs", None, ConnectionRefusedError(111, "refused"))
        return []

    monkeypatch.setattr(supervisor, "reap", refused)
    monkeypatch.setattr(supervisor, "reap_period_s", 0.0)
    caplog.set_level(logging.INFO, logger="services.orchestrator.recovery")
    supervisor.start()
    await asyncio.sleep(0.3)  # ~30 failing passes
    failing = False
    await asyncio.sleep(0.1)
    await supervisor.stop()
    records = [r for r in caplog.records if r.name == "services.orchestrator.recovery"]
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING] == [
        "run reaper: database unavailable; reaping and settling wait until it answers"
    ]
    assert any(r.getMessage() == "run reaper: passes go through again" for r in records)
