"""The OpenAPI document declares the request body of every route that reads one, including routes
reading their JSON body by hand (else a generated client, e.g. schemathesis, sends none and gets
400), with the fields, types, limits and required fields the handler enforces."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import jsonschema
from fastapi.routing import APIRoute, iter_route_contexts

from services.gateway.routes.fields import MAX_SEARCH_BASES, STRING_LIMITS

JSON_READERS = ("body_of(", "read_json_object(", "read_body(", "receive_json_object(")
# (method, path) of every route that reads a JSON body, by hand or through the lean handler
JSON_BODY_ROUTES = {
    ("POST", "/assistant/chat"),
    ("POST", "/assistant/chat/{chat_id}/resume"),
    ("POST", "/api-keys"),
    ("POST", "/credentials"),
    ("POST", "/credentials/mcp-server"),
    ("POST", "/credentials/oauth2/initiate"),
    ("POST", "/knowledge-bases"),
    ("POST", "/knowledge-bases/search"),
    ("POST", "/knowledge-bases/{knowledge_base_id}/search"),
    ("POST", "/knowledge-bases/{knowledge_base_id}/hybrid-search"),
    ("POST", "/knowledge-bases/{knowledge_base_id}/retrieve-context"),
    ("PUT", "/organizations/settings/composer-llm"),
}


async def _document(services) -> dict[str, Any]:
    async with services.client() as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _routes(services) -> list[Any]:
    """Every documented route, also those of included routers (FastAPI keeps those apart)."""
    return [
        r
        for r in iter_route_contexts(services.gateway.app.routes)
        if isinstance(r.original_route, APIRoute) and r.include_in_schema
    ]


def _allowed_fields(endpoint) -> set[str] | None:  # noqa: ANN001
    """The literal set of field names the endpoint's first `check_fields(body, {...})` allows,
    or None."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(endpoint)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "check_fields"
            and isinstance(node.args[-1], ast.Set)
        ):
            return {ast.literal_eval(e) for e in node.args[-1].elts}
    return None


def _body_schema(
    document: dict[str, Any], method: str, path: str, media: str = "application/json"
) -> dict[str, Any]:
    body = document["paths"][path][method.lower()].get("requestBody")
    assert body is not None, f"{method} {path} declares no request body"
    assert body.get("required") is True, f"{method} {path}: the request body is not required"
    assert media in body["content"], (method, path, body)
    return body["content"][media]["schema"]


async def test_every_route_that_reads_a_json_body_declares_it_with_its_fields(services):
    document = await _document(services)
    readers = set()
    for route in _routes(services):
        source = inspect.getsource(route.endpoint)
        if any(reader in source for reader in JSON_READERS):
            readers |= {(method, route.path_format) for method in route.methods}
    assert readers == JSON_BODY_ROUTES  # the list above is complete
    for method, path in sorted(readers):
        schema = _body_schema(document, method, path)
        assert schema["type"] == "object" and schema["additionalProperties"] is False, (
            method,
            path,
        )
        endpoint = next(
            r.endpoint for r in _routes(services) if r.path_format == path and method in r.methods
        )
        allowed = _allowed_fields(endpoint)
        if (
            allowed is not None
        ):  # the schema names exactly the fields the handler's check_fields allows
            assert set(schema["properties"]) == allowed, (method, path)
        assert set(schema.get("required", ())) <= set(schema["properties"]), (method, path)


async def test_the_document_upload_declares_its_multipart_body(services):
    document = await _document(services)
    schema = _body_schema(
        document, "POST", "/knowledge-bases/{knowledge_base_id}/documents", "multipart/form-data"
    )
    assert schema["required"] == ["file"] and "file" in schema["properties"]


async def test_post_credentials_schema_lists_its_fields_types_limits_and_required_ones(services):
    schema = _body_schema(await _document(services), "POST", "/credentials")
    props = schema["properties"]
    assert set(props) == {
        "integration_name",
        "auth_data",
        "auth_type",
        "oauth_config",
        "display_name",
        "metadata",
        "make_default",
        "expires_at",
    }
    assert schema["required"] == ["integration_name"]
    assert (
        props["integration_name"]["maxLength"] == STRING_LIMITS["integration_name"]
        and props["integration_name"]["minLength"] == 1
    )
    assert props["display_name"]["maxLength"] == STRING_LIMITS["display_name"]
    assert props["make_default"] == {"type": "boolean"}
    assert props["oauth_config"]["type"] == "null"


def _verdict(schema: dict[str, Any], body: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(body)


# (path, body, whether the schema and the handler accept it): the handler refuses (400) exactly
# what the schema refuses; an accepted body may still fail later (the tools service: 404, 400...)
CASES = [
    ("/credentials", {}, False),
    ("/credentials", {"integration_name": " "}, False),
    ("/credentials", {"integration_name": "x" * 101}, False),
    ("/credentials", {"integration_name": "openai", "make_default": None}, False),
    ("/credentials", {"integration_name": "openai", "oauth_config": {}}, False),
    ("/credentials", {"integration_name": "openai", "auth_data": "key"}, False),
    ("/credentials", {"integration_name": "openai", "surprise": 1}, False),
    ("/credentials", {"integration_name": "openai", "expires_at": "x" * 65}, False),
    (
        "/credentials",
        {
            "integration_name": "openai",
            "auth_data": {"api_key": "sk-123456789012"},
            "display_name": None,
            "metadata": None,
            "expires_at": "2030-01-01",
            "make_default": True,
            "oauth_config": None,
        },
        True,
    ),
    ("/credentials/mcp-server", {"server_url": ""}, False),
    (
        "/credentials/mcp-server",
        {"server_url": "http://127.0.0.1:1/mcp", "headers": {"X-A": 1}},
        False,
    ),
    (
        "/credentials/mcp-server",
        {"server_url": "http://127.0.0.1:1/mcp", "headers": {"X-A": "b"}, "make_default": False},
        True,
    ),
    ("/credentials/oauth2/initiate", {"integration_name": "acme"}, False),
    (
        "/credentials/oauth2/initiate",
        {"integration_name": "acme", "redirect_uri": "http://x/cb", "use_modulex_oauth": False},
        False,
    ),
    (
        "/credentials/oauth2/initiate",
        {"integration_name": "acme", "redirect_uri": "http://x/cb", "env_var_values": {}},
        False,
    ),
    (
        "/credentials/oauth2/initiate",
        {
            "integration_name": "acme",
            "redirect_uri": "http://x/cb",
            "use_modulex_oauth": True,
            "composer_chat_id": "c",
            "scope": None,
        },
        True,
    ),
    ("/api-keys", {}, False),
    ("/api-keys", {"name": ""}, False),
    ("/api-keys", {"name": "ci", "rate_limit_per_minute": 0}, False),
    ("/api-keys", {"name": "ci", "rate_limit_per_minute": 1.5}, False),
    ("/api-keys", {"name": "ci", "expires_at": 5}, False),
    ("/api-keys", {"name": "ci", "surprise": 1}, False),
    ("/api-keys", {"name": "ci\nrunner"}, False),
    ("/api-keys", {"name": "ci\u202erunner"}, False),
    ("/api-keys", {"name": " \u00e9t\u00e9 runner "}, True),
    (
        "/api-keys",
        {
            "name": "ci",
            "organization_id": None,
            "expires_at": None,
            "rate_limit_per_minute": 60,
        },
        True,
    ),
    ("/knowledge-bases", {"name": ""}, False),
    ("/knowledge-bases", {"name": "kb", "chunking_config": {"max_chars": 5}}, False),
    ("/knowledge-bases", {"name": "kb", "description": "x" * 10_001}, False),
    (
        "/knowledge-bases",
        {"name": "kb", "chunking_config": {}, "embedding_config": None, "description": None},
        True,
    ),
    ("/knowledge-bases/search", {"knowledge_base_ids": [], "query": "q"}, False),
    (
        "/knowledge-bases/search",
        {"knowledge_base_ids": ["x"] * (MAX_SEARCH_BASES + 1), "query": "q"},
        False,
    ),
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x" * 65], "query": "q"}, False),
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x"], "query": "q", "top_k": 51}, False),
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x"], "query": "q", "top_k": True}, False),
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x"], "query": "q", "top_k": 19.5}, False),
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x"], "query": "q", "top_k": 1e300}, False),
    # a zero fractional part is an integer to JSON Schema (2020-12 Validation 6.1.1), so to the
    # handler too
    ("/knowledge-bases/search", {"knowledge_base_ids": ["x"], "query": "q", "top_k": 19.0}, True),
    (
        "/knowledge-bases/search",
        {"knowledge_base_ids": ["x"], "query": "q", "min_score": None},
        False,
    ),
    # scores are 0 to 1, so is min_score
    (
        "/knowledge-bases/search",
        {"knowledge_base_ids": ["x"], "query": "q", "top_k": 50, "min_score": -1.5},
        False,
    ),
    (
        "/knowledge-bases/search",
        {"knowledge_base_ids": ["x"], "query": "q", "min_score": 0.5, "search_type": "keyword"},
        True,
    ),
    (
        "/knowledge-bases/search",
        {"knowledge_base_ids": ["x"], "query": "q", "search_type": "x"},
        False,
    ),
    ("/knowledge-bases/{kb}/search", {"query": "q", "search_type": "hybrid", "min_score": 1}, True),
    ("/knowledge-bases/{kb}/search", {"query": "q", "search_type": None}, False),
    ("/knowledge-bases/{kb}/search", {"query": "q", "min_score": 1.01}, False),
    ("/knowledge-bases/{kb}/hybrid-search", {"query": "q"}, True),
    (
        "/knowledge-bases/{kb}/hybrid-search",
        {"query": "q", "semantic_weight": 1, "keyword_weight": 0, "min_score": 0.2, "filters": {}},
        True,
    ),
    ("/knowledge-bases/{kb}/hybrid-search", {"query": "q", "keyword_weight": 1.5}, False),
    ("/knowledge-bases/{kb}/hybrid-search", {"query": "q", "filters": {"a": 1}}, False),
    ("/knowledge-bases/{kb}/hybrid-search", {"query": "q", "search_type": "hybrid"}, False),
    ("/knowledge-bases/{kb}/retrieve-context", {"query": "q", "max_tokens": 32000}, True),
    ("/knowledge-bases/{kb}/retrieve-context", {"query": "q", "max_tokens": 32001}, False),
    ("/knowledge-bases/{kb}/retrieve-context", {"query": "q", "top_k": 0}, False),
    ("/knowledge-bases/{kb}/retrieve-context", {"query": "q", "min_score": 0.3, "top_k": 50}, True),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"provider": "local"}}, True),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"provider": None}}, True),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"provider": "cohere"}}, False),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"provider": {}}}, False),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"provider": ""}}, False),
    ("/knowledge-bases", {"name": "kb", "embedding_config": {"model": "m"}}, False),
    (
        "/knowledge-bases",
        {"name": "kb", "embedding_config": {"provider": "openai", "model": "m"}},
        False,
    ),
    (
        "/knowledge-bases",
        {
            "name": "kb",
            "embedding_config": {
                "provider": "openai",
                "model": "m",
                "credential_id": "c",
                "dimensions": 0,
            },
        },
        False,
    ),
    ("/knowledge-bases/{kb}/search", {"query": "q", "filters": {"a": 1}}, False),
    ("/knowledge-bases/{kb}/search", {"query": "q", "include_content": "yes"}, False),
    (
        "/knowledge-bases/{kb}/search",
        {
            "query": "q",
            "filters": {},
            "include_content": False,
            "include_metadata": True,
            "top_k": 1,
        },
        True,
    ),
]


TOOLS_SERVICE_400S = ("ntegration", "server_url refused")


async def test_the_body_schemas_refuse_exactly_what_the_handlers_refuse(services):
    document = await _document(services)
    async with services.client() as client:
        kb = (await client.post("/knowledge-bases", json={"name": "kb"})).json()["id"]
        for path, body, accepted in CASES:
            schema = _body_schema(document, "POST", path.replace("{kb}", "{knowledge_base_id}"))
            assert _verdict(schema, body) is accepted, (path, body)
            response = await client.post(path.replace("{kb}", kb), json=body)
            if accepted:
                # past the gateway's body checks: what follows is the tools service's (an unknown
                # integration, a refused MCP address)
                assert response.status_code != 400 or any(
                    word in response.text for word in TOOLS_SERVICE_400S
                ), (path, body, response.text)
            else:
                assert response.status_code == 400, (path, body, response.text)
