"""ListModelProviders: the model providers this deployment serves, for the gateway's
`GET /integrations/llm-providers` (the tools service lists them beside its integrations).

Only what a client may see: ids, names, allowed model ids and whether a key is needed, never a
base URL (an internal host) or a key.
"""

from __future__ import annotations

import grpc

from loopline.assistant.v1 import assistant_pb2
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers import registry
from services.orchestrator.servicer.access import ChatAccess
from services.orchestrator.servicer.errors import unary

# Names and descriptions by provider kind; an OpenAI-compatible provider of
# LOOPLINE_OPENAI_COMPATIBLE_PROVIDERS is named by its id.
_KNOWN = {
    "openai": ("OpenAI", "OpenAI chat completions (streamed, with function calling)."),
    "anthropic": ("Anthropic", "Anthropic Messages (streamed, with prompt caching)."),
}
_COMPATIBLE = "An OpenAI-compatible chat completions server configured by the operator."
_SCRIPTED = (
    "Scripted model",
    "A deterministic model that follows a script carried in the user message (tests and demos).",
)


def model_providers(settings: OrchestratorSettings) -> list[assistant_pb2.ModelProvider]:
    """The providers `registry.resolve` serves with `settings`: the scripted one first (when
    enabled), then openai, anthropic and the OpenAI-compatible ones, in their configured order."""
    found = []
    if settings.scripted_model_enabled:
        found.append(
            assistant_pb2.ModelProvider(
                provider_id="scripted",
                integration_name="loopline",
                display_name=_SCRIPTED[0],
                description=_SCRIPTED[1],
                model_ids=sorted(registry.SCRIPTED_MODELS),
                platform_key=True,
            )
        )
    for provider_id, config in registry.providers(settings).items():
        display_name, description = _KNOWN.get(provider_id, (provider_id, _COMPATIBLE))
        found.append(
            assistant_pb2.ModelProvider(
                provider_id=provider_id,
                integration_name=provider_id,
                display_name=display_name,
                description=description,
                model_ids=sorted(config.models or ()),
                any_model=config.models is None,
                platform_key=bool(config.api_key) or not config.key_required,
                bring_your_own_key=provider_id in registry.BYOK_PROVIDERS,
            )
        )
    return found


class ModelProviders(ChatAccess):
    """ListModelProviders of the servicer."""

    @unary
    async def ListModelProviders(
        self, request: assistant_pb2.ListModelProvidersRequest, context: grpc.aio.ServicerContext
    ) -> assistant_pb2.ListModelProvidersResponse:
        """The model providers of this deployment (`model_providers`)."""
        return assistant_pb2.ListModelProvidersResponse(providers=model_providers(self.settings))
