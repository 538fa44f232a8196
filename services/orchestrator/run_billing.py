"""The billing records of a run: each model call's tokens (batched by `UsageBatcher`) and each
tool call's catalogue cost (`Redelivery`), idempotent, so a retry only replays."""

from __future__ import annotations

import asyncio
from typing import Any

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from services.orchestrator.providers.base import TokenUsage, ToolCallRequest
from services.orchestrator.run_state import RunSpec, RunTotals
from services.orchestrator.usage.batches import UsageBatcher
from services.orchestrator.usage.redelivery import Redelivery


class RunBilling:
    """The billing records of `TurnRunner`, mixed into it (no delegating layer on the loop's
    path). Uses the runner's `usage` batcher, `billing` stub and `redelivery`."""

    usage: UsageBatcher
    billing: billing_pb2_grpc.BillingServiceStub
    redelivery: Redelivery

    def _record_usage_later(
        self, spec: RunSpec, totals: RunTotals, call_index: int, usage: TokenUsage
    ) -> None:
        """Queue a model call's usage for billing (`UsageBatcher`) without holding up the loop;
        `_finish` stores what still waits in the transaction of the run's end (`UsageBatcher.take`)
        and waits for what is on its way, so every record is with billing or stored before the
        run's terminal event."""
        totals.pending_writes.append(self.usage.add(self._usage_request(spec, call_index, usage)))

    async def _record_usage(self, spec: RunSpec, call_index: int, usage: TokenUsage) -> None:
        """Record one model call's tokens with billing now and wait for it (idempotent by run and
        call index; bounded retries, a last failure logged)."""
        done = self.usage.add(self._usage_request(spec, call_index, usage))
        self.usage.flush()
        await asyncio.shield(done)

    @staticmethod
    def _usage_request(
        spec: RunSpec, call_index: int, usage: TokenUsage
    ) -> billing_pb2.RecordUsageRequest:
        return billing_pb2.RecordUsageRequest(
            organization_id=spec.organization_id,
            run_id=spec.run_id,
            call_index=call_index,
            provider_id=spec.llm.get("provider_id", ""),
            model_id=spec.llm.get("model_id", ""),
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            byok=bool(spec.llm.get("credential_id")),
            estimated=usage.estimated,
            chat_id=spec.chat_id,
        )

    async def _record_tool_usage(
        self, spec: RunSpec, call: ToolCallRequest, millicredits: int
    ) -> None:
        """Charge a tool call's catalogue cost with billing (idempotent by run and tool call;
        bounded retries)."""
        detail = ""
        if call.name == "execute_integration_tool":
            detail = f"{call.input.get('integration', '')}.{call.input.get('action', '')}"
        request = billing_pb2.RecordToolUsageRequest(
            organization_id=spec.organization_id,
            run_id=spec.run_id,
            tool_call_id=call.id,
            tool=call.name,
            detail=detail[:200],
            millicredits=millicredits,
            chat_id=spec.chat_id,
        )
        await self._send_to_billing(
            "RecordToolUsage", request, "recording tool usage failed", tool_call_id=call.id
        )

    async def _send_to_billing(
        self, method: str, request: Any, failure_message: str, **log_fields: Any
    ) -> None:
        """Call the idempotent billing RPC `method` (`Redelivery.send_or_store`: quick retries, then
        WARNING with `log_fields` and stored, sent again in the background across restarts; ERROR
        `failure_message` only if it is finally given up), never raised. Run as a task of its
        own (see `_execute`), so a cancel of the run does not cut it off."""
        rpc = getattr(self.billing, method)
        await self.redelivery.send_or_store(
            method,
            request,
            lambda timeout: rpc(request, timeout=timeout),
            failure_message,
            [log_fields],
        )
