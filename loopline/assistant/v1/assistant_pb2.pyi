import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from loopline.assistant.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LlmConfig(_message.Message):
    __slots__ = ("integration_name", "provider_id", "model_id", "credential_id")
    INTEGRATION_NAME_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    integration_name: str
    provider_id: str
    model_id: str
    credential_id: str
    def __init__(self, integration_name: _Optional[str] = ..., provider_id: _Optional[str] = ..., model_id: _Optional[str] = ..., credential_id: _Optional[str] = ...) -> None: ...

class Caller(_message.Message):
    __slots__ = ("organization_id", "user_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    user_id: str
    def __init__(self, organization_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class StartTurnRequest(_message.Message):
    __slots__ = ("caller", "message", "chat_id", "llm", "kind", "request_id")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    LLM_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    message: str
    chat_id: str
    llm: LlmConfig
    kind: str
    request_id: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., message: _Optional[str] = ..., chat_id: _Optional[str] = ..., llm: _Optional[_Union[LlmConfig, _Mapping]] = ..., kind: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class StartTurnResponse(_message.Message):
    __slots__ = ("status", "chat_id", "run_id", "thread_id", "stream_url")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_URL_FIELD_NUMBER: _ClassVar[int]
    status: str
    chat_id: str
    run_id: str
    thread_id: str
    stream_url: str
    def __init__(self, status: _Optional[str] = ..., chat_id: _Optional[str] = ..., run_id: _Optional[str] = ..., thread_id: _Optional[str] = ..., stream_url: _Optional[str] = ...) -> None: ...

class StreamRunRequest(_message.Message):
    __slots__ = ("caller", "chat_id", "run_id", "after", "max_batch")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    run_id: str
    after: int
    max_batch: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ..., run_id: _Optional[str] = ..., after: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class StreamRunResponse(_message.Message):
    __slots__ = ("event", "events")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.Event
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.Event]
    def __init__(self, event: _Optional[_Union[_events_pb2.Event, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_events_pb2.Event, _Mapping]]] = ...) -> None: ...

class StreamRunsRequest(_message.Message):
    __slots__ = ("stream_id", "follow", "stop")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    follow: StreamRunRequest
    stop: bool
    def __init__(self, stream_id: _Optional[int] = ..., follow: _Optional[_Union[StreamRunRequest, _Mapping]] = ..., stop: _Optional[bool] = ...) -> None: ...

class RunStreamEvents(_message.Message):
    __slots__ = ("stream_id", "events", "accepted", "end_status", "ended")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    END_STATUS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.Event]
    accepted: bool
    end_status: bytes
    ended: bool
    def __init__(self, stream_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[_events_pb2.Event, _Mapping]]] = ..., accepted: _Optional[bool] = ..., end_status: _Optional[bytes] = ..., ended: _Optional[bool] = ...) -> None: ...

class StreamRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStreamEvents]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStreamEvents, _Mapping]]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("caller", "chat_id", "request_id", "response", "llm", "response_json")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LLM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_JSON_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    request_id: str
    response: _struct_pb2.Struct
    llm: LlmConfig
    response_json: bytes
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ..., request_id: _Optional[str] = ..., response: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., llm: _Optional[_Union[LlmConfig, _Mapping]] = ..., response_json: _Optional[bytes] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("status", "chat_id", "run_id", "thread_id", "stream_url")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_URL_FIELD_NUMBER: _ClassVar[int]
    status: str
    chat_id: str
    run_id: str
    thread_id: str
    stream_url: str
    def __init__(self, status: _Optional[str] = ..., chat_id: _Optional[str] = ..., run_id: _Optional[str] = ..., thread_id: _Optional[str] = ..., stream_url: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("caller", "chat_id", "reason")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    reason: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("status", "chat_id", "run_id")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    status: str
    chat_id: str
    run_id: str
    def __init__(self, status: _Optional[str] = ..., chat_id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class GetChatRequest(_message.Message):
    __slots__ = ("caller", "chat_id", "page_size", "page_token")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    page_size: int
    page_token: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("id", "role", "content", "run_id", "running_status", "create_time", "thinking", "content_json", "thinking_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    CONTENT_JSON_FIELD_NUMBER: _ClassVar[int]
    THINKING_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    content: _struct_pb2.Value
    run_id: str
    running_status: str
    create_time: _timestamp_pb2.Timestamp
    thinking: _struct_pb2.Struct
    content_json: bytes
    thinking_json: bytes
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., content: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., run_id: _Optional[str] = ..., running_status: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., thinking: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., content_json: _Optional[bytes] = ..., thinking_json: _Optional[bytes] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("id", "title", "running_id", "pending_user_input_request", "create_time", "update_time", "kind", "pending_user_input_request_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_USER_INPUT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PENDING_USER_INPUT_REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    title: str
    running_id: str
    pending_user_input_request: _struct_pb2.Struct
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    kind: str
    pending_user_input_request_json: bytes
    def __init__(self, id: _Optional[str] = ..., title: _Optional[str] = ..., running_id: _Optional[str] = ..., pending_user_input_request: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[str] = ..., pending_user_input_request_json: _Optional[bytes] = ...) -> None: ...

class GetChatResponse(_message.Message):
    __slots__ = ("chat", "messages", "next_page_token")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    next_page_token: str
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListChatsRequest(_message.Message):
    __slots__ = ("caller", "limit", "cursor")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    limit: int
    cursor: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class ListChatsResponse(_message.Message):
    __slots__ = ("chats", "next_cursor")
    CHATS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    chats: _containers.RepeatedCompositeFieldContainer[Chat]
    next_cursor: str
    def __init__(self, chats: _Optional[_Iterable[_Union[Chat, _Mapping]]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class GetChatStatusRequest(_message.Message):
    __slots__ = ("caller", "chat_id")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ...) -> None: ...

class GetChatStatusResponse(_message.Message):
    __slots__ = ("chat_id", "is_running", "awaiting_input", "pending_request_id", "running_id", "run_status")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    IS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    AWAITING_INPUT_FIELD_NUMBER: _ClassVar[int]
    PENDING_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_STATUS_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    is_running: bool
    awaiting_input: bool
    pending_request_id: str
    running_id: str
    run_status: _struct_pb2.Struct
    def __init__(self, chat_id: _Optional[str] = ..., is_running: _Optional[bool] = ..., awaiting_input: _Optional[bool] = ..., pending_request_id: _Optional[str] = ..., running_id: _Optional[str] = ..., run_status: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class DeleteChatRequest(_message.Message):
    __slots__ = ("caller", "chat_id", "permanent")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    chat_id: str
    permanent: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., chat_id: _Optional[str] = ..., permanent: _Optional[bool] = ...) -> None: ...

class DeleteChatResponse(_message.Message):
    __slots__ = ("status", "chat_id", "permanent")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    status: str
    chat_id: str
    permanent: bool
    def __init__(self, status: _Optional[str] = ..., chat_id: _Optional[str] = ..., permanent: _Optional[bool] = ...) -> None: ...

class NotifyCredentialConnectedRequest(_message.Message):
    __slots__ = ("organization_id", "integration", "credential_id", "user_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    integration: str
    credential_id: str
    user_id: str
    def __init__(self, organization_id: _Optional[str] = ..., integration: _Optional[str] = ..., credential_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class NotifyCredentialConnectedResponse(_message.Message):
    __slots__ = ("resumed_run_ids",)
    RESUMED_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    resumed_run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, resumed_run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckModelRequest(_message.Message):
    __slots__ = ("caller", "llm")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    LLM_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    llm: LlmConfig
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., llm: _Optional[_Union[LlmConfig, _Mapping]] = ...) -> None: ...

class CheckModelResponse(_message.Message):
    __slots__ = ("provider_id",)
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    def __init__(self, provider_id: _Optional[str] = ...) -> None: ...

class ListModelProvidersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

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

class ListModelProvidersResponse(_message.Message):
    __slots__ = ("providers",)
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    providers: _containers.RepeatedCompositeFieldContainer[ModelProvider]
    def __init__(self, providers: _Optional[_Iterable[_Union[ModelProvider, _Mapping]]] = ...) -> None: ...
