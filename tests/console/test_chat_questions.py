"""The console's question forms: each kind answered in the browser resumes the turn, whose new
run's answer shows; Skip; a pending question shows when the chat is opened later; a credential
question offers the organization's credentials and an OAuth2 "Connect" that opens the provider,
after which the run resumes by itself and the page follows run_resumed."""

from __future__ import annotations

import json
from typing import Any

import pytest_asyncio
from playwright.async_api import Page, expect

from tests.conftest import start_stack, stop_stack
from tests.console.conftest import CONSOLE_LOOP, MODULE_LOOP, open_console
from tests.console.test_chat_turns import new_turn
from tests.gateway.test_oauth2_connect import acme_provider, oauth_server_app
from tests.orchestrator.helpers import run_turn
from tests.tools.tools_stack import serve_asgi

pytestmark = CONSOLE_LOOP

OPTIONS = [
    {"value": "red", "label": "Red"},
    {"value": "blue", "label": "Blue", "description": "the calm one"},
    {"value": "green", "label": "Green"},
]


async def answer_of(console, page: Page) -> Any:
    """The stored result of the chat's question tool call (what the model was given)."""
    chat_id = page.url.rsplit("/", 1)[-1]
    async with console.stack.client() as client:
        chat = (await client.get(f"/assistant/chat/{chat_id}")).json()
    results = [m["content"] for m in chat["messages"] if m["role"] == "tool"]
    assert len(results) == 1, results
    return results[0].get("answer", results[0])


async def resumed_answer(page: Page, text: str) -> None:
    """The resumed run (the second on the page) streams `text` and ends."""
    resumed = page.locator(".live .run").nth(1)
    await expect(resumed.locator(".answer")).to_have_text(text)
    await expect(resumed.locator(".run-status")).to_have_text("done")
    await expect(page.locator(".question-form")).to_have_count(0)
    await expect(page.locator(".chat-state")).to_have_text("idle")


async def test_single_choice_answered_in_the_form_resumes_the_turn(console):
    question = {"message": "Which colour?", "options": OPTIONS}
    page = await new_turn(console, {"tool": "ask_user_choice", "input": question}, {"say": "Blue!"})
    form = page.locator(".question-form[data-kind=single_choice]")
    await expect(form.locator(".question-message")).to_have_text("Which colour?")
    await expect(page.locator(".chat-state")).to_have_text("awaiting input")
    await form.get_by_label("Blue").check()
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Blue!")
    await expect(page.locator(".answer-message")).to_contain_text("Blue")
    assert (await answer_of(console, page))["selected_value"] == "blue"


async def test_multi_choice_answered_in_the_form_sends_every_checked_value(console):
    question = {"message": "Which?", "options": OPTIONS, "min_selections": 2, "max_selections": 2}
    page = await new_turn(
        console, {"tool": "ask_user_multi_choice", "input": question}, {"say": "Two."}
    )
    form = page.locator(".question-form[data-kind=multi_choice]")
    await form.get_by_label("Red").check()
    await form.locator(".answer-button").click()
    await expect(form.locator(".notice.error")).to_have_text("Pick 2 options.")  # not "2 and 2"
    await form.get_by_label("Green").check()
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Two.")
    assert (await answer_of(console, page))["selected_values"] == ["red", "green"]


async def test_yes_no_answered_with_its_labels(console):
    question = {"message": "Delete it?", "yes_label": "Delete", "no_label": "Keep"}
    page = await new_turn(console, {"tool": "ask_user_yes_no", "input": question}, {"say": "Kept."})
    form = page.locator(".question-form[data-kind=yes_no]")
    await expect(form.locator(".answer-yes")).to_have_text("Delete")
    await form.locator(".answer-no").click()
    await resumed_answer(page, "Kept.")
    assert (await answer_of(console, page))["answer"] is False


async def test_free_text_answered_in_the_form_and_hostile_text_stays_text(console):
    dialogs: list[str] = []
    console.page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    question = {"message": "<img src=x onerror=alert(1)>Name?", "placeholder": "a name"}
    page = await new_turn(
        console, {"tool": "ask_user_free_text", "input": question}, {"say": "Hello."}
    )
    form = page.locator(".question-form[data-kind=free_text]")
    await expect(form.locator(".question-message")).to_have_text(question["message"])
    await form.get_by_placeholder("a name").fill("<b>Ada</b>")
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Hello.")
    await expect(page.locator(".answer-message .text")).to_have_text("<b>Ada</b>")
    assert (await answer_of(console, page))["text"] == "<b>Ada</b>"
    assert await page.locator("#view img, #view b").count() == 0 and dialogs == []


async def test_skip_answers_skipped(console):
    question = {"message": "Sure?"}
    page = await new_turn(
        console, {"tool": "ask_user_yes_no", "input": question}, {"say": "Skipped then."}
    )
    await page.locator(".question-form .skip").click()
    await resumed_answer(page, "Skipped then.")
    assert (await answer_of(console, page))["skipped"] is True


async def test_a_pending_question_shows_its_form_when_the_chat_is_opened_later(console):
    question = {"message": "Which colour?", "options": OPTIONS}
    async with console.stack.client() as client:
        paused, _ = await run_turn(
            client, {"tool": "ask_user_choice", "input": question}, {"say": "Red it is."}
        )
    await console.open(f"#/chat/{paused['chat_id']}")
    page = console.page
    form = page.locator(".question-form")
    await expect(form).to_have_count(1)
    await expect(form.locator(".question-message")).to_have_text("Which colour?")
    # the paused run replays from its stream once: one card, one question
    await expect(page.locator(".live .run .run-status")).to_have_text("awaiting input")
    await expect(page.locator(".tool-card")).to_have_count(1)
    await form.get_by_label("Red").check()
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Red it is.")


async def test_cancel_while_a_question_waits_withdraws_it(console):
    page = await new_turn(console, {"tool": "ask_user_yes_no", "input": {"message": "Go?"}})
    await expect(page.locator(".question-form")).to_be_visible()
    await page.click(".cancel-run")
    await expect(page.locator(".live .cancelled")).to_be_visible()
    await expect(page.locator(".question-form")).to_have_count(0)
    await expect(page.locator(".composer .send")).to_be_enabled()


async def test_credential_question_answered_with_an_existing_credential(console):
    async with console.stack.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": "tok-1234567890"},
                "display_name": "<i>my token</i>",
            },
        )
        assert created.status_code == 201, created.text
    question = {"integration": "http", "message": "Connect HTTP"}
    page = await new_turn(
        console, {"tool": "request_credential", "input": question}, {"say": "Connected."}
    )
    form = page.locator(".question-form[data-kind=credential_request]")
    choice = form.locator(".credential-choice")
    await expect(choice.locator("option")).to_have_count(2)
    await choice.select_option(created.json()["credential_id"])
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Connected.")
    answer = await answer_of(console, page)
    assert answer["kind"] == "credential_added"
    assert answer["credential_id"] == created.json()["credential_id"]


@pytest_asyncio.fixture(loop_scope=MODULE_LOOP)
async def oauth_stack(tmp_path):
    """A stack whose tools service offers the OAuth2 integration `acme` on a local provider."""
    issued: dict[str, Any] = {}
    async with serve_asgi(oauth_server_app(issued)) as auth_base:
        providers = json.dumps([acme_provider(auth_base)])
        stack = await start_stack(
            tmp_path,
            tools={"tools_oauth2_integrations": providers},
            gateway={"heartbeat_interval_s": 1.0},
        )
        try:
            yield stack, auth_base
        finally:
            await stop_stack(stack)


async def test_connect_opens_the_providers_authorization_url_and_the_run_resumes(
    browser, oauth_stack
):
    stack, auth_base = oauth_stack
    console = await open_console(browser, stack)
    await console.sign_in()
    requested: list[str] = []
    console.page.context.on("request", lambda request: requested.append(request.url))
    page = await new_turn(
        console,
        {"tool": "request_credential", "input": {"integration": "acme", "message": "Acme?"}},
        {"say": "resumed by itself"},
    )
    form = page.locator(".question-form[data-kind=credential_request]")
    async with page.context.expect_page() as opened:
        await form.locator(".connect").click()
    popup = await opened.value
    await popup.wait_for_load_state()
    authorize = [url for url in requested if url.startswith(f"{auth_base}/authorize?")]
    assert len(authorize) == 1
    assert (
        "code_challenge_method=S256" in authorize[0] and "client_id=loopline-client" in authorize[0]
    )
    assert await popup.evaluate("window.opener") is None
    # the provider sent the popup back to the gateway's callback, which stored the credential
    assert popup.url.startswith(f"{stack.base_url}/credentials/oauth2/callback?")
    await expect(popup.locator("body")).to_contain_text('"status":"connected"')
    await expect(page.locator(".live .run").first.locator(".run-status")).to_have_text("resumed")
    await resumed_answer(page, "resumed by itself")
    assert console.errors == []


async def test_a_resumed_run_opened_later_streams_once_under_its_answered_question(console):
    question = {"message": "Which colour?", "options": OPTIONS}
    async with console.stack.client() as client:
        paused, frames = await run_turn(
            client,
            {"tool": "ask_user_choice", "input": question},
            {"say": "still going", "sleep_ms": 60_000},
        )
        resumed = await client.post(
            f"/assistant/chat/{paused['chat_id']}/resume",
            json={
                "request_id": frames[-1]["data"]["request_id"],
                "response": {"kind": "single_choice", "selected_value": "green"},
            },
        )
        assert resumed.status_code == 200, resumed.text
        await console.open(f"#/chat/{paused['chat_id']}")
        page = console.page
        # the question's card (the paused run's) holds the answer, which no frame carries
        card = page.locator(".history .tool-card")
        await expect(card).to_have_count(1)
        await expect(card.locator(".badge")).to_have_text("ok")
        await expect(card.locator(".tool-output")).to_contain_text('"selected_value": "green"')
        live = page.locator(".live .run")
        await expect(live).to_have_count(1)
        await expect(live).to_have_attribute("data-run-id", resumed.json()["run_id"])
        await expect(live.locator(".run-status")).to_have_text("streaming")
        await expect(page.locator(".chat-state")).to_have_text("running")
        await client.post(f"/assistant/chat/{paused['chat_id']}/cancel")
        await expect(live.locator(".run-status")).to_have_text("cancelled")


async def test_free_text_max_length_counts_without_surrounding_whitespace_as_the_server(console):
    question = {"message": "Five at most?", "placeholder": "short", "max_length": 5}
    page = await new_turn(
        console, {"tool": "ask_user_free_text", "input": question}, {"say": "Noted."}
    )
    form = page.locator(".question-form[data-kind=free_text]")
    await form.get_by_placeholder("short").fill("  👍👍👍👍👍  \n")
    await form.locator(".answer-button").click()
    await resumed_answer(page, "Noted.")
    assert (await answer_of(console, page))["text"].strip() == "👍👍👍👍👍"
