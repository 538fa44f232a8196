"""The console's chat view in a browser: a whole turn streamed live, its tool cards, usage and
raw frames, a cancel, hostile text shown as text, refusals as notices, the chats list's states."""

from __future__ import annotations

import json

from playwright.async_api import Page, expect

from tests.conftest import script, start_stack, stop_stack
from tests.console.conftest import CONSOLE_LOOP, Console, open_console
from tests.orchestrator.helpers import run_turn, start
from tests.sse_client import read_frames

pytestmark = CONSOLE_LOOP


async def send(page: Page, message: str) -> None:
    """Type `message` into the composer and send it."""
    await page.fill(".composer-input", message)
    await page.click(".composer .send")


async def new_turn(console: Console, *steps: dict) -> Page:
    """Open a new chat and send a scripted message; waits for the chat's own URL."""
    page = console.page
    await console.open("#/chat")
    await send(page, script(*steps))
    await page.wait_for_url("**/console/#/chat/*")
    return page


async def test_a_whole_turn_streams_its_tool_card_answer_and_usage(console):
    page = await new_turn(
        console,
        {
            "tool": "get_available_integrations",
            "input": {},
            "usage": {"input_tokens": 3, "output_tokens": 2},
        },
        {"say": "Here are your integrations.", "usage": {"input_tokens": 4, "output_tokens": 3}},
    )
    run = page.locator(".live .run")
    card = run.locator(".tool-card")
    await expect(card.locator(".tool-name")).to_have_text("get_available_integrations")
    await expect(card.locator(".badge")).to_have_text("ok")
    await card.locator("summary").click()
    await expect(card.locator(".tool-input")).to_have_text("{}")
    output = json.loads(await card.locator(".tool-output").text_content() or "")
    assert any(i["name"] == "http" for i in output["integrations"])
    await expect(run.locator(".answer")).to_have_text("Here are your integrations.")
    await expect(run.locator(".usage")).to_have_text(
        "Usage: 7 input · 5 output · 12 total tokens · 2 LLM calls"
    )
    await expect(run.locator(".run-status")).to_have_text("done")
    await expect(page.locator(".chat-state")).to_have_text("idle")


async def test_a_failed_tool_result_is_marked_failed(console):
    page = await new_turn(console, {"tool": "no_such_tool", "input": {}}, {"say": "ok"})
    card = page.locator(".live .tool-card")
    await expect(card).to_have_class("tool-card failed")
    await expect(card.locator(".badge")).to_have_text("failed")


async def test_a_second_turn_continues_the_chat_under_its_history(console):
    page = await new_turn(console, {"say": "first answer"})
    await expect(page.locator(".live .run-status")).to_have_text("done")
    await send(page, script({"say": "second answer"}))
    await expect(page.locator(".live .run")).to_have_count(2)
    await expect(page.locator(".live .run").nth(1).locator(".answer")).to_have_text("second answer")
    await page.reload()
    await expect(page.locator(".history .answer")).to_have_text(["first answer", "second answer"])
    await expect(page.locator(".live .run")).to_have_count(0)


async def test_cancel_of_a_slow_run_shows_cancelled(console):
    page = await new_turn(console, {"say": "never shown", "sleep_ms": 60_000})
    await expect(page.locator(".live .run-status")).to_have_text("streaming")
    await page.click(".cancel-run")
    await expect(page.locator(".live .cancelled")).to_contain_text("Cancelled")
    await expect(page.locator(".live .run-status")).to_have_text("cancelled")
    await expect(page.locator(".cancel-run")).to_be_hidden()
    await expect(page.locator(".composer .send")).to_be_enabled()


async def test_the_raw_frames_view_lists_every_frame_as_the_wire_carried_it(console):
    # a run quiet for longer than the heartbeat interval (1 s here) gets heartbeats
    page = await new_turn(console, {"say": "one two three", "sleep_ms": 2500})
    run = page.locator(".live .run")
    await expect(run.locator(".run-status")).to_have_text("done")
    chat_id = page.url.rsplit("/", 1)[-1]
    run_id = await run.get_attribute("data-run-id")
    async with console.stack.client() as client:
        raw: list[bytes] = []
        await read_frames(client, f"/assistant/chat/{chat_id}/listen/{run_id}", raw=raw)
    await run.locator(".raw-frames > summary").click()
    shown = await run.locator(".raw-frame:not(.heartbeat) pre").all_text_contents()
    assert shown == [frame.decode().rstrip("\n") for frame in raw]
    heartbeats = run.locator(".raw-frame.heartbeat")
    assert await heartbeats.count() >= 1
    await expect(heartbeats.first).to_contain_text("heartbeat (not counted)")
    await expect(heartbeats.first.locator("pre")).to_have_text('data: {"type":"heartbeat"}')


HOSTILE = '<img src=x onerror=alert(1)> <script>alert(2)</script> <b id="bold">b</b>'


async def test_hostile_model_and_tool_text_shows_literally_and_never_runs(console):
    page = console.page
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    await new_turn(
        console,
        {"tool": "<img src=x onerror=alert(3)>", "input": {"html": HOSTILE}},
        {
            "tool": "execute_integration_tool",
            "input": {"integration": HOSTILE, "action": "x", "parameters": {}},
        },
        {"say": HOSTILE},
    )
    live = page.locator(".live")
    await expect(live.locator(".answer")).to_have_text(HOSTILE)
    cards = live.locator(".tool-card")
    await expect(cards.first.locator(".tool-name")).to_have_text("<img src=x onerror=alert(3)>")
    await expect(cards.nth(1).locator(".tool-output")).to_contain_text(HOSTILE.replace('"', '\\"'))
    await page.reload()  # and from the stored history
    await expect(page.locator(".history .answer")).to_have_text(HOSTILE)
    assert await page.locator("#view img, #view script, #bold").count() == 0
    assert dialogs == []


async def test_chat_list_shows_running_awaiting_and_ended_states(console):
    async with console.stack.client() as client:
        ended, _ = await run_turn(client, {"say": "done"})
        asked, _ = await run_turn(
            client, {"tool": "ask_user_yes_no", "input": {"message": "Sure?"}}, {"say": "ok"}
        )
        running = await start(client, {"say": "slow", "sleep_ms": 60_000})
        await console.open("#/chats")
        page = console.page
        await page.reload()  # the sign-in showed #/chats before these chats existed
        for chat_id, state in [
            (ended["chat_id"], "ended (completed)"),
            (asked["chat_id"], "awaiting input"),
            (running["chat_id"], "running"),
        ]:
            row = page.locator(f'.chat-row[data-chat-id="{chat_id}"]')
            await expect(row.locator(".chat-state")).to_have_text(state)
        # newest first
        ids = await page.locator(".chat-row").evaluate_all(
            "rows => rows.map(r => r.dataset.chatId)"
        )
        assert ids == [running["chat_id"], asked["chat_id"], ended["chat_id"]]
        await page.click(f'.chat-row[data-chat-id="{running["chat_id"]}"] a')
        await expect(page.locator(".live .run-status")).to_have_text("streaming")
        await client.post(f"/assistant/chat/{running['chat_id']}/cancel")


async def test_new_chat_button_opens_an_empty_chat(console):
    await console.open("#/chats")
    await console.page.click(".new-chat")
    await expect(console.page.locator(".chat-title")).to_have_text("New chat")
    await expect(console.page.locator(".composer-input")).to_be_focused()


NO_CREDITS = """
[plans.none]
monthly_run_credits = 0
wallet_overage = false
wallet_price_minor = 0
"""


async def test_a_billing_denial_shows_its_reason_as_a_notice(browser, tmp_path):
    plans = tmp_path / "plans.toml"
    plans.write_text(NO_CREDITS)
    stack = await start_stack(
        tmp_path, billing={"billing_plans_path": plans, "billing_default_plan": "none"}
    )
    try:
        console = await open_console(browser, stack)
        await console.sign_in()
        await console.open("#/chat")
        await send(console.page, "hello")
        refused = console.page.locator(".chat-notices .notice.error")
        await expect(refused).to_contain_text("Refused (402) [credit_plan_exhausted]")
        await expect(console.page.locator(".composer-input")).to_have_value("hello")
        assert console.errors == []
    finally:
        await stop_stack(stack)


async def test_guidance_is_marked_live_and_failed_cards_stay_in_the_history(console):
    failing = {"tool": "no_such_tool", "input": {}}
    page = await new_turn(console, failing, failing, failing, {"say": "giving up"})
    live = page.locator(".live .run")
    await expect(live.locator(".run-status")).to_have_text("done")
    await expect(live.locator(".guidance")).to_have_count(1)
    await expect(live.locator(".guidance")).to_contain_text("Guidance:")
    await expect(live.locator(".tool-card.failed")).to_have_count(3)
    await page.reload()
    history = page.locator(".history")  # (GET chat does not return the guidance)
    await expect(history.locator(".tool-card.failed")).to_have_count(3)
    card = history.locator(".tool-card").first
    await card.locator("summary").click()
    assert json.loads(await card.locator(".tool-output").text_content() or "")["success"] is False


async def test_a_summary_in_the_history_is_marked(browser, tmp_path):
    stack = await start_stack(
        tmp_path,
        orchestrator={"summarization_budget_tokens": 400, "summarization_keep_tokens": 150},
    )
    try:
        chat_id = None
        async with stack.client() as client:
            for turn in range(5):
                body = await start(
                    client, {"say": f"answer {turn} " + "words " * 40}, chat_id=chat_id
                )
                chat_id = body["chat_id"]
                await read_frames(client, body["stream_url"])
        console = await open_console(browser, stack)
        await console.sign_in()
        await console.open(f"#/chat/{chat_id}")
        summary = console.page.locator(".history .summary-message")
        await expect(summary.first).to_contain_text("summary of the earlier conversation")
        assert console.errors == []
    finally:
        await stop_stack(stack)


async def test_a_member_role_sees_the_403_detail_on_the_chat_views(browser, stack):
    member = await stack.member("member")
    console = await open_console(browser, stack)
    await console.sign_in(api_key=member["api_key"])
    await console.open("#/chats")
    refused = console.page.locator("main .notice.error")
    await expect(refused).to_contain_text("Refused (403)")
    await console.open("#/chat")
    await send(console.page, "hello")
    await expect(refused).to_contain_text("Refused (403)")
    assert console.errors == []
