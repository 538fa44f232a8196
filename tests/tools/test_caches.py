"""Per-process caches and lazy imports of the tools service: correct, never stale after a write.

Rules checked: a credential write through a process is seen by that process's next tool call;
another replica's write is seen within LOOPLINE_TOOLS_CREDENTIAL_CACHE_TTL_S, and an MCP
server it registered is found at once; a tool call that can use no credential reads none;
the idle service loads no optional package (cryptography, httpx, asyncpg, mcp, ...); the
direct Struct/Value conversions equal json_format's.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from google.protobuf import json_format, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.tools.catalogue import Catalogue
from services.tools.crypto import SecretBox
from services.tools.mcp_servers import MCP_AUTH_TYPE

MCP_TOOLS = [
    {"name": "ping", "description": "Ping.", "input_schema": {"type": "object", "properties": {}}}
]


def _connected(output: dict) -> dict[str, bool]:
    return {i["name"]: i["connected"] for i in output["integrations"]}


async def test_credential_writes_are_seen_by_the_next_tool_call_of_the_same_process(start_tools):
    tools = await start_tools(tools_credential_cache_ttl_s=3600.0)
    assert (
        _connected(await tools.ok("get_available_integrations", {}))["http"] is False
    )  # now cached
    credential = await tools.create_credential(
        "http", {"token": "tok-123456789"}, auth_type="bearer"
    )
    assert _connected(await tools.ok("get_available_integrations", {}))["http"] is True
    await tools.stub.DeleteCredential(
        tools_pb2.DeleteCredentialRequest(
            organization_id="org-a", credential_id=credential.credential_id
        )
    )
    assert _connected(await tools.ok("get_available_integrations", {}))["http"] is False


async def test_mcp_server_writes_are_seen_by_the_next_tool_call_of_the_same_process(start_tools):
    tools = await start_tools(tools_credential_cache_ttl_s=3600.0)
    store = tools.server.servicer.credentials
    names = {i["name"] for i in (await tools.ok("get_available_integrations", {}))["integrations"]}
    assert "mcp_docs" not in names
    info = await store.create_raw(
        "org-a",
        "mcp_docs",
        MCP_AUTH_TYPE,
        {"url": "https://mcp.example/mcp", "headers": {}},
        "Docs",
        discovery=MCP_TOOLS,
    )
    listed = {
        i["name"]: i for i in (await tools.ok("get_available_integrations", {}))["integrations"]
    }
    assert listed["mcp_docs"]["connected"] is True
    details = await tools.ok("get_integration_details", {"integration": "mcp_docs"})
    assert [a["name"] for a in details["actions"]] == ["ping"]

    await store.set_discovery("org-a", info.id, [*MCP_TOOLS, {**MCP_TOOLS[0], "name": "pong"}])
    details = await tools.ok("get_integration_details", {"integration": "mcp_docs"})
    assert [a["name"] for a in details["actions"]] == ["ping", "pong"]

    await store.delete("org-a", info.id)
    names = {i["name"] for i in (await tools.ok("get_available_integrations", {}))["integrations"]}
    assert "mcp_docs" not in names
    assert "Unknown integration" in await tools.failed(
        "get_integration_details", {"integration": "mcp_docs"}
    )


async def test_the_unknown_integration_hint_names_the_organizations_mcp_servers(start_tools):
    tools = await start_tools()
    store = tools.server.servicer.credentials
    await store.create_raw(
        "org-a",
        "mcp_docs",
        MCP_AUTH_TYPE,
        {"url": "https://mcp.example/mcp", "headers": {}},
        "Docs",
        discovery=MCP_TOOLS,
    )
    error = await tools.failed("get_integration_details", {"integration": "mcp_doc"})
    assert "Unknown integration 'mcp_doc'" in error
    hinted = error.split("include: ", 1)[1].split(". Call", 1)[0].split(", ")
    assert "mcp_docs" in hinted and "http" in hinted
    other = await tools.failed("get_integration_details", {"integration": "mcp_doc"}, org="org-b")
    assert "mcp_docs" not in other  # another organization's server is never named


async def test_another_replicas_credential_is_seen_within_the_cache_ttl(start_tools, tmp_path):
    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    first = await start_tools(tools_database_url=url, tools_credential_cache_ttl_s=0.5)
    second = await start_tools(tools_database_url=url, tools_credential_cache_ttl_s=0.5)
    assert (
        _connected(await second.ok("get_available_integrations", {}))["http"] is False
    )  # cached by the second
    await first.create_credential("http", {"token": "tok-123456789"}, auth_type="bearer")
    await asyncio.sleep(0.6)
    assert _connected(await second.ok("get_available_integrations", {}))["http"] is True


async def test_an_mcp_server_registered_on_another_replica_is_found_at_once(start_tools, tmp_path):
    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    first = await start_tools(tools_database_url=url, tools_credential_cache_ttl_s=3600.0)
    second = await start_tools(tools_database_url=url, tools_credential_cache_ttl_s=3600.0)
    await second.ok("get_available_integrations", {})  # the second caches "no MCP server"
    await first.server.servicer.credentials.create_raw(
        "org-a",
        "mcp_docs",
        MCP_AUTH_TYPE,
        {"url": "https://mcp.example/mcp", "headers": {}},
        "Docs",
        discovery=MCP_TOOLS,
    )
    details = await second.ok("get_integration_details", {"integration": "mcp_docs"})
    assert [a["name"] for a in details["actions"]] == ["ping"]


async def test_a_tool_call_that_can_use_no_credential_reads_none(tools_service, monkeypatch):
    store = tools_service.server.servicer.credentials
    calls: list[tuple] = []

    async def resolve(*args):
        calls.append(args)

    monkeypatch.setattr(store, "resolve", resolve)
    output = await tools_service.ok(
        "execute_integration_tool",
        {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}},
    )
    assert output["result"] == {"message": "hi"} and output["credential_id"] is None
    assert calls == []
    # A named credential is still looked up (and, for loopline, never found).
    error = await tools_service.failed(
        "execute_integration_tool",
        {
            "integration": "loopline",
            "action": "echo",
            "parameters": {"message": "hi"},
            "credential_id": "nope",
        },
    )
    assert "Credential 'nope' was not found" in error
    assert calls == [("org-a", "loopline", "nope")]
    # An integration that takes a secret still resolves one.
    await tools_service.failed(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": "https://example.com"}},
    )
    assert calls[-1] == ("org-a", "http", None)


def test_an_action_validator_is_built_once():
    loopline = Catalogue.builtin().get("loopline")
    assert loopline is not None
    action = loopline.actions["echo"]
    assert action.validator is action.validator
    assert not action.validator.is_valid({"message": 3})


def test_the_idle_service_loads_no_optional_package(tmp_path):
    # cryptography, httpx (+ click, rich), httpx2, anyio, asyncpg, the mcp SDK, pypdf: loaded on
    # first use only.
    script = (
        "import asyncio, json, sys\n"
        "from services.tools.config import ToolsSettings\n"
        "from services.tools.server import ToolsServer\n"
        "async def main():\n"
        f"    settings = ToolsSettings(data_dir={str(tmp_path)!r}, tools_port=0,\n"
        "        host='127.0.0.1', auto_migrate=True)\n"
        "    server = await ToolsServer.start(settings)\n"
        "    print(json.dumps(sorted(sys.modules)))\n"
        "    await server.stop(0)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    loaded = {name.split(".")[0] for name in json.loads(out.strip().splitlines()[-1])}
    assert not loaded & {
        "cryptography",
        "httpx",
        "httpcore",
        "httpx2",
        "anyio",
        "asyncpg",
        "mcp",
        "pypdf",
        "click",
        "rich",
    }
    # The reflection implementation (and protobuf's descriptor_pb2, ~3 MiB) waits for the first
    # reflection call (grpc itself imports the empty top-level `grpc_reflection` package).
    modules = json.loads(out.strip().splitlines()[-1])
    assert "google.protobuf.descriptor_pb2" not in modules
    assert not [name for name in modules if name.startswith("grpc_reflection.")]


async def test_server_reflection_lists_the_services_and_resolves_their_files(tools_service):
    def reflect(port: int) -> tuple[list[str], str, str]:
        import grpc
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = sorted(database.get_services())
            found = database.FindFileContainingSymbol("loopline.tools.v1.ToolsService")
            return services, found.name, found.package

    services, name, package = await asyncio.to_thread(reflect, tools_service.server.port)
    assert services == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "loopline.tools.v1.ToolsService",
    ]
    assert name.endswith("tools.proto") and package == "loopline.tools.v1"


def test_a_malformed_credential_key_is_refused_at_construction():
    for key in ["", "abc", "A" * 44, "ä" * 44]:
        with pytest.raises(ValueError, match="Fernet key"):
            SecretBox([key])
    box = SecretBox(["A" * 43 + "="])
    assert box.decrypt(box.encrypt({"a": 1})) == {"a": 1}


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_direct_struct_conversions_equal_json_format(data):
    expected = struct_pb2.Value()
    json_format.ParseDict(data, expected)
    assert pb.to_value(data).SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    back = _sorted_keys(
        pb._ints(json_format.MessageToDict(expected))
    )  # pb sorts an object's keys (deterministic frames)
    assert repr(pb.from_value(expected)) == repr(back)
    if isinstance(data, dict):
        struct = struct_pb2.Struct()
        json_format.ParseDict(data, struct)
        assert repr(pb.from_struct(struct)) == repr(
            _sorted_keys(pb._ints(json_format.MessageToDict(struct)))
        )


def _sorted_keys(data):  # noqa: ANN001, ANN202
    if isinstance(data, dict):
        return {key: _sorted_keys(data[key]) for key in sorted(data)}
    if isinstance(data, list):
        return [_sorted_keys(item) for item in data]
    return data


def test_direct_struct_conversions_raise_what_json_format_raises():
    with pytest.raises(json_format.ParseError):
        pb.to_value({"a": object()})
    with pytest.raises(json_format.ParseError):
        pb.to_value([b"bytes"])
    with pytest.raises(ValueError, match="Infinity"):
        pb.from_value(struct_pb2.Value(number_value=float("inf")))
    struct = struct_pb2.Struct()
    struct.fields["a"].number_value = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        pb.from_struct(struct)


@pytest.mark.parametrize(("env", "applied"), [({}, True), ({"MALLOC_ARENA_MAX": "4"}, False)])
def test_services_cap_malloc_arenas_unless_the_operator_sets_malloc_arena_max(env, applied):
    import os

    script = "from services.common.runner import limit_malloc_arenas; print(limit_malloc_arenas())"
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=environment,
    )
    assert out.stdout.strip() == str(applied)
