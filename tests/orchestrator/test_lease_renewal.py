"""Run ownership lives in the database alone: leases are renewed whatever Redis does.

A reliability test saw a replica stop renewing its runs' leases while Redis was away (the
renewal shared a step with the Redis poll of cancel flags, which raised first), so another
replica reaped its live runs as lost. Renewal is now a task of its own.
"""

from __future__ import annotations

import asyncio
import types

from services.orchestrator.recovery import RunSupervisor


class _RedisAway:
    """A distributed backend whose every Redis call fails, or hangs, like a Redis that is away."""

    distributed = True

    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.events = types.SimpleNamespace(restore_lost=self._fail)

    async def _fail(self, *_: object) -> dict:
        if self.hang:
            await asyncio.sleep(3600)
        raise ConnectionError("Redis is away")

    pending_cancels = _fail


async def _renewals_while_redis_is(hang: bool) -> int:
    runner = types.SimpleNamespace(
        active={"run-1": types.SimpleNamespace(cancel_reason=None, finishing=False)},
        unsettled_runs=lambda: ["run-1"],
    )
    supervisor = RunSupervisor(
        types.SimpleNamespace(run_lease_s=0.4), None, runner, _RedisAway(hang)
    )
    renewals: list[float] = []

    async def renew() -> int:
        renewals.append(asyncio.get_running_loop().time())
        return 1

    async def nothing() -> None:
        return None

    supervisor.renew = renew  # type: ignore[method-assign]
    supervisor._reap_and_settle = nothing  # type: ignore[method-assign]
    supervisor.start()
    await asyncio.sleep(0.55)
    await supervisor.stop()
    return len(renewals)


async def test_leases_are_renewed_while_redis_refuses_connections():
    assert (
        await _renewals_while_redis_is(hang=False) >= 4
    )  # every run_lease_s / 4; before: none at all


async def test_leases_are_renewed_while_redis_does_not_answer():
    assert await _renewals_while_redis_is(hang=True) >= 4
