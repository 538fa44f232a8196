"""Load across replicas, no fault: 500 runs started through g1 (run by o1), each followed by 3
listeners through g2 (served by o2 from Redis), with bounded concurrency so that a 2-core
machine copes. Every one of the 1,500 listeners must get the whole run and its end on one
connection, with no "event store is unreachable" frame, and every invariant of
tests/faults/checker.py must hold for every run.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from tests.conftest import script
from tests.faults.checker import assert_invariants
from tests.faults.listeners import Listener, wait_listeners
from tests.faults.turns import ECHO, Run, Turn, echo_input, start_turn

RUNS = 500


def _turn(i: int) -> Turn:
    """About a second of run: a model step and a tool call, then the answer in 4 chunks."""
    answer = f"Load answer {i}: alpha beta gamma delta epsilon."
    return Turn(
        script(
            {
                "tool": ECHO,
                "input": echo_input(f"load {i}"),
                "say": f"Run {i} checks. ",
                "sleep_ms": 500,
            },
            {"say": answer, "chunks": 4, "sleep_ms": 500},
        ),
        answer,
    )


LISTENERS_PER_RUN = 3
# runs at a time, each with its listeners: 25 keeps the client and the services within a 2-core
# machine (at 50, with listeners joining as soon as the POST answers, g2's answer to a listen took
# up to 5-8 s under load: LOOPLINE_FAULTS_LOAD_IN_FLIGHT=50 shows it)
IN_FLIGHT = int(os.environ.get("LOOPLINE_FAULTS_LOAD_IN_FLIGHT", "25"))


@pytest.mark.timeout(420)
async def test_500_runs_each_followed_by_3_listeners_through_the_other_replica(faults):
    await faults.start_default(lease_s=10.0, redis_retry_s=30.0)
    g1, g2 = faults.gateways
    runs: list[Run] = []
    listeners: list[Listener] = []
    failures: list[str] = []
    gate = asyncio.Semaphore(IN_FLIGHT)
    limits = httpx.Limits(
        max_connections=IN_FLIGHT * (LISTENERS_PER_RUN + 1) + 10,
        max_keepalive_connections=IN_FLIGHT * 4,
    )
    began = time.monotonic()
    async with faults.client(g1, limits=limits) as c1, faults.client(g2, limits=limits) as c2:

        async def one(i: int) -> None:
            async with gate:
                try:
                    run = await start_turn(c1, _turn(i), via="g1", attempts=3)
                except AssertionError as error:
                    failures.append(str(error))
                    return
                runs.append(run)
                mine = [
                    Listener(f"run {i} listener {k} on g2", run, [("g2", c2)]).start()
                    for k in range(LISTENERS_PER_RUN)
                ]
                listeners.extend(mine)
                await wait_listeners(mine, 60)

        await asyncio.gather(*(one(i) for i in range(RUNS)))
    took = time.monotonic() - began
    print(
        f"{len(runs)} runs, {len(listeners)} listeners in {took:.1f} s "
        f"({len(runs) / took:.1f} runs/s)"
    )
    assert not failures, f"{len(failures)} turn starts failed, e.g. {failures[:3]}"
    await assert_invariants(
        faults, runs, listeners, allow_reconnects=False, forbid=("event store is unreachable",)
    )
