"""Turn routes: start a turn, listen to a run, answer a question and resume, cancel.

The turn POST and the listen GET are answered by `hot_path.TurnRequests`, which the lean ASGI
handlers of hot_path.py share: the endpoints here declare them in the OpenAPI document and serve
the requests the lean handlers leave to FastAPI.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from loopline.assistant.v1 import assistant_pb2
from services.common import pb
from services.gateway.bodies import (
    LLM_SCHEMA,
    check_fields,
    parse_llm,
    read_json_object,
    refuse_body,
)
from services.gateway.context import context_of
from services.gateway.errors import BodyError
from services.gateway.hot_path import MAX_AFTER, TurnRequests, turn_json
from services.gateway.listener import EventStreamResponse
from services.gateway.openapi import EVENT_STREAM, error_responses, keyed
from services.gateway.query import WholeNumber
from services.gateway.schemas import RunCancelled, TurnStarted

_START_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "chat_id": {"type": ["string", "null"]},
                        "llm": LLM_SCHEMA,
                    },
                    "required": ["message"],
                    "additionalProperties": False,
                }
            }
        },
    }
}
_RESUME_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "request_id": {"type": "string", "minLength": 1},
                        "response": {
                            "type": "object",
                            "properties": {"kind": {"type": "string"}},
                            "required": ["kind"],
                        },
                        "llm": LLM_SCHEMA,
                    },
                    "required": ["request_id", "response"],
                    "additionalProperties": False,
                }
            }
        },
    }
}


_REPLAYED = {
    "Idempotent-Replayed": {
        "description": "`true` when this is the stored answer of an earlier request with the "
        "same Idempotency-Key and body (nothing was started).",
        "schema": {"type": "string", "enum": ["true"]},
    }
}


def _chat_operation(path: str, method: str, description: str, run: bool = False) -> dict[str, Any]:
    """An OpenAPI link from a turn's answer to the operation at `path` on its chat (and run)."""
    parameters = {"chat_id": "$response.body#/chat_id"}
    if run:
        parameters["run_id"] = "$response.body#/run_id"
    return {
        "operationRef": "#/paths/" + path.replace("/", "~1") + "/" + method,
        "parameters": parameters,
        "description": description,
    }


# What a client does next with a started or resumed turn: the ids of the answer, not of the
# request (a request's `chat_id` may be "" for a new chat).
TURN_LINKS = {
    "Listen": _chat_operation(
        "/assistant/chat/{chat_id}/listen/{run_id}", "get", "The run's events", run=True
    ),
    "Status": _chat_operation("/assistant/chat/{chat_id}/status", "get", "The chat's status"),
    "Chat": _chat_operation("/assistant/chat/{chat_id}", "get", "The chat and its messages"),
    "Resume": _chat_operation("/assistant/chat/{chat_id}/resume", "post", "Answer its question"),
    "Cancel": _chat_operation("/assistant/chat/{chat_id}/cancel", "post", "Cancel the run"),
    "Delete": _chat_operation("/assistant/chat/{chat_id}", "delete", "Delete the chat"),
}

router = APIRouter()


@router.post(
    "/assistant/chat",
    summary="Start a turn (new chat, or continue one)",
    response_model=TurnStarted,
    responses={
        **error_responses(402, 404, 409, 413, 422, 429, denial=True),
        200: {"description": "The turn started", "headers": _REPLAYED, "links": TURN_LINKS},
    },
    openapi_extra=keyed(_START_BODY, idempotent=True),
)
async def start_turn(request: Request) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    body = await read_json_object(request, context.settings.max_body_bytes)
    turns: TurnRequests = request.app.state.turns
    return await turns.start(who, body, request.headers.get("idempotency-key"))


@router.get(
    "/assistant/chat/{chat_id}/listen/{run_id}",
    summary="Stream a run's events as Server-Sent Events",
    # the answer's media type (the endpoint returns the response itself)
    response_class=EventStreamResponse,
    status_code=200,
    responses={**error_responses(404), 200: EVENT_STREAM},
    openapi_extra=keyed(),
)
async def listen(
    chat_id: str,
    run_id: str,
    request: Request,
    after: Annotated[WholeNumber, Query(ge=0, le=MAX_AFTER)] = 0,
) -> Response:
    who = await context_of(request).principal(request)
    turns: TurnRequests = request.app.state.turns
    return await turns.listen(who, chat_id, run_id, after, request.headers.get("authorization"))


@router.post(
    "/assistant/chat/{chat_id}/resume",
    summary="Answer a pending question and resume",
    response_model=TurnStarted,
    responses={
        **error_responses(404, 409, 413),
        200: {"description": "The turn resumed in a new run", "links": TURN_LINKS},
    },
    openapi_extra=keyed(_RESUME_BODY),
)
async def resume(chat_id: str, request: Request) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    body = await read_json_object(request, context.settings.max_body_bytes)
    check_fields(body, {"request_id", "response", "llm"})
    request_id, answer = body.get("request_id"), body.get("response")
    if not isinstance(request_id, str) or not request_id:
        raise BodyError(400, "request_id must be a non-empty string")
    if not isinstance(answer, dict) or not isinstance(answer.get("kind"), str):
        raise BodyError(
            400, "response must be an object with a 'kind' (the SDK's UserInputResponse)"
        )
    llm = parse_llm(body.get("llm"))
    # the answer as JSON text (numbers exact, keys in the client's order), and as a Struct
    # beside it for an orchestrator of an older version (it reads only `response`)
    rpc = assistant_pb2.ResumeRequest(
        caller=context.caller(who),
        chat_id=chat_id,
        request_id=request_id,
        response=pb.to_struct(answer),
        response_json=pb.json_bytes(answer),
    )
    if llm is not None:
        rpc.llm.CopyFrom(llm)
    return JSONResponse(turn_json(await context.orchestrator.Resume(rpc, timeout=30)))


@router.post(
    "/assistant/chat/{chat_id}/cancel",
    summary="Cancel the chat's active run",
    response_model=RunCancelled,
    responses=error_responses(404),
    openapi_extra=keyed(),
)
async def cancel(chat_id: str, request: Request) -> Response:
    context = context_of(request)
    who = await context.principal(request)
    await refuse_body(request, context.settings.max_body_bytes)
    response = await context.orchestrator.Cancel(
        assistant_pb2.CancelRequest(
            caller=context.caller(who), chat_id=chat_id, reason="cancelled by user"
        ),
        timeout=30,
    )
    cancelled: RunCancelled = {
        "status": response.status,
        "chat_id": response.chat_id,
        "run_id": response.run_id,
    }
    return JSONResponse(cancelled)
