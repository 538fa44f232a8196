"""State survives restarts: pending questions, completed runs and their events (issues 4 and 8)."""

from __future__ import annotations

import asyncio

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.gateway.server import GatewayServer
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer
from tests.orchestrator.helpers import run_turn
from tests.sse_client import read_frames


async def _restart_all(services) -> None:
    """Stop every service of the stack and start it again on the same databases (new ports)."""
    orchestrator_settings = services.orchestrator.settings
    gateway_settings = services.gateway.settings
    await services.gateway.stop(1)
    await services.orchestrator.stop(1)
    await services.tools.stop(1)
    await services.billing.stop(1)
    common = {
        k: getattr(orchestrator_settings, k)
        for k in ("data_dir", "host", "redis_url", "log_level", "shutdown_grace_s")
    }
    services.billing = await BillingServer.start(
        BillingSettings(**common, billing_port=0, auto_migrate=False)
    )
    services.tools = await ToolsServer.start(
        ToolsSettings(**common, tools_port=0, auto_migrate=False)
    )
    services.orchestrator = await OrchestratorServer.start(
        orchestrator_settings.model_copy(
            update={
                "billing_addr": f"127.0.0.1:{services.billing.port}",
                "tools_addr": f"127.0.0.1:{services.tools.port}",
            }
        )
    )
    services.gateway = await GatewayServer.start(
        gateway_settings.model_copy(
            update={
                "orchestrator_addr": f"127.0.0.1:{services.orchestrator.port}",
                "tools_addr": f"127.0.0.1:{services.tools.port}",
                "billing_addr": f"127.0.0.1:{services.billing.port}",
            }
        )
    )


async def _die_mid_run(services, monkeypatch) -> dict:
    """Start a slow turn, let the orchestrator "die" mid-run (its stop records nothing of the
    run, as kill -9; the run's lease is far from lapsing), start every service again; returns
    the turn start's body."""
    async with services.client() as client:
        started = await client.post(
            "/assistant/chat", json={"message": '{"script": [{"say": "slow", "sleep_ms": 60000}]}'}
        )
        assert started.status_code == 200, started.text
        body = started.json()
    runner = services.orchestrator.runner
    for _ in range(200):
        if body["run_id"] in runner.active:
            break
        await asyncio.sleep(0.01)

    async def records_nothing(*args: object) -> None:
        return None

    monkeypatch.setattr(runner, "_finish", records_nothing)
    monkeypatch.setattr(runner, "_finish_minimal", records_nothing)
    await _restart_all(services)
    return body


async def test_pending_question_and_finished_runs_survive_a_restart_of_every_service(services):
    if (
        services.orchestrator.settings.redis_url
        or "postgresql" in services.orchestrator.settings.database_url
    ):
        import pytest

        pytest.skip("restarts the embedded backend in place")
    async with services.client() as client:
        done_body, done_frames = await run_turn(
            client,
            {
                "say": "finished before the restart",
                "tool": "get_available_integrations",
                "input": {},
            },
            {"say": "ok"},
        )
        body, frames = await run_turn(
            client,
            {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}},
            {"say": "resumed after restart"},
        )
        request_id = frames[-1]["data"]["request_id"]
    await _restart_all(services)
    async with services.client() as client:
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id
        details = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert details["pending_user_input_request"]["request_id"] == request_id
        assert await read_frames(client, done_body["stream_url"]) == done_frames
        assert await read_frames(client, body["stream_url"]) == frames
        resumed = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request_id, "response": {"kind": "yes_no", "answer": True}},
        )
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
    assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "resumed after restart"


async def test_an_ended_runs_stream_is_stored_with_its_end_before_the_end_is_published(
    services, monkeypatch
):
    """Embedded backend: the stream is written in the transaction that ends the run, so `kill -9`
    of the orchestrator right after a listener got `done` (or `interrupted`) loses no frame.
    Here the process 'dies' before any later archive (TurnRunner.archive does nothing) and a
    restart still replays every frame."""
    if services.orchestrator.runner.events.durable:
        import pytest

        pytest.skip(
            "Redis Streams keep the events until they are archived (the crash reaper reads them)"
        )

    async def died_before_archiving(run_id: str) -> None:
        return None

    monkeypatch.setattr(services.orchestrator.runner, "archive", died_before_archiving)
    async with services.client() as client:
        done_body, done_frames = await run_turn(
            client,
            {"say": "checking", "tool": "get_available_integrations", "input": {}},
            {"say": "ok"},
        )
        paused_body, paused_frames = await run_turn(
            client, {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}}, {"say": "later"}
        )
    assert done_frames[-1]["type"] == "done" and paused_frames[-1]["type"] == "interrupted"
    await _restart_all(services)  # the memory event log is gone: only what was stored remains
    async with services.client() as client:
        assert await read_frames(client, done_body["stream_url"]) == done_frames
        assert await read_frames(client, paused_body["stream_url"]) == paused_frames


async def test_a_run_a_dead_orchestrator_left_running_ends_when_the_embedded_one_starts_again(
    services, monkeypatch
):
    """Embedded backend: the restarted orchestrator ends the runs the dead process left running
    before it serves: the listener gets `error` and `done {error: true}` and the chat takes a
    new turn (not an empty 200 stream and a 409 until the reaper's lease runs out, up to 30 s)."""
    if services.orchestrator.backend.distributed:
        import pytest

        pytest.skip("replicas share Redis: another replica may run it, so the lease decides")
    body = await _die_mid_run(services, monkeypatch)
    async with services.client() as client:
        frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), 10)
        assert [f["type"] for f in frames] == ["error", "done"] and frames[-1]["data"][
            "error"
        ] is True
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["is_running"] is False
        again = await client.post(
            "/assistant/chat", json={"message": "again", "chat_id": body["chat_id"]}
        )
        assert again.status_code == 200, again.text


async def test_a_run_lost_before_its_charge_was_sent_is_charged_once_and_not_released(
    services, monkeypatch
):
    """The run charge is committed with the turn (usage.batches.RunCharges). A process that dies
    before sending it leaves it stored; the next start fails the lost run and sends the charge.
    The reaper does not Release a lost run's reservation: racing the stored charge, that would
    void the hold of a persisted turn, whose credit would then never be charged."""
    from sqlalchemy import func, select

    from services.billing.models import LedgerEntry, Reservation
    from tests.orchestrator.helpers import billing_delivered

    if services.orchestrator.backend.distributed:
        import pytest

        pytest.skip("replicas share Redis: the lease decides when a lost run ends")
    monkeypatch.setattr(
        services.orchestrator.runner.charges, "committed", lambda *_args: None
    )  # dies before sending it
    body = await _die_mid_run(services, monkeypatch)
    async with services.client() as client:
        frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), 10)
    assert [f["type"] for f in frames] == ["error", "done"]
    await billing_delivered(services)
    async with services.billing.store.sessions() as session:
        states = (
            await session.scalars(
                select(Reservation.state).where(Reservation.org_id == services.org_id)
            )
        ).all()
        charges = await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(LedgerEntry.org_id == services.org_id, LedgerEntry.kind == "run_charge")
        )
    assert (states, charges) == (["charged"], 1)
