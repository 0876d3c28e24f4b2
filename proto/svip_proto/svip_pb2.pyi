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

class Next(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_UNSET: _ClassVar[Next]
    NEXT_FOLLOWUP: _ClassVar[Next]
    NEXT_PREPARED: _ClassVar[Next]
    NEXT_DRAW: _ClassVar[Next]
    NEXT_SETTLED: _ClassVar[Next]
PIPELINE_UNSPECIFIED: Pipeline
PIPELINE_SYNC: Pipeline
PIPELINE_ASYNC: Pipeline
NEXT_UNSET: Next
NEXT_FOLLOWUP: Next
NEXT_PREPARED: Next
NEXT_DRAW: Next
NEXT_SETTLED: Next

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
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logit_bias_ids", "logit_bias", "presence_penalty", "frequency_penalty", "min_tokens", "repetition_penalty", "grammar_kind", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.RepeatedScalarFieldContainer[float]
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    repetition_penalty: float
    grammar_kind: str
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Iterable[float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class PolicyConfig(_message.Message):
    __slots__ = ("name", "threshold", "entropy_scale", "draft_length", "max_draft_length", "confidence", "tree")
    NAME_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_SCALE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    name: str
    threshold: float
    entropy_scale: float
    draft_length: int
    max_draft_length: int
    confidence: float
    tree: str
    def __init__(self, name: _Optional[str] = ..., threshold: _Optional[float] = ..., entropy_scale: _Optional[float] = ..., draft_length: _Optional[int] = ..., max_draft_length: _Optional[int] = ..., confidence: _Optional[float] = ..., tree: _Optional[str] = ...) -> None: ...

class StopRule(_message.Message):
    __slots__ = ("weights", "stop_at")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    stop_at: float
    def __init__(self, weights: _Optional[_Iterable[float]] = ..., stop_at: _Optional[float] = ...) -> None: ...

class StartSession(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "policy", "stop_token_ids", "max_new_tokens", "pipeline", "load_cap", "epoch", "stop_rule", "node_price", "logprobs", "prompt_logprobs", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    LOAD_CAP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOP_RULE_FIELD_NUMBER: _ClassVar[int]
    NODE_PRICE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    policy: PolicyConfig
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    pipeline: Pipeline
    load_cap: int
    epoch: int
    stop_rule: StopRule
    node_price: float
    logprobs: int
    prompt_logprobs: bool
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy: _Optional[_Union[PolicyConfig, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., pipeline: _Optional[_Union[Pipeline, str]] = ..., load_cap: _Optional[int] = ..., epoch: _Optional[int] = ..., stop_rule: _Optional[_Union[StopRule, _Mapping]] = ..., node_price: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class PreparedFor(_message.Message):
    __slots__ = ("base", "accepted", "token")
    BASE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    base: int
    accepted: int
    token: int
    def __init__(self, base: _Optional[int] = ..., accepted: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "tokens", "q_probs", "entropies", "resolved_token", "followup", "prepared_for", "started_at", "finished_at", "draft_s", "trigger_at", "reused", "sibling_counts", "sibling_tokens", "q_rows", "q_nonzero", "grown_parents", "grown_tokens", "grows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPIES_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FOR_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_AT_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    SIBLING_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SIBLING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_ROWS_FIELD_NUMBER: _ClassVar[int]
    Q_NONZERO_FIELD_NUMBER: _ClassVar[int]
    GROWN_PARENTS_FIELD_NUMBER: _ClassVar[int]
    GROWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q_probs: Tensor
    entropies: Tensor
    resolved_token: int
    followup: bool
    prepared_for: PreparedFor
    started_at: float
    finished_at: float
    draft_s: float
    trigger_at: float
    reused: bool
    sibling_counts: _containers.RepeatedScalarFieldContainer[int]
    sibling_tokens: _containers.RepeatedScalarFieldContainer[int]
    q_rows: Tensor
    q_nonzero: _containers.RepeatedCompositeFieldContainer[SparseRow]
    grown_parents: _containers.RepeatedScalarFieldContainer[int]
    grown_tokens: _containers.RepeatedScalarFieldContainer[int]
    grows: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Union[Tensor, _Mapping]] = ..., entropies: _Optional[_Union[Tensor, _Mapping]] = ..., resolved_token: _Optional[int] = ..., followup: _Optional[bool] = ..., prepared_for: _Optional[_Union[PreparedFor, _Mapping]] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., draft_s: _Optional[float] = ..., trigger_at: _Optional[float] = ..., reused: _Optional[bool] = ..., sibling_counts: _Optional[_Iterable[int]] = ..., sibling_tokens: _Optional[_Iterable[int]] = ..., q_rows: _Optional[_Union[Tensor, _Mapping]] = ..., q_nonzero: _Optional[_Iterable[_Union[SparseRow, _Mapping]]] = ..., grown_parents: _Optional[_Iterable[int]] = ..., grown_tokens: _Optional[_Iterable[int]] = ..., grows: _Optional[int] = ...) -> None: ...

class Feedback(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "drafted", "accepted", "token", "p_row", "prepared_used", "sent_at", "then", "load_cap", "stop_rule", "features", "features_from", "p_nonzero", "node_price", "branch_tokens", "next", "next_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    P_ROW_FIELD_NUMBER: _ClassVar[int]
    PREPARED_USED_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    THEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_CAP_FIELD_NUMBER: _ClassVar[int]
    STOP_RULE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    P_NONZERO_FIELD_NUMBER: _ClassVar[int]
    NODE_PRICE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    drafted: int
    accepted: int
    token: int
    p_row: Tensor
    prepared_used: bool
    sent_at: float
    then: Feedback
    load_cap: int
    stop_rule: StopRule
    features: Tensor
    features_from: int
    p_nonzero: SparseRow
    node_price: float
    branch_tokens: _containers.RepeatedScalarFieldContainer[int]
    next: Next
    next_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., token: _Optional[int] = ..., p_row: _Optional[_Union[Tensor, _Mapping]] = ..., prepared_used: _Optional[bool] = ..., sent_at: _Optional[float] = ..., then: _Optional[_Union[Feedback, _Mapping]] = ..., load_cap: _Optional[int] = ..., stop_rule: _Optional[_Union[StopRule, _Mapping]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., features_from: _Optional[int] = ..., p_nonzero: _Optional[_Union[SparseRow, _Mapping]] = ..., node_price: _Optional[float] = ..., branch_tokens: _Optional[_Iterable[int]] = ..., next: _Optional[_Union[Next, str]] = ..., next_tokens: _Optional[int] = ...) -> None: ...

class SparseRow(_message.Message):
    __slots__ = ("ids", "values")
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    values: Tensor
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("session_id", "epoch", "base", "tokens", "load_cap", "stop_rule", "features", "features_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_CAP_FIELD_NUMBER: _ClassVar[int]
    STOP_RULE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    load_cap: int
    stop_rule: StopRule
    features: Tensor
    features_from: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., load_cap: _Optional[int] = ..., stop_rule: _Optional[_Union[StopRule, _Mapping]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., features_from: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class FeatureChunk(_message.Message):
    __slots__ = ("session_id", "features_from", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    features_from: int
    features: Tensor
    def __init__(self, session_id: _Optional[str] = ..., features_from: _Optional[int] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Closed(_message.Message):
    __slots__ = ("session_id", "shed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shed: bool
    def __init__(self, session_id: _Optional[str] = ..., shed: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("start", "feedback", "cancel", "resume", "feature_chunk", "batch")
    START_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    start: StartSession
    feedback: Feedback
    cancel: Cancel
    resume: Resume
    feature_chunk: FeatureChunk
    batch: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, start: _Optional[_Union[StartSession, _Mapping]] = ..., feedback: _Optional[_Union[Feedback, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., feature_chunk: _Optional[_Union[FeatureChunk, _Mapping]] = ..., batch: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DraftEvent(_message.Message):
    __slots__ = ("block", "closed", "error", "batch")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    block: Block
    closed: Closed
    error: Error
    batch: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block: _Optional[_Union[Block, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., batch: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: StartSession
    cancel: Cancel
    def __init__(self, start: _Optional[_Union[StartSession, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class Settled(_message.Message):
    __slots__ = ("session_id", "tokens", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("drafted", "accepted", "wall_s", "draft_s", "target_s", "block_transit_s", "target_queue_s", "feedback_transit_s", "draft_queue_s", "overhead_s", "source")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TRANSIT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_TRANSIT_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    wall_s: float
    draft_s: float
    target_s: float
    block_transit_s: float
    target_queue_s: float
    feedback_transit_s: float
    draft_queue_s: float
    overhead_s: float
    source: str
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., wall_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., target_s: _Optional[float] = ..., block_transit_s: _Optional[float] = ..., target_queue_s: _Optional[float] = ..., feedback_transit_s: _Optional[float] = ..., draft_queue_s: _Optional[float] = ..., overhead_s: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("worker", "start", "end")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    worker: str
    start: float
    end: float
    def __init__(self, worker: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("rounds", "stop_entropies", "discarded_tokens", "prepared_sent", "prepared_used", "prepared_used_late", "wall_s", "wire_bytes", "timeline", "target_forwards", "draft_forwards", "draft_busy_s", "target_busy_s", "both_busy_s", "draft_wait_s", "target_wait_s", "pauses", "detached", "reattached", "tree_nodes", "branches", "branch_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STOP_ENTROPIES_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_SENT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_USED_FIELD_NUMBER: _ClassVar[int]
    PREPARED_USED_LATE_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    BOTH_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PAUSES_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[Round]
    stop_entropies: _containers.RepeatedScalarFieldContainer[float]
    discarded_tokens: int
    prepared_sent: int
    prepared_used: int
    prepared_used_late: int
    wall_s: float
    wire_bytes: int
    timeline: _containers.RepeatedCompositeFieldContainer[Span]
    target_forwards: int
    draft_forwards: int
    draft_busy_s: float
    target_busy_s: float
    both_busy_s: float
    draft_wait_s: float
    target_wait_s: float
    pauses: int
    detached: int
    reattached: int
    tree_nodes: int
    branches: int
    branch_tokens: int
    def __init__(self, rounds: _Optional[_Iterable[_Union[Round, _Mapping]]] = ..., stop_entropies: _Optional[_Iterable[float]] = ..., discarded_tokens: _Optional[int] = ..., prepared_sent: _Optional[int] = ..., prepared_used: _Optional[int] = ..., prepared_used_late: _Optional[int] = ..., wall_s: _Optional[float] = ..., wire_bytes: _Optional[int] = ..., timeline: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., target_forwards: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., draft_busy_s: _Optional[float] = ..., target_busy_s: _Optional[float] = ..., both_busy_s: _Optional[float] = ..., draft_wait_s: _Optional[float] = ..., target_wait_s: _Optional[float] = ..., pauses: _Optional[int] = ..., detached: _Optional[int] = ..., reattached: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., branches: _Optional[int] = ..., branch_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("session_id", "finish_reason", "stats")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    finish_reason: str
    stats: SessionStats
    def __init__(self, session_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("settled", "finished", "error")
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    settled: Settled
    finished: Finished
    error: Error
    def __init__(self, settled: _Optional[_Union[Settled, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("open_sessions", "cached_tokens", "tokens_processed", "unavailable", "kv_pages_used", "kv_pages_total", "kv_page_tokens", "draft_replacements", "draft_lost", "auto_greedy", "auto_sampled", "auto_prior_cost", "test_hooks", "preemptions", "emulated_device", "forks_released", "sessions_shed", "prompt_tokens_shared", "prepared_tokens")
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOST_FIELD_NUMBER: _ClassVar[int]
    AUTO_GREEDY_FIELD_NUMBER: _ClassVar[int]
    AUTO_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    AUTO_PRIOR_COST_FIELD_NUMBER: _ClassVar[int]
    TEST_HOOKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_DEVICE_FIELD_NUMBER: _ClassVar[int]
    FORKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_SHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_SHARED_FIELD_NUMBER: _ClassVar[int]
    PREPARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    open_sessions: int
    cached_tokens: int
    tokens_processed: int
    unavailable: str
    kv_pages_used: int
    kv_pages_total: int
    kv_page_tokens: int
    draft_replacements: int
    draft_lost: str
    auto_greedy: AutoModelState
    auto_sampled: AutoModelState
    auto_prior_cost: float
    test_hooks: _containers.RepeatedScalarFieldContainer[str]
    preemptions: int
    emulated_device: EmulatedDeviceUse
    forks_released: int
    sessions_shed: int
    prompt_tokens_shared: int
    prepared_tokens: int
    def __init__(self, open_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., unavailable: _Optional[str] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_page_tokens: _Optional[int] = ..., draft_replacements: _Optional[int] = ..., draft_lost: _Optional[str] = ..., auto_greedy: _Optional[_Union[AutoModelState, _Mapping]] = ..., auto_sampled: _Optional[_Union[AutoModelState, _Mapping]] = ..., auto_prior_cost: _Optional[float] = ..., test_hooks: _Optional[_Iterable[str]] = ..., preemptions: _Optional[int] = ..., emulated_device: _Optional[_Union[EmulatedDeviceUse, _Mapping]] = ..., forks_released: _Optional[int] = ..., sessions_shed: _Optional[int] = ..., prompt_tokens_shared: _Optional[int] = ..., prepared_tokens: _Optional[int] = ...) -> None: ...

class EmulatedDeviceUse(_message.Message):
    __slots__ = ("name", "scale", "forwards", "device_s", "overruns", "overrun_s", "worst_ratio")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    OVERRUNS_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_S_FIELD_NUMBER: _ClassVar[int]
    WORST_RATIO_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    forwards: int
    device_s: float
    overruns: int
    overrun_s: float
    worst_ratio: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ..., forwards: _Optional[int] = ..., device_s: _Optional[float] = ..., overruns: _Optional[int] = ..., overrun_s: _Optional[float] = ..., worst_ratio: _Optional[float] = ...) -> None: ...

class AutoModelState(_message.Message):
    __slots__ = ("weights", "observed_tokens", "fits", "predicted_acceptance", "observed_acceptance")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    observed_tokens: int
    fits: int
    predicted_acceptance: float
    observed_acceptance: float
    def __init__(self, weights: _Optional[_Iterable[float]] = ..., observed_tokens: _Optional[int] = ..., fits: _Optional[int] = ..., predicted_acceptance: _Optional[float] = ..., observed_acceptance: _Optional[float] = ...) -> None: ...
