"""The console's files as the gateway serves them: a strict Content-Security-Policy on every answer,
no asset from another origin, and no script that parses text as markup (what keeps hostile model or
tool output inert, besides the CSP; tests/console checks it in a browser)."""

from __future__ import annotations

import re

import httpx

from services.gateway.console import CONSOLE_DIR, SECURITY_HEADERS

# Sinks that turn a string into markup or code: none may appear in the console's scripts.
MARKUP_SINKS = re.compile(
    r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\s*\(|new\s+Function\b"
    r"|setTimeout\s*\(\s*['\"`]|srcdoc"
)


def console_files() -> list:
    return sorted(p for p in CONSOLE_DIR.rglob("*") if p.is_file())


def test_console_scripts_never_parse_text_as_markup():
    scripts = [p for p in console_files() if p.suffix == ".js"]
    assert scripts
    for script in scripts:
        code = "\n".join(
            line for line in script.read_text().splitlines() if not line.lstrip().startswith("//")
        )
        assert not MARKUP_SINKS.search(code), f"{script.name} uses {MARKUP_SINKS.search(code)}"


def test_console_loads_nothing_from_another_origin():
    for path in console_files():
        if path.suffix in {".js", ".css", ".html"}:
            text = path.read_text()
            assert not re.search(r"(src|href|url)\s*[=(]\s*['\"]?(https?:)?//", text), path.name
            assert "@import" not in text, path.name


async def test_every_console_answer_carries_the_security_headers(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        redirect = await client.get("/console")
        assert redirect.status_code == 308
        assert redirect.headers["location"] == "/console/"
        for path in ["/console/", "/console/js/app.js", "/console/console.css", "/console/nope.js"]:
            answer = await client.get(path)
            assert answer.status_code == (404 if "nope" in path else 200), path
            for name, value in SECURITY_HEADERS.items():
                assert answer.headers[name] == value, (path, name)
        missing = await client.get("/console/nope.js")
        assert missing.json() == {"detail": "Not Found"}
        post = await client.post("/console/js/app.js")
        assert (post.status_code, post.headers["allow"]) == (405, "GET, HEAD")
        assert (
            post.headers["content-security-policy"] == SECURITY_HEADERS["content-security-policy"]
        )
        page = await client.get("/console/")
        assert page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="js/app.js">' in page.text
