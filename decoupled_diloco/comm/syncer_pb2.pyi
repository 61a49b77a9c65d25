from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorHeader(_message.Message):
    __slots__ = ("name", "shape", "dtype", "scheme", "block_size", "format_version", "values_scheme", "topk_k", "payload_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUES_SCHEME_FIELD_NUMBER: _ClassVar[int]
    TOPK_K_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    scheme: str
    block_size: int
    format_version: int
    values_scheme: str
    topk_k: int
    payload_bytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., scheme: _Optional[str] = ..., block_size: _Optional[int] = ..., format_version: _Optional[int] = ..., values_scheme: _Optional[str] = ..., topk_k: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint", "mesh")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    mesh: str
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ..., mesh: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("num_fragments", "versions", "incarnation")
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    num_fragments: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    incarnation: int
    def __init__(self, num_fragments: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "step", "tokens", "loss", "state", "versions", "blocked_s", "step_time_s", "eval_loss", "bytes_sent", "bytes_received", "sync_rounds", "phase_step")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SYNC_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_STEP_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    step: int
    tokens: int
    loss: float
    state: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    blocked_s: float
    step_time_s: float
    eval_loss: float
    bytes_sent: int
    bytes_received: int
    sync_rounds: int
    phase_step: int
    def __init__(self, learner_id: _Optional[int] = ..., step: _Optional[int] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ..., state: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., blocked_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., eval_loss: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., sync_rounds: _Optional[int] = ..., phase_step: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("versions", "fastest_step_time_s", "live_learners", "lead_step", "lead_step_time_s")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FASTEST_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEARNERS_FIELD_NUMBER: _ClassVar[int]
    LEAD_STEP_FIELD_NUMBER: _ClassVar[int]
    LEAD_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    fastest_step_time_s: float
    live_learners: int
    lead_step: float
    lead_step_time_s: float
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., fastest_step_time_s: _Optional[float] = ..., live_learners: _Optional[int] = ..., lead_step: _Optional[float] = ..., lead_step_time_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class DataRange(_message.Message):
    __slots__ = ("lease", "begin", "end")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    lease: int
    begin: int
    end: int
    def __init__(self, lease: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("learner_id", "flushed")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    flushed: bool
    def __init__(self, learner_id: _Optional[int] = ..., flushed: _Optional[bool] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("status", "lease", "begin", "end", "num_shards", "covered", "live_learners")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    COVERED_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEARNERS_FIELD_NUMBER: _ClassVar[int]
    status: str
    lease: int
    begin: int
    end: int
    num_shards: int
    covered: _containers.RepeatedScalarFieldContainer[int]
    live_learners: int
    def __init__(self, status: _Optional[str] = ..., lease: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., num_shards: _Optional[int] = ..., covered: _Optional[_Iterable[int]] = ..., live_learners: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "fragment", "round", "base_version", "steps", "tokens", "tensors", "total_bytes", "incarnation", "data")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fragment: int
    round: int
    base_version: int
    steps: int
    tokens: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    total_bytes: int
    incarnation: int
    data: _containers.RepeatedCompositeFieldContainer[DataRange]
    def __init__(self, learner_id: _Optional[int] = ..., fragment: _Optional[int] = ..., round: _Optional[int] = ..., base_version: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., incarnation: _Optional[int] = ..., data: _Optional[_Iterable[_Union[DataRange, _Mapping]]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "seq", "payload_crc32")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    seq: int
    payload_crc32: int
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., seq: _Optional[int] = ..., payload_crc32: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "duplicate", "reason", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    reason: str
    version: int
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "fragment", "min_version", "wait_s", "has_copy", "have_version")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    HAS_COPY_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fragment: int
    min_version: int
    wait_s: float
    has_copy: bool
    have_version: int
    def __init__(self, learner_id: _Optional[int] = ..., fragment: _Optional[int] = ..., min_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., has_copy: _Optional[bool] = ..., have_version: _Optional[int] = ...) -> None: ...

class FragmentChunk(_message.Message):
    __slots__ = ("fragment", "version", "tensors", "total_bytes", "data", "delta", "base_version")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    total_bytes: int
    data: bytes
    delta: bool
    base_version: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ...) -> None: ...
