"""The definitions (name, description, input JSON Schema) of the tools this service executes.

The five tools of the "assistant" profile, as ListTools returns them to the orchestrator, which
offers them to the model; `tools.ToolExecutor` validates each call's input against its schema.
"""

from __future__ import annotations

from typing import Any

#: The profiles whose tools ListTools lists: "assistant" is the only one today (tools.proto,
#: ListToolsRequest).
PROFILES = ("assistant",)


TOOL_DEFINITIONS: list[dict[str, Any]] = [
    {
        "name": "get_available_integrations",
        "description": "List the integrations this organization can use, with whether each is "
        "connected "
        "(has a credential, or needs none) and the auth types it accepts. Filter by category or a "
        "search text.",
        "input_schema": {
            "type": "object",
            "properties": {
                "category": {
                    "type": "string",
                    "description": 'Only integrations in this category, e.g. "database".',
                },
                "query": {
                    "type": "string",
                    "description": "Only integrations whose name or description contains this "
                    "text.",
                },
            },
            "additionalProperties": False,
        },
    },
    {
        "name": "get_integration_details",
        "description": "Describe one integration: its actions with their parameter JSON Schemas "
        "and credit costs, "
        "and its auth options. Call it before execute_integration_tool.",
        "input_schema": {
            "type": "object",
            "properties": {
                "integration": {
                    "type": "string",
                    "minLength": 1,
                    "description": 'Integration name, e.g. "postgresql".',
                }
            },
            "required": ["integration"],
            "additionalProperties": False,
        },
    },
    {
        "name": "get_organization_credentials",
        "description": "List the organization's connected credentials (metadata only: id, "
        "integration, auth type, "
        "display name, default flag, dates). Secrets are never shown.",
        "input_schema": {
            "type": "object",
            "properties": {
                "integration": {
                    "type": "string",
                    "description": "Only this integration's credentials.",
                }
            },
            "additionalProperties": False,
        },
    },
    {
        "name": "execute_integration_tool",
        "description": "Run one action of an integration with parameters that match the action's "
        "schema "
        "(see get_integration_details). Uses the integration's default credential unless "
        "credential_id is given. "
        "If no credential is connected, call request_credential to ask the user for one.",
        "input_schema": {
            "type": "object",
            "properties": {
                "integration": {
                    "type": "string",
                    "minLength": 1,
                    "description": "Integration name.",
                },
                "action": {"type": "string", "minLength": 1, "description": "Action name."},
                "parameters": {
                    "type": "object",
                    "description": "The action's parameters.",
                    "default": {},
                },
                "credential_id": {
                    "type": "string",
                    "description": "A credential id from get_organization_credentials.",
                },
            },
            "required": ["integration", "action"],
            "additionalProperties": False,
        },
    },
    {
        "name": "search_knowledge",
        "description": "Search the organization's knowledge bases by meaning and by words "
        "(hybrid, the default), by meaning only (semantic) or by words only (keyword); returns "
        "the best-matching passages with their document and scores from 0 to 1.",
        "input_schema": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "description": "What to look for."},
                "knowledge_base_ids": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Only these knowledge bases (default: all of the "
                    "organization's).",
                },
                "top_k": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 50,
                    "default": 5,
                    "description": "How many passages.",
                },
                "mode": {
                    "type": "string",
                    "enum": ["hybrid", "semantic", "keyword"],
                    "default": "hybrid",
                    "description": "hybrid: meaning and words combined; semantic: meaning only "
                    "(finds passages that use other words); keyword: the query's words only "
                    "(names, codes, exact terms).",
                },
                "min_score": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 1,
                    "default": 0,
                    "description": "Only passages scoring at least this (0 to 1).",
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
