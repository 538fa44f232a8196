"""Screenshots of the web console for docs/console.md (docs/images/console-*.png, 1280x800).

Starts the four services in-process as the tests do (SQLite in a temporary folder, the scripted
model), signs a headless Chromium in, drives a few turns and saves one PNG per view. Run it after
changing the console's look:

    .venv/bin/python -m scripts.console_screenshots [--out docs/images]

Each shot is a function in SHOTS (name -> async function(page, stack, base)); add a view's shot
there. Needs Debian's chromium (`make chromium`) or LOOPLINE_CHROMIUM.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from playwright.async_api import Page, ViewportSize, async_playwright

from scripts.console_screenshots_panels import PANEL_SHOTS
from tests.conftest import Stack, start_stack, stop_stack
from tests.console.conftest import CHROMIUM, FLAGS
from tests.orchestrator.helpers import run_turn, start
from tests.sse_client import read_frames

SIZE: ViewportSize = {"width": 1280, "height": 800}
LIMIT_BYTES = 200_000


async def shot_chats(page: Page, stack: Stack, base: str) -> None:
    """The chats list with its states: ended, awaiting input, running."""
    async with stack.client() as client:
        # each chat's title is its first message: plain words, then the scripted turn
        chats: list[tuple[str, dict[str, Any]]] = [
            ("Summarize last week's failed deployments", {"say": "Done."}),
            (
                "Send the weekly report",
                {"tool": "ask_user_yes_no", "input": {"message": "Send it now?"}},
            ),
            ("Compare the two pricing sheets", {"say": "Still reading.", "sleep_ms": 120_000}),
        ]
        for title, steps in chats:
            first = await start(client, message=title)
            await read_frames(client, first["stream_url"])
            if "sleep_ms" in steps:
                await start(client, steps, chat_id=first["chat_id"])
            else:
                await run_turn(client, steps, chat_id=first["chat_id"])
    await page.goto(f"{base}#/chats")
    await page.reload()
    await page.wait_for_selector(".chat-row .chat-state.ended")


async def shot_turn(page: Page, stack: Stack, base: str) -> None:
    """A turn with a tool call (its card open), the streamed answer and the usage."""
    await page.goto(f"{base}#/chat")
    # without a script, the scripted model looks the integrations up and sums them up
    await page.fill(".composer-input", "Which integrations can I use?")
    await page.click(".composer .send")
    await page.wait_for_selector(".live .run .usage")
    await page.click(".live .tool-card summary")


async def shot_question(page: Page, stack: Stack, base: str) -> None:
    """A paused run's single-choice question as a form."""
    question = {
        "message": "Which database should I query?",
        "options": [
            {"value": "prod", "label": "Production", "description": "read-only replica"},
            {"value": "staging", "label": "Staging"},
        ],
        "allow_free_text": True,
    }
    async with stack.client() as client:
        first = await start(client, message="Count yesterday's signups")
        await read_frames(client, first["stream_url"])
        await run_turn(
            client, {"tool": "ask_user_choice", "input": question}, chat_id=first["chat_id"]
        )
    await page.goto(f"{base}#/chat/{first['chat_id']}")
    await page.wait_for_selector(".question-form")
    await page.locator(".question-form").scroll_into_view_if_needed()


async def shot_raw(page: Page, stack: Stack, base: str) -> None:
    """A run's raw frames, opened."""
    await page.goto(f"{base}#/chat")
    await page.fill(".composer-input", "Hello there")
    await page.click(".composer .send")
    await page.wait_for_selector(".live .run .usage")
    await page.click(".live .raw-frames > summary")


SHOTS: dict[str, Callable[[Page, Stack, str], Awaitable[Any]]] = {
    "chats": shot_chats,
    "turn": shot_turn,
    "question": shot_question,
    "raw-frames": shot_raw,
    **PANEL_SHOTS,  # the organization's panels (credentials, knowledge, integrations, usage)
}


async def main(out: pathlib.Path) -> None:
    """Start a stack, sign in, and save every shot of SHOTS under `out`."""
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stack = await start_stack(pathlib.Path(tmp))
        try:
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
                context = await browser.new_context(viewport=SIZE, color_scheme="light")
                page = await context.new_page()
                base = f"{stack.base_url}/console/"
                await page.goto(base)
                await page.fill("input[name=api_key]", stack.api_key)
                await page.fill("input[name=organization_id]", stack.org_id)
                await page.click("#sign-in button[type=submit]")
                await page.wait_for_selector("#nav:not([hidden])")
                for name, shoot in SHOTS.items():
                    await shoot(page, stack, base)
                    path = out / f"console-{name}.png"
                    await page.screenshot(path=str(path))
                    size = (await asyncio.to_thread(path.stat)).st_size
                    note = "" if size < LIMIT_BYTES else f" (over {LIMIT_BYTES // 1000} KB)"
                    print(f"{path} {size // 1000} KB{note}")
                await browser.close()
        finally:
            await stop_stack(stack)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/images"))
    asyncio.run(main(parser.parse_args().out))
