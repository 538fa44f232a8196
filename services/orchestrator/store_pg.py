"""The turn's hot-path transactions on PostgreSQL (`PgTurnStatements`): each one SQL statement
sent straight on asyncpg, for `TurnStore` (store.py) when its database is PostgreSQL.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from services.common.pg import PgPool, loads, param, pg_type, record_type
from services.orchestrator.models import BillingRedelivery, Chat, Interrupt, Message, Run, utcnow
from services.orchestrator.store import ClaimLost, RunEnd, RunTakenOver, ThreadRow

_chats = Chat.__table__
_messages = Message.__table__
_runs = Run.__table__
_interrupts = Interrupt.__table__
_redeliveries = BillingRedelivery.__table__

_MESSAGE_COLUMNS = ("id", "chat_id", "run_id", "role", "content", "extra", "created_at")
# a run's archived events ($1 the run id; {seqs} and {payloads} the parameters of two arrays),
# rows already stored kept
_PG_ARCHIVE = (
    "INSERT INTO run_events (run_id, seq, payload) SELECT $1, s, p"
    " FROM unnest({seqs}::bigint[], {payloads}::bytea[])"
    " AS t(s, p){where} ON CONFLICT (run_id, seq) DO NOTHING"
)
_PG_ARCHIVE_RUN = _PG_ARCHIVE.format(seqs="$2", payloads="$3", where="")  # `archive`
# `archive` when settled
_PG_SETTLED = "UPDATE runs SET archive_due = NULL WHERE id = $1 AND archive_due IS NOT NULL"
# the run's thread rows as one INSERT ... SELECT FROM unnest(arrays) (seq is assigned in row order)
_PG_MESSAGES = (
    "INSERT INTO messages ({cols}) SELECT {cols} FROM unnest({arrays})"
    " WITH ORDINALITY AS t({cols}, n){where} ORDER BY n"
)


_GuardRow = record_type("organization_id", "kind", "deleted_at", "running_id", "pending_id")
_TargetRow = record_type("organization_id", "kind", "deleted_at", "run_chat_id")


class PgTurnStatements(PgPool):
    """The hot-path transactions of `TurnStore` on PostgreSQL, straight on asyncpg.

    Each transaction is one SQL statement (data-modifying CTEs; a single statement is atomic
    without BEGIN/COMMIT), sent on a connection of a small asyncpg pool of its own: one round
    trip per transaction, no SQLAlchemy compile/greenlet layer and no pool pre-ping (measured:
    ~5 ms of the orchestrator's ~24 ms CPU per turn went to `run_sync`, the greenlet bridge,
    checkout pings and BEGIN/COMMIT round trips; docs/performance.md), and no reset query when
    a connection goes back to the pool (`services.common.pg.no_reset`). asyncpg prepares and
    caches each statement per connection. JSON columns are sent as `json.dumps` text and
    read with `json.loads`, as SQLAlchemy's JSON type does (Python None is stored as JSON
    `null`), so rows written here read the same through the ORM.

    Args:
        url: the orchestrator's SQLAlchemy URL (`postgresql+asyncpg://...`).
        max_size: connections of the pool at most (statements hold one for one round trip).
    """

    # ------------------------------------------------------------------ statement text

    def _insert_values(
        self, table: Any, values: dict[str, Any], params: list[Any], select: bool
    ) -> tuple[str, str]:
        """(column list, value list) of an INSERT of `values` into `table`; appends the parameters.

        `select`: the values go in a SELECT list (each parameter cast to its column's type)."""
        cols, places = [], []
        for name, value in values.items():
            column = table.c[name]
            params.append(param(column, value))
            cols.append(name)
            places.append(f"${len(params)}::{pg_type(column)}" if select else f"${len(params)}")
        return ", ".join(cols), ", ".join(places)

    def _messages(self, rows: Sequence[ThreadRow], params: list[Any], where: str = "") -> str:
        """The `_PG_MESSAGES` statement for `rows` (appends its array parameters); `where`: a
        condition clause (" WHERE ...") the rows are inserted under."""
        arrays = []
        for name in _MESSAGE_COLUMNS:
            column = _messages.c[name]
            params.append([param(column, getattr(row, name)) for row in rows])
            arrays.append(f"${len(params)}::{pg_type(column)}[]")
        cols = ", ".join(_MESSAGE_COLUMNS)
        return _PG_MESSAGES.format(cols=cols, arrays=", ".join(arrays), where=where)

    # ------------------------------------------------------------------ transactions

    async def persist_turn(
        self,
        claim: bool,
        chat: dict[str, Any] | None,
        message: ThreadRow,
        run: dict[str, Any],
        charge: dict[str, Any] | None = None,
    ) -> None:
        """`TurnStore.persist_turn` as one statement; ClaimLost when the claim UPDATE matched
        nothing."""
        params: list[Any] = []
        message_values = message.values()
        if claim:
            params += [message.chat_id, run["id"], message.created_at]
            m_cols, m_vals = self._insert_values(_messages, message_values, params, select=True)
            r_cols, r_vals = self._insert_values(_runs, run, params, select=True)
            charged = ""
            if charge is not None:
                b_cols, b_vals = self._insert_values(_redeliveries, charge, params, select=True)
                charged = (
                    f", b AS (INSERT INTO billing_redeliveries ({b_cols}) SELECT {b_vals} FROM c)"
                )
            sql = (
                "WITH c AS (UPDATE chats SET running_id = $2, updated_at = $3"
                " WHERE id = $1 AND running_id IS NULL AND deleted_at IS NULL RETURNING id),"
                f" m AS (INSERT INTO messages ({m_cols}) SELECT {m_vals} FROM c),"
                f" r AS (INSERT INTO runs ({r_cols}) SELECT {r_vals} FROM c){charged}"
                " SELECT count(*) FROM c"
            )
            pool = await self.pool()
            if await pool.fetchval(sql, *params) != 1:
                raise ClaimLost(message.chat_id)
            return
        assert chat is not None
        c_cols, c_vals = self._insert_values(_chats, chat, params, select=False)
        m_cols, m_vals = self._insert_values(_messages, message_values, params, select=False)
        r_cols, r_vals = self._insert_values(_runs, run, params, select=False)
        charged = ""
        if charge is not None:
            b_cols, b_vals = self._insert_values(_redeliveries, charge, params, select=False)
            charged = f", b AS (INSERT INTO billing_redeliveries ({b_cols}) VALUES ({b_vals}))"
        sql = (
            f"WITH c AS (INSERT INTO chats ({c_cols}) VALUES ({c_vals})),"
            f" m AS (INSERT INTO messages ({m_cols}) VALUES ({m_vals})){charged}"
            f" INSERT INTO runs ({r_cols}) VALUES ({r_vals})"
        )
        pool = await self.pool()
        await pool.execute(sql, *params)

    async def load_thread(self, chat_id: str) -> list[ThreadRow]:
        """`TurnStore.load_thread`: one SELECT."""
        pool = await self.pool()
        records = await pool.fetch(
            "SELECT seq, id, role, content, extra, run_id, created_at FROM messages"
            " WHERE chat_id = $1 ORDER BY seq",
            chat_id,
        )
        return [
            ThreadRow(
                role=r["role"],
                content=loads(r["content"]),
                extra=loads(r["extra"]),
                chat_id=chat_id,
                run_id=r["run_id"],
                id=r["id"],
                created_at=r["created_at"],
                seq=r["seq"],
            )
            for r in records
        ]

    async def store_rows(self, rows: Sequence[ThreadRow]) -> None:
        """`TurnStore.store_rows`: one INSERT ... SELECT FROM unnest."""
        if not rows:
            return
        params: list[Any] = []
        sql = self._messages(rows, params)
        pool = await self.pool()
        await pool.execute(sql, *params)

    async def finish(self, end: RunEnd) -> None:
        """`TurnStore.finish` as one statement: the run UPDATE (only while it is `running`), then,
        each only when it matched (`EXISTS (SELECT 1 FROM r)`): [interrupt INSERT,] messages
        INSERT, [run_events INSERT,] [billing_redeliveries INSERT,] [pending interrupts ->
        cancelled,] and the chat UPDATE (freed, or only touched when paused). RunTakenOver,
        with nothing written, when the run was no longer running."""
        now = utcnow()
        params: list[Any] = [
            end.run_id,
            end.chat_id,
            now,
            end.status,
            end.error,
            json.dumps(end.usage),
            None if end.events else now,
        ]
        parts = [
            "r AS (UPDATE runs SET status = $4, updated_at = $3, error = $5, usage = $6::json,"
            " archive_due = $7 WHERE id = $1 AND status = 'running' RETURNING 1)"
        ]
        mine = " WHERE EXISTS (SELECT 1 FROM r)"
        if end.interrupt is not None:
            i_cols, i_vals = self._insert_values(_interrupts, end.interrupt, params, select=True)
            parts.append(f"i AS (INSERT INTO interrupts ({i_cols}) SELECT {i_vals}{mine})")
        if end.rows:
            parts.append(f"m AS ({self._messages(end.rows, params, mine)})")
        if end.events:
            params += [[seq for seq, _ in end.events], [payload for _, payload in end.events]]
            seqs, payloads = f"${len(params) - 1}", f"${len(params)}"
            parts.append(f"e AS ({_PG_ARCHIVE.format(seqs=seqs, payloads=payloads, where=mine)})")
        for index, call in enumerate(end.billing_calls):
            b_cols, b_vals = self._insert_values(_redeliveries, call, params, select=True)
            parts.append(
                f"b{index} AS (INSERT INTO billing_redeliveries ({b_cols}) SELECT {b_vals}{mine})"
            )
        if end.status == "interrupted":
            parts.append(
                "c AS (UPDATE chats SET updated_at = $3 WHERE id = $2 AND EXISTS (SELECT 1 FROM r))"
            )
        else:
            if end.status == "cancelled":
                parts.append(
                    "x AS (UPDATE interrupts SET outcome = 'cancelled', resolved_at = $3"
                    " WHERE run_id = $1 AND outcome = 'pending' AND EXISTS (SELECT 1 FROM r))"
                )
            parts.append(
                "c AS (UPDATE chats SET running_id = NULL, updated_at = $3"
                " WHERE id = $2 AND running_id = $1 AND EXISTS (SELECT 1 FROM r))"
            )
        sql = "WITH " + ", ".join(parts) + " SELECT count(*) FROM r"
        pool = await self.pool()
        if not await pool.fetchval(sql, *params):
            raise RunTakenOver(end.run_id)

    async def forget_redeliveries(self, ids: list[str]) -> None:
        """`TurnStore.forget_redeliveries`: one DELETE."""
        pool = await self.pool()
        await pool.execute("DELETE FROM billing_redeliveries WHERE id = ANY($1::varchar[])", ids)

    async def run_for_request(
        self, organization_id: str, request_id: str, since: datetime.datetime
    ) -> tuple[str, str] | None:
        """`TurnStore.run_for_request`: one SELECT."""
        pool = await self.pool()
        record = await pool.fetchrow(
            "SELECT chat_id, id FROM runs"
            " WHERE request_id = $1 AND organization_id = $2 AND created_at >= $3"
            " ORDER BY created_at DESC LIMIT 1",
            request_id,
            organization_id,
            since,
        )
        return None if record is None else (record[0], record[1])

    async def turn_guard(self, chat_id: str) -> Any:
        """`TurnStore.turn_guard`: one SELECT."""
        pool = await self.pool()
        record = await pool.fetchrow(
            "SELECT c.organization_id, c.kind, c.deleted_at, c.running_id, i.id AS pending_id"
            " FROM chats c LEFT OUTER JOIN interrupts i ON i.chat_id = c.id"
            " AND i.outcome = 'pending' WHERE c.id = $1 LIMIT 1",
            chat_id,
        )
        return None if record is None else _GuardRow(tuple(record))

    async def stream_target(self, chat_id: str, run_id: str) -> Any:
        """`TurnStore.stream_target`: one SELECT."""
        pool = await self.pool()
        record = await pool.fetchrow(
            "SELECT c.organization_id, c.kind, c.deleted_at, r.chat_id AS run_chat_id FROM chats c"
            " LEFT OUTER JOIN runs r ON r.id = $2 AND r.chat_id = c.id WHERE c.id = $1 LIMIT 1",
            chat_id,
            run_id,
        )
        return None if record is None else _TargetRow(tuple(record))

    async def archive(
        self, run_id: str, events: Sequence[tuple[int, bytes]], settled: bool
    ) -> None:
        """`TurnStore.archive`: one INSERT ... SELECT FROM unnest ... ON CONFLICT DO NOTHING, with
        the run's `archive_due` cleared in the same statement when `settled`."""
        pool = await self.pool()
        sql = (
            (f"WITH e AS ({_PG_ARCHIVE_RUN}) {_PG_SETTLED}" if events else _PG_SETTLED)
            if settled
            else _PG_ARCHIVE_RUN
        )
        args = (
            [run_id, [seq for seq, _ in events], [payload for _, payload in events]]
            if events
            else [run_id]
        )
        await pool.execute(sql, *args)
