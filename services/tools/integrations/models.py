"""Model-provider integrations (`openai`, `anthropic`): they hold an organization's own model key.

They have no actions; the orchestrator reads the key through the internal
`ResolveCredentialSecret` RPC when a request names `llm.credential_id` (bring your own
key, DESIGN.md "Models"). Any OpenAI-compatible server's key is stored under `openai`.
"""

from __future__ import annotations

from typing import Any

_KEY_FIELDS = {
    "type": "object",
    "properties": {"api_key": {"type": "string", "minLength": 1}},
    "required": ["api_key"],
    "additionalProperties": False,
}


def _manifest(name: str, display_name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "display_name": display_name,
        "description": description,
        "categories": ["models"],
        "auth": [
            {
                "type": "api_key",
                "label": "API key",
                "description": "The organization's own key for the model provider.",
                "fields": _KEY_FIELDS,
            }
        ],
        "actions": [],
    }


MANIFESTS = [
    _manifest(
        "openai",
        "OpenAI (model key)",
        "Your own OpenAI or OpenAI-compatible API key, used for the assistant's model calls.",
    ),
    _manifest(
        "anthropic",
        "Anthropic (model key)",
        "Your own Anthropic API key, used for the assistant's model calls.",
    ),
]
