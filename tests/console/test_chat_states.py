"""A run shows the state it is in, not one it left: a paused run answered says "answered", one
cancelled while its question waits says "cancelled" inside the run, a lost stream's open tool
cards say their state is unknown; a question answered in another tab reloads the chat; a failed
run's reason shows when the chat is opened later; Back after a new chat's first message leaves it;
free text is counted in characters; a missing chat offers no message box."""

from __future__ import annotations

import json

from playwright.async_api import Route, expect

from tests.conftest import script
from tests.console.conftest import CONSOLE_LOOP, Console
from tests.console.test_chat_questions import OPTIONS
from tests.console.test_chat_turns import new_turn, send
from tests.orchestrator.helpers import run_turn

pytestmark = CONSOLE_LOOP

CHOICE = {"tool": "ask_user_choice", "input": {"message": "Which colour?", "options": OPTIONS}}


async def test_an_answered_question_leaves_its_paused_run_answered(console: Console) -> None:
    page = await new_turn(console, CHOICE, {"say": "Blue!"})
    form = page.locator(".question-form")
    await form.get_by_label("Blue").check()
    await form.locator(".answer-button").click()
    paused = page.locator(".live .run").first
    await expect(paused.locator(".run-status")).to_have_text("answered")
    await expect(paused.locator(".tool-card .badge")).to_have_text("answered")
    await expect(paused.locator(".tool-card .tool-output")).to_have_text("Answered: Blue")
    await expect(paused).not_to_contain_text("The run paused for your answer.")
    await expect(page.locator(".live .run").nth(1).locator(".answer")).to_have_text("Blue!")
    await expect(page.locator(".composer-input")).to_be_focused()


async def test_cancel_while_a_question_waits_shows_cancelled_inside_the_run(
    console: Console,
) -> None:
    page = await new_turn(console, {"tool": "ask_user_yes_no", "input": {"message": "Go?"}})
    await expect(page.locator(".question-form")).to_be_visible()
    await page.click(".cancel-run")
    run = page.locator(".live .run")
    await expect(run.locator(".cancelled")).to_contain_text("Cancelled")
    await expect(run.locator(".run-status")).to_have_text("cancelled")
    await expect(run.locator(".tool-card .badge")).to_have_text("cancelled")
    await expect(page.locator(".chat-state")).to_have_text("idle")


async def test_a_lost_stream_marks_its_running_tool_cards_unknown(console: Console) -> None:
    page = console.page

    async def cut_after_the_tool_call(route: Route) -> None:
        if "after=" in route.request.url:
            await route.fulfill(status=404, json={"detail": "Run not found"})
            return
        real = await route.fetch()
        frames = (await real.text()).split("\n\n")
        upto = next(i for i, f in enumerate(frames) if '"tool_call"' in f)
        body = "\n\n".join([*frames[: upto + 1], ""])
        await route.fulfill(status=200, headers=dict(real.headers), body=body)

    await page.route("**/listen/**", cut_after_the_tool_call)
    await new_turn(console, {"tool": "get_available_integrations", "input": {}}, {"say": "ok"})
    run = page.locator(".live .run")
    await expect(run.locator(".run-status")).to_have_text("stream lost")
    await expect(run.locator(".tool-card .badge")).to_have_text("unknown (stream lost)")


async def test_a_question_answered_in_another_tab_reloads_the_chat_with_a_notice(
    console: Console,
) -> None:
    page = await new_turn(console, CHOICE, {"say": "Green it was."})
    form = page.locator(".question-form")
    await expect(form).to_be_visible()
    chat_id = page.url.rsplit("/", 1)[-1]
    async with console.stack.client() as client:
        status = (await client.get(f"/assistant/chat/{chat_id}/status")).json()
        elsewhere = await client.post(
            f"/assistant/chat/{chat_id}/resume",
            json={
                "request_id": status["pending_request_id"],
                "response": {"kind": "single_choice", "selected_value": "green"},
            },
        )
        assert elsewhere.status_code == 200, elsewhere.text
    await form.get_by_label("Red").check()
    await form.locator(".answer-button").click()  # 409: answered already
    await expect(page.locator(".chat-notices .notice")).to_contain_text("answered elsewhere")
    await expect(page.locator(".question-form")).to_have_count(0)
    await expect(page.locator("#view")).to_contain_text("Green it was.")
    await expect(page.locator(".chat-state")).to_have_text("idle")


async def test_a_failed_runs_reason_shows_when_the_chat_is_opened_later(console: Console) -> None:
    async with console.stack.client() as client:
        failed, frames = await run_turn(client, {"fail": "the provider broke"})
    # the reason is in the run's stream only (GET chat and its status say just "failed")
    reason = next(f["data"]["message"] for f in frames if f["type"] == "error")
    await console.open(f"#/chat/{failed['chat_id']}")
    history = console.page.locator(".history")
    await expect(history.locator(".badge.failed")).to_have_text("run failed")
    await expect(history.locator(".run-error")).to_have_text(f"Error: {reason}")


async def test_back_after_a_new_chats_first_message_leaves_the_chat(console: Console) -> None:
    page = console.page
    await console.open("#/chats")
    await page.click(".new-chat")
    await send(page, script({"say": "hello"}))
    await page.wait_for_url("**/console/#/chat/*")
    await expect(page.locator(".live .run-status")).to_have_text("done")
    await page.go_back()
    await page.wait_for_url("**/console/#/chats")
    await expect(page.locator("#view h1")).to_have_text("Chats")


async def test_free_text_length_is_counted_in_characters_and_ctrl_enter_sends(
    console: Console,
) -> None:
    question = {"message": "Mood?", "max_length": 3, "multiline": True}
    page = await new_turn(
        console, {"tool": "ask_user_free_text", "input": question}, {"say": "Noted."}
    )
    box = page.locator(".question-form textarea.free-text")
    assert await box.get_attribute("maxlength") is None  # it would count UTF-16 units
    await box.fill("😀😀😀😀")
    await box.press("Control+Enter")
    await expect(page.locator(".question-form .notice.error")).to_have_text(
        "Write at most 3 characters (this answer has 4)."
    )
    await box.fill("😀😀😀")  # 3 characters, 6 UTF-16 units
    await box.press("Control+Enter")
    await expect(page.locator(".live .run").nth(1).locator(".answer")).to_have_text("Noted.")
    chat_id = page.url.rsplit("/", 1)[-1]
    async with console.stack.client() as client:
        chat = (await client.get(f"/assistant/chat/{chat_id}")).json()
    answers = [m["content"] for m in chat["messages"] if m["role"] == "tool"]
    assert json.dumps(answers[0], ensure_ascii=False).count("😀") == 3


async def test_a_missing_chat_shows_its_404_and_no_message_box(console: Console) -> None:
    await console.open("#/chat/no-such-chat")
    page = console.page
    await expect(page.locator(".chat-notices .notice.error")).to_contain_text("404")
    await expect(page.locator(".composer")).to_be_hidden()
