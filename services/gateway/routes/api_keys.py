"""The SDK's `api_keys` routes: create, list, get and revoke API keys; owner or admin of
X-Organization-ID.

POST /api-keys {name, organization_id?, expires_at?, rate_limit_per_minute?} -> 201 with the key
    itself, shown this once. The key belongs to the caller and is bound to the X-Organization-ID
    organization: it is refused (403) in any other. An `organization_id` in the body that is not
    the header's is 400: the request contradicts itself, and nothing about the other organization
    is looked up or revealed. A key made with a key that expires or has its own limit cannot
    outlast it nor exceed that limit (`_within_caller`). At most
    LOOPLINE_MAX_API_KEYS_PER_ORGANIZATION active keys per organization (409 past it). No
    Idempotency-Key: a replay would have to store the key itself.
GET /api-keys?include_revoked= -> {keys, total, max_keys}: the organization's keys (any member's)
    and, for a caller with an unbound key, its own unbound keys (made by the CLI), newest first.
GET, DELETE /api-keys/{key_id}: a key outside that list is 404, like a missing one. An admin may
    not revoke a key of an owner (403). Revoking is idempotent; a key revoked here is refused by
    this gateway at once (its cache entries are dropped), by other replicas within
    LOOPLINE_AUTH_CACHE_TTL_S.
"""

from __future__ import annotations

import datetime
import unicodedata
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from services.common import db, pb
from services.gateway import accounts
from services.gateway.account_schemas import ApiKeyCreated, ApiKeyList, ApiKeyRevoked, ApiKeyView
from services.gateway.bodies import check_fields, read_json_object, refuse_body
from services.gateway.context import context_of
from services.gateway.errors import BodyError
from services.gateway.identity import Principal, shown_prefix
from services.gateway.models import ApiKey, utcnow
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import TrueOrFalse
from services.gateway.ratelimit import effective_limit
from services.gateway.routes.fields import int_field, json_body

NAME_CHARS = 200
EXPIRES_AT_CHARS = 64
# the most a key's own limit may be when the deployment sets none (its setting's own maximum)
UNLIMITED_MAX = 100_000_000
NOT_FOUND = "API key not found"
OWNERS_KEY = "Only an owner of this organization may revoke an owner's API key"
# bidirectional text controls (a name shown in a list must read as it is stored)
BIDI_CONTROLS = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# the characters of `name` the schema refuses: Unicode category Cc and BIDI_CONTROLS
_NAME_REFUSED = r"\u0000-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069"

_CREATE_BODY = json_body(
    {
        "name": {
            "type": "string",
            "minLength": 1,
            # something other than whitespace, and no control or bidirectional text character
            "pattern": f"^[^{_NAME_REFUSED}]*[^\\s{_NAME_REFUSED}][^{_NAME_REFUSED}]*$",
            "description": f"1 to {NAME_CHARS} characters once surrounding whitespace is trimmed;"
            " no control characters (line breaks, tabs) nor bidirectional text controls.",
        },
        "organization_id": {
            "type": ["string", "null"],
            "description": "The X-Organization-ID organization, or absent (another: 400).",
        },
        "expires_at": {
            "type": ["string", "null"],
            "maxLength": EXPIRES_AT_CHARS,
            "description": "ISO 8601 with a UTC offset, in the future; null: never expires (or,"
            " made with a key that expires, when that key expires: no later).",
        },
        "rate_limit_per_minute": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": UNLIMITED_MAX,
            "description": "The key's own limit, at most LOOPLINE_KEY_REQUESTS_PER_MINUTE; "
            "null: the deployment's (or, made with a key that has its own limit, that limit:"
            " no higher).",
        },
    },
    ["name"],
)

router = APIRouter(responses=error_responses(404, 413))


def key_json(key: ApiKey, deployment_limit: int, now: datetime.datetime) -> ApiKeyView:
    """The listed form of `key`: never more of it than its stored prefix."""
    hint = shown_prefix(key)
    expired = accounts.is_expired(key, now)
    return {
        "id": key.id,
        "name": key.name,
        "key_hint": hint,
        "masked_key": f"{hint}…",
        "organization_id": key.organization_id,
        "expires_at": pb.iso(key.expires_at),
        "is_expired": expired,
        "is_active": key.revoked_at is None and not expired,
        "rate_limit_per_minute": effective_limit(deployment_limit, key.rate_limit_per_minute),
        "last_used_at": pb.iso(key.last_used_at),
        "created_at": pb.iso(key.created_at),
        "revoked_at": pb.iso(key.revoked_at),
    }


def _name(body: dict[str, Any]) -> str:
    """`name` trimmed; BodyError 400 when it is missing or blank, too long, or holds a control
    character (category Cc: line breaks, tabs) or a bidirectional text control anywhere (a name
    is shown in lists and logs as one line that reads as stored)."""
    value = body.get("name")
    if not isinstance(value, str) or not value.strip():
        raise BodyError(400, "name is required: a non-empty string")
    refused = next(
        (c for c in value if c in BIDI_CONTROLS or unicodedata.category(c) == "Cc"), None
    )
    if refused is not None:
        raise BodyError(
            400,
            "name must not contain control characters (such as line breaks or tabs) nor"
            f" bidirectional text controls (it has U+{ord(refused):04X})",
        )
    name = value.strip()
    if len(name) > NAME_CHARS:
        raise BodyError(400, f"name must be at most {NAME_CHARS} characters (it has {len(name)})")
    return name


def _expires_at(body: dict[str, Any], now: datetime.datetime) -> datetime.datetime | None:
    """`expires_at` as aware UTC, or None; BodyError 400 unless ISO 8601 with an offset, later
    than `now`."""
    value = body.get("expires_at")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > EXPIRES_AT_CHARS:
        raise BodyError(400, "expires_at must be an ISO 8601 date and time with a UTC offset")
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        moment = None
    try:
        utc = db.utc(moment) if moment is not None and moment.tzinfo is not None else None
    except OverflowError:  # a valid time whose UTC is past the year 9999 (or before the year 1)
        raise BodyError(
            400, "expires_at is out of range: in UTC it falls outside the years 1 to 9999"
        ) from None
    if utc is None:
        raise BodyError(
            400,
            "expires_at must be an ISO 8601 date and time with a UTC offset"
            " (e.g. 2030-01-01T00:00:00Z)",
        )
    if utc <= now:
        raise BodyError(400, "expires_at must be in the future")
    return utc


def _within_caller(
    who: Principal, expires_at: datetime.datetime | None, own_limit: int | None
) -> tuple[datetime.datetime | None, int | None]:
    """The new key's expiry and own limit under the caller key's: a key made with a key that
    expires or has its own limit gets those as ceilings (omitted: the caller key's; later or
    higher: BodyError 400), so a key cannot mint one that outlasts or outpaces it. Read from the
    Principal (the authentication look-up's), no database call."""
    if who.expires_at is not None:
        ceiling = datetime.datetime.fromtimestamp(who.expires_at, datetime.UTC)
        if expires_at is None:
            expires_at = ceiling
        elif expires_at.timestamp() > who.expires_at:
            raise BodyError(
                400,
                f"expires_at must be no later than {pb.iso(ceiling)}, when the API key making"
                " this request expires",
            )
    mine = who.rate_limit_per_minute
    if mine is not None:
        if own_limit is None:
            own_limit = mine
        elif own_limit > mine:
            raise BodyError(
                400,
                f"rate_limit_per_minute must be at most {mine}, the limit of the API key making"
                " this request",
            )
    return expires_at, own_limit


@router.post(
    "/api-keys",
    status_code=201,
    summary="Create an API key bound to this organization (the key is shown once)",
    tags=["api-keys"],
    response_model=ApiKeyCreated,
    responses=error_responses(409, 413),
    openapi_extra=keyed(_CREATE_BODY),
)
async def create_api_key(request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    settings = context.settings
    body = await read_json_object(request, settings.max_body_bytes)
    check_fields(body, {"name", "organization_id", "expires_at", "rate_limit_per_minute"})
    name = _name(body)
    named = body.get("organization_id")
    if named is not None and named != who.organization_id:
        raise BodyError(400, "organization_id must be the X-Organization-ID organization")
    now = utcnow()
    expires_at = _expires_at(body, now)
    own_limit = None
    if body.get("rate_limit_per_minute") is not None:
        high = settings.key_requests_per_minute or UNLIMITED_MAX
        own_limit = int_field(body, "rate_limit_per_minute", 0, 1, high)
    expires_at, own_limit = _within_caller(who, expires_at, own_limit)
    try:
        row, key = await accounts.create_key(
            context.authenticator.sessions,
            user_id=who.user_id,
            organization_id=who.organization_id,
            name=name,
            expires_at=expires_at,
            rate_limit_per_minute=own_limit,
            cap=settings.max_api_keys_per_organization,
        )
    except accounts.KeyCapReached as reached:
        raise HTTPException(
            409,
            f"This organization has {reached.cap} active API keys, the most it may have;"
            " revoke one first",
        ) from None
    answer: ApiKeyCreated = {**key_json(row, settings.key_requests_per_minute, now), "key": key}
    return JSONResponse(answer, status_code=201)


@router.get(
    "/api-keys",
    summary="The organization's API keys and the caller's own, newest first",
    tags=["api-keys"],
    response_model=ApiKeyList,
    openapi_extra=keyed(),
)
async def list_api_keys(request: Request, include_revoked: TrueOrFalse = False) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    rows = await accounts.visible_keys(context.authenticator.sessions, who, include_revoked)
    now, limit = utcnow(), context.settings.key_requests_per_minute
    answer: ApiKeyList = {
        "keys": [key_json(row, limit, now) for row in rows],
        "total": len(rows),
        "max_keys": context.settings.max_api_keys_per_organization,
    }
    return JSONResponse(answer)


@router.get(
    "/api-keys/{key_id}",
    summary="One API key (never the key itself)",
    tags=["api-keys"],
    response_model=ApiKeyView,
    openapi_extra=keyed(),
)
async def get_api_key(key_id: str, request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    row = await accounts.visible_key(context.authenticator.sessions, who, key_id)
    if row is None:
        raise HTTPException(404, NOT_FOUND)
    answer = key_json(row, context.settings.key_requests_per_minute, utcnow())
    return JSONResponse(answer)


@router.delete(
    "/api-keys/{key_id}",
    summary="Revoke an API key (idempotent)",
    tags=["api-keys"],
    response_model=ApiKeyRevoked,
    openapi_extra=keyed(),
)
async def revoke_api_key(key_id: str, request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.principal(request)
    await refuse_body(request, context.settings.max_body_bytes)
    try:
        row = await accounts.revoke_visible(context.authenticator.sessions, who, key_id)
    except accounts.OwnersKey:
        raise HTTPException(403, OWNERS_KEY) from None
    if row is None:
        raise HTTPException(404, NOT_FOUND)
    context.authenticator.forget(row.id)  # refused by this gateway from now on
    answer: ApiKeyRevoked = {"success": True, "message": "API key revoked"}
    return JSONResponse(answer)
