"""The assistant profile's tools that the tools service executes.

Contract (DESIGN.md "A turn, end to end"): the five tools
`get_available_integrations`, `get_integration_details`, `get_organization_credentials`,
`execute_integration_tool` and `search_knowledge`. Every failure is a `ToolResult` with
success=false and a readable, secret-free `error` — never an exception out of
`ToolExecutor.execute` (except asyncio.CancelledError, which must propagate so that a
cancelled tool call stops). The `error` is built from known fields and a kind of failure
(`services/tools/failures.py`), never an exception's own text, which is logged, redacted; an
integration's error and its result both go through the credential's redaction
(`services/common/redaction.py`) before they leave (docs/security.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from services.common import metrics, pb
from services.common.errors import RpcError, bounded
from services.common.redaction import Redactor
from services.common.validation import schema_errors
from services.tools import failures
from services.tools.catalogue import Action, ActionContext, ActionError, Catalogue, Integration
from services.tools.config import ToolsSettings
from services.tools.credentials import CredentialInfo, CredentialStore
from services.tools.crypto import SecretBoxError
from services.tools.knowledge import KnowledgeStore
from services.tools.mcp_client import McpConnector
from services.tools.mcp_servers import (
    MCP_AUTH_TYPE,
    NO_AUTH,
    ORG_SERVER_AUTH,
    StdioRegistry,
    integration_of_tools,
)
from services.tools.netpolicy import OutboundPolicyError
from services.tools.oauth_refresh import CredentialUnusable
from services.tools.tool_definitions import PROFILES, TOOL_DEFINITIONS

log = logging.getLogger(__name__)

# get_available_integrations describes at most this many integrations (see its docstring)
DESCRIBED_AT_MOST = 25

# Room kept for the execute_integration_tool envelope around a capped result.
_ENVELOPE_BYTES = 512


def _is_httpx_error(exc: BaseException) -> bool:
    """Whether `exc` is an httpx.HTTPError (httpx is imported on first use: no httpx error exists
    before)."""
    httpx = sys.modules.get("httpx")
    return httpx is not None and isinstance(exc, httpx.HTTPError)


class ToolError(Exception):
    """A tool failure to report to the model as success=false; the message must be secret-free."""


@dataclass
class ToolResult:
    """The outcome of one tool call, as ExecuteToolResponse carries it.

    Attributes:
        success: whether the tool succeeded.
        output: any JSON value when it succeeded (None otherwise).
        error: a message for the model when it failed.
        millicredits: what the call cost (0 when it failed).
    """

    success: bool
    output: Any = None
    error: str = ""
    millicredits: int = 0


_VALIDATORS = {d["name"]: Draft202012Validator(d["input_schema"]) for d in TOOL_DEFINITIONS}


def _action_of(integration: Integration, name: str) -> Action:
    """The action `name` of `integration`; else a ToolError that lists the actions it has."""
    action = integration.actions.get(name)
    if action is None:
        if not integration.actions:  # e.g. an MCP server whose tools could not be discovered
            raise ToolError(
                f"Integration {integration.name!r} has no actions (an MCP server's are those "
                "its discovery found; refresh it with POST /credentials/{id}/refresh-discovery)."
            )
        names = ", ".join(integration.actions)
        raise ToolError(
            f"Integration {integration.name!r} has no action {name!r}. Its actions: {names}."
        )
    return action


def _log_action_raised(integration: Integration, action: Action, exc: Exception) -> None:
    """Log an unexpected action failure (not an httpx error) with where it was raised; its text
    is left out (it goes to the finish log only, redacted)."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame else "?"
    log.error(
        "integration action raised",
        extra={
            "fields": {
                "integration": integration.name,
                "action": action.name,
                "exc_type": type(exc).__name__,
                "where": where,
            }
        },
    )


def _field_with_nul(tool_input: dict[str, Any]) -> str | None:
    """The first field of a tool's input (`parameters` aside: an action checks its own) that
    holds U+0000 (`pb.holds_nul`), else None. These fields name things the
    tools service looks up in its database, and PostgreSQL's text takes no NUL (an internal
    error there, "not found" on SQLite); the gateway refuses NUL in request bodies the same
    way."""
    return next(
        (
            name
            for name, value in tool_input.items()
            if name != "parameters" and pb.holds_nul(value)
        ),
        None,
    )


def cap_result(result: Any, max_bytes: int) -> tuple[Any, bool, int]:
    """`result`, or its JSON text cut to fit `max_bytes` with a truncation marker.

    Returns (value, truncated, original size in bytes of its compact UTF-8 JSON).
    A cut result is a string: the first bytes of the JSON text (cut on a character
    boundary) followed by "…[output truncated: N bytes exceed the limit of M bytes ...]".
    """
    try:
        encoded = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode()
    except (
        UnicodeEncodeError
    ):  # a lone surrogate (a web page's "\ud800"): U+FFFD instead (pb.scrub)
        result = pb.scrub(result)
        encoded = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode()
    if len(encoded) <= max_bytes:
        return result, False, len(encoded)
    marker = (
        f"…[output truncated: {len(encoded)} bytes exceed the limit of {max_bytes} bytes; "
        "narrow the request (fewer rows, a LIMIT, a smaller range) to see the rest]"
    )
    budget = max(0, max_bytes - len(marker.encode()))
    head = encoded[:budget].decode("utf-8", errors="ignore")
    return head + marker, True, len(encoded)


class ToolExecutor:
    """Runs the five tools for an organization.

    Args:
        settings: timeouts, output cap, outbound policy, search cost.
        catalogue: the integrations.
        credentials: the credential store.
        knowledge: the knowledge store.
        mcp: the MCP connector (organization servers); default: one from `settings`.
        stdio: the operator's stdio MCP servers; default: none.
    """

    def __init__(
        self,
        settings: ToolsSettings,
        catalogue: Catalogue,
        credentials: CredentialStore,
        knowledge: KnowledgeStore,
        mcp: McpConnector | None = None,
        stdio: StdioRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.catalogue = catalogue
        self.credentials = credentials
        self.knowledge = knowledge
        self.mcp = mcp or McpConnector(
            settings.tools_timeout_s,
            settings.tools_max_output_bytes,
            settings.tools_allow_private_network,
        )
        self.stdio = stdio or StdioRegistry([], self.mcp)
        self._handlers = {
            "get_available_integrations": self.get_available_integrations,
            "get_integration_details": self.get_integration_details,
            "get_organization_credentials": self.get_organization_credentials,
            "execute_integration_tool": self.execute_integration_tool,
            "search_knowledge": self.search_knowledge,
        }

    @staticmethod
    def definitions(profile: str) -> list[dict[str, Any]]:
        """The tool definitions of `profile` (one of PROFILES, or "" for "assistant"); [] for any
        other profile (ListTools refuses those first: INVALID_ARGUMENT UNKNOWN_PROFILE)."""
        return TOOL_DEFINITIONS if profile in ("", *PROFILES) else []

    async def execute(self, org_id: str, tool: str, tool_input: dict[str, Any]) -> ToolResult:
        """Run `tool` with `tool_input` for `org_id`; never raises except asyncio.CancelledError."""
        handler = self._handlers.get(tool)
        if handler is None:
            names = ", ".join(self._handlers)
            return ToolResult(
                False, error=f"Unknown tool {tool!r}. The tools service executes: {names}."
            )
        if not org_id:
            return ToolResult(False, error="No organization given for this tool call.")
        problems = schema_errors(_VALIDATORS[tool], tool_input, "input")
        if problems:
            return ToolResult(False, error=f"Invalid input for {tool}: {problems}")
        nul = _field_with_nul(tool_input)
        if nul is not None:
            return ToolResult(
                False, error=f"Invalid input for {tool}: input.{nul}: must not contain U+0000 (NUL)"
            )
        try:
            return await handler(org_id, tool_input)
        except ToolError as exc:
            return ToolResult(False, error=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool failure is a result, never a failed RPC
            log.exception(
                "tool failed unexpectedly",
                extra={"fields": {"tool": tool, "exc_type": type(exc).__name__}},
            )
            return ToolResult(
                False, error=f"{tool} failed because of an internal error; try again later."
            )

    async def get_available_integrations(self, org_id: str, args: dict[str, Any]) -> ToolResult:
        """{"integrations": [{"name", "display_name", "description", "categories", "connected",
        "auth_types"}], "count"}; past DESCRIBED_AT_MOST integrations, each without its
        description and categories, and a `note` that says how to narrow the list (the whole
        catalogue described is ~60 KB, too much for a model's context)."""
        category = (args.get("category") or "").strip().lower()
        query = (args.get("query") or "").strip().lower()
        connected = await self.credentials.connected_integrations(org_id)
        items = []
        for integration in await self.visible_integrations(org_id):
            if category and category not in (c.lower() for c in integration.categories):
                continue
            if query and query not in (
                f"{integration.name} {integration.display_name} {integration.description}".lower()
            ):
                continue
            auth_types = integration.auth_types
            items.append(
                {
                    "name": integration.name,
                    "display_name": integration.display_name,
                    "description": integration.description,
                    "categories": list(integration.categories),
                    "connected": integration.name in connected or auth_types == ["none"],
                    "auth_types": auth_types,
                }
            )
        output: dict[str, Any] = {"integrations": items, "count": len(items)}
        if len(items) > DESCRIBED_AT_MOST:
            for item in items:
                del item["description"], item["categories"]
            output["note"] = (
                f"{len(items)} integrations, listed without descriptions: call again with a query "
                "or a category to describe fewer, or get_integration_details for one."
            )
        return ToolResult(True, output=output)

    async def visible_integrations(self, org_id: str) -> list[Integration]:
        """The integrations `org_id` sees, in listing order: the catalogue's, the operator's stdio
        MCP servers (without their actions: discovered on first use) and the organization's own
        MCP servers (shared by get_available_integrations and GET /integrations, listing.py)."""
        listed = list(self.catalogue.all())
        listed += [
            Integration(s.name, s.name, self.stdio.describe(s), ("mcp",), NO_AUTH, {}, source="mcp")
            for s in self.stdio.servers.values()
        ]
        listed += [
            self.org_mcp_integration(info, tools)
            for info, tools in await self.credentials.of_auth_type(org_id, MCP_AUTH_TYPE)
        ]
        return listed

    async def get_integration_details(self, org_id: str, args: dict[str, Any]) -> ToolResult:
        """{"name", "display_name", "description", "categories", "connected", "requires_credential",
        "auth_options": [{"type", "label", "description", "fields"}],
        "actions": [{"name", "description", "parameters", "credit_cost_millicredits"}]}."""
        integration = await self._integration(org_id, args["integration"])
        connected = integration.name in await self.credentials.connected_integrations(org_id)
        return ToolResult(
            True,
            output={
                "name": integration.name,
                "display_name": integration.display_name,
                "description": integration.description,
                "categories": list(integration.categories),
                "connected": connected or integration.auth_types == ["none"],
                "requires_credential": integration.requires_credential,
                "auth_options": [o.to_json() for o in integration.auth_options],
                "actions": [a.to_json() for a in integration.actions.values()],
            },
        )

    async def get_organization_credentials(self, org_id: str, args: dict[str, Any]) -> ToolResult:
        """{"credentials": [{"id", "integration", "auth_type", "display_name", "is_default",
        "created_at", "updated_at"}], "count"} — metadata only, newest first (at most 500)."""
        infos, total = await self.credentials.list(
            org_id, integration_name=args.get("integration") or "", limit=500
        )
        return ToolResult(
            True, output={"credentials": [i.to_tool_json() for i in infos], "count": total}
        )

    async def execute_integration_tool(self, org_id: str, args: dict[str, Any]) -> ToolResult:
        """{"integration", "action", "credential_id" (or null), "result", "truncated",
        "result_bytes"}.

        `result` is the action's output (see each integration's handler), or, when its
        JSON exceeds the output cap, a string cut with a truncation marker. Costs the
        action's `credit_cost_millicredits` when it succeeds, nothing when it fails.
        """
        integration = await self._integration(org_id, args["integration"])
        action = _action_of(integration, args["action"])
        parameters = args.get("parameters") or {}
        problems = schema_errors(action.validator, parameters, "parameters")
        if problems:
            raise ToolError(
                f"Invalid parameters for {integration.name}.{action.name}: {problems}. "
                "See get_integration_details for the schema."
            )
        resolved = await self._credential_for(org_id, integration, args.get("credential_id"))
        info, secret = resolved if resolved is not None else (None, None)
        result = await self._run_action(org_id, integration, action, parameters, info, secret)
        budget = max(256, self.settings.tools_max_output_bytes - _ENVELOPE_BYTES)
        value, truncated, size = cap_result(result, budget)
        return ToolResult(
            True,
            output={
                "integration": integration.name,
                "action": action.name,
                "credential_id": info.id if info else None,
                "result": value,
                "truncated": truncated,
                "result_bytes": size,
            },
            millicredits=action.credit_cost_millicredits,
        )

    async def _credential_for(
        self, org_id: str, integration: Integration, credential_id: str | None
    ) -> tuple[CredentialInfo, dict[str, Any]] | None:
        """The credential (and its secret) an action of `integration` runs with: the one named by
        `credential_id`, else the integration's default; None when it needs none. An oauth2
        credential's access token is renewed first when it expires soon (oauth_refresh.py). Raises
        ToolError when a named or required credential is missing, cannot be decrypted, or must be
        connected again (or renewed later)."""
        try:
            # An integration without a secret auth type (e.g. loopline) can have no credential
            # (CreateCredential refuses one), so there is nothing to look up unless an id is named.
            if credential_id or integration.secret_auth_types:
                resolved = await self.credentials.resolve(org_id, integration.name, credential_id)
            else:
                resolved = None
            refresher = self.credentials.refresher
            if resolved is not None and refresher is not None:
                resolved = await refresher.usable(*resolved)
        except CredentialUnusable as exc:  # its text is built for the model, from known fields
            raise ToolError(str(exc)) from None
        except SecretBoxError as exc:
            raise ToolError(
                f"The stored {integration.name} credential cannot be decrypted; ask the user to "
                "connect it again with request_credential."
            ) from exc
        if resolved is None and (credential_id or integration.requires_credential):
            needed = [t for t in integration.auth_types if t != "none"]
            if credential_id:
                raise ToolError(
                    f"Credential {credential_id!r} was not found for integration "
                    f"{integration.name!r} in this organization. Call get_organization_credentials "
                    "to see the connected ones, or call request_credential to ask the user to "
                    "connect one."
                )
            raise ToolError(
                f"No credential for integration {integration.name!r} is connected in this "
                "organization. Call request_credential to ask the user to connect one (auth types: "
                f"{', '.join(needed)})."
            )
        return resolved

    async def _run_action(
        self,
        org_id: str,
        integration: Integration,
        action: Action,
        parameters: dict[str, Any],
        info: CredentialInfo | None,
        secret: dict[str, Any] | None,
    ) -> Any:
        """Run `action` under the tools timeout, log how it ended, and return its result with the
        credential redacted. Every failure becomes a secret-free ToolError (a cancel propagates)."""
        context = ActionContext(
            secret=secret,
            auth_type=info.auth_type if info else "none",
            timeout_s=self.settings.tools_timeout_s,
            max_output_bytes=self.settings.tools_max_output_bytes,
            allow_private_network=self.settings.tools_allow_private_network,
        )
        started = time.monotonic()
        outcome = "error"
        cause: BaseException | None = None
        redactor = Redactor(secret)
        try:
            async with asyncio.timeout(self.settings.tools_timeout_s):
                result = await action.handler(context, parameters)
            outcome = "ok"
        except TimeoutError as exc:
            outcome = "timeout"
            raise ToolError(
                f"{integration.name}.{action.name} timed out after "
                f"{self.settings.tools_timeout_s:g} s and was stopped."
            ) from exc
        # built by the integration from known fields; redacted all the same (defence in depth)
        except ActionError as exc:
            cause = exc.__cause__
            raise ToolError(
                f"{integration.name}.{action.name} failed: {redactor.text(str(exc))}"
            ) from exc
        # an MCP server's host: the organization's, not the model's, so not named
        except OutboundPolicyError as exc:
            raise ToolError(
                f"{integration.name}.{action.name} refused: "
                f"{failures.policy_refusal(exc, 'the server host')}"
            ) from exc
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - an action bug is the call's failure, not the RPC's
            # The model gets the failure's kind (`failures.unexpected`), never the exception's text:
            # a driver's message may quote the secret, a host, an address or a path.
            cause = exc
            if not _is_httpx_error(exc):  # an httpx error is an expected failure: not an error log
                _log_action_raised(integration, action, exc)
            raise ToolError(
                f"{integration.name}.{action.name} failed: {failures.unexpected(exc)}"
            ) from exc
        finally:
            self._action_finished(
                org_id, integration, action, info, outcome, started, cause, redactor
            )
        # a server that echoes the credential (a header, a URL, an error body) must not hand it
        # to the model
        if redactor:
            result = redactor.value(result)
        return result

    def _action_finished(
        self,
        org_id: str,
        integration: Integration,
        action: Action,
        info: CredentialInfo | None,
        outcome: str,
        started: float,
        cause: BaseException | None,
        redactor: Redactor,
    ) -> None:
        """Count the action in the metrics and log one line of how it ended (the cause, for the
        operator only, redacted with the credential's secret; never in the tool's result)."""
        seconds = time.monotonic() - started
        # an organization's MCP server is named by it: one label for them all
        known = self.catalogue.get(integration.name) is not None
        metrics.integration_action(
            integration.name if known or integration.name in self.stdio.servers else "mcp",
            outcome,
            seconds,
        )
        fields: dict[str, Any] = {
            "org_id": org_id,
            "integration": integration.name,
            "action": action.name,
            "credential_id": info.id if info else None,
            "outcome": outcome,
            "duration_ms": round(seconds * 1000, 1),
        }
        if cause is not None:
            fields["cause"] = bounded(redactor.text(f"{type(cause).__name__}: {cause}"), 300)
        log.info("integration action finished", extra={"fields": fields})

    async def search_knowledge(self, org_id: str, args: dict[str, Any]) -> ToolResult:
        """{"query", "results": [{"knowledge_base_id", "document_id", "document_name", "chunk_id",
        "chunk_index", "content", "score", "semantic_score", "keyword_score"}], "count"}, ranked
        by `mode` (hybrid by default, with the store's default weights) and at least `min_score`;
        error result when the org has no knowledge base."""
        known = await self.knowledge.base_ids(org_id)
        if not known:
            raise ToolError(
                "This organization has no knowledge bases yet, so there is nothing to search."
            )
        unknown = [i for i in dict.fromkeys(args.get("knowledge_base_ids") or []) if i not in known]
        # as POST /knowledge-bases/search answers 404 for them, instead of searching the others
        if unknown:
            shown = ", ".join(repr(i[:64]) for i in unknown[:5]) + (
                f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            )
            raise ToolError(
                f"Knowledge base(s) not found: {shown}. Leave out knowledge_base_ids to search "
                "them all."
            )
        try:
            hits = await self.knowledge.search(
                org_id,
                args["query"],
                args.get("knowledge_base_ids"),
                int(args.get("top_k", 5)),
                mode=args.get("mode", "hybrid"),
                min_score=float(args.get("min_score", 0.0)),
            )
        except RpcError as refused:  # e.g. no embedding model answers: its known reason
            raise ToolError(refused.message) from None
        output = {
            "query": args["query"],
            "results": [h.to_json() for h in hits],
            "count": len(hits),
        }
        value, truncated, _size = cap_result(output, self.settings.tools_max_output_bytes)
        if truncated:
            output = {
                "query": args["query"],
                "results": value,
                "count": len(hits),
                "truncated": True,
            }
        return ToolResult(True, output=output, millicredits=self.settings.tools_search_millicredits)

    def org_mcp_integration(self, info: Any, tools: list[dict[str, Any]]) -> Integration:
        """The integration of an organization's MCP server credential: its discovered tools as
        actions."""

        async def call(ctx: ActionContext, tool_name: str, params: dict[str, Any]) -> Any:
            if not ctx.secret or not ctx.secret.get("url"):
                raise ActionError("the MCP server credential has no URL; register the server again")
            return await self.mcp.call_tool(ctx.secret, tool_name, params)

        description = str(
            info.metadata.get("description") or f"Tools of the MCP server {info.display_name!r}"
        )
        return integration_of_tools(
            info.integration, info.display_name, description, tools, ORG_SERVER_AUTH, call
        )

    async def _integration(self, org_id: str, name: str) -> Integration:
        """The integration `name`: built-in or OAuth2 (catalogue), operator stdio MCP, or the org's
        MCP server.

        Raises ToolError when there is none, or when a stdio server's tools cannot be discovered.
        """
        integration = self.catalogue.get(name)
        if integration is not None:
            return integration
        if name in self.stdio.servers:
            try:
                return await self.stdio.integration(name)
            except TimeoutError:
                raise ToolError(
                    f"The MCP server {name!r} did not list its tools in time; try again later."
                ) from None
            except (ActionError, OutboundPolicyError) as exc:
                raise ToolError(f"The MCP server {name!r} is unavailable: {exc}") from None
        org_servers: list[str] = []
        for fresh in (
            False,
            True,
        ):  # cached first; a name it lacks may be a server another replica just added
            org_servers.clear()
            for info, tools in await self.credentials.of_auth_type(
                org_id, MCP_AUTH_TYPE, fresh=fresh
            ):
                if info.integration == name:
                    return self.org_mcp_integration(info, tools)
                org_servers.append(info.integration)
        names = [i.name for i in self.catalogue.all()] + list(self.stdio.servers) + org_servers
        raise ToolError(
            f"Unknown integration {name!r}. Available integrations include: {', '.join(names)}. "
            "Call get_available_integrations to browse them."
        )
