"""What every RPC of the servicer shares: its state, the chat claims, the caller's chat and
its pending question (settled when expired), and the model a turn will call."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import grpc
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc, events_pb2
from loopline.billing.v1 import billing_pb2_grpc
from services.common import db, ids
from services.common.errors import RpcError
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.eventlog import RunBackend
from services.orchestrator.eventlog.memory import MemoryBackend
from services.orchestrator.loop import TurnRunner
from services.orchestrator.models import Chat, Interrupt, Message, Run, utcnow
from services.orchestrator.providers import registry
from services.orchestrator.providers.clients import ProviderClients
from services.orchestrator.recovery import RunSupervisor
from services.orchestrator.servicer.errors import Expired, downstream_failure, not_found
from services.orchestrator.thread import cut_off_result

log = logging.getLogger(__name__)

ASSISTANT_KIND = "assistant"


async def lock_chat(session: AsyncSession, chat_id: str) -> None:
    """Lock the chat's row for the rest of the transaction (PostgreSQL `FOR UPDATE`; SQLite has
    one writer at a time). Every transaction that changes a chat and its question (a resume, a
    cancel, an expiry, a delete) takes the chat's row first, then the question's, so two of them
    wait for each other instead of deadlocking."""
    await session.execute(
        select(Chat.id).where(Chat.id == chat_id).with_for_update(key_share=True)
    )  # FOR NO KEY UPDATE


class ChatAccess(assistant_pb2_grpc.AssistantServiceServicer):
    """The servicer's shared state and the looks at a chat that every RPC makes.

    The concern classes (turn start, interrupts, streams, cancel, chats) extend it and the
    servicer combines them (`services/orchestrator/servicer/__init__.py`).
    """

    def __init__(
        self,
        settings: OrchestratorSettings,
        sessions: Any,
        runner: TurnRunner,
        billing: billing_pb2_grpc.BillingServiceStub,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.runner = runner
        self.store = runner.store
        self.billing = billing
        # chat_id -> claim token, for claims taken by this process
        self._claims: dict[str, str] = {}
        # releases of holds whose turn start was cancelled (`TurnStart._release_when_admitted`)
        self._admissions: set[asyncio.Task[None]] = set()
        # shared state of the replicas and this replica's supervisor; set by OrchestratorServer
        self.backend: RunBackend = MemoryBackend()
        self.supervisor: RunSupervisor | None = None

    async def _try_claim(self, chat_id: str) -> bool:
        """Take the chat's start/resume/delete claim (atomic across replicas); False if held.

        UNAVAILABLE when the shared backend (Redis) cannot be reached.
        """
        try:
            token = await self.backend.try_claim(chat_id)
        except Exception:
            log.exception("taking a chat claim failed")
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE,
                "BACKEND_UNAVAILABLE",
                "The service is temporarily unavailable; try again",
            ) from None
        if token is None:
            return False
        self._claims[chat_id] = token
        return True

    async def _claim(self, chat_id: str) -> None:
        """Take the chat's claim or raise 409 RUN_IN_FLIGHT; of two racing requests (on any
        replicas) exactly one proceeds."""
        if not await self._try_claim(chat_id):
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "RUN_IN_FLIGHT",
                "A run is already in flight on this chat; wait for it or cancel it",
            )

    async def _unclaim(self, chat_id: str) -> None:
        """Release this process's claim of the chat (a no-op when it holds none)."""
        token = self._claims.pop(chat_id, None)
        if token is not None:
            await self.backend.release_claim(chat_id, token)

    async def _chat(
        self,
        session: AsyncSession,
        caller: assistant_pb2.Caller,
        chat_id: str,
        deleted: bool = False,
    ) -> Chat:
        """The caller's assistant chat or NOT_FOUND (same error for absent, other org, other kind,
        deleted); with `deleted`, a soft-deleted chat of the caller's is found too (to purge it)."""
        chat = await session.get(Chat, chat_id) if ids.is_row_id(chat_id) else None
        if chat is None or not self._visible(chat, caller, deleted=deleted):
            raise not_found()
        return chat

    async def _pending(self, session: AsyncSession, chat: Chat) -> Interrupt | None:
        """The chat's pending question; an expired one is marked `expired` and frees the chat."""
        interrupt = (
            (
                await session.execute(
                    select(Interrupt).where(
                        Interrupt.chat_id == chat.id, Interrupt.outcome == "pending"
                    )
                )
            )
            .scalars()
            .first()
        )
        if interrupt is None:
            return None
        expires_at = db.utc(interrupt.expires_at)
        if expires_at <= utcnow():
            await self._settle_expired(interrupt)
            raise Expired(interrupt)
        return interrupt

    async def _settle_expired(self, interrupt: Interrupt) -> bool:
        """Settle a pending question past its `expires_at` (LOOPLINE_PENDING_TTL_S) in one
        transaction: the audit row and its run become `expired`, the chat is free (running_id
        cleared), and the question's tool call gets its result (`cut_off_result("expired")`), as a
        cancel gives one, so GET chat and the next model call never see a call without a result.
        Questions are settled when next looked at (status, get, list, a turn, a resume, a
        cancel). Returns whether this call settled it (False when an answer, a cancel or another
        look came first)."""
        async with self.sessions() as writer, writer.begin():
            await lock_chat(writer, interrupt.chat_id)
            result = await writer.execute(
                update(Interrupt)
                .where(Interrupt.id == interrupt.id, Interrupt.outcome == "pending")
                .values(outcome="expired", resolved_at=utcnow())
            )
            if not result.rowcount:
                return False
            await writer.execute(
                update(Run)
                .where(Run.id == interrupt.run_id, Run.status == "interrupted")
                .values(status="expired", updated_at=utcnow())
            )
            await writer.execute(
                update(Chat)
                .where(Chat.id == interrupt.chat_id, Chat.running_id == interrupt.run_id)
                .values(running_id=None)
            )
            writer.add(
                Message(
                    id=str(uuid.uuid4()),
                    chat_id=interrupt.chat_id,
                    run_id=interrupt.run_id,
                    role="tool",
                    content=cut_off_result("expired"),
                    extra={"tool_call_id": interrupt.tool_call_id, "name": interrupt.tool},
                )
            )
        return True

    async def _chat_and_pending(
        self, session: AsyncSession, caller: assistant_pb2.Caller, chat_id: str
    ) -> tuple[Chat, Interrupt | None]:
        """The caller's chat and its pending question; an expired question is settled and the
        chat re-read."""
        chat = await self._chat(session, caller, chat_id)
        try:
            return chat, await self._pending(session, chat)
        except Expired:
            await session.rollback()
            await session.refresh(chat)
            return chat, None

    def _llm(self, message: assistant_pb2.LlmConfig | None, has: bool) -> dict[str, Any]:
        if has and message is not None and message.provider_id:
            llm = {
                "integration_name": message.integration_name,
                "provider_id": message.provider_id,
                "model_id": message.model_id,
            }
            if message.HasField("credential_id") and message.credential_id:
                llm["credential_id"] = message.credential_id
            return llm
        return {
            "integration_name": self.settings.default_integration_name,
            "provider_id": self.settings.default_provider_id,
            "model_id": self.settings.default_model_id,
        }

    # (organization_id, credential_id) -> the org's own model key (BYOK); wired by the server when
    # the tools service can hand out a credential's secret; None refuses llm.credential_id with 400.
    secret_resolver: registry.SecretResolver | None = None
    # the server's kept provider SDK clients (providers/clients.py); None: a client per model call
    provider_clients: ProviderClients | None = None

    async def _model(self, llm: dict[str, Any], organization_id: str) -> Any:
        """The ChatModel for `llm`, resolved before anything is written or charged.

        Raises RpcError: INVALID_ARGUMENT UNKNOWN_MODEL for an unknown provider, model or unusable
        credential (registry.resolve); FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE (metadata
        `credential_id`; the gateway's 409) when the model key's credential cannot be decrypted
        (README "Changing the key": only an operator listing the old key, or a new credential,
        fixes it, so it is not a "try again"); DEADLINE_EXCEEDED TOOLS_TIMEOUT / UNAVAILABLE
        TOOLS_UNAVAILABLE when the tools service does not answer in time / cannot be reached
        (`downstream_failure`).
        """
        try:
            return await registry.resolve(
                self.settings,
                llm,
                organization_id=organization_id,
                secret_resolver=self.secret_resolver,
                clients=self.provider_clients,
            )
        except registry.UnknownModel as unknown:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_MODEL", str(unknown)
            ) from None
        except registry.CredentialUndecryptable as undecryptable:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "CREDENTIAL_UNDECRYPTABLE",
                undecryptable.message,
                metadata={"credential_id": undecryptable.credential_id},
            ) from None
        except grpc.aio.AioRpcError as error:
            raise downstream_failure(
                error, "TOOLS", "The credential service is unavailable; try again"
            ) from None

    def _stream_url(self, chat_id: str, run_id: str) -> str:
        return f"{self.settings.stream_url_prefix}/{chat_id}/listen/{run_id}"

    async def _guard(self, chat_id: str) -> Any:
        """store.turn_guard of `chat_id`, or None when it is not a UUID (then it cannot exist)."""
        return await self.store.turn_guard(chat_id) if ids.is_row_id(chat_id) else None

    @staticmethod
    def _visible(chat: Any, caller: assistant_pb2.Caller, deleted: bool = False) -> bool:
        """Whether `chat` (a Chat, or a row with its organization_id, kind and deleted_at) is a live
        assistant chat of the caller's organization (with `deleted`, a soft-deleted one too); None
        is not. Everything else is the same 404."""
        return (
            chat is not None
            and chat.organization_id == caller.organization_id
            and chat.kind == ASSISTANT_KIND
            and (deleted or chat.deleted_at is None)
        )

    async def _publish_after_pause(self, run_id: str, event: events_pb2.Event) -> None:
        """Append `event` to a paused (closed) run's log, restoring it from the archive if needed,
        then archive the log (a failed archive is tried again in the background: the change this
        event reports is stored, so the call that made it succeeds)."""
        await self.runner.events.append_after_end(run_id, event)
        await self.runner.archive_after_end(run_id)
