"""An orchestrator stops within its grace even when billing went down before its runs ended."""

from __future__ import annotations

import asyncio

from tests.conftest import start_stack
from tests.orchestrator.helpers import start
from tests.sse_client import read_frames


async def test_a_stop_right_after_runs_ended_with_billing_down_does_not_hang(tmp_path):
    """A SIGTERM within ~2 s of runs' `done` frames, with billing killed during the runs,
    stops the orchestrator: its usage sender, woken in the same loop turn as its cancel, must
    not survive asyncio.wait_for dropping that cancel and keep the process serving."""
    stack = await start_stack(tmp_path)
    try:
        async with stack.client() as client:
            bodies = [
                await start(
                    client,
                    {
                        "say": "end",
                        "usage": {"input_tokens": 300, "output_tokens": 50},
                        "sleep_ms": 800,
                    },
                )
                for _ in range(3)
            ]
            await asyncio.sleep(0.3)
            await stack.billing.stop(0)
            for body in bodies:
                assert (await read_frames(client, body["stream_url"]))[-1]["type"] == "done"
        began = asyncio.get_running_loop().time()
        stopping = asyncio.ensure_future(stack.orchestrator.stop(1))
        done, _ = await asyncio.wait({stopping}, timeout=12)
        assert done, "the orchestrator's stop hung"
        assert asyncio.get_running_loop().time() - began < 6
    finally:
        await stack.gateway.stop(1)
        await stack.tools.stop(1)
