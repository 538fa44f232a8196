"""The servicer's errors: NOT_FOUND, downstream failures and the RPC wrappers."""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from services.common import ids
from services.common.errors import ASSISTANT_DOMAIN, RpcError, rpc_handler, stream_rpc_handler
from services.orchestrator.models import Interrupt

# a billing call that ended without an answer: billing may or may not have done its work
OUTCOME_UNKNOWN = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


def not_found(what: str = "Chat") -> RpcError:
    return RpcError(grpc.StatusCode.NOT_FOUND, f"{what.upper()}_NOT_FOUND", f"{what} not found")


# every unary call names a possible organization
unary = rpc_handler(check=ids.request_organization_check(ASSISTANT_DOMAIN))
# StreamRun checks its ids itself: an unknown run is NOT_FOUND whatever the organization id
stream = stream_rpc_handler()


class PassThrough(Exception):
    """A downstream rich status to return unchanged (a billing denial)."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__("pass-through status")
        self.status = status


def downstream_failure(error: grpc.aio.AioRpcError, service: str, unavailable: str) -> RpcError:
    """The error of a turn whose call to billing or the tools service failed with `error` (no answer
    of theirs to pass on): DEADLINE_EXCEEDED `<service>_TIMEOUT` when the call timed out (the
    gateway's 504, README error table: "a downstream timeout"), else UNAVAILABLE
    `<service>_UNAVAILABLE` with the message `unavailable` and a RetryInfo of 1 s (503 with
    Retry-After; a gRPC caller gets the same hint, AIP-194). `service` is "BILLING" or "TOOLS"."""
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        what = "Billing" if service == "BILLING" else "The tools service"
        return RpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{service}_TIMEOUT",
            f"{what} did not answer in time",
        )
    return RpcError(
        grpc.StatusCode.UNAVAILABLE, f"{service}_UNAVAILABLE", unavailable, retry_after_s=1.0
    )


def downstream_status(error: grpc.aio.AioRpcError) -> grpc.Status | None:
    """The rich status of a downstream refusal to pass on unchanged (a billing denial), or None:
    no details, or UNKNOWN (a failure inside the service, whose outcome is unknown: answered
    as that service being unavailable, `downstream_failure`)."""
    if error.code() == grpc.StatusCode.UNKNOWN:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return rpc_status.to_status(status_pb2.Status.FromString(value))
    return None


class Expired(Exception):
    def __init__(self, interrupt: Interrupt) -> None:
        super().__init__("expired")
        self.interrupt = interrupt
