from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_ACCEPTED: _ClassVar[AckStatus]
    ACK_STATUS_DUPLICATE: _ClassVar[AckStatus]
    ACK_STATUS_INVALID_ARGUMENT: _ClassVar[AckStatus]
    ACK_STATUS_UNAVAILABLE: _ClassVar[AckStatus]

class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATUS_UNSPECIFIED: _ClassVar[ServingStatus]
    SERVING_STATUS_SERVING: _ClassVar[ServingStatus]
    SERVING_STATUS_DRAINING: _ClassVar[ServingStatus]
    SERVING_STATUS_NOT_SERVING: _ClassVar[ServingStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ERROR: FinishReason
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_ACCEPTED: AckStatus
ACK_STATUS_DUPLICATE: AckStatus
ACK_STATUS_INVALID_ARGUMENT: AckStatus
ACK_STATUS_UNAVAILABLE: AckStatus
SERVING_STATUS_UNSPECIFIED: ServingStatus
SERVING_STATUS_SERVING: ServingStatus
SERVING_STATUS_DRAINING: ServingStatus
SERVING_STATUS_NOT_SERVING: ServingStatus

class Sample(_message.Message):
    __slots__ = ("sample_id", "prompt_id", "group_id", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "top_k", "top_ids", "top_logprobs", "blocks_attended", "policy_version", "schedule_version", "reward", "finish_reason", "error", "metadata", "worker_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ATTENDED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    blocks_attended: _containers.RepeatedScalarFieldContainer[int]
    policy_version: int
    schedule_version: int
    reward: float
    finish_reason: FinishReason
    error: str
    metadata: _containers.ScalarMap[str, str]
    worker_id: str
    def __init__(self, sample_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., blocks_attended: _Optional[_Iterable[int]] = ..., policy_version: _Optional[int] = ..., schedule_version: _Optional[int] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class SampleStreamRequest(_message.Message):
    __slots__ = ("open", "sample")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    sample: Sample
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("id", "status", "field", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: AckStatus
    field: str
    message: str
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[AckStatus, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StreamGrant(_message.Message):
    __slots__ = ("window", "server_id")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    window: int
    server_id: str
    def __init__(self, window: _Optional[int] = ..., server_id: _Optional[str] = ...) -> None: ...

class StreamReply(_message.Message):
    __slots__ = ("grant", "ack")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    grant: StreamGrant
    ack: Ack
    def __init__(self, grant: _Optional[_Union[StreamGrant, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("drained", "pending")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    pending: int
    def __init__(self, drained: _Optional[bool] = ..., pending: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "target", "serving", "joining", "retiring", "resizable")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    RETIRING_FIELD_NUMBER: _ClassVar[int]
    RESIZABLE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    target: int
    serving: int
    joining: int
    retiring: int
    resizable: bool
    def __init__(self, pool: _Optional[str] = ..., target: _Optional[int] = ..., serving: _Optional[int] = ..., joining: _Optional[int] = ..., retiring: _Optional[int] = ..., resizable: _Optional[bool] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "component", "schedule_version", "policy_version", "gauges", "pools")
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    status: ServingStatus
    component: str
    schedule_version: int
    policy_version: int
    gauges: _containers.ScalarMap[str, float]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, status: _Optional[_Union[ServingStatus, str]] = ..., component: _Optional[str] = ..., schedule_version: _Optional[int] = ..., policy_version: _Optional[int] = ..., gauges: _Optional[_Mapping[str, float]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class ResizePoolRequest(_message.Message):
    __slots__ = ("pool", "size")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    size: int
    def __init__(self, pool: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ResizePoolReply(_message.Message):
    __slots__ = ("accepted", "size", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    size: int
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., size: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
