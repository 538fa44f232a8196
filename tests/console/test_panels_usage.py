"""The Usage panel in a real browser: the run credits used this period against the allowance,
the reset date, token and tool usage and the plan, before and after a turn run over HTTP."""

from __future__ import annotations

from playwright.async_api import expect

from tests.console.conftest import CONSOLE_LOOP, Console
from tests.orchestrator.helpers import run_turn, wait_for

pytestmark = CONSOLE_LOOP

OVERVIEW = "/dashboard/analytics/overview"


async def test_usage_shows_the_credit_a_turn_used_against_the_allowance(console: Console) -> None:
    stack, page = console.stack, console.page
    await console.open("#/usage")
    words = page.locator(".credit-words")
    await expect(words).to_contain_text("0 of ")
    async with stack.client() as http:
        _, frames = await run_turn(http, {"say": "hello"})
        assert frames[-1]["type"] == "done"

        async def charged() -> bool:
            usage = (await http.get(OVERVIEW)).json()["data"]["overview"]
            return usage["current_month_credit_usage"]["used_credit"] == 1

        await wait_for(charged, timeout=10, interval=0.1)  # billing sees the charge within ~0.2 s
        usage = (await http.get(OVERVIEW)).json()["data"]["overview"]["current_month_credit_usage"]
    await page.get_by_role("button", name="Refresh").click()
    await expect(words).to_have_text(f"1 of {usage['max_credit']:,} run credits used")
    bar = page.locator("#credit-bar")
    await expect(bar).to_have_attribute("value", "1")
    await expect(bar).to_have_attribute("max", str(usage["max_credit"]))
    await expect(page.locator("#credit-reset")).to_contain_text("Resets")
    await expect(page.locator(".stats")).to_contain_text(usage["plan"])
    await expect(page.locator(".stats")).to_contain_text(
        f"{usage['usage_millicredits']:,} millicredits"
    )
