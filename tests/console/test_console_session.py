"""Signing in and staying signed in: what a header cannot carry is refused before anything is sent
(and pasted invisible characters at the ends are trimmed), a key refused with 401 while signed in
signs the tab out with the reason, and the focus lands on the page's heading after sign-in."""

from __future__ import annotations

from playwright.async_api import expect

from tests.console.conftest import CONSOLE_LOOP, Console, open_console

pytestmark = CONSOLE_LOOP


async def test_sign_in_refuses_an_org_id_a_header_cannot_carry_before_sending(
    browser, stack
) -> None:
    console = await open_console(browser, stack)
    page = console.page
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "/auth/me" in r.url else None)
    await page.goto(console.url)
    await page.fill("input[name=api_key]", stack.api_key)
    await page.fill("input[name=organization_id]", "org_ab…cd")
    await page.click("#sign-in button[type=submit]")
    refused = page.locator("#sign-in .notice.error")
    await expect(refused).to_contain_text("organization id can hold only visible ASCII")
    await expect(refused).to_contain_text("U+2026")
    await expect(refused).not_to_contain_text("cannot be reached")
    assert sent == []
    assert console.errors == []


async def test_sign_in_trims_zero_width_and_white_space_pasted_around_the_key_and_org(
    browser, stack
) -> None:
    console = await open_console(browser, stack)
    await console.sign_in(
        api_key=f"\u200b {stack.api_key}\ufeff", org_id=f"{stack.org_id}\u200b\u2060 "
    )
    await expect(console.page.locator("#who")).to_contain_text(stack.org_id)
    assert console.errors == []


async def test_a_key_revoked_while_signed_in_signs_out_at_its_next_401(browser, stack) -> None:
    async with stack.client() as client:
        made = await client.post("/api-keys", json={"name": "soon revoked"})
        assert made.status_code == 201, made.text
        console = await open_console(browser, stack)
        await console.sign_in(api_key=made.json()["key"])
        page = console.page
        await expect(page.locator("h1")).to_have_text("Chats")
        revoked = await client.delete(f"/api-keys/{made.json()['id']}")
        assert revoked.status_code == 200, revoked.text
    await page.click("#nav a[data-nav=usage]")
    refused = page.locator("#sign-in .notice.error")
    await expect(refused).to_contain_text("Your API key was refused (401)")
    await expect(refused).to_contain_text("Sign in again")
    await expect(page.locator("#nav")).to_be_hidden()
    assert await page.evaluate("sessionStorage.length") == 0
    assert console.errors == []


async def test_the_focus_moves_to_the_pages_heading_after_sign_in(console: Console) -> None:
    await expect(console.page.locator("#view h1")).to_have_text("Chats")
    await expect(console.page.locator("#view h1")).to_be_focused()
