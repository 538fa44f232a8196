"""LOOPLINE_INTERNAL_TOKEN (services/common/internal_auth.py): with it set, every internal gRPC
call must carry it, so reaching a port is not enough to get, e.g., a credential's decrypted
secret from the tools service's ResolveCredentialSecret."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common.internal_auth import internal_channel
from tests.conftest import SCRIPTED, script, start_stack, stop_stack
from tests.sse_client import read_frames

TOKEN = "internal-test-token-1234567890"


@pytest.fixture
async def guarded(tmp_path):
    overrides = {"internal_token": TOKEN}
    running = await start_stack(
        tmp_path, orchestrator=overrides, gateway=overrides, billing=overrides, tools=overrides
    )
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_turns_work_with_the_token_and_direct_calls_without_it_are_refused(guarded):
    async with guarded.client() as client:
        created = await client.post(
            "/credentials",
            json={"integration_name": "openai", "auth_data": {"api_key": "sk-probe-secret"}},
        )
        assert created.status_code == 201, created.text
        turn = await client.post(
            "/assistant/chat",
            json={
                "message": script(
                    {"tool": "get_available_integrations", "input": {}}, {"say": "done"}
                ),
                "llm": SCRIPTED,
            },
        )
        assert turn.status_code == 200, turn.text
        frames = await read_frames(client, turn.json()["stream_url"])
        assert (
            frames[-1]["type"] == "done"
        )  # StartTurn, StreamRun, Admit/Charge/usage and ExecuteTool all passed
    request = tools_pb2.ResolveCredentialSecretRequest(
        organization_id=guarded.org_id,
        credential_id=created.json()["credential_id"],
        integration_name="openai",
    )
    target = f"127.0.0.1:{guarded.tools.port}"
    for token in ("", "wrong-token"):
        async with internal_channel(target, token) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tools_pb2_grpc.ToolsServiceStub(channel).ResolveCredentialSecret(
                    request, timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "sk-probe" not in str(refused.value)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    async with internal_channel(target, TOKEN) as channel:
        answer = await tools_pb2_grpc.ToolsServiceStub(channel).ResolveCredentialSecret(
            request, timeout=5
        )
    assert answer.secret == "sk-probe-secret"


async def test_a_refused_call_is_logged_by_the_refusing_service_without_the_token(guarded, caplog):
    """A replica with another token refuses every call while its health checks pass, so it logs
    a WARNING (once a minute per method) saying what to fix; never the token."""
    import logging

    caplog.set_level(logging.WARNING, logger="services.common.internal_auth")
    target = f"127.0.0.1:{guarded.tools.port}"
    for token in ("not-the-token-1234567890", "not-the-token-1234567890", ""):
        async with internal_channel(target, token) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tools_pb2_grpc.ToolsServiceStub(channel).ListTools(
                    tools_pb2.ListToolsRequest(profile="assistant")
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    logged = [r for r in caplog.records if r.name == "services.common.internal_auth"]
    assert [r.getMessage() for r in logged] == [
        "refused an internal call: wrong internal token"
    ]  # once a minute per method
    assert logged[0].fields["method"] == "/loopline.tools.v1.ToolsService/ListTools"
    assert "not-the-token" not in caplog.text


async def test_a_bidirectional_call_carries_the_token_too(guarded):
    """StreamRuns (client and server both streaming) through an internal channel: refused
    without the token, served with it."""
    async with guarded.client() as client:
        turn = await client.post("/assistant/chat", json={"message": script({"say": "hi"})})
        assert turn.status_code == 200, turn.text
        body = turn.json()
        await read_frames(client, body["stream_url"])
    caller = assistant_pb2.Caller(organization_id=guarded.org_id, user_id=guarded.user_id)
    follow = assistant_pb2.StreamRunRequest(
        caller=caller, chat_id=body["chat_id"], run_id=body["run_id"]
    )

    async def requests():
        yield assistant_pb2.StreamRunsRequest(stream_id=1, follow=follow)

    target = f"127.0.0.1:{guarded.orchestrator.port}"
    async with internal_channel(target, "wrong-token") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in assistant_pb2_grpc.AssistantServiceStub(channel).StreamRuns(requests()):
                pass
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with internal_channel(target, TOKEN) as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        runs = [entry async for response in stub.StreamRuns(requests()) for entry in response.runs]
    assert runs[-1].ended and runs[-1].end_status == b""
    assert [e.WhichOneof("payload") for entry in runs for e in entry.events][-1] == "done"
