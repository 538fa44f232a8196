"""The integration catalogue: manifests, actions and the context an action runs in.

Each integration is one module in `services/tools/integrations/` with two names:
`MANIFEST` (a JSON-able dict: name, display_name,
description, categories, auth options, actions with JSON Schema parameters and a
credit cost) and `HANDLERS` (action name -> `async def handler(ctx, params) -> JSON`).
Manifests are checked when the catalogue loads (every parameter schema must be a valid
JSON Schema 2020-12, every action must have a handler), so a broken manifest fails the
service at start, not a model's call.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

AUTH_TYPES = ("none", "api_key", "bearer", "oauth2", "custom")

# What an action may do beyond reading, shown in its details (see `Action.effects`).
EFFECTS = ("create", "update", "send", "delete")

# The built-in integrations, in the order the catalogue lists them.
BUILTIN_MODULES = ("postgresql", "http", "loopline")


class ActionError(Exception):
    """An action failed in a way the model can act on; the message is shown to it (after
    redaction)."""


@dataclass(frozen=True)
class ActionContext:
    """What an action handler gets besides its parameters.

    Attributes:
        secret: the decrypted credential fields (e.g. {"dsn": ...}), or None when the
            integration runs without a credential. Never log it.
        auth_type: the credential's auth type ("none" without a credential).
        timeout_s: the action's time limit in seconds (the handler is also cancelled
            when it expires; handlers pass it on to servers, e.g. `statement_timeout`).
        max_output_bytes: the output cap in bytes; handlers that stream (http) stop reading past it.
        allow_private_network: the operator's outbound policy for org-supplied URLs.
    """

    secret: dict[str, Any] | None
    auth_type: str
    timeout_s: float
    max_output_bytes: int
    allow_private_network: bool


Handler = Callable[[ActionContext, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class AuthOption:
    """One way to authenticate: `type` in AUTH_TYPES, and `fields`, the JSON Schema of its
    secret (each property's `title`, `description`, and `writeOnly` for a secret value).
    `setup_instructions` tell a user how to get the secret; `oauth` holds an `oauth2`
    option's `authorize_url`, `token_url` and `scopes` where the manifest names them."""

    type: str
    label: str
    description: str
    fields: dict[str, Any] | None
    setup_instructions: tuple[str, ...] = ()
    oauth: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The option as shown by get_integration_details."""
        shown: dict[str, Any] = {
            "type": self.type,
            "label": self.label,
            "description": self.description,
            "fields": self.fields,
        }
        if self.setup_instructions:
            shown["setup_instructions"] = list(self.setup_instructions)
        return shown


@dataclass(frozen=True)
class Action:
    """One action: JSON Schema `parameters`, cost in millicredits, its handler, and `effects`:
    which of EFFECTS it has beyond reading (e.g. ("delete",)), () for a read."""

    name: str
    description: str
    parameters: dict[str, Any]
    credit_cost_millicredits: int
    handler: Handler = field(repr=False, compare=False)
    effects: tuple[str, ...] = ()

    @functools.cached_property
    def validator(self) -> Draft202012Validator:
        """The JSON Schema 2020-12 validator of `parameters`, built once per action (not per
        call)."""
        return Draft202012Validator(self.parameters)

    def to_json(self) -> dict[str, Any]:
        """The action as shown by get_integration_details."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "credit_cost_millicredits": self.credit_cost_millicredits,
            "effects": list(self.effects),
        }


class LazyActions(Mapping[str, Action]):
    """An integration's actions, asked of `load` on each use (a generated catalogue keeps its
    2,000 action schemas on disk and a few integrations' in a cache: `load` is that cache)."""

    def __init__(self, load: Callable[[], dict[str, Action]]) -> None:
        self._load = load

    def __getitem__(self, name: str) -> Action:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


@dataclass(frozen=True)
class Integration:
    """An integration from its manifest.

    `source` says where it comes from: "builtin", "modulex-integrations" (the generated
    catalogue), "oauth2" (an operator's OAuth2 integration), "mcp" (an MCP server);
    `version`, `logo` and `app_url` are the manifest's, where it has them.
    """

    name: str
    display_name: str
    description: str
    categories: tuple[str, ...]
    auth_options: tuple[AuthOption, ...]
    actions: Mapping[str, Action]
    source: str = "builtin"
    version: str = ""
    logo: str | None = None
    app_url: str | None = None

    @property
    def auth_types(self) -> list[str]:
        """The auth types it accepts, in manifest order (e.g. ["none", "bearer"])."""
        return [option.type for option in self.auth_options]

    @property
    def secret_auth_types(self) -> list[str]:
        """The auth types that carry a secret (all but "none"); [] when no credential can be stored
        for it."""
        return [t for t in self.auth_types if t != "none"]

    @property
    def requires_credential(self) -> bool:
        """Whether an action needs a credential (false when "none" is an auth option)."""
        return "none" not in self.auth_types

    def auth_option(self, auth_type: str) -> AuthOption | None:
        """The option of `auth_type`, or None."""
        return next((o for o in self.auth_options if o.type == auth_type), None)


def integration_from_manifest(
    manifest: dict[str, Any], handlers: dict[str, Handler]
) -> Integration:
    """Build an Integration from a manifest dict and its handlers.

    Raises ValueError when the manifest is malformed: a missing key, an unknown auth
    type, an invalid parameter or auth-field JSON Schema, or an action without a handler.
    """
    name = manifest["name"]
    options = []
    for raw in manifest["auth"]:
        if raw["type"] not in AUTH_TYPES:
            raise ValueError(f"integration {name}: unknown auth type {raw['type']!r}")
        if raw.get("fields") is not None:
            Draft202012Validator.check_schema(raw["fields"])
        options.append(
            AuthOption(
                raw["type"],
                raw.get("label", raw["type"]),
                raw.get("description", ""),
                raw.get("fields"),
            )
        )
    if not options:
        raise ValueError(f"integration {name}: no auth option")
    actions: dict[str, Action] = {}
    for raw in manifest["actions"]:
        Draft202012Validator.check_schema(raw["parameters"])
        if raw["name"] not in handlers:
            raise ValueError(f"integration {name}: action {raw['name']} has no handler")
        actions[raw["name"]] = Action(
            name=raw["name"],
            description=raw["description"],
            parameters=raw["parameters"],
            credit_cost_millicredits=int(raw["credit_cost_millicredits"]),
            handler=handlers[raw["name"]],
            effects=tuple(raw.get("effects", ())),
        )
    return Integration(
        name=name,
        display_name=manifest["display_name"],
        description=manifest["description"],
        categories=tuple(manifest.get("categories", ())),
        auth_options=tuple(options),
        actions=actions,
    )


class Catalogue:
    """The integrations the service offers, by name, in a stable order."""

    def __init__(self, integrations: list[Integration]) -> None:
        self._by_name = {integration.name: integration for integration in integrations}

    @classmethod
    def builtin(cls) -> Catalogue:
        """The catalogue of the built-in integration modules (BUILTIN_MODULES)."""
        integrations = []
        for module_name in BUILTIN_MODULES:
            module = importlib.import_module(f"services.tools.integrations.{module_name}")
            integrations.append(integration_from_manifest(module.MANIFEST, module.HANDLERS))
        from services.tools.integrations import models as model_keys

        for manifest in model_keys.MANIFESTS:
            integrations.append(integration_from_manifest(manifest, {}))
        return cls(integrations)

    def get(self, name: str) -> Integration | None:
        """The integration called `name`, or None."""
        return self._by_name.get(name)

    def all(self) -> list[Integration]:
        """Every integration, in catalogue order."""
        return list(self._by_name.values())
