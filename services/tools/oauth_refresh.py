"""OAuth2 credentials that stay usable past their access token's lifetime (RFC 6749 section 6).

An `oauth2` credential's secret is {"access_token", "token_type", "refresh_token"?} (encrypted);
its metadata {"scope", "expires_at"?, "expires_in"?} (`token_fields`). Before an action runs with
one (`ToolExecutor._credential_for` calls `TokenRefresher.usable`), an access token that expires
within REFRESH_MARGIN (or half its lifetime when that is shorter) is renewed with the refresh token
at the provider's token endpoint (authlib, `request_tokens`); `api_request` renews once more when
the API answers 401 (`renew_after_rejection`). The new tokens are stored encrypted, the old refresh
token kept when the server sends none.

One renewal per credential at a time: a lock per credential in the process and, on PostgreSQL, a
row lock (SELECT ... FOR UPDATE) held across the token request, so two replicas never both spend a
rotating refresh token; a call that waited finds the renewed token and uses it. The write is also a
compare-and-set on the stored ciphertext.

A refusal (invalid_grant, any other 4xx, or no refresh token once the access token has expired)
marks the credential `needs_reconnect` and the call fails with ReconnectRequired, whose text tells
the model to call request_credential; completing a new OAuth2 flow for the integration stores the
new tokens in that credential and clears the mark (`reconnect`). No answer (network error, 5xx,
408, 429, no token in a 2xx) marks nothing: RefreshUnavailable says to try again later. A refused
client (invalid_client, 401) is the operator's configuration, not the user's: ClientRefused, nothing
marked. Tokens never reach a log line or an error: messages are built from known fields.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import logging
import re
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from services.tools.credential_cache import OrgReadCache
from services.tools.credential_info import CredentialInfo
from services.tools.crypto import KEY_CHANGED_HINT, SecretBox, SecretBoxError, mask_secret
from services.tools.models import Credential, utcnow

if TYPE_CHECKING:
    from services.tools.oauth import OAuth2Provider

log = logging.getLogger(__name__)

#: How long before its expiry an access token is renewed (at most half its lifetime).
REFRESH_MARGIN = datetime.timedelta(seconds=60)
#: Statuses of a token endpoint that say "not now" rather than "no".
_TEMPORARY_STATUSES = (408, 429)
_ERROR_CODE = re.compile(r"[\x20-\x21\x23-\x5b\x5d-\x7e]{1,64}")  # RFC 6749 section 5.2


class TokenEndpointError(Exception):
    """The token endpoint issued no token. `status`: its HTTP status (None: no answer); `error`:
    the RFC 6749 error code it sent ("" if none, or not a well-formed code)."""

    def __init__(self, status: int | None, error: str = "") -> None:
        super().__init__(f"token endpoint: status {status}, error {error or '-'}")
        self.status = status
        self.error = error if _ERROR_CODE.fullmatch(error) else ""

    @property
    def client_refused(self) -> bool:
        """The server refused the client (its id, secret or authentication method)."""
        return self.error == "invalid_client" or self.status == 401

    @property
    def refused(self) -> bool:
        """The server answered no (an OAuth2 error or a 4xx), rather than "not now"."""
        if self.status in _TEMPORARY_STATUSES or self.status is None:
            return False
        return bool(self.error) or 400 <= self.status < 500


async def request_tokens(
    provider: OAuth2Provider, timeout_s: float, grant: Mapping[str, str]
) -> dict[str, Any]:
    """The token response (it has a string `access_token`) of `grant` at the provider's token
    endpoint, the client authenticated by `provider.auth_method`: a refresh when `grant` has
    `refresh_token`, else an authorization code exchange (`code`, `redirect_uri`,
    `code_verifier`?). Raises TokenEndpointError when no token comes back."""
    # loaded on first use, not at start
    from authlib.integrations.httpx_client import AsyncOAuth2Client, OAuthError

    # the HTTP library authlib runs on (httpx2 where installed): its errors
    from authlib.integrations.httpx_client._compat import httpx2

    statuses: list[int] = []

    def seen(response: Any) -> Any:
        statuses.append(response.status_code)
        return response

    client = AsyncOAuth2Client(
        client_id=provider.client_id,
        client_secret=provider.client_secret or None,
        token_endpoint_auth_method=provider.auth_method,
        timeout=timeout_s,
        follow_redirects=False,
        trust_env=False,  # no proxy from the environment; its CAs (SSL_CERT_FILE) are trusted:
        verify=httpx2.create_ssl_context(trust_env=True),
    )
    client.register_compliance_hook("access_token_response", seen)
    client.register_compliance_hook("refresh_token_response", seen)
    try:
        async with client:
            if "refresh_token" in grant:
                token = await client.refresh_token(
                    provider.token_url, refresh_token=grant["refresh_token"]
                )
            else:
                token = await client.fetch_token(
                    provider.token_url, grant_type="authorization_code", **grant
                )
    except OAuthError as exc:
        raise TokenEndpointError(statuses[-1] if statuses else None, str(exc.error)) from None
    # an HTTP error status, no answer, or not a JSON object (or nested past what json parses)
    except (httpx2.HTTPError, ValueError, RecursionError) as exc:
        log.warning(
            "oauth2 token endpoint gave no token",
            extra={
                "fields": {
                    "integration": provider.name,
                    "status": statuses[-1] if statuses else None,
                    "exc_type": type(exc).__name__,
                }
            },
        )
        raise TokenEndpointError(statuses[-1] if statuses else None) from None
    if not isinstance(token.get("access_token"), str) or not token["access_token"]:
        raise TokenEndpointError(statuses[-1] if statuses else None)
    return dict(token)


def token_fields(
    tokens: Mapping[str, Any], previous: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(secret, metadata fields) of a token response: the refresh token of `previous` (the secret
    it renews) is kept when the response has none; `expires_at` and `expires_in` only when the
    response says how long the access token lives, `scope` only when it names one."""
    previous = previous or {}
    secret = {
        "access_token": tokens["access_token"],
        "token_type": str(tokens.get("token_type") or previous.get("token_type") or "Bearer"),
    }
    refresh = tokens.get("refresh_token") or previous.get("refresh_token")
    if isinstance(refresh, str) and refresh:
        secret["refresh_token"] = refresh
    fields: dict[str, Any] = {}
    lifetime = tokens.get("expires_in")
    if isinstance(lifetime, int | float) and not isinstance(lifetime, bool) and lifetime > 0:
        fields["expires_in"] = lifetime
        fields["expires_at"] = (utcnow() + datetime.timedelta(seconds=lifetime)).isoformat()
    if isinstance(tokens.get("scope"), str):
        fields["scope"] = tokens["scope"]
    return secret, fields


def expires_soon(metadata: Mapping[str, Any]) -> bool:
    """Whether the access token described by `metadata` expires within REFRESH_MARGIN, or half its
    lifetime when that is shorter (False when its expiry is not known)."""
    expires_at = _expiry(metadata)
    if expires_at is None:
        return False
    margin = REFRESH_MARGIN
    lifetime = metadata.get("expires_in")
    if isinstance(lifetime, int | float) and not isinstance(lifetime, bool) and lifetime > 0:
        margin = min(margin, datetime.timedelta(seconds=lifetime / 2))
    return expires_at - utcnow() <= margin


class CredentialUnusable(Exception):
    """An oauth2 credential cannot be used now; the message is for the model (no secret)."""


class ReconnectRequired(CredentialUnusable):
    """The authorization server refused to renew the credential: the user must connect it again."""

    def __init__(self, info: CredentialInfo) -> None:
        super().__init__(
            f"The {info.integration} credential {info.id!r} must be connected again: its "
            "authorization server no longer accepts it. Call request_credential with the "
            f"integration {info.integration!r} to ask the user to connect it again."
        )


class RefreshUnavailable(CredentialUnusable):
    """The token endpoint did not answer (or not with a token): a temporary failure."""

    def __init__(self, info: CredentialInfo) -> None:
        super().__init__(
            f"The {info.integration} credential {info.id!r} needs a new access token, but its "
            "authorization server could not be reached or failed to answer; try again later."
        )


class ClientRefused(CredentialUnusable):
    """The token endpoint refused the operator's client: connecting again would not help."""

    def __init__(self, info: CredentialInfo) -> None:
        super().__init__(
            f"The {info.integration} authorization server refused Loopline's OAuth2 client while "
            f"renewing credential {info.id!r}; the operator must fix the integration's OAuth2 "
            "configuration (connecting again will not help)."
        )


# The oauth2 credential the current tool call runs with (set by `TokenRefresher.usable`), for
# `renew_after_rejection`: a context variable, so it follows the call into its action.
_running_with: contextvars.ContextVar[tuple[TokenRefresher, CredentialInfo] | None] = (
    contextvars.ContextVar("loopline_oauth2_credential", default=None)
)


async def renew_after_rejection(integration: str, access_token: str) -> dict[str, Any] | None:
    """The renewed secret of the credential the current tool call runs with, after its API answered
    401 to `access_token` (renewed at most once for all the calls that saw that token), or None
    when the call runs with no renewable oauth2 credential of `integration`.

    Raises CredentialUnusable (as `TokenRefresher.usable`)."""
    running = _running_with.get()
    if running is None or running[1].integration != integration:
        return None
    refresher, info = running
    renewed = await refresher.renew(info, rejected=access_token)
    if renewed is None:
        return None
    _running_with.set((refresher, renewed[0]))
    return renewed[1]


class TokenRefresher:
    """Renews the access tokens of stored oauth2 credentials (see the module docstring).

    Args:
        providers: the OAuth2 providers by integration name (shared with OAuth2Flows).
        sessions: the tools database's session factory.
        box: encrypts and decrypts the secrets.
        cache: the credential store's read cache (invalidated after a write).
        timeout_s: the token request's time limit, in seconds.
    """

    def __init__(
        self,
        providers: Mapping[str, OAuth2Provider],
        sessions: Any,
        box: SecretBox,
        cache: OrgReadCache,
        timeout_s: float,
    ) -> None:
        self.providers = providers
        self._sessions = sessions
        self._box = box
        self._cache = cache
        self._timeout_s = timeout_s
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def usable(
        self, info: CredentialInfo, secret: dict[str, Any]
    ) -> tuple[CredentialInfo, dict[str, Any]]:
        """(`info`, `secret`) of the credential an action is about to run with, renewed first when
        it is an oauth2 credential whose access token expires soon (`expires_soon`).

        Raises ReconnectRequired (it needs reconnecting, or its renewal was refused now),
        RefreshUnavailable, ClientRefused; crypto.SecretBoxError when the stored secret cannot be
        decrypted (logged)."""
        if info.auth_type != "oauth2":
            _running_with.set(None)
            return info, secret
        if info.needs_reconnect:
            raise ReconnectRequired(info)
        if info.integration in self.providers and expires_soon(info.metadata):
            renewed = await self.renew(info, rejected=None)
            if renewed is not None:
                info, secret = renewed
        _running_with.set((self, info))
        return info, secret

    async def renew(
        self, info: CredentialInfo, rejected: str | None
    ) -> tuple[CredentialInfo, dict[str, Any]] | None:
        """Renew `info`'s access token, unless another call did meanwhile: one whose expiry is near
        (`rejected` None) or that the API rejected (`rejected`, the access token it answered 401
        to). None when its provider is not configured. Raises as `usable`."""
        provider = self.providers.get(info.integration)
        if provider is None:
            return None
        lock = self._locks.get(info.id)
        if lock is None:
            lock = self._locks[info.id] = asyncio.Lock()
        async with lock:
            return await self._renew_locked(provider, info, rejected)

    async def _renew_locked(
        self, provider: OAuth2Provider, info: CredentialInfo, rejected: str | None
    ) -> tuple[CredentialInfo, dict[str, Any]]:
        """`renew` under the credential's lock: read it (row-locked on PostgreSQL), ask the token
        endpoint when it is still stale, store the new tokens or the mark; returns the credential
        as stored then."""
        failure: CredentialUnusable | None = None
        async with self._sessions() as session, session.begin():
            row = await session.scalar(
                select(Credential).where(Credential.id == info.id).with_for_update()
            )
            if row is None:  # deleted meanwhile
                raise ReconnectRequired(info)
            secret = self._decrypt(row)
            current = CredentialInfo.of(row)
            if row.needs_reconnect:
                raise ReconnectRequired(current)
            if rejected is None:
                stale = expires_soon(row.metadata_json or {})
            else:
                stale = secret.get("access_token") == rejected
            if not stale:  # renewed by another call meanwhile
                return current, secret
            try:
                tokens = await self._tokens_for(provider, current, secret, rejected)
            except _StillValid:
                return current, secret
            except ReconnectRequired as exc:
                failure = exc
                written = await self._write(session, row, needs_reconnect=True)
            else:
                fresh, fields = token_fields(tokens, secret)
                kept = {
                    k: v
                    for k, v in (row.metadata_json or {}).items()
                    if k not in ("expires_at", "expires_in")
                }
                written = await self._write(session, row, fresh, {**kept, **fields})
            stored = await session.get(Credential, row.id, populate_existing=True)
        self._cache.invalidate(info.org_id)
        if stored is None:  # deleted meanwhile
            raise ReconnectRequired(info)
        if written:
            if failure is not None:
                raise failure
            log.info(
                "oauth2 access token renewed",
                extra=self._extra(info, reason="expiring" if rejected is None else "rejected"),
            )
        elif stored.needs_reconnect:  # the compare-and-set lost to another process's mark
            raise ReconnectRequired(CredentialInfo.of(stored))
        # renewed here, or by another process sharing the database (the compare-and-set lost)
        return CredentialInfo.of(stored), self._decrypt(stored)

    async def _tokens_for(
        self,
        provider: OAuth2Provider,
        info: CredentialInfo,
        secret: dict[str, Any],
        rejected: str | None,
    ) -> dict[str, Any]:
        """The token endpoint's answer to the credential's refresh token. Raises ReconnectRequired
        when it has none (and its access token expired or was rejected) or the server refused,
        RefreshUnavailable, ClientRefused."""
        refresh_token = secret.get("refresh_token")
        if not isinstance(refresh_token, str) or not refresh_token:
            expired = rejected is not None or _expired(info.metadata)
            if not expired:  # no way to renew it, but it still works for a little while
                raise _StillValid
            log.warning("oauth2 credential has no refresh token", extra=self._extra(info))
            raise ReconnectRequired(info)
        try:
            return await request_tokens(provider, self._timeout_s, {"refresh_token": refresh_token})
        except TokenEndpointError as exc:
            extra = self._extra(info, status=exc.status, error=exc.error)
            if exc.client_refused:
                log.warning("oauth2 token endpoint refused the client", extra=extra)
                raise ClientRefused(info) from None
            if exc.refused:
                log.warning("oauth2 token renewal refused", extra=extra)
                raise ReconnectRequired(info) from None
            log.warning("oauth2 token renewal failed for now", extra=extra)
            raise RefreshUnavailable(info) from None

    async def _write(
        self,
        session: Any,
        row: Credential,
        secret: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        needs_reconnect: bool = False,
    ) -> bool:
        """Store new tokens or the mark on `row` if its ciphertext is still the one read (another
        process may share an SQLite file); whether it was."""
        values: dict[str, Any] = {"needs_reconnect": needs_reconnect, "updated_at": utcnow()}
        if secret is not None:
            values |= {
                "encrypted_secret": self._box.encrypt(secret),
                "masked_secret": mask_secret(secret),
                "metadata_json": metadata or {},
            }
        result = await session.execute(
            update(Credential)
            .where(Credential.id == row.id, Credential.encrypted_secret == row.encrypted_secret)
            .values(values)
            .execution_options(synchronize_session=False)
        )
        return bool(result.rowcount)

    async def reconnect(
        self,
        org_id: str,
        integration: str,
        secret: dict[str, Any],
        metadata: dict[str, Any],
        display_name: str,
    ) -> CredentialInfo | None:
        """Store a new flow's tokens in the organization's oauth2 credential of `integration` that
        needs reconnecting (its default first, else the newest), clearing the mark; None when none
        does. `display_name` ("" keeps the old one) renames it."""
        async with self._sessions() as session, session.begin():
            row = await session.scalar(
                select(Credential)
                .where(
                    Credential.org_id == org_id,
                    Credential.integration == integration,
                    Credential.auth_type == "oauth2",
                    Credential.needs_reconnect,
                )
                .order_by(Credential.is_default.desc(), Credential.created_at.desc(), Credential.id)
                .limit(1)
                .with_for_update()
            )
            if row is None:
                return None
            row.encrypted_secret = self._box.encrypt(secret)
            row.masked_secret = mask_secret(secret)
            row.metadata_json = metadata
            row.needs_reconnect = False
            row.display_name = display_name or row.display_name
            row.updated_at = utcnow()
        self._cache.invalidate(org_id)
        log.info("oauth2 credential connected again", extra=self._extra(CredentialInfo.of(row)))
        return CredentialInfo.of(row)

    def _decrypt(self, row: Credential) -> dict[str, Any]:
        """The secret of `row`; SecretBoxError (logged, without the secret) when no key decrypts
        it."""
        try:
            return self._box.decrypt(row.encrypted_secret)
        except SecretBoxError:
            log.warning(
                f"stored credential cannot be decrypted: {KEY_CHANGED_HINT}",
                extra=self._extra(CredentialInfo.of(row)),
            )
            raise

    @staticmethod
    def _fields(info: CredentialInfo, **more: Any) -> dict[str, Any]:
        return {
            "credential_id": info.id,
            "org_id": info.org_id,
            "integration": info.integration,
            **more,
        }

    @classmethod
    def _extra(cls, info: CredentialInfo, **more: Any) -> dict[str, Any]:
        return {"fields": cls._fields(info, **more)}


class _StillValid(CredentialUnusable):
    """No refresh token, but the access token has not expired yet: it is used as it is."""


def _expiry(metadata: Mapping[str, Any]) -> datetime.datetime | None:
    """When the access token described by `metadata` expires (aware), or None when not known."""
    try:
        expires_at = datetime.datetime.fromisoformat(str(metadata["expires_at"]))
    except (KeyError, ValueError):
        return None
    return expires_at if expires_at.tzinfo else expires_at.replace(tzinfo=datetime.UTC)


def _expired(metadata: Mapping[str, Any]) -> bool:
    """Whether the access token's known expiry has passed."""
    expires_at = _expiry(metadata)
    return expires_at is not None and expires_at <= utcnow()
