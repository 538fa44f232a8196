"""The chat RPCs: GetChat (paged messages), ListChats, GetChatStatus and DeleteChat."""

from __future__ import annotations

import base64
import datetime
import logging
import re
from collections.abc import Sequence

import grpc
from sqlalchemy import delete, select, update

from loopline.assistant.v1 import assistant_pb2
from services.common import db, pb
from services.common.errors import RpcError
from services.orchestrator.models import Chat, Interrupt, Message, Run, RunEvent, utcnow
from services.orchestrator.servicer.access import ASSISTANT_KIND, ChatAccess
from services.orchestrator.servicer.errors import not_found, unary

log = logging.getLogger(__name__)

MAX_CHAT_PAGE_SIZE = 1000  # GetChatRequest.page_size, at most
# a GetChat page's messages, at most (a gRPC client's default limit is 4 MiB)
CHAT_PAGE_BYTES = 3 * 1024 * 1024


def _page_token(chat_id: str, seq: int) -> str:
    """A GetChat page token: the chat's messages before `seq` (base64url of "<chat id>|<seq>")."""
    return base64.urlsafe_b64encode(f"{chat_id}|{seq}".encode()).decode()


def _page_token_seq(token: str, chat_id: str) -> int:
    """The seq in a GetChat page token of `chat_id`; INVALID_ARGUMENT INVALID_PAGE_TOKEN for any
    other text."""
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


def _page(
    rows: Sequence[Message], statuses: dict[str | None, str], chat_id: str, page_size: int
) -> tuple[list[assistant_pb2.ChatMessage], str]:
    """A GetChat page of `rows` (newest first): its messages oldest first, at most `page_size`
    (0: all) and CHAT_PAGE_BYTES of them (a larger message comes alone), and the token of the
    next (older) page, empty when there is none."""
    messages: list[assistant_pb2.ChatMessage] = []
    size = 0
    next_page_token = ""
    last_seq = 0
    for row in rows:  # newest first
        thinking = (
            pb.json_bytes(row.extra, clip=True, max_depth=pb.MAX_WIRE_DEPTH) if row.extra else b""
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
        if messages and (size > CHAT_PAGE_BYTES or len(messages) == page_size):
            next_page_token = _page_token(chat_id, last_seq)
            break
        messages.append(message)
        last_seq = row.seq
    messages.reverse()
    return messages, next_page_token


# A ListChats cursor: "<created_at in UTC, isoformat()>|<chat id>", URL-safe base64.
_CURSOR = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?\+00:00)\|"
    r"(?P<id>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
)


class Chats(ChatAccess):
    """GetChat, ListChats, GetChatStatus and DeleteChat of the servicer."""

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
        chat stays readable within a gRPC message. `next_page_token` leads to older messages.
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
        messages, next_page_token = _page(rows, statuses, chat.id, request.page_size)
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
        if pending is not None:  # clipped: see GetChat
            message.pending_user_input_request_json = pb.json_bytes(pending.request, clip=True)
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
            # only the cursor this method mints (`_CURSOR`: a UTC time as isoformat() writes it,
            # a chat's UUID) is taken: a forged one may hold a NUL PostgreSQL cannot take, or a
            # time that overflows when made UTC
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
            # a question past its time is settled by this look too: its chat is free
            for row in rows:
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
        """running / awaiting_input / idle, the pending question's id, the latest run's status."""
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
        await self._claim(chat_id)
        try:
            purged = await self._delete_rows(chat_id, request.permanent)
        finally:
            await self._unclaim(chat_id)
        # the runs' events outside the database too (Redis streams, memory)
        if request.permanent and purged:
            try:
                await self.runner.events.purge(purged)
            except Exception:  # noqa: BLE001 - the rows are gone; the streams expire (TTL)
                log.warning(
                    "deleting the event streams of a deleted chat failed; "
                    "they expire by themselves",
                    extra={"fields": {"chat_id": chat_id}},
                )
        return assistant_pb2.DeleteChatResponse(
            status="deleted", chat_id=chat_id, permanent=request.permanent
        )

    async def _delete_rows(self, chat_id: str, permanent: bool) -> list[str]:
        """One transaction on the claimed chat: its pending question cancelled, then the chat
        hidden (soft) or deleted with its rows (permanent); returns the runs deleted. NOT_FOUND
        when it is gone, FAILED_PRECONDITION RUN_IN_FLIGHT while a run is running."""
        purged: list[str] = []
        async with self.sessions() as session, session.begin():
            # the chat's row first (`lock_chat`)
            chat = await session.get(Chat, chat_id, with_for_update=True)
            if chat is None or (chat.deleted_at is not None and not permanent):
                raise not_found()
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
            if permanent:
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
        return purged
