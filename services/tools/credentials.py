"""An organization's credentials: create, list, read, delete, pick the default, resolve.

Secrets are encrypted at rest (crypto.SecretBox) and
decrypted only by `resolve` when an action runs; everything else returns metadata
(`CredentialInfo`), with a masked form at most. Every read is scoped by organization:
another organization's credential is NOT_FOUND, the same as an absent one. The first
credential of an integration becomes its default; deleting the default promotes the
newest remaining one. An `oauth2` credential whose refresh was refused `needs_reconnect`
(oauth_refresh.py): its metadata says so, and connecting the integration again clears it.
"""

from __future__ import annotations

import builtins
import datetime
import logging
from typing import TYPE_CHECKING, Any

import grpc
from jsonschema import Draft202012Validator
from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.common import db
from services.common.errors import TOOLS_DOMAIN, RpcError
from services.common.ids import is_row_id
from services.common.validation import schema_errors
from services.tools.catalogue import AUTH_TYPES, Catalogue
from services.tools.credential_cache import MISS, OrgReadCache
from services.tools.credential_info import CredentialInfo
from services.tools.crypto import (
    KEY_CHANGED_HINT,
    SecretBox,
    SecretBoxError,
    mask_secret,
)
from services.tools.mcp_servers import MCP_AUTH_TYPE
from services.tools.models import Credential, OAuthState, new_id, utcnow

if TYPE_CHECKING:
    from services.tools.oauth_refresh import TokenRefresher

log = logging.getLogger(__name__)


def _not_found(credential_id: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.NOT_FOUND,
        "CREDENTIAL_NOT_FOUND",
        "Credential not found",
        domain=TOOLS_DOMAIN,
        metadata={"credential_id": credential_id},
    )


#: The auth types a stored credential can have: an integration's secret types, and MCP servers'.
# The field that names an auth type when a credential is created without one (the SDK's rule).
_TYPE_FIELDS = (
    ("api_key", "api_key"),
    ("token", "bearer"),
    ("bearer_token", "bearer"),
    ("access_token", "oauth2"),
)


def inferred_auth_type(secret_types: list[str], auth_data: dict[str, Any]) -> str:
    """The auth type of a credential created without one: the integration's only secret type,
    else the one `auth_data`'s fields name (`api_key`, `token`, `access_token`) if the
    integration takes it, else its first; "" when it takes none."""
    if len(secret_types) > 1:
        for field_name, auth_type in _TYPE_FIELDS:
            if field_name in auth_data and auth_type in secret_types:
                return auth_type
    return secret_types[0] if secret_types else ""


STORED_AUTH_TYPES = (*(t for t in AUTH_TYPES if t != "none"), MCP_AUTH_TYPE)


def _invalid(reason: str, message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=TOOLS_DOMAIN)


async def _lock_defaults(session: Any, org_id: str, integration_name: str) -> None:
    """Serialize the transactions that change which credential is an integration's default
    (create, set-default, delete) for one organization and integration, until the transaction
    ends, so that each reads the defaults the one before it left. PostgreSQL: an advisory
    transaction lock. SQLite: a write that matches no row, which starts the transaction as a
    write transaction on the latest data (SQLite's one writer; the driver would otherwise run
    the reads before it outside any transaction). Without it, two creates with make_default
    sent together would each see the defaults as they were and make one: a unique violation of
    uq_credentials_one_default, or a deadlock."""
    if session.bind.dialect.name == "postgresql":
        await session.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
            {"key": f"loopline-credential-default\n{org_id}\n{integration_name}"},
        )
    else:
        await session.execute(text("UPDATE credentials SET is_default = is_default WHERE 0"))


class CredentialStore:
    """Credentials in the tools database.

    Args:
        sessions: the service's session factory.
        box: the SecretBox that encrypts and decrypts secrets.
        catalogue: integrations, to validate integration names, auth types and secret fields.
        cache_ttl_s: seconds `connected_integrations` and `of_auth_type` results are reused
            by this process (see OrgReadCache; writes through this store invalidate at once;
            0 = no cache, the default here; the server passes
            LOOPLINE_TOOLS_CREDENTIAL_CACHE_TTL_S).
    """

    def __init__(
        self,
        sessions: async_sessionmaker,
        box: SecretBox,
        catalogue: Catalogue,
        cache_ttl_s: float = 0.0,
    ) -> None:
        self._sessions = sessions
        self._box = box
        self._catalogue = catalogue
        self.cache = OrgReadCache(cache_ttl_s)
        # Renews expiring oauth2 credentials before an action runs (set by the server; None: never).
        self.refresher: TokenRefresher | None = None

    async def create(
        self,
        org_id: str,
        integration_name: str,
        auth_type: str,
        auth_data: dict[str, Any],
        display_name: str = "",
        metadata: dict[str, Any] | None = None,
        make_default: bool = False,
        created_by: str = "",
    ) -> CredentialInfo:
        """Store a credential and return its metadata (`created_by`: the creating user's id, or "").

        Raises RpcError INVALID_ARGUMENT (reasons INTEGRATION_NOT_FOUND, AUTH_TYPE_NOT_SUPPORTED,
        INVALID_AUTH_DATA, ORGANIZATION_REQUIRED). INVALID_AUTH_DATA messages come from
        validation.schema_errors: they name missing and unexpected fields and the broken
        rule ("auth_data is invalid: auth_data: 'dsn' is required"), never a value.
        """
        if not org_id:
            raise _invalid("ORGANIZATION_REQUIRED", "organization_id is required")
        integration = self._catalogue.get(integration_name)
        if integration is None:
            raise _invalid("INTEGRATION_NOT_FOUND", f"Unknown integration {integration_name!r}")
        secret_types = [o.type for o in integration.auth_options if o.type != "none"]
        auth_type = auth_type or inferred_auth_type(secret_types, auth_data)
        option = integration.auth_option(auth_type)
        if option is None or auth_type == "none":
            raise _invalid(
                "AUTH_TYPE_NOT_SUPPORTED",
                f"Integration {integration_name!r} takes auth types {secret_types}, "
                f"not {auth_type!r}"
                if secret_types
                # not "takes auth types [], not ''": the integration needs no credential
                else f"Integration {integration_name!r} needs no credential: "
                "it is connected without one",
            )
        if option.fields is not None:
            # Names the fields and the rules (e.g. "auth_data: 'dsn' is required"), never a value:
            # it is a secret.
            problems = schema_errors(Draft202012Validator(option.fields), auth_data, "auth_data")
            if problems:
                raise _invalid("INVALID_AUTH_DATA", "auth_data is invalid: " + problems)
        now = utcnow()
        row = Credential(
            id=new_id(),
            org_id=org_id,
            integration=integration_name,
            auth_type=auth_type,
            display_name=display_name or f"{integration.display_name} credential",
            is_default=False,
            encrypted_secret=self._box.encrypt(auth_data),
            masked_secret=mask_secret(auth_data),
            metadata_json=metadata or {},
            created_by=created_by or None,
            created_at=now,
            updated_at=now,
        )
        return await self._insert(row, make_default)

    async def rotate_secrets(self, page_size: int = 500) -> tuple[int, list[str], int]:
        """Encrypt every stored secret again with the first key (`SecretBox.rotate`): credentials'
        secrets and pending OAuth2 flows' PKCE verifiers.

        The last step of changing LOOPLINE_TOOLS_CREDENTIAL_KEY: with NEW,OLD configured, this
        rewrites what OLD encrypted, after which OLD can be dropped. A row the first key alone
        already decrypts (`SecretBox.is_current`) is skipped, so running it again rewrites
        nothing and the counts are of rows actually rewritten. Each row is written only if
        its ciphertext is still the one read (a concurrent write is never overwritten; it is
        encrypted with the first key anyway). Returns (credentials rewritten, ids of credentials
        that no configured key decrypts, left as they are, pending OAuth2 flows rewritten; one
        no key decrypts is left to expire). Never logs or returns a secret.
        """
        rotated, undecryptable = await self._rotate(
            Credential.id, Credential.encrypted_secret, page_size
        )
        flows, _ = await self._rotate(OAuthState.state, OAuthState.encrypted_verifier, page_size)
        return rotated, undecryptable, flows

    async def _rotate(self, key: Any, token_column: Any, page_size: int) -> tuple[int, list[str]]:
        """`rotate_secrets` over one table: (rows rewritten, keys of rows no configured key
        decrypts)."""
        table = key.class_
        rotated, undecryptable = 0, []
        after = ""
        while True:
            async with self._sessions() as session:
                rows = (
                    await session.execute(
                        select(key, token_column).where(key > after).order_by(key).limit(page_size)
                    )
                ).all()
            if not rows:
                break
            after = rows[-1][0]
            for row_key, token in rows:
                if self._box.is_current(token):
                    continue  # already under the first key: nothing to rewrite
                try:
                    fresh = self._box.rotate(token)
                except SecretBoxError:
                    undecryptable.append(row_key)
                    continue
                async with self._sessions() as session, session.begin():
                    result = await session.execute(
                        update(table)
                        .where(key == row_key, token_column == token)
                        .values({token_column.key: fresh})
                    )
                rotated += result.rowcount
        return rotated, undecryptable

    async def list(
        self,
        org_id: str,
        integration_name: str = "",
        auth_type: str = "",
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[CredentialInfo], int]:
        """The organization's credentials matching the filters, newest first, and their total count.

        An `auth_type` filter that no credential can have (not in STORED_AUTH_TYPES) raises
        RpcError INVALID_ARGUMENT AUTH_TYPE_UNKNOWN (a typo would otherwise list nothing, as if
        the organization had no such credentials); an unknown `integration_name` lists nothing.
        """
        if auth_type and auth_type not in STORED_AUTH_TYPES:
            raise _invalid(
                "AUTH_TYPE_UNKNOWN", f"auth_type must be one of {', '.join(STORED_AUTH_TYPES)}"
            )
        conditions = [Credential.org_id == org_id]
        if integration_name:
            conditions.append(Credential.integration == integration_name)
        if auth_type:
            conditions.append(Credential.auth_type == auth_type)
        async with self._sessions() as session:
            total = await session.scalar(
                select(func.count()).select_from(Credential).where(*conditions)
            )
            rows = (
                await session.scalars(
                    select(Credential)
                    .where(*conditions)
                    .order_by(Credential.created_at.desc(), Credential.id)
                    .limit(limit)
                    .offset(offset)
                )
            ).all()
        return [CredentialInfo.of(r) for r in rows], int(total or 0)

    async def get(self, org_id: str, credential_id: str) -> CredentialInfo:
        """One credential of the organization. Raises RpcError NOT_FOUND (absent, another org's, or
        an id that cannot be ours, `is_row_id`: not looked up)."""
        if not is_row_id(credential_id):
            raise _not_found(credential_id)
        async with self._sessions() as session:
            row = await session.get(Credential, credential_id)
        if row is None or row.org_id != org_id:
            raise _not_found(credential_id)
        return CredentialInfo.of(row)

    async def delete(self, org_id: str, credential_id: str) -> str:
        """Delete one credential; returns the id of the promoted new default ("" if none).

        Raises RpcError NOT_FOUND (absent, another org's, or an id that cannot be ours,
        `is_row_id`)."""
        if not is_row_id(credential_id):
            raise _not_found(credential_id)
        promoted = ""
        async with self._sessions() as session, session.begin():
            row = await session.get(Credential, credential_id)
            if row is None or row.org_id != org_id:
                raise _not_found(credential_id)
            await _lock_defaults(session, org_id, row.integration)
            await session.refresh(row)  # as the last change of the defaults left it
            was_default = row.is_default
            await session.delete(row)
            await session.flush()
            if was_default:
                successor = await session.scalar(
                    select(Credential)
                    .where(Credential.org_id == org_id, Credential.integration == row.integration)
                    .order_by(Credential.created_at.desc(), Credential.id)
                    .limit(1)
                )
                if successor is not None:
                    successor.is_default = True
                    successor.updated_at = utcnow()
                    promoted = successor.id
        self.cache.invalidate(org_id)
        log.info(
            "credential deleted",
            extra={"fields": {"credential_id": credential_id, "org_id": org_id}},
        )
        return promoted

    async def set_default(self, org_id: str, credential_id: str) -> CredentialInfo:
        """Make one credential its integration's default. Raises RpcError NOT_FOUND (also for an id
        that cannot be ours, `is_row_id`)."""
        if not is_row_id(credential_id):
            raise _not_found(credential_id)
        async with self._sessions() as session, session.begin():
            row = await session.get(Credential, credential_id)
            if row is None or row.org_id != org_id:
                raise _not_found(credential_id)
            await _lock_defaults(session, org_id, row.integration)
            await session.execute(
                update(Credential)
                .where(
                    Credential.org_id == org_id,
                    Credential.integration == row.integration,
                    Credential.id != row.id,
                )
                .values(is_default=False)
            )
            await session.flush()
            row.is_default = True
            row.updated_at = utcnow()
        self.cache.invalidate(org_id)
        return CredentialInfo.of(row)

    async def create_raw(
        self,
        org_id: str,
        integration_name: str,
        auth_type: str,
        secret: dict[str, Any],
        display_name: str,
        metadata: dict[str, Any] | None = None,
        make_default: bool = False,
        discovery: builtins.list[dict[str, Any]] | None = None,
        created_by: str = "",
    ) -> CredentialInfo:
        """Store a credential for an integration outside the static catalogue (MCP servers, OAuth2
        tokens); `created_by` is the creating user's id, or "".

        The caller has validated `secret`; it is encrypted like any other. `discovery`
        (MCP servers) is stored with the discovery time. The first credential of an
        integration, or one with `make_default`, becomes its default.
        """
        now = utcnow()
        row = Credential(
            id=new_id(),
            org_id=org_id,
            integration=integration_name,
            auth_type=auth_type,
            display_name=display_name,
            is_default=False,
            encrypted_secret=self._box.encrypt(secret),
            masked_secret=mask_secret(secret),
            metadata_json=metadata or {},
            discovery=discovery,
            discovered_at=now if discovery is not None else None,
            created_by=created_by or None,
            created_at=now,
            updated_at=now,
        )
        return await self._insert(row, make_default)

    async def integration_taken(self, org_id: str, integration_name: str) -> bool:
        """Whether the organization has a credential for `integration_name`."""
        async with self._sessions() as session:
            found = await session.scalar(
                select(Credential.id)
                .where(Credential.org_id == org_id, Credential.integration == integration_name)
                .limit(1)
            )
        return found is not None

    async def of_auth_type(
        self, org_id: str, auth_type: str, *, fresh: bool = False
    ) -> builtins.list[tuple[CredentialInfo, builtins.list[dict[str, Any]]]]:
        """The organization's credentials of `auth_type` (oldest first), each with its stored
        discovery ([] if none).

        Served from the per-process cache (OrgReadCache) unless `fresh`; a fresh read refills it.
        """
        key = ("of_auth_type", auth_type)
        if not fresh:
            cached = self.cache.get(org_id, key)
            if cached is not MISS:
                return [(info, list(tools)) for info, tools in cached]
        generation = self.cache.generation
        async with self._sessions() as session:
            rows = (
                await session.scalars(
                    select(Credential)
                    .where(Credential.org_id == org_id, Credential.auth_type == auth_type)
                    .order_by(Credential.created_at, Credential.id)
                )
            ).all()
        found = [(CredentialInfo.of(r), list(r.discovery or [])) for r in rows]
        self.cache.put(
            org_id, key, tuple((info, tuple(tools)) for info, tools in found), generation
        )
        return found

    async def discovery(
        self, org_id: str, credential_id: str, auth_type: str, *, secret: bool = True
    ) -> tuple[
        CredentialInfo,
        builtins.list[dict[str, Any]] | None,
        datetime.datetime | None,
        dict[str, Any],
    ]:
        """(metadata, discovered tools or None, discovery time or None, decrypted secret) of one
        credential; with `secret=False` the secret is not decrypted ({} in its place).

        Raises RpcError NOT_FOUND when it is absent or another organization's, INVALID_ARGUMENT
        WRONG_CREDENTIAL_KIND when it is the organization's but not of `auth_type` (not NOT_FOUND,
        which would deny a credential that exists);
        crypto.SecretBoxError (logged, see `_decrypt`) when its secret is asked for and cannot be
        decrypted. NOT_FOUND without a query for an id that cannot be ours (`is_row_id`)."""
        if not is_row_id(credential_id):
            raise _not_found(credential_id)
        async with self._sessions() as session:
            row = await session.get(Credential, credential_id)
        if row is None or row.org_id != org_id:
            raise _not_found(credential_id)
        if row.auth_type != auth_type:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "WRONG_CREDENTIAL_KIND",
                f"Credential {credential_id} has auth type {row.auth_type}, not {auth_type}: "
                "it is not an MCP server's",
                domain=TOOLS_DOMAIN,
                metadata={"credential_id": credential_id, "auth_type": row.auth_type},
            )
        when = db.utc(row.discovered_at) if row.discovered_at else None
        return CredentialInfo.of(row), row.discovery, when, self._decrypt(row) if secret else {}

    async def set_discovery(
        self, org_id: str, credential_id: str, tools: builtins.list[dict[str, Any]]
    ) -> datetime.datetime:
        """Store the tools discovered on an MCP server credential; returns the discovery time.
        Raises NOT_FOUND (also for an id that cannot be ours, `is_row_id`)."""
        if not is_row_id(credential_id):
            raise _not_found(credential_id)
        now = utcnow()
        async with self._sessions() as session, session.begin():
            row = await session.get(Credential, credential_id)
            if row is None or row.org_id != org_id:
                raise _not_found(credential_id)
            row.discovery = tools
            row.discovered_at = now
            row.updated_at = now
        self.cache.invalidate(org_id)
        return now

    async def connected_integrations(self, org_id: str) -> set[str]:
        """Names of the integrations the organization has at least one credential for (cached:
        OrgReadCache)."""
        cached = self.cache.get(org_id, "connected")
        if cached is not MISS:
            return set(cached)
        generation = self.cache.generation
        async with self._sessions() as session:
            rows = await session.scalars(
                select(Credential.integration).where(Credential.org_id == org_id).distinct()
            )
            names = set(rows.all())
        self.cache.put(org_id, "connected", frozenset(names), generation)
        return names

    async def _insert(self, row: Credential, make_default: bool) -> CredentialInfo:
        """Store a new credential row; it becomes the default of its integration when asked, or
        when the organization has none for that integration yet (then the old default is cleared).

        Under `_lock_defaults`: a create sent beside another sees the other's default."""
        org_id, integration_name = row.org_id, row.integration
        async with self._sessions() as session, session.begin():
            await _lock_defaults(session, org_id, integration_name)
            existing_default = await session.scalar(
                select(Credential.id).where(
                    Credential.org_id == org_id,
                    Credential.integration == integration_name,
                    Credential.is_default,
                )
            )
            if make_default and existing_default:
                await session.execute(
                    update(Credential)
                    .where(Credential.org_id == org_id, Credential.integration == integration_name)
                    .values(is_default=False)
                )
            row.is_default = make_default or existing_default is None
            session.add(row)
        self.cache.invalidate(org_id)
        log.info(
            "credential created",
            extra={
                "fields": {
                    "credential_id": row.id,
                    "org_id": org_id,
                    "integration": integration_name,
                }
            },
        )
        return CredentialInfo.of(row)

    async def resolve(
        self, org_id: str, integration_name: str, credential_id: str | None
    ) -> tuple[CredentialInfo, dict[str, Any]] | None:
        """The credential an action runs with, and its decrypted secret.

        `credential_id` given: that credential, which must belong to `org_id` and be for
        `integration_name` (else None; None without a query for an id that cannot be ours,
        `is_row_id`). Not given: the integration's default, else its newest credential, else None.
        Raises crypto.SecretBoxError when the secret cannot be decrypted with the configured keys
        (logged once, see `_decrypt`)."""
        if credential_id and not is_row_id(credential_id):
            return None
        async with self._sessions() as session:
            if credential_id:
                row = await session.get(Credential, credential_id)
                if row is None or row.org_id != org_id or row.integration != integration_name:
                    return None
            else:
                row = await session.scalar(
                    select(Credential)
                    .where(Credential.org_id == org_id, Credential.integration == integration_name)
                    .order_by(
                        Credential.is_default.desc(), Credential.created_at.desc(), Credential.id
                    )
                    .limit(1)
                )
                if row is None:
                    return None
        return CredentialInfo.of(row), self._decrypt(row)

    def _decrypt(self, row: Credential) -> dict[str, Any]:
        """The decrypted secret of `row`.

        Raises crypto.SecretBoxError when no configured key decrypts it, after logging one
        WARNING for the operator: the credential id, integration and organization, and the
        hint that LOOPLINE_TOOLS_CREDENTIAL_KEY changed. Never the secret or its ciphertext.
        """
        try:
            return self._box.decrypt(row.encrypted_secret)
        except SecretBoxError:
            log.warning(
                f"stored credential cannot be decrypted: {KEY_CHANGED_HINT}",
                extra={
                    "fields": {
                        "credential_id": row.id,
                        "integration": row.integration,
                        "org_id": row.org_id,
                        "auth_type": row.auth_type,
                    }
                },
            )
            raise
