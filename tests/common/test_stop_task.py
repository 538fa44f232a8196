"""services/common/tasks.py: stopping a background task loses no cancel."""

from __future__ import annotations

import asyncio

import pytest

from services.common.tasks import stop_task


async def test_the_tasks_cancel_is_not_raised_but_a_cancel_of_the_stopper_is():
    background = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    await stop_task(background)  # the task's own CancelledError stays inside
    assert background.cancelled()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.shield(asyncio.sleep(0.2))  # a cleanup that takes a while

    slow = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop_task(slow))
    await asyncio.sleep(0.05)
    stopper.cancel()  # was swallowed by contextlib.suppress(CancelledError): the stopper went on
    with pytest.raises(asyncio.CancelledError):
        await stopper


async def test_another_exception_of_the_task_is_raised():
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await stop_task(task)
