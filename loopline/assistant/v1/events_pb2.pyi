import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Event(_message.Message):
    __slots__ = ("seq", "run_id", "time", "metadata", "response_chunk", "tool_call", "tool_result", "guidance", "user_input_request", "interrupted", "run_resumed", "done", "error", "cancelled")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    USER_INPUT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    RUN_RESUMED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    run_id: str
    time: _timestamp_pb2.Timestamp
    metadata: MetadataEvent
    response_chunk: ResponseChunkEvent
    tool_call: ToolCallEvent
    tool_result: ToolResultEvent
    guidance: GuidanceEvent
    user_input_request: UserInputRequestEvent
    interrupted: InterruptedEvent
    run_resumed: RunResumedEvent
    done: DoneEvent
    error: ErrorEvent
    cancelled: CancelledEvent
    def __init__(self, seq: _Optional[int] = ..., run_id: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Union[MetadataEvent, _Mapping]] = ..., response_chunk: _Optional[_Union[ResponseChunkEvent, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCallEvent, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResultEvent, _Mapping]] = ..., guidance: _Optional[_Union[GuidanceEvent, _Mapping]] = ..., user_input_request: _Optional[_Union[UserInputRequestEvent, _Mapping]] = ..., interrupted: _Optional[_Union[InterruptedEvent, _Mapping]] = ..., run_resumed: _Optional[_Union[RunResumedEvent, _Mapping]] = ..., done: _Optional[_Union[DoneEvent, _Mapping]] = ..., error: _Optional[_Union[ErrorEvent, _Mapping]] = ..., cancelled: _Optional[_Union[CancelledEvent, _Mapping]] = ...) -> None: ...

class MetadataEvent(_message.Message):
    __slots__ = ("run_id", "thread_id", "workflow_type", "surface")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_TYPE_FIELD_NUMBER: _ClassVar[int]
    SURFACE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    thread_id: str
    workflow_type: str
    surface: str
    def __init__(self, run_id: _Optional[str] = ..., thread_id: _Optional[str] = ..., workflow_type: _Optional[str] = ..., surface: _Optional[str] = ...) -> None: ...

class ResponseChunkEvent(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: str
    def __init__(self, chunk: _Optional[str] = ...) -> None: ...

class ToolCallEvent(_message.Message):
    __slots__ = ("tool", "input", "tool_call_id", "input_json")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    tool: str
    input: _struct_pb2.Struct
    tool_call_id: str
    input_json: bytes
    def __init__(self, tool: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., tool_call_id: _Optional[str] = ..., input_json: _Optional[bytes] = ...) -> None: ...

class ToolResultEvent(_message.Message):
    __slots__ = ("tool", "tool_call_id", "output", "output_json")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    tool: str
    tool_call_id: str
    output: _struct_pb2.Value
    output_json: bytes
    def __init__(self, tool: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., output_json: _Optional[bytes] = ...) -> None: ...

class GuidanceEvent(_message.Message):
    __slots__ = ("message", "consecutive_failures", "total_llm_calls")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LLM_CALLS_FIELD_NUMBER: _ClassVar[int]
    message: str
    consecutive_failures: int
    total_llm_calls: int
    def __init__(self, message: _Optional[str] = ..., consecutive_failures: _Optional[int] = ..., total_llm_calls: _Optional[int] = ...) -> None: ...

class UserInputRequestEvent(_message.Message):
    __slots__ = ("request", "request_json")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    request: _struct_pb2.Struct
    request_json: bytes
    def __init__(self, request: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., request_json: _Optional[bytes] = ...) -> None: ...

class InterruptedEvent(_message.Message):
    __slots__ = ("request_id", "kind")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class RunResumedEvent(_message.Message):
    __slots__ = ("new_run_id",)
    NEW_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    new_run_id: str
    def __init__(self, new_run_id: _Optional[str] = ...) -> None: ...

class ToolCallRecord(_message.Message):
    __slots__ = ("tool", "input", "output", "output_json", "input_json")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    tool: str
    input: _struct_pb2.Struct
    output: _struct_pb2.Value
    output_json: bytes
    input_json: bytes
    def __init__(self, tool: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., output_json: _Optional[bytes] = ..., input_json: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "total_tokens", "llm_calls")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LLM_CALLS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    total_tokens: int
    llm_calls: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., llm_calls: _Optional[int] = ...) -> None: ...

class DoneEvent(_message.Message):
    __slots__ = ("response", "tool_calls", "usage", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallRecord]
    usage: Usage
    error: bool
    def __init__(self, response: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallRecord, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[bool] = ...) -> None: ...

class ErrorEvent(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class CancelledEvent(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
