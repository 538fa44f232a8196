"""Idempotent POSTs with the `Idempotency-Key` header (Google AIP-155; the SDK sends it).

A retry with the same key and the same body returns the original response and starts
nothing; the same key with another body is 422; a retry while the first request is
still running is 409. Keys are scoped to (organization, user) and kept for
`idempotency_ttl_s` seconds (24 h by default); a refused request frees its key, one whose
outcome is unknown (a downstream deadline or outage) frees it for the same body only and
passes it down as the turn start's `request_id` (`release_unknown`, `request_id`). A claim
left without an answer for IN_PROGRESS_LEASE_S (the gateway handling it died: it cannot free
the key) is taken over by the next request with the same body, so a client can retry after a
crash instead of getting 409 "still in progress" for the whole TTL.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any, cast

import grpc
from fastapi import HTTPException
from sqlalchemy import CursorResult, delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common import db
from services.gateway.errors import BodyError
from services.gateway.models import IdempotencyRecord, utcnow

MAX_KEY_LENGTH = 255
#: Seconds after which a claim still without an answer is abandoned: longer than any request
#: the gateway serves may take (its longest downstream deadline is 120 s, MCP discovery).
IN_PROGRESS_LEASE_S = 300.0


class IdempotencyConflict(Exception):
    """The key cannot be used for this request: `status` (409 or 422) and a `detail`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def body_hash(route: str, body: bytes) -> str:
    """SHA-256 of the route and the canonical body."""
    return hashlib.sha256(route.encode() + b"\0" + body).hexdigest()


def request_id(org_id: str, user_id: str, key: str, digest: str) -> str:
    """The StartTurn request_id (AIP-155; 64 hex characters) of a POST with Idempotency-Key
    `key` and body digest `digest` (`body_hash`) by `user_id` of `org_id`: the same for every
    retry of that request, so the orchestrator answers a retry with the turn the first attempt
    started, when it did (its answer lost to a 504 or 503: `release_unknown`)."""
    return hashlib.sha256("\0".join((org_id, user_id, key, digest)).encode()).hexdigest()


#: gRPC codes of a downstream failure that settles nothing: the request was refused as it
#: stands, so its key is freed for any request (`IdempotencyStore.release`); any other
#: failure may have taken effect (`IdempotencyStore.release_unknown`).
REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def outcome_unknown(failure: BaseException) -> bool:
    """Whether a request that raised `failure` may have taken effect downstream: a gRPC failure
    other than a refusal (REFUSED_CODES: a deadline, an outage, a cancel), or anything that is
    not a gRPC failure nor an HTTP error of the gateway's own (HTTPException, BodyError: e.g. a
    saved default model the orchestrator refused) — a disconnect, a crash."""
    if isinstance(failure, grpc.aio.AioRpcError):
        return failure.code() not in REFUSED_CODES
    return not isinstance(failure, HTTPException | BodyError)


class IdempotencyStore:
    """Claims, completes and replays idempotency keys in the gateway database."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s

    async def claim(
        self, org_id: str, user_id: str, key: str, route: str, digest: str
    ) -> tuple[int, str] | None:
        """Claim `key`; returns None when claimed now, or the stored (status, body) to replay.

        Raises IdempotencyConflict(422) for another body, (409) while the first request runs
        (for IN_PROGRESS_LEASE_S at most: then the claim is taken over), and (400) for a key
        that is empty or longer than 255 characters.
        """
        if not key or len(key) > MAX_KEY_LENGTH:
            raise IdempotencyConflict(400, "Idempotency-Key must be 1 to 255 characters")
        cutoff = utcnow() - datetime.timedelta(seconds=self.ttl_s)
        for _ in range(2):
            async with self.sessions() as session, session.begin():
                row = await session.get(IdempotencyRecord, (org_id, user_id, key))
                if row is not None and db.utc(row.created_at) < cutoff:
                    await session.delete(row)
                    await session.flush()
                    row = None
                if row is None:
                    try:
                        session.add(
                            IdempotencyRecord(
                                organization_id=org_id,
                                user_id=user_id,
                                key=key,
                                route=route,
                                body_hash=digest,
                            )
                        )
                        await session.flush()
                        return None
                    except IntegrityError:
                        await session.rollback()
                        continue
                if row.route != route or row.body_hash != digest:
                    raise IdempotencyConflict(
                        422, "This Idempotency-Key was already used with a different request"
                    )
                if row.status_code is None:
                    abandoned = utcnow() - datetime.timedelta(seconds=IN_PROGRESS_LEASE_S)
                    # its gateway died: one retry takes it over
                    if db.utc(row.created_at) < abandoned:
                        # an UPDATE's result is a CursorResult, which counts its rows
                        taken = cast(
                            "CursorResult[Any]",
                            await session.execute(
                                update(IdempotencyRecord)
                                .where(
                                    IdempotencyRecord.organization_id == org_id,
                                    IdempotencyRecord.user_id == user_id,
                                    IdempotencyRecord.key == key,
                                    IdempotencyRecord.status_code.is_(None),
                                    IdempotencyRecord.created_at == row.created_at,
                                )
                                .values(created_at=utcnow())
                            ),
                        )
                        if taken.rowcount == 1:
                            return None
                    raise IdempotencyConflict(
                        409, "A request with this Idempotency-Key is still in progress"
                    )
                return row.status_code, row.response or ""
        raise IdempotencyConflict(409, "A request with this Idempotency-Key is still in progress")

    async def complete(self, org_id: str, user_id: str, key: str, status: int, body: str) -> None:
        """Store the response of a claimed key."""
        async with self.sessions() as session, session.begin():
            row = await session.get(IdempotencyRecord, (org_id, user_id, key))
            if row is not None:
                row.status_code, row.response = status, body

    async def release(self, org_id: str, user_id: str, key: str) -> None:
        """Free a claimed key whose request failed, so that it can be retried."""
        async with self.sessions() as session, session.begin():
            await session.execute(
                delete(IdempotencyRecord).where(
                    IdempotencyRecord.organization_id == org_id,
                    IdempotencyRecord.user_id == user_id,
                    IdempotencyRecord.key == key,
                    IdempotencyRecord.status_code.is_(None),
                )
            )

    async def release_unknown(self, org_id: str, user_id: str, key: str) -> None:
        """Free a claimed key whose request failed without the gateway knowing whether it took
        effect (a downstream deadline or outage, a disconnect: `outcome_unknown`), but keep it
        bound to its body: the next request with the same body takes it over at once (and the
        orchestrator answers it with the turn the first one started, if it did: `request_id`),
        another body gets 422. Its claim's start is moved back past IN_PROGRESS_LEASE_S, so the
        key is kept 5 minutes less than the TTL. Re-test: after a 504 the key was freed, and a
        retry with another body started and charged a second turn."""
        async with self.sessions() as session, session.begin():
            await session.execute(
                update(IdempotencyRecord)
                .where(
                    IdempotencyRecord.organization_id == org_id,
                    IdempotencyRecord.user_id == user_id,
                    IdempotencyRecord.key == key,
                    IdempotencyRecord.status_code.is_(None),
                )
                .values(created_at=utcnow() - datetime.timedelta(seconds=IN_PROGRESS_LEASE_S + 1))
            )

    async def sweep(self) -> int:
        """Delete records past the TTL; returns how many."""
        cutoff = utcnow() - datetime.timedelta(seconds=self.ttl_s)
        async with self.sessions() as session, session.begin():
            result = cast(
                "CursorResult[Any]",
                await session.execute(
                    delete(IdempotencyRecord).where(IdempotencyRecord.created_at < cutoff)
                ),
            )
            return result.rowcount or 0


__all__ = [
    "REFUSED_CODES",
    "IdempotencyConflict",
    "IdempotencyStore",
    "body_hash",
    "outcome_unknown",
    "request_id",
]
