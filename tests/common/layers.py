"""Cases of a rule applied at several layers: each case gets the fixtures it may need and
starts what it tests (the four services, the tools service alone, or nothing)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import Stack, start_stack, stop_stack
from tests.tools.conftest import StartTools


@dataclass
class Fixtures:
    """What a layer's case may use: the test's folder and patcher, the tools service's
    factory and a local HTTP server (tests/tools/conftest.py)."""

    tmp_path: Any
    monkeypatch: pytest.MonkeyPatch
    start_tools: StartTools
    local_http: str


Case = Callable[[Fixtures], Awaitable[None]]


@asynccontextmanager
async def running_services(tmp_path: Any) -> AsyncIterator[Stack]:
    """The four services as the `services` fixture starts them."""
    running = await start_stack(tmp_path, gateway={"heartbeat_interval_s": 1.0})
    try:
        yield running
    finally:
        await stop_stack(running)


def on_services(check: Callable[[Stack], Awaitable[None]]) -> Case:
    """A case that runs `check` against the four services."""

    async def case(fixtures: Fixtures) -> None:
        async with running_services(fixtures.tmp_path) as services:
            await check(services)

    return case


def at_once(check: Callable[[], None]) -> Case:
    """A case that needs nothing started."""

    async def case(fixtures: Fixtures) -> None:
        check()

    return case
