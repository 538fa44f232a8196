"""A 405's `Allow` header lists every method the path supports (RFC 9110 section 15.5.6): e.g.
`OPTIONS /credentials` lists GET as well as POST."""

from __future__ import annotations

import re
from typing import Any

import pytest


async def _document(services) -> dict[str, Any]:
    async with services.client() as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _concrete(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "x1", template)


def _methods_at(document: dict[str, Any], path: str) -> set[str]:
    """Every method of every documented path template that `path` matches."""
    methods = set()
    for template, operations in document["paths"].items():
        if re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in operations}
    return methods


@pytest.mark.parametrize(
    "path",
    [
        "/credentials",
        "/credentials/x1",
        "/knowledge-bases",
        "/assistant/chat/x1",
        "/organizations/settings/composer-llm",
        "/credentials/mcp-server",
    ],
)
async def test_a_405_allow_header_lists_every_method_of_the_path(services, path):
    document = await _document(services)
    expected = _methods_at(document, path)
    assert len(expected) >= 2, path
    async with services.client() as client:
        for method in ("OPTIONS", "PATCH"):
            response = await client.request(method, path)
            assert response.status_code == 405, (method, path, response.text)
            assert response.json() == {"detail": "Method Not Allowed"}
            assert set(response.headers["allow"].split(", ")) == expected, (
                method,
                path,
                response.headers["allow"],
            )


async def test_every_documented_path_answers_405_with_all_its_methods(services):
    document = await _document(services)
    async with services.client() as client:
        for template in document["paths"]:
            path = _concrete(template)
            expected = _methods_at(document, path)
            if "PATCH" in expected:
                continue
            response = await client.patch(path)
            assert response.status_code == 405, (path, response.text)
            allowed = set(response.headers["allow"].split(", "))
            assert allowed - {"HEAD"} == expected, (path, response.headers["allow"])
