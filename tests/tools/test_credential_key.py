"""A stored secret that no configured key decrypts (LOOPLINE_TOOLS_CREDENTIAL_KEY changed without
keeping the old key): the caller gets a clear error, and the operator a WARNING naming the
credential, the integration and the organization with the fix — never the secret or its ciphertext.
"""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from cryptography.fernet import Fernet

from loopline.tools.v1 import tools_pb2
from services.common.errors import status_details
from services.common.logging import JsonFormatter
from services.common.sqlite_driver import sqlite3
from tests.log_records import fields_of

SECRET_DSN = "postgresql://reader:s3cr3t-Passw0rd@db.example:5432/sales"
MCP_TOKEN = "Bearer mcp-t0ken-never-logged"


def _undecryptable_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "cannot be decrypted" in r.getMessage()]


def _ciphertexts(db_file) -> list[str]:
    with sqlite3.connect(db_file) as connection:
        return [row[0] for row in connection.execute("SELECT encrypted_secret FROM credentials")]


def _assert_secret_free(record: logging.LogRecord, *secrets: str) -> str:
    """The record as the service's JSON log line, checked to hold none of `secrets`."""
    line = JsonFormatter("tools").format(record)
    for secret in secrets:
        assert secret not in line
    return line


async def _two_replicas(start_tools, tmp_path):
    """(writer, reader): one database; the reader's key is a new one, without the writer's."""
    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    old_key, new_key = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    writer = await start_tools(tools_database_url=url, tools_credential_key=old_key)
    reader = await start_tools(tools_database_url=url, tools_credential_key=new_key)
    return writer, reader, old_key, new_key


async def test_an_undecryptable_credential_is_logged_once_with_its_ids_and_the_fix(
    start_tools, tmp_path, caplog
):
    writer, reader, _old, _new = await _two_replicas(start_tools, tmp_path)
    credential = await writer.create_credential(
        "postgresql", {"dsn": SECRET_DSN}, display_name="Sales DB"
    )
    caplog.set_level(logging.WARNING, logger="services.tools")

    error = await reader.failed(
        "execute_integration_tool", {"integration": "postgresql", "action": "list_schemas"}
    )

    assert "cannot be decrypted" in error and "s3cr3t" not in error
    records = _undecryptable_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    record = records[0]
    assert record.levelno == logging.WARNING
    assert fields_of(record)["credential_id"] == credential.credential_id
    assert fields_of(record)["integration"] == "postgresql"
    assert fields_of(record)["org_id"] == "org-a"
    message = record.getMessage()
    assert "LOOPLINE_TOOLS_CREDENTIAL_KEY" in message
    assert "after the new one" in message and "comma-separated" in message
    line = _assert_secret_free(
        record, SECRET_DSN, "s3cr3t-Passw0rd", "db.example", *_ciphertexts(tmp_path / "shared.db")
    )
    assert json.loads(line)["credential_id"] == credential.credential_id


async def test_listing_the_old_key_after_the_new_one_decrypts_it_again(
    start_tools, tmp_path, caplog
):
    writer, _reader, old_key, new_key = await _two_replicas(start_tools, tmp_path)
    await writer.create_credential("http", {"token": "tok-1234567890"}, auth_type="bearer")
    rotated = await start_tools(
        tools_database_url=writer.settings.tools_database_url,
        tools_credential_key=f"{new_key},{old_key}",
    )
    caplog.set_level(logging.WARNING, logger="services.tools")
    # The action itself fails (nothing listens there); what matters is that the secret was read.
    error = await rotated.failed(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": "http://127.0.0.1:9/x"}},
    )
    assert "cannot be decrypted" not in error
    assert _undecryptable_records(caplog) == []


async def test_mcp_discovery_of_an_undecryptable_server_is_a_clear_error_and_logged_once(
    start_tools, tmp_path, caplog
):
    writer, reader, _old, _new = await _two_replicas(start_tools, tmp_path)
    info = await writer.server.servicer.credentials.create_raw(
        "org-a",
        "mcp_docs",
        "mcp_server",
        {"url": "https://mcp.example/mcp", "headers": {"Authorization": MCP_TOKEN}},
        "Docs",
        discovery=[],
    )
    caplog.set_level(logging.WARNING)
    # listing the tools last discovered needs no secret: it works whatever the key
    listed = await reader.stub.ListMcpTools(
        tools_pb2.ListMcpToolsRequest(organization_id="org-a", credential_id=info.id)
    )
    assert listed.credential_id == info.id and _undecryptable_records(caplog) == []
    for call, request in (
        (
            reader.stub.RefreshMcpDiscovery,
            tools_pb2.RefreshMcpDiscoveryRequest(organization_id="org-a", credential_id=info.id),
        ),
    ):
        caplog.clear()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(request)
        details = status_details(caught.value)
        assert (details.code, details.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "CREDENTIAL_UNDECRYPTABLE",
        )
        assert details.metadata == {"credential_id": info.id} and info.id in details.message
        records = _undecryptable_records(caplog)
        assert len(records) == 1 and fields_of(records[0])["credential_id"] == info.id
        assert fields_of(records[0])["integration"] == "mcp_docs"
        assert not [
            r for r in caplog.records if r.levelno >= logging.ERROR
        ]  # not an "unhandled error"
        _assert_secret_free(
            records[0], MCP_TOKEN, "mcp-t0ken", *_ciphertexts(tmp_path / "shared.db")
        )


MODEL_KEY = "sk-m0del-key-never-logged-1234567890"


async def test_resolving_an_undecryptable_model_key_is_failed_precondition_named_and_logged_once(
    start_tools, tmp_path, caplog
):
    # ResolveCredentialSecret (the orchestrator's bring-your-own-key lookup) answers a
    # SecretBoxError FAILED_PRECONDITION: escaping, it would be INTERNAL with an ERROR traceback,
    # which the orchestrator turns into a permanent 503 "try again".
    writer, reader, _old, _new = await _two_replicas(start_tools, tmp_path)
    credential = await writer.create_credential("openai", {"api_key": MODEL_KEY})
    request = tools_pb2.ResolveCredentialSecretRequest(
        organization_id="org-a", credential_id=credential.credential_id, integration_name="openai"
    )
    assert (await writer.stub.ResolveCredentialSecret(request)).secret == MODEL_KEY
    caplog.set_level(logging.WARNING)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await reader.stub.ResolveCredentialSecret(request)

    details = status_details(caught.value)
    assert (details.code, details.reason, details.domain) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "CREDENTIAL_UNDECRYPTABLE",
        "tools.loopline.dev",
    )
    assert details.metadata == {"credential_id": credential.credential_id}
    assert credential.credential_id in details.message and "cannot be decrypted" in details.message
    assert "old key" in details.message and MODEL_KEY not in details.message
    records = _undecryptable_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert fields_of(records[0])["credential_id"] == credential.credential_id
    assert (fields_of(records[0])["integration"], fields_of(records[0])["org_id"]) == (
        "openai",
        "org-a",
    )
    assert "LOOPLINE_TOOLS_CREDENTIAL_KEY" in records[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # not an "unhandled error"
    _assert_secret_free(records[0], MODEL_KEY, *_ciphertexts(tmp_path / "shared.db"))


async def test_an_oauth2_state_the_new_key_cannot_read_asks_to_start_again_and_is_logged(
    start_tools, tmp_path, caplog
):
    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    provider = json.dumps(
        [
            {
                "name": "acme",
                "authorize_url": "https://auth.example/authorize",
                "token_url": "https://auth.example/token",
                "client_id": "loopline-client",
                "api_base_url": "https://api.example",
            }
        ]
    )
    writer = await start_tools(
        tools_database_url=url,
        tools_credential_key=Fernet.generate_key().decode(),
        tools_oauth2_integrations=provider,
    )
    reader = await start_tools(
        tools_database_url=url,
        tools_credential_key=Fernet.generate_key().decode(),
        tools_oauth2_integrations=provider,
    )
    started = await writer.stub.InitiateOAuth2(
        tools_pb2.InitiateOAuth2Request(
            organization_id="org-a",
            integration_name="acme",
            redirect_uri="https://app.example/callback",
        )
    )
    caplog.set_level(logging.WARNING)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await reader.stub.CompleteOAuth2(
            tools_pb2.CompleteOAuth2Request(state=started.state, code="code-1")
        )
    details = status_details(caught.value)
    assert (details.code, details.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "OAUTH2_STATE_INVALID",
    )
    assert "start the connection again" in details.message
    records = _undecryptable_records(caplog)
    assert len(records) == 1
    assert fields_of(records[0]) == {"integration": "acme", "org_id": "org-a"}
    assert "LOOPLINE_TOOLS_CREDENTIAL_KEY" in records[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_rotate_credentials_rewrites_old_secrets_with_the_new_key_and_names_the_lost(
    start_tools, tmp_path
):
    """`python -m services.tools rotate-credentials`: with NEW,OLD configured, every secret OLD
    encrypted is encrypted again with NEW (so OLD can be dropped); one no key decrypts is named
    and left as it is (exit 1)."""
    from services.tools.__main__ import rotate_credentials
    from services.tools.config import ToolsSettings
    from services.tools.crypto import SecretBox, SecretBoxError

    writer, _reader, old_key, new_key = await _two_replicas(start_tools, tmp_path)
    url = writer.settings.tools_database_url
    kept = await writer.create_credential("postgresql", {"dsn": SECRET_DSN})
    stranger = await start_tools(
        tools_database_url=url, tools_credential_key=Fernet.generate_key().decode()
    )
    lost = await stranger.create_credential("http", {"token": "tok-1234567890"}, auth_type="bearer")
    before = _ciphertexts(tmp_path / "shared.db")

    settings = ToolsSettings(
        data_dir=tmp_path / "cli",
        tools_database_url=url,
        tools_credential_key=f"{new_key},{old_key}",
    )
    code, document = await rotate_credentials(settings)

    assert (code, document) == (
        1,
        {"rotated": 1, "undecryptable": [lost.credential_id], "oauth2_flows_rotated": 0},
    )
    assert SECRET_DSN not in json.dumps(document)
    after = _ciphertexts(tmp_path / "shared.db")
    new_only = SecretBox([new_key])
    assert {"dsn": SECRET_DSN} in [
        new_only.decrypt(token) for token in after if token not in before
    ]
    assert len(set(after) - set(before)) == 1  # the lost one is untouched
    with pytest.raises(SecretBoxError):
        SecretBox([old_key]).decrypt(next(token for token in after if token not in before))
    assert kept.credential_id not in document["undecryptable"]
    code, document = await rotate_credentials(
        ToolsSettings(
            data_dir=tmp_path / "cli", tools_database_url=url, tools_credential_key=new_key
        )
    )
    assert (code, document["rotated"]) == (
        1,
        0,
    )  # the kept one is already under the new key: not rewritten again


def test_rotate_credentials_command_refuses_without_a_key_or_a_database(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    command = [sys.executable, "-m", "services.tools", "rotate-credentials"]
    no_key = subprocess.run(
        command,
        env={**env, "LOOPLINE_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        no_key.returncode == 1
        and "LOOPLINE_TOOLS_CREDENTIAL_KEY is not set" in json.loads(no_key.stdout)["error"]
    )
    no_db = subprocess.run(
        command,
        env={
            **env,
            "LOOPLINE_DATA_DIR": str(tmp_path),
            "LOOPLINE_TOOLS_CREDENTIAL_KEY": Fernet.generate_key().decode(),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert no_db.returncode == 1 and "no tools database" in json.loads(no_db.stdout)["error"]
    (tmp_path / "tools.db").touch()
    bad_key = subprocess.run(
        command,
        env={
            **env,
            "LOOPLINE_DATA_DIR": str(tmp_path),
            "LOOPLINE_TOOLS_CREDENTIAL_KEY": "not-a-fernet-key",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        bad_key.returncode == 1 and "must be a Fernet key" in json.loads(bad_key.stdout)["error"]
    )  # JSON, not a traceback
    assert "not-a-fernet-key" not in bad_key.stdout + bad_key.stderr
    (tmp_path / "tools.db").unlink()
    assert not list(tmp_path.iterdir())  # nothing was created


async def test_rotate_credentials_also_rewrites_pending_oauth2_flows(start_tools, tmp_path):
    """rotate-credentials also re-encrypts the PKCE verifier of a pending OAuth2 flow under
    the new key, so dropping the old key does not break that flow's callback."""
    from services.tools.__main__ import rotate_credentials
    from services.tools.config import ToolsSettings
    from services.tools.crypto import SecretBox

    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    provider = json.dumps(
        [
            {
                "name": "acme",
                "authorize_url": "https://auth.example/authorize",
                "token_url": "https://auth.example/token",
                "client_id": "loopline-client",
                "api_base_url": "https://api.example",
            }
        ]
    )
    old_key, new_key = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    writer = await start_tools(
        tools_database_url=url, tools_credential_key=old_key, tools_oauth2_integrations=provider
    )
    await writer.stub.InitiateOAuth2(
        tools_pb2.InitiateOAuth2Request(
            organization_id="org-a",
            integration_name="acme",
            redirect_uri="https://app.example/callback",
        )
    )

    settings = ToolsSettings(
        data_dir=tmp_path / "cli",
        tools_database_url=url,
        tools_credential_key=f"{new_key},{old_key}",
    )
    code, document = await rotate_credentials(settings)

    assert (code, document) == (0, {"rotated": 0, "undecryptable": [], "oauth2_flows_rotated": 1})
    with sqlite3.connect(tmp_path / "shared.db") as connection:
        (token,) = connection.execute("SELECT encrypted_verifier FROM oauth_states").fetchone()
    assert set(SecretBox([new_key]).decrypt(token)) == {"verifier"}


async def test_rotate_credentials_skips_rows_already_under_the_first_key(start_tools, tmp_path):
    """rotate-credentials rewrites and counts only rows the first key alone cannot decrypt,
    so a second run rewrites nothing (its ciphertexts stay byte for byte)."""
    from services.tools.__main__ import rotate_credentials
    from services.tools.config import ToolsSettings

    url = f"sqlite+aiosqlite:///{(tmp_path / 'shared.db').as_posix()}"
    provider = json.dumps(
        [
            {
                "name": "acme",
                "authorize_url": "https://auth.example/authorize",
                "token_url": "https://auth.example/token",
                "client_id": "loopline-client",
                "api_base_url": "https://api.example",
            }
        ]
    )
    old_key, new_key = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    old = await start_tools(
        tools_database_url=url, tools_credential_key=old_key, tools_oauth2_integrations=provider
    )
    new = await start_tools(
        tools_database_url=url,
        tools_credential_key=f"{new_key},{old_key}",
        tools_oauth2_integrations=provider,
    )
    await old.create_credential("postgresql", {"dsn": SECRET_DSN})
    await new.create_credential(
        "http", {"token": "tok-1234567890"}, auth_type="bearer"
    )  # already under NEW
    for replica in (old, new):
        await replica.stub.InitiateOAuth2(
            tools_pb2.InitiateOAuth2Request(
                organization_id="org-a",
                integration_name="acme",
                redirect_uri="https://app.example/callback",
            )
        )

    def stored() -> list[str]:
        with sqlite3.connect(tmp_path / "shared.db") as connection:
            flows = [
                row[0]
                for row in connection.execute(
                    "SELECT encrypted_verifier FROM oauth_states ORDER BY state"
                )
            ]
        return sorted(_ciphertexts(tmp_path / "shared.db")) + flows

    settings = ToolsSettings(
        data_dir=tmp_path / "cli",
        tools_database_url=url,
        tools_credential_key=f"{new_key},{old_key}",
    )
    first = await rotate_credentials(settings)
    assert first == (
        0,
        {"rotated": 1, "undecryptable": [], "oauth2_flows_rotated": 1},
    )  # only OLD's rows
    before = stored()
    second = await rotate_credentials(settings)
    assert second == (0, {"rotated": 0, "undecryptable": [], "oauth2_flows_rotated": 0})
    assert stored() == before  # nothing was rewritten


async def test_rotate_credentials_answers_a_database_it_cannot_use_as_json(tmp_path):
    """rotate-credentials answers a tools database it cannot use (a file of garbage, a
    folder, an empty file never migrated, a malformed URL, a PostgreSQL server that refuses)
    with {"error": ...} and exit 1, naming the database but never the URL's password, and no
    traceback."""
    import asyncio
    import os
    import subprocess
    import sys

    from services.tools.__main__ import rotate_credentials
    from services.tools.config import ToolsSettings

    key = Fernet.generate_key().decode()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(os.urandom(4096))
    (tmp_path / "folder.db").mkdir()
    (tmp_path / "empty.db").touch()
    cases = {
        f"sqlite+aiosqlite:///{garbage}": (
            f"the tools database at {garbage} cannot be used: the file is not a SQLite database"
        ),
        f"sqlite+aiosqlite:///{tmp_path / 'folder.db'}": "it is a folder, not a database file",
        f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}": (
            "cannot be used: no such table: credentials"
        ),
        # a data directory that is a file is named as such, not as a missing FILE/tools.db
        f"sqlite+aiosqlite:///{garbage / 'tools.db'}": f"its folder {garbage} is a file",
        "not a url": "LOOPLINE_TOOLS_DATABASE_URL is not a database URL",
        "postgresql+asyncpg://vault:pa55word-x@127.0.0.1:1/tools": (
            "(postgresql database 'tools' on 127.0.0.1:1) cannot be used"
        ),
    }
    for url, fragment in cases.items():
        code, document = await rotate_credentials(
            ToolsSettings(data_dir=tmp_path, tools_database_url=url, tools_credential_key=key)
        )
        assert code == 1 and list(document) == ["error"] and fragment in document["error"], (
            url,
            document,
        )
        assert "pa55word-x" not in document["error"]

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(
        LOOPLINE_TOOLS_DATABASE_URL=f"sqlite+aiosqlite:///{garbage}",
        LOOPLINE_TOOLS_CREDENTIAL_KEY=key,
    )
    command = [sys.executable, "-m", "services.tools", "rotate-credentials"]
    result = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "not a SQLite database" in json.loads(result.stdout)["error"]
