"""The console's layout holds against its data and a phone: long unbroken strings wrap instead of
widening the page, a 390 px wide screen keeps Sign out and a table's buttons reachable, data with
a right-to-left override stays in its own bidirectional island, the navigation hides before
sign-in, and the page's own requests (its favicon included) all succeed."""

from __future__ import annotations

from playwright.async_api import Page, expect

from tests.console.conftest import CONSOLE_LOOP, Console, open_console
from tests.console.test_chat_turns import new_turn

pytestmark = CONSOLE_LOOP

LONG = "x" * 500  # one unbroken word
LONG_NAME = "n" * 200  # the longest name a key or a credential takes


async def page_width(page: Page) -> tuple[int, int]:
    """(the document's scroll width, the viewport's width)."""
    return await page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )


async def assert_fits(page: Page) -> None:
    scroll, viewport = await page_width(page)
    assert scroll <= viewport, f"the page is {scroll} px wide in a {viewport} px viewport"


async def test_long_unbroken_text_in_panels_never_widens_the_page(console: Console) -> None:
    page = console.page
    async with console.stack.client() as client:
        kb = await client.post("/knowledge-bases", json={"name": LONG[:200], "description": LONG})
        assert kb.status_code == 201, kb.text
    await console.open("#/knowledge")
    await expect(page.locator("#knowledge-list tr")).to_have_count(2)
    await assert_fits(page)
    await console.open(f"#/knowledge/{kb.json()['id']}")
    await expect(page.locator(".kb-facts h1")).to_be_visible()
    await assert_fits(page)
    await console.open("#/keys")
    await page.fill("input[name=key_name]", LONG_NAME)
    await page.click("#key-create button[type=submit]")
    await expect(page.locator(".key-once h2")).to_contain_text("created")
    await expect(page.locator("#key-list td.key-name", has_text=LONG_NAME)).to_be_visible()
    await assert_fits(page)


async def test_long_unbroken_text_in_a_run_and_a_question_never_widens_the_page(
    console: Console,
) -> None:
    async with console.stack.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": "tok-1234567890"},
                "display_name": LONG_NAME,
            },
        )
        assert created.status_code == 201, created.text
    page = await new_turn(
        console, {"tool": "request_credential", "input": {"integration": "http", "message": LONG}}
    )
    await expect(page.locator(".live .question-asked")).to_contain_text(LONG)
    await expect(page.locator(".credential-choice option")).to_have_count(2)
    await assert_fits(page)


async def test_a_phone_keeps_sign_out_and_a_keys_revoke_button_reachable(browser, stack) -> None:
    async with stack.client() as client:
        made = await client.post("/api-keys", json={"name": "phone key"})
        assert made.status_code == 201, made.text
    console = await open_console(browser, stack, viewport={"width": 390, "height": 844})
    await console.sign_in()
    page = console.page
    header = page.locator(".topbar")
    assert await header.evaluate("el => getComputedStyle(el).position") == "static"
    bar = await header.bounding_box()
    assert bar and bar["height"] < 140  # one line and the navigation's, not 220 px
    await console.open("#/keys")
    revoke = page.locator("#key-list tr", has_text="phone key").get_by_role("button", name="Revoke")
    await expect(revoke).to_be_attached()
    await assert_fits(page)
    sign_out = await page.locator("#sign-out").bounding_box()
    assert sign_out and sign_out["x"] + sign_out["width"] <= 390
    await revoke.scroll_into_view_if_needed()  # the table scrolls inside its card
    box = await revoke.bounding_box()
    assert box and 0 <= box["x"] and box["x"] + box["width"] <= 390
    await assert_fits(page)
    await console.open("#/credentials")
    await expect(page.locator("#credential-list")).to_contain_text("No credentials")
    await assert_fits(page)
    assert console.errors == []


async def test_a_right_to_left_override_in_a_file_name_leaves_the_consoles_words_in_order(
    console: Console,
) -> None:
    page = console.page
    name = "\u202ebad name.txt"  # (the API refuses bidirectional controls in a key's name)
    async with console.stack.client() as client:
        kb = await client.post("/knowledge-bases", json={"name": "bidi"})
    await console.open(f"#/knowledge/{kb.json()['id']}")
    await page.set_input_files(
        "#knowledge-upload input[name=file]",
        {"name": name, "mimeType": "text/plain", "buffer": b"some words\n"},
    )
    await page.click("#knowledge-upload button[type=submit]")
    shown = page.locator("#knowledge-upload .notice.ok")
    await expect(shown.locator("bdi")).to_have_text(name)
    # the notice's own words come after the name, left to right, outside the name's island
    order = await shown.evaluate(
        """p => {
          const words = [...p.childNodes].find(n => n.nodeType === 3 && n.data.includes('chunk'));
          const range = document.createRange();
          range.selectNodeContents(words);
          return [p.querySelector('bdi').getBoundingClientRect().right,
                  range.getBoundingClientRect().left, words.data];
        }"""
    )
    assert order[0] <= order[1] + 1 and order[2].startswith(": 1 chunk, found by its words now")
    await expect(page.locator("#documents td bdi")).to_have_text(name)


async def test_the_navigation_hides_before_sign_in_and_every_request_of_the_page_succeeds(
    browser, stack
) -> None:
    console = await open_console(browser, stack)
    page = console.page
    failed: list[str] = []
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
    await page.goto(console.url)
    await expect(page.locator("#sign-in")).to_be_visible()
    await expect(page.locator("#nav")).to_be_hidden()
    await expect(page.locator("#sign-out")).to_be_hidden()
    icon = await page.locator("link[rel=icon]").get_attribute("href")
    answer = await page.request.get(console.url + (icon or ""))
    assert answer.status == 200 and answer.headers["content-type"].startswith("image/svg+xml")
    assert failed == []
