"""Organization settings: the saved default model (the SDK's `organizations.get_settings` and
`set_composer_llm`; an omitted `llm` uses the organization's saved default).

GET /organizations/settings -> {llm_model_visibility: {}, composer_llm: {...} | null}
PUT /organizations/settings/composer-llm {integration_name, provider_id, model_id, credential_id?}
DELETE /organizations/settings/composer-llm (back to the deployment's default model)
    -> {composer_llm: {...}}; owner or admin only.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loopline.assistant.v1 import assistant_pb2
from services.gateway.bodies import parse_llm, read_json_object, refuse_body
from services.gateway.context import context_of
from services.gateway.openapi import error_responses, keyed
from services.gateway.schemas import ComposerLlm, OrganizationSettings, SavedModel


def _shown(llm: dict[str, Any]) -> SavedModel:
    """A saved default as GET and PUT answer it: `credential_id` always present (null without)."""
    return {
        "integration_name": llm["integration_name"],
        "provider_id": llm["provider_id"],
        "model_id": llm["model_id"],
        "credential_id": llm.get("credential_id"),
    }


_COMPOSER_LLM_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "integration_name": {
                            "type": "string",
                            "minLength": 1,
                            "pattern": r"\S",
                        },
                        "provider_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "model_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "credential_id": {"type": ["string", "null"]},
                    },
                    "required": ["integration_name", "provider_id", "model_id"],
                    "additionalProperties": False,
                }
            }
        },
    }
}

# The PUT asks the orchestrator whether it can serve the model (CheckModel; an error is 400), and
# checks and saves inside `DefaultModels.exclusive` (a DELETE of the credential it names waits,
# then sees it as the default: 409; or it waits for that DELETE and its check fails: 400).
router = APIRouter(responses=error_responses(413))


@router.get(
    "/organizations/settings",
    summary="The organization's model preferences",
    tags=["organizations"],
    response_model=OrganizationSettings,
    openapi_extra=keyed(),
)
async def get_settings(request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    saved = await context.default_models.get(who.organization_id)
    answer: OrganizationSettings = {
        "llm_model_visibility": {},
        "composer_llm": _shown(saved) if saved else None,
    }
    return JSONResponse(answer)


@router.put(
    "/organizations/settings/composer-llm",
    summary="Save the organization's default model (used when a turn names none)",
    tags=["organizations"],
    response_model=ComposerLlm,
    openapi_extra=keyed(_COMPOSER_LLM_BODY),
)
async def set_composer_llm(request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    body = await read_json_object(request, context.settings.max_body_bytes)
    parsed = parse_llm(body)
    assert parsed is not None  # the body is a JSON object, never None
    llm = {
        "integration_name": parsed.integration_name,
        "provider_id": parsed.provider_id,
        "model_id": parsed.model_id,
    }
    if parsed.HasField("credential_id") and parsed.credential_id:
        llm["credential_id"] = parsed.credential_id
    # no DELETE /credentials/{id} between check and save
    async with context.default_models.exclusive(who.organization_id) as held:
        # an unusable default would break every turn that names no model
        await context.orchestrator.CheckModel(
            assistant_pb2.CheckModelRequest(caller=context.caller(who), llm=parsed), timeout=30
        )
        await held.set(llm)
    answer: ComposerLlm = {"composer_llm": _shown(llm)}
    return JSONResponse(answer)


@router.delete(
    "/organizations/settings/composer-llm",
    summary="Clear the organization's saved default model"
    " (turns naming none use the deployment's again)",
    tags=["organizations"],
    response_model=ComposerLlm,
    openapi_extra=keyed(),
)
async def clear_composer_llm(request: Request) -> JSONResponse:
    """200 {"composer_llm": null}, also when none was saved: turns that name no model use the
    deployment's default again. Taken under the same lock as PUT; the key of the model that was
    the default may be deleted afterwards."""
    context = context_of(request)
    who = await context.principal(request)
    await refuse_body(request, context.settings.max_body_bytes)
    async with context.default_models.exclusive(who.organization_id) as held:
        await held.set(None)
    cleared: ComposerLlm = {"composer_llm": None}
    return JSONResponse(cleared)
