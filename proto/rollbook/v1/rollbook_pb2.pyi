from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
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
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_versions: _containers.RepeatedScalarFieldContainer[int]
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
    def __init__(self, trajectory_id: _Optional[str] = ..., session_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., consumed: _Optional[bool] = ..., task_id: _Optional[str] = ..., domain: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_versions: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., finish_reason: _Optional[str] = ..., reward: _Optional[float] = ..., worker_id: _Optional[str] = ..., created_at: _Optional[float] = ..., parent_request_id: _Optional[str] = ..., branched: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("trajectory_id", "status", "reason", "detail")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[Verdict.Status]
        ACCEPTED: _ClassVar[Verdict.Status]
        DUPLICATE: _ClassVar[Verdict.Status]
        REJECTED: _ClassVar[Verdict.Status]
    STATUS_UNSPECIFIED: Verdict.Status
    ACCEPTED: Verdict.Status
    DUPLICATE: Verdict.Status
    REJECTED: Verdict.Status
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    status: Verdict.Status
    reason: str
    detail: str
    def __init__(self, trajectory_id: _Optional[str] = ..., status: _Optional[_Union[Verdict.Status, str]] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("verdicts",)
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ...) -> None: ...

class SetRewardRequest(_message.Message):
    __slots__ = ("trajectory_id", "session_id", "reward")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    session_id: str
    reward: float
    def __init__(self, trajectory_id: _Optional[str] = ..., session_id: _Optional[str] = ..., reward: _Optional[float] = ...) -> None: ...

class SetRewardResponse(_message.Message):
    __slots__ = ("trajectory_id",)
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    def __init__(self, trajectory_id: _Optional[str] = ...) -> None: ...

class PullBatchRequest(_message.Message):
    __slots__ = ("trainer_id", "trainer_version", "max_staleness", "num_samples", "num_groups", "step", "model_id", "lease_seconds")
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    trainer_id: str
    trainer_version: int
    max_staleness: int
    num_samples: int
    num_groups: int
    step: int
    model_id: str
    lease_seconds: float
    def __init__(self, trainer_id: _Optional[str] = ..., trainer_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_groups: _Optional[int] = ..., step: _Optional[int] = ..., model_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class PullBatchResponse(_message.Message):
    __slots__ = ("lease_id", "arrow_ipc", "num_rows", "stats_json")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    arrow_ipc: bytes
    num_rows: int
    stats_json: str
    def __init__(self, lease_id: _Optional[str] = ..., arrow_ipc: _Optional[bytes] = ..., num_rows: _Optional[int] = ..., stats_json: _Optional[str] = ...) -> None: ...

class AckBatchRequest(_message.Message):
    __slots__ = ("lease_id", "trainer_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    trainer_id: str
    def __init__(self, lease_id: _Optional[str] = ..., trainer_id: _Optional[str] = ...) -> None: ...

class AckBatchResponse(_message.Message):
    __slots__ = ("num_rows",)
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    def __init__(self, num_rows: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("sql", "max_rows", "timeout_seconds")
    SQL_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    max_rows: int
    timeout_seconds: float
    def __init__(self, sql: _Optional[str] = ..., max_rows: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class QueryChunk(_message.Message):
    __slots__ = ("arrow_ipc", "truncated")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    truncated: bool
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., truncated: _Optional[bool] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("model_id", "version", "checksum", "max_staleness", "samples_per_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    version: int
    checksum: str
    max_staleness: int
    samples_per_version: int
    def __init__(self, model_id: _Optional[str] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ..., max_staleness: _Optional[int] = ..., samples_per_version: _Optional[int] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class SetVersionStatusRequest(_message.Message):
    __slots__ = ("model_id", "version", "status", "gate_json")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GATE_JSON_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    version: int
    status: str
    gate_json: str
    def __init__(self, model_id: _Optional[str] = ..., version: _Optional[int] = ..., status: _Optional[str] = ..., gate_json: _Optional[str] = ...) -> None: ...

class SetVersionStatusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("model_id", "vocab_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class GetModelResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "latest_version", "max_staleness", "samples_per_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    latest_version: int
    max_staleness: int
    samples_per_version: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., latest_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., samples_per_version: _Optional[int] = ...) -> None: ...

class ReportTrainStepRequest(_message.Message):
    __slots__ = ("step", "trainer_id", "version", "lease_id", "started_at", "finished_at", "stats_json")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    step: int
    trainer_id: str
    version: int
    lease_id: str
    started_at: float
    finished_at: float
    stats_json: str
    def __init__(self, step: _Optional[int] = ..., trainer_id: _Optional[str] = ..., version: _Optional[int] = ..., lease_id: _Optional[str] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., stats_json: _Optional[str] = ...) -> None: ...

class ReportTrainStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GovernRequest(_message.Message):
    __slots__ = ("action", "predicate", "reason", "model_id", "tenants", "require_consent", "detail_json", "detectors")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_CONSENT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    DETECTORS_FIELD_NUMBER: _ClassVar[int]
    action: str
    predicate: str
    reason: str
    model_id: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    require_consent: bool
    detail_json: str
    detectors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, action: _Optional[str] = ..., predicate: _Optional[str] = ..., reason: _Optional[str] = ..., model_id: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., require_consent: _Optional[bool] = ..., detail_json: _Optional[str] = ..., detectors: _Optional[_Iterable[str]] = ...) -> None: ...

class GovernResponse(_message.Message):
    __slots__ = ("rows", "audit_id", "lineage_json")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_JSON_FIELD_NUMBER: _ClassVar[int]
    rows: int
    audit_id: str
    lineage_json: str
    def __init__(self, rows: _Optional[int] = ..., audit_id: _Optional[str] = ..., lineage_json: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "rejected", "rejected_by_reason", "accepted_tokens", "rejected_tokens", "stats_json")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    rejected: int
    rejected_by_reason: _containers.ScalarMap[str, int]
    accepted_tokens: int
    rejected_tokens: int
    stats_json: str
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., accepted_tokens: _Optional[int] = ..., rejected_tokens: _Optional[int] = ..., stats_json: _Optional[str] = ...) -> None: ...
