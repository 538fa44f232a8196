"""Provider resolution (ids, model lists, keys, BYOK) and the retry rule's arithmetic."""

from __future__ import annotations

import email.utils
import time

import pytest

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers import registry
from services.orchestrator.providers.anthropic_provider import AnthropicModel
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.providers.retry import RetryPolicy, parse_retry_after
from services.orchestrator.providers.scripted import ScriptedModel


def settings(**overrides) -> OrchestratorSettings:
    base = {"openai_api_key": "", "anthropic_api_key": "", "openai_compatible_providers": {}}
    return OrchestratorSettings(**{**base, **overrides})


async def test_scripted_and_configured_providers_resolve_to_their_model_classes():
    s = settings(
        openai_api_key="sk-a-123456",
        anthropic_api_key="sk-ant-123456",
        openai_models="m1",
        anthropic_models="c1",
    )
    assert isinstance(
        await registry.resolve(s, {"provider_id": "scripted", "model_id": "default"}), ScriptedModel
    )
    openai_model = await registry.resolve(s, {"provider_id": "openai", "model_id": "m1"})
    assert isinstance(openai_model, OpenAICompatModel) and openai_model.model_id == "m1"
    assert isinstance(
        await registry.resolve(s, {"provider_id": "anthropic", "model_id": "c1"}), AnthropicModel
    )


async def test_a_model_outside_the_list_is_unknown_and_star_allows_any():
    with pytest.raises(registry.UnknownModel):
        await registry.resolve(
            settings(openai_api_key="k", openai_models="m1"),
            {"provider_id": "openai", "model_id": "m2"},
        )
    model = await registry.resolve(
        settings(openai_api_key="k", openai_models="*"), {"provider_id": "openai", "model_id": "m2"}
    )
    assert model.model_id == "m2"


async def test_a_provider_without_a_platform_key_needs_a_credential():
    with pytest.raises(registry.UnknownModel, match="no key configured"):
        await registry.resolve(
            settings(openai_models="m1"), {"provider_id": "openai", "model_id": "m1"}
        )


async def test_a_compatible_provider_with_its_key_variable_unset_does_not_point_to_byok(
    monkeypatch,
):
    """A compatible provider whose key variable is unset is refused as having no key on this
    deployment, without pointing to llm.credential_id: bring-your-own-key credentials work only
    with the anthropic and openai providers, so that hint would lead to another 400."""
    monkeypatch.delenv("NOT_SET_ANYWHERE_VAR", raising=False)
    s = settings(
        openai_compatible_providers={
            "vllm": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "NOT_SET_ANYWHERE_VAR"}
        }
    )
    with pytest.raises(registry.UnknownModel) as refused:
        await registry.resolve(s, {"provider_id": "vllm", "model_id": "qwen"})
    assert str(refused.value) == "model provider 'vllm' has no key configured on this deployment"


async def test_named_compatible_providers_come_from_json_settings(monkeypatch):
    monkeypatch.setenv("VLLM_TEST_KEY", "sk-vllm-123456")
    s = settings(
        openai_compatible_providers={
            "vllm": {
                "base_url": "http://127.0.0.1:9/v1",
                "api_key_env": "VLLM_TEST_KEY",
                "models": ["qwen"],
            },
            "ollama": {"base_url": "http://127.0.0.1:11434/v1"},
            "openai": {"base_url": "http://evil.example/v1"},  # built-in ids cannot be replaced
        }
    )
    vllm = await registry.resolve(s, {"provider_id": "vllm", "model_id": "qwen"})
    assert (
        isinstance(vllm, OpenAICompatModel)
        and vllm.provider_id == "vllm"
        and vllm._spec.api_key == "sk-vllm-123456"
    )
    with pytest.raises(registry.UnknownModel):
        await registry.resolve(s, {"provider_id": "vllm", "model_id": "llama"})
    ollama = await registry.resolve(s, {"provider_id": "ollama", "model_id": "anything"})
    assert isinstance(ollama, OpenAICompatModel)
    assert ollama._spec.api_key == registry.NO_KEY  # a local server needs no key
    assert registry.providers(s)["openai"].base_url == s.openai_base_url


async def test_byok_takes_the_key_from_the_injected_resolver_and_unknown_credentials_are_refused():
    calls = []

    async def resolver(org_id: str, credential_id: str, integration: str) -> str:
        calls.append((org_id, credential_id, integration))
        if credential_id != "cred_ok":
            raise LookupError(credential_id)
        return "sk-org-own-key-123456"

    s = settings(anthropic_models="c1")  # no platform key at all
    model = await registry.resolve(
        s,
        {"provider_id": "anthropic", "model_id": "c1", "credential_id": "cred_ok"},
        organization_id="org_1",
        secret_resolver=resolver,
    )
    assert isinstance(model, AnthropicModel)
    assert model._spec.api_key == "sk-org-own-key-123456" and calls == [
        ("org_1", "cred_ok", "anthropic")
    ]
    with pytest.raises(registry.UnknownModel, match="cannot be used"):
        await registry.resolve(
            s,
            {"provider_id": "anthropic", "model_id": "c1", "credential_id": "cred_x"},
            organization_id="org_1",
            secret_resolver=resolver,
        )


def test_backoff_doubles_up_to_the_cap_and_retry_after_is_a_floor():
    policy = RetryPolicy(max_retries=5, base_delay_s=0.5, max_delay_s=3.0)
    assert [policy.delay(n, None) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.delay(1, 2.5) == 2.5 and policy.delay(3, 0.1) == 2.0


def test_retry_after_accepts_seconds_milliseconds_and_http_dates():
    assert parse_retry_after({"retry-after": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    from_date = parse_retry_after({"retry-after": later})
    assert from_date is not None and 25 <= from_date <= 31
    assert parse_retry_after({"retry-after": "soon"}) is None and parse_retry_after({}) is None


async def test_byok_only_for_openai_and_anthropic_and_integration_must_match_the_provider():
    async def resolver(org_id: str, credential_id: str, integration: str) -> str:
        return "sk-org-own-key-123456"

    s = settings(
        openai_compatible_providers={
            "tiny": {"base_url": "http://127.0.0.1:9/v1", "models": ["t1"]}
        },
        openai_models="gpt-test",
    )
    with pytest.raises(registry.UnknownModel, match="bring-your-own-key"):
        await registry.resolve(
            s,
            {"provider_id": "tiny", "model_id": "t1", "credential_id": "cred_ok"},
            organization_id="o",
            secret_resolver=resolver,
        )
    # a credential named with the scripted model is refused, not silently ignored (200)
    with pytest.raises(registry.UnknownModel, match="bring-your-own-key"):
        await registry.resolve(
            s,
            {
                "integration_name": "loopline",
                "provider_id": "scripted",
                "model_id": "default",
                "credential_id": "nope",
            },
            organization_id="o",
            secret_resolver=resolver,
        )
    with pytest.raises(registry.UnknownModel, match="integration_name"):
        await registry.resolve(
            s,
            {"integration_name": "tiny", "provider_id": "openai", "model_id": "gpt-test"},
            organization_id="o",
        )
    with pytest.raises(registry.UnknownModel, match="integration_name"):
        await registry.resolve(
            s, {"integration_name": "openai", "provider_id": "scripted", "model_id": "default"}
        )
    model = await registry.resolve(
        s,
        {
            "integration_name": "openai",
            "provider_id": "openai",
            "model_id": "gpt-test",
            "credential_id": "c",
        },
        organization_id="o",
        secret_resolver=resolver,
    )
    assert isinstance(model, OpenAICompatModel)
    assert model._spec.api_key == "sk-org-own-key-123456"
