"""AssistantService over gRPC checks what the gateway checks over HTTP (for a gRPC client)."""

from __future__ import annotations

import grpc
import pytest

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common.errors import ASSISTANT_DOMAIN, status_details


@pytest.fixture
async def stub(services):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        yield assistant_pb2_grpc.AssistantServiceStub(channel)


@pytest.mark.parametrize("organization_id", ["", "org\x00x", "org ü", "o" * 129, "has space"])
async def test_a_call_naming_no_possible_organization_is_invalid_argument_in_the_assistant_domain(
    services, stub, organization_id
):
    """Before: no caller was billing's ORGANIZATION_ID_REQUIRED (billing's domain), a NUL was
    UNAVAILABLE "Billing is unavailable; try again" (retried for ever), 129 characters billing's
    KEY_TOO_LONG, and non-ASCII was taken."""
    caller = assistant_pb2.Caller(organization_id=organization_id, user_id=services.user_id)
    calls = [
        stub.StartTurn(assistant_pb2.StartTurnRequest(caller=caller, message="hello")),
        stub.ListChats(assistant_pb2.ListChatsRequest(caller=caller)),
        stub.NotifyCredentialConnected(
            assistant_pb2.NotifyCredentialConnectedRequest(
                organization_id=organization_id, integration="http"
            )
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        details = status_details(refused.value)
        assert (details.reason, details.domain) == ("INVALID_ORGANIZATION_ID", ASSISTANT_DOMAIN)


async def test_a_nul_in_a_text_field_is_stored_or_invalid_argument_never_a_leak(services, stub):
    """PostgreSQL cannot store U+0000: StartTurn answered UNKNOWN "Unexpected <class
    'asyncpg...CharacterNotInRepertoireError'>" and ListChats the whole SQL with its parameters.
    SQLite stores it; PostgreSQL refuses it as INVALID_ARGUMENT INVALID_VALUE."""
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id="user\x00x")
    for call in (
        stub.StartTurn(
            assistant_pb2.StartTurnRequest(
                caller=assistant_pb2.Caller(
                    organization_id=services.org_id, user_id=services.user_id
                ),
                message="a\x00b",
            )
        ),
        stub.ListChats(assistant_pb2.ListChatsRequest(caller=caller)),
    ):
        try:
            await call
        except grpc.aio.AioRpcError as refused:
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
            assert status_details(refused).reason == "INVALID_VALUE"
            details = refused.details()
            assert details is not None and "SQL" not in details and "class" not in details


async def test_a_cancel_reason_longer_than_1000_characters_is_refused_and_the_run_goes_on(
    services, stub
):
    # a long reason (5,000 characters) is refused: it would be stored and sent to every listener
    from tests.conftest import script

    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    started = await stub.StartTurn(
        assistant_pb2.StartTurnRequest(
            caller=caller, message=script({"say": "slow", "sleep_ms": 20_000})
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Cancel(
            assistant_pb2.CancelRequest(caller=caller, chat_id=started.chat_id, reason="x" * 1001)
        )
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and status_details(refused.value).reason == "INVALID_REASON"
    )
    cancelled = await stub.Cancel(
        assistant_pb2.CancelRequest(caller=caller, chat_id=started.chat_id, reason="y" * 1000)
    )
    assert cancelled.status == "cancelled"


@pytest.mark.parametrize("organization_id", ["a b", "org\x00x", "o" * 129, "org ü"])
async def test_billing_and_tools_refuse_an_organization_id_no_organization_can_have(
    services, organization_id
):
    """Billing's Admit opens no account "a b" (which its own admin commands refuse) and the tools
    service lists nothing for a 129-character id: each service checks, not only the orchestrator."""
    from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
    from services.common.errors import BILLING_DOMAIN, TOOLS_DOMAIN

    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{services.billing.port}") as billing,
        grpc.aio.insecure_channel(f"127.0.0.1:{services.tools.port}") as tools,
    ):
        calls = [
            (
                billing_pb2_grpc.BillingServiceStub(billing).Admit(
                    billing_pb2.AdmitRequest(
                        organization_id=organization_id,
                        turn_key="k",
                        usage_type="run",
                        rate_class="sync_exec",
                    )
                ),
                BILLING_DOMAIN,
            ),
            (
                tools_pb2_grpc.ToolsServiceStub(tools).ListCredentials(
                    tools_pb2.ListCredentialsRequest(organization_id=organization_id)
                ),
                TOOLS_DOMAIN,
            ),
        ]
        for call, domain in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            details = status_details(refused.value)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (details.reason, details.domain) == ("INVALID_ORGANIZATION_ID", domain)


@pytest.mark.parametrize(
    "response_json, says",
    [
        (b'{"kind":"free_text","text":"ab\\u0000cd"}', "NUL"),
        (b"{not json", "not valid JSON"),
        (b"[1]", "an array"),
    ],
)
async def test_a_grpc_answer_the_gateway_would_refuse_is_invalid_and_the_question_stays(
    services, stub, response_json, says
):
    """A NUL in a gRPC answer is refused as HTTP refuses it (never given to the model), and an
    answer that is not JSON or not an object is refused, not read as {} ("'kind' must be one
    of")."""
    from tests.conftest import script
    from tests.sse_client import read_frames

    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    started = await stub.StartTurn(
        assistant_pb2.StartTurnRequest(
            caller=caller,
            message=script(
                {"tool": "ask_user_free_text", "input": {"message": "Name it"}}, {"say": "thanks"}
            ),
        )
    )
    async with services.client() as client:
        frames = await read_frames(client, started.stream_url)
    request_id = frames[-1]["data"]["request_id"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Resume(
            assistant_pb2.ResumeRequest(
                caller=caller,
                chat_id=started.chat_id,
                request_id=request_id,
                response_json=response_json,
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (
        refused.value.details() or ""
    )
    answered = await stub.Resume(
        assistant_pb2.ResumeRequest(
            caller=caller,
            chat_id=started.chat_id,
            request_id=request_id,
            response_json=b'{"kind":"free_text","text":"fine"}',
        )
    )
    assert answered.run_id


async def test_billing_and_tools_name_a_missing_organization_id_as_required(services):
    """One check (ids.request_organization_check) answers an empty organization id for every call
    of billing and tools, with each service's own *_REQUIRED reason."""
    from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc

    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{services.billing.port}") as billing,
        grpc.aio.insecure_channel(f"127.0.0.1:{services.tools.port}") as tools,
    ):
        stub = tools_pb2_grpc.ToolsServiceStub(tools)
        calls = [
            (
                billing_pb2_grpc.BillingServiceStub(billing).Admit(
                    billing_pb2.AdmitRequest(turn_key="k", usage_type="run")
                ),
                "ORGANIZATION_ID_REQUIRED",
            ),
            (stub.ListCredentials(tools_pb2.ListCredentialsRequest()), "ORGANIZATION_REQUIRED"),
            (
                stub.ListKnowledgeBases(tools_pb2.ListKnowledgeBasesRequest()),
                "ORGANIZATION_REQUIRED",
            ),
            (
                stub.GetCredential(
                    tools_pb2.GetCredentialRequest(
                        credential_id="00000000-0000-4000-8000-000000000000"
                    )
                ),
                "ORGANIZATION_REQUIRED",
            ),
        ]
        for call, reason in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert status_details(
                refused.value
            ).reason == reason and "organization_id is required" in (refused.value.details() or "")
