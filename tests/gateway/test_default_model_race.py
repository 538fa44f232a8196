"""A PUT of the default model and a DELETE of its credential, sent together, never leave a saved
default whose key is gone.

`PUT /organizations/settings/composer-llm` checks the credential (tools service, through the
orchestrator's CheckModel) and then saves the default (gateway database); `DELETE
/credentials/{id}` reads the saved default and then deletes the credential (tools service).
Check-then-act on both sides, across two services' databases: interleaved, both would answer
success and leave a default naming a deleted credential, so every turn naming no model fails.
The two operations hold the organization's default-model lock (`DefaultModels.exclusive`: a
row lock on PostgreSQL, an in-process lock on SQLite) from their check to their write.

The tools service's credential store is patched to pause on an asyncio.Event so that the two
requests interleave the same way every run; everything else is the real stack.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from services.gateway.server import GatewayServer
from tests.conftest import selected_backend, start_stack, stop_stack

OPENAI = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}
SCRIPTED = {"integration_name": "loopline", "provider_id": "scripted", "model_id": "default"}
# how long the second request is given to get through while the first one is paused: plenty for
# an unguarded request (milliseconds), and a guarded one waits however long it is given
OVERTAKE_S = 1.0


async def _stack(tmp_path):
    return await start_stack(
        tmp_path, orchestrator={"openai_api_key": "", "openai_models": "gpt-test"}
    )


async def _credential(client) -> str:
    created = await client.post(
        "/credentials",
        json={"integration_name": "openai", "auth_data": {"api_key": "sk-org-own-key-999999"}},
    )
    assert created.status_code == 201, created.text
    return created.json()["credential_id"]


def _pause_after(monkeypatch, store: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Make `store.<name>` (a method of the tools service's credential store) run, then signal
    `reached` and wait for `release` before it returns. Returns (reached, release)."""
    reached, release = asyncio.Event(), asyncio.Event()
    original = getattr(store, name)

    async def paused(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if not release.is_set():
            reached.set()
            await release.wait()
        return result

    monkeypatch.setattr(store, name, paused)
    return reached, release


def _pause_before(monkeypatch, store: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """As `_pause_after`, but the pause comes before the method does its work."""
    reached, release = asyncio.Event(), asyncio.Event()
    original = getattr(store, name)

    async def paused(*args: Any, **kwargs: Any) -> Any:
        if not release.is_set():
            reached.set()
            await release.wait()
        return await original(*args, **kwargs)

    monkeypatch.setattr(store, name, paused)
    return reached, release


async def _end_state(client, credential_id: str) -> tuple[dict[str, Any] | None, int]:
    """(the saved default, GET /credentials/{credential_id}'s status)."""
    saved = (await client.get("/organizations/settings")).json()["composer_llm"]
    return saved, (await client.get(f"/credentials/{credential_id}")).status_code


def _consistent(saved: dict[str, Any] | None, credential_id: str, credential_status: int) -> bool:
    """The invariant: a saved default naming the credential means the credential exists."""
    return not (
        saved is not None
        and saved.get("credential_id") == credential_id
        and credential_status == 404
    )


async def test_put_checked_then_delete_then_put_saves_never_leaves_a_default_without_its_key(
    tmp_path, monkeypatch
):
    """PUT naming X passes its check and pauses before saving; DELETE X comes in meanwhile.

    The DELETE waits for the PUT and is refused (409); without the lock it would see no default
    naming X, delete it (204), and the PUT would then save X as the default (200)."""
    stack = await _stack(tmp_path)
    try:
        async with stack.client() as client:
            credential_id = await _credential(client)
            checked, release = _pause_after(
                monkeypatch, stack.tools.servicer.credentials, "resolve"
            )
            put = asyncio.create_task(
                client.put(
                    "/organizations/settings/composer-llm",
                    json={**OPENAI, "credential_id": credential_id},
                )
            )
            await asyncio.wait_for(checked.wait(), 10)  # the PUT's check found X; its save is next
            delete = asyncio.create_task(client.delete(f"/credentials/{credential_id}"))
            await asyncio.wait({delete}, timeout=OVERTAKE_S)
            overtook = delete.done()
            release.set()
            put_status, delete_status = (await put).status_code, (await delete).status_code
            saved, credential_status = await _end_state(client, credential_id)
            print(
                f"PUT {put_status}, DELETE {delete_status}"
                f" (finished while the PUT was paused: {overtook}); "
                f"saved default {saved}; GET credential {credential_status}"
            )
            assert _consistent(saved, credential_id, credential_status), (
                "a saved default names a deleted credential"
            )
            assert not overtook, (
                "DELETE finished while the PUT held the organization's default model"
            )
            assert (put_status, delete_status, credential_status) == (200, 409, 200)
            assert saved == {**OPENAI, "credential_id": credential_id}
    finally:
        await stop_stack(stack)


async def test_delete_checked_then_put_then_delete_deletes_never_leaves_a_default_without_its_key(
    tmp_path, monkeypatch
):
    """DELETE X finds no default naming X and pauses before the tools service deletes it; PUT
    naming X comes in meanwhile.

    The PUT waits for the DELETE, and its check then finds X gone (400); without the lock its
    check would still find X and save it (200), then the DELETE would remove X (204)."""
    stack = await _stack(tmp_path)
    try:
        async with stack.client() as client:
            credential_id = await _credential(client)
            deleting, release = _pause_before(
                monkeypatch, stack.tools.servicer.credentials, "delete"
            )
            delete = asyncio.create_task(client.delete(f"/credentials/{credential_id}"))
            await asyncio.wait_for(
                deleting.wait(), 10
            )  # the DELETE's check passed; the deletion is next
            put = asyncio.create_task(
                client.put(
                    "/organizations/settings/composer-llm",
                    json={**OPENAI, "credential_id": credential_id},
                )
            )
            await asyncio.wait({put}, timeout=OVERTAKE_S)
            overtook = put.done()
            release.set()
            put_status, delete_status = (await put).status_code, (await delete).status_code
            saved, credential_status = await _end_state(client, credential_id)
            print(
                f"PUT {put_status}, DELETE {delete_status}"
                f" (PUT finished while the DELETE was paused: {overtook}); "
                f"saved default {saved}; GET credential {credential_status}"
            )
            assert _consistent(saved, credential_id, credential_status), (
                "a saved default names a deleted credential"
            )
            assert not overtook, (
                "PUT finished while the DELETE held the organization's default model"
            )
            assert (put_status, delete_status, credential_status) == (400, 204, 404)
            assert saved is None
    finally:
        await stop_stack(stack)


async def test_the_lock_is_per_organization(tmp_path, monkeypatch):
    """A paused DELETE in one organization does not hold up another organization's PUT."""
    stack = await _stack(tmp_path)
    try:
        other = await stack.member("owner", org_id=f"{stack.org_id}_b")
        async with stack.client() as client:
            credential_id = await _credential(client)
            deleting, release = _pause_before(
                monkeypatch, stack.tools.servicer.credentials, "delete"
            )
            delete = asyncio.create_task(client.delete(f"/credentials/{credential_id}"))
            await asyncio.wait_for(deleting.wait(), 10)
            try:
                elsewhere = await asyncio.wait_for(
                    client.put(
                        "/organizations/settings/composer-llm",
                        json=SCRIPTED,
                        headers=stack.headers(api_key=other["api_key"], org_id=f"{stack.org_id}_b"),
                    ),
                    10,
                )
                assert elsewhere.status_code == 200, elsewhere.text
                assert not delete.done()
            finally:
                release.set()
            assert (await delete).status_code == 204
    finally:
        await stop_stack(stack)


@pytest.mark.skipif(
    selected_backend() != "postgres",
    reason="two gateway processes share a database only on PostgreSQL"
    " (one SQLite file serves one gateway)",
)
async def test_two_gateways_on_one_postgresql_database_serialize_put_and_delete(
    tmp_path, monkeypatch
):
    """The PUT through one gateway, the DELETE through another sharing its PostgreSQL database:
    their in-process locks are different objects, so only the database's row lock orders them."""
    stack = await _stack(tmp_path)
    second = await GatewayServer.start(
        stack.gateway.settings.model_copy(update={"http_port": 0, "gateway_grpc_port": 0})
    )
    try:
        assert second.default_models is not stack.gateway.default_models
        async with (
            stack.client() as client,
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{second.port}", headers=stack.headers(), timeout=30
            ) as other,
        ):
            credential_id = await _credential(client)
            checked, release = _pause_after(
                monkeypatch, stack.tools.servicer.credentials, "resolve"
            )
            put = asyncio.create_task(
                client.put(
                    "/organizations/settings/composer-llm",
                    json={**OPENAI, "credential_id": credential_id},
                )
            )
            await asyncio.wait_for(checked.wait(), 10)
            delete = asyncio.create_task(other.delete(f"/credentials/{credential_id}"))
            await asyncio.wait({delete}, timeout=OVERTAKE_S)
            overtook = delete.done()
            release.set()
            put_status, delete_status = (await put).status_code, (await delete).status_code
            saved, credential_status = await _end_state(other, credential_id)
            print(
                f"PUT {put_status} (gateway 1), DELETE {delete_status}"
                " (gateway 2, finished while the PUT was paused: "
                f"{overtook}); saved default {saved}; GET credential {credential_status}"
            )
            assert _consistent(saved, credential_id, credential_status), (
                "a saved default names a deleted credential"
            )
            assert not overtook
            assert (put_status, delete_status, credential_status) == (200, 409, 200)
    finally:
        await second.stop(1)
        await stop_stack(stack)
