"""Every panel shown to a member-role key: the 403's detail as a notice, not a broken page."""

from __future__ import annotations

from playwright.async_api import Browser, expect

from tests.conftest import Stack
from tests.console.conftest import CONSOLE_LOOP, open_console

pytestmark = CONSOLE_LOOP

PANELS = ["#/credentials", "#/knowledge", "#/integrations", "#/keys", "#/usage"]


async def test_member_role_sees_the_403_detail_on_every_panel(
    browser: Browser, stack: Stack
) -> None:
    member = await stack.member("member")
    console = await open_console(browser, stack)
    await console.sign_in(api_key=member["api_key"])
    for hash_ in PANELS:
        await console.open(hash_)
        refused = console.page.locator("main .notice.error").first
        await expect(refused).to_contain_text("403 Your role in this organization cannot do this")
        await expect(console.page.locator("main h1")).to_be_visible()  # the panel is drawn
    assert console.errors == []
