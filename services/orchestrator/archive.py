"""The archive of a run's events in the `run_events` table: written when the run ends, loaded
when a listener comes after the event log let the run go.

A memory log dies with its process, so its runs are archived with their end, in the same
transaction (`RunArchiving._stream_to_archive`). A durable log (Redis) is archived after the
end is published (`archive_after_end`); an archive that fails then is tried again in the
background while the log still holds the events, and never changes the run's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import select

from loopline.assistant.v1 import events_pb2
from services.common import logging as loopline_logging
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.eventlog import EventLog, is_terminal
from services.orchestrator.models import RunEvent
from services.orchestrator.store import TurnStore

log = logging.getLogger(__name__)

ARCHIVE_RETRY_FIRST_S = 0.5  # first wait before a failed archive is tried again (doubling)
ARCHIVE_RETRY_MAX_S = 60.0  # longest wait between two tries
ARCHIVE_AT_STOP_S = 2.0  # a shutdown's last try of each archive still pending
ARCHIVE_FLUSH_S = 0.5  # longest wait for the log to store the owner's events (then left due)


class RunArchiving:
    """The run archive of `TurnRunner`, mixed into it: recovery, the servicer and tests call and
    patch these as the runner's methods, and a mixin keeps that without a delegating layer.

    Uses the runner's `settings`, `store`, `events` and `_archiving` (ended runs whose archive
    failed and is tried again, by run id).
    """

    settings: OrchestratorSettings
    store: TurnStore
    events: EventLog
    _archiving: dict[str, asyncio.Task[None]]

    def _stream_to_archive(
        self, run_id: str, ending: list[events_pb2.Event]
    ) -> list[tuple[int, bytes]]:
        """The archive rows of the run's stream with `ending` (its terminal events, not published
        yet, numbered here as the log will number them), for an event log that dies with this
        process (memory): stored with the run's end in one transaction before the end is
        published, so a crash right after a listener got `done` cannot leave an ended run with
        no stream. Empty for a durable log (archived after the end)."""
        if self.events.durable:
            return []
        published = self.events.snapshot(run_id)
        for index, event in enumerate(ending, start=len(published)):
            event.seq = index
        return [(event.seq, event.SerializeToString()) for event in (*published, *ending)]

    async def archive_after_end(self, run_id: str) -> None:
        """Archive an ended run's events (a durable log: after its end is stored and published).

        The end is final by then, so a failed archive (the database unreachable for a moment)
        must not touch the run's outcome: it is logged and tried again in the background
        (`_archive_until_written`) while the log still holds the events. While a retry of the
        run's archive is pending, it writes this archive's events too (it reads the log when it
        tries).
        """
        if run_id in self._archiving:
            return
        try:
            await self.archive(run_id)
        except Exception as error:  # noqa: BLE001 - any failure: the events are still in the log
            log.warning(
                "archiving the run's events failed; trying again",
                extra={"fields": {"error": type(error).__name__}},
            )
            task = asyncio.create_task(
                self._archive_until_written(run_id), name=f"archive:{run_id}"
            )
            self._archiving[run_id] = task
            task.add_done_callback(lambda _task: self._archiving.pop(run_id, None))

    async def _archive_until_written(self, run_id: str) -> None:
        """Try the archive of an ended run again, waiting ARCHIVE_RETRY_FIRST_S doubling up to
        ARCHIVE_RETRY_MAX_S between tries, until it is written or the log's copy has expired
        (LOOPLINE_RUN_EVENTS_TTL_S after the end). A run deleted meanwhile (its rows are gone:
        the insert breaks the foreign key) needs no archive."""
        loopline_logging.bind_task(run_id=run_id)
        delay = ARCHIVE_RETRY_FIRST_S
        give_up_at = time.monotonic() + float(self.settings.run_events_ttl_s)
        while True:
            await asyncio.sleep(delay)
            try:
                await self.archive(run_id)
            except sa_exc.IntegrityError:
                log.info("the run was deleted before its events were archived")
                return
            except Exception as error:  # noqa: BLE001 - logged, tried again
                if time.monotonic() + delay >= give_up_at:
                    log.error(
                        "archiving the run's events failed until its log expired; "
                        "the events are lost",
                        extra={"fields": {"error": type(error).__name__}},
                    )
                    return
                delay = min(delay * 2, ARCHIVE_RETRY_MAX_S)
            else:
                log.info("the run's events were archived after a failed try")
                return

    def archiving_runs(self) -> int:
        """Ended runs whose archive failed and is being tried again (for tests and metrics)."""
        return len(self._archiving)

    async def _stop_archiving(self) -> None:
        """At shutdown: each archive still being tried again gets one last try (ARCHIVE_AT_STOP_S),
        then is left; its events stay in the durable log until they expire."""
        for run_id, task in list(self._archiving.items()):
            task.cancel()
            try:
                await asyncio.wait_for(self.archive(run_id), ARCHIVE_AT_STOP_S)
            except Exception as error:  # noqa: BLE001 - logged; nothing else can be done at shutdown
                log.error(
                    "a run's events could not be archived before shutdown; "
                    "they stay in the event log until it expires",
                    extra={"fields": {"run_id": run_id, "error": type(error).__name__}},
                )

    async def archive(self, run_id: str) -> None:
        """Write the run's events to `run_events` (one transaction; existing rows kept).

        The events are this process's own copy of a run it published (`EventLog.owned_events`:
        what it published, also while Redis is away, which the archive must not wait for or
        depend on), else the event log's once everything published is stored (the Redis
        stream, or memory), so the database holds the durable copy of every ended run. Two
        replicas archiving the same run at once both succeed (INSERT ... ON CONFLICT DO NOTHING).

        The run's `archive_due` is cleared with it when the log holds the run's end (what the
        owner published is stored there, waited for up to ARCHIVE_FLUSH_S; or, read from the
        log, it has a terminal event); otherwise the run stays due: this process renews its
        lease while its events wait for Redis, and `RunSupervisor.settle_ended` settles it
        once they are stored, or once the process is gone.
        """
        events = self.events.owned_events(run_id)
        owned = events is not None
        if events is None:
            await self.events.flush(run_id)
            events = await self.events.events_of(run_id)
            settled = any(is_terminal(event) for event in events)
        else:
            await self.events.flush(run_id, ARCHIVE_FLUSH_S)
            owned_now = self.events.owned_events(run_id)
            owned, events = owned_now is not None, owned_now or events
            settled = run_id not in self.events.unstored_runs()
        await self.store.archive(
            run_id, [(event.seq, event.SerializeToString()) for event in events], settled=settled
        )
        forget = getattr(self.events, "forget", None)
        if forget is not None:
            forget(run_id, archived=owned)


async def load_archive(sessions: Any, run_id: str) -> list[events_pb2.Event]:
    """The events of a run archived in the `run_events` table, in order (empty when none)."""
    async with sessions() as session:
        rows = (
            await session.execute(
                select(RunEvent.payload).where(RunEvent.run_id == run_id).order_by(RunEvent.seq)
            )
        ).scalars()
        return [events_pb2.Event.FromString(payload) for payload in rows]
