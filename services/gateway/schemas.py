"""The JSON bodies of the gateway's success answers, as typed dicts.

Each route builds its answer as one of these (the builder's return annotation) and names the same
type as its `response_model`, from which FastAPI writes the answer's schema in the OpenAPI
document: mypy checks every builder's keys and value types against the type, so the document
cannot drift from what is sent. The handlers return the bytes themselves (a Response), so FastAPI
neither validates nor re-encodes them: no CPU per request, and the hot path's answer
(`hot_path.turn_json`) is built the same way. Field docstrings become the schema's descriptions.

Typed dicts of typing_extensions: pydantic needs them on Python 3.11.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, WithJsonSchema, with_config
from typing_extensions import TypedDict

_DOCSTRINGS = ConfigDict(use_attribute_docstrings=True)

# A JSON object the services pass through as stored (numbers exact, keys in their order); null
# when there is none.
JsonObjectOrNull = Annotated[Any, WithJsonSchema({"type": ["object", "null"]})]
# Any JSON value, as stored.
Json = Any


# ---- turns ----------------------------------------------------------------------------------


@with_config(_DOCSTRINGS)
class TurnStarted(TypedDict):
    """A started or resumed turn: listen to `stream_url` for its events."""

    status: str
    """`running`."""
    chat_id: str
    run_id: str
    """The new run: it keys the stream, the status and the history."""
    thread_id: str
    """Equal to `chat_id` for the chat's whole life."""
    stream_url: str
    """`/assistant/chat/{chat_id}/listen/{run_id}`."""


class RunCancelled(TypedDict):
    """The cancelled run of a chat."""

    status: str
    chat_id: str
    run_id: str


# ---- chats ----------------------------------------------------------------------------------


@with_config(_DOCSTRINGS)
class Message(TypedDict):
    """A message of a chat, oldest first."""

    id: str
    role: str
    content: Json
    """The message's content as stored (JSON: keys in their order, numbers exact)."""
    thinking: Json
    run_id: str | None
    running_status: str | None
    created_at: str | None


@with_config(_DOCSTRINGS)
class Chat(TypedDict):
    """A chat with a page of its messages and its pending question."""

    id: str
    kind: Literal["assistant"]
    workflow_id: None
    title: str
    running_id: str | None
    """The in-flight or paused run; null when none."""
    pending_user_input_request: JsonObjectOrNull
    """The open question (the SDK's UserInputRequest), or null."""
    created_at: str | None
    updated_at: str | None
    messages: list[Message]
    next_page_token: NotRequired[str]
    """The `page_token` of the older messages; absent when there are none."""


class ChatSummary(TypedDict):
    """A chat of the caller's list."""

    id: str
    title: str
    created_at: str | None
    updated_at: str | None
    is_running: bool


@with_config(_DOCSTRINGS)
class ChatPage(TypedDict):
    """The caller's chats, newest first."""

    items: list[ChatSummary]
    next_cursor: str | None
    """The `cursor` of the next page; null on the last one."""


@with_config(_DOCSTRINGS)
class ChatStatus(TypedDict):
    """Whether a chat is running or waiting for an answer."""

    chat_id: str
    is_running: bool
    awaiting_input: bool
    pending_request_id: str | None
    running_id: str | None
    run_status: dict[str, Any] | None
    """`{run_id, status, durable_id}` of the chat's latest run; null before the first."""


class ChatDeleted(TypedDict):
    """A deleted chat."""

    status: str
    chat_id: str
    permanent: bool


# ---- organization settings ------------------------------------------------------------------


class SavedModel(TypedDict):
    """A model: the organization's saved default, used by turns that name none."""

    integration_name: str
    provider_id: str
    model_id: str
    credential_id: str | None


@with_config(_DOCSTRINGS)
class OrganizationSettings(TypedDict):
    """The organization's model preferences."""

    llm_model_visibility: dict[str, Any]
    composer_llm: SavedModel | None
    """The saved default model; null: the deployment's default."""


class ComposerLlm(TypedDict):
    """The organization's saved default model after a change (null: the deployment's)."""

    composer_llm: SavedModel | None


# ---- credentials ----------------------------------------------------------------------------


@with_config(_DOCSTRINGS)
class Credential(TypedDict):
    """A credential's metadata (the secret is never returned)."""

    credential_id: str
    integration_name: str
    integration_type: Literal["mcp", "integration"]
    display_name: str
    auth_type: str
    is_default: bool
    created_at: str | None
    updated_at: str | None
    last_used_at: None
    expires_at: Json
    """`expires_at` of its metadata; null without."""
    credentials_metadata: dict[str, Any]


@with_config(_DOCSTRINGS)
class CredentialDetail(Credential):
    """A credential with its owner and, on request, its masked secret."""

    organization_id: str
    created_by: str | None
    created_by_email: str | None
    auth_data_masked: str | None
    """The secret masked, with `include_masked=true`; else null."""


class CredentialPage(TypedDict):
    """A page of the organization's credentials, newest first."""

    credentials: list[Credential]
    total: int
    limit: int
    offset: int
    has_next: bool
    has_previous: bool


class McpTool(TypedDict):
    """A tool discovered on an MCP server."""

    name: str
    description: str
    input_schema: dict[str, Any]


@with_config(_DOCSTRINGS)
class McpServerCreated(TypedDict):
    """A registered MCP server and the tools discovered on it."""

    credential_id: str
    integration_name: str
    display_name: str
    auth_type: str
    is_default: bool
    created_at: str | None
    credentials_metadata: dict[str, Any]
    tools: list[McpTool]
    total_tools: int
    discovery_error: str | None
    """Why discovery failed; null when it worked."""


class OAuth2Started(TypedDict):
    """Where to send the browser, and the flow's single-use state."""

    authorization_url: str
    state: str


@with_config(_DOCSTRINGS)
class OAuth2Connected(Credential):
    """The credential an OAuth2 authorization stored."""

    status: Literal["connected"]
    orchestrator_notified: bool
    """Whether paused runs waiting for it were told (they resume by themselves)."""


class ToolChanges(TypedDict):
    """The tool names a discovery added and removed."""

    added: list[str]
    removed: list[str]


class DiscoveryRefreshed(TypedDict):
    """The result of discovering an MCP server's tools again."""

    credential_id: str
    refreshed_at: str | None
    changes: ToolChanges
    total_tools: int
    success: bool
    error: str | None


class McpToolList(TypedDict):
    """The tools discovered on an MCP server."""

    credential_id: str
    tools: list[McpTool]
    total_count: int
    discovered_at: str | None


# ---- knowledge ------------------------------------------------------------------------------


@with_config(_DOCSTRINGS)
class KnowledgeBase(TypedDict):
    """A knowledge base: its embedding model and its (fixed) chunking."""

    id: str
    organization_id: str
    created_by_user_id: str | None
    credential_id: str | None
    """The credential (integration `openai`) its embeddings use; null for the local model."""
    name: str
    description: str
    embedding_config: dict[str, Any]
    """`{provider, model, dimensions}`: `local` (the tools service's own model) or `openai`."""
    chunking_config: dict[str, Any]
    document_count: int
    total_chunks: int
    total_tokens: int
    status: str
    """`active`."""
    created_at: str | None
    updated_at: str | None
    stats: None


@with_config(_DOCSTRINGS)
class Document(TypedDict):
    """A document of a knowledge base."""

    id: str
    knowledge_base_id: str
    filename: str
    file_type: str
    """txt, md, html, csv, json or pdf."""
    file_size_bytes: int
    status: str
    """pending, processing (being embedded; keyword search already finds it), completed or
    failed."""
    chunk_count: int
    token_count: int
    error_message: str | None
    """Why indexing failed (`failed`); null otherwise."""
    created_at: str | None


class DocumentStatus(TypedDict):
    """A document's processing status: chunked and keyword-indexed within its upload, then
    embedded (`processing` until its embeddings are written)."""

    document_id: str
    status: str
    filename: str
    file_type: str
    message: str | None
    processing_started_at: str | None
    processing_completed_at: str | None
    chunk_count: int
    token_count: int
    error: str | None


@with_config(_DOCSTRINGS)
class SearchMatch(TypedDict):
    """A chunk that matched a search, best first."""

    chunk_id: str
    document_id: str
    document_filename: str
    chunk_index: int
    score: float
    content: str | None
    """The chunk's text; null with `include_content: false`."""
    metadata: dict[str, str] | None
    """`{knowledge_base_id}`; null with `include_metadata: false`."""
    semantic_score: float
    """The cosine similarity of the query's and the chunk's embeddings (0 to 1)."""
    keyword_score: float
    """The share of the query's words (common words aside) the chunk contains (0 to 1)."""


class Search(TypedDict):
    """The matches of a search of one knowledge base."""

    query: str
    knowledge_base_id: str
    top_k: int
    total_matches: int
    matches: list[SearchMatch]


class MultiSearch(TypedDict):
    """The matches of a search of several knowledge bases."""

    query: str
    knowledge_bases_searched: int
    top_k: int
    total_matches: int
    matches: list[SearchMatch]


@with_config(_DOCSTRINGS)
class HybridSearch(TypedDict):
    """The matches of a hybrid search of one knowledge base."""

    query: str
    knowledge_base_id: str
    search_type: Literal["hybrid"]
    weights: dict[str, float]
    """`{semantic, keyword}` as given; a match's score is their weighted mean of its scores."""
    top_k: int
    total_matches: int
    matches: list[SearchMatch]


@with_config(_DOCSTRINGS)
class ContextSource(TypedDict):
    """A chunk the context holds, in its order."""

    chunk_id: str
    document_id: str
    document_filename: str
    chunk_index: int
    score: float


@with_config(_DOCSTRINGS)
class Context(TypedDict):
    """The best chunks for a query as one text for a model's prompt, within a token budget."""

    context: str
    """Each chunk as a line `[n] <file> (chunk <index>, score <score>)` then its text, a blank
    line between chunks; "" when nothing matched."""
    query: str
    sources: list[ContextSource]
    token_count: int
    """The context's word tokens (at most `max_tokens`)."""


# ---- integrations ---------------------------------------------------------------------------


@with_config(_DOCSTRINGS)
class IntegrationAction(TypedDict):
    """An action of an integration, as `execute_integration_tool` runs it."""

    name: str
    display_name: str
    description: str
    parameters: dict[str, Any]
    """The JSON Schema of its parameters."""


@with_config(_DOCSTRINGS)
class SetupVariable(TypedDict):
    """A field of a credential's `auth_data` for this auth schema."""

    name: str
    display_name: str
    description: str
    required: bool
    sensitive: bool
    """A secret value (never shown again once stored)."""


@with_config(_DOCSTRINGS)
class AuthSchema(TypedDict):
    """One way to connect an integration (POST /credentials with this `auth_type`, or the OAuth2
    flow for `oauth2`)."""

    auth_type: str
    """api_key, bearer_token, oauth2, custom or mcp_server."""
    display_name: str
    description: str
    setup_environment_variables: list[SetupVariable]
    setup_instructions: list[str]
    oauth_config: JsonObjectOrNull
    """For oauth2: authorize_url, token_url, scopes, use_pkce where known; else null."""
    required_scopes: list[str]
    supports_modulex_oauth: NotRequired[bool]
    """On the detail routes, for oauth2: whether the operator configured its OAuth2 app (connect
    it with POST /credentials/oauth2/initiate)."""
    supports_custom_oauth: NotRequired[bool]
    """On the detail routes, for oauth2: always false (custom OAuth apps are not supported)."""


@with_config(_DOCSTRINGS)
class IntegrationModel(TypedDict):
    """A model id a model provider allows (`llm.model_id`)."""

    id: str
    name: str
    display_name: str


IntegrationType = Literal["tool", "llm_provider", "knowledge_provider"]


@with_config(_DOCSTRINGS)
class IntegrationSummary(TypedDict):
    """An integration as listed; `actions`, `models` and `auth_schemas` only with
    `include_details` (browse), else null."""

    name: str
    display_name: str
    description: str
    logo: str | None
    app_url: str | None
    docs_url: None
    categories: list[str]
    integration_type: IntegrationType
    version: str | None
    status: Literal["connected", "available"]
    """connected: the organization has a credential for it, or it needs none."""
    recommended: bool
    actions: list[IntegrationAction] | None
    models: list[IntegrationModel] | None
    """A model provider's allowed model ids ([] when it allows any); null for the others."""
    auth_schemas: list[AuthSchema] | None


@with_config(_DOCSTRINGS)
class IntegrationPage(TypedDict):
    """A page of GET /integrations/browse."""

    integrations: list[IntegrationSummary]
    total: int
    """How many integrations match the filters in all."""
    page: int
    page_size: int
    has_more: bool


@with_config(_DOCSTRINGS)
class IntegrationDetail(TypedDict):
    """One integration with its auth schemas and its actions (tools, knowledge) or models (model
    providers); GET /integrations/{name} sets both."""

    name: str
    display_name: str
    description: str
    logo: str | None
    app_url: str | None
    docs_url: None
    categories: list[str]
    integration_type: IntegrationType
    version: str | None
    status: Literal["connected", "available"]
    auth_schemas: list[AuthSchema]
    actions: list[IntegrationAction] | None
    models: list[IntegrationModel] | None
    features: None
    metadata: dict[str, Any]
    """`source`, `requires_credential`, `actions` (each action's `credit_cost_millicredits` and
    `effects`: create, send, delete) and, for a model provider, `any_model`."""
