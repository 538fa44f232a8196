"""Redis loses a run's stream (restarted without persistence) while its owner is alive.

The owner writes its whole copy again, atomically, on its next write or when polled
(`RedisEventLog.restore_lost`), so a follower on another replica goes on from the index it
reached and gets every event once, in order. A follower of a stream that stays gone ends
with StreamInterrupted (the listener's reconnect frame), never a bare end. A lost stream is
simulated by deleting its keys (what a Redis restarted empty shows a client). Skipped without
Redis.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from loopline.assistant.v1 import events_pb2
from services.orchestrator.eventlog import StreamInterrupted
from services.orchestrator.eventlog.redis import RedisEventLog, redis_client
from tests.conftest import drop_redis_prefix, redis_url
from tests.scale.conftest import fresh_redis_prefix, no_archive


def _chunk(run_id: str, text: str) -> events_pb2.Event:
    return events_pb2.Event(run_id=run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=text))


@pytest.fixture
async def logs():
    """(owner log, follower log, client): two replicas' event logs on one fresh key prefix."""
    prefix = fresh_redis_prefix()
    owner_client, follower_client = (
        redis_client(redis_url()),
        redis_client(redis_url(), max_connections=4),
    )
    owner = RedisEventLog(owner_client, prefix, 10_000, 60, no_archive, retry_s=2.0)
    follower = RedisEventLog(
        follower_client, prefix, 10_000, 60, no_archive, retry_s=2.0, block_ms=200
    )
    try:
        yield owner, follower, owner_client
    finally:
        await owner.aclose()
        await owner_client.aclose()
        await follower_client.aclose()
        await drop_redis_prefix(redis_url(), prefix)


async def _lose(log: RedisEventLog, client, run_id: str) -> None:  # noqa: ANN001
    await client.delete(*log._keys(run_id))


async def _stored_seqs(log: RedisEventLog, client, run_id: str) -> list[int]:  # noqa: ANN001
    entries = await client.xrange(log._keys(run_id)[0], "-", "+")
    return [int(entry_id.decode().split("-")[1]) - 1 for entry_id, _ in entries]


async def _one_event_stored(owner: RedisEventLog) -> str:
    """A new run of `owner` whose first event (a chunk "a") is stored; its id."""
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    owner.append(_chunk(run_id, "a"))
    await owner.flush(run_id)
    return run_id


async def _following(
    follower: RedisEventLog, run_id: str
) -> tuple[asyncio.Task, list[events_pb2.Event]]:
    """A follower of the run in the background, once it has its first event: (its task, what it
    got)."""
    seen: list[events_pb2.Event] = []

    async def listen() -> None:
        async for event in follower.follow(run_id, 0):
            seen.append(event)

    task = asyncio.create_task(listen())
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.02)
    return task, seen


async def test_the_next_write_after_the_stream_was_lost_writes_the_whole_run_again(logs):
    owner, _, client = logs
    run_id = str(uuid.uuid4())
    owner.open(run_id)
    for text in "abc":
        owner.append(_chunk(run_id, text))
    await owner.flush(run_id)
    await _lose(owner, client, run_id)
    owner.append(_chunk(run_id, "d"))
    await owner.flush(run_id)
    assert await _stored_seqs(owner, client, run_id) == [
        0,
        1,
        2,
        3,
    ]  # before: [3], the first three lost for good
    assert owner.owned_events(run_id) is not None  # still the stream's copy (not `diverged`)


async def test_an_idle_run_whose_stream_was_lost_is_written_again_when_polled(logs):
    owner, _, client = logs
    run_id = await _one_event_stored(owner)
    await _lose(owner, client, run_id)
    assert await owner.restore_lost() == 1
    await owner.flush(run_id)
    assert await _stored_seqs(owner, client, run_id) == [0]
    assert await owner.restore_lost() == 0  # whole again: nothing to ask


async def test_a_follower_on_another_replica_goes_on_after_the_stream_was_lost(logs):
    owner, follower, client = logs
    run_id = await _one_event_stored(owner)
    task, seen = await _following(follower, run_id)
    await _lose(owner, client, run_id)
    await asyncio.sleep(
        0.5
    )  # the follower finds the stream gone and waits (before: a bare end at once)
    assert not task.done()
    await owner.restore_lost()
    owner.append(_chunk(run_id, "b"))
    owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ab")))
    owner.close(run_id)
    await asyncio.wait_for(task, 10)
    assert [(event.seq, event.WhichOneof("payload")) for event in seen] == [
        (0, "response_chunk"),
        (1, "response_chunk"),
        (2, "done"),
    ]


async def test_a_follower_of_a_stream_that_stays_lost_ends_with_the_reconnect_frame(logs):
    owner, follower, client = logs
    run_id = await _one_event_stored(owner)
    task, seen = await _following(follower, run_id)
    owner._writers.pop(run_id).task.cancel()  # its owner is gone, and its copy with it
    await _lose(owner, client, run_id)
    with pytest.raises(
        StreamInterrupted
    ) as interrupted:  # retry_s (2 s) after the stream went missing; before: a bare end at once
        await asyncio.wait_for(task, 10)
    assert [event.WhichOneof("payload") for event in seen] == ["response_chunk"]
    assert interrupted.value.message.endswith("reconnect with ?after=1")
