"""A network partition of the run's orchestrator (the optional scenario, done with TCP proxies
rather than `ip netns`): o1 reaches PostgreSQL and Redis only through tests/tcp_proxy.py's
proxies, which go silent (every byte dropped, connections left open) for longer than the run
lease, then heal. o1 is alive and its gateway g1 still reaches it; it is only cut off from its
stores, as behind a partition.

Within the lease o2 must end the run (the owner is gone as far as the stores can tell): one
outcome, `failed`, error + done {error: true} on the stream once. When o1 comes back it finds
the run ended by another (README "Crash recovery": its late end is not stored, the stream takes
nothing more from it), and serves new turns. Every invariant of tests/faults/checker.py holds.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy.engine import make_url

from tests.faults.checker import assert_invariants
from tests.faults.listeners import Listener, wait_frames, wait_listeners
from tests.faults.turns import long_turn, short_turn, start_turn
from tests.tcp_proxy import CuttableProxy

LEASE_S = 6.0
PARTITION_S = 15.0


@pytest.mark.timeout(180)
async def test_run_owner_cut_off_from_postgresql_and_redis_past_its_lease(faults):
    database = make_url(faults.urls["orchestrator"])
    pg_proxy = CuttableProxy(database.host or "127.0.0.1", database.port or 5432)
    redis_proxy = CuttableProxy("127.0.0.1", faults.redis.port)
    await pg_proxy.start()
    await redis_proxy.start()
    try:
        o1_settings = {
            "LOOPLINE_ORCHESTRATOR_DATABASE_URL": database.set(
                host="127.0.0.1", port=pg_proxy.port
            ).render_as_string(hide_password=False),
            "LOOPLINE_REDIS_URL": f"redis://127.0.0.1:{redis_proxy.port}/0",
        }
        await faults.start_default(lease_s=LEASE_S, o1_settings=o1_settings)
        g1, g2 = faults.gateways
        async with faults.client(g1) as c1, faults.client(g2) as c2:
            run = await start_turn(c1, long_turn(40, "partitioned"), via="g1")
            run.expect = "failed"  # its owner is cut off past the lease: o2 ends it
            listeners = [
                Listener("L1 on g2", run, [("g2", c2), ("g1", c1)]).start(),
                Listener("L2 on g1", run, [("g1", c1), ("g2", c2)]).start(),
            ]
            await wait_frames(listeners[0], 3)
            await asyncio.sleep(1.0)
            pg_proxy.swallowing = redis_proxy.swallowing = True
            cut_at = time.monotonic()
            await wait_frames(listeners[0], 1, timeout=LEASE_S + 15, kind="done")
            print(
                f"o2 ended the run {time.monotonic() - cut_at:.1f} s into the partition "
                f"(lease {LEASE_S} s)"
            )
            await asyncio.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))
            pg_proxy.swallowing = redis_proxy.swallowing = False
            print(f"partition healed after {time.monotonic() - cut_at:.1f} s")
            late = Listener("L3 late on g2", run, [("g2", c2)]).start(delay=1.0)
            listeners.append(late)
            await wait_listeners(listeners, 60)
            # o1 has had time to notice, and must not write a second end
            await asyncio.sleep(LEASE_S)
            # o1 serves new turns again once healed (its next connections go through the healed
            # proxies)
            again = await start_turn(
                c1,
                short_turn("after the partition", sleep_ms=100),
                chat_id=run.chat_id,
                via="g1",
                attempts=40,
            )
            follow = Listener("L4 next turn on g1", again, [("g1", c1), ("g2", c2)]).start()
            await wait_listeners([follow], 40)
        await assert_invariants(faults, [run, again], [*listeners, follow])
    finally:
        await pg_proxy.stop()
        await redis_proxy.stop()
