"""The console in a real browser: headless Chromium (Debian's `chromium`, which `make test`
installs where it is missing) driven by Playwright against the four services in-process.

The browser and the stack are started once per module (a stack and Chromium take seconds to
start, a test a second or two): every test of tests/console runs in its module's event loop, and
`stack` gives each test an organization of its own, with a new owner, on the module's stack (a test
that needs other settings starts its own with `start_stack`). `console` is a page, in a browser
context of its own, signed in as that owner. Any uncaught error of the page's scripts fails the test
at teardown, so a view that breaks cannot pass unnoticed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright

from services.gateway import identity
from tests.conftest import Stack, start_stack, stop_stack

# The loop every test and async fixture of tests/console runs in (see the module's docstring): each
# test module sets `pytestmark = CONSOLE_LOOP`.
MODULE_LOOP: Final = "module"
CONSOLE_LOOP = pytest.mark.asyncio(loop_scope=MODULE_LOOP)

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


@pytest_asyncio.fixture(scope="module", loop_scope=MODULE_LOOP)
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


@pytest_asyncio.fixture(scope="module", loop_scope=MODULE_LOOP)
async def module_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    running = await start_stack(
        tmp_path_factory.mktemp("stack"), gateway={"heartbeat_interval_s": 1.0}
    )
    try:
        yield running
    finally:
        await stop_stack(running)


@pytest_asyncio.fixture(loop_scope=MODULE_LOOP)
async def stack(module_stack: Stack) -> Stack:
    """The module's stack, as an organization of this test's own with a new owner."""
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    owner = await identity.create_member(module_stack.gateway.sessions, org_id, "owner")
    return dataclasses.replace(
        module_stack, org_id=org_id, api_key=owner["api_key"], user_id=owner["user_id"]
    )


@pytest_asyncio.fixture(loop_scope=MODULE_LOOP)
async def console(browser: Browser, stack: Stack) -> AsyncIterator[Console]:
    """The console signed in as the stack's owner."""
    opened = await open_console(browser, stack)
    await opened.sign_in()
    yield opened
    assert opened.errors == [], f"the page's scripts failed: {opened.errors}"
