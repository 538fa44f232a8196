"""The organization's saved default model: read and set through the API and the admin
command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from modulex import Modulex

from tests.conftest import start_stack, stop_stack
from tests.sse_client import read_frames

FROM_DEFAULT = " (from the organization's default model, PUT /organizations/settings/composer-llm)"


async def test_saved_default_is_used_when_a_turn_names_no_model(services):
    async with services.client() as client:
        assert (await client.get("/organizations/settings")).json() == {
            "llm_model_visibility": {},
            "composer_llm": None,
        }
        for unusable in (
            {"integration_name": "x", "provider_id": "nope", "model_id": "m"},
            {"integration_name": "loopline", "provider_id": "scripted", "model_id": "gpt-9"},
            {
                "integration_name": "openai",
                "provider_id": "openai",
                "model_id": "gpt-4o",
                "credential_id": "nope",
            },
        ):
            refused = await client.put("/organizations/settings/composer-llm", json=unusable)
            assert refused.status_code == 400, refused.text
        assert (await client.get("/organizations/settings")).json()["composer_llm"] is None
        back = {"integration_name": "loopline", "provider_id": "scripted", "model_id": "default"}
        saved = await client.put("/organizations/settings/composer-llm", json=back)
        assert saved.status_code == 200
        # the same shape from PUT and GET
        assert (
            saved.json()["composer_llm"]
            == (await client.get("/organizations/settings")).json()["composer_llm"]
        )
        assert saved.json()["composer_llm"] == {**back, "credential_id": None}
        turn = await client.post("/assistant/chat", json={"message": "hi"})
        assert turn.status_code == 200
        await read_frames(client, turn.json()["stream_url"])
        assert (
            await client.put("/organizations/settings/composer-llm", json={"provider_id": "x"})
        ).status_code == 400


async def test_member_cannot_read_or_set_the_default(services):
    member = await services.member("member")
    async with services.client() as client:
        response = await client.get(
            "/organizations/settings", headers=services.headers(api_key=member["api_key"])
        )
    assert response.status_code == 403
    async with services.client() as client:
        cleared = await client.delete(
            "/organizations/settings/composer-llm",
            headers=services.headers(api_key=member["api_key"]),
        )
    assert cleared.status_code == 403


async def test_sdk_sets_and_reads_the_default(services):
    client = Modulex(
        api_key=services.api_key, organization_id=services.org_id, base_url=services.base_url
    )
    await client.organizations.set_composer_llm("loopline", "scripted", "default")
    settings = await client.organizations.get_settings()
    assert settings.composer_llm is not None
    assert settings.composer_llm.provider_id == "scripted"


def test_admin_command_sets_and_shows_the_default(tmp_path):
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}
    seeded = json.loads(
        subprocess.run(
            [sys.executable, "-m", "services.gateway", "seed-dev"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    org = seeded["organization_id"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.gateway",
            "set-default-llm",
            "--org",
            org,
            "--integration",
            "openai",
            "--provider",
            "openai",
            "--model",
            "gpt-4o",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    shown = json.loads(
        subprocess.run(
            [sys.executable, "-m", "services.gateway", "show-default-llm", "--org", org],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert shown["default_llm"] == {
        "integration_name": "openai",
        "provider_id": "openai",
        "model_id": "gpt-4o",
    }


def test_admin_command_refuses_an_unknown_organization_and_a_missing_database(tmp_path):
    """Admin commands run without the services' LOOPLINE_DATA_DIR answer "no gateway
    database" (exit 1) and create none; set-default-llm on a mistyped organization answers
    "no organization" (exit 1), not `"default_llm": null` with exit 0."""
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path / "elsewhere")}
    args = ["--integration", "openai", "--provider", "openai", "--model", "gpt-4o"]
    for command in (
        ["set-default-llm", "--org", "org_x", *args],
        ["show-default-llm", "--org", "org_x"],
        ["add-member", "--org", "org_x", "--role", "owner"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "services.gateway", *command],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert (
            result.returncode == 1 and "no gateway database" in json.loads(result.stdout)["error"]
        )
    assert not (tmp_path / "elsewhere" / "gateway.db").exists()
    env["LOOPLINE_DATA_DIR"] = str(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "services.gateway", "seed-dev"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = subprocess.run(
        [sys.executable, "-m", "services.gateway", "set-default-llm", "--org", "org_typo", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and json.loads(result.stdout) == {
        "error": "no organization 'org_typo'"
    }


def test_admin_commands_refuse_an_empty_model_or_impossible_org_id_before_storing_anything(
    tmp_path,
):
    # set-default-llm must not store {"", "", ""} (exit 0): every turn naming no model would then
    # be refused
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path)}
    org = json.loads(
        subprocess.run(
            [sys.executable, "-m", "services.gateway", "seed-dev"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )["organization_id"]
    for command, says in (
        (
            [
                "set-default-llm",
                "--org",
                org,
                "--integration",
                " ",
                "--provider",
                "openai",
                "--model",
                "gpt-4o",
            ],
            "must not be empty",
        ),
        (
            [
                "set-default-llm",
                "--org",
                org,
                "--integration",
                "openai",
                "--provider",
                "openai",
                "--model",
                "",
            ],
            "must not be empty",
        ),
        (["show-default-llm", "--org", ""], "visible ASCII"),
        (["list-keys", "--org", "a" * 300], "visible ASCII"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "services.gateway", *command],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 2 and says in result.stderr, (command, result.stderr)
    shown = json.loads(
        subprocess.run(
            [sys.executable, "-m", "services.gateway", "show-default-llm", "--org", org],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert shown["default_llm"] is None


async def test_an_unusable_saved_default_is_a_400_that_says_it_is_the_saved_default(tmp_path):
    """Every refusal of a saved default (unusable credential, e.g. one deleted since, unknown
    model, a malformed one saved by the admin command) says it is the saved default, so a turn
    without `llm` knows where the credential came from; a turn's own `llm` does not say so."""
    openai = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}
    stack = await start_stack(
        tmp_path, orchestrator={"openai_api_key": "", "openai_models": "gpt-test"}
    )
    try:
        async with stack.client() as client:
            created = await client.post(
                "/credentials",
                json={
                    "integration_name": "openai",
                    "auth_data": {"api_key": "sk-org-own-key-999999"},
                },
            )
            assert created.status_code == 201, created.text
            credential_id = created.json()["credential_id"]
            saved = await client.put(
                "/organizations/settings/composer-llm",
                json={**openai, "credential_id": credential_id},
            )
            assert saved.status_code == 200, saved.text
            # deleted behind the gateway's back (DELETE /credentials refuses the default's key:
            # below)
            await stack.tools.servicer.credentials.delete(stack.org_id, credential_id)
            expected = f"credential {credential_id!r} cannot be used as a model key" + FROM_DEFAULT
            for headers in (
                {},
                {"Idempotency-Key": "turn-1"},
                {"Idempotency-Key": "turn-1"},
            ):  # the key is released: same answer
                turn = await client.post("/assistant/chat", json={"message": "hi"}, headers=headers)
                assert turn.status_code == 400 and turn.json() == {"detail": expected}
            own = await client.post(
                "/assistant/chat",
                json={"message": "hi", "llm": {**openai, "credential_id": credential_id}},
            )
            assert own.status_code == 400 and own.json() == {
                "detail": f"credential {credential_id!r} cannot be used as a model key"
            }
            # the same for any other refusal of a saved default (the admin command saves without
            # checking)
            for default, message in (
                (
                    {
                        "integration_name": "loopline",
                        "provider_id": "scripted",
                        "model_id": "gpt-9",
                    },
                    "unknown model 'gpt-9' for provider 'scripted'",
                ),
                (
                    {"integration_name": "openai", "provider_id": "", "model_id": "gpt-test"},
                    "llm.provider_id must be a non-empty string",
                ),
            ):
                await stack.gateway.default_models.set(stack.org_id, default)
                turn = await client.post("/assistant/chat", json={"message": "hi"})
                assert turn.status_code == 400 and turn.json()["detail"].endswith(FROM_DEFAULT), (
                    turn.text
                )
                assert message in turn.json()["detail"]
            assert (await client.get("/assistant/chats")).json()["items"] == []  # nothing written
    finally:
        await stop_stack(stack)


async def test_the_key_of_the_saved_default_model_cannot_be_deleted_until_another_default_is_saved(
    tmp_path,
):
    """DELETE /credentials/{id} of the credential the organization's saved default model
    uses is 409 until another default is saved, since every turn naming no model needs it."""
    openai = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}
    stack = await start_stack(
        tmp_path, orchestrator={"openai_api_key": "", "openai_models": "gpt-test"}
    )
    try:
        async with stack.client() as client:
            created = await client.post(
                "/credentials",
                json={
                    "integration_name": "openai",
                    "auth_data": {"api_key": "sk-org-own-key-999999"},
                },
            )
            credential_id = created.json()["credential_id"]
            assert (
                await client.put(
                    "/organizations/settings/composer-llm",
                    json={**openai, "credential_id": credential_id},
                )
            ).status_code == 200
            refused = await client.delete(f"/credentials/{credential_id}")
            assert refused.status_code == 409 and "default model" in refused.json()["detail"]
            assert (
                await client.get(f"/credentials/{credential_id}")
            ).status_code == 200  # nothing deleted
            scripted = {
                "integration_name": "loopline",
                "provider_id": "scripted",
                "model_id": "default",
            }
            assert (
                await client.put("/organizations/settings/composer-llm", json=scripted)
            ).status_code == 200
            assert (await client.delete(f"/credentials/{credential_id}")).status_code == 204
    finally:
        await stop_stack(stack)


async def test_the_saved_default_can_be_cleared_and_its_key_deleted_then(tmp_path):
    """DELETE is the way back to "no saved default" (a PUT of another model keeps a saved
    choice): it clears it, idempotently, and frees its key."""
    openai = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}
    stack = await start_stack(
        tmp_path, orchestrator={"openai_api_key": "", "openai_models": "gpt-test"}
    )
    try:
        async with stack.client() as client:
            created = await client.post(
                "/credentials",
                json={
                    "integration_name": "openai",
                    "auth_data": {"api_key": "sk-org-own-key-999999"},
                },
            )
            credential_id = created.json()["credential_id"]
            assert (
                await client.put(
                    "/organizations/settings/composer-llm",
                    json={**openai, "credential_id": credential_id},
                )
            ).status_code == 200
            cleared = await client.delete("/organizations/settings/composer-llm")
            assert cleared.status_code == 200 and cleared.json() == {"composer_llm": None}
            assert (await client.get("/organizations/settings")).json()["composer_llm"] is None
            assert (
                await client.delete("/organizations/settings/composer-llm")
            ).status_code == 200  # none saved: the same
            assert (await client.delete(f"/credentials/{credential_id}")).status_code == 204
    finally:
        await stop_stack(stack)
