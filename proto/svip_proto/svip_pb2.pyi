from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pipeline(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIPELINE_UNSPECIFIED: _ClassVar[Pipeline]
    PIPELINE_SYNC: _ClassVar[Pipeline]
    PIPELINE_ASYNC: _ClassVar[Pipeline]
PIPELINE_UNSPECIFIED: Pipeline
PIPELINE_SYNC: Pipeline
PIPELINE_ASYNC: Pipeline

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class PolicyConfig(_message.Message):
    __slots__ = ("name", "threshold", "entropy_scale", "draft_length", "max_draft_length", "confidence")
    NAME_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_SCALE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    threshold: float
    entropy_scale: float
    draft_length: int
    max_draft_length: int
    confidence: float
    def __init__(self, name: _Optional[str] = ..., threshold: _Optional[float] = ..., entropy_scale: _Optional[float] = ..., draft_length: _Optional[int] = ..., max_draft_length: _Optional[int] = ..., confidence: _Optional[float] = ...) -> None: ...

class StartSession(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "policy", "stop_token_ids", "max_new_tokens", "pipeline")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    policy: PolicyConfig
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    pipeline: Pipeline
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy: _Optional[_Union[PolicyConfig, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., pipeline: _Optional[_Union[Pipeline, str]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "tokens", "q_probs", "entropies", "resolved_token", "followup", "started_at", "finished_at")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPIES_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q_probs: Tensor
    entropies: Tensor
    resolved_token: int
    followup: bool
    started_at: float
    finished_at: float
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Union[Tensor, _Mapping]] = ..., entropies: _Optional[_Union[Tensor, _Mapping]] = ..., resolved_token: _Optional[int] = ..., followup: _Optional[bool] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class VerifyBlock(_message.Message):
    __slots__ = ("block", "append")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    block: Block
    append: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ..., append: _Optional[_Iterable[int]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "accepted", "token", "p_row", "started_at", "finished_at")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    P_ROW_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    accepted: int
    token: int
    p_row: Tensor
    started_at: float
    finished_at: float
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., accepted: _Optional[int] = ..., token: _Optional[int] = ..., p_row: _Optional[_Union[Tensor, _Mapping]] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class Feedback(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "drafted", "accepted", "token", "p_row")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    P_ROW_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    drafted: int
    accepted: int
    token: int
    p_row: Tensor
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., token: _Optional[int] = ..., p_row: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Closed(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("session_id", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("start", "feedback", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: StartSession
    feedback: Feedback
    cancel: Cancel
    def __init__(self, start: _Optional[_Union[StartSession, _Mapping]] = ..., feedback: _Optional[_Union[Feedback, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class DraftEvent(_message.Message):
    __slots__ = ("block", "closed", "error")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    block: Block
    closed: Closed
    error: Error
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("start", "verify", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: StartSession
    verify: VerifyBlock
    cancel: Cancel
    def __init__(self, start: _Optional[_Union[StartSession, _Mapping]] = ..., verify: _Optional[_Union[VerifyBlock, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class TargetEvent(_message.Message):
    __slots__ = ("verdict", "closed", "error")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    closed: Closed
    error: Error
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("open_sessions", "cached_tokens", "tokens_processed")
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    open_sessions: int
    cached_tokens: int
    tokens_processed: int
    def __init__(self, open_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tokens_processed: _Optional[int] = ...) -> None: ...
