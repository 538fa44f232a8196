"""OAuth2 authorization code flow (RFC 6749 section 4.1, with PKCE S256 by RFC 7636) for
integrations that declare it; the token requests go through authlib (`oauth_refresh`).

OAuth2 integrations are configured by the operator with LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS,
a JSON list of `{"name", "display_name"?, "description"?, "authorize_url", "token_url",
"client_id", "client_secret"?, "token_endpoint_auth_method"?, "scope"? or "scopes"?, "use_pkce"?,
"authorize_params"?, "api_base_url"}` (see `OAuth2Provider`). Each becomes an integration with the
auth option `oauth2` and one action, `api_request`, that calls its API with the stored access token
(renewed first when it expires soon, and once more when the API answers 401: oauth_refresh.py).

Flow: `initiate` stores a single-use state (random, 10 minutes) with the PKCE verifier
encrypted and returns the authorization URL; `complete` consumes the state, exchanges the
code at the token URL and stores the tokens as an `oauth2` credential: in the organization's
credential of that integration that needs reconnecting when there is one (clearing the mark),
else as a new one. Tokens are secrets: encrypted at rest, never returned.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import secrets
import unicodedata
import urllib.parse
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from sqlalchemy import delete

from services.common import pb
from services.common.errors import TOOLS_DOMAIN, RpcError, bounded
from services.common.redaction import Redactor
from services.tools import oauth_refresh
from services.tools.catalogue import (
    ActionContext,
    ActionError,
    Integration,
    integration_from_manifest,
)
from services.tools.credentials import CredentialInfo, CredentialStore
from services.tools.crypto import KEY_CHANGED_HINT, SecretBox, SecretBoxError
from services.tools.models import OAuthState, utcnow
from services.tools.oauth_refresh import TokenEndpointError, TokenRefresher, request_tokens

log = logging.getLogger(__name__)

STATE_TTL = datetime.timedelta(minutes=10)
# What a state can look like: `initiate` makes it with secrets.token_urlsafe(32) (43 characters of
# the URL-safe base64 alphabet); the column holds 64. Any other state cannot be ours (`complete`).
_STATE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
#: How a client authenticates at the token endpoint (RFC 7591 names): the secret in the form, in
#: an HTTP Basic header, or no secret (a public client: its client_id in the form).
TOKEN_ENDPOINT_AUTH_METHODS = ("client_secret_post", "client_secret_basic", "none")
#: Parameters of the authorize URL that the flow sets itself: `authorize_params` cannot hold them.
FLOW_PARAMS = frozenset(
    {
        "response_type",
        "client_id",
        "redirect_uri",
        "state",
        "scope",
        "code_challenge",
        "code_challenge_method",
    }
)


@dataclass(frozen=True, kw_only=True)
class OAuth2Provider:
    """An OAuth2 integration's authorization server and client.

    `scopes` (or the space-separated `scope`) are asked for unless a flow names its own;
    `token_endpoint_auth_method` is one of TOKEN_ENDPOINT_AUTH_METHODS (client_secret_post by
    default; none when there is no client secret); `use_pkce` false leaves out the code challenge
    and verifier (for servers that refuse them); `authorize_params` are extra query parameters of
    the authorize URL (e.g. {"access_type": "offline", "prompt": "consent"}); `api_base_url` is
    where `api_request` sends the token ("" for an integration without that action).
    """

    name: str
    display_name: str
    description: str
    authorize_url: str
    token_url: str
    client_id: str
    client_secret: str = ""
    scope: str = ""
    scopes: tuple[str, ...] = ()
    api_base_url: str = ""
    token_endpoint_auth_method: str = "client_secret_post"
    use_pkce: bool = True
    authorize_params: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def default_scope(self) -> str:
        """The scope a flow asks for when it names none (space-separated)."""
        return " ".join(self.scopes) if self.scopes else self.scope

    @property
    def auth_method(self) -> str:
        """How the client authenticates at the token endpoint: "none" without a secret."""
        return self.token_endpoint_auth_method if self.client_secret else "none"


def _provider_options(item: dict[str, Any]) -> dict[str, Any]:
    """The optional fields of one configured provider, checked. Raises ValueError."""
    name = item["name"]
    method = item.get("token_endpoint_auth_method", "client_secret_post")
    if method not in TOKEN_ENDPOINT_AUTH_METHODS:
        raise ValueError(
            f"OAuth2 integration {name!r}: token_endpoint_auth_method must be one of "
            f"{', '.join(TOKEN_ENDPOINT_AUTH_METHODS)}"
        )
    if method == "client_secret_basic" and not item.get("client_secret"):
        raise ValueError(f"OAuth2 integration {name!r}: client_secret_basic needs client_secret")
    scopes = item.get("scopes", [])
    if not isinstance(scopes, list) or not all(
        isinstance(s, str) and s and not any(c.isspace() for c in s) for s in scopes
    ):
        raise ValueError(f"OAuth2 integration {name!r}: scopes must be a list of scope names")
    if scopes and item.get("scope"):
        raise ValueError(f"OAuth2 integration {name!r}: give scope or scopes, not both")
    params = item.get("authorize_params", {})
    if not isinstance(params, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in params.items()
    ):
        raise ValueError(f"OAuth2 integration {name!r}: authorize_params must map names to strings")
    taken = sorted(FLOW_PARAMS & set(params))
    if taken:
        raise ValueError(
            f"OAuth2 integration {name!r}: authorize_params cannot set {', '.join(taken)}"
        )
    if not isinstance(item.get("use_pkce", True), bool):
        raise ValueError(f"OAuth2 integration {name!r}: use_pkce must be true or false")
    return {
        "token_endpoint_auth_method": method,
        "scopes": tuple(scopes),
        "use_pkce": item.get("use_pkce", True),
        "authorize_params": dict(params),
    }


def parse_providers(
    raw: str, manifests: Mapping[str, Mapping[str, Any]] | None = None
) -> list[OAuth2Provider]:
    """The providers of a LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS value ("" -> []). Raises ValueError
    when malformed.

    `manifests` holds the OAuth2 settings of catalogue integrations by name (`authorize_url`,
    `token_url`, `scopes`, `token_endpoint_auth_method`, `use_pkce`, `authorize_params`): an
    entry of that name takes what it does not give from there and needs no `api_base_url` (the
    integration's own actions use the token)."""
    if not raw.strip():
        return []
    items = json.loads(raw)
    if not isinstance(items, list):
        raise ValueError("tools_oauth2_integrations must be a JSON list")
    providers = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("tools_oauth2_integrations must be a list of JSON objects")
        manifest = (manifests or {}).get(str(item.get("name")))
        if manifest is not None:
            given_scope = "scope" in item or "scopes" in item
            item = {**{k: v for k, v in manifest.items() if k != "scopes"}, **item}
            if not given_scope:
                item["scopes"] = list(manifest.get("scopes", []))
        required = ("name", "authorize_url", "token_url", "client_id")
        missing = [
            k
            for k in (required if manifest is not None else (*required, "api_base_url"))
            if not isinstance(item.get(k), str) or not item[k]
        ]
        if missing:
            raise ValueError(f"OAuth2 integration {item.get('name')!r} lacks {', '.join(missing)}")
        if not _NAME_RE.match(item["name"]):
            raise ValueError(f"OAuth2 integration name {item['name']!r} must match [a-z][a-z0-9_]*")
        providers.append(
            OAuth2Provider(
                name=item["name"],
                display_name=item.get("display_name") or item["name"],
                description=item.get("description")
                or f"{item.get('display_name') or item['name']} API (OAuth2)",
                authorize_url=item["authorize_url"],
                token_url=item["token_url"],
                client_id=item["client_id"],
                client_secret=item.get("client_secret", ""),
                scope=item.get("scope", ""),
                api_base_url=str(item.get("api_base_url", "")).rstrip("/"),
                **_provider_options(item),
            )
        )
    return providers


#: The most percent-decoding passes a path segment may need before it stops changing
#: (`api_path_error`).
MAX_DECODE_PASSES = 4
_PATH_REFUSAL = (
    "path must be a path on the API: no '.' or '..' segments, no ';' parameters, no control "
    "characters and no encoded '/' or '\\' (in any percent-encoding)"
)


def _decoded(segment: str) -> str | None:
    """`segment` percent-decoded until it stops changing (at most MAX_DECODE_PASSES passes), or
    None when it still changes after them (an encoding nested that deep is refused)."""
    for _ in range(MAX_DECODE_PASSES + 1):
        decoded = urllib.parse.unquote(segment)
        if decoded == segment:
            return decoded
        segment = decoded
    return None


def api_path_error(path: str) -> str | None:
    """Why `path` is not a path under an OAuth2 integration's `api_base_url`, or None when it is.

    The access token is sent to `api_base_url + path`, so the path must stay on that host and under
    that base path: it starts with one '/', names no scheme, and none of its segments,
    percent-decoded until it stops changing (a server or a proxy in front of it may decode more than
    once: `%252e%252e` is `..` after two passes), is a dot-segment ('.' or '..', also in Unicode
    compatibility forms such as U+FF0E: RFC 3986 §5.2.4 removes them, so `/../x` would leave the
    base path), holds a ';' (a path parameter: `..;` is `..` to servlet containers, which strip
    parameters after normalizing), a '/' or '\\' (which some servers decode into a separator) or a
    control character. The query and fragment are not checked: they do not change the path."""
    if not path.startswith("/") or path.startswith("//") or "://" in path:
        return "path must be a path on the API, starting with '/'"
    raw = path.split("#", 1)[0].split("?", 1)[0]
    for segment in raw.split("/"):
        decoded = _decoded(segment)
        if (
            decoded is None
            or any(c in decoded for c in "/\\;")
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded)
        ):
            return _PATH_REFUSAL
        if unicodedata.normalize("NFKC", decoded).strip() in (".", ".."):
            return _PATH_REFUSAL
    return None


def integration_of(provider: OAuth2Provider, timeout_s: float) -> Integration:
    """The integration of an OAuth2 provider: auth option oauth2, action `api_request`."""

    async def api_request(ctx: ActionContext, params: dict[str, Any]) -> Any:
        token = (ctx.secret or {}).get("access_token")
        if not token:
            raise ActionError("the credential has no access token; connect the integration again")
        path = params["path"]
        refusal = api_path_error(path)
        if refusal is not None:
            raise ActionError(refusal)
        response = await _send(provider, timeout_s, params, token)
        if response.status_code == 401:  # revoked or expired early: renew once, then retry once
            try:
                renewed = await oauth_refresh.renew_after_rejection(provider.name, token)
            except oauth_refresh.CredentialUnusable as exc:
                raise ActionError(str(exc)) from None
            if renewed is not None:
                retried = await _send(provider, timeout_s, params, renewed["access_token"])
                # the caller redacts the secret it gave; this one it never saw
                return Redactor(renewed).value(_api_result(retried))
        return _api_result(response)

    manifest = {
        "name": provider.name,
        "display_name": provider.display_name,
        "description": provider.description,
        "categories": ["oauth2"],
        "auth": [
            {
                "type": "oauth2",
                "label": "Sign in",
                "description": f"Connect with {provider.display_name} (OAuth2)",
                "fields": None,
            }
        ],
        "actions": [
            {
                "name": "api_request",
                "description": f"Call the {provider.display_name} API with the connected account.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "method": {"enum": ["GET", "POST"], "default": "GET"},
                        "path": {
                            "type": "string",
                            "minLength": 1,
                            "description": "The API path under the base URL, e.g. /me (no . or .. "
                            "segments, no ;)",
                        },
                        "body": {"type": "object", "description": "JSON body for POST"},
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
                "credit_cost_millicredits": 100,
            }
        ],
    }
    return replace(
        integration_from_manifest(manifest, {"api_request": api_request}), source="oauth2"
    )


async def _send(
    provider: OAuth2Provider, timeout_s: float, params: dict[str, Any], access_token: str
) -> Any:
    """`api_request`'s HTTP request (an httpx.Response) with `access_token`."""
    import httpx  # loaded on first use, not at start

    async with httpx.AsyncClient(  # no proxy from the environment; SSL_CERT_FILE is trusted
        timeout=timeout_s,
        follow_redirects=False,
        trust_env=False,
        verify=httpx.create_ssl_context(trust_env=True),
    ) as client:
        return await client.request(
            params.get("method", "GET"),
            provider.api_base_url + params["path"],
            headers={"Authorization": f"Bearer {access_token}"},
            json=params.get("body"),
        )


def _api_result(response: Any) -> dict[str, Any]:
    """{"status", "body"} of an API response: its JSON, else its text."""
    try:
        body: Any = pb.loads_strict(response.content)
    except ValueError:  # not JSON (NaN and 1e400 included), or nested past what json.loads parses
        body = response.text
    return {"status": response.status_code, "body": body}


def _invalid(reason: str, message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=TOOLS_DOMAIN)


class OAuth2Flows:
    """Starts and completes authorization code flows.

    Args:
        providers: the configured OAuth2 integrations.
        sessions: the tools database's session factory (for `oauth_states`).
        box: encrypts the PKCE verifiers.
        credentials: stores the resulting credentials.
        timeout_s: the token request's time limit, in seconds.
        unconfigured: integrations whose manifests offer OAuth2 without an operator's app for
            them (their refusal says what is missing).

    `refresher` renews the credentials' access tokens (the server gives it to the credential
    store, for the tool calls); it shares `providers`.
    """

    def __init__(
        self,
        providers: list[OAuth2Provider],
        sessions: Any,
        box: SecretBox,
        credentials: CredentialStore,
        timeout_s: float,
        unconfigured: Collection[str] = (),
    ) -> None:
        self.providers = {p.name: p for p in providers}
        self._unconfigured = frozenset(unconfigured)
        self._sessions = sessions
        self._box = box
        self._credentials = credentials
        self._timeout_s = timeout_s
        self.refresher = TokenRefresher(self.providers, sessions, box, credentials.cache, timeout_s)

    async def initiate(
        self,
        org_id: str,
        integration: str,
        redirect_uri: str,
        scope: str = "",
        display_name: str = "",
        make_default: bool = False,
        user_id: str = "",
    ) -> tuple[str, str]:
        """(authorization_url, state): the provider's authorize URL with its `authorize_params`,
        the scope, and the PKCE S256 challenge unless `use_pkce` is false. Raises RpcError
        INVALID_ARGUMENT for an integration without OAuth2 or a redirect_uri that is not an
        absolute http(s) URL."""
        # loaded on first use, not at start
        from authlib.oauth2.rfc6749.parameters import prepare_grant_uri
        from authlib.oauth2.rfc7636 import create_s256_code_challenge

        if not org_id:
            raise _invalid("ORGANIZATION_REQUIRED", "organization_id is required")
        provider = self.providers.get(integration)
        if provider is None and integration in self._unconfigured:
            raise _invalid(
                "OAUTH2_NOT_SUPPORTED",
                f"Integration {integration!r} offers OAuth2, but this deployment has no OAuth2 app "
                "for it (its operator adds one to LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS)",
            )
        if provider is None:
            raise _invalid(
                "OAUTH2_NOT_SUPPORTED", f"Integration {integration!r} does not offer OAuth2"
            )
        parts = urllib.parse.urlsplit(redirect_uri)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise _invalid(
                "INVALID_REDIRECT_URI", "redirect_uri must be an absolute http or https URL"
            )
        state = secrets.token_urlsafe(32)
        verifier = secrets.token_urlsafe(64) if provider.use_pkce else ""
        scope = scope or provider.default_scope
        async with self._sessions() as session, session.begin():
            await session.execute(delete(OAuthState).where(OAuthState.expires_at < utcnow()))
            session.add(
                OAuthState(
                    state=state,
                    org_id=org_id,
                    user_id=user_id,
                    integration=integration,
                    encrypted_verifier=self._box.encrypt({"verifier": verifier}),
                    redirect_uri=redirect_uri,
                    scope=scope,
                    display_name=display_name,
                    make_default=make_default,
                    expires_at=utcnow() + STATE_TTL,
                )
            )
        pkce = (
            {
                "code_challenge": create_s256_code_challenge(verifier),
                "code_challenge_method": "S256",
            }
            if verifier
            else {}
        )
        url = prepare_grant_uri(
            provider.authorize_url,
            client_id=provider.client_id,
            response_type="code",
            redirect_uri=redirect_uri,
            scope=scope or None,
            state=state,
            **{**provider.authorize_params, **pkce},
        )
        return url, state

    async def complete(self, state: str, code: str, error: str = "") -> tuple[CredentialInfo, str]:
        """Consume `state`, exchange `code`, store the credential; returns (its metadata, the user
        who started). The tokens go to the organization's credential of the integration that needs
        reconnecting when there is one (`TokenRefresher.reconnect`: same id, mark cleared), else to
        a new credential.

        Raises RpcError INVALID_ARGUMENT (OAUTH2_STATE_INVALID: unknown, used or expired state, or
        one no configured credential key decrypts (logged); missing code; OAUTH2_DENIED: the
        authorization server's `error`, RFC 6749 section 4.1.2.1, for a valid state; a state
        `initiate` cannot have made, `_STATE`, is unknown without a query) or FAILED_PRECONDITION
        (OAUTH2_EXCHANGE_FAILED: the token endpoint refused the code or could not be reached). The
        state is spent either way (it is single-use: a denied flow cannot go on to an exchange)."""
        if not state or not (code or error):
            raise _invalid("OAUTH2_STATE_INVALID", "state and code are required")
        row = await self._spend_state(state)
        if error:
            raise _invalid("OAUTH2_DENIED", bounded(f"Authorization was not granted: {error}"))
        provider = self.providers[row.integration]
        verifier = self._verifier(row)
        tokens = await self._exchange(provider, row, code, verifier)
        secret, fields = oauth_refresh.token_fields(tokens)
        metadata: dict[str, Any] = {"scope": row.scope, **fields}
        info = await self.refresher.reconnect(
            row.org_id, provider.name, secret, metadata, row.display_name
        )
        if info is not None:
            if row.make_default and not info.is_default:
                info = await self._credentials.set_default(row.org_id, info.id)
            return info, row.user_id
        info = await self._credentials.create_raw(
            row.org_id,
            provider.name,
            "oauth2",
            secret,
            display_name=row.display_name or f"{provider.display_name} account",
            metadata=metadata,
            make_default=row.make_default,
            created_by=row.user_id,
        )
        return info, row.user_id

    async def _spend_state(self, state: str) -> OAuthState:
        """Delete the stored `state` and return it; OAUTH2_STATE_INVALID when it is unknown,
        expired or for a provider no longer configured."""
        # a state `initiate` cannot have made is not looked up (U+0000 was INTERNAL on PostgreSQL)
        if not _STATE.fullmatch(state):
            raise _invalid(
                "OAUTH2_STATE_INVALID",
                "Unknown or expired OAuth2 state; start the connection again",
            )
        async with self._sessions() as session, session.begin():
            row = await session.get(OAuthState, state)
            if row is not None:
                await session.delete(row)
        if row is not None and row.expires_at.tzinfo is None:
            row.expires_at = row.expires_at.replace(tzinfo=datetime.UTC)  # SQLite returns naive UTC
        if row is None or row.expires_at < utcnow() or row.integration not in self.providers:
            raise _invalid(
                "OAUTH2_STATE_INVALID",
                "Unknown or expired OAuth2 state; start the connection again",
            )
        return row

    def _verifier(self, row: OAuthState) -> str:
        """The PKCE verifier stored with `row`; OAUTH2_STATE_INVALID when the key changed between
        initiate and complete (see KEY_CHANGED_HINT)."""
        try:
            verifier: str = self._box.decrypt(row.encrypted_verifier)["verifier"]
        except SecretBoxError:
            log.warning(
                f"stored OAuth2 state cannot be decrypted: {KEY_CHANGED_HINT}",
                extra={"fields": {"integration": row.integration, "org_id": row.org_id}},
            )
            raise _invalid(
                "OAUTH2_STATE_INVALID",
                "The OAuth2 state cannot be read; start the connection again",
            ) from None
        return verifier

    async def _exchange(
        self, provider: OAuth2Provider, row: OAuthState, code: str, verifier: str
    ) -> dict[str, Any]:
        """Exchange `code` at the provider's token endpoint (with the PKCE verifier when the flow
        has one); the token response, which has an `access_token`. OAUTH2_EXCHANGE_FAILED when the
        endpoint refuses or cannot be reached."""
        grant = {"code": code, "redirect_uri": row.redirect_uri}
        if verifier:
            grant["code_verifier"] = verifier
        try:
            return await request_tokens(provider, self._timeout_s, grant)
        except TokenEndpointError as exc:
            why = (
                f"status {exc.status}"
                if exc.status is not None
                else "its token endpoint could not be reached"
            )
            log.warning(
                "oauth2 token exchange failed",
                extra={
                    "fields": {
                        "integration": provider.name,
                        "status": exc.status,
                        "error": exc.error,
                    }
                },
            )
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "OAUTH2_EXCHANGE_FAILED",
                f"The authorization server did not issue a token ({why}); start the connection "
                "again",
                domain=TOOLS_DOMAIN,
            ) from None
