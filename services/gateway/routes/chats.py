"""Chat routes: one chat with its messages, the caller's chats, a chat's status, delete."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from loopline.assistant.v1 import assistant_pb2
from services.common import pb
from services.gateway.bodies import refuse_body
from services.gateway.context import context_of
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import TrueOrFalse, WholeNumber
from services.gateway.schemas import Chat, ChatDeleted, ChatPage, ChatStatus

router = APIRouter()


@router.get(
    "/assistant/chat/{chat_id}",
    summary="A chat with its messages and pending question",
    response_model=Chat,
    responses=error_responses(404),
    openapi_extra=keyed(),
)
async def get_chat(
    chat_id: str,
    request: Request,
    page_size: Annotated[WholeNumber, Query(ge=0, le=1000)] = 0,
    page_token: str | None = None,
) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    response = await context.orchestrator.GetChat(
        assistant_pb2.GetChatRequest(
            caller=context.caller(who),
            chat_id=chat_id,
            page_size=page_size,
            page_token=page_token or "",
        ),
        timeout=30,
    )
    return Response(orjson.dumps(chat_json(response)), media_type="application/json")


@router.get(
    "/assistant/chats",
    summary="The caller's chats, newest first",
    response_model=ChatPage,
    responses=error_responses(),
    openapi_extra=keyed(),
)
async def list_chats(
    request: Request,
    limit: Annotated[WholeNumber, Query(ge=1, le=100)] = 20,
    cursor: str | None = None,
) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    response = await context.orchestrator.ListChats(
        assistant_pb2.ListChatsRequest(
            caller=context.caller(who), limit=limit, cursor=cursor or ""
        ),
        timeout=30,
    )
    page: ChatPage = {
        "items": [
            {
                "id": c.id,
                "title": c.title,
                "created_at": pb.iso(c.create_time),
                "updated_at": pb.iso(c.update_time),
                "is_running": bool(c.running_id) and not _pending(c),
            }
            for c in response.chats
        ],
        "next_cursor": response.next_cursor or None,
    }
    return JSONResponse(page)


@router.get(
    "/assistant/chat/{chat_id}/status",
    summary="Whether the chat is running or awaiting input",
    response_model=ChatStatus,
    responses=error_responses(404),
    openapi_extra=keyed(),
)
async def status(chat_id: str, request: Request) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    r = await context.orchestrator.GetChatStatus(
        assistant_pb2.GetChatStatusRequest(caller=context.caller(who), chat_id=chat_id), timeout=30
    )
    answer: ChatStatus = {
        "chat_id": r.chat_id,
        "is_running": r.is_running,
        "awaiting_input": r.awaiting_input,
        "pending_request_id": r.pending_request_id or None,
        "running_id": r.running_id or None,
        "run_status": pb.from_struct(r.run_status) if r.HasField("run_status") else None,
    }
    return JSONResponse(answer)


@router.delete(
    "/assistant/chat/{chat_id}",
    summary="Delete a chat (soft unless permanent=true)",
    response_model=ChatDeleted,
    responses=error_responses(404, 409),
    openapi_extra=keyed(),
)
async def delete_chat(chat_id: str, request: Request, permanent: TrueOrFalse = False) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    await refuse_body(request, context.settings.max_body_bytes)
    r = await context.orchestrator.DeleteChat(
        assistant_pb2.DeleteChatRequest(
            caller=context.caller(who), chat_id=chat_id, permanent=permanent
        ),
        timeout=30,
    )
    deleted: ChatDeleted = {"status": r.status, "chat_id": r.chat_id, "permanent": r.permanent}
    return JSONResponse(deleted)


def chat_json(response: assistant_pb2.GetChatResponse) -> Chat:
    """The JSON of a chat and a page of its messages (GetChat).

    The JSON fields' text (`*_json`) goes into the body as the orchestrator wrote it
    (pb.field_fragment: numbers exact, keys in their stored order); an older orchestrator's
    Struct or Value is converted."""
    chat = response.chat
    body: Chat = {
        "id": chat.id,
        # the spec's chat: the surface discriminator, and never workflow-bound
        "kind": "assistant",
        "workflow_id": None,
        "title": chat.title,
        "running_id": chat.running_id or None,
        "pending_user_input_request": pb.field_fragment(chat, "pending_user_input_request"),
        "created_at": pb.iso(chat.create_time),
        "updated_at": pb.iso(chat.update_time),
        "messages": [
            {
                "id": m.id,
                "role": m.role,
                "content": pb.field_fragment(m, "content"),
                "thinking": pb.field_fragment(m, "thinking"),
                "run_id": m.run_id or None,
                "running_status": m.running_status or None,
                "created_at": pb.iso(m.create_time),
            }
            for m in response.messages
        ],
    }
    if response.next_page_token:  # only when there are older messages
        body["next_page_token"] = response.next_page_token
    return body


def _pending(chat: assistant_pb2.Chat) -> bool:
    """Whether `chat` (of ListChats) has a pending question: its `pending_user_input_request_json`,
    or the Struct an orchestrator of an older version sets instead."""
    return bool(chat.pending_user_input_request_json) or chat.HasField("pending_user_input_request")
