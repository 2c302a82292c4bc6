from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrajectoryView(_message.Message):
    __slots__ = ("trajectory_id", "session_id", "group_id", "group_size", "request_id", "attempt", "consumed", "task_id", "domain", "model_id", "prompt_token_ids", "output_token_ids", "output_logprobs", "output_versions", "temperature", "top_p", "top_k", "finish_reason", "reward", "worker_id", "created_at", "parent_request_id", "branched", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCHED_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    session_id: str
    group_id: str
    group_size: int
    request_id: str
    attempt: int
    consumed: bool
    task_id: str
    domain: str
    model_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[bytes]
    output_token_ids: _containers.RepeatedScalarFieldContainer[bytes]
    output_logprobs: _containers.RepeatedScalarFieldContainer[bytes]
    output_versions: _containers.RepeatedScalarFieldContainer[bytes]
    temperature: float
    top_p: float
    top_k: int
    finish_reason: str
    reward: float
    worker_id: str
    created_at: float
    parent_request_id: str
    branched: bool
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, trajectory_id: _Optional[str] = ..., session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., consumed: _Optional[bool] = ..., task_id: _Optional[str] = ..., domain: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[bytes]] = ..., output_token_ids: _Optional[_Iterable[bytes]] = ..., output_logprobs: _Optional[_Iterable[bytes]] = ..., output_versions: _Optional[_Iterable[bytes]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., finish_reason: _Optional[str] = ..., reward: _Optional[float] = ..., worker_id: _Optional[str] = ..., created_at: _Optional[float] = ..., parent_request_id: _Optional[str] = ..., branched: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubmitRequestView(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[TrajectoryView]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[TrajectoryView, _Mapping]]] = ...) -> None: ...
