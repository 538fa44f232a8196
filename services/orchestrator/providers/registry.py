"""Resolve a request's `llm` object to a chat model."""

from __future__ import annotations

from typing import Any

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers.base import ChatModel
from services.orchestrator.providers.scripted import ScriptedModel


class UnknownModel(ValueError):
    """The `llm` names a provider or model this deployment does not serve (HTTP 400)."""


def resolve(settings: OrchestratorSettings, llm: dict[str, Any]) -> ChatModel:
    """The ChatModel for `llm` = {integration_name, provider_id, model_id, credential_id?}.

    Raises UnknownModel for an unknown or disabled provider.
    """
    provider = llm.get("provider_id", "")
    if provider == "scripted":
        if not settings.scripted_model_enabled:
            raise UnknownModel("the scripted model is disabled on this deployment")
        return ScriptedModel(llm.get("model_id") or "default")
    raise UnknownModel(f"unknown model provider {provider!r}")
