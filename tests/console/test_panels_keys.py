"""The API keys panel in a real browser: a new key is shown once (gone after leaving the view),
signs in, and fails to sign in once revoked; revoked keys show behind a toggle."""

from __future__ import annotations

from playwright.async_api import Browser, expect

from tests.console.conftest import CONSOLE_LOOP, Console, open_console

pytestmark = CONSOLE_LOOP


async def create_key(console: Console, name: str) -> str:
    """Create a key named `name` from the panel; gives the key shown."""
    page = console.page
    await page.fill("input[name=key_name]", name)
    await page.click("#key-create button[type=submit]")
    shown = page.locator("#new-key-value")
    await expect(shown).to_be_visible()
    await expect(page.locator(".key-once")).to_contain_text("you will not see it again")
    return await shown.input_value()


async def test_new_key_is_shown_once_and_gone_after_navigating_away(console: Console) -> None:
    page = console.page
    await console.open("#/keys")
    key = await create_key(console, "deploy bot")
    row = page.locator("#key-list tr", has_text="deploy bot")
    await expect(row).to_contain_text("active")
    assert key not in await row.inner_text()  # the list shows the hint only
    await page.click("#nav a[data-nav=usage]")
    await page.click("#nav a[data-nav=keys]")
    await expect(page.locator("#key-list tr", has_text="deploy bot")).to_be_visible()
    assert await page.locator(".key-once").count() == 0
    assert key not in await page.content()


async def test_new_key_signs_in_revoked_key_does_not_and_shows_behind_the_toggle(
    console: Console, browser: Browser
) -> None:
    page = console.page
    await console.open("#/keys")
    key = await create_key(console, "laptop")
    fresh = await open_console(browser, console.stack)
    await fresh.sign_in(api_key=key)
    await expect(fresh.page.locator("#who")).to_contain_text(console.stack.org_id)
    row = page.locator("#key-list tr", has_text="laptop")
    await row.get_by_role("button", name="Revoke").click()
    await row.get_by_role("button", name="Yes, revoke").click()
    await expect(page.locator("#key-list")).not_to_contain_text("laptop")
    await page.check("input[name=include_revoked]")  # revoked keys behind the toggle
    revoked = page.locator("#key-list tr", has_text="laptop")
    await expect(revoked.locator(".badge")).to_have_text("revoked")
    await expect(revoked.get_by_role("button", name="Revoke")).to_have_count(0)
    later = await open_console(browser, console.stack)
    await later.page.goto(later.url)
    await later.page.fill("input[name=api_key]", key)
    await later.page.fill("input[name=organization_id]", console.stack.org_id)
    await later.page.click("#sign-in button[type=submit]")
    await expect(later.page.locator("#sign-in .notice.error")).to_contain_text("401")
    assert fresh.errors == [] and later.errors == []


async def test_key_with_bad_rate_limit_shows_the_400(console: Console) -> None:
    page = console.page
    await console.open("#/keys")
    await page.fill("input[name=key_name]", "too fast")
    await page.fill("input[name=rate_limit]", "999999999")
    await page.click("#key-create button[type=submit]")
    await expect(page.locator(".notice.error")).to_contain_text("400")


async def test_revoking_the_key_this_tab_signed_in_with_warns_first(console: Console) -> None:
    page = console.page
    await console.open("#/keys")
    await create_key(console, "other")
    rows = page.locator("table tr[data-key-id]")
    await expect(rows).to_have_count(2)
    for index in range(2):
        row = rows.nth(index)
        await row.get_by_role("button", name="Revoke").click()
        mine = "other" not in (await row.inner_text())
        warning = row.get_by_text("This is the key this console is signed in with")
        await expect(warning).to_have_count(1 if mine else 0)
        await row.get_by_role("button", name="Cancel").click()
