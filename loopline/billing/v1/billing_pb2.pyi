import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReservationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVATION_STATE_UNSPECIFIED: _ClassVar[ReservationState]
    RESERVATION_STATE_HELD: _ClassVar[ReservationState]
    RESERVATION_STATE_CHARGED: _ClassVar[ReservationState]
    RESERVATION_STATE_RELEASED: _ClassVar[ReservationState]
    RESERVATION_STATE_EXPIRED: _ClassVar[ReservationState]
RESERVATION_STATE_UNSPECIFIED: ReservationState
RESERVATION_STATE_HELD: ReservationState
RESERVATION_STATE_CHARGED: ReservationState
RESERVATION_STATE_RELEASED: ReservationState
RESERVATION_STATE_EXPIRED: ReservationState

class AdmitRequest(_message.Message):
    __slots__ = ("organization_id", "turn_key", "usage_type", "rate_class", "credits")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_KEY_FIELD_NUMBER: _ClassVar[int]
    USAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    RATE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    turn_key: str
    usage_type: str
    rate_class: str
    credits: int
    def __init__(self, organization_id: _Optional[str] = ..., turn_key: _Optional[str] = ..., usage_type: _Optional[str] = ..., rate_class: _Optional[str] = ..., credits: _Optional[int] = ...) -> None: ...

class RateLimitState(_message.Message):
    __slots__ = ("limit", "remaining", "reset_seconds")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    remaining: int
    reset_seconds: int
    def __init__(self, limit: _Optional[int] = ..., remaining: _Optional[int] = ..., reset_seconds: _Optional[int] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("reservation_id", "state", "credits", "rate_limit", "replayed")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    state: ReservationState
    credits: int
    rate_limit: RateLimitState
    replayed: bool
    def __init__(self, reservation_id: _Optional[str] = ..., state: _Optional[_Union[ReservationState, str]] = ..., credits: _Optional[int] = ..., rate_limit: _Optional[_Union[RateLimitState, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class ChargeRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class ChargeResponse(_message.Message):
    __slots__ = ("state", "ledger_entry_id")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    state: ReservationState
    ledger_entry_id: str
    def __init__(self, state: _Optional[_Union[ReservationState, str]] = ..., ledger_entry_id: _Optional[str] = ...) -> None: ...

class ChargeBatchRequest(_message.Message):
    __slots__ = ("charges",)
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    charges: _containers.RepeatedCompositeFieldContainer[ChargeRequest]
    def __init__(self, charges: _Optional[_Iterable[_Union[ChargeRequest, _Mapping]]] = ...) -> None: ...

class ChargeBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ChargeResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ChargeResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "reason")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reason: str
    def __init__(self, reservation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: ReservationState
    def __init__(self, state: _Optional[_Union[ReservationState, str]] = ...) -> None: ...

class RecordUsageRequest(_message.Message):
    __slots__ = ("organization_id", "run_id", "call_index", "provider_id", "model_id", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "byok", "estimated", "chat_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYOK_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    run_id: str
    call_index: int
    provider_id: str
    model_id: str
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    byok: bool
    estimated: bool
    chat_id: str
    def __init__(self, organization_id: _Optional[str] = ..., run_id: _Optional[str] = ..., call_index: _Optional[int] = ..., provider_id: _Optional[str] = ..., model_id: _Optional[str] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cache_read_tokens: _Optional[int] = ..., cache_write_tokens: _Optional[int] = ..., byok: _Optional[bool] = ..., estimated: _Optional[bool] = ..., chat_id: _Optional[str] = ...) -> None: ...

class RecordUsageResponse(_message.Message):
    __slots__ = ("usage_id", "millicredits", "replayed")
    USAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MILLICREDITS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    usage_id: str
    millicredits: int
    replayed: bool
    def __init__(self, usage_id: _Optional[str] = ..., millicredits: _Optional[int] = ..., replayed: _Optional[bool] = ...) -> None: ...

class RecordUsageBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[RecordUsageRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[RecordUsageRequest, _Mapping]]] = ...) -> None: ...

class RecordUsageBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RecordUsageResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[RecordUsageResponse, _Mapping]]] = ...) -> None: ...

class Denial(_message.Message):
    __slots__ = ("code", "layer", "key", "current", "limit", "reason", "retry_after_seconds", "rate_limit")
    CODE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    code: str
    layer: str
    key: str
    current: int
    limit: int
    reason: str
    retry_after_seconds: int
    rate_limit: RateLimitState
    def __init__(self, code: _Optional[str] = ..., layer: _Optional[str] = ..., key: _Optional[str] = ..., current: _Optional[int] = ..., limit: _Optional[int] = ..., reason: _Optional[str] = ..., retry_after_seconds: _Optional[int] = ..., rate_limit: _Optional[_Union[RateLimitState, _Mapping]] = ...) -> None: ...

class RecordToolUsageRequest(_message.Message):
    __slots__ = ("organization_id", "run_id", "tool_call_id", "tool", "detail", "millicredits", "chat_id")
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MILLICREDITS_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    run_id: str
    tool_call_id: str
    tool: str
    detail: str
    millicredits: int
    chat_id: str
    def __init__(self, organization_id: _Optional[str] = ..., run_id: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool: _Optional[str] = ..., detail: _Optional[str] = ..., millicredits: _Optional[int] = ..., chat_id: _Optional[str] = ...) -> None: ...

class RecordToolUsageResponse(_message.Message):
    __slots__ = ("ledger_entry_id", "replayed")
    LEDGER_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    ledger_entry_id: str
    replayed: bool
    def __init__(self, ledger_entry_id: _Optional[str] = ..., replayed: _Optional[bool] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("organization_id",)
    ORGANIZATION_ID_FIELD_NUMBER: _ClassVar[int]
    organization_id: str
    def __init__(self, organization_id: _Optional[str] = ...) -> None: ...

class RunCredits(_message.Message):
    __slots__ = ("allowance", "granted", "used", "reserved", "available")
    ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    allowance: int
    granted: int
    used: int
    reserved: int
    available: int
    def __init__(self, allowance: _Optional[int] = ..., granted: _Optional[int] = ..., used: _Optional[int] = ..., reserved: _Optional[int] = ..., available: _Optional[int] = ...) -> None: ...

class Wallet(_message.Message):
    __slots__ = ("balance_minor", "reserved_minor", "available_minor")
    BALANCE_MINOR_FIELD_NUMBER: _ClassVar[int]
    RESERVED_MINOR_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_MINOR_FIELD_NUMBER: _ClassVar[int]
    balance_minor: int
    reserved_minor: int
    available_minor: int
    def __init__(self, balance_minor: _Optional[int] = ..., reserved_minor: _Optional[int] = ..., available_minor: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("found", "plan", "monthly_run_credits", "period_start", "period_end", "run_credits", "usage_millicredits", "wallet")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MONTHLY_RUN_CREDITS_FIELD_NUMBER: _ClassVar[int]
    PERIOD_START_FIELD_NUMBER: _ClassVar[int]
    PERIOD_END_FIELD_NUMBER: _ClassVar[int]
    RUN_CREDITS_FIELD_NUMBER: _ClassVar[int]
    USAGE_MILLICREDITS_FIELD_NUMBER: _ClassVar[int]
    WALLET_FIELD_NUMBER: _ClassVar[int]
    found: bool
    plan: str
    monthly_run_credits: int
    period_start: _timestamp_pb2.Timestamp
    period_end: _timestamp_pb2.Timestamp
    run_credits: RunCredits
    usage_millicredits: int
    wallet: Wallet
    def __init__(self, found: _Optional[bool] = ..., plan: _Optional[str] = ..., monthly_run_credits: _Optional[int] = ..., period_start: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., period_end: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_credits: _Optional[_Union[RunCredits, _Mapping]] = ..., usage_millicredits: _Optional[int] = ..., wallet: _Optional[_Union[Wallet, _Mapping]] = ...) -> None: ...
