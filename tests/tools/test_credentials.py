"""Credential RPCs and get_organization_credentials: organization scoping, defaults, encryption
at rest, no secret out."""

from __future__ import annotations

import json

import grpc
import pytest
from cryptography.fernet import Fernet

from loopline.tools.v1 import tools_pb2
from services.common.errors import status_details
from services.common.sqlite_driver import sqlite3
from services.tools.crypto import SecretBox, SecretBoxError

SECRET_DSN = "postgresql://reader:s3cr3t-Passw0rd@db.example:5432/sales"


async def test_credentials_are_encrypted_at_rest_with_the_configured_key(start_tools):
    key = Fernet.generate_key().decode()
    tools = await start_tools(tools_credential_key=key)
    credential = await tools.create_credential(
        "postgresql", {"dsn": SECRET_DSN}, display_name="Sales DB"
    )

    db_file = tools.settings.data_dir / "tools.db"
    with sqlite3.connect(db_file) as connection:
        row = connection.execute(
            "SELECT * FROM credentials WHERE id = ?", (credential.credential_id,)
        ).fetchone()
        token = connection.execute(
            "SELECT encrypted_secret FROM credentials WHERE id = ?", (credential.credential_id,)
        ).fetchone()[0]
    raw = " ".join(str(value) for value in row)
    assert "s3cr3t-Passw0rd" not in raw
    assert "db.example" not in raw
    assert SecretBox([key]).decrypt(token) == {"dsn": SECRET_DSN}
    with pytest.raises(SecretBoxError):
        SecretBox([Fernet.generate_key().decode()]).decrypt(token)


async def test_no_rpc_or_tool_returns_the_secret(tools_service):
    credential = await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    got = await tools_service.stub.GetCredential(
        tools_pb2.GetCredentialRequest(
            organization_id="org-a", credential_id=credential.credential_id, include_masked=True
        )
    )
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a")
    )
    tool_output = await tools_service.ok("get_organization_credentials", {})
    for text in (str(credential), str(got), str(listed), json.dumps(tool_output)):
        assert "s3cr3t-Passw0rd" not in text
        assert SECRET_DSN not in text
    assert got.credential.auth_data_masked == "dsn=po****es"
    assert credential.auth_data_masked == ""  # only on request


async def test_get_organization_credentials_returns_metadata_only(tools_service):
    first = await tools_service.create_credential(
        "postgresql", {"dsn": SECRET_DSN}, display_name="Sales DB"
    )
    await tools_service.create_credential("http", {"token": "tok-abcdefghijkl"}, auth_type="bearer")
    await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN}, org="org-b")

    output = await tools_service.ok("get_organization_credentials", {"integration": "postgresql"})
    assert output["count"] == 1
    (item,) = output["credentials"]
    assert set(item) == {
        "id",
        "integration",
        "auth_type",
        "display_name",
        "is_default",
        "created_at",
        "updated_at",
    }
    assert item["id"] == first.credential_id
    assert item["integration"] == "postgresql"
    assert item["auth_type"] == "api_key"
    assert item["display_name"] == "Sales DB"
    assert item["is_default"] is True
    assert item["created_at"].endswith("+00:00")
    every = await tools_service.ok("get_organization_credentials", {})
    assert every["count"] == 2


async def test_another_organizations_credential_is_not_found(tools_service):
    credential = await tools_service.create_credential(
        "postgresql", {"dsn": SECRET_DSN}, org="org-a"
    )
    for call, request in (
        (
            tools_service.stub.GetCredential,
            tools_pb2.GetCredentialRequest(
                organization_id="org-b", credential_id=credential.credential_id
            ),
        ),
        (
            tools_service.stub.DeleteCredential,
            tools_pb2.DeleteCredentialRequest(
                organization_id="org-b", credential_id=credential.credential_id
            ),
        ),
        (
            tools_service.stub.SetDefaultCredential,
            tools_pb2.SetDefaultCredentialRequest(
                organization_id="org-b", credential_id=credential.credential_id
            ),
        ),
        (
            tools_service.stub.GetCredential,
            tools_pb2.GetCredentialRequest(organization_id="org-a", credential_id="absent"),
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(request)
        details = status_details(caught.value)
        assert details.code == grpc.StatusCode.NOT_FOUND
        assert details.reason == "CREDENTIAL_NOT_FOUND"
    # Still there for its owner.
    got = await tools_service.stub.GetCredential(
        tools_pb2.GetCredentialRequest(
            organization_id="org-a", credential_id=credential.credential_id
        )
    )
    assert got.credential.integration_name == "postgresql"


async def test_first_credential_is_default_and_set_default_moves_the_flag(tools_service):
    first = await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    second = await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    assert first.is_default and not second.is_default

    moved = await tools_service.stub.SetDefaultCredential(
        tools_pb2.SetDefaultCredentialRequest(
            organization_id="org-a", credential_id=second.credential_id
        )
    )
    assert moved.credential.is_default
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a")
    )
    flags = {c.credential_id: c.is_default for c in listed.credentials}
    assert flags == {first.credential_id: False, second.credential_id: True}

    third = await tools_service.create_credential(
        "postgresql", {"dsn": SECRET_DSN}, make_default=True
    )
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a")
    )
    assert [c.credential_id for c in listed.credentials if c.is_default] == [third.credential_id]
    assert listed.total == 3


async def test_deleting_the_default_promotes_the_newest_remaining_credential(tools_service):
    first = await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    second = await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    deleted = await tools_service.stub.DeleteCredential(
        tools_pb2.DeleteCredentialRequest(
            organization_id="org-a", credential_id=first.credential_id
        )
    )
    assert deleted.new_default_credential_id == second.credential_id
    got = await tools_service.stub.GetCredential(
        tools_pb2.GetCredentialRequest(organization_id="org-a", credential_id=second.credential_id)
    )
    assert got.credential.is_default
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a")
    )
    assert [c.credential_id for c in listed.credentials] == [second.credential_id]


@pytest.mark.parametrize(
    ("integration", "auth_type", "auth_data", "reason", "says"),
    [
        ("gitrub", "", {"token": "x"}, "INTEGRATION_NOT_FOUND", "Unknown integration 'gitrub'"),
        ("postgresql", "bearer", {"token": "abc"}, "AUTH_TYPE_NOT_SUPPORTED", "not 'bearer'"),
        ("http", "none", {}, "AUTH_TYPE_NOT_SUPPORTED", "not 'none'"),
        # says it needs no credential, not "takes auth types [], not ''"
        (
            "loopline",
            "",
            {},
            "AUTH_TYPE_NOT_SUPPORTED",
            "Integration 'loopline' needs no credential: it is connected without one",
        ),
        (
            "postgresql",
            "api_key",
            {"dsn": "mysql://root:hunter2-secret@h/db"},
            "INVALID_AUTH_DATA",
            "auth_data.dsn: must match the pattern",
        ),
        ("postgresql", "api_key", {}, "INVALID_AUTH_DATA", "auth_data: 'dsn' is required"),
        (
            "postgresql",
            "api_key",
            {"host": "hunter2-secret.example"},
            "INVALID_AUTH_DATA",
            "auth_data: 'dsn' is required; auth_data: unexpected field(s) 'host' (allowed: 'dsn')",
        ),
    ],
)
async def test_invalid_credentials_are_rejected_without_echoing_the_secret(
    tools_service, integration, auth_type, auth_data, reason, says
):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await tools_service.create_credential(integration, auth_data, auth_type=auth_type)
    details = status_details(caught.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.reason == reason
    assert says in details.message
    assert "hunter2-secret" not in details.message


async def test_list_credentials_filters_and_pages(tools_service):
    for _ in range(3):
        await tools_service.create_credential("postgresql", {"dsn": SECRET_DSN})
    await tools_service.create_credential(
        "http", {"api_key": "key-1234567890"}, auth_type="api_key"
    )
    page = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(
            organization_id="org-a", integration_name="postgresql", limit=2, offset=1
        )
    )
    assert page.total == 3
    assert len(page.credentials) == 2
    by_type = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a", auth_type="api_key")
    )
    assert by_type.total == 4
    assert {c.integration_name for c in by_type.credentials} == {"postgresql", "http"}
    with pytest.raises(
        grpc.aio.AioRpcError
    ) as caught:  # no credential can have it: not an empty page
        await tools_service.stub.ListCredentials(
            tools_pb2.ListCredentialsRequest(organization_id="org-a", auth_type="apikey")
        )
    details = status_details(caught.value)
    assert (details.code, details.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "AUTH_TYPE_UNKNOWN")


async def _create_defaults_together(tools_service) -> None:
    """15 POST /credentials with make_default sent together (PostgreSQL): two transactions may
    each clear the defaults they saw and insert their own (a unique violation of
    uq_credentials_one_default). A create that loses the race is tried again; every create
    succeeds and one default remains."""
    import asyncio

    created = await asyncio.gather(
        *(
            tools_service.create_credential(
                "anthropic", {"api_key": f"sk-test-{index}-xxxxxxxx"}, make_default=True
            )
            for index in range(12)
        )
    )
    assert len({c.credential_id for c in created}) == 12
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id="org-a", integration_name="anthropic")
    )
    assert len(listed.credentials) == 12 and sum(c.is_default for c in listed.credentials) == 1


async def test_credentials_created_together_as_default_leave_exactly_one_default(start_tools):
    await _create_defaults_together(await start_tools())


async def test_credentials_created_together_as_default_leave_exactly_one_default_on_postgresql(
    start_tools, pg_database
):
    await _create_defaults_together(await start_tools(tools_database_url=pg_database))
