"""Resolve a request's `llm` object to a chat model.

Providers served:
- `scripted`: the deterministic test/demo model (`LOOPLINE_SCRIPTED_MODEL_ENABLED`);
- `openai`: chat completions at `LOOPLINE_OPENAI_BASE_URL` (models `LOOPLINE_OPENAI_MODELS`);
- `anthropic`: Messages at `LOOPLINE_ANTHROPIC_BASE_URL` (models `LOOPLINE_ANTHROPIC_MODELS`);
- every entry of `LOOPLINE_OPENAI_COMPATIBLE_PROVIDERS` (vLLM, Ollama, llama.cpp, ...).

Keys: with `llm.credential_id` the key is the organization's own credential, fetched by
the injected `secret_resolver(org_id, credential_id)` (bring your own key); otherwise the
platform's key from settings. A provider without a platform key serves only
bring-your-own-key requests. Every refusal is `UnknownModel` (HTTP 400, nothing written).

The models of one orchestrator share its `ProviderClients` (clients.py): one SDK client per
provider, base URL and key, whose connections the steps and runs reuse.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers.base import ChatModel
from services.orchestrator.providers.clients import ProviderClients
from services.orchestrator.providers.retry import RetryPolicy
from services.orchestrator.providers.scripted import ScriptedModel

SCRIPTED_MODELS = frozenset({"default"})
BYOK_PROVIDERS = frozenset({"openai", "anthropic"})


def _check_integration(llm: dict[str, Any], expected: str) -> None:
    """`llm.integration_name`, when given, must name the provider's integration (the provider id,
    or "loopline" for the scripted model). Raises UnknownModel."""
    integration = llm.get("integration_name")
    if integration and integration != expected:
        raise UnknownModel(
            f"llm.integration_name must be {expected!r} for provider {llm.get('provider_id')!r}"
        )


SecretResolver = Callable[[str, str, str], Awaitable[str]]
"""`(organization_id, credential_id, integration) -> api key`, integration "openai" or
"anthropic"; raises LookupError when the credential is absent, another organization's, for
another integration, or not usable as a model key; CredentialUndecryptable when it exists but
its stored secret cannot be decrypted."""

RESERVED = frozenset({"scripted", "openai", "anthropic"})
NO_KEY = "no-key"  # sent to compatible servers that need none (the SDK insists on a value)


class UnknownModel(ValueError):
    """The `llm` names a provider, model or credential this deployment cannot serve (HTTP 400)."""


class CredentialUndecryptable(Exception):
    """The `llm.credential_id` credential exists but no key the tools service lists decrypts its
    secret (LOOPLINE_TOOLS_CREDENTIAL_KEY changed without keeping the old key). Not the client's
    mistake and not retryable: HTTP 409 until an operator lists the old
    key again or the credential is connected again.

    Attributes:
        credential_id: the credential named by the request.
        message: text for the client naming the credential and the fix (never the secret).
    """

    def __init__(self, credential_id: str, message: str = "") -> None:
        self.credential_id = credential_id
        self.message = message or (
            f"Credential {credential_id!r} cannot be decrypted: the server's credential key was "
            "changed without keeping the old one. An operator must list the old key again "
            "(after the new one), or the credential must be connected again"
        )
        super().__init__(self.message)


@dataclass(frozen=True)
class ProviderConfig:
    """One configured provider.

    Attributes:
        provider_id: the id clients put in `llm.provider_id`.
        kind: "openai" (chat-completions wire format) or "anthropic".
        base_url: API base URL.
        api_key: the platform's key; "" when it has none.
        models: allowed model ids; None allows any.
        key_required: whether a request without a key must be refused.
    """

    provider_id: str
    kind: str
    base_url: str
    api_key: str
    models: frozenset[str] | None
    key_required: bool = True


def _model_list(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    items = (
        [v.strip() for v in value.split(",")]
        if isinstance(value, str)
        else [str(v).strip() for v in value]
    )
    items = [v for v in items if v]
    return None if not items or "*" in items else frozenset(items)


def providers(settings: OrchestratorSettings) -> dict[str, ProviderConfig]:
    """The real (non-scripted) providers of this deployment, by id."""
    found = {
        "openai": ProviderConfig(
            "openai",
            "openai",
            settings.openai_base_url,
            settings.openai_api_key,
            _model_list(settings.openai_models),
        ),
        "anthropic": ProviderConfig(
            "anthropic",
            "anthropic",
            settings.anthropic_base_url,
            settings.anthropic_api_key,
            _model_list(settings.anthropic_models),
        ),
    }
    for provider_id, entry in (settings.openai_compatible_providers or {}).items():
        if provider_id in RESERVED or not isinstance(entry, dict) or not entry.get("base_url"):
            continue
        key_env = entry.get("api_key_env")
        found[provider_id] = ProviderConfig(
            provider_id,
            "openai",
            str(entry["base_url"]),
            os.environ.get(key_env, "") if key_env else "",
            _model_list(entry.get("models")),
            key_required=bool(key_env),
        )
    return found


def retry_policy(settings: OrchestratorSettings) -> RetryPolicy:
    """The retry bounds of model calls from settings."""
    return RetryPolicy(
        max_retries=max(0, settings.llm_max_retries),
        base_delay_s=settings.llm_retry_base_delay_s,
        max_delay_s=settings.llm_retry_max_delay_s,
    )


async def resolve(
    settings: OrchestratorSettings,
    llm: dict[str, Any],
    *,
    organization_id: str = "",
    secret_resolver: SecretResolver | None = None,
    clients: ProviderClients | None = None,
) -> ChatModel:
    """The ChatModel for `llm` = {integration_name, provider_id, model_id, credential_id?}, its
    SDK client taken from `clients` (None: a client of its own per call).

    Raises:
        UnknownModel: unknown or disabled provider, a model id outside the provider's list,
            no key available, or a credential that cannot be used (absent, another
            organization's, or bring-your-own-key not wired on this deployment).
        CredentialUndecryptable: the credential exists but its secret cannot be decrypted
            (raised by `secret_resolver`, passed on unchanged).
        Whatever else `secret_resolver` raises (e.g. grpc.aio.AioRpcError when the tools
            service is down or does not answer in time) propagates.
    """
    provider_id = llm.get("provider_id", "")
    model_id = llm.get("model_id") or ""
    if llm.get("credential_id") and provider_id not in BYOK_PROVIDERS:
        # an organization's key is stored per provider integration; sending an OpenAI key to
        # another OpenAI-compatible host would hand it to a third party (and the scripted model
        # has no key at all: accepting one would hide a client's mistake)
        byok = " and ".join(sorted(BYOK_PROVIDERS))
        raise UnknownModel(
            f"bring-your-own-key credentials work with the {byok} providers, not {provider_id!r}"
        )
    if provider_id == "scripted":
        return _scripted_model(settings, llm, model_id)
    config = providers(settings).get(provider_id)
    if config is None:
        raise UnknownModel(f"unknown model provider {provider_id!r}")
    _check_integration(llm, provider_id)
    if not model_id or (config.models is not None and model_id not in config.models):
        raise UnknownModel(f"unknown model {model_id!r} for provider {provider_id!r}")
    api_key = await _api_key(
        config, provider_id, llm.get("credential_id"), organization_id, secret_resolver
    )
    return _provider_model(settings, config, provider_id, model_id, api_key, clients)


def _scripted_model(
    settings: OrchestratorSettings, llm: dict[str, Any], model_id: str
) -> ChatModel:
    """The scripted model, when the deployment enables it and `model_id` is one of its own."""
    if not settings.scripted_model_enabled:
        raise UnknownModel("the scripted model is disabled on this deployment")
    if model_id not in SCRIPTED_MODELS:
        raise UnknownModel(f"unknown model {model_id!r} for provider 'scripted' (use 'default')")
    _check_integration(llm, "loopline")
    return ScriptedModel(model_id)


async def _api_key(
    config: ProviderConfig,
    provider_id: str,
    credential_id: str | None,
    organization_id: str,
    resolver: SecretResolver | None,
) -> str:
    """The key a request to `config`'s provider uses: the organization's credential when one is
    named, else the platform's key, else NO_KEY for a provider that needs none."""
    if credential_id:
        if resolver is None:
            raise UnknownModel(
                "bring-your-own-key credentials are not available on this deployment"
            )
        try:
            api_key = await resolver(organization_id, credential_id, provider_id)
        except LookupError:
            raise UnknownModel(
                f"credential {credential_id!r} cannot be used as a model key"
            ) from None
    else:
        api_key = config.api_key
    if not api_key:
        if config.key_required:
            if provider_id in BYOK_PROVIDERS:
                raise UnknownModel(
                    f"model provider {provider_id!r} has no key configured; pass llm.credential_id"
                )
            # no bring-your-own-key for it (an OpenAI key is never sent to another host): the
            # fix is the deployment's
            raise UnknownModel(
                f"model provider {provider_id!r} has no key configured on this deployment"
            )
        api_key = NO_KEY
    return api_key


def _provider_model(
    settings: OrchestratorSettings,
    config: ProviderConfig,
    provider_id: str,
    model_id: str,
    api_key: str,
    clients: ProviderClients | None,
) -> ChatModel:
    """The ChatModel of `config`'s provider for `model_id`, with `api_key` and `clients`."""
    policy = retry_policy(settings)
    if config.kind == "anthropic":
        # The provider SDKs are imported on first use: importing them costs seconds of start-up
        # and tens of MiB of memory in every orchestrator that never calls them.
        from services.orchestrator.providers.anthropic_provider import AnthropicModel

        return AnthropicModel(
            model_id,
            base_url=config.base_url,
            api_key=api_key,
            policy=policy,
            max_tokens=settings.anthropic_max_tokens,
            timeout_s=settings.llm_timeout_s,
            max_connections=settings.llm_max_connections,
            clients=clients,
        )
    from services.orchestrator.providers.openai_compat import OpenAICompatModel

    return OpenAICompatModel(
        provider_id,
        model_id,
        base_url=config.base_url,
        api_key=api_key,
        policy=policy,
        timeout_s=settings.llm_timeout_s,
        max_connections=settings.llm_max_connections,
        clients=clients,
    )
