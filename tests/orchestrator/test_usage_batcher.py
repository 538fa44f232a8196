"""services/orchestrator/usage.py: model calls' usage goes to billing in batches, nothing lost."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from loopline.billing.v1 import billing_pb2
from services.orchestrator.loop import TurnRunner
from services.orchestrator.usage import Redelivery, UsageBatcher


class _Failure(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


class FakeBilling:
    def __init__(self, batch_code: grpc.StatusCode | None = None, failures: int = 0) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.singles: list[tuple[str, int]] = []
        self.batch_code = batch_code
        self.failures = failures

    async def RecordUsageBatch(self, request, timeout=None):  # noqa: N802 - stub method name
        if self.batch_code is not None:
            raise _Failure(self.batch_code)
        if self.failures:
            self.failures -= 1
            raise _Failure(grpc.StatusCode.UNAVAILABLE)
        self.batches.append([(c.run_id, c.call_index) for c in request.calls])
        return billing_pb2.RecordUsageBatchResponse()

    async def RecordUsage(self, request, timeout=None):  # noqa: N802 - stub method name
        self.singles.append((request.run_id, request.call_index))
        return billing_pb2.RecordUsageResponse()


def _usage(run_id: str, index: int) -> billing_pb2.RecordUsageRequest:
    return billing_pb2.RecordUsageRequest(organization_id="org", run_id=run_id, call_index=index, input_tokens=1)


async def test_records_within_the_window_go_in_one_batch_and_flush_sends_at_once():
    billing = FakeBilling()
    batcher = UsageBatcher(billing, window_s=0.05)
    waits = [batcher.add(_usage("a", 0)), batcher.add(_usage("b", 0))]
    await asyncio.sleep(0.01)
    assert billing.batches == []  # still inside the window
    waits.append(batcher.add(_usage("a", 1)))
    batcher.flush()  # a run's end does not wait for the window
    await asyncio.wait_for(asyncio.gather(*waits), 1)
    assert billing.batches == [[("a", 0), ("b", 0), ("a", 1)]]
    late = batcher.add(_usage("c", 0))
    await asyncio.wait_for(late, 1)  # the window alone sends it too
    assert billing.batches[-1] == [("c", 0)]


async def test_an_older_billing_without_the_batch_rpc_gets_single_calls():
    billing = FakeBilling(batch_code=grpc.StatusCode.UNIMPLEMENTED)
    batcher = UsageBatcher(billing, window_s=0)
    await asyncio.wait_for(asyncio.gather(batcher.add(_usage("a", 0)), batcher.add(_usage("a", 1))), 1)
    assert sorted(billing.singles) == [("a", 0), ("a", 1)]


async def test_a_failed_send_is_retried_and_a_last_failure_logged_not_raised(caplog: pytest.LogCaptureFixture):
    billing = FakeBilling(failures=1)
    batcher = UsageBatcher(billing, window_s=0)
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 2)
    assert billing.batches == [[("a", 0)]]  # the retry went through
    billing.failures = 5
    await asyncio.wait_for(batcher.add(_usage("b", 0)), 3)
    assert any("recording usage failed" in r.getMessage() for r in caplog.records)
    await batcher.close()


async def test_a_billing_outage_longer_than_the_quick_retries_loses_no_record(caplog: pytest.LogCaptureFixture):
    """Re-test: billing stalled ~25 s during a run and its usage records were never recorded (3 quick
    attempts, then only an ERROR line). Now the run is not held up, and the records are sent again
    in the background until billing takes them."""
    billing = FakeBilling(failures=6)  # more than the 3 quick attempts
    batcher = UsageBatcher(billing, window_s=0, redelivery=Redelivery(first_delay_s=0.01, max_delay_s=0.02, horizon_s=10))
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 3)  # the run goes on after the quick retries
    assert billing.batches == [] and batcher.redelivery.pending == 1
    assert any("retrying in the background" in r.getMessage() for r in caplog.records)
    for _ in range(200):
        if batcher.redelivery.pending == 0:
            break
        await asyncio.sleep(0.01)
    assert billing.batches == [[("a", 0)]] and batcher.redelivery.pending == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    await batcher.close()


async def test_a_record_still_unsent_at_shutdown_gets_one_last_attempt_and_a_lost_one_is_logged(caplog: pytest.LogCaptureFixture):
    billing = FakeBilling(failures=3)
    batcher = UsageBatcher(billing, window_s=0, redelivery=Redelivery(first_delay_s=60))
    await asyncio.wait_for(batcher.add(_usage("a", 0)), 3)
    assert batcher.redelivery.pending == 1
    await asyncio.wait_for(batcher.close(), 3)  # no 60 s wait: the last attempt is made at once
    assert billing.batches == [[("a", 0)]]
    billing.failures = 10
    gone = UsageBatcher(billing, window_s=0, redelivery=Redelivery(first_delay_s=0.01, max_delay_s=0.01, horizon_s=0.05))
    await asyncio.wait_for(gone.add(_usage("b", 0)), 3)
    for _ in range(100):
        if gone.redelivery.pending == 0:
            break
        await asyncio.sleep(0.01)
    lost = [r for r in caplog.records if r.levelname == "ERROR" and r.getMessage() == "recording usage failed"]
    assert len(lost) == 1 and lost[0].fields["run_id"] == "b"
    await gone.close()


async def test_a_tool_charge_billing_refused_is_sent_again_in_the_background():
    calls: list[str] = []

    async def record_tool_usage(request, timeout=None):
        calls.append(request.tool_call_id)
        if len(calls) <= 4:
            raise _Failure(grpc.StatusCode.UNAVAILABLE)
        return billing_pb2.RecordToolUsageResponse()

    runner = SimpleNamespace(redelivery=Redelivery(first_delay_s=0.01, max_delay_s=0.02, horizon_s=10))
    request = billing_pb2.RecordToolUsageRequest(organization_id="org", run_id="r", tool_call_id="t1", millicredits=5)
    await TurnRunner._send_to_billing(runner, record_tool_usage, request, "recording tool usage failed", tool_call_id="t1")
    assert calls == ["t1"] * 3 and runner.redelivery.pending == 1
    for _ in range(200):
        if runner.redelivery.pending == 0:
            break
        await asyncio.sleep(0.01)
    assert calls == ["t1"] * 5
