"""/docs (Swagger UI) and /redoc work offline: their HTML references only the gateway's own
paths (no CDN, no web fonts, no validator badge), and the gateway serves every asset it
references with the right content type, without an API key."""

from __future__ import annotations

import re

import httpx
import pytest

ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


def _references(html: str) -> list[str]:
    """Every URL the page loads: src/href attributes, ReDoc's spec-url and Swagger UI's `url`."""
    return re.findall(r'(?:src|href|spec-url)="([^"]+)"', html) + re.findall(
        r"\burl: '([^']+)'", html
    )


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_docs_pages_load_only_assets_the_gateway_serves(services, page):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.get(page)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        html = response.text
        assert not re.search(r"(?:https?:)?//", html), html  # nothing from another host
        references = _references(html)
        assert "/openapi.json" in references
        assets = [r for r in references if r != "/openapi.json"]
        assert assets and all(a.startswith("/docs/static/") for a in assets), references
        for asset in assets:
            served = await client.get(asset)
            assert served.status_code == 200, asset
            expected = ASSET_TYPES[asset[asset.rindex(".") :]]
            assert served.headers["content-type"].split(";")[0] == expected, asset
            assert len(served.content) > 1000, asset
        document = await client.get("/openapi.json")
        assert document.status_code == 200 and document.json()["paths"]


async def test_swagger_ui_fetches_no_validator_badge(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        html = (await client.get("/docs")).text
    assert '"validatorUrl": null' in html


async def test_an_unknown_docs_asset_is_the_json_404(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        missing = await client.get("/docs/static/nothing.js")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
