"""The JSON bodies of the account routes' answers (system health, the caller's profile and
organizations, API keys), as typed dicts: the SDK's `modulex/types/{system,auth,api_keys}.py`
shapes. Built and used as those of schemas.py are (each route's `response_model`)."""

from __future__ import annotations

from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict

_DOCSTRINGS = ConfigDict(use_attribute_docstrings=True)


@with_config(_DOCSTRINGS)
class SystemHealth(TypedDict):
    """Whether the service is up (no key needed)."""

    status: str
    """`ok`, or `degraded` while the readiness probe fails (a database or Redis not answering)."""
    service: str
    version: str


@with_config(_DOCSTRINGS)
class UserProfile(TypedDict):
    """The caller: the user its API key belongs to."""

    id: str
    email: str | None
    username: None
    """Always null: users have no user name here."""
    role: str | None
    """The role in the X-Organization-ID organization; null without that header."""
    is_active: bool
    organization_ids: list[str]
    """The user's organizations (only its own for a key bound to one), oldest first."""
    primary_organization_id: str | None
    """X-Organization-ID when sent, else the key's organization, else the oldest where the user
    is owner, else the first."""


@with_config(_DOCSTRINGS)
class OrganizationMembership(TypedDict):
    """An organization the user belongs to."""

    id: str
    name: str
    slug: None
    domain: None
    role: str
    joined_at: None
    """Not recorded: always null."""
    is_default: bool
    """Whether it is the profile's `primary_organization_id`."""


class UserOrganizations(TypedDict):
    """The user's organizations (filtered by `role` when given), oldest first."""

    success: bool
    user_id: str
    organizations: list[OrganizationMembership]
    total: int


@with_config(_DOCSTRINGS)
class ApiKeyView(TypedDict):
    """An API key's metadata: never the key itself, only its first characters."""

    id: str
    name: str
    key_hint: str
    """The key's first characters (at most 12, at most a quarter of the key)."""
    masked_key: str
    """`key_hint` followed by `…`."""
    organization_id: str | None
    """The organization the key is bound to; null: valid in every organization of its user."""
    expires_at: str | None
    is_expired: bool
    is_active: bool
    """Neither revoked nor expired."""
    rate_limit_per_minute: int
    """The requests a minute the key may make: its own limit or the deployment's, the lower
    (0: not limited)."""
    last_used_at: str | None
    """When the key last authenticated a request, to about a minute; null: never."""
    created_at: str | None
    revoked_at: str | None


@with_config(_DOCSTRINGS)
class ApiKeyCreated(ApiKeyView):
    """A new API key, with the key itself: shown this once, never again."""

    key: str


@with_config(_DOCSTRINGS)
class ApiKeyList(TypedDict):
    """The keys bound to the organization and (for a caller whose key is unbound) the caller's
    own unbound keys, newest first; expired keys included, revoked ones on request."""

    keys: list[ApiKeyView]
    total: int
    max_keys: int
    """The most active keys one organization may have (LOOPLINE_MAX_API_KEYS_PER_ORGANIZATION)."""


class ApiKeyRevoked(TypedDict):
    """A revoked API key (also when it was revoked before)."""

    success: bool
    message: str
