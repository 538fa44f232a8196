"""Cancel: stop a chat's active run, running here, on another replica, or paused."""

from __future__ import annotations

import uuid

import grpc
from sqlalchemy import select, update

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.common import pb
from services.common.errors import RpcError
from services.orchestrator import hitl
from services.orchestrator.models import Chat, Interrupt, Message, Run, utcnow
from services.orchestrator.servicer.access import ChatAccess
from services.orchestrator.servicer.errors import unary
from services.orchestrator.thread import cut_off_result

# looks at a chat's active run by one Cancel, when it changes under the cancel (`_cancel_active`)
CANCEL_ATTEMPTS = 3


class Cancels(ChatAccess):
    """Cancel of the servicer."""

    @unary
    async def Cancel(
        self, request: assistant_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.CancelResponse:
        """Stop the chat's active run (running or paused); FAILED_PRECONDITION
        NO_ACTIVE_EXECUTION (the gateway's 400) when there is none."""
        # the reason goes into the event every listener gets
        if len(request.reason) > hitl.MAX_REASON_CHARS:
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
        caller looks again, so a cancel sent beside a resume cancels the resumed run)."""
        async with self.sessions() as session:
            # an expired question is settled first, as every other look at the chat settles it:
            # its run is over and nothing is active
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
        # a run that just paused is cancelled as a paused one (`_cancel_paused`)
        if outcome is not None and outcome != "interrupted":
            if outcome != "cancelled":
                raise no_active
            return assistant_pb2.CancelResponse(status="cancelled", chat_id=chat.id, run_id=run_id)
        if self.backend.distributed and self.supervisor is not None:
            async with self.sessions() as session:
                status = (
                    await session.execute(select(Run.status).where(Run.id == run_id))
                ).scalar()
            # running on another replica: ask it to stop, wait for the outcome
            if status == "running":
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
                # it ended by itself meanwhile: look again (nothing active: NO_ACTIVE_EXECUTION)
                return None
        return await self._cancel_paused(chat.id, run_id, reason)

    async def _cancel_paused(
        self, chat_id: str, run_id: str, reason: str
    ) -> assistant_pb2.CancelResponse | None:
        """Cancel the run `run_id`, not running in this process (a paused run, or an orphan), in
        one transaction: the chat freed, its pending question cancelled with its tool call's
        result, the run `cancelled`; then `cancelled` is published on its stream. None when it is
        no longer the chat's active run."""
        async with self.sessions() as session, session.begin():
            changed = await session.execute(
                update(Chat)
                .where(Chat.id == chat_id, Chat.running_id == run_id)
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
            # its tool call's result, as a cancel gives a call it cuts off (GET chat shows it)
            for question in cancelled:
                session.add(
                    Message(
                        id=str(uuid.uuid4()),
                        chat_id=chat_id,
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
        return assistant_pb2.CancelResponse(status="cancelled", chat_id=chat_id, run_id=run_id)
