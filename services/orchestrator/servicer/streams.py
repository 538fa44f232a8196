"""StreamRun: a run's events from `after`, then live, in batches or one per message; StreamRuns:
the same for many runs over one call."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from loopline.assistant.v1 import assistant_pb2
from services.common import ids
from services.common.errors import RpcError, abort
from services.orchestrator.eventlog import StreamInterrupted
from services.orchestrator.servicer.access import ChatAccess
from services.orchestrator.servicer.errors import not_found, stream
from services.orchestrator.servicer.run_streams import MAX_RUN_BATCH, RunStreams, pieces

STREAM_READY = "x-loopline-stream"  # initial metadata sent once a StreamRun request is validated


class Streams(ChatAccess):
    """StreamRun and StreamRuns of the servicer."""

    async def _refusal(self, request: assistant_pb2.StreamRunRequest) -> RpcError | None:
        """Why a request to stream a run is refused, or None (StreamRun's and StreamRuns' check).

        A run active in this process is checked against its RunSpec (its chat cannot be deleted
        while it runs); any other run against the database (store.stream_target).
        """
        active = self.runner.active.get(request.run_id)
        if (
            active is None
            or active.spec.chat_id != request.chat_id
            or active.spec.organization_id != request.caller.organization_id
        ):
            target: Any = None  # a store.stream_target row
            if ids.is_row_id(request.chat_id):
                target = await self.store.stream_target(
                    request.chat_id, request.run_id if ids.is_row_id(request.run_id) else ""
                )
            if not self._visible(target, request.caller):
                return not_found()
            if target.run_chat_id is None:
                return not_found("Run")
        if request.after < 0:
            return RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_AFTER", "after must be >= 0")
        return None

    @stream
    async def StreamRuns(
        self,
        requests: AsyncIterator[assistant_pb2.StreamRunsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncGenerator[assistant_pb2.StreamRunsResponse, None]:
        """Follow many runs over one call (run_streams.py)."""
        async with contextlib.aclosing(
            RunStreams(self._refusal, self.runner.events).serve(requests)
        ) as out:
            async for response in out:
                yield response

    @stream
    async def StreamRun(
        self, request: assistant_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[assistant_pb2.StreamRunResponse, None]:
        """Replay the run's events from `after`, then follow live; ends after a terminal event."""
        refusal = await self._refusal(request)
        if refusal is not None:
            await abort(context, refusal)
            return
        await context.send_initial_metadata(((STREAM_READY, "1"),))
        try:
            if (
                request.max_batch > 1
            ):  # every event available at once in one message (EventLog.follow_batches)
                limit = min(int(request.max_batch), MAX_RUN_BATCH)
                async with contextlib.aclosing(
                    self.runner.events.follow_batches(request.run_id, int(request.after))
                ) as batches:
                    async for batch in batches:
                        for piece in pieces(batch, limit):
                            yield assistant_pb2.StreamRunResponse(events=piece)
            else:
                async with contextlib.aclosing(
                    self.runner.events.follow(request.run_id, int(request.after))
                ) as events:
                    async for event in events:
                        yield assistant_pb2.StreamRunResponse(event=event)
        except (
            StreamInterrupted
        ) as interrupted:  # the gateway gives each listener its own reconnect frame
            await abort(
                context,
                RpcError(grpc.StatusCode.UNAVAILABLE, "STREAM_INTERRUPTED", interrupted.message),
            )
