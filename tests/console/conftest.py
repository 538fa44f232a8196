"""The console in a real browser: headless Chromium (Debian's `chromium`, which `make test`
installs where it is missing) driven by Playwright against the four services in-process.

`console` is a page signed in to the stack's organization as its owner. Any uncaught error of
the page's scripts fails the test at teardown, so a view that breaks cannot pass unnoticed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from playwright.async_api import Browser, Page, async_playwright

from tests.conftest import Stack, start_stack, stop_stack

# Where the browser is: LOOPLINE_CHROMIUM, else Debian's chromium on PATH.
CHROMIUM = os.environ.get("LOOPLINE_CHROMIUM") or shutil.which("chromium") or ""
# Headless, and nothing that reaches for the internet (this machine's network is closed).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# Playwright's waits: a view shows its data within this many milliseconds or the test fails.
WAIT_MS = 15_000


@dataclass
class Console:
    """A browser page on the console of `stack`, and what its scripts reported."""

    page: Page
    stack: Stack
    errors: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{self.stack.base_url}/console/"

    async def open(self, hash_: str = "#/chats") -> None:
        """Go to the view `hash_` (signed in already)."""
        await self.page.goto(self.url + hash_)

    async def sign_in(self, api_key: str | None = None, org_id: str | None = None) -> None:
        """Fill and send the sign-in form; waits until the navigation shows."""
        await self.page.goto(self.url)
        await self.page.fill("input[name=api_key]", api_key or self.stack.api_key)
        await self.page.fill("input[name=organization_id]", org_id or self.stack.org_id)
        await self.page.click("#sign-in button[type=submit]")
        await self.page.wait_for_selector("#nav:not([hidden])", timeout=WAIT_MS)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not CHROMIUM:
        pytest.fail(
            "no Chromium: `make test` installs Debian's chromium package (or set LOOPLINE_CHROMIUM)"
        )
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield launched
        finally:
            await launched.close()


async def open_console(browser: Browser, stack: Stack, **context: Any) -> Console:
    """A new page (its own storage) on the console of `stack`, not signed in."""
    page = await (await browser.new_context(**context)).new_page()
    page.set_default_timeout(WAIT_MS)
    console = Console(page, stack)
    page.on("pageerror", lambda error: console.errors.append(str(error)))
    return console


@pytest.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    running = await start_stack(tmp_path, gateway={"heartbeat_interval_s": 1.0})
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest.fixture
async def console(browser: Browser, stack: Stack) -> AsyncIterator[Console]:
    """The console signed in as the stack's owner."""
    opened = await open_console(browser, stack)
    await opened.sign_in()
    yield opened
    assert opened.errors == [], f"the page's scripts failed: {opened.errors}"
