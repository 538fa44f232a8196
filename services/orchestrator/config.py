"""Orchestrator settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings


class OrchestratorSettings(CommonSettings):
    """Settings of the orchestrator.

    Attributes:
        orchestrator_port: gRPC port (0 = any free port).
        orchestrator_metrics_port: port of the Prometheus metrics (HTTP, on `host`; 0 = any free
            port; docs/metrics.md).
        orchestrator_database_url: SQLAlchemy URL; empty = SQLite `<data_dir>/orchestrator.db`.
        auto_migrate: apply Alembic migrations at start.
        recursion_limit: loop steps per run (a model call or a tool execution is one step);
            spec default 100.
        failure_guidance_threshold: consecutive tool failures that publish guidance; spec default 3
            (at least 1).
        llm_call_guidance_every: every Nth model call publishes wind-down guidance; spec default 20;
            0 turns it off.
        pending_ttl_s: lifetime of a pending question (spec: 7 days).
        scripted_model_enabled: whether the `scripted` provider may be used.
        default_integration_name / default_provider_id / default_model_id: the model used when a
            request names none and the organization has saved no default.
        tool_timeout_s: deadline of one ExecuteTool call.
        stream_url_prefix: path prefix of the stream_url returned to clients.
        event_log_max_runs: runs whose events the in-memory log keeps after they end (older ones
            are served from the run_events archive; 1,000 keeps the idle process small; 0 = none).
        event_log_max_bytes: about how much memory those ended runs' events may take together
            (default 64 MiB; the oldest runs are evicted first; 0 = none kept).
        summarization_budget_tokens: estimated thread size (tokens, ~4 chars each) past which the
            older part is summarized before the next model call; 0 turns summarization off.
        summarization_keep_tokens: about how much recent conversation is kept verbatim (whole turns;
            the current turn always is, so 0 keeps that one only).
        openai_base_url / openai_api_key / openai_models: the "openai" provider: API base URL,
            the platform's key (empty: the provider serves only bring-your-own-key requests),
            and the allowed model ids, comma-separated ("*" allows any).
        anthropic_base_url / anthropic_api_key / anthropic_models: the same for "anthropic".
        anthropic_max_tokens: `max_tokens` of each Anthropic call.
        openai_compatible_providers: more OpenAI-compatible providers as JSON
            `{provider_id: {"base_url", "api_key_env"?, "models"?}}`; `api_key_env` names the
            environment variable holding the key (none: no key needed, e.g. a local Ollama);
            `models` is a list of allowed ids (absent: any).
        llm_max_retries: retries of a model call after a timeout, 429 or 5xx (so at most N+1
            attempts; 0 = no retry).
        llm_retry_base_delay_s / llm_retry_max_delay_s: exponential backoff start and cap, in
            seconds (0 = retry at once); a provider's Retry-After is honored (a longer one than the
            cap fails at once).
        llm_timeout_s: per-request timeout of a model call (connect, and between streamed chunks).
        llm_max_connections: HTTP connections per provider client at most, so model calls in
            flight to one provider and key (each streamed call holds one; the SDKs' default,
            1,000, would queue the rest).
        run_events_max_len: approximate cap of a run's Redis stream (XADD MAXLEN ~), in events.
        run_events_ttl_s: seconds a run's Redis stream is kept after the run ends (the database
            archive serves it afterwards).
        chat_claim_ttl_s: seconds after which a chat claim (start/resume/delete in progress) that
            was never released expires, so a crashed replica cannot block a chat.
        redis_retry_s: seconds followers keep retrying an unreachable Redis, then end with an
            `error` event (0 = no retry); event writers retry until Redis answers and log an
            ERROR once this much time has passed.
        redis_max_connections: the most Redis connections one orchestrator holds (a pool every
            command shares, waited for when all are busy, never an error); the shared follower
            reads take `redis_readers` more, each on a connection of its own.
        redis_readers: connections over which one replica's followers of runs it does not own
            share their blocking stream reads (`StreamReader`).
        run_lease_s: crash-detection bound in seconds: a running run whose loop stopped renewing
            its lease (its process died) is failed by any replica within this time.
        cancel_wait_s: how long Cancel waits for a run on another replica to stop (0 = looks once).
        idempotency_ttl_s: how long a turn start's request_id (the gateway's Idempotency-Key)
            answers the turn it started (24 h; the gateway keeps its keys as long).
    """

    orchestrator_port: int = Field(default=50051, ge=0, le=MAX_PORT)
    orchestrator_metrics_port: int = Field(default=9101, ge=0, le=MAX_PORT)
    orchestrator_database_url: str = ""
    auto_migrate: bool = True
    recursion_limit: int = Field(default=100, ge=1)
    failure_guidance_threshold: int = Field(default=3, ge=1)
    llm_call_guidance_every: int = Field(default=20, ge=0)
    pending_ttl_s: int = Field(default=7 * 24 * 3600, gt=0, le=MAX_SECONDS)
    scripted_model_enabled: bool = True
    default_integration_name: str = "loopline"
    default_provider_id: str = "scripted"
    default_model_id: str = "default"
    tool_timeout_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    stream_url_prefix: str = "/assistant/chat"
    event_log_max_runs: int = Field(default=1_000, ge=0)
    event_log_max_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    summarization_budget_tokens: int = Field(default=60_000, ge=0)
    summarization_keep_tokens: int = Field(default=12_000, ge=0)
    openai_base_url: str = "https://api.openai.com/v1"
    openai_api_key: str = ""
    openai_models: str = "gpt-4.1,gpt-4.1-mini,gpt-4.1-nano,gpt-4o,gpt-4o-mini,o4-mini"
    anthropic_base_url: str = "https://api.anthropic.com"
    anthropic_api_key: str = ""
    anthropic_models: str = (
        "claude-opus-4-1,claude-sonnet-4-5,claude-sonnet-4-0,claude-haiku-4-5,"
        "claude-3-5-haiku-latest"
    )
    anthropic_max_tokens: int = Field(default=4096, ge=1)
    openai_compatible_providers: dict[str, dict[str, Any]] = {}
    llm_max_retries: int = Field(default=2, ge=0)
    llm_retry_base_delay_s: float = Field(default=0.5, ge=0, le=MAX_SECONDS)
    llm_retry_max_delay_s: float = Field(default=30.0, ge=0, le=MAX_SECONDS)
    llm_timeout_s: float = Field(default=120.0, gt=0, le=MAX_SECONDS)
    llm_max_connections: int = Field(default=10_000, ge=1, le=1_000_000)
    run_events_max_len: int = Field(default=10_000, ge=1)
    run_events_ttl_s: float = Field(default=86_400.0, gt=0, le=MAX_SECONDS)
    chat_claim_ttl_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    redis_retry_s: float = Field(default=30.0, ge=0, le=MAX_SECONDS)
    redis_max_connections: int = Field(default=32, ge=2, le=10_000)
    redis_readers: int = Field(default=2, ge=1, le=64)
    run_lease_s: float = Field(default=30.0, gt=0, le=MAX_SECONDS)
    cancel_wait_s: float = Field(default=10.0, ge=0, le=MAX_SECONDS)
    idempotency_ttl_s: float = Field(default=86_400.0, gt=0, le=MAX_SECONDS)

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.orchestrator_database_url or self.sqlite_url("orchestrator")
