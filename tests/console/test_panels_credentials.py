"""The Credentials panel in a real browser: a credential is added from its integration's auth
schema, listed without its secret, made default and deleted; markup in a name stays text; an
OAuth2 integration connects through the authorization page opened in a new window."""

from __future__ import annotations

import datetime
import json
from typing import Any

from playwright.async_api import Browser, expect

from tests.conftest import start_stack, stop_stack
from tests.console.conftest import CONSOLE_LOOP, Console, open_console
from tests.gateway.test_oauth2_connect import acme_provider, oauth_server_app
from tests.orchestrator.helpers import run_turn
from tests.tools.tools_stack import serve_asgi

pytestmark = CONSOLE_LOOP

SECRET = "ghp_console_secret_4f1c9a"
HOSTILE = '<img src=x onerror=alert(1)>"><script>alert(2)</script>'


async def add_github_token(console: Console, name: str) -> None:
    """Open the form, pick GitHub's personal access token, fill the secret and save."""
    page = console.page
    await page.click("#add-credential")
    form = page.locator("#credential-form")
    await form.locator("select[name=integration] option[value=github]").wait_for(state="attached")
    await form.locator("select[name=integration]").select_option("github")
    await form.locator("select[name=auth_type]").select_option(
        label="Personal Access Token (Bearer token)"
    )
    secret = form.locator("input[name=auth_token]")
    await expect(secret).to_have_attribute("type", "password")
    await secret.fill(SECRET)
    await form.locator("input[name=display_name]").fill(name)
    await form.locator("button.save").click()
    await expect(page.locator(".notice.ok")).to_contain_text("Saved")


async def test_credential_secret_never_shown_after_saving_and_delete_removes_it(
    console: Console,
) -> None:
    page = console.page
    await console.open("#/credentials")
    await expect(page.locator("#credential-list")).to_contain_text("No credentials yet")
    await add_github_token(console, "CI token")
    row = page.locator("#credential-list tr", has_text="CI token")
    await expect(row).to_contain_text("github")
    await expect(row).to_contain_text("Bearer token")
    await expect(row.locator(".badge.ok")).to_have_text("default")  # an integration's first
    assert SECRET not in await page.content()
    assert SECRET not in await page.locator("body").inner_text()
    values = await page.locator("input").evaluate_all("els => els.map(e => e.value)")
    assert SECRET not in values
    await row.get_by_role("button", name="Delete").click()
    await row.get_by_role("button", name="Yes, delete").click()
    await expect(page.locator("#credential-list")).to_contain_text("No credentials yet")
    async with console.stack.client() as http:
        assert (await http.get("/credentials")).json()["total"] == 0


async def test_credential_named_with_markup_is_shown_as_text_and_runs_nothing(
    console: Console,
) -> None:
    page = console.page
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    await console.open("#/credentials")
    await add_github_token(console, HOSTILE)
    cell = page.locator("#credential-list td.cred-name")
    await expect(cell).to_have_text(HOSTILE)
    assert await page.locator("#credential-list img, #credential-list script").count() == 0
    assert dialogs == []


async def test_a_saved_notice_isolates_the_name_so_its_direction_controls_stay_inside(
    console: Console,
) -> None:
    await console.open("#/credentials")
    await add_github_token(console, "\u202eevil")
    notice = console.page.locator(".notice.ok", has_text="Saved")
    # U+2068 ... U+2069 (first strong isolate ... pop directional isolate) around the name
    await expect(notice).to_have_text("Saved \u2068\u202eevil\u2069 (Bearer token).")


async def test_second_credential_can_be_made_the_default(console: Console) -> None:
    page = console.page
    await console.open("#/credentials")
    await add_github_token(console, "first")
    await add_github_token(console, "second")
    second = page.locator("#credential-list tr", has_text="second")
    await second.get_by_role("button", name="Make default").click()
    await second.get_by_role("button", name="Yes, make default").click()
    await expect(second.locator(".badge.ok")).to_have_text("default")
    first = page.locator("#credential-list tr", has_text="first")
    await expect(first.get_by_role("button", name="Make default")).to_be_visible()


async def test_integration_needing_no_credential_says_so(console: Console) -> None:
    page = console.page
    await console.open("#/credentials/arxiv")
    await expect(page.locator("#credential-form")).to_contain_text("needs no credential")


async def test_oauth2_connect_opens_the_authorization_page_without_opener_and_stores_it(
    browser: Browser, tmp_path
) -> None:
    issued: dict[str, Any] = {}
    async with serve_asgi(oauth_server_app(issued)) as auth_base:
        tools = {
            "tools_oauth2_integrations": json.dumps([acme_provider(auth_base)]),
            "tools_allow_private_network": True,  # the authorization server is on 127.0.0.1
        }
        stack = await start_stack(tmp_path, tools=tools)
        try:
            console = await open_console(browser, stack)
            await console.sign_in()
            page = console.page
            await console.open("#/credentials/acme")
            async with page.context.expect_page() as opened:
                await page.get_by_role("button", name="Connect Acme").click()
            popup = await opened.value
            # the authorization server sent the browser back to the gateway's callback
            await expect(popup.locator("body")).to_contain_text('"status":"connected"')
            assert await popup.evaluate("window.opener === null")
            await expect(page.locator("#credential-form")).to_contain_text("new window")
            await console.open("#/credentials")
            row = page.locator("#credential-list tr", has_text="acme")
            await expect(row).to_contain_text("OAuth2")
            assert "at-secret-123" not in await page.content()
            assert console.errors == []
        finally:
            await stop_stack(stack)


async def test_an_expired_credential_is_marked_and_not_offered_to_a_question(
    console: Console,
) -> None:
    async with console.stack.client() as http:
        for name, expires in [("old token", "2030-01-01T00:00:00Z"), ("new token", None)]:
            body = {
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": "tok-1234567890"},
                "display_name": name,
            }
            if expires:
                body["expires_at"] = expires
            assert (await http.post("/credentials", json=body)).status_code == 201
        paused, _ = await run_turn(
            http, {"tool": "request_credential", "input": {"integration": "http", "message": "?"}}
        )
    page = console.page
    await page.clock.set_fixed_time(datetime.datetime(2031, 1, 1, tzinfo=datetime.UTC))
    await console.open("#/credentials")
    old = page.locator("#credential-list tr", has_text="old token")
    await expect(old.locator(".badge.expired")).to_have_text("expired")
    await expect(page.locator("#credential-list tr", has_text="new token")).not_to_contain_text(
        "expired"
    )
    await console.open(f"#/chat/{paused['chat_id']}")
    choice = page.locator(".question-form .credential-choice option")
    await expect(choice).to_have_count(2)  # "Choose a credential" and the one not expired
    await expect(choice.nth(1)).to_contain_text("new token")


async def test_a_credential_question_offers_add_instead_of_connect_without_an_oauth_app(
    console: Console,
) -> None:
    async with console.stack.client() as http:
        paused, frames = await run_turn(
            http,
            {"tool": "request_credential", "input": {"integration": "github", "message": "?"}},
        )
    asked = next(f["data"] for f in frames if f["type"] == "user_input_request")
    assert any(o["auth_type"] == "oauth2" for o in asked["auth_options"])
    await console.open(f"#/chat/{paused['chat_id']}")
    form = console.page.locator(".question-form[data-kind=credential_request]")
    add = form.locator("a.add-credential")
    await expect(add).to_have_attribute("href", "#/credentials/github")
    await expect(form.locator(".connect")).to_have_count(0)


async def test_an_unknown_integration_in_the_address_says_so(console: Console) -> None:
    await console.open("#/credentials/no_such_integration")
    refused = console.page.locator("#credential-form .notice.error")
    await expect(refused).to_contain_text("There is no integration named")
    await expect(refused).to_contain_text("no_such_integration")
