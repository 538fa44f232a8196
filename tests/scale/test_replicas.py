"""Replicas on PostgreSQL + Redis: any orchestrator serves any run; crashes are recovered.

Orchestrators and gateways are real `python -m services.<name>` processes; billing and
tools run in the test process. Skipped when PostgreSQL or Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import time

from tests.conftest import SCRIPTED, script
from tests.orchestrator.helpers import types, wait_for
from tests.sse_client import read_frames

LEASE_S = 4.0  # the crash-detection bound used here (default 30 s)


async def _start(client, *steps, chat_id: str | None = None) -> dict:
    body = {"message": script(*steps)}
    if chat_id:
        body["chat_id"] = chat_id
    response = await client.post("/assistant/chat", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _first_frames(client, url: str, count: int) -> list[dict]:
    """The first `count` frames of a stream (the listener then disconnects)."""
    return await asyncio.wait_for(read_frames(client, url, limit=count), 20)


async def test_turn_started_on_one_replica_is_listened_resumed_and_finished_through_the_other(
    cluster,
):
    orchestrator_a = await cluster.spawn_orchestrator("orchestrator-a")
    orchestrator_b = await cluster.spawn_orchestrator("orchestrator-b")
    gateway_a = await cluster.spawn_gateway("gateway-a", orchestrator_a)
    gateway_b = await cluster.spawn_gateway("gateway-b", orchestrator_b)
    async with cluster.client(gateway_a) as a, cluster.client(gateway_b) as b:
        body = await _start(
            a,
            {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}, "say": "Asking."},
            {"say": "Done after yes.", "sleep_ms": 300},
        )
        # listened through B: the run runs on A, its events come from the Redis stream
        paused = await read_frames(b, body["stream_url"])
        assert types(paused)[0] == "metadata" and types(paused)[-2:] == [
            "user_input_request",
            "interrupted",
        ], types(paused)
        assert await read_frames(a, body["stream_url"]) == paused  # same frames from either replica
        request_id = paused[-1]["data"]["request_id"]

        status = (await b.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id

        resumed = await b.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True},
                "llm": SCRIPTED,
            },
        )
        assert resumed.status_code == 200, resumed.text
        # the continuation runs on B and is listened to through A
        frames = await read_frames(a, resumed.json()["stream_url"])
        assert types(frames)[0] == "metadata" and types(frames)[-1] == "done", types(frames)
        assert frames[-1]["data"]["response"] == "Done after yes."
        # a late listener after the run ended gets every event again (Redis stream or archive)
        assert await read_frames(b, resumed.json()["stream_url"]) == frames


async def test_cancel_through_the_other_replica_stops_the_loop_within_a_second(cluster):
    orchestrator_a = await cluster.spawn_orchestrator("orchestrator-a")
    orchestrator_b = await cluster.spawn_orchestrator("orchestrator-b")
    gateway_a = await cluster.spawn_gateway("gateway-a", orchestrator_a)
    gateway_b = await cluster.spawn_gateway("gateway-b", orchestrator_b)
    async with cluster.client(gateway_a) as a, cluster.client(gateway_b) as b:
        body = await _start(a, {"say": "never said", "sleep_ms": 60_000})
        listener = asyncio.create_task(read_frames(b, body["stream_url"]))
        await wait_for(lambda: _is_running(b, body["chat_id"]), timeout=10)
        await asyncio.sleep(0.3)  # the loop is inside the model's wait on A
        started = time.monotonic()
        cancelled = await b.post(f"/assistant/chat/{body['chat_id']}/cancel")
        elapsed = time.monotonic() - started
        assert cancelled.status_code == 200, (cancelled.text, cluster.logs())
        assert cancelled.json()["status"] == "cancelled"
        assert elapsed < 1.5, f"cancel across replicas took {elapsed:.2f} s"
        print(f"cross-replica cancel answered in {elapsed:.3f} s")
        frames = await asyncio.wait_for(listener, 10)
        assert types(frames) == ["metadata", "cancelled"], types(frames)
        # the chat is free at once, on either replica
        again = await _start(b, {"say": "next turn"}, chat_id=body["chat_id"])
        assert types(await read_frames(a, again["stream_url"]))[-1] == "done"


async def _is_running(client, chat_id: str) -> bool:
    return (await client.get(f"/assistant/chat/{chat_id}/status")).json()["is_running"]


async def test_a_run_whose_orchestrator_is_killed_fails_within_the_lease_bound(cluster):
    lease = {"LOOPLINE_RUN_LEASE_S": str(LEASE_S)}
    doomed = await cluster.spawn_orchestrator("orchestrator-doomed", **lease)
    survivor = await cluster.spawn_orchestrator("orchestrator-survivor", **lease)
    gateway_doomed = await cluster.spawn_gateway("gateway-doomed", doomed)
    gateway = await cluster.spawn_gateway("gateway-survivor", survivor)
    async with cluster.client(gateway_doomed) as doomed_client, cluster.client(gateway) as client:
        body = await _start(doomed_client, {"say": "never said", "sleep_ms": 120_000})
        first = await _first_frames(doomed_client, body["stream_url"], 1)
        assert types(first) == ["metadata"]
        # a listener on the surviving replica follows the run through the crash
        listener = asyncio.create_task(read_frames(client, body["stream_url"]))
        await asyncio.sleep(LEASE_S / 2)  # the doomed replica renews its lease at least once
        doomed.kill()
        killed_at = time.monotonic()
        frames = await asyncio.wait_for(listener, LEASE_S + 20)
        detected = time.monotonic() - killed_at
        # the frames published before the crash survive (Redis), then error and done {error: true}
        assert types(frames) == ["metadata", "error", "done"], types(frames)
        assert frames[0] == first[0]
        assert frames[-1]["data"]["error"] is True
        assert "stopped unexpectedly" in frames[1]["data"]["message"]
        assert detected <= LEASE_S + 1, f"crash detected after {detected:.1f} s (bound {LEASE_S} s)"
        print(
            f"crash of the run's replica detected after {detected:.2f} s (lease bound {LEASE_S} s)"
        )

        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["is_running"] is False and not status["running_id"]
        assert status["run_status"]["status"] == "failed"
        # the chat takes a new turn
        again = await _start(client, {"say": "back again"}, chat_id=body["chat_id"])
        assert types(await read_frames(client, again["stream_url"]))[-1] == "done"
        # the failed run's events were archived in PostgreSQL: they outlive the Redis stream
        import redis.asyncio as aioredis

        from tests.conftest import redis_url

        redis = aioredis.Redis.from_url(redis_url())
        try:
            await redis.delete(
                f"{cluster.redis_prefix}run:{body['run_id']}:events",
                f"{cluster.redis_prefix}run:{body['run_id']}:meta",
            )
        finally:
            await redis.aclose()
        assert await read_frames(client, body["stream_url"]) == frames


async def test_a_replica_started_after_the_crash_recovers_the_run(cluster):
    lease = {"LOOPLINE_RUN_LEASE_S": str(LEASE_S)}
    doomed = await cluster.spawn_orchestrator("orchestrator-doomed", **lease)
    gateway_doomed = await cluster.spawn_gateway("gateway-doomed", doomed)
    async with cluster.client(gateway_doomed) as client:
        body = await _start(
            client,
            {"tool": "get_available_integrations", "input": {}, "say": "Looking."},
            {"say": "never said", "sleep_ms": 120_000},
        )
        before = await _first_frames(client, body["stream_url"], 4)
        assert (
            types(before)
            == ["metadata", "response_chunk", "tool_call", "tool_result"][: len(before)]
        )
    doomed.kill()
    restarted = await cluster.spawn_orchestrator("orchestrator-restarted", **lease)
    gateway = await cluster.spawn_gateway("gateway-restarted", restarted)
    async with cluster.client(gateway) as client:
        frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), LEASE_S + 20)
        assert frames[: len(before)] == before
        assert types(frames)[-2:] == ["error", "done"] and frames[-1]["data"]["error"] is True
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert chat["running_id"] in ("", None)
        again = await _start(client, {"say": "after the restart"}, chat_id=body["chat_id"])
        final = await read_frames(client, again["stream_url"])
        assert types(final)[-1] == "done" and final[-1]["data"]["response"] == "after the restart"


async def test_a_tool_call_cut_off_by_the_crash_gets_its_result_and_done_lists_the_calls(cluster):
    """README "Stream end": every streamed tool_call gets its tool_result. A run whose replica
    dies during a tool call is ended by the reaper, which answers the call from the Redis stream;
    done lists the run's calls."""
    lease = {"LOOPLINE_RUN_LEASE_S": str(LEASE_S)}
    doomed = await cluster.spawn_orchestrator("orchestrator-doomed", **lease)
    survivor = await cluster.spawn_orchestrator("orchestrator-survivor", **lease)
    gateway_doomed = await cluster.spawn_gateway("gateway-doomed", doomed)
    gateway = await cluster.spawn_gateway("gateway-survivor", survivor)
    slow = {"integration": "loopline", "action": "wait", "parameters": {"seconds": 120}}
    async with cluster.client(gateway_doomed) as doomed_client, cluster.client(gateway) as client:
        body = await _start(
            doomed_client,
            {"tool": "get_available_integrations", "input": {}},
            {"tool": "execute_integration_tool", "input": slow},
            {"say": "never said"},
        )
        before = await _first_frames(doomed_client, body["stream_url"], 4)
        assert types(before) == ["metadata", "tool_call", "tool_result", "tool_call"], types(before)
        doomed.kill()
        frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), LEASE_S + 20)
    assert types(frames) == [
        "metadata",
        "tool_call",
        "tool_result",
        "tool_call",
        "tool_result",
        "error",
        "done",
    ], types(frames)
    cut = frames[4]["data"]
    assert cut["tool_call_id"] == frames[3]["data"]["tool_call_id"]
    assert cut["output"] == {"error": "not completed: the run failed", "success": False}
    done = frames[-1]["data"]
    assert done["error"] is True
    assert [(c["tool"], c["output"]) for c in done["tool_calls"]] == [
        ("get_available_integrations", frames[2]["data"]["output"]),
        ("execute_integration_tool", cut["output"]),
    ]


async def test_a_cancel_during_a_redis_outage_answers_at_once_and_the_stream_ends_after_it(
    cluster,
):
    # the cancel of a run of the same replica must not hang 30 s and answer 504 while Redis is
    # away (the run's finish waiting to archive its events from Redis), and the run's stream gets
    # its end once Redis is back
    from urllib.parse import urlsplit

    from tests.conftest import redis_url
    from tests.tcp_proxy import CuttableProxy

    target = urlsplit(redis_url())
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    try:
        orchestrator = await cluster.spawn_orchestrator(
            "orchestrator-a",
            LOOPLINE_REDIS_URL=f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}",
            LOOPLINE_REDIS_RETRY_S="2",
        )
        gateway = await cluster.spawn_gateway("gateway-a", orchestrator)
        async with cluster.client(gateway) as client:
            body = await _start(client, {"say": "slow", "sleep_ms": 20_000})
            assert types(await _first_frames(client, body["stream_url"], 1)) == ["metadata"]
            proxy.cut()
            began = time.monotonic()
            cancelled = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert time.monotonic() - began < 10
            await asyncio.sleep(
                3
            )  # past LOOPLINE_REDIS_RETRY_S: the writer holds the run's end meanwhile
            proxy.restore()
            frames = await asyncio.wait_for(read_frames(client, body["stream_url"]), 30)
        assert types(frames)[0] == "metadata" and frames[-1] == {
            "type": "cancelled",
            "data": {"reason": "cancelled by user"},
        }, (types(frames), cluster.logs())
    finally:
        await proxy.stop()


async def test_a_cancel_through_the_other_replica_during_a_redis_outage_is_503_and_loses_nothing(
    cluster,
):
    # the cancel of a run owned by another replica
    # reaches it through Redis only; while Redis is away it must fail as "retry" (503), at once
    # rather than after the client's deadline, and leave the run as it was for a later cancel
    from urllib.parse import urlsplit

    from tests.conftest import redis_url
    from tests.tcp_proxy import CuttableProxy

    target = urlsplit(redis_url())
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    try:
        through_proxy = {
            "LOOPLINE_REDIS_URL": f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}",
            "LOOPLINE_REDIS_RETRY_S": "2",
        }
        orchestrator_a = await cluster.spawn_orchestrator("orchestrator-a", **through_proxy)
        orchestrator_b = await cluster.spawn_orchestrator("orchestrator-b", **through_proxy)
        gateway_a = await cluster.spawn_gateway("gateway-a", orchestrator_a)
        gateway_b = await cluster.spawn_gateway("gateway-b", orchestrator_b)
        async with cluster.client(gateway_a) as a, cluster.client(gateway_b) as b:
            body = await _start(a, {"say": "never said", "sleep_ms": 60_000})
            assert types(await _first_frames(a, body["stream_url"], 1)) == ["metadata"]
            proxy.cut()
            began = time.monotonic()
            refused = await b.post(f"/assistant/chat/{body['chat_id']}/cancel")
            elapsed = time.monotonic() - began
            assert refused.status_code == 503, (refused.status_code, refused.text, cluster.logs())
            assert refused.headers["retry-after"] and set(refused.json()) == {"detail"}
            assert elapsed < 10, f"the refused cancel took {elapsed:.1f} s"
            assert (
                "Redis unavailable" in cluster.logs()
                and "database unavailable" not in cluster.logs()
            )
            assert await _is_running(a, body["chat_id"])  # nothing changed: the run goes on on A
            proxy.restore()
            cancelled = await b.post(f"/assistant/chat/{body['chat_id']}/cancel")
            assert cancelled.status_code == 200, (cancelled.text, cluster.logs())
            frames = await asyncio.wait_for(read_frames(b, body["stream_url"]), 30)
        assert types(frames) == ["metadata", "cancelled"], types(frames)
    finally:
        await proxy.stop()
