"""The turn's hot-path transactions: start a turn, load a thread, end a run, archive its events.

Each is one synchronous function over a Core `Connection`, run by
`services.common.txn.TxnRunner` on SQLite (one thread hop per transaction), with statements
built once at import. On PostgreSQL each is one SQL statement (data-modifying CTEs) sent
straight on asyncpg by `PgTurnStatements` (store_pg.py): one round trip per transaction,
without SQLAlchemy's `run_sync` greenlet bridge, pool pre-ping and BEGIN/COMMIT round trips
(docs/performance.md). A run writes its thread messages, its status, its interrupt row and
the chat's `running_id` in one transaction when it ends (`finish`), before its
terminal event is published (the ordering rule of loop.py), so a turn is three
transactions: `persist_turn`, `finish`, `archive` (docs/performance.md).

Durability trade-off (README "Decisions"): the messages a run produces are kept in the
run's memory until it ends. A process that dies mid-run loses that run's unfinished
assistant/tool messages, never the user message or the run row; the crash reaper then
fails the run (recovery.py) and the thread stays valid for the next turn.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import QueuePool

from services.common import db
from services.common.txn import TxnRunner
from services.orchestrator.models import (
    BillingRedelivery,
    Chat,
    Interrupt,
    Message,
    Run,
    RunEvent,
    utcnow,
)

# the declarative models' tables (typed as the Table each is)
_chats = cast(Table, Chat.__table__)
_messages = cast(Table, Message.__table__)
_runs = cast(Table, Run.__table__)
_events = cast(Table, RunEvent.__table__)
_interrupts = cast(Table, Interrupt.__table__)
_redeliveries = cast(Table, BillingRedelivery.__table__)


@dataclass(slots=True)
class ThreadRow:
    """One thread entry in memory, shaped like a `messages` row (see models.Message).

    `seq` is None until the row is stored; `thread.to_model_messages` reads role, content
    and extra, `thread.choose_cut` reads role and seq.
    """

    role: str
    content: Any
    extra: dict[str, Any] | None = None
    chat_id: str = ""
    run_id: str | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    created_at: datetime.datetime = field(default_factory=utcnow)
    seq: int | None = None

    def values(self) -> dict[str, Any]:
        """The row as INSERT parameters (seq is assigned by the database)."""
        return {
            "id": self.id,
            "chat_id": self.chat_id,
            "run_id": self.run_id,
            "role": self.role,
            "content": self.content,
            "extra": self.extra,
            "created_at": self.created_at,
        }


@dataclass(slots=True)
class RunEnd:
    """What `finish` writes when a run ends.

    Args:
        run_id, chat_id: the run and its chat.
        status: completed, interrupted, cancelled or failed (runs.status).
        error: the sanitized failure message or None.
        usage: {input_tokens, output_tokens, total_tokens, llm_calls} (runs.usage).
        rows: the run's thread messages not stored yet, in order.
        interrupt: the HITL audit row's values when the run paused on a question (outcome pending).
        events: (seq, payload) of the run's whole event stream, its terminal events included, to
            archive in the same transaction (an event log that dies with the process: the run's
            end and its stream are stored together, before the end is published); empty when
            the events are archived after the end (Redis Streams keep them meanwhile): the run
            is then stored with `archive_due` set, which the archive clears (models.Run).
        billing_calls: `billing_redeliveries` rows (`Redelivery.row`) of the run's usage records
            still on their way to billing (`UsageBatcher.take`), stored with its end.
    """

    run_id: str
    chat_id: str
    status: str
    error: str | None
    usage: dict[str, int]
    rows: list[ThreadRow]
    interrupt: dict[str, Any] | None = None
    events: list[tuple[int, bytes]] = field(default_factory=list)
    billing_calls: list[dict[str, Any]] = field(default_factory=list)


class ClaimLost(Exception):
    """The chat was taken (running_id set or deleted) between the guard and the write."""


class RunTakenOver(Exception):
    """The run's end was not stored: the run is no longer `running` in the database, another
    replica ended it (its lease lapsed while this process was stalled or cut off; recovery.py
    `take_over`) or its chat was deleted. Nothing of the end was written; this process must not
    publish it (one terminal outcome per run)."""


# a SQLite transaction writing more rows than this stays on the worker thread (txn.py: inline)
INLINE_ROWS = 64

_INSERT_MESSAGE = insert(_messages)
_INSERT_CHAT = insert(_chats)
_INSERT_RUN = insert(_runs)
_INSERT_INTERRUPT = insert(_interrupts)
_INSERT_REDELIVERY = insert(_redeliveries)
_DELETE_REDELIVERY = delete(_redeliveries).where(_redeliveries.c.id == bindparam("b_id"))
_CLAIM_CHAT = (
    update(_chats)
    .where(
        _chats.c.id == bindparam("b_chat_id"),
        _chats.c.running_id.is_(None),
        _chats.c.deleted_at.is_(None),
    )
    .values(running_id=bindparam("b_run_id"), updated_at=bindparam("b_now"))
)
_SELECT_THREAD = (
    select(
        _messages.c.seq,
        _messages.c.id,
        _messages.c.role,
        _messages.c.content,
        _messages.c.extra,
        _messages.c.run_id,
        _messages.c.created_at,
    )
    .where(_messages.c.chat_id == bindparam("b_chat_id"))
    .order_by(_messages.c.seq)
)
_END_RUN = (  # only while the run is ours: `running` (RunTakenOver otherwise)
    update(_runs)
    .where(_runs.c.id == bindparam("b_run_id"), _runs.c.status == "running")
    .values(
        status=bindparam("b_status"),
        updated_at=bindparam("b_now"),
        error=bindparam("b_error"),
        usage=bindparam("b_usage"),
        archive_due=bindparam("b_archive_due"),
    )
)
# the run's log holds its end and is archived: nothing due (`TurnStore.archive`)
_ARCHIVED = (
    update(_runs)
    .where(_runs.c.id == bindparam("b_run_id"), _runs.c.archive_due.is_not(None))
    .values(archive_due=None)
)
_TOUCH_CHAT = (
    update(_chats)
    .where(_chats.c.id == bindparam("b_chat_id"))
    .values(updated_at=bindparam("b_now"))
)
_FREE_CHAT = (
    update(_chats)
    .where(_chats.c.id == bindparam("b_chat_id"), _chats.c.running_id == bindparam("b_run_id"))
    .values(running_id=None, updated_at=bindparam("b_now"))
)
_CANCEL_INTERRUPTS = (
    update(_interrupts)
    .where(_interrupts.c.run_id == bindparam("b_run_id"), _interrupts.c.outcome == "pending")
    .values(outcome="cancelled", resolved_at=bindparam("b_now"))
)
_UNWIND_MESSAGE = delete(_messages).where(
    _messages.c.run_id == bindparam("b_run_id"), _messages.c.role == "user"
)
_UNWIND_RUN = delete(_runs).where(_runs.c.id == bindparam("b_run_id"))
_UNWIND_CHAT = delete(_chats).where(_chats.c.id == bindparam("b_chat_id"))
_RUN_FOR_REQUEST = (
    select(_runs.c.chat_id, _runs.c.id)
    .where(
        _runs.c.request_id == bindparam("b_request_id"),
        _runs.c.organization_id == bindparam("b_org_id"),
        _runs.c.created_at >= bindparam("b_since"),
    )
    .order_by(_runs.c.created_at.desc())
    .limit(1)
)
_STREAM_TARGET = (
    select(
        _chats.c.organization_id,
        _chats.c.kind,
        _chats.c.deleted_at,
        _runs.c.chat_id.label("run_chat_id"),
    )
    .select_from(
        _chats.outerjoin(
            _runs, and_(_runs.c.id == bindparam("b_run_id"), _runs.c.chat_id == _chats.c.id)
        )
    )
    .where(_chats.c.id == bindparam("b_chat_id"))
)
_TURN_GUARD = (
    select(
        _chats.c.organization_id,
        _chats.c.kind,
        _chats.c.deleted_at,
        _chats.c.running_id,
        _interrupts.c.id.label("pending_id"),
    )
    .select_from(
        _chats.outerjoin(
            _interrupts,
            and_(_interrupts.c.chat_id == _chats.c.id, _interrupts.c.outcome == "pending"),
        )
    )
    .where(_chats.c.id == bindparam("b_chat_id"))
)


def _persist_turn(
    conn: Connection,
    claim: bool,
    chat: dict[str, Any] | None,
    message: ThreadRow,
    run: dict[str, Any],
    charge: dict[str, Any] | None,
) -> None:
    if claim:
        result = conn.execute(
            _CLAIM_CHAT,
            {"b_chat_id": message.chat_id, "b_run_id": run["id"], "b_now": message.created_at},
        )
        if result.rowcount != 1:
            raise ClaimLost(message.chat_id)
    else:
        assert chat is not None
        conn.execute(_INSERT_CHAT, chat)
    conn.execute(_INSERT_MESSAGE, message.values())
    conn.execute(_INSERT_RUN, run)
    if charge is not None:
        conn.execute(_INSERT_REDELIVERY, charge)


def _unwind_turn(
    conn: Connection, chat_id: str, run_id: str, new_chat: bool, charge_id: str
) -> None:
    conn.execute(_DELETE_REDELIVERY, {"b_id": charge_id})
    conn.execute(_UNWIND_MESSAGE, {"b_run_id": run_id})
    conn.execute(_UNWIND_RUN, {"b_run_id": run_id})
    if new_chat:
        conn.execute(_UNWIND_CHAT, {"b_chat_id": chat_id})
    else:
        conn.execute(_FREE_CHAT, {"b_chat_id": chat_id, "b_run_id": run_id, "b_now": utcnow()})


def _run_for_request(
    conn: Connection, organization_id: str, request_id: str, since: datetime.datetime
) -> Any:
    return conn.execute(
        _RUN_FOR_REQUEST,
        {"b_request_id": request_id, "b_org_id": organization_id, "b_since": since},
    ).first()


def _load_thread(conn: Connection, chat_id: str) -> list[ThreadRow]:
    return [
        ThreadRow(
            role=r.role,
            content=r.content,
            extra=r.extra,
            chat_id=chat_id,
            run_id=r.run_id,
            id=r.id,
            created_at=r.created_at,
            seq=r.seq,
        )
        for r in conn.execute(_SELECT_THREAD, {"b_chat_id": chat_id})
    ]


def _store_rows(conn: Connection, rows: Sequence[ThreadRow]) -> None:
    if rows:  # one executemany, in order: seq follows the thread
        conn.execute(_INSERT_MESSAGE, [row.values() for row in rows])


def _finish(conn: Connection, end: RunEnd) -> None:
    now = utcnow()
    ended = conn.execute(
        _END_RUN,
        {
            "b_run_id": end.run_id,
            "b_status": end.status,
            "b_now": now,
            "b_error": end.error,
            "b_usage": end.usage,
            "b_archive_due": None if end.events else now,
        },
    )
    if ended.rowcount != 1:  # raising rolls this transaction (its savepoint) back: nothing written
        raise RunTakenOver(end.run_id)
    if end.interrupt is not None:
        conn.execute(_INSERT_INTERRUPT, end.interrupt)
    _store_rows(conn, end.rows)
    if end.events:
        TurnStore._archive_rows(conn, end.run_id, end.events)
    for call in end.billing_calls:
        conn.execute(_INSERT_REDELIVERY, call)
    if end.status == "interrupted":
        conn.execute(_TOUCH_CHAT, {"b_chat_id": end.chat_id, "b_now": now})
        return
    if end.status == "cancelled":
        conn.execute(_CANCEL_INTERRUPTS, {"b_run_id": end.run_id, "b_now": now})
    conn.execute(_FREE_CHAT, {"b_chat_id": end.chat_id, "b_run_id": end.run_id, "b_now": now})


def _forget_redeliveries(conn: Connection, ids: list[str]) -> None:
    conn.execute(_DELETE_REDELIVERY, [{"b_id": row_id} for row_id in ids])


def _turn_guard(conn: Connection, chat_id: str) -> Any:
    return conn.execute(_TURN_GUARD, {"b_chat_id": chat_id}).first()


def _stream_target(conn: Connection, chat_id: str, run_id: str) -> Any:
    return conn.execute(_STREAM_TARGET, {"b_chat_id": chat_id, "b_run_id": run_id}).first()


class TurnStore:
    """The orchestrator's hot-path transactions over its database (one `TxnRunner`).

    Args:
        engine: the orchestrator's async engine (SQLite or PostgreSQL).
    """

    def __init__(self, engine: AsyncEngine) -> None:
        if engine.dialect.name not in ("sqlite", "postgresql"):
            raise ValueError(
                f"unsupported database dialect {engine.dialect.name!r} (sqlite or postgresql)"
            )
        self.txn = TxnRunner(engine, thread_name="orchestrator-db")
        # PostgreSQL: each transaction is one statement on asyncpg (PgTurnStatements); imported
        # here, as store_pg.py imports this module's row types
        from services.orchestrator.store_pg import PgTurnStatements

        pool = cast(QueuePool, engine.pool)  # a PostgreSQL engine's pool is a queue pool
        self.pg = (
            PgTurnStatements(engine.url, max_size=pool.size(), timeout_s=pool.timeout())
            if self.txn.dialect == "postgresql"
            else None
        )

    async def persist_turn(
        self,
        *,
        claim: bool,
        chat: dict[str, Any] | None,
        message: ThreadRow,
        run: dict[str, Any],
        charge: dict[str, Any] | None = None,
    ) -> None:
        """Spec "Persist and charge", one transaction: the chat (a new row when `claim` is False,
        else a conditional `running_id` update), the user message, the run row and `charge`,
        the turn's run charge as a `billing_redeliveries` row (`RunCharges.row`; None: none).

        Raises ClaimLost when `claim` is True and the chat is running, deleted or gone (nothing
        written).
        """
        if self.pg is not None:
            return await self.pg.persist_turn(claim, chat, message, run, charge)
        await self.txn.run(_persist_turn, claim, chat, message, run, charge)

    async def unwind_turn(
        self, *, chat_id: str, run_id: str, new_chat: bool, charge_id: str
    ) -> None:
        """Undo `persist_turn` in one transaction: the stored run charge (row `charge_id`), the
        user message, the run, and the chat (a new one) or its `running_id`. It runs after a
        `persist_turn` of this store whose caller gave up on it (cancelled, failed on the way
        back): on SQLite both are jobs of one worker, in order, so a commit still on its way
        is undone rather than overtaken."""
        await self.txn.run(_unwind_turn, chat_id, run_id, new_chat, charge_id)

    async def run_for_request(
        self, organization_id: str, request_id: str, since: datetime.datetime
    ) -> tuple[str, str] | None:
        """(chat_id, run_id) of the newest run of `organization_id` started with `request_id`
        (StartTurnRequest.request_id) at or after `since` (UTC), or None. One read (every
        turn start with an Idempotency-Key makes it: on PostgreSQL on asyncpg, as turn_guard)."""
        if self.pg is not None:
            return await self.pg.run_for_request(organization_id, request_id, since)
        row = await self.txn.run(_run_for_request, organization_id, request_id, since)
        return None if row is None else (row[0], row[1])

    async def load_thread(self, chat_id: str) -> list[ThreadRow]:
        """Every stored message of the chat, oldest first (summaries and markers included)."""
        if self.pg is not None:
            return await self.pg.load_thread(chat_id)
        return await self.txn.run(_load_thread, chat_id, inline=False)  # a thread can be long

    async def store_rows(self, rows: Sequence[ThreadRow]) -> None:
        """Insert thread messages in one transaction, in order."""
        if self.pg is not None:
            return await self.pg.store_rows(list(rows))
        await self.txn.run(_store_rows, list(rows), inline=len(rows) <= INLINE_ROWS)

    async def finish(self, end: RunEnd) -> None:
        """One transaction at a run's end: its interrupt row (a pause), its unsaved thread messages,
        its status/error/usage, and the chat (`running_id` cleared, or only touched when paused; a
        cancel also flips a pending audit row to `cancelled`), `end.events` into the archive and
        `end.billing_calls` into `billing_redeliveries`. Only while the run is still `running`:
        RunTakenOver, with nothing written, otherwise."""
        if self.pg is not None:
            return await self.pg.finish(end)
        await self.txn.run(
            _finish,
            end,
            inline=len(end.rows) + len(end.events) + len(end.billing_calls) <= INLINE_ROWS,
        )

    async def forget_redeliveries(self, ids: list[str]) -> None:
        """Delete `billing_redeliveries` rows by id in one transaction (billing took them)."""
        if self.pg is not None:
            return await self.pg.forget_redeliveries(ids)
        await self.txn.run(_forget_redeliveries, ids, inline=len(ids) <= INLINE_ROWS)

    async def turn_guard(self, chat_id: str) -> Any:
        """(organization_id, kind, deleted_at, running_id, pending_id) of the chat, pending_id being
        a pending question's id or None; None when the chat does not exist. One read."""
        if self.pg is not None:
            return await self.pg.turn_guard(chat_id)
        return await self.txn.run(_turn_guard, chat_id)

    async def stream_target(self, chat_id: str, run_id: str) -> Any:
        """(organization_id, kind, deleted_at, run_chat_id) of the chat and the run if it belongs
        to it (run_chat_id None otherwise); None when the chat does not exist."""
        if self.pg is not None:
            return await self.pg.stream_target(chat_id, run_id)
        return await self.txn.run(_stream_target, chat_id, run_id)

    async def archive(
        self, run_id: str, events: Sequence[tuple[int, bytes]], *, settled: bool = True
    ) -> None:
        """Store (seq, payload) events of a run in one transaction; rows already stored (another
        replica) are kept. `settled`: the run's event log holds its end (every event is stored
        there), so its `archive_due` is cleared in the same transaction; False leaves it due."""
        if not events and not settled:
            return
        if self.pg is not None:
            return await self.pg.archive(run_id, events, settled)
        await self.txn.run(
            self._archive_and_settle,
            run_id,
            list(events),
            settled,
            inline=len(events) <= INLINE_ROWS,
        )

    @staticmethod
    def _archive_rows(conn: Connection, run_id: str, events: list[tuple[int, bytes]]) -> None:
        if events:  # one executemany
            conn.execute(
                db.insert_ignoring(conn.dialect.name, _events, ("run_id", "seq")),
                [{"run_id": run_id, "seq": seq, "payload": payload} for seq, payload in events],
            )

    @staticmethod
    def _archive_and_settle(
        conn: Connection, run_id: str, events: list[tuple[int, bytes]], settled: bool
    ) -> None:
        TurnStore._archive_rows(conn, run_id, events)
        if settled:
            conn.execute(_ARCHIVED, {"b_run_id": run_id})

    def close(self) -> None:
        """Stop the worker thread (SQLite) or close the asyncpg pool (PostgreSQL)."""
        self.txn.close()
        if self.pg is not None:
            self.pg.close()
