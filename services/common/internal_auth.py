"""Service-to-service authentication: one shared bearer token on every internal gRPC call.

The services trust the caller a request names (`Caller{organization_id, user_id}`, put
there by the gateway after it checked the API key), and the tools service hands credential
secrets to the orchestrator (`ResolveCredentialSecret`). Their gRPC ports must therefore be
reachable by the other services only. On one machine the default bind address (LOOPLINE_HOST
127.0.0.1) does that; when replicas talk across machines, set LOOPLINE_INTERNAL_TOKEN to the
same secret on every service: each gRPC server then refuses any call that does not carry
`authorization: Bearer <token>` with UNAUTHENTICATED (grpc.health.v1 checks excepted, for
probes), and every internal client channel sends it. The token is compared in constant
time and never logged. It authenticates, it does not encrypt: across untrusted networks put
the ports behind TLS as well (a service mesh or a tunnel).

Empty (the default) turns the check off, as before.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.common import tracing
from services.common.request_ids import RequestIdChannel

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_REFUSED = "missing or wrong internal token"
REFUSAL_LOG_INTERVAL_S = (
    60.0  # a refused method is logged at most this often (a misconfigured peer retries a lot)
)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that aborts with UNAUTHENTICATED. The status carries no
    ErrorInfo on purpose: a gateway that relays it answers 500 (a deployment fault), not 401."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # pragma: no cover - abort raises

    kinds = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kinds)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kinds)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kinds)
    return grpc.stream_stream_rpc_method_handler(stream, **kinds)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Server side: let a call through only with `authorization: Bearer <token>` (health
    excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._logged: dict[str, float] = {}  # method -> monotonic time it was last logged

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return handler
        self._log_refusal(
            handler_call_details.method,
            any(
                key == "authorization" for key, _ in handler_call_details.invocation_metadata or ()
            ),
        )
        return _refusing(handler)

    def _log_refusal(self, method: str, had_token: bool) -> None:
        """WARNING (at most once a REFUSAL_LOG_INTERVAL_S per method) that a call was refused, so a
        replica with another LOOPLINE_INTERNAL_TOKEN shows in the logs of the one refusing it
        (its health checks pass all the same). Never the token."""
        now = time.monotonic()
        if now - self._logged.get(method, -REFUSAL_LOG_INTERVAL_S) < REFUSAL_LOG_INTERVAL_S:
            return
        self._logged[method] = now
        log.warning(
            "refused an internal call: %s internal token",
            "wrong" if had_token else "no",
            extra={
                "fields": {
                    "method": method,
                    "fix": "set the same LOOPLINE_INTERNAL_TOKEN on every service",
                }
            },
        )


class _SendToken:
    """Client side: add `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(
            *(tuple(details.metadata) if details.metadata else ()), self._pair
        )
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per call kind: grpc.aio files an interceptor under the first call kind it implements
# only.
class _SendTokenUnary(_SendToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _SendTokenStream(_SendToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _SendTokenBidi(_SendToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), requests)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a gRPC server needs for `token` (none when it is empty)."""
    return [TokenCheck(token)] if token else []


#: Calls spread over every address the target resolves to (a DNS name with several A records,
#: as a Kubernetes headless Service gives, or an `ipv4:a:p,b:p` list); gRPC's default,
#: pick_first, sends them all to one.
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def internal_channel(
    target: str,
    token: str,
    options: Sequence[tuple[str, Any]] = (),
    keepalive: tuple[float, float] = (10.0, 5.0),
) -> grpc.aio.Channel:
    """An insecure channel to another Loopline service that sends `token` when it is set.

    Round-robin over the target's addresses. `keepalive` = (seconds, timeout seconds): each
    replica is pinged after that many seconds without a ping (LOOPLINE_GRPC_KEEPALIVE_S), also
    while no call is open, so one that stalls (SIGSTOP, a host gone) is dropped from the round
    once its answer is the timeout late (LOOPLINE_GRPC_KEEPALIVE_TIMEOUT_S). Calls send the
    bound request id (request_ids.py)."""
    # the trace context (tracing on only), then the token
    interceptors: list[grpc.aio.ClientInterceptor] = tracing.client_interceptors()
    if token:
        interceptors += [_SendTokenUnary(token), _SendTokenStream(token), _SendTokenBidi(token)]
    channel_options = [
        ("grpc.service_config", ROUND_ROBIN),
        ("grpc.keepalive_time_ms", round(keepalive[0] * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive[1] * 1000)),
        # any ping's (gRPC's own bandwidth probes too: a keepalive ping waits behind one)
        ("grpc.http2.ping_timeout_ms", round(keepalive[1] * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # a replica that went away is tried again soon and at least every 5 s once it is back
        # (gRPC's defaults: 1 s, growing to 120 s, all that time out of the round)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        *options,
    ]
    return RequestIdChannel(
        grpc.aio.insecure_channel(
            target, options=channel_options, interceptors=interceptors or None
        )
    )


__all__ = ["TokenCheck", "internal_channel", "server_interceptors"]
