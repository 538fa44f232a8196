"""StartTurn and CheckModel: guards, model, admission, persist-and-charge, background start."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import uuid
from typing import Any

import grpc

from loopline.assistant.v1 import assistant_pb2
from loopline.billing.v1 import billing_pb2
from services.common import db
from services.common.errors import RpcError
from services.orchestrator.models import utcnow
from services.orchestrator.recovery import RunSupervisor
from services.orchestrator.run_state import RunSpec
from services.orchestrator.servicer.access import ASSISTANT_KIND, ChatAccess
from services.orchestrator.servicer.errors import (
    OUTCOME_UNKNOWN,
    Expired,
    PassThrough,
    downstream_failure,
    downstream_status,
    not_found,
    unary,
)
from services.orchestrator.store import ClaimLost, ThreadRow
from services.orchestrator.usage.redelivery import release_or_store

log = logging.getLogger(__name__)

TITLE_LENGTH = 50
REQUEST_ID_LENGTH = 64  # StartTurnRequest.request_id, at most (runs.request_id)
REQUEST_CLAIM_WAIT_S = (
    30.0  # a start waits this long at most for another with its request_id (`_claim_request`)
)
REQUEST_CLAIM_POLL_S = 0.02


def _run_in_flight() -> RpcError:
    return RpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "RUN_IN_FLIGHT",
        "A run is already in flight on this chat; wait for it or cancel it",
    )


def _rate_metadata(state: billing_pb2.RateLimitState) -> tuple[tuple[str, str], ...]:
    """X-RateLimit-* values of an admitted turn as trailing metadata for the gateway."""
    if not state.limit:
        return ()
    return (
        ("x-ratelimit-limit", str(state.limit)),
        ("x-ratelimit-remaining", str(state.remaining)),
        ("x-ratelimit-reset", str(state.reset_seconds)),
    )


class TurnStart(ChatAccess):
    """StartTurn and CheckModel of the servicer."""

    @unary
    async def StartTurn(
        self, request: assistant_pb2.StartTurnRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.StartTurnResponse:
        """Guards -> model -> admission -> persist -> charge -> start the loop (nothing is
        written on a refusal).

        The model (and its bring-your-own key) is resolved before billing is asked, so a model
        refused (`_model`: INVALID_ARGUMENT, FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE) uses
        no rate slot and charges nothing. A billing denial is passed through unchanged; billing
        not answering in time is DEADLINE_EXCEEDED BILLING_TIMEOUT, any other billing failure
        UNAVAILABLE BILLING_UNAVAILABLE (`downstream_failure`); once admitted, the run charge is
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
        REQUEST_CLAIM_POLL_S), then find it. ABORTED REQUEST_IN_FLIGHT (409 at the gateway)
        when the claim is still held after REQUEST_CLAIM_WAIT_S.
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
        # a new chat's id is minted here: no race for its claim
        if request.chat_id and not await self._try_claim(chat_id):
            # someone holds the claim: 409, unless the chat is not the caller's (the usual 404)
            if not self._visible(await self._guard(request.chat_id), caller):
                raise not_found()
            raise _run_in_flight()
        try:
            if request.chat_id:
                await self._check_chat_free(request.chat_id, caller)
            admission = billing_pb2.AdmitRequest(
                organization_id=caller.organization_id,
                turn_key=f"{chat_id}:{run_id}",
                usage_type="run",
                rate_class="sync_exec",
            )
            admitted = await self._admit(admission)
            context.set_trailing_metadata(_rate_metadata(admitted.rate_limit))
            # The run charge is stored with the turn's rows and sent within STORED_LINGER_S,
            # batched with other turns' (RunCharges): a persisted turn is never left uncharged.
            charge = self.runner.charges.row(admitted.reservation_id)
            try:
                history = await self._persist_turn(
                    request, caller, chat_id, run_id, llm, admitted.reservation_id, charge
                )
            except BaseException:
                # nothing was written (or a commit whose answer was lost: removed again),
                # so the hold goes back
                await self._unwind(
                    chat_id, run_id, new_chat=not request.chat_id, charge_id=charge["id"]
                )
                await self._release(admitted.reservation_id, "turn not started")
                raise
            self.runner.charges.committed(charge["id"], admitted.reservation_id)
            # started before anything else is awaited: a persisted (and charged) turn runs even
            # when the call is cancelled from here on (its caller's deadline, during the unclaim)
            self._start(caller, chat_id, run_id, llm, model, history)
        except PassThrough as passthrough:
            await context.abort_with_status(passthrough.status)
        finally:
            await self._unclaim(chat_id)
        return self._started(chat_id, run_id)

    async def _check_chat_free(self, chat_id: str, caller: assistant_pb2.Caller) -> None:
        """The claimed chat `chat_id` takes a turn: NOT_FOUND unless it is the caller's,
        FAILED_PRECONDITION RUN_IN_FLIGHT while a run is active, QUESTION_PENDING while a
        question waits (an expired question is settled here and frees the chat)."""
        guard = await self._guard(chat_id)
        if not self._visible(guard, caller):
            raise not_found()
        if guard.pending_id is None:
            if guard.running_id:
                raise _run_in_flight()
            return
        async with self.sessions() as session:  # a question: pending (409) or expired (settled)
            chat = await self._chat(session, caller, chat_id)
            running_id = chat.running_id
            try:
                pending = await self._pending(session, chat)
            except Expired as expired:
                pending = None
                running_id = None if running_id == expired.interrupt.run_id else running_id
            if pending is not None:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "QUESTION_PENDING",
                    "This chat has a pending question; answer it first",
                )
            if running_id:
                raise _run_in_flight()

    async def _admit(self, admission: billing_pb2.AdmitRequest) -> billing_pb2.AdmitResponse:
        """Billing's Admit of the turn: its reservation and rate-limit state.

        A denial is raised as PassThrough (its status returned unchanged); no answer is
        `downstream_failure`. A hold billing may have set aside for a call given up on (the
        caller's cancel, an unknown outcome) is released in the background.
        """
        admit = asyncio.ensure_future(self.billing.Admit(admission, timeout=10))
        try:
            return await asyncio.shield(admit)
        except asyncio.CancelledError:
            self._release_when_admitted(admission, admit)
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() in OUTCOME_UNKNOWN:
                self._release_when_admitted(admission, None)
            status = downstream_status(error)
            if status is not None:
                raise PassThrough(status) from None
            raise downstream_failure(
                error, "BILLING", "Billing is unavailable; try again"
            ) from None

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
            raise _run_in_flight() from None
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
            else:  # most likely the outage that failed the start: said once, no traceback
                log.warning(
                    f"unwinding a failed turn start: {store} unavailable; "
                    "a run it wrote ends when its lease lapses",
                    extra={"fields": {"run_id": run_id, "error": type(error).__name__}},
                )

    def _release_when_admitted(
        self,
        admission: billing_pb2.AdmitRequest,
        admit: asyncio.Future[billing_pb2.AdmitResponse] | None,
    ) -> None:
        """A turn start gave up on its Admit while billing may have set a hold aside for it: it
        was cancelled (its caller's deadline passed) with `admit` (the Admit call, shielded)
        still on its way, or the call ended without an answer (`admit` None: its deadline,
        a lost connection). In the background, once `admit` answers — or, without an answer,
        after asking billing again for the same turn key (Admit is idempotent by it: the hold
        set aside, or a new one) — release the hold, which would otherwise count against the
        allowance and the daily quota until it expired."""

        async def release() -> None:
            try:
                admitted = await admit if admit is not None else None
            except grpc.aio.AioRpcError as error:
                if error.code() not in OUTCOME_UNKNOWN:
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
                    if error.code() not in OUTCOME_UNKNOWN:
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

    @unary
    async def CheckModel(
        self, request: assistant_pb2.CheckModelRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.CheckModelResponse:
        """Validate `llm` for the caller's organization as StartTurn would: INVALID_ARGUMENT when
        unusable, FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE when its key cannot be decrypted
        (`_model`)."""
        if not request.HasField("llm") or not request.llm.provider_id:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_MODEL", "llm.provider_id is required"
            )
        llm = self._llm(request.llm, True)
        await self._model(llm, request.caller.organization_id)
        return assistant_pb2.CheckModelResponse(provider_id=llm["provider_id"])
