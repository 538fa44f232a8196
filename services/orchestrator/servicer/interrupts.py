"""The interrupt side: Resume answers a pending question, NotifyCredentialConnected resumes
the runs paused on a credential; each starts a continuation run on the same thread."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import grpc
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loopline.assistant.v1 import assistant_pb2, events_pb2
from loopline.tools.v1 import tools_pb2
from services.common import db, ids, pb, tracing
from services.common.errors import RpcError
from services.orchestrator import hitl
from services.orchestrator.models import Chat, Interrupt, Message, Run, utcnow
from services.orchestrator.recovery import RunSupervisor
from services.orchestrator.run_state import RunSpec
from services.orchestrator.servicer.access import ASSISTANT_KIND, ChatAccess
from services.orchestrator.servicer.errors import Expired, downstream_failure, unary

log = logging.getLogger(__name__)


def _question_expired() -> RpcError:
    return RpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "QUESTION_EXPIRED",
        "The question expired; start a new turn",
    )


class Interrupts(ChatAccess):
    """Resume and NotifyCredentialConnected of the servicer."""

    @unary
    async def Resume(
        self, request: assistant_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.ResumeResponse:
        """Answer the pending question and start a new run on the same thread (no second run
        credit).

        Errors as StartTurn's for the model (`_model`, resolved before anything is written);
        a `credential_added` answer is checked with the tools service (`_check_credential`).
        """
        caller = request.caller
        try:  # the JSON text, or the Struct of a gateway of an older version
            answer = pb.object_of(request, "response")
        except pb.NotAnObject as bad:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ANSWER", str(bad)) from None
        if pb.holds_nul(answer):  # refused as the gateway refuses it in a body
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
                interrupt = await self._question(session, chat, request.request_id)
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
            turn_trace = await self._turn_trace(interrupt)
            run_id = await self._continue(
                chat.id, caller.organization_id, interrupt, normalized, llm
            )
        finally:
            await self._unclaim(chat_id)
        with tracing.resumed(turn_trace, context):  # the run joins the paused turn's trace
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

    async def _question(self, session: AsyncSession, chat: Chat, request_id: str) -> Interrupt:
        """The chat's pending question with the id `request_id`; FAILED_PRECONDITION
        QUESTION_EXPIRED when it expired (settled now or before), NO_PENDING_QUESTION when the
        chat has none, STALE_REQUEST when another question is pending."""
        try:
            interrupt = await self._pending(session, chat)
        except Expired:
            raise _question_expired() from None
        if interrupt is None:
            expired = (
                (
                    await session.execute(
                        select(Interrupt).where(
                            Interrupt.id == request_id, Interrupt.chat_id == chat.id
                        )
                    )
                )
                .scalars()
                .first()
                if ids.is_row_id(request_id)
                else None
            )
            if expired is not None and expired.outcome == "expired":
                raise _question_expired()
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "NO_PENDING_QUESTION",
                "This chat has no pending question",
            )
        if interrupt.id != request_id:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "STALE_REQUEST",
                "request_id does not match the pending question",
            )
        return interrupt

    async def _turn_trace(self, interrupt: Interrupt) -> str:
        """The W3C traceparent of the run paused on `interrupt`, kept in its `interrupted` marker
        (run_end.py; docs/tracing.md): "" when tracing is off (nothing is read) or it has none."""
        if not tracing.enabled():
            return ""
        async with self.sessions() as session:
            markers = (
                await session.execute(
                    select(Message.extra).where(
                        Message.chat_id == interrupt.chat_id,
                        Message.run_id == interrupt.run_id,
                        Message.role == "marker",
                    )
                )
            ).scalars()
            for extra in markers:
                if isinstance(extra, dict) and extra.get("request_id") == interrupt.id:
                    return str(extra.get("traceparent") or "")
        return ""

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
            # the chat's row first, then the question's (`lock_chat`)
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
        published on the paused run's stream. Idempotent: answered questions are not resumed
        again."""
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
                turn_trace = await self._turn_trace(interrupt)
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
            with tracing.resumed(turn_trace):  # the run joins the paused turn's trace
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

    async def _check_credential(
        self, organization_id: str, question: dict[str, Any], answer: dict[str, Any]
    ) -> None:
        """A `credential_added` answer must name an existing credential of the organization for the
        question's integration (INVALID_ARGUMENT INVALID_ANSWER, 400, otherwise; the question stays
        pending). The tools service not answering in time is DEADLINE_EXCEEDED TOOLS_TIMEOUT, any
        other failure UNAVAILABLE TOOLS_UNAVAILABLE (`downstream_failure`)."""
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
            raise downstream_failure(
                error, "TOOLS", "The tools service is unavailable; try again"
            ) from None
        wanted = question.get("integration_name")
        if wanted and found.credential.integration_name != wanted:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ANSWER",
                f"the credential is for {found.credential.integration_name!r}, not {wanted!r}",
            )
