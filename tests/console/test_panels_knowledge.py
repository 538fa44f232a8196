"""The Knowledge panel in a real browser: a base is created, a text file uploaded and found by
search; a document holding markup is shown as text; the upload route's refusals are shown."""

from __future__ import annotations

from playwright.async_api import expect

from tests.console.conftest import CONSOLE_LOOP, Console

pytestmark = CONSOLE_LOOP

HOSTILE = "<img src=x onerror=alert(1)>"


async def create_base(console: Console, name: str) -> None:
    """Create a knowledge base from the list view; the view then opens it."""
    page = console.page
    await console.open("#/knowledge")
    await page.fill("input[name=kb_name]", name)
    await page.click("#knowledge-create button[type=submit]")
    await expect(page.locator("h1")).to_have_text(name)


async def upload(console: Console, name: str, data: bytes, mime: str = "text/plain") -> None:
    page = console.page
    await page.set_input_files(
        "#knowledge-upload input[name=file]", {"name": name, "mimeType": mime, "buffer": data}
    )
    await page.click("#knowledge-upload button[type=submit]")


async def test_base_created_file_uploaded_and_found_by_search(console: Console) -> None:
    page = console.page
    await create_base(console, "Handbook")
    await page.fill("#knowledge-search input[name=query]", "midsummer")
    await page.click("#knowledge-search button[type=submit]")
    await expect(page.locator("#search-results")).to_contain_text("Nothing matches")
    await upload(console, "holidays.txt", b"Office holidays: the office closes on midsummer eve.\n")
    await expect(page.locator("#knowledge-upload .notice.ok")).to_contain_text(
        "Indexed holidays.txt"
    )
    await expect(page.locator("#documents")).to_contain_text("holidays.txt")
    await expect(page.locator(".kb-facts")).to_contain_text("1 document, 1 chunk")
    await page.fill("#knowledge-search input[name=query]", "midsummer")
    await page.click("#knowledge-search button[type=submit]")
    match = page.locator("#search-results .match").first
    await expect(match).to_contain_text("holidays.txt")
    await expect(match.locator(".match-text")).to_contain_text("closes on midsummer eve")
    await expect(match.locator(".badge")).to_contain_text("score")
    await expect(match).to_contain_text("words 1")  # the one query word is in the chunk
    await console.open("#/knowledge")
    row = page.locator("#knowledge-list tr", has_text="Handbook")
    await expect(row.locator("td").nth(2)).to_have_text("1")  # documents


async def test_document_with_markup_is_found_and_shown_as_text(console: Console) -> None:
    page = console.page
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    await create_base(console, HOSTILE)  # a base's name is hostile too
    await upload(console, f"{HOSTILE}.txt", f"payload {HOSTILE} inside\n".encode())
    await expect(page.locator("#knowledge-upload .notice.ok")).to_be_visible()
    await page.fill("#knowledge-search input[name=query]", "payload")
    await page.click("#knowledge-search button[type=submit]")
    await expect(page.locator("#search-results .match-text")).to_contain_text(HOSTILE)
    assert await page.locator("main img, main script").count() == 0
    assert dialogs == []


async def test_refusals_show_their_status_415_for_an_upload_404_for_a_missing_base(
    console: Console,
) -> None:
    page = console.page
    await create_base(console, "Refusals")
    await upload(console, "picture.png", b"\x89PNG\r\n\x1a\n", "image/png")
    await expect(page.locator("#knowledge-upload .notice.error")).to_contain_text(
        "415 Unsupported file type"
    )
    await console.open("#/knowledge/kb_missing")
    await expect(page.locator(".notice.error")).to_contain_text("404 Not found")
