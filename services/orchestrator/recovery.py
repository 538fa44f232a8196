"""Run leases, the crash reaper and cross-replica cancel delivery.

Run ownership is decided in the orchestrator database alone: a run belongs to the replica
that renews `runs.lease_until`, and any replica may end a run whose lease lapsed. Redis
carries events, cancel flags and claims, and may be slow, away or emptied without a live
run losing its lease. Every replica runs three independent tasks (`RunSupervisor.start`),
so that no step waits on another's store:

- **lease renewal** (database only, its own connection pool: `lease_sessions`): every
  `run_lease_s`/4 pushes `runs.lease_until = now + 3/4 * run_lease_s` for the runs this
  replica executes and its ended runs still due (one UPDATE), so two renewals may be missed
  before a lease lapses. A run it executes that is no longer `running` there was ended by
  another replica (this one stalled past its lease): it is stopped here, its late writes
  refused (`RunTakenOver`, the `_BATCH` fence);
- **reaping** (database, then events): every `run_lease_s`/6 ends each `running` run whose
  lease lapsed and that is not active here: its replica died. One replica wins a conditional
  UPDATE to `failed`; it gives a tool call cut off by the crash its error result (the thread
  stays valid), clears the chat's `running_id`, publishes a `tool_result` for a streamed call
  the crash cut off, then `error` and `done {error: true}` (listing the run's tool calls) on
  the run's stream, and archives the events. The turn's reservation is left alone: its run
  charge was stored with the run (`usage.RunCharges`) and reaches billing from the outbox.
  The same pass settles ended runs still due (`runs.archive_due`: the end is stored, the
  event log's end and archive were not) whose lease lapsed: their replica died between the
  two. One replica wins the run for a lease, appends the terminal events the stored end
  calls for when the log has none (`stored_ending`), archives the log and clears the mark;
- **Redis polling** (Redis only, distributed backend): every tick (`run_lease_s`/30, at most
  1 s) reads the cancel flags of the runs active here, so a cancel whose pub/sub message was
  lost still stops the loop within a second, and has the event log restore the streams of
  this replica's runs that Redis lost (`RedisEventLog.restore_lost`: a restart without
  persistence).

A run gets its first lease when its row is written (`lease_deadline`), so a crashed run is
failed at most 3/4 + 1/6 of `run_lease_s` after its last renewal or its start (the lease,
then the next reaper pass) — under `run_lease_s` with room for the work of failing it. Times
are the replicas' UTC clocks; keep them in sync (NTP) - skew eats into the bound.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from typing import Any

from sqlalchemy import and_, or_, select, update

from loopline.assistant.v1 import events_pb2
from services.common import pb
from services.common.errors import PassLog
from services.common.tasks import stop_task
from services.orchestrator.eventlog import is_terminal
from services.orchestrator.lost_run_events import LOST_MESSAGE, close_calls, stored_ending
from services.orchestrator.models import Chat, Message, Run, utcnow
from services.orchestrator.thread import cut_off_result

log = logging.getLogger(__name__)


class RunSupervisor:
    """Leases, reaping and Redis polling for one orchestrator replica (module docstring).

    Args:
        settings: orchestrator settings (`run_lease_s`).
        sessions: async session factory of the orchestrator database.
        runner: this replica's `TurnRunner` (active runs, cancel, archive).
        backend: the shared `RunBackend` (events, cancel flags).
        lease_sessions: the session factory lease renewal uses (its own pool on PostgreSQL,
            so that busy request handlers cannot delay it); `sessions` when None.
    """

    def __init__(
        self, settings: Any, sessions: Any, runner: Any, backend: Any, lease_sessions: Any = None
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.lease_sessions = lease_sessions or sessions
        self.runner = runner
        self.backend = backend
        self.lease_s = float(settings.run_lease_s)
        self.tick_s = max(0.05, min(1.0, self.lease_s / 30))
        self.period_s = self.lease_s / 4
        self.reap_period_s = self.lease_s / 6
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start the independent tasks: lease renewal, reaping, and (with Redis) Redis polling
        (idempotent)."""
        if self._tasks:
            return
        loops = [
            (
                "lease renewal",
                self.period_s,
                self.renew,
                "leases are renewed once the database answers",
            ),
            (
                "run reaper",
                self.reap_period_s,
                self._reap_and_settle,
                "reaping and settling wait until it answers",
            ),
        ]
        if self.backend.distributed:
            loops.append(
                (
                    "Redis polling",
                    self.tick_s,
                    self.poll_redis,
                    "cancel flags are read once Redis answers",
                )
            )
        self._tasks = [
            asyncio.create_task(
                self._every(what, period, step, waiting), name=f"run-supervisor: {what}"
            )
            for what, period, step, waiting in loops
        ]

    async def stop(self) -> None:
        """Stop the background tasks."""
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []

    @staticmethod
    async def _every(what: str, period_s: float, step: Any, waiting: str) -> None:
        """Run `step` every `period_s` seconds; a failed pass is logged (`PassLog`) and the next
        one tried."""
        passes = PassLog(log, what, waiting)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                passes.failed(error)
            else:
                passes.passed()
            await asyncio.sleep(max(0.0, started + period_s - loop.time()))

    async def _reap_and_settle(self) -> None:
        await self.reap()
        await self.settle_ended()

    async def poll_redis(self) -> None:
        """Cancel flags of the runs active here, then the streams Redis lost (module docstring)."""
        if self.runner.active:
            await self.poll_cancels()
        await self.backend.events.restore_lost()

    async def poll_cancels(self) -> None:
        """Cancel active runs of this replica whose cancel flag is set."""
        flags = await self.backend.pending_cancels(list(self.runner.active))
        for run_id, reason in flags.items():
            state = self.runner.active.get(run_id)
            if state is not None and state.cancel_reason is None and not state.finishing:
                asyncio.create_task(self.runner.cancel(run_id, reason))

    async def renew(self) -> int:
        """Push the lease of this replica's running runs, and of its ended runs still due
        (`TurnRunner.unsettled_runs`), forward; returns how many were renewed."""
        run_ids = self.runner.unsettled_runs()
        if not run_ids:
            return 0
        until = utcnow() + datetime.timedelta(seconds=self.lease_s * 0.75)
        async with self.lease_sessions() as session, session.begin():
            result = await session.execute(
                update(Run)
                .where(
                    Run.id.in_(run_ids), or_(Run.status == "running", Run.archive_due.is_not(None))
                )
                .values(lease_until=until)
                .returning(Run.id)
            )
            renewed = set(result.scalars())
        # an active run no longer `running` there was ended by another replica (its lease lapsed)
        for run_id in run_ids:
            state = self.runner.active.get(run_id)
            if (
                state is not None
                and run_id not in renewed
                and not state.finishing
                and state.cancel_reason is None
            ):
                log.warning(
                    "a run of this replica was ended by another one "
                    "(its lease lapsed while this one was stalled or cut off): "
                    "stopped here, its end is the other's",
                    extra={"fields": {"run_id": run_id}},
                )
                asyncio.create_task(self.runner.cancel(run_id, "taken over"))
        return len(renewed)

    @staticmethod
    def lease_deadline(settings: Any, now: datetime.datetime) -> datetime.datetime:
        """The lease a run gets when its row is written: `now + 3/4 * run_lease_s`."""
        return now + datetime.timedelta(seconds=float(settings.run_lease_s) * 0.75)

    def _lapsed(self, now: datetime.datetime) -> Any:
        never_renewed_before = now - datetime.timedelta(seconds=self.lease_s)
        return and_(
            Run.status == "running",
            or_(
                Run.lease_until < now,
                and_(Run.lease_until.is_(None), Run.updated_at < never_renewed_before),
            ),
        )

    async def reap(self) -> list[str]:
        """Fail every running run whose lease lapsed and that is not active here; returns their
        ids."""
        now = utcnow()
        async with self.sessions() as session:
            candidates = list(
                (
                    await session.execute(select(Run.id).where(self._lapsed(now)).limit(100))
                ).scalars()
            )
        reaped = []
        for run_id in candidates:
            if run_id in self.runner.active:
                continue
            if await self.take_over(run_id, "failed", now=now):
                reaped.append(run_id)
        return reaped

    async def reap_orphans(self) -> list[str]:
        """At the start of an orchestrator on the embedded backend (one process, run events in its
        memory), fail every run still `running` at once: a previous process left it (a crash; a
        stop ends its runs) and its events died with it: no listener waits for its lease to lapse
        (up to `run_lease_s`) on an empty stream. Returns the runs' ids."""
        async with self.sessions() as session:
            orphans = list(
                (await session.execute(select(Run.id).where(Run.status == "running"))).scalars()
            )
        reaped = [
            run_id for run_id in orphans if await self.take_over(run_id, "failed", orphaned=True)
        ]
        if reaped:
            log.warning(
                "runs left running by a previous process ended",
                extra={"fields": {"count": len(reaped)}},
            )
        return reaped

    async def take_over(
        self,
        run_id: str,
        status: str,
        *,
        reason: str = "",
        now: datetime.datetime | None = None,
        orphaned: bool = False,
    ) -> bool:
        """End a run whose owner is gone, as `failed` (crash) or `cancelled` (cancel of a lost run).

        Exactly one replica wins (conditional UPDATE on the lapsed lease; with `orphaned`, on the
        run being `running`: `reap_orphans`); the winner settles the thread, the chat and the
        events (not the reservation: its charge is stored with the run). Returns whether this call
        won.
        """
        now = now or utcnow()
        error = LOST_MESSAGE if status == "failed" else None
        async with self.sessions() as session, session.begin():
            won = await session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "running" if orphaned else self._lapsed(now))
                .values(
                    status=status,
                    error=error,
                    updated_at=utcnow(),
                    lease_until=self.lease_deadline(self.settings, utcnow()),
                    # the end below settles it; if it fails, `settle_ended` does once the lease
                    # lapses
                    archive_due=utcnow(),
                )
            )
            if won.rowcount != 1:
                return False
            run = await session.get(Run, run_id)
            await self._close_open_tool_call(session, run, status)
            await session.execute(
                update(Chat)
                .where(Chat.id == run.chat_id, Chat.running_id == run_id)
                .values(running_id=None, updated_at=utcnow())
            )
        log.warning(
            "run lost: its replica stopped renewing the lease",
            extra={"fields": {"run_id": run_id, "status": status}},
        )
        cut_off, records = await self._tool_calls_of(run_id, status)
        if status == "failed":
            ended = [
                *cut_off,
                events_pb2.Event(
                    run_id=run_id,
                    time=pb.timestamp(),
                    error=events_pb2.ErrorEvent(message=LOST_MESSAGE),
                ),
                events_pb2.Event(
                    run_id=run_id,
                    time=pb.timestamp(),
                    done=events_pb2.DoneEvent(
                        response="", tool_calls=records, usage=events_pb2.Usage(), error=True
                    ),
                ),
            ]
        else:
            ended = [
                *cut_off,
                events_pb2.Event(
                    run_id=run_id,
                    time=pb.timestamp(),
                    cancelled=events_pb2.CancelledEvent(reason=reason or "cancelled"),
                ),
            ]
        try:
            await self.backend.events.append_after_end(run_id, *ended)
            await self.runner.archive(run_id)
        except Exception:
            log.exception("publishing the end of a lost run failed; settled once its lease lapses")
        return True

    async def settle_ended(self) -> list[str]:
        """Settle every ended run still due (`runs.archive_due`) whose lease lapsed and that this
        replica is not settling itself: end its event log if it has no terminal event, archive
        it, clear the mark (module docstring). At most 100 per pass; returns the runs settled.
        A run whose settling fails (Redis or the database away) is tried again once its lease
        lapses."""
        now = utcnow()
        lapsed = and_(
            Run.archive_due.is_not(None), or_(Run.lease_until < now, Run.lease_until.is_(None))
        )
        async with self.sessions() as session:
            candidates = list(
                (await session.execute(select(Run.id).where(lapsed).limit(100))).scalars()
            )
        if not candidates:
            return []
        mine = set(self.runner.unsettled_runs())
        settled = []
        for run_id in candidates:
            if run_id in mine:
                continue
            async with self.sessions() as session, session.begin():
                won = await session.execute(
                    update(Run)
                    .where(Run.id == run_id, lapsed)
                    .values(lease_until=self.lease_deadline(self.settings, utcnow()))
                )
            if won.rowcount != 1:
                continue
            try:
                published = await self.backend.events.events_of(run_id)
                if not any(is_terminal(event) for event in published):
                    ending = await stored_ending(self.sessions, run_id, published)
                    await self.backend.events.append_after_end(run_id, *ending)
                    log.warning(
                        "an ended run's stream had no end "
                        "(its replica stopped before publishing it): ended here",
                        extra={"fields": {"run_id": run_id, "events": len(published)}},
                    )
                await self.runner.archive(run_id)
            except Exception:
                log.exception(
                    "settling an ended run's events failed; tried again once its lease lapses"
                )
                continue
            settled.append(run_id)
        return settled

    async def _tool_calls_of(
        self, run_id: str, status: str
    ) -> tuple[list[events_pb2.Event], list[events_pb2.ToolCallRecord]]:
        """From the events the lost run's replica published (the Redis stream; nothing when they
        died with it): `close_calls` with the error the loop gives a call cut off by `status`."""
        try:
            published = await self.backend.events.events_of(run_id)
        except Exception:  # the stream cannot be read: the run still ends
            log.exception("reading a lost run's events failed")
            return [], []
        return close_calls(run_id, published, status, {})

    async def _close_open_tool_call(self, session: Any, run: Run, status: str) -> None:
        """Store an error result for the run's last tool call if the crash cut it off."""
        last = (
            (
                await session.execute(
                    select(Message)
                    .where(Message.run_id == run.id, Message.role == "assistant")
                    .order_by(Message.seq.desc())
                    .limit(1)
                )
            )
            .scalars()
            .first()
        )
        calls = (last.extra or {}).get("tool_calls") if last is not None else None
        if not calls:
            return
        call = calls[0]
        answered = (
            (
                await session.execute(
                    select(Message.extra).where(
                        Message.chat_id == run.chat_id,
                        Message.role == "tool",
                        Message.seq > last.seq,
                    )
                )
            )
            .scalars()
            .all()
        )
        if any(
            isinstance(extra, dict) and extra.get("tool_call_id") == call.get("id")
            for extra in answered
        ):
            return
        session.add(
            Message(
                id=str(uuid.uuid4()),
                chat_id=run.chat_id,
                run_id=run.id,
                role="tool",
                content=cut_off_result(status),
                extra={"tool_call_id": call.get("id"), "name": call.get("name")},
            )
        )

    async def cancel_elsewhere(self, run_id: str, reason: str) -> str | None:
        """Cancel a run running on another replica and wait (up to `cancel_wait_s`) until it ends.

        Returns the run's final status ("cancelled", or the outcome it reached first), or None
        when it did not stop in time. A run whose owner is gone (lease lapsed) is cancelled here.
        """
        await self.backend.request_cancel(run_id, reason)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(self.settings.cancel_wait_s)
        while True:
            async with self.sessions() as session:
                status = (
                    await session.execute(select(Run.status).where(Run.id == run_id))
                ).scalar()
            if status != "running":
                return status
            if await self.take_over(run_id, "cancelled", reason=reason):
                return "cancelled"
            if loop.time() > deadline:
                return None
            await asyncio.sleep(0.05)
