"""The loop contract of the spec, one test per rule, through the public HTTP API."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import select

from services.orchestrator.models import Chat, Message, Run
from tests.orchestrator.helpers import run_turn, start, types, wait_for
from tests.sse_client import read_frames


async def _run_row(services, run_id):
    async with services.orchestrator.servicer.sessions() as session:
        return await session.get(Run, run_id)


async def _chat_row(services, chat_id):
    async with services.orchestrator.servicer.sessions() as session:
        return await session.get(Chat, chat_id)


async def test_natural_completion_sets_completed_and_clears_running_id(services):
    async with services.client() as client:
        body, frames = await run_turn(client, {"say": "Hello there."})
    assert types(frames) == ["metadata", "response_chunk", "response_chunk", "done"]
    assert (await _run_row(services, body["run_id"])).status == "completed"
    assert (await _chat_row(services, body["chat_id"])).running_id is None


async def test_done_usage_sums_every_model_call(services):
    async with services.client() as client:
        _, frames = await run_turn(
            client,
            {
                "tool": "get_available_integrations",
                "input": {},
                "usage": {"input_tokens": 100, "output_tokens": 10},
            },
            {"say": "ok", "usage": {"input_tokens": 200, "output_tokens": 20}},
        )
    assert frames[-1]["data"]["usage"] == {
        "input_tokens": 300,
        "output_tokens": 30,
        "total_tokens": 330,
        "llm_calls": 2,
    }
    assert [c["tool"] for c in frames[-1]["data"]["tool_calls"]] == ["get_available_integrations"]
    assert set(frames[-1]["data"]["tool_calls"][0]) == {"tool", "input", "output"}


async def test_model_failure_emits_error_then_done_with_error_true(services):
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {
                "say": "step one",
                "tool": "get_available_integrations",
                "input": {},
                "usage": {"input_tokens": 7, "output_tokens": 3},
            },
            {
                "fail": "provider exploded at https://internal.example.local/v1 "
                "with key sk-abcdefghijklmnop"
            },
        )
    assert types(frames)[-2:] == ["error", "done"]
    message = frames[-2]["data"]["message"]
    assert (
        "sk-abcdefghijklmnop" not in message
        and "internal.example.local" not in message
        and "Traceback" not in message
    )
    assert frames[-1]["data"]["error"] is True
    run = await _run_row(services, body["run_id"])
    assert run.status == "failed"
    assert (await _chat_row(services, body["chat_id"])).running_id is None
    assert run.usage["llm_calls"] == 2


async def test_a_failure_text_with_control_characters_or_a_lone_surrogate_is_stored_clean(
    services,
):
    # a model failure text with a NUL must not fail the run's end on PostgreSQL ("Internal error
    # while finishing the turn."), and is streamed clean too
    async with services.client() as client:
        body, frames = await run_turn(client, {"fail": "bad\u0000thing\u0007 \ud800 done"})
    assert types(frames)[-2:] == ["error", "done"]
    message = frames[-2]["data"]["message"]
    assert "finishing" not in message and "\x00" not in message and "\x07" not in message
    # the failure's own text goes to the log only: the client is told the provider and the kind
    assert message == "scripted: the model call failed"
    run = await _run_row(services, body["run_id"])
    assert run.status == "failed" and run.error == message


async def test_failed_run_records_token_usage_with_billing(services):
    from services.billing.models import UsageRecord

    async with services.client() as client:
        body, _ = await run_turn(
            client, {"fail": "boom", "usage": {"input_tokens": 11, "output_tokens": 5}}
        )
    async with services.billing.store.sessions() as session:
        rows = (
            (await session.execute(select(UsageRecord).where(UsageRecord.run_id == body["run_id"])))
            .scalars()
            .all()
        )
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(11, 5)]


@pytest.mark.parametrize(
    ("step", "named"),
    [
        ({"say": "ok ok ok", "chunks": 1e400}, "chunks"),
        ({"say": "ok", "chunks": 0}, "chunks"),
        ({"say": "ok", "chunks": "2"}, "chunks"),
        ({"say": "ok", "chunks": 2.5}, "chunks"),
        ({"say": "ok", "sleep_ms": 1e12}, "sleep_ms"),
        ({"say": "ok", "sleep_ms": -5}, "sleep_ms"),
        ({"say": "ok", "sleep_ms": "10"}, "sleep_ms"),
        ({"say": "ok", "usage": "5"}, "usage"),
        ({"say": "ok", "usage": 5}, "usage"),
        ({"say": "ok", "usage": [1, 2]}, "usage"),
        (None, "step"),
        ("plain text", "step"),
        ({"say": ["a"]}, "say"),
        ({"tool": 5}, "tool"),
        ({"tools": "x"}, "tools"),
        ({"tools": [{"input": {}}]}, "tools"),
        ({"fail": 5}, "fail"),
    ],
)
async def test_a_scripted_step_with_an_out_of_range_setting_fails_that_model_call_not_the_loop(
    services, step, named
):
    # chunks 1e400 must not crash the loop (OverflowError, "Internal error"), nor sleep_ms 1e12
    # hold the chat for good
    async with services.client() as client:
        body, frames = await asyncio.wait_for(run_turn(client, step), 10)
    assert types(frames)[-2:] == ["error", "done"], frames
    assert frames[-1]["data"]["error"] is True and frames[-1]["data"]["usage"]["llm_calls"] == 1
    assert (await _run_row(services, body["run_id"])).status == "failed"


async def test_a_scripted_usage_object_reports_its_counts_missing_ones_as_0(services):
    async with services.client() as client:
        _, frames = await run_turn(client, {"say": "hello", "usage": {}})
        _, more = await run_turn(client, {"say": "hello", "usage": {"input_tokens": 5}})
    assert (
        frames[-1]["data"]["usage"]["input_tokens"] == 0
        and frames[-1]["data"]["usage"]["output_tokens"] == 0
    )
    assert (
        more[-1]["data"]["usage"]["input_tokens"],
        more[-1]["data"]["usage"]["output_tokens"],
    ) == (5, 0)


async def test_scripted_chunks_and_sleep_ms_within_their_bounds_are_used(services):
    async with services.client() as client:
        _, frames = await run_turn(
            client, {"say": "one two three four", "chunks": 2, "sleep_ms": 1}
        )
    assert [f["data"]["chunk"] for f in frames if f["type"] == "response_chunk"] == [
        "one two ",
        "three four",
    ]


async def test_failed_tool_output_is_error_and_success_false(services):
    async with services.client() as client:
        _, frames = await run_turn(client, {"tool": "no_such_tool", "input": {}}, {"say": "done"})
    result = next(f for f in frames if f["type"] == "tool_result")["data"]["output"]
    assert result["success"] is False and isinstance(result["error"], str)


async def test_recursion_limit_of_100_steps_ends_the_run_with_an_error(services):
    steps = [{"tool": "get_available_integrations", "input": {}, "chunks": 1} for _ in range(60)]
    async with services.client() as client:
        body, frames = await run_turn(client, *steps)
    assert types(frames)[-2:] == ["error", "done"]
    assert "recursion limit" in frames[-2]["data"]["message"].lower()
    # steps 1..100 are 50 model calls and 50 tool executions; the 51st model call would be step 101
    assert sum(1 for t in types(frames) if t == "tool_result") == 50
    assert frames[-1]["data"]["usage"]["llm_calls"] == 50
    assert (await _run_row(services, body["run_id"])).status == "failed"


async def test_three_consecutive_tool_failures_publish_guidance_and_success_resets(services):
    bad = {"tool": "no_such_tool", "input": {}}
    good = {"tool": "get_available_integrations", "input": {}}
    async with services.client() as client:
        body, frames = await run_turn(client, bad, bad, bad, good, bad, bad, {"say": "giving up"})
    guidance = [f["data"] for f in frames if f["type"] == "guidance"]
    assert guidance == [{"message": guidance[0]["message"], "consecutive_failures": 3}]
    order = types(frames)
    third_result = [i for i, t in enumerate(order) if t == "tool_result"][2]
    assert order[third_result + 1] == "guidance"
    async with services.orchestrator.servicer.sessions() as session:
        system = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "system"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert [m.content for m in system] == [guidance[0]["message"]]
    assert frames[-1]["type"] == "done" and "error" not in frames[-1]["data"]


async def test_every_20th_model_call_publishes_guidance(services):
    steps = [
        {"tool": "get_available_integrations", "input": {}, "chunks": 1} for _ in range(41)
    ] + [{"say": "finished"}]
    async with services.client() as client:
        _, frames = await run_turn(client, *steps)
    milestones = [f["data"]["total_llm_calls"] for f in frames if f["type"] == "guidance"]
    assert milestones == [20, 40]
    assert frames[-1]["type"] == "done"


async def test_several_tool_calls_in_one_step_run_only_one_and_thread_stays_valid(services):
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {
                "tools": [
                    {"tool": "get_available_integrations", "input": {}},
                    {"tool": "get_organization_credentials", "input": {}},
                ]
            },
            {"say": "ok"},
        )
        assert types(frames).count("tool_call") == 1
        _, again = await run_turn(client, {"say": "next turn works"}, chat_id=body["chat_id"])
    assert again[-1]["type"] == "done"


async def test_second_turn_while_running_is_409(services):
    async with services.client() as client:
        body = await start(client, {"say": "slow", "sleep_ms": 2000})
        second = await client.post(
            "/assistant/chat", json={"message": "again", "chat_id": body["chat_id"]}
        )
        assert second.status_code == 409
        await client.post(f"/assistant/chat/{body['chat_id']}/cancel")


async def test_fifty_concurrent_turns_on_one_idle_chat_admit_exactly_one(services):
    async with services.client() as client:
        first, _ = await run_turn(client, {"say": "warm"})
        chat_id = first["chat_id"]
        async with services.orchestrator.servicer.sessions() as session:
            before = len(
                (await session.execute(select(Message).where(Message.chat_id == chat_id)))
                .scalars()
                .all()
            )
        responses = await asyncio.gather(
            *[
                client.post(
                    "/assistant/chat",
                    json={"message": '{"script":[{"say":"x","sleep_ms":300}]}', "chat_id": chat_id},
                )
                for _ in range(50)
            ]
        )
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] + [409] * 49
        winner = next(r.json() for r in responses if r.status_code == 200)
        await read_frames(client, winner["stream_url"])
    async with services.orchestrator.servicer.sessions() as session:
        runs = (await session.execute(select(Run).where(Run.chat_id == chat_id))).scalars().all()
        messages = (
            (
                await session.execute(
                    select(Message).where(Message.chat_id == chat_id, Message.role == "user")
                )
            )
            .scalars()
            .all()
        )
    assert len(runs) == 2 and len(messages) == 2
    assert before > 0


async def test_late_listener_and_many_listeners_get_every_event_in_order(services):
    async with services.client() as client:
        body = await start(
            client,
            {
                "say": "a b c d e f",
                "sleep_ms": 300,
                "tool": "get_available_integrations",
                "input": {},
            },
            {"say": "end"},
        )
        listeners = await asyncio.gather(
            *[read_frames(client, body["stream_url"]) for _ in range(5)]
        )
        late = await read_frames(client, body["stream_url"])
    assert all(frames == late for frames in listeners)


async def test_reconnect_with_after_gets_the_rest_without_gaps_or_repeats(services):
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "one two three four", "tool": "get_available_integrations", "input": {}},
            {"say": "bye now"},
        )
        for n in (0, 1, 3, len(frames) - 1, len(frames)):
            rest = await read_frames(client, body["stream_url"], params={"after": n})
            assert rest == frames[n:]
        assert (await client.get(body["stream_url"], params={"after": -1})).status_code == 400


async def test_heartbeat_after_silence(services):
    async with services.client() as client:
        body = await start(client, {"say": "late", "sleep_ms": 2300})
        frames = await read_frames(client, body["stream_url"], heartbeats=True)
    assert frames[1] == {"type": "heartbeat"}
    assert types(frames).count("heartbeat") >= 2
    assert frames[-1]["type"] == "done"


async def test_listener_disconnect_does_not_disturb_the_run(services):
    async with services.client() as client:
        body = await start(client, {"say": "x", "sleep_ms": 500}, {"say": "y"})
        async with client.stream("GET", body["stream_url"]) as response:
            async for _ in response.aiter_bytes():
                break
        await wait_for(
            lambda: services.orchestrator.runner.active.get(body["run_id"]) is None, timeout=10
        )
        await wait_for(
            lambda: not [t for t in asyncio.all_tasks() if t.get_name() == "sse-pump"], timeout=5
        )
        frames = await read_frames(client, body["stream_url"])
    assert frames[-1]["type"] == "done"
    assert (await _run_row(services, body["run_id"])).status == "completed"


async def test_unknown_run_on_listen_is_404(services):
    import uuid

    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "x"})
        assert (
            await client.get(f"/assistant/chat/{body['chat_id']}/listen/{uuid.uuid4()}")
        ).status_code == 404
        assert (
            await client.get(f"/assistant/chat/{uuid.uuid4()}/listen/{body['run_id']}")
        ).status_code == 404


async def test_tools_service_down_is_a_sanitized_error_result_and_the_run_goes_on(services):
    """The tools service down mid-conversation: the call is an error result for the model, which
    answers without it (the run is not failed); no address or traceback reaches the stream."""
    async with services.client() as client:
        await run_turn(client, {"tool": "get_available_integrations", "input": {}}, {"say": "ok"})
        await services.tools.stop(0)
        body, frames = await run_turn(
            client,
            {"tool": "get_available_integrations", "input": {}},
            {"say": "answered without it"},
        )
    assert types(frames)[-1] == "done" and "error" not in types(frames)
    result = next(f["data"]["output"] for f in frames if f["type"] == "tool_result")
    assert result == {
        "error": "the tools service is unavailable; try again later",
        "success": False,
    }
    assert "127.0.0.1" not in str(frames) and "Traceback" not in str(frames)
    assert frames[-1]["data"]["response"] == "answered without it"
    assert (await _run_row(services, body["run_id"])).status == "completed"
    assert (await _chat_row(services, body["chat_id"])).running_id is None


async def test_a_tool_call_cut_off_by_the_tools_service_going_away_says_it_may_have_run(services):
    # not "unavailable; try again later", which would invite the model to repeat an action that
    # may have happened
    slow = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "wait", "parameters": {"seconds": 20}},
    }
    async with services.client() as client:
        body = await start(client, slow, {"say": "answered without it"})
        await wait_for(
            lambda: any(
                e.HasField("tool_call")
                for e in services.orchestrator.runner.events.snapshot(body["run_id"])
            )
        )
        await asyncio.sleep(0.3)  # the call is in the tools service
        await services.tools.stop(0)
        frames = await read_frames(client, body["stream_url"])
    result = next(f["data"]["output"] for f in frames if f["type"] == "tool_result")
    assert result == {
        "error": "the tools service went away during the call; the call may have run",
        "success": False,
    }
    assert frames[-1]["type"] == "done" and frames[-1]["data"]["response"] == "answered without it"


async def test_a_turn_starts_and_answers_while_the_tools_service_is_down(services):
    """With the tools service stalled or down, a new turn still starts and answers: the run
    goes on with the tools it knows (the last answer, or the HITL tools alone) and a tool call
    gets an error result. A failed ListTools at run start must not fail (and charge) the turn
    after a 10 s deadline."""
    runner = services.orchestrator.runner
    async with services.client() as client:
        await services.tools.stop(0)
        runner._tool_defs = None  # nothing known yet: a fresh orchestrator
        _, first = await run_turn(client, {"say": "hello without tools"})
        assert types(first)[-1] == "done" and first[-1]["data"]["response"] == "hello without tools"
        runner._tool_defs = [
            {
                "name": "get_available_integrations",
                "description": "d",
                "input_schema": {"type": "object"},
            }
        ]
        runner._tool_defs_at = runner._tool_defs_retry_at = (
            0.0  # the last answer is stale: asked again, fails
        )
        _, second = await run_turn(
            client, {"tool": "get_available_integrations", "input": {}}, {"say": "still fine"}
        )
    assert types(second)[-1] == "done" and second[-1]["data"]["response"] == "still fine"
    result = next(f["data"]["output"] for f in second if f["type"] == "tool_result")
    assert result == {
        "error": "the tools service is unavailable; try again later",
        "success": False,
    }


async def test_listeners_of_one_run_share_one_upstream_stream(services):
    fanout = services.gateway.app.state.fanout
    async with services.client() as client:
        body = await start(client, {"say": "slow answer", "sleep_ms": 1500})
        listeners = [
            asyncio.create_task(read_frames(client, body["stream_url"])) for _ in range(20)
        ]
        await wait_for(lambda: fanout.active_runs() == 1)
        await asyncio.sleep(0.3)
        assert fanout.active_runs() == 1
        results = await asyncio.gather(*listeners)
    assert all(r == results[0] for r in results) and results[0][-1]["type"] == "done"
    await wait_for(lambda: fanout.active_runs() == 0)


async def test_out_of_range_usage_fails_the_run_cleanly_and_frees_the_chat(services):
    async with services.client() as client:
        for usage in (
            {"input_tokens": 2**62, "output_tokens": 1},
            {"input_tokens": -1000, "output_tokens": 5},
            {"input_tokens": "abc"},
        ):
            body, frames = await run_turn(client, {"say": "x", "usage": usage})
            assert types(frames)[-2:] == ["error", "done"], frames
            assert "usage" in frames[-2]["data"]["message"]
            assert frames[-1]["data"]["usage"]["total_tokens"] >= 0
            assert (await _chat_row(services, body["chat_id"])).running_id is None


def test_provider_usage_is_clamped_before_it_reaches_billing_or_events():
    from services.orchestrator.providers.base import TokenUsage, clamp_usage

    clamped = clamp_usage(
        TokenUsage(
            input_tokens=-5,
            output_tokens=2**62,
            cache_read_tokens=7,
            cache_write_tokens=True,
            estimated=True,
        )
    )
    assert (
        clamped.input_tokens,
        clamped.output_tokens,
        clamped.cache_read_tokens,
        clamped.cache_write_tokens,
    ) == (0, 0, 7, 0)
    assert clamped.estimated is True


async def test_reconnect_at_the_end_is_an_empty_stream_and_past_it_the_end_frame_every_time(
    services,
):
    # at the end (N = frames): nothing, every time (no 503s); past it (README "Stream end": the
    # client counted frames the stream no longer has, as after a crash): the run's end frame
    async with services.client() as client:
        body, frames = await run_turn(client, {"say": "short"})
        for n in [len(frames)] * 15:
            response = await client.get(body["stream_url"], params={"after": n})
            assert response.status_code == 200, response.text
            assert response.content == b""
        assert (
            await read_frames(client, body["stream_url"], params={"after": len(frames) + 3})
            == frames[-1:]
        )
        assert frames[-1]["type"] == "done"


async def test_a_busy_claim_on_a_chat_that_is_not_the_callers_is_still_404(services):
    # concurrent POSTs naming one unknown chat_id all get the same 404 as any request for an
    # unknown chat, not 409 RUN_IN_FLIGHT from the claim taken by the first
    unknown = str(uuid.uuid4())
    servicer = services.orchestrator.servicer
    assert await servicer._try_claim(unknown)
    try:
        async with services.client() as client:
            response = await client.post(
                "/assistant/chat", json={"message": "hi", "chat_id": unknown}
            )
            assert response.status_code == 404, response.text
            first = await client.post("/assistant/chat", json={"message": "hi"})
            chat_id = first.json()["chat_id"]
            await read_frames(client, first.json()["stream_url"])
            assert await servicer._try_claim(chat_id)
            try:
                busy = await client.post(
                    "/assistant/chat", json={"message": "again", "chat_id": chat_id}
                )
                assert busy.status_code == 409, busy.text
            finally:
                await servicer._unclaim(chat_id)
    finally:
        await servicer._unclaim(unknown)
