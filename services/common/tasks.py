"""Stopping background tasks without losing a cancel."""

from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has ended.

    The task's own CancelledError is not raised; a cancel of the caller while it waits is
    (`contextlib.suppress(CancelledError)` around the wait swallowed both, so a stop that was
    itself cancelled went on as if nothing happened). Another exception of the task is raised.
    A task whose loop can drop a cancel (Python 3.11's `asyncio.wait_for` returns a wait that
    finished in the same loop turn as a cancel) must also stop by a flag of its own.
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
