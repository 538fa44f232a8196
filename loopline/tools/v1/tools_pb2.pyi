import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SearchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEARCH_MODE_UNSPECIFIED: _ClassVar[SearchMode]
    SEARCH_MODE_HYBRID: _ClassVar[SearchMode]
    SEARCH_MODE_SEMANTIC: _ClassVar[SearchMode]
    SEARCH_MODE_KEYWORD: _ClassVar[SearchMode]
SEARCH_MODE_UNSPECIFIED: SearchMode
SEARCH_MODE_HYBRID: SearchMode
SEARCH_MODE_SEMANTIC: SearchMode
SEARCH_MODE_KEYWORD: SearchMode

class ToolDefinition(_message.Message):
    __slots__ = ("name", "description", "input_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ("profile",)
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    profile: str
    def __init__(self, profile: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ...) -> None: ...

class ExecuteToolRequest(_message.Message):
    __slots__ = ("organization_id", "tool", "input", "run_id", "tool_call_id", "chat_id", "input_json")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    tool: str
    input: _struct_pb2.Struct
    run_id: str
    tool_call_id: str
    chat_id: str
    input_json: bytes
    def __init__(self, organization_id: _Optional[str] = ..., tool: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., run_id: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., chat_id: _Optional[str] = ..., input_json: _Optional[bytes] = ...) -> None: ...

class ExecuteToolResponse(_message.Message):
    __slots__ = ("success", "output", "error", "millicredits", "output_json")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MILLICREDITS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    success: bool
    output: _struct_pb2.Value
    error: str
    millicredits: int
    output_json: bytes
    def __init__(self, success: _Optional[bool] = ..., output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[str] = ..., millicredits: _Optional[int] = ..., output_json: _Optional[bytes] = ...) -> None: ...

class Credential(_message.Message):
    __slots__ = ("credential_id", "organization_id", "integration_name", "auth_type", "display_name", "is_default", "create_time", "update_time", "metadata", "auth_data_masked", "created_by_user_id")
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    AUTH_DATA_MASKED_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_USER_ID_FIELD_NUMBER: _ClassVar[int]
    credential_id: str
    organization_id: str
    integration_name: str
    auth_type: str
    display_name: str
    is_default: bool
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    metadata: _struct_pb2.Struct
    auth_data_masked: str
    created_by_user_id: str
    def __init__(self, credential_id: _Optional[str] = ..., organization_id: _Optional[str] = ..., integration_name: _Optional[str] = ..., auth_type: _Optional[str] = ..., display_name: _Optional[str] = ..., is_default: _Optional[bool] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., auth_data_masked: _Optional[str] = ..., created_by_user_id: _Optional[str] = ...) -> None: ...

class CreateCredentialRequest(_message.Message):
    __slots__ = ("organization_id", "integration_name", "auth_type", "auth_data", "display_name", "metadata", "make_default", "user_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MAKE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    integration_name: str
    auth_type: str
    auth_data: _struct_pb2.Struct
    display_name: str
    metadata: _struct_pb2.Struct
    make_default: bool
    user_id: str
    def __init__(self, organization_id: _Optional[str] = ..., integration_name: _Optional[str] = ..., auth_type: _Optional[str] = ..., auth_data: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., display_name: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., make_default: _Optional[bool] = ..., user_id: _Optional[str] = ...) -> None: ...

class CreateCredentialResponse(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: Credential
    def __init__(self, credential: _Optional[_Union[Credential, _Mapping]] = ...) -> None: ...

class ListCredentialsRequest(_message.Message):
    __slots__ = ("organization_id", "integration_name", "auth_type", "limit", "offset")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    integration_name: str
    auth_type: str
    limit: int
    offset: int
    def __init__(self, organization_id: _Optional[str] = ..., integration_name: _Optional[str] = ..., auth_type: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListCredentialsResponse(_message.Message):
    __slots__ = ("credentials", "total")
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    credentials: _containers.RepeatedCompositeFieldContainer[Credential]
    total: int
    def __init__(self, credentials: _Optional[_Iterable[_Union[Credential, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class GetCredentialRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id", "include_masked")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_MASKED_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    include_masked: bool
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ..., include_masked: _Optional[bool] = ...) -> None: ...

class GetCredentialResponse(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: Credential
    def __init__(self, credential: _Optional[_Union[Credential, _Mapping]] = ...) -> None: ...

class DeleteCredentialRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ...) -> None: ...

class DeleteCredentialResponse(_message.Message):
    __slots__ = ("new_default_credential_id",)
    NEW_DEFAULT_CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    new_default_credential_id: str
    def __init__(self, new_default_credential_id: _Optional[str] = ...) -> None: ...

class SetDefaultCredentialRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ...) -> None: ...

class SetDefaultCredentialResponse(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: Credential
    def __init__(self, credential: _Optional[_Union[Credential, _Mapping]] = ...) -> None: ...

class KnowledgeBase(_message.Message):
    __slots__ = ("knowledge_base_id", "organization_id", "name", "description", "document_count", "create_time", "total_chunks", "total_tokens", "created_by_user_id", "embedding")
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_USER_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    knowledge_base_id: str
    organization_id: str
    name: str
    description: str
    document_count: int
    create_time: _timestamp_pb2.Timestamp
    total_chunks: int
    total_tokens: int
    created_by_user_id: str
    embedding: EmbeddingConfig
    def __init__(self, knowledge_base_id: _Optional[str] = ..., organization_id: _Optional[str] = ..., name: _Optional[str] = ..., description: _Optional[str] = ..., document_count: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., total_chunks: _Optional[int] = ..., total_tokens: _Optional[int] = ..., created_by_user_id: _Optional[str] = ..., embedding: _Optional[_Union[EmbeddingConfig, _Mapping]] = ...) -> None: ...

class EmbeddingConfig(_message.Message):
    __slots__ = ("provider", "model", "dimensions", "credential_id")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    provider: str
    model: str
    dimensions: int
    credential_id: str
    def __init__(self, provider: _Optional[str] = ..., model: _Optional[str] = ..., dimensions: _Optional[int] = ..., credential_id: _Optional[str] = ...) -> None: ...

class CreateKnowledgeBaseRequest(_message.Message):
    __slots__ = ("organization_id", "name", "description", "user_id", "embedding")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    name: str
    description: str
    user_id: str
    embedding: EmbeddingConfig
    def __init__(self, organization_id: _Optional[str] = ..., name: _Optional[str] = ..., description: _Optional[str] = ..., user_id: _Optional[str] = ..., embedding: _Optional[_Union[EmbeddingConfig, _Mapping]] = ...) -> None: ...

class CreateKnowledgeBaseResponse(_message.Message):
    __slots__ = ("knowledge_base",)
    KNOWLEDGE_BASE_FIELD_NUMBER: _ClassVar[int]
    knowledge_base: KnowledgeBase
    def __init__(self, knowledge_base: _Optional[_Union[KnowledgeBase, _Mapping]] = ...) -> None: ...

class ListKnowledgeBasesRequest(_message.Message):
    __slots__ = ("organization_id",)
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    def __init__(self, organization_id: _Optional[str] = ...) -> None: ...

class ListKnowledgeBasesResponse(_message.Message):
    __slots__ = ("knowledge_bases",)
    KNOWLEDGE_BASES_FIELD_NUMBER: _ClassVar[int]
    knowledge_bases: _containers.RepeatedCompositeFieldContainer[KnowledgeBase]
    def __init__(self, knowledge_bases: _Optional[_Iterable[_Union[KnowledgeBase, _Mapping]]] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("document_id", "knowledge_base_id", "name", "content_type", "status", "chunk_count", "create_time", "file_size_bytes", "token_count", "error_message", "index_time")
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_TIME_FIELD_NUMBER: _ClassVar[int]
    document_id: str
    knowledge_base_id: str
    name: str
    content_type: str
    status: str
    chunk_count: int
    create_time: _timestamp_pb2.Timestamp
    file_size_bytes: int
    token_count: int
    error_message: str
    index_time: _timestamp_pb2.Timestamp
    def __init__(self, document_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ..., name: _Optional[str] = ..., content_type: _Optional[str] = ..., status: _Optional[str] = ..., chunk_count: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., file_size_bytes: _Optional[int] = ..., token_count: _Optional[int] = ..., error_message: _Optional[str] = ..., index_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AddDocumentRequest(_message.Message):
    __slots__ = ("organization_id", "knowledge_base_id", "name", "content_type", "text", "data")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    knowledge_base_id: str
    name: str
    content_type: str
    text: str
    data: bytes
    def __init__(self, organization_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ..., name: _Optional[str] = ..., content_type: _Optional[str] = ..., text: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class AddDocumentResponse(_message.Message):
    __slots__ = ("document",)
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    document: Document
    def __init__(self, document: _Optional[_Union[Document, _Mapping]] = ...) -> None: ...

class SearchKnowledgeRequest(_message.Message):
    __slots__ = ("organization_id", "query", "knowledge_base_ids", "top_k", "mode", "semantic_weight", "keyword_weight", "min_score")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    query: str
    knowledge_base_ids: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    mode: SearchMode
    semantic_weight: float
    keyword_weight: float
    min_score: float
    def __init__(self, organization_id: _Optional[str] = ..., query: _Optional[str] = ..., knowledge_base_ids: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., mode: _Optional[_Union[SearchMode, str]] = ..., semantic_weight: _Optional[float] = ..., keyword_weight: _Optional[float] = ..., min_score: _Optional[float] = ...) -> None: ...

class KnowledgeSearchResult(_message.Message):
    __slots__ = ("knowledge_base_id", "document_id", "document_name", "chunk_id", "chunk_index", "content", "score", "semantic_score", "keyword_score")
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_SCORE_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_SCORE_FIELD_NUMBER: _ClassVar[int]
    knowledge_base_id: str
    document_id: str
    document_name: str
    chunk_id: str
    chunk_index: int
    content: str
    score: float
    semantic_score: float
    keyword_score: float
    def __init__(self, knowledge_base_id: _Optional[str] = ..., document_id: _Optional[str] = ..., document_name: _Optional[str] = ..., chunk_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., content: _Optional[str] = ..., score: _Optional[float] = ..., semantic_score: _Optional[float] = ..., keyword_score: _Optional[float] = ...) -> None: ...

class SearchKnowledgeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KnowledgeSearchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KnowledgeSearchResult, _Mapping]]] = ...) -> None: ...

class GetDocumentRequest(_message.Message):
    __slots__ = ("organization_id", "knowledge_base_id", "document_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    knowledge_base_id: str
    document_id: str
    def __init__(self, organization_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ..., document_id: _Optional[str] = ...) -> None: ...

class GetDocumentResponse(_message.Message):
    __slots__ = ("document",)
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    document: Document
    def __init__(self, document: _Optional[_Union[Document, _Mapping]] = ...) -> None: ...

class ListDocumentsRequest(_message.Message):
    __slots__ = ("organization_id", "knowledge_base_id", "limit", "offset")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    knowledge_base_id: str
    limit: int
    offset: int
    def __init__(self, organization_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListDocumentsResponse(_message.Message):
    __slots__ = ("documents",)
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    def __init__(self, documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ...) -> None: ...

class DeleteDocumentRequest(_message.Message):
    __slots__ = ("organization_id", "knowledge_base_id", "document_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    knowledge_base_id: str
    document_id: str
    def __init__(self, organization_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ..., document_id: _Optional[str] = ...) -> None: ...

class DeleteDocumentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteKnowledgeBaseRequest(_message.Message):
    __slots__ = ("organization_id", "knowledge_base_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    knowledge_base_id: str
    def __init__(self, organization_id: _Optional[str] = ..., knowledge_base_id: _Optional[str] = ...) -> None: ...

class DeleteKnowledgeBaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class McpTool(_message.Message):
    __slots__ = ("name", "description", "input_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CreateMcpServerRequest(_message.Message):
    __slots__ = ("organization_id", "server_url", "headers", "display_name", "make_default", "user_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_URL_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    MAKE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    server_url: str
    headers: _struct_pb2.Struct
    display_name: str
    make_default: bool
    user_id: str
    def __init__(self, organization_id: _Optional[str] = ..., server_url: _Optional[str] = ..., headers: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., display_name: _Optional[str] = ..., make_default: _Optional[bool] = ..., user_id: _Optional[str] = ...) -> None: ...

class CreateMcpServerResponse(_message.Message):
    __slots__ = ("credential", "tools", "discovery_error")
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_ERROR_FIELD_NUMBER: _ClassVar[int]
    credential: Credential
    tools: _containers.RepeatedCompositeFieldContainer[McpTool]
    discovery_error: str
    def __init__(self, credential: _Optional[_Union[Credential, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[McpTool, _Mapping]]] = ..., discovery_error: _Optional[str] = ...) -> None: ...

class RefreshMcpDiscoveryRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ...) -> None: ...

class RefreshMcpDiscoveryResponse(_message.Message):
    __slots__ = ("credential_id", "success", "total_tools", "added", "removed", "refresh_time", "error")
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    REFRESH_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    credential_id: str
    success: bool
    total_tools: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    refresh_time: _timestamp_pb2.Timestamp
    error: str
    def __init__(self, credential_id: _Optional[str] = ..., success: _Optional[bool] = ..., total_tools: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., refresh_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class ListMcpToolsRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ...) -> None: ...

class ListMcpToolsResponse(_message.Message):
    __slots__ = ("credential_id", "tools", "discovery_time")
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_TIME_FIELD_NUMBER: _ClassVar[int]
    credential_id: str
    tools: _containers.RepeatedCompositeFieldContainer[McpTool]
    discovery_time: _timestamp_pb2.Timestamp
    def __init__(self, credential_id: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[McpTool, _Mapping]]] = ..., discovery_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class InitiateOAuth2Request(_message.Message):
    __slots__ = ("organization_id", "integration_name", "redirect_uri", "scope", "display_name", "make_default", "user_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_URI_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    MAKE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    integration_name: str
    redirect_uri: str
    scope: str
    display_name: str
    make_default: bool
    user_id: str
    def __init__(self, organization_id: _Optional[str] = ..., integration_name: _Optional[str] = ..., redirect_uri: _Optional[str] = ..., scope: _Optional[str] = ..., display_name: _Optional[str] = ..., make_default: _Optional[bool] = ..., user_id: _Optional[str] = ...) -> None: ...

class InitiateOAuth2Response(_message.Message):
    __slots__ = ("authorization_url", "state")
    AUTHORIZATION_URL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    authorization_url: str
    state: str
    def __init__(self, authorization_url: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class CompleteOAuth2Request(_message.Message):
    __slots__ = ("state", "code", "error")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    state: str
    code: str
    error: str
    def __init__(self, state: _Optional[str] = ..., code: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class CompleteOAuth2Response(_message.Message):
    __slots__ = ("credential", "user_id")
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    credential: Credential
    user_id: str
    def __init__(self, credential: _Optional[_Union[Credential, _Mapping]] = ..., user_id: _Optional[str] = ...) -> None: ...

class ResolveCredentialSecretRequest(_message.Message):
    __slots__ = ("organization_id", "credential_id", "integration_name")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    credential_id: str
    integration_name: str
    def __init__(self, organization_id: _Optional[str] = ..., credential_id: _Optional[str] = ..., integration_name: _Optional[str] = ...) -> None: ...

class ResolveCredentialSecretResponse(_message.Message):
    __slots__ = ("secret",)
    SECRET_FIELD_NUMBER: _ClassVar[int]
    secret: str
    def __init__(self, secret: _Optional[str] = ...) -> None: ...

class ModelProvider(_message.Message):
    __slots__ = ("provider_id", "integration_name", "display_name", "description", "model_ids", "any_model", "platform_key", "bring_your_own_key")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    ANY_MODEL_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_KEY_FIELD_NUMBER: _ClassVar[int]
    BRING_YOUR_OWN_KEY_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    integration_name: str
    display_name: str
    description: str
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    any_model: bool
    platform_key: bool
    bring_your_own_key: bool
    def __init__(self, provider_id: _Optional[str] = ..., integration_name: _Optional[str] = ..., display_name: _Optional[str] = ..., description: _Optional[str] = ..., model_ids: _Optional[_Iterable[str]] = ..., any_model: _Optional[bool] = ..., platform_key: _Optional[bool] = ..., bring_your_own_key: _Optional[bool] = ...) -> None: ...

class IntegrationAction(_message.Message):
    __slots__ = ("name", "description", "parameters", "credit_cost_millicredits", "effects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_COST_MILLICREDITS_FIELD_NUMBER: _ClassVar[int]
    EFFECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: _struct_pb2.Struct
    credit_cost_millicredits: int
    effects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., credit_cost_millicredits: _Optional[int] = ..., effects: _Optional[_Iterable[str]] = ...) -> None: ...

class AuthField(_message.Message):
    __slots__ = ("name", "display_name", "description", "required", "sensitive")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SENSITIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    display_name: str
    description: str
    required: bool
    sensitive: bool
    def __init__(self, name: _Optional[str] = ..., display_name: _Optional[str] = ..., description: _Optional[str] = ..., required: _Optional[bool] = ..., sensitive: _Optional[bool] = ...) -> None: ...

class AuthSchema(_message.Message):
    __slots__ = ("auth_type", "display_name", "description", "fields", "setup_instructions", "oauth_config", "oauth_connectable")
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SETUP_INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    OAUTH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    OAUTH_CONNECTABLE_FIELD_NUMBER: _ClassVar[int]
    auth_type: str
    display_name: str
    description: str
    fields: _containers.RepeatedCompositeFieldContainer[AuthField]
    setup_instructions: _containers.RepeatedScalarFieldContainer[str]
    oauth_config: _struct_pb2.Struct
    oauth_connectable: bool
    def __init__(self, auth_type: _Optional[str] = ..., display_name: _Optional[str] = ..., description: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[AuthField, _Mapping]]] = ..., setup_instructions: _Optional[_Iterable[str]] = ..., oauth_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., oauth_connectable: _Optional[bool] = ...) -> None: ...

class Integration(_message.Message):
    __slots__ = ("name", "display_name", "description", "logo", "app_url", "categories", "integration_type", "version", "connected", "source", "requires_credential", "details", "auth_schemas", "actions", "model_ids", "any_model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LOGO_FIELD_NUMBER: _ClassVar[int]
    APP_URL_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_TYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    AUTH_SCHEMAS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    ANY_MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    display_name: str
    description: str
    logo: str
    app_url: str
    categories: _containers.RepeatedScalarFieldContainer[str]
    integration_type: str
    version: str
    connected: bool
    source: str
    requires_credential: bool
    details: bool
    auth_schemas: _containers.RepeatedCompositeFieldContainer[AuthSchema]
    actions: _containers.RepeatedCompositeFieldContainer[IntegrationAction]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    any_model: bool
    def __init__(self, name: _Optional[str] = ..., display_name: _Optional[str] = ..., description: _Optional[str] = ..., logo: _Optional[str] = ..., app_url: _Optional[str] = ..., categories: _Optional[_Iterable[str]] = ..., integration_type: _Optional[str] = ..., version: _Optional[str] = ..., connected: _Optional[bool] = ..., source: _Optional[str] = ..., requires_credential: _Optional[bool] = ..., details: _Optional[bool] = ..., auth_schemas: _Optional[_Iterable[_Union[AuthSchema, _Mapping]]] = ..., actions: _Optional[_Iterable[_Union[IntegrationAction, _Mapping]]] = ..., model_ids: _Optional[_Iterable[str]] = ..., any_model: _Optional[bool] = ...) -> None: ...

class ListIntegrationsRequest(_message.Message):
    __slots__ = ("organization_id", "integration_type", "category", "auth_type", "search", "include_details", "offset", "limit", "model_providers")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_TYPE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    SEARCH_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MODEL_PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    integration_type: str
    category: str
    auth_type: str
    search: str
    include_details: bool
    offset: int
    limit: int
    model_providers: _containers.RepeatedCompositeFieldContainer[ModelProvider]
    def __init__(self, organization_id: _Optional[str] = ..., integration_type: _Optional[str] = ..., category: _Optional[str] = ..., auth_type: _Optional[str] = ..., search: _Optional[str] = ..., include_details: _Optional[bool] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ..., model_providers: _Optional[_Iterable[_Union[ModelProvider, _Mapping]]] = ...) -> None: ...

class ListIntegrationsResponse(_message.Message):
    __slots__ = ("integrations", "total_size")
    INTEGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    integrations: _containers.RepeatedCompositeFieldContainer[Integration]
    total_size: int
    def __init__(self, integrations: _Optional[_Iterable[_Union[Integration, _Mapping]]] = ..., total_size: _Optional[int] = ...) -> None: ...

class GetIntegrationRequest(_message.Message):
    __slots__ = ("organization_id", "name", "integration_type", "model_providers")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    name: str
    integration_type: str
    model_providers: _containers.RepeatedCompositeFieldContainer[ModelProvider]
    def __init__(self, organization_id: _Optional[str] = ..., name: _Optional[str] = ..., integration_type: _Optional[str] = ..., model_providers: _Optional[_Iterable[_Union[ModelProvider, _Mapping]]] = ...) -> None: ...

class GetIntegrationResponse(_message.Message):
    __slots__ = ("integration",)
    INTEGRATION_FIELD_NUMBER: _ClassVar[int]
    integration: Integration
    def __init__(self, integration: _Optional[_Union[Integration, _Mapping]] = ...) -> None: ...
