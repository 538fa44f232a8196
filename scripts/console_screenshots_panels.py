"""The organization panels' screenshots for docs/console.md, used by scripts/console_screenshots.py
(PANEL_SHOTS joins its SHOTS): credentials, a knowledge search, an integration opened, the usage.

Each shot stores what it shows over HTTP first (credentials, a knowledge base and its document),
then opens the panel as a user would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from playwright.async_api import Page

from tests.conftest import Stack

HANDBOOK = (
    b"Office holidays\n\nThe office closes on midsummer eve and reopens the Monday after.\n\n"
    b"Expenses\n\nSubmit receipts within 30 days; travel is booked through the portal.\n"
)


async def shot_credentials(page: Page, stack: Stack, base: str) -> None:
    """The credentials list, then the form for a GitHub token opened above it."""
    credentials = [
        {"integration_name": "github", "auth_type": "bearer_token", "auth_data": {"token": "x"}},
        {"integration_name": "airtable", "auth_type": "api_key", "auth_data": {"api_key": "x"}},
        {"integration_name": "slack", "auth_type": "bearer_token", "auth_data": {"token": "x"}},
    ]
    names = ["CI token", "Sales base", "Support workspace"]
    async with stack.client() as client:
        for body, name in zip(credentials, names, strict=True):
            answer = await client.post("/credentials", json={**body, "display_name": name})
            answer.raise_for_status()
    await page.goto(f"{base}#/credentials/github")
    await page.wait_for_selector("#credential-list td.cred-name")
    await page.wait_for_selector("#credential-form input[name=auth_token]")


async def shot_knowledge(page: Page, stack: Stack, base: str) -> None:
    """A knowledge base after an upload, with a search and its match."""
    async with stack.client() as client:
        created = await client.post(
            "/knowledge-bases", json={"name": "Handbook", "description": "Company policies"}
        )
        created.raise_for_status()
        kb = created.json()["id"]
        files = {"file": ("handbook.md", HANDBOOK, "text/markdown")}
        (await client.post(f"/knowledge-bases/{kb}/documents", files=files)).raise_for_status()
    await page.goto(f"{base}#/knowledge/{kb}")
    await page.fill("#knowledge-search input[name=query]", "midsummer")
    await page.click("#knowledge-search button[type=submit]")
    await page.wait_for_selector("#search-results .match")
    await page.locator("#knowledge-search").scroll_into_view_if_needed()


async def shot_integrations(page: Page, stack: Stack, base: str) -> None:
    """The browse searched for "github", opened to its actions, costs and effects."""
    await page.goto(f"{base}#/integrations")
    await page.fill("#browse input[name=search]", "github")
    github = page.locator("#browse-results details[data-integration=github]")
    await github.locator("summary").click()
    await github.locator("table.actions").wait_for()
    # the "Browse" heading just under the sticky top bar
    await page.evaluate(
        "window.scrollTo(0, document.querySelector('#browse').getBoundingClientRect().top"
        " + window.scrollY - 110)"
    )


async def shot_usage(page: Page, stack: Stack, base: str) -> None:
    """The run credits used this period (the earlier shots' turns) and the plan."""
    await page.goto(f"{base}#/usage")
    await page.wait_for_selector(".credit-words")


PANEL_SHOTS: dict[str, Callable[[Page, Stack, str], Awaitable[Any]]] = {
    "credentials": shot_credentials,
    "knowledge": shot_knowledge,
    "integrations": shot_integrations,
    "usage": shot_usage,
}
