"""The AssistantService servicer: turns, streams, resume, cancel and chat reads.

Spec sections implemented here: "How a turn is admitted, charged, and tracked"
(guards, reject-before-write admission, persist-and-charge, background execution),
"Termination and limits" (cancel), "Human-in-the-loop pause" (resume), and the chat
reads of the official SDK (`modulex/types/assistant.py`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc, events_pb2
from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2
from services.common import db, ids, pb
from services.common.errors import ASSISTANT_DOMAIN, RpcError, abort, rpc_handler
from services.orchestrator import hitl
from services.orchestrator.backend import MemoryBackend, RunBackend, StreamInterrupted
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.loop import RunSpec, TurnRunner
from services.orchestrator.models import Chat, Interrupt, Message, Run, RunEvent, utcnow
from services.orchestrator.providers import registry
from services.orchestrator.recovery import RunSupervisor
from services.orchestrator.store import ClaimLost, ThreadRow
from services.orchestrator.thread import cut_off_result
from services.orchestrator.usage import release_or_store

log = logging.getLogger(__name__)

ASSISTANT_KIND = "assistant"
STREAM_READY = "x-loopline-stream"  # initial metadata sent once a StreamRun request is validated
TITLE_LENGTH = 50
REQUEST_ID_LENGTH = 64  # StartTurnRequest.request_id, at most (runs.request_id)
MAX_CHAT_PAGE_SIZE = 1000  # GetChatRequest.page_size, at most
CHAT_PAGE_BYTES = (
    3 * 1024 * 1024
)  # a GetChat page's messages, at most (a gRPC client's default limit is 4 MiB)
CANCEL_ATTEMPTS = 3  # looks at a chat's active run by one Cancel, when it changes under the cancel (`_cancel_active`)
REQUEST_CLAIM_WAIT_S = (
    30.0  # a start waits this long at most for another with its request_id (`_claim_request`)
)
REQUEST_CLAIM_POLL_S = 0.02
# a billing call that ended without an answer: billing may or may not have done its work
_OUTCOME_UNKNOWN = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


def _not_found(what: str = "Chat") -> RpcError:
    return RpcError(grpc.StatusCode.NOT_FOUND, f"{what.upper()}_NOT_FOUND", f"{what} not found")


unary = rpc_handler(
    check=ids.request_organization_check(ASSISTANT_DOMAIN)
)  # every call names a possible organization


class _PassThrough(Exception):
    """A downstream rich status to return unchanged (a billing denial)."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__("pass-through status")
        self.status = status


def _downstream_failure(error: grpc.aio.AioRpcError, service: str, unavailable: str) -> RpcError:
    """The error of a turn whose call to billing or the tools service failed with `error` (no answer
    of theirs to pass on): DEADLINE_EXCEEDED `<service>_TIMEOUT` when the call timed out (the
    gateway's 504, README error table: "a downstream timeout"), else UNAVAILABLE
    `<service>_UNAVAILABLE` with the message `unavailable` and a RetryInfo of 1 s (503 with
    Retry-After; a gRPC caller gets the same hint, AIP-194). `service` is "BILLING" or "TOOLS"."""
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        what = "Billing" if service == "BILLING" else "The tools service"
        return RpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{service}_TIMEOUT",
            f"{what} did not answer in time",
        )
    return RpcError(
        grpc.StatusCode.UNAVAILABLE, f"{service}_UNAVAILABLE", unavailable, retry_after_s=1.0
    )


def _downstream_status(error: grpc.aio.AioRpcError) -> grpc.Status | None:
    """The rich status of a downstream refusal to pass on unchanged (a billing denial), or None:
    no details, or UNKNOWN (a failure inside the service, whose outcome is unknown: answered
    as that service being unavailable, `_downstream_failure`)."""
    if error.code() == grpc.StatusCode.UNKNOWN:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return rpc_status.to_status(status_pb2.Status.FromString(value))
    return None


async def _lock_chat(session: AsyncSession, chat_id: str) -> None:
    """Lock the chat's row for the rest of the transaction (PostgreSQL `FOR UPDATE`; SQLite has
    one writer at a time). Every transaction that changes a chat and its question (a resume, a
    cancel, an expiry, a delete) takes the chat's row first, then the question's, so two of them
    wait for each other instead of deadlocking (fresh-eyes test: a resume and a cancel sent
    together on PostgreSQL, one of them 500 "deadlock detected")."""
    await session.execute(
        select(Chat.id).where(Chat.id == chat_id).with_for_update(key_share=True)
    )  # FOR NO KEY UPDATE


def _page_token(chat_id: str, seq: int) -> str:
    """A GetChat page token: the messages before `seq` of the chat (URL-safe base64 of "<chat id>|<seq>")."""
    return base64.urlsafe_b64encode(f"{chat_id}|{seq}".encode()).decode()


def _page_token_seq(token: str, chat_id: str) -> int:
    """The seq in a GetChat page token of `chat_id`; INVALID_ARGUMENT INVALID_PAGE_TOKEN for any other text."""
    try:
        owner, _, seq = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        if owner != chat_id or not seq.isdigit() or not 0 < int(seq) < 2**63:
            raise ValueError("not a page token of this chat")
        return int(seq)
    except (ValueError, UnicodeError):
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_PAGE_TOKEN",
            "page_token is not valid for this chat",
        ) from None


# A ListChats cursor: "<created_at in UTC, isoformat()>|<chat id>", URL-safe base64.
_CURSOR = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?\+00:00)\|"
    r"(?P<id>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
)


class AssistantServicer(assistant_pb2_grpc.AssistantServiceServicer):
    """Implements loopline.assistant.v1.AssistantService over the orchestrator database."""

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
        self._claims: dict[
            str, str
        ] = {}  # chat_id -> claim token, for claims taken by this process
        self._admissions: set[asyncio.Task] = (
            set()
        )  # releases of holds whose turn start was cancelled
        # shared state of the replicas and this replica's supervisor; set by OrchestratorServer
        self.backend: RunBackend = MemoryBackend()
        self.supervisor: RunSupervisor | None = None

    # ------------------------------------------------------------------ helpers

    async def _try_claim(self, chat_id: str) -> bool:
        """Take the chat's start/resume/delete claim (atomic across replicas); False when it is held.

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
        """Take the chat's claim or raise 409 RUN_IN_FLIGHT; two racing requests (any replicas): exactly one proceeds."""
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
        if not self._visible(chat, caller, deleted=deleted):
            raise _not_found()
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
            raise _Expired(interrupt)
        return interrupt

    async def _settle_expired(self, interrupt: Interrupt) -> bool:
        """Settle a pending question past its `expires_at` (LOOPLINE_PENDING_TTL_S) in one
        transaction: the audit row and its run become `expired`, the chat is free (running_id
        cleared), and the question's tool call gets its result (`cut_off_result("expired")`), as a
        cancel gives one, so GET chat and the next model call never see a call without a result.
        Questions are settled when next looked at (status, get, list, a turn, a resume, a cancel). Returns
        whether this call settled it (False when an answer, a cancel or another look came first)."""
        async with self.sessions() as writer, writer.begin():
            await _lock_chat(writer, interrupt.chat_id)
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
        """The caller's chat and its pending question; an expired question is settled and the chat re-read."""
        chat = await self._chat(session, caller, chat_id)
        try:
            return chat, await self._pending(session, chat)
        except _Expired:
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

    async def _model(self, llm: dict[str, Any], organization_id: str) -> Any:
        """The ChatModel for `llm`, resolved before anything is written or charged.

        Raises RpcError: INVALID_ARGUMENT UNKNOWN_MODEL for an unknown provider, model or unusable
        credential (registry.resolve); FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE (metadata
        `credential_id`; the gateway's 409) when the model key's credential cannot be decrypted
        (README "Changing the key": only an operator listing the old key, or a new credential,
        fixes it, so it is not a "try again"); DEADLINE_EXCEEDED TOOLS_TIMEOUT / UNAVAILABLE
        TOOLS_UNAVAILABLE when the tools service does not answer in time / cannot be reached
        (`_downstream_failure`).
        """
        try:
            return await registry.resolve(
                self.settings,
                llm,
                organization_id=organization_id,
                secret_resolver=self.secret_resolver,
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
            raise _downstream_failure(
                error, "TOOLS", "The credential service is unavailable; try again"
            ) from None

    def _stream_url(self, chat_id: str, run_id: str) -> str:
        return f"{self.settings.stream_url_prefix}/{chat_id}/listen/{run_id}"

    # ------------------------------------------------------------------ StartTurn

    @unary
    async def StartTurn(
        self, request: assistant_pb2.StartTurnRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.StartTurnResponse:
        """Guards -> model -> admission -> persist -> charge -> start the loop (nothing written on a refusal).

        The model (and its bring-your-own key) is resolved before billing is asked, so a model
        refused (`_model`: INVALID_ARGUMENT, FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE) uses
        no rate slot and charges nothing. A billing denial is passed through unchanged; billing
        not answering in time is DEADLINE_EXCEEDED BILLING_TIMEOUT, any other billing failure
        UNAVAILABLE BILLING_UNAVAILABLE (`_downstream_failure`); once admitted, the run charge is
        stored in the persist's transaction and sent in a batch (`RunCharges`), so the turn
        start does not wait for it; a failed persist releases the reservation and removes
        what was written.
        """
        caller = request.caller
        if not request.message.strip():
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "EMPTY_MESSAGE",
                "message must be a non-empty string",
            )
        if request.kind and request.kind != ASSISTANT_KIND:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "UNSUPPORTED_KIND",
                "only assistant chats are served here",
            )
        if len(request.request_id) > REQUEST_ID_LENGTH:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_REQUEST_ID",
                f"request_id must be at most {REQUEST_ID_LENGTH} characters",
            )
        if not request.request_id:
            return await self._start_turn(request, context)
        # AIP-155: a retry of a start that did start answers that turn; a start sent while
        # another with the same request_id is in flight waits for it (`_claim_request`)
        claim = await self._claim_request(caller.organization_id, request.request_id)
        try:
            since = utcnow() - datetime.timedelta(seconds=self.settings.idempotency_ttl_s)
            started = await self.store.run_for_request(
                caller.organization_id, request.request_id, since
            )
            if started is not None:
                return self._started(*started)
            return await self._start_turn(request, context)
        finally:
            await self._unclaim(claim)

    async def _claim_request(self, organization_id: str, request_id: str) -> str:
        """Take the claim of a turn start's request_id (the chat claims' mechanism: atomic across
        replicas, freed on a crash after LOOPLINE_CHAT_CLAIM_TTL_S); returns its key for `_unclaim`.

        Held from the lookup of a started turn until the start's run is stored, so starts with
        the same request_id sent together start one turn: the others wait here (polling every
        REQUEST_CLAIM_POLL_S), then find it. Fresh-eyes test: ten sent together started and
        charged ten turns. ABORTED REQUEST_IN_FLIGHT (409 at the gateway) when the claim is
        still held after REQUEST_CLAIM_WAIT_S.
        """
        digest = hashlib.sha256(f"{organization_id}\n{request_id}".encode()).hexdigest()
        key = f"request:{digest[:32]}"
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + REQUEST_CLAIM_WAIT_S
        while not await self._try_claim(key):
            if loop.time() >= give_up_at:
                raise RpcError(
                    grpc.StatusCode.ABORTED,
                    "REQUEST_IN_FLIGHT",
                    "A turn start with this request_id is still in flight; retry it",
                )
            await asyncio.sleep(REQUEST_CLAIM_POLL_S)
        return key

    async def _start_turn(
        self, request: assistant_pb2.StartTurnRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.StartTurnResponse:
        """`StartTurn` past its request_id: model -> admission -> persist -> start (see there)."""
        caller = request.caller
        llm = self._llm(request.llm, request.HasField("llm"))
        model = await self._model(llm, caller.organization_id)
        chat_id = request.chat_id or str(uuid.uuid4())
        run_id = str(uuid.uuid4())
        if request.chat_id and not await self._try_claim(
            chat_id
        ):  # a new chat's id is minted here: no race
            # someone holds the claim: 409, unless the chat is not the caller's (the same 404 as always)
            if not self._visible(await self._guard(request.chat_id), caller):
                raise _not_found()
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "RUN_IN_FLIGHT",
                "A run is already in flight on this chat; wait for it or cancel it",
            )
        try:
            guard = await self._guard(request.chat_id) if request.chat_id else None
            if request.chat_id and not self._visible(guard, caller):
                raise _not_found()
            if guard is not None and guard.pending_id is None and guard.running_id:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "RUN_IN_FLIGHT",
                    "A run is already in flight on this chat; wait for it or cancel it",
                )
            if (
                guard is not None and guard.pending_id is not None
            ):  # a question: pending (409) or expired (settled here)
                async with self.sessions() as session:
                    chat = await self._chat(session, caller, request.chat_id)
                    running_id = chat.running_id
                    try:
                        pending = await self._pending(session, chat)
                    except _Expired as expired:
                        pending = None
                        running_id = None if running_id == expired.interrupt.run_id else running_id
                    if pending is not None:
                        raise RpcError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            "QUESTION_PENDING",
                            "This chat has a pending question; answer it first",
                        )
                    if running_id:
                        raise RpcError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            "RUN_IN_FLIGHT",
                            "A run is already in flight on this chat; wait for it or cancel it",
                        )
            admission = billing_pb2.AdmitRequest(
                organization_id=caller.organization_id,
                turn_key=f"{chat_id}:{run_id}",
                usage_type="run",
                rate_class="sync_exec",
            )
            admit = asyncio.ensure_future(self.billing.Admit(admission, timeout=10))
            try:
                admitted = await asyncio.shield(admit)
            except asyncio.CancelledError:
                self._release_when_admitted(admission, admit)
                raise
            except grpc.aio.AioRpcError as error:
                if error.code() in _OUTCOME_UNKNOWN:
                    self._release_when_admitted(admission, None)
                status = _downstream_status(error)
                if status is not None:
                    raise _PassThrough(status) from None
                raise _downstream_failure(
                    error, "BILLING", "Billing is unavailable; try again"
                ) from None
            context.set_trailing_metadata(_rate_metadata(admitted.rate_limit))
            # The run charge is stored with the turn's rows and sent within STORED_LINGER_S,
            # batched with other turns' (RunCharges): a persisted turn is never left uncharged.
            charge = self.runner.charges.row(admitted.reservation_id)
            try:
                history = await self._persist_turn(
                    request, caller, chat_id, run_id, llm, admitted.reservation_id, charge
                )
            except BaseException:
                # nothing was written (or a commit whose answer was lost: removed again), so the hold goes back
                await self._unwind(
                    chat_id, run_id, new_chat=not request.chat_id, charge_id=charge["id"]
                )
                await self._release(admitted.reservation_id, "turn not started")
                raise
            self.runner.charges.committed(charge["id"], admitted.reservation_id)
            # started before anything else is awaited: a persisted (and charged) turn runs even
            # when the call is cancelled from here on (its caller's deadline, during the unclaim)
            self._start(caller, chat_id, run_id, llm, model, history)
        except _PassThrough as passthrough:
            await context.abort_with_status(passthrough.status)
        finally:
            await self._unclaim(chat_id)
        return self._started(chat_id, run_id)

    def _started(self, chat_id: str, run_id: str) -> assistant_pb2.StartTurnResponse:
        """The StartTurn answer of a turn started (now, or before under the same request_id)."""
        return assistant_pb2.StartTurnResponse(
            status="running",
            chat_id=chat_id,
            run_id=run_id,
            thread_id=chat_id,
            stream_url=self._stream_url(chat_id, run_id),
        )

    def _start(
        self,
        caller: Any,
        chat_id: str,
        run_id: str,
        llm: dict[str, Any],
        model: Any,
        history: list[ThreadRow] | None,
    ) -> None:
        """Start the loop of a persisted and charged turn."""
        self.runner.start(
            RunSpec(
                run_id=run_id,
                chat_id=chat_id,
                organization_id=caller.organization_id,
                llm=llm,
                model=model,
                history=history,
            )
        )

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

    async def _persist_turn(
        self,
        request: Any,
        caller: Any,
        chat_id: str,
        run_id: str,
        llm: dict[str, Any],
        reservation_id: str,
        charge: dict[str, Any],
    ) -> list[ThreadRow] | None:
        """One transaction: chat (new, or claimed with a conditional update), user message, run row
        and the run charge (`charge`, a `billing_redeliveries` row: `RunCharges.row`).

        Returns the thread of a new chat (its user message), so the loop need not read it back;
        None for an existing chat. FAILED_PRECONDITION RUN_IN_FLIGHT when the claim is lost.
        """
        message = ThreadRow(role="user", content=request.message, chat_id=chat_id, run_id=run_id)
        now = message.created_at
        chat = None
        if not request.chat_id:
            chat = {
                "id": chat_id,
                "organization_id": caller.organization_id,
                "user_id": caller.user_id,
                "kind": ASSISTANT_KIND,
                "title": request.message[:TITLE_LENGTH],
                "workflow_id": None,
                "running_id": run_id,
                "deleted_at": None,
                "created_at": now,
                "updated_at": now,
            }
        run = {
            "id": run_id,
            "durable_id": f"run_{uuid.uuid4().hex}",
            "chat_id": chat_id,
            "organization_id": caller.organization_id,
            "parent_run_id": None,
            "status": "running",
            "llm": llm,
            "reservation_id": reservation_id,
            "usage": None,
            "error": None,
            "created_at": now,
            "updated_at": now,
            "lease_until": RunSupervisor.lease_deadline(self.settings, now),
            "request_id": request.request_id or None,
        }
        try:
            await self.store.persist_turn(
                claim=bool(request.chat_id), chat=chat, message=message, run=run, charge=charge
            )
        except ClaimLost:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "RUN_IN_FLIGHT",
                "A run is already in flight on this chat; wait for it or cancel it",
            ) from None
        return None if request.chat_id else [message]

    async def _unwind(self, chat_id: str, run_id: str, new_chat: bool, charge_id: str) -> None:
        """Undo a turn start whose persist failed (`TurnStore.unwind_turn`: its rows, a new chat
        entirely, and its stored charge, row `charge_id`; the chat freed). Usually nothing was
        written; a commit whose answer was lost (a cancelled call, a dropped connection) is
        removed here. Never raises (logged: a storage outage as a warning without a traceback,
        the run supervisor ends such a run once its first lease lapses; anything else with it)."""
        try:
            await self.store.unwind_turn(
                chat_id=chat_id, run_id=run_id, new_chat=new_chat, charge_id=charge_id
            )
        except Exception as error:
            store = db.unavailable_store(error)
            if store is None:
                log.exception("unwinding a failed turn start failed")
            else:  # the turn start failed for the same outage, most likely: said once per start, no traceback
                log.warning(
                    f"unwinding a failed turn start: {store} unavailable; a run it wrote ends when its lease lapses",
                    extra={"fields": {"run_id": run_id, "error": type(error).__name__}},
                )

    def _release_when_admitted(
        self, admission: billing_pb2.AdmitRequest, admit: asyncio.Future | None
    ) -> None:
        """A turn start gave up on its Admit while billing may have set a hold aside for it: it
        was cancelled (its caller's deadline passed) with `admit` (the Admit call, shielded)
        still on its way, or the call ended without an answer (`admit` None: its deadline,
        a lost connection). In the background, once `admit` answers — or, without an answer,
        after asking billing again for the same turn key (Admit is idempotent by it: the hold
        set aside, or a new one) — release the hold. Before, such a hold stayed held until it
        expired (120 s), counting against the allowance and the daily quota (fresh-eyes tests)."""

        async def release() -> None:
            try:
                admitted = await admit if admit is not None else None
            except grpc.aio.AioRpcError as error:
                if error.code() not in _OUTCOME_UNKNOWN:
                    return  # refused: nothing was set aside
                admitted = None
            except Exception:  # noqa: BLE001 - nothing was set aside
                return
            for attempt in range(3):
                if admitted is not None:
                    break
                try:
                    admitted = await self.billing.Admit(admission, timeout=10)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in _OUTCOME_UNKNOWN:
                        return
                    await asyncio.sleep(1.0 * (attempt + 1))
            if admitted is None:
                log.warning(
                    "a hold of a turn start that gave up on billing could not be found; it expires",
                    extra={"fields": {"turn_key": admission.turn_key}},
                )
                return
            await self._release(admitted.reservation_id, "turn not started")

        task = asyncio.get_running_loop().create_task(release(), name="release-abandoned-admission")
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)

    async def _release(self, reservation_id: str, reason: str) -> int | None:
        """Release the reservation (usage.release_or_store: its state after the call, or None when
        billing could not be asked and the Release is sent again in the background)."""
        return await release_or_store(
            self.billing,
            self.runner.redelivery,
            reservation_id,
            reason,
            "releasing a reservation failed",
        )

    # ------------------------------------------------------------------ StreamRun

    async def StreamRun(
        self, request: assistant_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[assistant_pb2.StreamRunResponse]:
        """Replay the run's events from `after`, then follow live; ends after a terminal event.

        A run active in this process is checked against its RunSpec (its chat cannot be deleted
        while it runs); any other run against the database (store.stream_target).
        """
        active = self.runner.active.get(request.run_id)
        if (
            active is None
            or active.spec.chat_id != request.chat_id
            or active.spec.organization_id != request.caller.organization_id
        ):
            target = None
            if ids.is_row_id(request.chat_id):
                target = await self.store.stream_target(
                    request.chat_id, request.run_id if ids.is_row_id(request.run_id) else ""
                )
            if not self._visible(target, request.caller):
                await abort(context, _not_found())
                return
            if target.run_chat_id is None:
                await abort(context, _not_found("Run"))
                return
        if request.after < 0:
            await abort(
                context,
                RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_AFTER", "after must be >= 0"),
            )
            return
        await context.send_initial_metadata(((STREAM_READY, "1"),))
        try:
            if (
                request.max_batch > 1
            ):  # every event available at once in one message (EventLog.follow_batches)
                limit = min(int(request.max_batch), MAX_STREAM_BATCH)
                async with contextlib.aclosing(
                    self.runner.events.follow_batches(request.run_id, int(request.after))
                ) as batches:
                    async for batch in batches:
                        for start in range(0, len(batch), limit):
                            yield assistant_pb2.StreamRunResponse(
                                events=batch[start : start + limit]
                            )
            else:
                async with contextlib.aclosing(
                    self.runner.events.follow(request.run_id, int(request.after))
                ) as events:
                    async for event in events:
                        yield assistant_pb2.StreamRunResponse(event=event)
        except (
            StreamInterrupted
        ) as interrupted:  # the gateway gives each listener its own reconnect frame
            await abort(
                context,
                RpcError(grpc.StatusCode.UNAVAILABLE, "STREAM_INTERRUPTED", interrupted.message),
            )

    # ------------------------------------------------------------------ Resume

    @unary
    async def Resume(
        self, request: assistant_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.ResumeResponse:
        """Answer the pending question and start a new run on the same thread (no second run credit).

        Errors as StartTurn's for the model (`_model`, resolved before anything is written);
        a `credential_added` answer is checked with the tools service (`_check_credential`).
        """
        caller = request.caller
        try:
            answer = pb.object_of(
                request, "response"
            )  # the JSON text, or the Struct of a gateway of an older version
        except pb.NotAnObject as bad:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ANSWER", str(bad)) from None
        if pb.holds_nul(
            answer
        ):  # as the gateway refuses it in a body (fresh-eyes test: a gRPC answer carried it to the model)
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ANSWER",
                "the answer holds a NUL character (U+0000); text cannot carry it",
            )
        llm = self._llm(request.llm, request.HasField("llm"))
        model = await self._model(llm, caller.organization_id)
        async with self.sessions() as session:
            chat_id = (await self._chat(session, caller, request.chat_id)).id
        await self._claim(chat_id)
        try:
            async with self.sessions() as session:
                chat = await self._chat(session, caller, request.chat_id)
                try:
                    interrupt = await self._pending(session, chat)
                except _Expired:
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "QUESTION_EXPIRED",
                        "The question expired; start a new turn",
                    ) from None
                if interrupt is None:
                    expired = (
                        (
                            await session.execute(
                                select(Interrupt).where(
                                    Interrupt.id == request.request_id, Interrupt.chat_id == chat.id
                                )
                            )
                        )
                        .scalars()
                        .first()
                        if ids.is_row_id(request.request_id)
                        else None
                    )
                    if expired is not None and expired.outcome == "expired":
                        raise RpcError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            "QUESTION_EXPIRED",
                            "The question expired; start a new turn",
                        )
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "NO_PENDING_QUESTION",
                        "This chat has no pending question",
                    )
                if interrupt.id != request.request_id:
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "STALE_REQUEST",
                        "request_id does not match the pending question",
                    )
                try:
                    normalized = hitl.validate_answer(interrupt.request, answer)
                except hitl.InvalidAnswer as invalid:
                    raise RpcError(
                        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ANSWER", str(invalid)
                    ) from None
                if normalized.get("kind") == "credential_added":
                    await self._check_credential(
                        caller.organization_id, interrupt.request, normalized
                    )
            if not request.HasField("llm") or not request.llm.provider_id:
                async with self.sessions() as session:
                    paused = await session.get(Run, interrupt.run_id)
                if paused is not None and paused.llm:
                    llm = dict(paused.llm)
                    model = await self._model(llm, caller.organization_id)
            run_id = await self._continue(
                chat.id, caller.organization_id, interrupt, normalized, llm
            )
        finally:
            await self._unclaim(chat_id)
        self.runner.start(
            RunSpec(
                run_id=run_id,
                chat_id=chat.id,
                organization_id=caller.organization_id,
                llm=llm,
                model=model,
            )
        )
        return assistant_pb2.ResumeResponse(
            status="running",
            chat_id=chat.id,
            run_id=run_id,
            thread_id=chat.id,
            stream_url=self._stream_url(chat.id, run_id),
        )

    async def _continue(
        self,
        chat_id: str,
        organization_id: str,
        interrupt: Interrupt,
        answer: dict[str, Any],
        llm: dict[str, Any],
    ) -> str:
        """Mark the question answered (exactly once), store the answer as the HITL tool's result and
        create the continuation run; returns its run_id. FAILED_PRECONDITION when the question is no
        longer pending (answered, cancelled or expired meanwhile)."""
        run_id = str(uuid.uuid4())
        now = utcnow()
        async with self.sessions() as session, session.begin():
            # the chat's row first, then the question's (`_lock_chat`)
            await session.execute(
                update(Chat).where(Chat.id == chat_id).values(running_id=run_id, updated_at=now)
            )
            won = await session.execute(
                update(Interrupt)
                .where(
                    Interrupt.id == interrupt.id,
                    Interrupt.outcome == "pending",
                    Interrupt.expires_at > now,
                )
                .values(outcome="answered", response=answer, resolved_at=now, resumed_run_id=run_id)
            )
            if won.rowcount != 1:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "NO_PENDING_QUESTION",
                    "The question was already answered, cancelled or expired",
                )
            await session.execute(
                update(Run)
                .where(Run.id == interrupt.run_id)
                .values(status="resumed", updated_at=now)
            )
            session.add(
                Message(
                    id=str(uuid.uuid4()),
                    chat_id=chat_id,
                    run_id=run_id,
                    role="tool",
                    content=hitl.answer_as_tool_output(answer),
                    extra={"tool_call_id": interrupt.tool_call_id, "name": interrupt.tool},
                )
            )
            session.add(
                Run(
                    id=run_id,
                    durable_id=f"run_{uuid.uuid4().hex}",
                    chat_id=chat_id,
                    organization_id=organization_id,
                    parent_run_id=interrupt.run_id,
                    status="running",
                    llm=llm,
                    created_at=now,
                    updated_at=now,
                    lease_until=RunSupervisor.lease_deadline(self.settings, now),
                )
            )
        return run_id

    @unary
    async def NotifyCredentialConnected(
        self,
        request: assistant_pb2.NotifyCredentialConnectedRequest,
        context: grpc.aio.ServicerContext,
    ) -> assistant_pb2.NotifyCredentialConnectedResponse:
        """Resume every run of the organization paused on a credential_request for `integration`
        (spec: OAuth auto-resume): a new run continues each, and `run_resumed {new_run_id}` is
        published on the paused run's stream. Idempotent: answered questions are not resumed again."""
        async with self.sessions() as session:
            rows = (
                await session.execute(
                    select(Interrupt, Chat)
                    .join(Chat, Chat.id == Interrupt.chat_id)
                    .where(
                        Chat.organization_id == request.organization_id,
                        Chat.kind == ASSISTANT_KIND,
                        Chat.deleted_at.is_(None),
                        Interrupt.outcome == "pending",
                        Interrupt.kind == "credential_request",
                    )
                )
            ).all()
        resumed: list[str] = []
        for interrupt, chat in rows:
            if interrupt.request.get("integration_name") != request.integration:
                continue
            if db.utc(interrupt.expires_at) <= utcnow():
                continue
            answer = {
                "kind": "credential_added",
                "credential_id": request.credential_id,
                "integration_name": request.integration,
                "auth_type": "oauth2",
            }
            async with self.sessions() as session:
                paused = await session.get(Run, interrupt.run_id)
            llm = dict(paused.llm) if paused is not None and paused.llm else self._llm(None, False)
            try:
                model = await self._model(llm, request.organization_id)
            except RpcError:
                log.warning("auto-resume skipped: the paused run's model is no longer available")
                continue
            if not await self._try_claim(chat.id):
                continue
            try:
                run_id = await self._continue(
                    chat.id, request.organization_id, interrupt, answer, llm
                )
            except RpcError:
                continue
            finally:
                await self._unclaim(chat.id)
            await self._publish_after_pause(
                interrupt.run_id,
                events_pb2.Event(
                    run_id=interrupt.run_id,
                    time=pb.timestamp(),
                    run_resumed=events_pb2.RunResumedEvent(new_run_id=run_id),
                ),
            )
            self.runner.start(
                RunSpec(
                    run_id=run_id,
                    chat_id=chat.id,
                    organization_id=request.organization_id,
                    llm=llm,
                    model=model,
                )
            )
            resumed.append(run_id)
        return assistant_pb2.NotifyCredentialConnectedResponse(resumed_run_ids=resumed)

    @unary
    async def CheckModel(
        self, request: assistant_pb2.CheckModelRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.CheckModelResponse:
        """Validate `llm` for the caller's organization as StartTurn would: INVALID_ARGUMENT when
        unusable, FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE when its key cannot be decrypted (`_model`)."""
        if not request.HasField("llm") or not request.llm.provider_id:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_MODEL", "llm.provider_id is required"
            )
        llm = self._llm(request.llm, True)
        await self._model(llm, request.caller.organization_id)
        return assistant_pb2.CheckModelResponse(provider_id=llm["provider_id"])

    async def _publish_after_pause(self, run_id: str, event: events_pb2.Event) -> None:
        """Append `event` to a paused (closed) run's log, restoring it from the archive if needed,
        then archive the log (a failed archive is tried again in the background: the change this
        event reports is stored, so the call that made it succeeds)."""
        await self.runner.events.append_after_end(run_id, event)
        await self.runner.archive_after_end(run_id)

    async def _check_credential(
        self, organization_id: str, question: dict[str, Any], answer: dict[str, Any]
    ) -> None:
        """A `credential_added` answer must name an existing credential of the organization for the
        question's integration (INVALID_ARGUMENT INVALID_ANSWER, 400, otherwise; the question stays
        pending). The tools service not answering in time is DEADLINE_EXCEEDED TOOLS_TIMEOUT, any
        other failure UNAVAILABLE TOOLS_UNAVAILABLE (`_downstream_failure`)."""
        try:
            found = await self.runner.tools.GetCredential(
                tools_pb2.GetCredentialRequest(
                    organization_id=organization_id, credential_id=str(answer.get("credential_id"))
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "INVALID_ANSWER",
                    "credential_added names a credential that does not exist",
                ) from None
            raise _downstream_failure(
                error, "TOOLS", "The tools service is unavailable; try again"
            ) from None
        wanted = question.get("integration_name")
        if wanted and found.credential.integration_name != wanted:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ANSWER",
                f"the credential is for {found.credential.integration_name!r}, not {wanted!r}",
            )

    # ------------------------------------------------------------------ Cancel

    @unary
    async def Cancel(
        self, request: assistant_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.CancelResponse:
        """Stop the chat's active run (running or paused); 400-mapped NO_ACTIVE_EXECUTION when there is none."""
        if (
            len(request.reason) > hitl.MAX_REASON_CHARS
        ):  # it goes into the event every listener gets (fresh-eyes test: 5,000 went)
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_REASON",
                f"reason must be at most {hitl.MAX_REASON_CHARS} characters",
            )
        reason = request.reason or "cancelled by user"
        for _ in range(CANCEL_ATTEMPTS):
            answer = await self._cancel_active(request, reason)
            if answer is not None:
                return answer
        raise RpcError(
            grpc.StatusCode.ABORTED,
            "CONCURRENT_UPDATE",
            "The chat's run changed while it was being cancelled; try again",
        )

    async def _cancel_active(
        self, request: assistant_pb2.CancelRequest, reason: str
    ) -> assistant_pb2.CancelResponse | None:
        """Cancel the chat's active run as it is now; None when another run became the active
        one meanwhile (a resume or a turn start committed between the read and the cancel: the
        caller looks again). Fresh-eyes test (replicas): a cancel sent beside a resume found the
        paused run gone and answered "No active execution to cancel" while the resumed run ran on."""
        async with self.sessions() as session:
            # an expired question is settled first, as every other look at the chat settles it: its
            # run is over and nothing is active (fresh-eyes test: a cancel that came first "cancelled"
            # the expired run, 200 and a frame on its ended stream; after a status look it was 400)
            chat, _ = await self._chat_and_pending(session, request.caller, request.chat_id)
            run_id = chat.running_id
        no_active = RpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "NO_ACTIVE_EXECUTION",
            "No active execution to cancel",
        )
        if not run_id:
            raise no_active
        outcome = await self.runner.cancel(run_id, reason)
        if (
            outcome is not None and outcome != "interrupted"
        ):  # a run that just paused is cancelled below
            if outcome != "cancelled":
                raise no_active
            return assistant_pb2.CancelResponse(status="cancelled", chat_id=chat.id, run_id=run_id)
        if self.backend.distributed and self.supervisor is not None:
            async with self.sessions() as session:
                status = (
                    await session.execute(select(Run.status).where(Run.id == run_id))
                ).scalar()
            if (
                status == "running"
            ):  # running on another replica: ask it to stop, wait for the outcome
                final = await self.supervisor.cancel_elsewhere(run_id, reason)
                if final == "cancelled":
                    return assistant_pb2.CancelResponse(
                        status="cancelled", chat_id=chat.id, run_id=run_id
                    )
                if final is None:
                    raise RpcError(
                        grpc.StatusCode.UNAVAILABLE,
                        "CANCEL_PENDING",
                        "The run did not stop in time; try again",
                    )
                return None  # it ended by itself meanwhile: look again (nothing active: NO_ACTIVE_EXECUTION)
        # Not running in this process: a paused run (or an orphan). Settle it here.
        async with self.sessions() as session, session.begin():
            changed = await session.execute(
                update(Chat)
                .where(Chat.id == chat.id, Chat.running_id == run_id)
                .values(running_id=None, updated_at=utcnow())
            )
            if changed.rowcount != 1:  # it is no longer the chat's active run: another one, or none
                return None
            cancelled = (
                await session.execute(
                    update(Interrupt)
                    .where(Interrupt.run_id == run_id, Interrupt.outcome == "pending")
                    .values(outcome="cancelled", resolved_at=utcnow())
                    .returning(Interrupt.tool_call_id, Interrupt.tool)
                )
            ).all()
            for question in cancelled:  # its tool call's result, as a cancel gives a call it cuts off (GET chat shows what the model sees)
                session.add(
                    Message(
                        id=str(uuid.uuid4()),
                        chat_id=chat.id,
                        run_id=run_id,
                        role="tool",
                        content=cut_off_result("cancelled"),
                        extra={"tool_call_id": question.tool_call_id, "name": question.tool},
                    )
                )
            await session.execute(
                update(Run).where(Run.id == run_id).values(status="cancelled", updated_at=utcnow())
            )
        await self._publish_after_pause(
            run_id,
            events_pb2.Event(
                run_id=run_id,
                time=pb.timestamp(),
                cancelled=events_pb2.CancelledEvent(reason=reason),
            ),
        )
        return assistant_pb2.CancelResponse(status="cancelled", chat_id=chat.id, run_id=run_id)

    # ------------------------------------------------------------------ reads

    @unary
    async def GetChat(
        self, request: assistant_pb2.GetChatRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.GetChatResponse:
        """The chat with its messages (oldest first) and its pending question.

        Stored JSON travels as JSON text (`content_json`, `thinking_json`,
        `pending_user_input_request_json`: numbers exact, keys in their stored order), written
        with `clip=True` (services/common/pb.py): a row stored before the depth rule (a tool input
        or output nested past what the services take) shows its deeper parts as JSON text instead
        of making every read of the chat fail. A message's `thinking` is limited to
        pb.MAX_WIRE_DEPTH, which its 3 levels around a tool call's input need
        ({"tool_calls": [{"input": ...}]}); anything stored since the rule fits unclipped.

        Pages (AIP-158): the newest `page_size` messages (0: all) before `page_token`, and never
        more than CHAT_PAGE_BYTES of them (one message larger than that comes alone), so a long
        chat stays readable: a fresh-eyes test's 9 turns of ~1 MB made every read fail
        (RESOURCE_EXHAUSTED; the gateway's 500). `next_page_token` leads to older messages.
        INVALID_ARGUMENT INVALID_PAGE_SIZE / INVALID_PAGE_TOKEN for a page_size outside
        0..MAX_CHAT_PAGE_SIZE or a token this chat did not give.
        """
        if not 0 <= request.page_size <= MAX_CHAT_PAGE_SIZE:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_PAGE_SIZE",
                f"page_size must be between 0 and {MAX_CHAT_PAGE_SIZE}",
            )
        async with self.sessions() as session:
            chat, pending = await self._chat_and_pending(session, request.caller, request.chat_id)
            query = select(Message).where(
                Message.chat_id == chat.id, Message.role.not_in(("marker", "system"))
            )
            if request.page_token:
                query = query.where(Message.seq < _page_token_seq(request.page_token, chat.id))
            if request.page_size:
                query = query.limit(request.page_size + 1)
            rows = (await session.execute(query.order_by(Message.seq.desc()))).scalars().all()
            statuses = dict(
                (
                    await session.execute(select(Run.id, Run.status).where(Run.chat_id == chat.id))
                ).all()
            )
        messages: list[assistant_pb2.ChatMessage] = []
        size = 0
        next_page_token = ""
        last_seq = 0
        for row in rows:  # newest first
            thinking = (
                pb.json_bytes(row.extra, clip=True, max_depth=pb.MAX_WIRE_DEPTH)
                if row.extra
                else b""
            )
            message = assistant_pb2.ChatMessage(
                id=row.id,
                role=row.role,
                content_json=pb.json_bytes(row.content, clip=True),
                run_id=row.run_id or "",
                running_status=statuses.get(row.run_id, ""),
                create_time=pb.timestamp(db.utc(row.created_at)),
                thinking_json=thinking,
            )
            size += message.ByteSize()
            if messages and (size > CHAT_PAGE_BYTES or len(messages) == request.page_size):
                next_page_token = _page_token(chat.id, last_seq)
                break
            messages.append(message)
            last_seq = row.seq
        messages.reverse()
        return assistant_pb2.GetChatResponse(
            chat=self._chat_message(chat, pending),
            messages=messages,
            next_page_token=next_page_token,
        )

    def _chat_message(self, chat: Chat, pending: Interrupt | None = None) -> assistant_pb2.Chat:
        message = assistant_pb2.Chat(
            id=chat.id,
            title=chat.title,
            running_id=chat.running_id or "",
            kind=chat.kind,
            create_time=pb.timestamp(db.utc(chat.created_at)),
            update_time=pb.timestamp(db.utc(chat.updated_at)),
        )
        if pending is not None:
            message.pending_user_input_request_json = pb.json_bytes(
                pending.request, clip=True
            )  # see GetChat
        return message

    @unary
    async def ListChats(
        self, request: assistant_pb2.ListChatsRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.ListChatsResponse:
        """The caller's assistant chats, newest first; `cursor` continues a previous page."""
        limit = request.limit or 20
        if not 1 <= limit <= 100:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_LIMIT", "limit must be between 1 and 100"
            )
        query = select(Chat).where(
            Chat.organization_id == request.caller.organization_id,
            Chat.user_id == request.caller.user_id,
            Chat.kind == ASSISTANT_KIND,
            Chat.deleted_at.is_(None),
        )
        if request.cursor:
            # only the cursor this method mints (`_CURSOR`: a UTC time as isoformat() writes it, a chat's UUID) is taken:
            # a forged one held a NUL PostgreSQL cannot take, or a time that overflows when made UTC (fresh-eyes tests: 500)
            try:
                found = _CURSOR.fullmatch(
                    base64.urlsafe_b64decode(request.cursor.encode()).decode()
                )
                if found is None:
                    raise ValueError("not a cursor of ListChats")
                created, last_id = datetime.datetime.fromisoformat(found["time"]), found["id"]
            except (ValueError, UnicodeDecodeError):
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CURSOR", "cursor is not valid"
                ) from None
            query = query.where(
                (Chat.created_at < created) | ((Chat.created_at == created) & (Chat.id < last_id))
            )
        query = query.order_by(Chat.created_at.desc(), Chat.id.desc()).limit(limit + 1)
        async with self.sessions() as session:
            chats = list((await session.execute(query)).scalars())
        next_cursor = ""
        if len(chats) > limit:
            chats = chats[:limit]
            last = chats[-1]
            next_cursor = base64.urlsafe_b64encode(
                f"{db.utc(last.created_at).isoformat()}|{last.id}".encode()
            ).decode()
        pending: dict[str, Interrupt] = {}
        if chats:
            async with self.sessions() as session:
                rows = list(
                    (
                        await session.execute(
                            select(Interrupt).where(
                                Interrupt.chat_id.in_([c.id for c in chats]),
                                Interrupt.outcome == "pending",
                            )
                        )
                    ).scalars()
                )
            now = utcnow()
            pending = {row.chat_id: row for row in rows if db.utc(row.expires_at) > now}
            for row in rows:  # a question past its time is settled by this look too: its chat is free (not running)
                if row.chat_id not in pending:
                    await self._settle_expired(row)
                    for chat in chats:
                        if chat.id == row.chat_id and chat.running_id == row.run_id:
                            chat.running_id = None
        return assistant_pb2.ListChatsResponse(
            chats=[self._chat_message(c, pending.get(c.id)) for c in chats], next_cursor=next_cursor
        )

    @unary
    async def GetChatStatus(
        self, request: assistant_pb2.GetChatStatusRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.GetChatStatusResponse:
        """running / awaiting_input / idle, the pending question's id and the latest run's status."""
        async with self.sessions() as session:
            chat, pending = await self._chat_and_pending(session, request.caller, request.chat_id)
            latest = (
                (
                    await session.execute(
                        select(Run)
                        .where(Run.chat_id == chat.id)
                        .order_by(Run.created_at.desc())
                        .limit(1)
                    )
                )
                .scalars()
                .first()
            )
        response = assistant_pb2.GetChatStatusResponse(
            chat_id=chat.id,
            is_running=bool(chat.running_id) and pending is None,
            awaiting_input=pending is not None,
            pending_request_id=pending.id if pending else "",
            running_id=chat.running_id or "",
        )
        if latest is not None:
            response.run_status.CopyFrom(
                pb.to_struct(
                    {"run_id": latest.id, "status": latest.status, "durable_id": latest.durable_id}
                )
            )
        return response

    @unary
    async def DeleteChat(
        self, request: assistant_pb2.DeleteChatRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.DeleteChatResponse:
        """Hide the chat (soft) or remove it and its rows (permanent: its runs' event logs too,
        `EventLog.purge`: Redis streams, this process's memory); 409 while a run is in flight.

        A permanent delete also purges a chat that was soft-deleted before (a soft-deleted chat
        is otherwise the same 404 as a missing one)."""
        async with self.sessions() as session:
            chat_id = (
                await self._chat(
                    session, request.caller, request.chat_id, deleted=request.permanent
                )
            ).id
        purged: list[str] = []  # the runs of a permanently deleted chat
        await self._claim(chat_id)
        try:
            async with self.sessions() as session, session.begin():
                chat = await session.get(
                    Chat, chat_id, with_for_update=True
                )  # the chat's row first (`_lock_chat`)
                if chat is None or (chat.deleted_at is not None and not request.permanent):
                    raise _not_found()
                active = (
                    chat.running_id is not None
                    and (
                        await session.execute(select(Run.status).where(Run.id == chat.running_id))
                    ).scalar()
                    == "running"
                )
                if active:
                    raise RpcError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "RUN_IN_FLIGHT",
                        "A run is in flight on this chat; cancel it before deleting",
                    )
                await session.execute(
                    update(Interrupt)
                    .where(Interrupt.chat_id == chat.id, Interrupt.outcome == "pending")
                    .values(outcome="cancelled", resolved_at=utcnow())
                )
                if request.permanent:
                    run_ids = select(Run.id).where(Run.chat_id == chat.id)
                    purged = list((await session.execute(run_ids)).scalars())
                    await session.execute(delete(RunEvent).where(RunEvent.run_id.in_(run_ids)))
                    await session.execute(delete(Interrupt).where(Interrupt.chat_id == chat.id))
                    await session.execute(delete(Message).where(Message.chat_id == chat.id))
                    await session.execute(delete(Run).where(Run.chat_id == chat.id))
                    await session.execute(delete(Chat).where(Chat.id == chat.id))
                else:
                    await session.execute(
                        update(Chat)
                        .where(Chat.id == chat.id)
                        .values(deleted_at=utcnow(), running_id=None)
                    )
        finally:
            await self._unclaim(chat_id)
        if (
            request.permanent and purged
        ):  # the runs' events outside the database too (Redis streams, memory)
            try:
                await self.runner.events.purge(purged)
            except Exception:  # noqa: BLE001 - the rows are gone; the streams expire after LOOPLINE_RUN_EVENTS_TTL_S
                log.warning(
                    "deleting the event streams of a deleted chat failed; they expire by themselves",
                    extra={"fields": {"chat_id": chat_id}},
                )
        return assistant_pb2.DeleteChatResponse(
            status="deleted", chat_id=chat_id, permanent=request.permanent
        )


class _Expired(Exception):
    def __init__(self, interrupt: Interrupt) -> None:
        super().__init__("expired")
        self.interrupt = interrupt


MAX_STREAM_BATCH = 256  # events per StreamRun response at most, whatever the client asks


def _rate_metadata(state: billing_pb2.RateLimitState) -> tuple[tuple[str, str], ...]:
    """X-RateLimit-* values of an admitted turn as trailing metadata for the gateway."""
    if not state.limit:
        return ()
    return (
        ("x-ratelimit-limit", str(state.limit)),
        ("x-ratelimit-remaining", str(state.remaining)),
        ("x-ratelimit-reset", str(state.reset_seconds)),
    )
