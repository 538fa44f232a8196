"""The console's stream survives a dropped connection: it reconnects with ?after=N (N the run's
frames it has, heartbeats not counted) and shows every frame exactly once; the gateway's own
"stream was interrupted" error is neither counted nor shown as the run's failure."""

from __future__ import annotations

import json

from playwright.async_api import Route, expect

from tests.conftest import script
from tests.console.conftest import CONSOLE_LOOP, open_console
from tests.console.test_chat_turns import send
from tests.sse_client import read_frames
from tests.tcp_proxy import CuttableProxy

pytestmark = CONSOLE_LOOP

WORDS = [f"w{i:02d} " for i in range(1, 16)]


async def server_frames(stack, page) -> list[str]:
    """The run's frames as the server keeps them (raw text without the blank line)."""
    run = page.locator(".live .run")
    chat_id = page.url.rsplit("/", 1)[-1]
    run_id = await run.get_attribute("data-run-id")
    raw: list[bytes] = []
    async with stack.client() as client:
        await read_frames(client, f"/assistant/chat/{chat_id}/listen/{run_id}", raw=raw)
    return [frame.decode().rstrip("\n") for frame in raw]


async def shown_frames(page) -> list[str]:
    """The run's frames in the page's raw panel (heartbeats and gateway notices left out)."""
    frames = page.locator(".live .run .raw-frame:not(.heartbeat):not(.gateway) pre")
    return await frames.all_text_contents()


async def test_a_cut_connection_reconnects_and_every_frame_shows_exactly_once(browser, stack):
    proxy = CuttableProxy("127.0.0.1", stack.gateway.port)
    await proxy.start()
    try:
        console = await open_console(browser, stack)
        page = console.page
        # the page reaches the gateway only through the proxy
        await page.goto(f"http://127.0.0.1:{proxy.port}/console/#/chat")
        await page.fill("input[name=api_key]", stack.api_key)
        await page.fill("input[name=organization_id]", stack.org_id)
        await page.click("#sign-in button[type=submit]")
        await page.wait_for_selector("#nav:not([hidden])")
        await send(page, script({"say": "".join(WORDS), "chunks": len(WORDS), "chunk_ms": 150}))
        answer = page.locator(".live .run .answer")
        await expect(answer).to_contain_text("w04")
        proxy.cut()
        await expect(page.locator(".live .run-status")).to_have_text("reconnecting…")
        proxy.restore()
        await expect(page.locator(".live .run-status")).to_have_text("done")
        await expect(answer).to_have_text("".join(WORDS))
        notes = await page.locator(".live .raw-note").all_text_contents()
        assert notes and all(n.startswith("reconnecting with ?after=") for n in notes)
        assert await shown_frames(page) == await server_frames(stack, page)
        assert console.errors == []
    finally:
        await proxy.stop()


async def test_the_gateways_interrupted_error_is_not_counted_nor_shown_as_a_failure(console):
    page = console.page
    listens: list[str] = []

    async def first_listen_interrupted(route: Route) -> None:
        listens.append(route.request.url)
        if "after=" in route.request.url:
            await route.continue_()
            return
        real = await route.fetch()
        frames = (await real.text()).split("\n\n")
        notice = {
            "type": "error",
            "data": {"message": "The event stream was interrupted; reconnect with ?after=2"},
        }
        body = "\n\n".join([*frames[:2], f"data: {json.dumps(notice)}", ""])
        await route.fulfill(status=200, headers=dict(real.headers), body=body)

    await page.route("**/listen/**", first_listen_interrupted)
    await console.open("#/chat")
    await send(page, script({"say": "one two three four", "chunks": 4}))
    await page.wait_for_url("**/console/#/chat/*")
    run = page.locator(".live .run")
    await expect(run.locator(".run-status")).to_have_text("done")
    await expect(run.locator(".answer")).to_have_text("one two three four")
    await expect(run.locator(".run-error")).to_have_count(0)
    await expect(run.locator(".raw-frame.gateway")).to_contain_text("not a run frame")
    assert [url.rsplit("?", 1)[-1] for url in listens][1:] == ["after=2"]
    assert await shown_frames(page) == await server_frames(console.stack, page)


async def test_a_runs_own_error_is_shown_and_ends_it_failed(console):
    await console.open("#/chat")
    page = console.page
    await send(page, script({"fail": "the provider broke"}))
    run = page.locator(".live .run")
    await expect(run.locator(".run-status")).to_have_text("failed")
    await expect(run.locator(".run-error")).to_contain_text("Error:")
    assert await shown_frames(page) == await server_frames(console.stack, page)
