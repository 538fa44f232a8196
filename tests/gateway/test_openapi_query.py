"""The OpenAPI document declares the query parameters' real bounds and values, so a generated
client (e.g. schemathesis) is not allowed `?limit=-128` or `?status=` that the server answers
400; bounds are JSON Schema's own, not pydantic's `ge`/`le`, which JSON Schema ignores."""

from __future__ import annotations

from typing import Any

import jsonschema


async def _document(services) -> dict[str, Any]:
    async with services.client() as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _verdict(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _walk(node: Any):  # noqa: ANN202
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


async def test_integer_query_bounds_are_json_schema_keywords(services):
    document = await _document(services)
    for node in _walk(document):
        if node.get("type") in ("integer", "number"):
            assert not {"ge", "le", "gt", "lt"} & set(node), (
                node
            )  # pydantic's names, which JSON Schema ignores
    for path in ("/credentials", "/knowledge-bases"):
        params = {p["name"]: p["schema"] for p in document["paths"][path]["get"]["parameters"]}
        assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, 500), path
        assert params["offset"]["minimum"] == 0, path
    chats = {
        p["name"]: p["schema"] for p in document["paths"]["/assistant/chats"]["get"]["parameters"]
    }
    assert (chats["limit"]["minimum"], chats["limit"]["maximum"]) == (1, 100)


async def test_enum_query_filters_declare_their_values_and_the_server_agrees(services):
    document = await _document(services)
    kb_status = {
        p["name"]: p["schema"] for p in document["paths"]["/knowledge-bases"]["get"]["parameters"]
    }["status"]
    auth_type = {
        p["name"]: p["schema"] for p in document["paths"]["/credentials"]["get"]["parameters"]
    }["auth_type"]
    async with services.client() as client:
        for path, name, schema, values in (
            ("/knowledge-bases", "status", kb_status, ["", "active", "archived", "nope", "ACTIVE"]),
            ("/credentials", "auth_type", auth_type, ["", "api_key", "bearer_token", "nope"]),
        ):
            for value in values:
                response = await client.get(path, params={name: value})
                assert response.status_code in (200, 400), response.text
                assert _verdict(schema, value) is (response.status_code == 200), (
                    path,
                    name,
                    value,
                    response.text,
                )
        for path in ("/credentials", "/knowledge-bases"):
            params = {p["name"]: p["schema"] for p in document["paths"][path]["get"]["parameters"]}
            for name, value in (
                ("limit", "-128"),
                ("limit", "0"),
                ("limit", "501"),
                ("offset", "-1"),
                ("limit", "500"),
                ("offset", "0"),
            ):
                response = await client.get(path, params={name: value})
                assert _verdict(params[name], int(value)) is (response.status_code == 200), (
                    path,
                    name,
                    value,
                    response.text,
                )


async def test_the_oauth2_callback_declares_state_required_and_its_other_parameters_once(services):
    document = await _document(services)
    params = [
        p
        for p in document["paths"]["/credentials/oauth2/callback"]["get"]["parameters"]
        if p["in"] == "query"
    ]
    assert [p["name"] for p in params] == ["state", "code", "error", "error_description"]
    assert [p["required"] for p in params] == [True, False, False, False]
    async with services.client() as client:
        for query in (
            {},
            {"state": ""},
            {"state": "s"},
            {"code": "c"},
        ):  # what the document refuses or cannot express
            response = await client.get("/credentials/oauth2/callback", params=query)
            assert response.status_code == 400 and response.json() == {
                "detail": "state and code are required"
            }, query
        unknown = await client.get(
            "/credentials/oauth2/callback", params={"state": "s", "code": "c"}
        )
        assert unknown.status_code != 400 or "state" in unknown.text.lower(), (
            unknown.text
        )  # the tools service's answer
