"""The fault suite's one checker: the invariants every scenario ends with.

`check(cluster, runs, listeners, ...)` waits for every run to end (bounded), reads the truth
from the stores (the orchestrator's `runs` and `run_events` tables, billing's `reservations`
and `ledger_entries`) and from the public API, and returns the violations, one line each
(`assert_invariants` raises with them). The invariants:

1. **Outcome.** A run that was not lost with its owner (`Run.expect == "completed"`) ends
   `completed` with its owner's answer (the scripted `say`), never `failed` (or anything
   else) by another replica. A run lost with its owner (`expect == "failed"`) ends `failed`,
   its stream ending `error` then `done {error: true}`.
2. **Streams.** Every listener's connections, in order, are the run's stored archive
   (`run_events`, rendered by the gateway's own encoder `services.gateway.sse.render`):
   each connection from `?after=N` gets exactly archive[N:], or archive[N:M] followed by
   exactly one reconnect frame `{"type":"error","data":{"message":"...reconnect with
   ?after=M"}}`, and the next connection asks `?after=M`; the last one ends with a terminal
   frame (done / cancelled / interrupted). A stream that closes with neither, or that the
   client had to give up on, is a violation. The archive served after the end (`GET
   .../listen/{run_id}` through a gateway) equals the stored one.
3. **Messages.** `GET /assistant/chat/{id}` has the run's user message (the script sent)
   and, for a completed run, the assistant answer.
4. **Charges.** Every started turn is charged exactly once: one `run_charge` ledger entry
   for the reservation of turn key `{chat_id}:{run_id}` (billing posts charges up to
   ~0.2 s after the turn; the checker waits for them, bounded).
5. **Waits.** No listener waits longer than `gap_bound_s` (the gateways' heartbeat
   interval plus a margin) for its next frame or its end, heartbeats counting as frames.

Options per scenario: `allow_reconnects=False` (a listener must get the whole run on one
connection), `forbid` (substrings no frame may contain, e.g. "event store is unreachable").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from sqlalchemy import text

from loopline.assistant.v1 import events_pb2
from services.common import db
from services.gateway import sse
from tests.faults.cluster import HEARTBEAT_S, FaultCluster
from tests.faults.listeners import RECONNECT, TERMINAL, Listener
from tests.faults.turns import Run

GAP_MARGIN_S = 4.0  # margin over the heartbeat interval for the longest wait on a stream
END_TIMEOUT_S = 60.0  # how long the checker waits for every run to end and be archived
CHARGE_TIMEOUT_S = 20.0  # how long it waits for the run charges to reach billing's ledger
ENDED = ("completed", "failed", "cancelled", "interrupted", "expired", "resumed")


def _frame(payload: bytes) -> dict[str, Any]:
    event = events_pb2.Event.FromString(payload)
    return orjson.loads(orjson.dumps(sse.render(event)))


def _short(frame: dict[str, Any] | None) -> str:
    return json.dumps(frame)[:160] if frame is not None else "None"


def _first_difference(got: Sequence[dict[str, Any]], want: Sequence[dict[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"frame {i}: got {_short(a)} want {_short(b)}"
    if len(got) != len(want):
        got_types = [f.get("type") for f in got][-6:]
        want_types = [f.get("type") for f in want][-6:]
        return f"{len(got)} frames, want {len(want)} (types {got_types} vs {want_types})"
    return "equal"


class Store:
    """Read access to the orchestrator's and billing's databases of a cluster."""

    def __init__(self, cluster: FaultCluster) -> None:
        self.orchestrator = db.make_engine(cluster.urls["orchestrator"])
        self.billing = db.make_engine(cluster.urls["billing"])

    async def close(self) -> None:
        await self.orchestrator.dispose()
        await self.billing.dispose()

    async def runs(self, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """{run_id: {status, error, archive_due, events}} (events: how many `run_events` rows)."""
        async with self.orchestrator.connect() as conn:
            rows = (
                (
                    await conn.execute(
                        text(
                            "SELECT r.id, r.status, r.error, r.archive_due, "
                            "(SELECT count(*) FROM run_events e WHERE e.run_id = r.id) AS events "
                            "FROM runs r WHERE r.id = ANY(:ids)"
                        ),
                        {"ids": run_ids},
                    )
                )
                .mappings()
                .all()
            )
        return {row["id"]: dict(row) for row in rows}

    async def archives(self, run_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """{run_id: its archived frames, in seq order}; a gap in the seqs is reported as a frame
        of type "missing"."""
        async with self.orchestrator.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT run_id, seq, payload FROM run_events WHERE run_id = ANY(:ids) "
                        "ORDER BY run_id, seq"
                    ),
                    {"ids": run_ids},
                )
            ).all()
        archives: dict[str, list[dict[str, Any]]] = {run_id: [] for run_id in run_ids}
        for run_id, seq, payload in rows:
            frames = archives[run_id]
            while len(frames) < seq:
                frames.append({"type": "missing", "data": {"seq": len(frames)}})
            frames.append(_frame(bytes(payload)))
        return archives

    async def charges(self, turn_keys: list[str]) -> dict[str, tuple[int, str | None]]:
        """{turn_key: (run_charge ledger entries, reservation state)}; a turn without a
        reservation is absent."""
        async with self.billing.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT r.turn_key, r.state, (SELECT count(*) FROM ledger_entries l "
                        "WHERE l.reservation_id = r.id AND l.kind = 'run_charge') "
                        "FROM reservations r WHERE r.turn_key = ANY(:keys)"
                    ),
                    {"keys": turn_keys},
                )
            ).all()
        found: dict[str, tuple[int, str | None]] = {}
        for key, state, count in rows:
            previous = found.get(key, (0, None))[0]
            found[key] = (previous + count, state)
        return found


async def _gather_bounded(calls: Sequence[Any], limit: int = 16) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(call) for call in calls))


def check_listener(
    listener: Listener,
    archive: list[dict[str, Any]],
    *,
    allow_reconnects: bool,
    gap_bound_s: float,
    forbid: Sequence[str],
) -> list[str]:
    """Invariants 2 and 5 for one listener against its run's archive."""
    problems = list(listener.problems)
    name = listener.name
    expected_after = 0
    for number, segment in enumerate(listener.segments):
        where = (
            f"{name} connection {number + 1} (through {segment.gateway}, ?after={segment.after})"
        )
        for frame in segment.frames:
            text_of = json.dumps(frame)
            for needle in forbid:
                if needle in text_of:
                    problems.append(f"{where}: a frame says {needle!r}: {_short(frame)}")
        if segment.max_gap > gap_bound_s:
            problems.append(
                f"{where}: waited {segment.max_gap:.1f} s for a frame (bound {gap_bound_s:.1f} s; "
                f"the wait ended {segment.max_gap_at:.1f} s after it began listening; "
                f"response headers after {segment.headers_s:.1f} s)"
            )
        if segment.after != expected_after:
            problems.append(
                f"{where}: asked ?after={segment.after}, "
                f"the previous connection said {expected_after}"
            )
        start = segment.after
        reconnect = segment.reconnect_at
        if reconnect is not None:
            body = segment.frames[:-1]
            if not allow_reconnects:
                problems.append(
                    f"{where}: ended with a reconnect frame after {len(body)} frames: "
                    f"{_short(segment.frames[-1])}"
                )
            if reconnect != start + len(body):
                problems.append(
                    f"{where}: the reconnect frame says ?after={reconnect} "
                    f"after {start + len(body)} frames of the run"
                )
            if body != archive[start : start + len(body)]:
                problems.append(
                    f"{where}: frames before the reconnect frame are not the archive's: "
                    f"{_first_difference(body, archive[start : start + len(body)])}"
                )
            expected_after = reconnect
            continue
        want = archive[start:]
        if segment.ending != "terminal":
            prefix = archive[start : start + len(segment.frames)]
            relation = (
                "the archive's"
                if segment.frames == prefix
                else f"not the archive's ({_first_difference(segment.frames, prefix)})"
            )
            problems.append(
                f"{where}: ended '{segment.ending}' with neither an end frame nor a reconnect "
                f"frame, after {len(segment.frames)} frames, {relation}; "
                f"last {_short(segment.frames[-1] if segment.frames else None)}"
            )
        elif segment.frames != want and not (
            start >= len(archive) and segment.frames == archive[-1:]
        ):  # past the end: the last frame (README "Stream end")
            problems.append(
                f"{where}: not the archive from {start}: {_first_difference(segment.frames, want)}"
            )
        expected_after = start + len(segment.frames)
    if (
        listener.segments
        and listener.segments[-1].reconnect_at is not None
        and not any("still open" in p for p in problems)
    ):
        problems.append(
            f"{name}: its last connection ended with a reconnect frame and it never got the rest"
        )
    if not listener.segments and not problems:
        problems.append(f"{name}: never connected ({listener.refused[-5:]})")
    return problems


async def check(
    cluster: FaultCluster,
    runs: Sequence[Run],
    listeners: Sequence[Listener],
    *,
    allow_reconnects: bool = True,
    gap_bound_s: float = HEARTBEAT_S + GAP_MARGIN_S,
    forbid: Sequence[str] = (),
    end_timeout_s: float = END_TIMEOUT_S,
    served_replay: bool = True,
) -> list[str]:
    """Every invariant of the module docstring; returns the violations (empty: all hold)."""
    problems: list[str] = []
    store = Store(cluster)
    by_id = {run.run_id: run for run in runs}
    try:
        # 1. every run ends (and is archived) within the bound
        deadline = time.monotonic() + end_timeout_s
        while True:
            rows = await store.runs(list(by_id))
            pending = [
                rid
                for rid in by_id
                if rid not in rows
                or rows[rid]["status"] not in ENDED
                or rows[rid]["archive_due"] is not None
                or not rows[rid]["events"]
            ]
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        for rid in pending:
            row = rows.get(rid)
            problems.append(
                f"run {rid}: not ended and archived {end_timeout_s:.0f} s after the scenario "
                f"(status {row and row['status']}, archive_due {row and row['archive_due']}, "
                f"{row and row['events']} archived events)"
            )
        archives = await store.archives(list(by_id))
        for run in runs:
            row, archive = rows.get(run.run_id), archives.get(run.run_id, [])
            if row is None:
                problems.append(f"run {run.run_id}: no row in the orchestrator database")
                continue
            types = [frame.get("type") for frame in archive]
            if "missing" in types:
                problems.append(f"run {run.run_id}: the archive has gaps in its seqs: {types}")
            if run.expect == "completed":
                if row["status"] != "completed":
                    problems.append(
                        f"run {run.run_id} (started through {run.via}): ended "
                        f"{row['status']!r}, not its owner's 'completed' "
                        f"(error: {row['error']!r}); archive ends {types[-3:]}"
                    )
                elif (
                    not archive
                    or types[-1] != "done"
                    or archive[-1]["data"].get("error")
                    or archive[-1]["data"].get("response") != run.turn.answer
                ):
                    problems.append(
                        f"run {run.run_id}: completed, but its stream ends "
                        f"{_short(archive[-1] if archive else None)} "
                        f"(want done with {run.turn.answer[:60]!r})"
                    )
            elif run.expect == "failed":
                if row["status"] != "failed":
                    problems.append(
                        f"run {run.run_id} (lost with its owner): ended {row['status']!r}, "
                        "not 'failed'"
                    )
                if types[-2:] != ["error", "done"] or not archive[-1]["data"].get("error"):
                    problems.append(
                        f"run {run.run_id} (lost with its owner): its stream ends {types[-3:]}, "
                        "not error + done {error: true}"
                    )
            if types and types[0] != "metadata":
                problems.append(
                    f"run {run.run_id}: its archive begins with {types[0]!r}, not metadata"
                )
            if sum(1 for t in types if t in TERMINAL) != 1 or (types and types[-1] not in TERMINAL):
                problems.append(
                    f"run {run.run_id}: its archive has "
                    f"{sum(1 for t in types if t in TERMINAL)} end frames "
                    f"and ends {types[-1:]}: {types[-6:]}"
                )

        # 2 + 5. listeners against the archive
        for listener in listeners:
            problems += check_listener(
                listener,
                archives.get(listener.run.run_id, []),
                allow_reconnects=allow_reconnects,
                gap_bound_s=gap_bound_s,
                forbid=forbid,
            )

        # 2. the replay served after the end is the archive; 3. the stored messages
        clients = [cluster.client(gateway, timeout=30) for gateway in cluster.live_gateways()]
        try:

            async def served(run: Run, client: httpx.AsyncClient) -> None:
                frames = await _replay(client, run.url)
                want = archives.get(run.run_id, [])
                if frames != want:
                    problems.append(
                        f"run {run.run_id}: the replay through {client.base_url} is not the "
                        f"archive: {_first_difference(frames, want)}"
                    )

            async def messages(run: Run, client: httpx.AsyncClient) -> None:
                response = await client.get(f"/assistant/chat/{run.chat_id}")
                if response.status_code != 200:
                    problems.append(
                        f"run {run.run_id}: GET chat answered {response.status_code} "
                        f"{response.text[:200]}"
                    )
                    return
                mine = [m for m in response.json()["messages"] if m.get("run_id") == run.run_id]
                if not any(
                    m["role"] == "user" and m["content"] == run.turn.message
                    for m in response.json()["messages"]
                ):
                    problems.append(
                        f"run {run.run_id}: its user message is not stored "
                        f"(chat has {len(response.json()['messages'])} messages)"
                    )
                if run.expect == "completed" and not any(
                    m["role"] == "assistant" and _text(m["content"]) == run.turn.answer
                    for m in mine
                ):
                    problems.append(
                        f"run {run.run_id}: its answer {run.turn.answer[:50]!r} is not stored; "
                        "the run's messages: "
                        f"{[(m['role'], str(m['content'])[:40]) for m in mine]}"
                    )

            calls = []
            for i, run in enumerate(runs):
                client = clients[i % len(clients)] if clients else None
                if client is None:
                    continue
                if served_replay:
                    calls.append(lambda run=run, client=client: served(run, client))
                other = clients[(i + 1) % len(clients)]
                calls.append(lambda run=run, client=other: messages(run, client))
            await _gather_bounded(calls)
        finally:
            for client in clients:
                await client.aclose()

        # 4. charged exactly once
        keys = [run.turn_key for run in runs]
        deadline = time.monotonic() + CHARGE_TIMEOUT_S
        while True:
            charges = await store.charges(keys)
            if (
                all(charges.get(key, (0, None))[0] == 1 for key in keys)
                or time.monotonic() > deadline
            ):
                break
            if any(count > 1 for count, _ in charges.values()):
                break
            await asyncio.sleep(0.25)
        for key in keys:
            count, state = charges.get(key, (0, None))
            if count != 1:
                problems.append(
                    f"turn {key}: charged {count} times (reservation {state or 'absent'}), "
                    "want exactly once"
                )
    finally:
        await store.close()
    return problems


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


async def _replay(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    frames = []
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            return [{"type": "http", "data": {"status": response.status_code}}]
        buffer = b""
        async for chunk in response.aiter_bytes():
            buffer += chunk
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                frame = json.loads(raw[len(b"data: ") :])
                if frame.get("type") != "heartbeat":
                    frames.append(frame)
    return frames


def summary(problems: Sequence[str], limit: int = 25) -> str:
    """The violations for an assertion message (the first `limit`, then how many more)."""
    shown = list(problems[:limit])
    if len(problems) > limit:
        shown.append(f"... and {len(problems) - limit} more")
    return f"{len(problems)} invariant violation(s):\n  " + "\n  ".join(shown)


async def assert_invariants(
    cluster: FaultCluster, runs: Sequence[Run], listeners: Sequence[Listener], **options: Any
) -> None:
    """`check`, raising AssertionError with the violations and the replicas' log tails."""
    problems = await check(cluster, runs, listeners, **options)
    print(report(runs, listeners))
    if problems:
        raise AssertionError(summary(problems) + "\n\nlogs:\n" + cluster.logs())


def report(runs: Sequence[Run], listeners: Sequence[Listener], limit: int = 12) -> str:
    """One line per listener: its connections (gateway, ?after, frames, how it ended, longest
    wait)."""
    lines = [f"{len(runs)} run(s), {len(listeners)} listener(s)"]
    for listener in listeners[:limit]:
        parts = [
            f"{s.gateway}@{s.after}:{len(s.frames)}f/{s.heartbeats}hb {s.ending} "
            f"gap {s.max_gap:.1f}s"
            for s in listener.segments
        ]
        lines.append(
            f"  {listener.name}: "
            + " | ".join(parts)
            + (f" refused {listener.refused[:4]}" if listener.refused else "")
        )
    if len(listeners) > limit:
        gaps = sorted(s.max_gap for listener in listeners for s in listener.segments)
        heads = sorted(s.headers_s for listener in listeners for s in listener.segments)
        reconnects = sum(
            1 for listener in listeners for s in listener.segments if s.ending == "reconnect"
        )
        lines.append(
            f"  ... {len(listeners) - limit} more; longest wait {gaps[-1] if gaps else 0:.2f} s, "
            f"p99 {gaps[int(len(gaps) * 0.99)] if gaps else 0:.2f} s; "
            f"response headers after {heads[-1] if heads else 0:.2f} s at most, "
            f"p99 {heads[int(len(heads) * 0.99)] if heads else 0:.2f} s; "
            f"reconnect frames {reconnects}"
        )
    return "\n".join(lines)


__all__ = ["report", "RECONNECT", "assert_invariants", "check", "check_listener", "summary"]
