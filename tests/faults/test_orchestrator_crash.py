"""The run's orchestrator dies (kill -9) mid model call or mid tool call: the run is lost with
its owner, so it must end `failed` within the lease bound (error + done {error: true} on its
stream, a cut-off tool call answered with an error result), its listener on the other gateway
must get those frames, a listener on the dead replica's gateway gets the reconnect frame and
the rest through the other gateway, and the turn is charged once (tests/faults/checker.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import script
from tests.faults.checker import assert_invariants
from tests.faults.listeners import Listener, wait_frames, wait_listeners
from tests.faults.turns import ECHO, Turn, echo_input, short_turn, start_turn, wait_input

LEASE_S = 6.0
DETECTION_MARGIN_S = 2.0  # the reaper's period (lease / 6) and a poll of the listener


async def _killed_mid(faults, turn: Turn, what: str, kill_after: str, count: int = 1) -> None:  # noqa: ANN001
    """Start `turn` through g1 (o1 owns it), listen through g2 and g1, kill o1 -9 once the
    listener on g2 has seen `count` `kill_after` frames, then check the run's end and bound."""
    await faults.start_default(lease_s=LEASE_S)
    o1, _ = faults.orchestrators
    g1, g2 = faults.gateways
    async with faults.client(g1) as c1, faults.client(g2) as c2:
        run = await start_turn(c1, turn, via="g1")
        run.expect = "failed"
        on_g2 = Listener("L1 on g2", run, [("g2", c2)]).start()
        on_g1 = Listener("L2 on g1 (then g2)", run, [("g1", c1), ("g2", c2)]).start()
        await wait_frames(on_g2, count, kind=kill_after)
        await wait_frames(on_g1, on_g2.received)
        await asyncio.sleep(LEASE_S / 2)  # o1 renews the run's lease at least once before it dies
        o1.kill()
        killed_at = time.monotonic()
        await wait_listeners([on_g2, on_g1], LEASE_S + 30)
        detected = (on_g2.ended_at or time.monotonic()) - killed_at
        print(
            f"o1 killed -9 mid {what}: the listener on g2 got the run's end {detected:.1f} s "
            f"later (lease {LEASE_S} s)"
        )
        # the chat takes a new turn through the surviving side
        again = await start_turn(
            c2, short_turn("after the crash", sleep_ms=100), chat_id=run.chat_id, via="g2"
        )
        follow = Listener("L3 next turn on g2", again, [("g2", c2)]).start()
        await wait_listeners([follow], 30)
    await assert_invariants(faults, [run, again], [on_g2, on_g1, follow])
    assert detected <= LEASE_S + DETECTION_MARGIN_S, (
        f"the crash was detected {detected:.1f} s after the kill "
        f"(bound {LEASE_S} s + {DETECTION_MARGIN_S} s)"
    )
    types = on_g2.received_types
    assert types[-2:] == ["error", "done"], types
    if what == "tool call":  # the call the crash cut off is answered
        cut = [f for f in on_g2.frames if f["type"] == "tool_result"][-1]["data"]
        assert cut["output"] == {"error": "not completed: the run failed", "success": False}, cut


@pytest.mark.timeout(120)
async def test_orchestrator_killed_mid_model_call(faults):
    turn = Turn(
        script(
            {"tool": ECHO, "input": echo_input("before the crash"), "say": "Checking first."},
            {"say": "never said", "sleep_ms": 120_000},
        ),
        "never said",
    )
    await _killed_mid(
        faults, turn, "model call", "tool_result"
    )  # the echo's result: the model call that sleeps is next


@pytest.mark.timeout(120)
async def test_orchestrator_killed_mid_tool_call(faults):
    turn = Turn(
        script(
            {"tool": ECHO, "input": echo_input("before the crash")},
            {"tool": ECHO, "input": wait_input(120), "say": "Waiting on the slow action."},
            {"say": "never said"},
        ),
        "never said",
    )
    await _killed_mid(
        faults, turn, "tool call", "tool_call", 2
    )  # the slow call (the first is the echo)
