"""Redis fails under a streaming run (issue "Scale-out that survives faults"): killed and
restarted empty, stopped for a minute, reachable but silent. Run ownership lives in
PostgreSQL, so the run must end with its owner's outcome (completed, the scripted answer),
every listener must get the run exactly (or a prefix and a "reconnect with ?after=N" frame,
then the rest), and nothing stored or charged may be lost or doubled (tests/faults/checker.py).

Shape: orchestrators o1, o2; gateways g1 -> o1, g2 -> o2; the run starts through g1 (o1 owns
it) and is listened to through both gateways (through g2 its events come from Redis, via o2).
Listeners that join after the fault use g3 -> o2 too, a gateway with no copy of the run yet, so
that o2 serves them from Redis from the first event (on g1 or g2 they would join the copy the
gateway already holds for the run's other listeners).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.faults.checker import assert_invariants
from tests.faults.cluster import FaultCluster
from tests.faults.listeners import Listener, wait_frames, wait_listeners
from tests.faults.turns import Run, long_turn, short_turn, start_turn
from tests.tcp_proxy import CuttableProxy

LEASE_S = 6.0  # short: a replica that wrongly reaps a live run during the outage shows up within it
REDIS_RETRY_S = 5.0  # followers give up on Redis after this (then the reconnect frame)


def _listeners(
    runs_clients: dict[str, httpx.AsyncClient], run: Run, *plan: tuple[str, str]
) -> list[Listener]:
    """Listeners of `run`: (name, gateway) each; a listener falls back to the other gateway."""
    listeners = []
    for name, gateway in plan:
        order = [gateway] + [g for g in runs_clients if g != gateway]
        listeners.append(Listener(name, run, [(g, runs_clients[g]) for g in order]))
    return listeners


async def _turns_after(
    faults: FaultCluster, clients: dict[str, httpx.AsyncClient], label: str
) -> tuple[list[Run], list[Listener]]:
    """A new short turn through each gateway once the fault is over (retrying a 503 for a while),
    each listened to through the other gateway: the cluster is back in service."""
    runs, listeners = [], []
    for via, other in (("g1", "g2"), ("g2", "g1")):
        run = await start_turn(
            clients[via], short_turn(f"{label}-{via}", sleep_ms=200), via=via, attempts=40
        )
        runs.append(run)
        listeners += _listeners(clients, run, (f"after {via} on {other}", other))
    for listener in listeners:
        listener.start()
    await wait_listeners(listeners, 30)
    return runs, listeners


@pytest.mark.timeout(200)
async def test_redis_killed_then_restarted_empty_while_a_run_streams(faults):
    await faults.start_default(lease_s=LEASE_S, redis_retry_s=REDIS_RETRY_S, late_gateway=True)
    g1, g2, g3 = faults.gateways
    async with faults.client(g1) as c1, faults.client(g2) as c2, faults.client(g3) as c3:
        clients = {"g1": c1, "g2": c2, "g3": c3}
        run = await start_turn(c1, long_turn(16, "killed"), via="g1")
        listeners = _listeners(
            clients,
            run,
            ("L1 on g1", "g1"),
            ("L2 on g1", "g1"),
            ("L3 on g2", "g2"),
            ("L4 on g2", "g2"),
        )
        for listener in listeners:
            listener.start()
        await wait_frames(listeners[2], 3)
        await asyncio.sleep(1.0)
        faults.redis.kill()
        killed_at = time.monotonic()
        await asyncio.sleep(3.0)
        await faults.redis.restart()
        print(f"Redis killed, restarted empty {time.monotonic() - killed_at:.1f} s later")
        # listeners that arrive just after the restart, on both gateways
        late = _listeners(clients, run, ("L5 late on g3", "g3"), ("L6 late on g3", "g3"))
        late[0].start(delay=0.5)
        late[1].start(delay=3.0)
        listeners += late
        await wait_listeners(listeners, 60)
        after, after_listeners = await _turns_after(faults, clients, "after-kill")
    await assert_invariants(faults, [run, *after], listeners + after_listeners)


@pytest.mark.timeout(300)
async def test_redis_stopped_for_a_minute_while_a_run_streams(faults):
    await faults.start_default(lease_s=LEASE_S, redis_retry_s=REDIS_RETRY_S, late_gateway=True)
    g1, g2, g3 = faults.gateways
    async with faults.client(g1) as c1, faults.client(g2) as c2, faults.client(g3) as c3:
        clients = {"g1": c1, "g2": c2, "g3": c3}
        run = await start_turn(c1, long_turn(80, "stopped", tick_s=2.0), via="g1")
        listeners = _listeners(
            clients, run, ("L1 on g1", "g1"), ("L2 on g2", "g2"), ("L3 on g2", "g2")
        )
        for listener in listeners:
            listener.start()
        await wait_frames(listeners[1], 3)
        await asyncio.sleep(1.0)
        faults.redis.pause()
        stopped_at = time.monotonic()
        try:
            await asyncio.sleep(60)
        finally:
            faults.redis.resume()
        print(f"Redis stopped (SIGSTOP) for {time.monotonic() - stopped_at:.1f} s")
        late = _listeners(clients, run, ("L4 late on g3", "g3"))
        late[0].start(delay=0.5)
        listeners += late
        await wait_listeners(listeners, 90)
        after, after_listeners = await _turns_after(faults, clients, "after-stop")
    await assert_invariants(faults, [run, *after], listeners + after_listeners)


@pytest.mark.timeout(200)
async def test_redis_reachable_but_silent_for_twenty_seconds(faults):
    proxy = CuttableProxy("127.0.0.1", faults.redis.port)
    await proxy.start()
    try:
        # both orchestrators reach Redis through the proxy; billing and tools directly
        await faults.start_default(
            lease_s=LEASE_S,
            redis_retry_s=REDIS_RETRY_S,
            late_gateway=True,
            orchestrator_redis_url=f"redis://127.0.0.1:{proxy.port}/0",
        )
        g1, g2, g3 = faults.gateways
        async with faults.client(g1) as c1, faults.client(g2) as c2, faults.client(g3) as c3:
            clients = {"g1": c1, "g2": c2, "g3": c3}
            run = await start_turn(c1, long_turn(36, "silent", tick_s=1.5), via="g1")
            listeners = _listeners(
                clients, run, ("L1 on g1", "g1"), ("L2 on g2", "g2"), ("L3 on g2", "g2")
            )
            for listener in listeners:
                listener.start()
            await wait_frames(listeners[1], 3)
            await asyncio.sleep(1.0)
            proxy.swallowing = True  # connections stay open; every byte either way is dropped
            try:
                await asyncio.sleep(20)
            finally:
                proxy.swallowing = False
            late = _listeners(clients, run, ("L4 late on g3", "g3"))
            late[0].start(delay=0.5)
            listeners += late
            await wait_listeners(listeners, 60)
            after, after_listeners = await _turns_after(faults, clients, "after-silence")
        await assert_invariants(faults, [run, *after], listeners + after_listeners)
    finally:
        await proxy.stop()
