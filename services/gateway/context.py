"""What the gateway's routes share: settings, the stubs, the callers' authentication.

One `GatewayContext` is built by `create_app` (application.py) and kept in `app.state.context`,
where the endpoints of `routes/` find it (`context_of`); the lean handlers of hot_path.py are
built with it.
"""

from __future__ import annotations

from cachetools import LRUCache
from fastapi import Request
from fastapi.responses import JSONResponse

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from loopline.billing.v1 import billing_pb2_grpc
from loopline.tools.v1 import tools_pb2_grpc
from services.gateway.config import GatewaySettings
from services.gateway.default_models import DefaultModels
from services.gateway.errors import detail
from services.gateway.fanout import RunFanout
from services.gateway.idempotency import IdempotencyStore
from services.gateway.identity import Authenticator, AuthError, Principal
from services.gateway.ratelimit import RateLimited, RequestLimits


class GatewayContext:
    """The shared state of the routes.

    Attributes:
        settings: the gateway's settings (`max_body_bytes` bounds JSON bodies).
        authenticator: API keys and sessions (a credential's `created_by_email` reads users).
        limits: every authentication, through the per-key and per-client limits.
        orchestrator: the orchestrator's stub.
        idempotency: the Idempotency-Key records of turn POSTs.
        default_models: the organizations' saved default models.
        fanout: the listeners of each run's event stream.
        tools: the tools service's stub (None: no credentials or knowledge routes).
        billing: billing's stub, set by `create_app` when it has a billing channel (None: no
            usage route).
    """

    __slots__ = (
        "authenticator",
        "billing",
        "default_models",
        "fanout",
        "idempotency",
        "limits",
        "orchestrator",
        "settings",
        "tools",
        "_callers",
    )

    def __init__(
        self,
        settings: GatewaySettings,
        authenticator: Authenticator,
        limits: RequestLimits,
        orchestrator: assistant_pb2_grpc.AssistantServiceStub,
        idempotency: IdempotencyStore,
        default_models: DefaultModels,
        fanout: RunFanout,
        tools: tools_pb2_grpc.ToolsServiceStub | None,
    ) -> None:
        self.settings = settings
        self.authenticator = authenticator
        self.limits = limits
        self.orchestrator = orchestrator
        self.idempotency = idempotency
        self.default_models = default_models
        self.fanout = fanout
        self.tools = tools
        self.billing: billing_pb2_grpc.BillingServiceStub | None = None
        # built once per principal (only ever copied into requests); least recently used out
        # past 10,000
        self._callers: LRUCache[Principal, assistant_pb2.Caller] = LRUCache(10_000)

    async def principal(self, request: Request) -> Principal:
        """The authenticated caller of `request`; raises AuthError (401, 403, 429)."""
        return await self.limits.authenticate(
            request.scope,
            request.headers.get("authorization"),
            request.headers.get("x-organization-id"),
        )

    async def member(self, request: Request) -> Principal:
        """The caller of a route any member may call, X-Organization-ID optional
        (`Authenticator.identify`, under the same limits); raises AuthError (401, 403, 429)."""
        return await self.limits.authenticate(
            request.scope,
            request.headers.get("authorization"),
            request.headers.get("x-organization-id"),
            member=True,
        )

    def caller(self, who: Principal) -> assistant_pb2.Caller:
        """The orchestrator's Caller message of `who` (cached)."""
        built = self._callers.get(who)
        if built is None:
            built = self._callers[who] = assistant_pb2.Caller(
                organization_id=who.organization_id, user_id=who.user_id
            )
        return built


def context_of(request: Request) -> GatewayContext:
    """The GatewayContext of the app serving `request`."""
    context: GatewayContext = request.app.state.context
    return context


async def authenticate(request: Request) -> Principal:
    """FastAPI dependency: the authenticated caller of `request` (AuthError 401, 403, 429)."""
    context: GatewayContext = request.app.state.context
    return await context.principal(request)


def auth_error_response(error: AuthError) -> JSONResponse:
    """`{"detail": ...}` with the status of `error` (401 adds `WWW-Authenticate: Bearer`); a rate
    limit's refusal (ratelimit.py) is the rate denial envelope with 429."""
    if isinstance(error, RateLimited):
        return error.response()
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return detail(error.status, error.detail, headers)
