"""Orchestrator settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

from services.common.config import CommonSettings


class OrchestratorSettings(CommonSettings):
    """Settings of the orchestrator.

    Attributes:
        orchestrator_port: gRPC port (0 = any free port).
        orchestrator_database_url: SQLAlchemy URL; empty = SQLite `<data_dir>/orchestrator.db`.
        auto_migrate: apply Alembic migrations at start.
        recursion_limit: loop steps per run (a model call or a tool execution is one step); spec default 100.
        failure_guidance_threshold: consecutive tool failures that publish guidance; spec default 3.
        llm_call_guidance_every: every Nth model call publishes wind-down guidance; spec default 20.
        pending_ttl_s: lifetime of a pending question (spec: 7 days).
        scripted_model_enabled: whether the `scripted` provider may be used.
        default_integration_name / default_provider_id / default_model_id: the model used when a
            request names none and the organization has saved no default.
        tool_timeout_s: deadline of one ExecuteTool call.
        stream_url_prefix: path prefix of the stream_url returned to clients.
        event_log_max_runs: runs whose events the in-memory log keeps after they end.
    """

    orchestrator_port: int = 50051
    orchestrator_database_url: str = ""
    auto_migrate: bool = True
    recursion_limit: int = 100
    failure_guidance_threshold: int = 3
    llm_call_guidance_every: int = 20
    pending_ttl_s: int = 7 * 24 * 3600
    scripted_model_enabled: bool = True
    default_integration_name: str = "loopline"
    default_provider_id: str = "scripted"
    default_model_id: str = "default"
    tool_timeout_s: float = 60.0
    stream_url_prefix: str = "/assistant/chat"
    event_log_max_runs: int = 10_000

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.orchestrator_database_url or self.sqlite_url("orchestrator")
