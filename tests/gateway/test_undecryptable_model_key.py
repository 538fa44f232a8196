"""A model key (bring your own key) that the tools service can no longer decrypt: the credential key
was changed without keeping the old one (README, "Changing the key").

Retrying never helps (so not 503 TOOLS_UNAVAILABLE with Retry-After): only an operator listing
the old key again, or the credential connected again, does. Rule: 409 (the error table's status
for a state the client's request cannot succeed in, as MCP discovery of such a server answers)
naming the credential and the fix, no Retry-After, nothing written, nothing charged (the model
is resolved before billing's Admit), one WARNING in the tools service and no error logged.
"""

from __future__ import annotations

import logging

from cryptography.fernet import Fernet
from sqlalchemy import func, select

from services.billing.models import LedgerEntry, Reservation
from services.orchestrator.models import Chat, Interrupt, Run
from services.tools.server import ToolsServer
from tests.conftest import SCRIPTED
from tests.orchestrator.helpers import billing_delivered, run_turn

OPENAI = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-4o"}
MODEL_KEY = "sk-byok-never-shown-0123456789"


async def _restart_tools_with_only(services, key: str) -> None:
    """Restart the tools service on its port (same database) with `key` as its only credential
    key."""
    settings = services.tools.servicer.executor.settings.model_copy(
        update={
            "tools_credential_key": key,
            "tools_port": services.tools.port,
            "auto_migrate": False,
        }
    )
    await services.tools.stop(0)
    services.tools = await ToolsServer.start(settings)
    # the orchestrator's round-robin channel reconnects on its own, after a backoff: wait for it
    await services.orchestrator.tools_channel.channel_ready()


async def _counts(services) -> tuple[int, int, int, int]:
    """(chats, runs of the orchestrator; reservations, ledger entries of billing) of the stack's
    organization."""
    async with services.orchestrator.servicer.sessions() as session:
        chats = await session.scalar(
            select(func.count()).select_from(Chat).where(Chat.organization_id == services.org_id)
        )
        runs = await session.scalar(
            select(func.count()).select_from(Run).where(Run.organization_id == services.org_id)
        )
    async with services.billing.store.sessions() as session:
        reservations = await session.scalar(
            select(func.count())
            .select_from(Reservation)
            .where(Reservation.org_id == services.org_id)
        )
        ledger = await session.scalar(
            select(func.count())
            .select_from(LedgerEntry)
            .where(LedgerEntry.org_id == services.org_id)
        )
    return chats, runs, reservations, ledger


def _assert_names_the_credential_and_the_fix(response, credential_id: str) -> None:
    assert response.status_code == 409, response.text
    assert "retry-after" not in response.headers
    detail = response.json()["detail"]
    assert credential_id in detail and "cannot be decrypted" in detail, detail
    assert "operator must list the old key" in detail, detail
    assert MODEL_KEY not in response.text


async def test_a_model_key_no_listed_key_decrypts_is_409_naming_it_with_nothing_written_or_charged(
    services, caplog
):
    async with services.client() as client:
        # a question pending on a chat (scripted model), before the organization picks a default
        asked, frames = await run_turn(
            client, {"say": "One question.", "tool": "ask_user_yes_no", "input": {"message": "Go?"}}
        )
        request_id = frames[-1]["data"]["request_id"]
        created = await client.post(
            "/credentials", json={"integration_name": "openai", "auth_data": {"api_key": MODEL_KEY}}
        )
        assert created.status_code in (200, 201), created.text
        credential_id = created.json()["credential_id"]
        saved = await client.put(
            "/organizations/settings/composer-llm", json={**OPENAI, "credential_id": credential_id}
        )
        assert saved.status_code == 200, saved.text
        await billing_delivered(
            services
        )  # the question's turn's token usage (stored with its end) is with billing
        before = await _counts(services)

        await _restart_tools_with_only(services, Fernet.generate_key().decode())
        caplog.clear()
        caplog.set_level(logging.WARNING)

        named = {**OPENAI, "credential_id": credential_id}
        for _ in range(2):  # the same answer every time: not a "try again"
            _assert_names_the_credential_and_the_fix(
                await client.post("/assistant/chat", json={"message": "hi", "llm": named}),
                credential_id,
            )
        # the organization's saved default names it: the same answer for a turn naming no model
        _assert_names_the_credential_and_the_fix(
            await client.post("/assistant/chat", json={"message": "hi"}), credential_id
        )
        # on an existing chat, and for a resume naming it (the question stays pending)
        _assert_names_the_credential_and_the_fix(
            await client.post(
                "/assistant/chat", json={"message": "hi", "chat_id": asked["chat_id"], "llm": named}
            ),
            credential_id,
        )
        _assert_names_the_credential_and_the_fix(
            await client.post(
                f"/assistant/chat/{asked['chat_id']}/resume",
                json={
                    "request_id": request_id,
                    "response": {"kind": "yes_no", "answer": True},
                    "llm": named,
                },
            ),
            credential_id,
        )
        # choosing it as the default again is refused the same way (CheckModel)
        _assert_names_the_credential_and_the_fix(
            await client.put("/organizations/settings/composer-llm", json=named), credential_id
        )

        status = (await client.get(f"/assistant/chat/{asked['chat_id']}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id
        async with services.orchestrator.servicer.sessions() as session:
            assert (await session.get(Interrupt, request_id)).outcome == "pending"
        assert await _counts(services) == before  # no chat, run, reservation or charge
        # a turn that needs no stored key still runs
        scripted = await client.post("/assistant/chat", json={"message": "hi", "llm": SCRIPTED})
        assert scripted.status_code == 200, scripted.text

    _assert_warned_without_the_key(caplog.records, credential_id)


def _assert_warned_without_the_key(records: list[logging.LogRecord], credential_id: str) -> None:
    """One warning per refusal naming the credential, no error log, never the key itself."""
    undecryptable = [r for r in records if "cannot be decrypted" in r.getMessage()]
    assert len(undecryptable) == 6 and all(
        r.levelno == logging.WARNING and r.exc_info is None for r in undecryptable
    )
    assert {getattr(r, "fields", {}).get("credential_id") for r in undecryptable} == {credential_id}
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert not [r for r in records if r.getMessage() == "downstream error"]  # the gateway's 5xx log
    assert all(
        MODEL_KEY not in r.getMessage() and MODEL_KEY not in str(getattr(r, "fields", ""))
        for r in records
    )
