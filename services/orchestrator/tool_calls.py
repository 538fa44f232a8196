"""The act step of the loop: one tool call, run by the tools service or asked of the user.

A call whose input cannot be used is not run (`checked_call`: its error result instead); a HITL
tool pauses the run on its question (`_ask`); any other goes to the tools service (`_act`),
whose failures become the call's error result, so the model can answer without it. The tool
definitions the model is given are cached here (`tool_definitions`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
from google.protobuf import struct_pb2

from loopline.assistant.v1 import events_pb2
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import pb
from services.orchestrator import hitl
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.eventlog import EventLog
from services.orchestrator.models import utcnow
from services.orchestrator.providers.base import ToolCallRequest
from services.orchestrator.run_billing import RunBilling
from services.orchestrator.run_state import RunSpec, RunTotals, new_event

log = logging.getLogger(__name__)

UNREADABLE_RESULT = (
    "the tool's result could not be read (its response could not be decoded); the call may have run"
)
TOOL_LIST_TIMEOUT_S = 2.0  # deadline of ListTools at a run's start (`tool_definitions`)
TOOL_LIST_RETRY_S = 5.0  # wait before ListTools is asked again after it failed
#: The error result of a tool call the tools service failed (`_execute`), by gRPC status.
TOOLS_FAILED = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "the tool did not answer in time; the call may have run",
    grpc.StatusCode.UNAVAILABLE: "the tools service is unavailable; try again later",
}
CUT_OFF_CALL = "the tools service went away during the call; the call may have run"


def tools_failure(failure: grpc.aio.AioRpcError) -> str:
    """The error result of a tool call the tools service failed (`TOOLS_FAILED` by status code).

    UNAVAILABLE covers two cases gRPC tells apart only in its details: the service could not
    be reached (no connection: the call was never sent, so trying later is safe) and a
    connection lost during the call (the service crashed or stopped: the action may have
    happened, so the model must not be told to simply repeat it). Anything but a failed
    connection counts as the second."""
    code = failure.code()
    if (
        code == grpc.StatusCode.UNAVAILABLE
        and "failed to connect" not in (failure.details() or "").lower()
    ):
        return CUT_OFF_CALL
    return TOOLS_FAILED.get(code, f"the tools service failed ({code.name.lower()})")


def checked_call(call: ToolCallRequest) -> tuple[ToolCallRequest, struct_pb2.Struct, str | None]:
    """`call` with its input as a Struct, checked against the depth rule of services/common/pb.py.

    Returns (call, input Struct, None); for input nested deeper than `pb.MAX_JSON_DEPTH` levels
    (which the tools service, the event stream and GetChat could not decode), (the call with a
    clipped copy of its input, that copy as a Struct, the error the model gets as the call's
    result): the call is not run, and the thread, the `tool_call` event and done.tool_calls keep
    the clipped copy (deeper parts as their JSON text), so everything stored or published stays
    decodable. One walk of the input when it fits (to_struct measures while it builds).
    A call whose arguments could not be read as a JSON object (`call.unreadable`: invalid
    JSON, an array, a string) has the input {} and that reason as its error: not run either.
    """
    if call.unreadable:
        error = (
            f"Invalid input for {call.name}: {call.unreadable}; the call was not run. "
            "Send the input as a JSON object."
        )
        return call, struct_pb2.Struct(), error
    try:
        return call, pb.to_struct(call.input), None
    except pb.JsonTooDeep as deep:
        kept = pb.clipped(call.input)
        error = (
            f"Invalid input for {call.name}: {deep}; the call was not run. Send a flatter input."
        )
        return dataclasses.replace(call, input=kept), pb.to_struct(kept), error


def failure_result(error: str) -> tuple[dict[str, Any], bool, bytes]:
    """A failed tool call's result: ({"error": error, "success": False}, False, that as JSON
    text)."""
    output = {"error": error, "success": False}
    return output, False, pb.json_bytes(output)


@dataclass(slots=True)
class ToolStep:
    """The tool call a reason step chose, checked, for the act step."""

    call: ToolCallRequest
    input: struct_pb2.Struct  # the call's input for ExecuteTool
    input_json: bytes  # the model's JSON, as the events, done and the tool get it
    invalid: str | None  # why the call is not run (its error result), or None
    asks_user: bool  # a HITL tool with a usable input: the run pauses on its question


class ToolActing(RunBilling):
    """The act step of `TurnRunner`, mixed into it (no delegating layer on the loop's path).
    Uses the runner's `settings`, `tools` stub, `events` and its cache of tool definitions."""

    settings: OrchestratorSettings
    tools: tools_pb2_grpc.ToolsServiceStub
    events: EventLog
    _tool_defs: list[dict[str, Any]] | None
    _tool_defs_at: float
    _tool_defs_retry_at: float

    async def tool_definitions(self) -> list[dict[str, Any]]:
        """The assistant profile's tools: the tools service's five plus the five HITL tools
        (cached 60 s).

        A tools service that does not answer ListTools within TOOL_LIST_TIMEOUT_S (stalled, down)
        does not fail the run: the definitions of the last answer are used, or the HITL tools
        alone when there was none yet, and it is asked again TOOL_LIST_RETRY_S later (so turns
        started meanwhile do not each wait for it). A tool call then gets the tools service's
        error result like any other (`_act`).
        """
        now = time.monotonic()
        if (
            self._tool_defs is None or now - self._tool_defs_at > 60
        ) and now >= self._tool_defs_retry_at:
            try:
                response = await self.tools.ListTools(
                    tools_pb2.ListToolsRequest(profile="assistant"), timeout=TOOL_LIST_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as failure:
                self._tool_defs_retry_at = time.monotonic() + TOOL_LIST_RETRY_S
                log.warning(
                    "listing the tools failed; the run goes on with the tools known",
                    extra={
                        "fields": {
                            "code": failure.code().name,
                            "known": "last answer"
                            if self._tool_defs is not None
                            else "HITL tools only",
                        }
                    },
                )
                return (
                    self._tool_defs if self._tool_defs is not None else list(hitl.TOOL_DEFINITIONS)
                )
            remote = [
                {
                    "name": t.name,
                    "description": t.description,
                    "input_schema": pb.from_struct(t.input_schema),
                }
                for t in response.tools
                if t.name not in hitl.TOOL_KINDS
            ]
            self._tool_defs = remote + hitl.TOOL_DEFINITIONS
            self._tool_defs_at = time.monotonic()
        return self._tool_defs if self._tool_defs is not None else list(hitl.TOOL_DEFINITIONS)

    def _publish_call(self, spec: RunSpec, act: ToolStep) -> None:
        """Publish the `tool_call` event of the call the act step takes."""
        self.events.append(
            new_event(
                spec.run_id,
                tool_call=events_pb2.ToolCallEvent(
                    tool=act.call.name, input_json=act.input_json, tool_call_id=act.call.id
                ),
            )
        )

    async def _act(
        self, spec: RunSpec, totals: RunTotals, act: ToolStep
    ) -> tuple[Any, bool, bytes]:
        """The act step: run one non-HITL tool through the tools service (a call whose input
        was refused, `act.invalid`, is not run: its error result is observed like any other).

        Returns (output as JSON, succeeded, output as JSON text): the tools service's JSON text
        (`output_json`; an older server's `output` Value converted once) is passed on to the
        events as it came, parsed once for the thread and the model. A response that cannot be
        decoded (grpc.aio then logs "Exception deserializing message!" and gives None), or an
        output that is not JSON, is the call's error result like any failed call, never a
        crashed run; its cost is unknown, so nothing is charged for it. A call the tools service
        fails (grpc.aio.AioRpcError: it did not answer within `tool_timeout_s`, is down, or
        failed inside) is the call's error result too (`tools_failure`), so the model can answer
        without it; the run goes on.
        """
        if act.invalid is not None:
            return failure_result(act.invalid)
        call = act.call
        # input_json: the model's numbers exact (a Struct holds doubles)
        request = tools_pb2.ExecuteToolRequest(
            organization_id=spec.organization_id,
            tool=call.name,
            input=act.input,
            input_json=act.input_json,
            run_id=spec.run_id,
            tool_call_id=call.id,
            chat_id=spec.chat_id,
        )
        try:
            response = await self.tools.ExecuteTool(request, timeout=self.settings.tool_timeout_s)
        except grpc.aio.AioRpcError as failure:
            code = failure.code()
            log.warning(
                "the tools service failed a tool call",
                extra={"fields": {"tool": call.name, "tool_call_id": call.id, "code": code.name}},
            )
            return failure_result(tools_failure(failure))
        if not isinstance(response, tools_pb2.ExecuteToolResponse):
            log.warning(
                "tool response could not be decoded",
                extra={"fields": {"tool": call.name, "tool_call_id": call.id}},
            )
            return failure_result(UNREADABLE_RESULT)
        # charged beside the run, which waits for it at its end (`_finish`)
        if response.millicredits > 0:
            totals.pending_writes.append(
                asyncio.ensure_future(self._record_tool_usage(spec, call, response.millicredits))
            )
        if response.success:
            # the tools service's JSON text, passed on to the events as it came
            raw = pb.output_json(response)
            try:
                return orjson.loads(raw), True, raw
            except orjson.JSONDecodeError:
                log.warning(
                    "tool output is not JSON",
                    extra={"fields": {"tool": call.name, "tool_call_id": call.id}},
                )
                return failure_result(UNREADABLE_RESULT)
        return failure_result(response.error or "the tool failed")

    async def _ask(self, spec: RunSpec, totals: RunTotals, act: ToolStep) -> dict[str, Any] | None:
        """Prepare the HITL question of `act` (its audit row is written with the run's end) and
        return it; None when the question is malformed: its error result joins the thread, is
        published and counts as a failed tool call."""
        call = act.call
        request_id = str(uuid.uuid4())
        try:
            integration = None
            if call.name == "request_credential":
                # before looking the integration up
                problems = hitl.input_problems(call.name, call.input)
                if problems:
                    raise ValueError(problems)
                integration = await self._integration_info(spec, call.input["integration"])
            request = hitl.build_request(call.name, call.input, request_id, integration)
        except ValueError as invalid:
            output = {"error": f"invalid question: {invalid}", "success": False}
            totals.add_tool_result(spec, call.id, call.name, output)
            self.events.append(
                new_event(
                    spec.run_id,
                    tool_result=events_pb2.ToolResultEvent(
                        tool=call.name, tool_call_id=call.id, output_json=pb.json_bytes(output)
                    ),
                )
            )
            totals.pending_call = None
            totals.tool_calls.append(
                events_pb2.ToolCallRecord(
                    tool=call.name, input_json=act.input_json, output_json=pb.json_bytes(output)
                )
            )
            return None
        now = utcnow()
        totals.interrupt = {
            "id": request_id,
            "chat_id": spec.chat_id,
            "run_id": spec.run_id,
            "tool_call_id": call.id,
            "tool": call.name,
            "kind": request["kind"],
            "request": request,
            "outcome": "pending",
            "created_at": now,
            "expires_at": now + datetime.timedelta(seconds=self.settings.pending_ttl_s),
        }
        totals.pending_call = None
        return request

    async def _integration_info(self, spec: RunSpec, name: str) -> dict[str, Any] | None:
        """What a credential question for integration `name` offers: {display_name, auth_options}
        from the tools service's `get_integration_details`, or None when the tools service cannot
        be asked (the question then offers an API key). Raises ValueError when the answer is that
        no credential can be connected for it: the integration is unknown (the tools service's
        error, with its list of integrations) or takes no credential (`loopline`, an operator's
        MCP server), so the question could only be skipped."""
        if not name.strip():
            return None
        try:
            response = await self.tools.ExecuteTool(
                tools_pb2.ExecuteToolRequest(
                    organization_id=spec.organization_id,
                    tool="get_integration_details",
                    input=pb.to_struct({"integration": name}),
                    run_id=spec.run_id,
                    chat_id=spec.chat_id,
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError:
            return None
        if not isinstance(response, tools_pb2.ExecuteToolResponse):  # undecodable: None
            return None
        if not response.success:
            raise ValueError(response.error or f"the integration {name!r} cannot be looked up")
        try:
            details = pb.output_of(response)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(details, dict):
            return None
        options = []
        for option in details.get("auth_options") or []:
            if not isinstance(option, dict):
                continue
            raw = option.get("type") or option.get("auth_type") or ""
            if raw in ("none", ""):
                continue  # nothing to connect
            # the SDK's CredentialAuthOption literals:
            # oauth2, api_key, bearer_token, modulex_key, custom
            auth_type = {"bearer": "bearer_token"}.get(raw, raw)
            if auth_type not in ("oauth2", "api_key", "bearer_token", "modulex_key", "custom"):
                auth_type = "custom"
            entry: dict[str, Any] = {
                "auth_type": auth_type,
                "display_name": option.get("label") or option.get("display_name") or auth_type,
            }
            if isinstance(option.get("fields"), dict):
                entry["fields"] = [
                    {"name": k, **(v if isinstance(v, dict) else {})}
                    for k, v in (option["fields"].get("properties") or {}).items()
                ]
            if auth_type == "oauth2":
                entry["oauth_initiate_endpoint"] = "/credentials/oauth2/initiate"
            options.append(entry)
        if not options:
            raise ValueError(
                f"the integration {name!r} takes no credential: "
                "use it with execute_integration_tool as it is"
            )
        return {"display_name": details.get("display_name") or name, "auth_options": options}
