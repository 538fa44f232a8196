"""The Integrations panel in a real browser: connected integrations first, a searchable browse of
the catalogue, each opening to its actions (cost, effects) and auth types."""

from __future__ import annotations

from playwright.async_api import expect

from tests.console.conftest import CONSOLE_LOOP, Console

pytestmark = CONSOLE_LOOP


async def test_browse_search_finds_github_and_opens_its_actions_none_for_no_match(
    console: Console,
) -> None:
    page = console.page
    await console.open("#/integrations")
    await page.fill("#browse input[name=search]", "no-such-integration-zzz")
    await expect(page.locator("#browse-results")).to_contain_text("No integration matches")
    await page.fill("#browse input[name=search]", "github")
    github = page.locator("#browse-results details[data-integration=github]")
    await github.locator("summary").click()
    body = github.locator(".integration-body")
    await expect(body).to_contain_text("Bearer token")  # its auth types
    row = body.locator("tr", has_text="create_repository")
    await expect(row).to_contain_text("millicredits")
    await expect(row.locator(".badge.effect")).to_have_text("create")
    await expect(body.locator("tr", has_text="list_repositories")).to_contain_text("reads only")
    await body.get_by_role("link", name="Add a credential").click()
    await expect(page.locator("#credential-form select[name=integration]")).to_have_value("github")


async def test_connected_lists_integrations_needing_no_credential_and_stored_ones(
    console: Console,
) -> None:
    page = console.page
    async with console.stack.client() as http:
        created = await http.post(
            "/credentials",
            json={
                "integration_name": "github",
                "auth_type": "bearer_token",
                "auth_data": {"token": "t"},
            },
        )
        assert created.status_code == 201
    await console.open("#/integrations")
    connected = page.locator("#connected")
    await expect(connected.locator("details[data-integration=github]")).to_be_visible()
    await expect(connected.locator("details[data-integration=arxiv]")).to_be_visible()
    assert await connected.locator("details[data-integration=postgresql]").count() == 0


async def test_browse_pages_through_the_catalogue(console: Console) -> None:
    page = console.page
    await console.open("#/integrations")
    pager = page.locator("#browse .pager")
    await expect(pager).to_contain_text("Page 1 of")
    first = await page.locator("#browse-results details").first.get_attribute("data-integration")
    await pager.get_by_role("button", name="Next →").click()
    await expect(pager).to_contain_text("Page 2 of")
    second = page.locator("#browse-results details").first
    await expect(second).not_to_have_attribute("data-integration", first or "")
