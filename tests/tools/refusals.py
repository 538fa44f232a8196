"""Shared by the tools service's request-check tests: the rich status of a refused call,
its checks, and the patches that prove a refusal did no work."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import TOOLS_DOMAIN, status_details
from services.tools import servicer as tools_server


async def refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The parsed rich status of `call(request)`, which must fail with `code` in the tools
    domain."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request)
    details = status_details(caught.value)
    assert details.code == code, details
    assert details.domain == TOOLS_DOMAIN, details
    return details


def too_long(details, field, limit, length):
    assert details.reason == "FIELD_TOO_LONG"
    assert details.message == f"{field} must be at most {limit} characters (it has {length})"
    assert details.metadata == {"field": field, "limit": str(limit)}


def no_database(tools_service, monkeypatch):
    """Make any database session of the stores fail the test (it would show as INTERNAL)."""

    def refuse():
        raise AssertionError("the database was queried")

    monkeypatch.setattr(tools_service.server.servicer.credentials, "_sessions", refuse)
    monkeypatch.setattr(tools_service.server.servicer.knowledge, "_sessions", refuse)
    monkeypatch.setattr(tools_service.server.servicer.oauth, "_sessions", refuse)


def no_network(tools_service, monkeypatch):
    """Make any outbound step of an MCP server's registration (URL policy, discovery) fail the
    test."""

    async def refuse(*_args, **_kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(tools_server, "check_url_policy", refuse)
    monkeypatch.setattr(tools_service.server.servicer.executor.mcp, "list_tools", refuse)


GOOD_ID = "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e"
