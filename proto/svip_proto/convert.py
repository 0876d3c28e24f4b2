"""All conversion between svip_common.contracts and the wire messages, in one place.

Tensors travel as raw little-endian bytes + dtype + shape, never as repeated floats or pickles.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array

import torch

from svip_common.acceptance import StopRule
from svip_common.contracts import (
    DRAFT_LENGTH_CAP,
    NO_TOKEN,
    Block,
    GenerationStats,
    PolicyConfig,
    SamplingParams,
    TokenLogprob,
    check_cache_scope,
    check_logprobs,
)
from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar
from svip_common.messages import (
    Cancel,
    DraftClosed,
    DraftedBlock,
    DraftEvent,
    DraftFailed,
    DraftRequest,
    Feedback,
    Resume,
    SessionStart,
)
from svip_common.outcome import DRAW, FOLLOWUP, PREPARED, SETTLED, Outcome, outcome_of
from svip_common.trees import MAX_NODE_PRICE, MAX_Q_BYTES
from svip_proto import svip_pb2 as pb

PIPELINES = {"sync": pb.PIPELINE_SYNC, "async": pb.PIPELINE_ASYNC}  # the pipeline modes by name, as the wire says them
_PIPELINE_NAMES = {v: k for k, v in PIPELINES.items()}

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().to("cpu").contiguous()
    if t.dtype not in _NAMES:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("big-endian hosts are not supported")
    return pb.Tensor(data=raw, dtype=_NAMES[t.dtype], shape=list(t.shape))


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidRequest(f"unsupported tensor dtype {msg.dtype!r}")
    shape = tuple(msg.shape)
    count = 1
    for d in shape:
        if d < 0:
            raise InvalidRequest(f"negative tensor dimension in shape {shape}")
        count *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != count * itemsize:
        raise InvalidRequest(
            f"tensor of shape {shape} and dtype {msg.dtype} needs {count * itemsize} bytes, got {len(msg.data)}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def floats_to_proto(values) -> pb.Tensor:
    """A short list of floats as a float32 [n] tensor message, without a torch round trip."""
    return pb.Tensor(data=array("f", values).tobytes(), dtype="float32", shape=[len(values)])


def floats_from_proto(msg: pb.Tensor) -> list[float]:
    """A float32 [n] tensor message as a list of floats (a bad one is an InvalidRequest)."""
    if msg.dtype != "float32" or len(msg.shape) != 1 or len(msg.data) != 4 * msg.shape[0]:
        return tensor_from_proto(msg).reshape(-1).tolist()  # names what is wrong, or converts
    values = array("f")
    values.frombytes(msg.data)
    return values.tolist()


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                            logit_bias_ids=[token for token, _ in s.logit_bias],
                            logit_bias=[bias for _, bias in s.logit_bias], presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, min_tokens=s.min_tokens)
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if s.grammar is not None:
        msg.grammar_kind, msg.grammar = s.grammar.kind, s.grammar.text
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Checked (SamplingParams.validate, a grammar's bounds but not its compile: the worker builds
    its matcher off the compute thread, svip_runtime/grammar_waits.py): a bad field, or bias ids and
    values that do not pair up, is an InvalidRequest (the bias's ids against the vocabulary: the
    worker's check_start)."""
    if len(msg.logit_bias_ids) != len(msg.logit_bias):
        raise InvalidRequest(f"logit_bias carries {len(msg.logit_bias_ids)} ids and {len(msg.logit_bias)} values")
    bias = tuple(zip(msg.logit_bias_ids, msg.logit_bias))
    repetition = msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
    grammar = Grammar(msg.grammar_kind, msg.grammar) if msg.grammar_kind or msg.grammar else None
    params = SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed, bias, msg.presence_penalty,
                            msg.frequency_penalty, msg.min_tokens, repetition, grammar)
    params.validate(compile_grammar=False)
    return params


def policy_to_proto(p: PolicyConfig) -> pb.PolicyConfig:
    if isinstance(p.threshold, str):
        raise ValueError("resolve threshold 'auto' before sending a policy")
    return pb.PolicyConfig(
        name=p.name,
        threshold=p.threshold,
        entropy_scale=p.entropy_scale,
        draft_length=p.draft_length,
        max_draft_length=p.max_draft_length,
        confidence=p.confidence,
        tree=p.tree,
    )


def policy_from_proto(msg: pb.PolicyConfig, cap: int = DRAFT_LENGTH_CAP) -> PolicyConfig:
    policy = PolicyConfig(
        name=msg.name,
        threshold=msg.threshold,
        entropy_scale=msg.entropy_scale,
        draft_length=msg.draft_length,
        max_draft_length=msg.max_draft_length,
        confidence=msg.confidence,
        tree=msg.tree or "off",
    )
    policy.validate(cap)
    return policy


def start_from_proto(msg: pb.StartSession, cap: int = DRAFT_LENGTH_CAP) -> SessionStart:
    """Checked against the worker's block cap: a bad policy or stop rule is INVALID_ARGUMENT, and
    so are logprobs past their bound."""
    speculates = msg.policy.name not in ("", "none")
    sampling = sampling_from_proto(msg.sampling)
    logprobs = msg.logprobs if msg.HasField("logprobs") else None
    check_logprobs(logprobs, msg.prompt_logprobs)
    check_cache_scope(msg.cache_scope)
    return SessionStart(
        session_id=msg.session_id,
        prompt_ids=tuple(msg.prompt_ids),
        max_new_tokens=msg.max_new_tokens,
        sampling=sampling,
        policy=policy_from_proto(msg.policy, cap) if speculates else PolicyConfig(name="none"),
        stop_token_ids=frozenset(msg.stop_token_ids),
        pipeline=_PIPELINE_NAMES.get(msg.pipeline, "async"),
        epoch=msg.epoch,
        load_cap=msg.load_cap if msg.HasField("load_cap") else None,
        stop_rule=stop_rule_from_proto(msg.stop_rule) if msg.HasField("stop_rule") else None,
        node_price=_node_price(msg.node_price) if msg.HasField("node_price") else None,
        logprobs=logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        cache_scope=msg.cache_scope,
    )


def start_to_proto(start: SessionStart) -> pb.StartSession:
    msg = pb.StartSession(
        session_id=start.session_id,
        prompt_ids=start.prompt_ids,
        sampling=sampling_to_proto(start.sampling),
        policy=policy_to_proto(start.policy),
        stop_token_ids=sorted(start.stop_token_ids),
        max_new_tokens=start.max_new_tokens,
        pipeline=PIPELINES[start.pipeline],
        epoch=start.epoch,
        cache_scope=start.cache_scope,
    )
    if start.load_cap is not None:
        msg.load_cap = start.load_cap
    if start.stop_rule is not None:
        msg.stop_rule.CopyFrom(stop_rule_to_proto(start.stop_rule))
    if start.node_price is not None:
        msg.node_price = start.node_price
    if start.logprobs is not None:
        msg.logprobs = start.logprobs
    msg.prompt_logprobs = start.prompt_logprobs
    return msg


def logprobs_to_proto(logprobs) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(logprob=lp.logprob, top_ids=[i for i, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs]


def settled_logprobs(msg: pb.Settled, prompt_ids) -> tuple[list[TokenLogprob], list[TokenLogprob] | None]:
    """A Settled's logprobs with its tokens, and the prompt's (None: not in this one); a worker's
    own message, read as is."""
    prompt = _logprobs_from_proto(prompt_ids[1:], msg.prompt_logprobs) if msg.prompt_logprobs else None
    return _logprobs_from_proto(msg.tokens, msg.logprobs), prompt


def _logprobs_from_proto(tokens, msgs) -> list[TokenLogprob]:
    return [TokenLogprob(token, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for token, m in zip(tokens, msgs)]


def feedback_to_proto(feedback: Feedback) -> pb.Feedback:
    """A chain of verdicts as one message, each the next one's ``then``."""
    return _chain_to_proto(feedback.chain())


def _chain_to_proto(chain: list[Feedback]) -> pb.Feedback:
    """These verdicts (earliest first; their own ``then`` is not read) as one message."""
    head = None
    for item in reversed(chain):
        msg = pb.Feedback(session_id=item.session_id, epoch=item.epoch, base=item.base, drafted=item.drafted,
                          accepted=item.accepted, token=item.token, prepared_used=item.prepared_used,
                          sent_at=item.sent_at, next=_NEXTS[item.outcome.next])
        msg.branch_tokens.extend(item.branch)
        if item.outcome.next_tokens is not None:
            msg.next_tokens = item.outcome.next_tokens
        if item.node_price is not None:
            msg.node_price = item.node_price
        if item.load_cap is not None:
            msg.load_cap = item.load_cap
        if item.stop_rule is not None:
            msg.stop_rule.CopyFrom(stop_rule_to_proto(item.stop_rule))
        if item.p_row is not None:
            p_row_to_proto(msg, item.p_row)
        if item.features is not None:  # raw, in the target's dtype
            msg.features.CopyFrom(tensor_to_proto(item.features))
            msg.features_from = item.features_from
        if head is not None:
            msg.then.CopyFrom(head)
        head = msg
    return head


def feedback_from_proto(msg: pb.Feedback, width: int) -> Feedback:
    """A chain of verdicts in the project's terms, each the next one's ``then``; a malformed p row
    (of a vocabulary of ``width``), stop rule or tensor anywhere in it is an InvalidRequest, before
    any verdict is applied. Target features come as sent (the draft checks them against its head)."""
    items = [msg]
    while items[-1].HasField("then"):
        items.append(items[-1].then)
    head = None
    for item in reversed(items):
        head = Feedback(
            session_id=item.session_id, outcome=_outcome_from_proto(item),
            load_cap=item.load_cap if item.HasField("load_cap") else None,
            stop_rule=stop_rule_from_proto(item.stop_rule) if item.HasField("stop_rule") else None,
            p_row=p_row_from_proto(item, width), sent_at=item.sent_at, then=head,
            features=tensor_from_proto(item.features) if item.HasField("features") else None,
            features_from=item.features_from,
            node_price=_node_price(item.node_price) if item.HasField("node_price") else None,
        )
    return head


_NEXTS = {FOLLOWUP: pb.NEXT_FOLLOWUP, PREPARED: pb.NEXT_PREPARED, DRAW: pb.NEXT_DRAW, SETTLED: pb.NEXT_SETTLED}
_NEXT_NAMES = {value: name for name, value in _NEXTS.items()}


def _outcome_from_proto(msg: pb.Feedback) -> Outcome:
    """The verdict's outcome as the target decided it (checked: an inconsistent one is an
    InvalidRequest); from an older peer that sends no ``next``, read from its other fields."""
    branch = tuple(msg.branch_tokens)
    if msg.next == pb.NEXT_UNSET:
        deferred = msg.accepted == msg.drafted and msg.token == NO_TOKEN
        return outcome_of(msg.epoch, msg.base, msg.drafted, msg.accepted, msg.token, branch, deferred,
                          msg.prepared_used)
    if msg.next not in _NEXT_NAMES:
        raise InvalidRequest(f"feedback with an unknown outcome {msg.next}")
    outcome = Outcome(msg.epoch, msg.base, msg.drafted, msg.accepted, msg.token, _NEXT_NAMES[msg.next], branch,
                      msg.next_tokens if msg.HasField("next_tokens") else None)
    if msg.prepared_used != (outcome.next == PREPARED):
        raise InvalidRequest("feedback's prepared_used disagrees with its outcome")
    return outcome


def _node_price(price: float) -> float:
    if not 0.0 <= price <= MAX_NODE_PRICE:  # NaN fails both
        raise InvalidRequest(f"node_price {price} outside [0, {MAX_NODE_PRICE}]")
    return price


def p_row_to_proto(msg: pb.Feedback, p_row: torch.Tensor) -> None:
    """A sampled rejection's p row (float32 on the wire): by its ids with mass (p_nonzero) where
    that is smaller, as after top-k or top-p (8 bytes an id against 4 for every id of the row)."""
    p = p_row.detach().to("cpu", torch.float32).reshape(-1)  # one copy off the device, then the ids here
    ids = torch.nonzero(p)[:, 0]
    if 2 * len(ids) < len(p):
        msg.p_nonzero.CopyFrom(_sparse_row(p, ids))
    else:
        msg.p_row.CopyFrom(tensor_to_proto(p))


def p_row_from_proto(msg: pb.Feedback, width: int) -> torch.Tensor | None:
    """The feedback's p row [width] float32, from p_row or p_nonzero (None: it carries neither);
    one that is not a row of this width is an InvalidRequest naming what is wrong."""
    if msg.HasField("p_row") and msg.HasField("p_nonzero"):
        raise InvalidRequest("a feedback carries p_row or p_nonzero, not both")
    if msg.HasField("p_row"):
        p_row = tensor_from_proto(msg.p_row)
        if p_row.dtype != torch.float32 or tuple(p_row.shape) != (width,):
            raise InvalidRequest(f"p_row is {_described(p_row)}, expected float32 [{width}]")
        _check_distribution(p_row, "p_row")
        return p_row
    if not msg.HasField("p_nonzero"):
        return None
    return _row_from_sparse(msg.p_nonzero, width, "p_nonzero")


def q_rows_to_proto(msg: pb.Block, q_rows: torch.Tensor) -> None:
    """A sampled tree's q rows [k, vocab] (float32 on the wire): each by its ids with mass
    (q_nonzero) where that is smaller in all, as for a p row."""
    q = q_rows.detach().to("cpu", torch.float32)
    ids = [torch.nonzero(row)[:, 0] for row in q]
    if 2 * sum(map(len, ids)) < q.numel():
        msg.q_nonzero.extend(_sparse_row(row, nonzero) for row, nonzero in zip(q, ids))
    else:
        msg.q_rows.CopyFrom(tensor_to_proto(q))


def q_rows_from_proto(msg: pb.Block, width: int | None) -> torch.Tensor | None:
    """The block's q rows [k, width] float32 (None: it carries none); rows that are not one per
    token of this width, or not distributions, or past MAX_Q_BYTES, are an InvalidRequest. width
    None: the reader reads no q rows (a draft worker's own blocks), and one that carries them is
    refused. Checked in one pass over the rows (review H-3: a loop of row checks cost the target's
    compute thread 144 ms a block at a 152k vocabulary)."""
    if not msg.HasField("q_rows") and not msg.q_nonzero:
        return None
    if width is None:
        raise InvalidRequest("a block carries q rows where none are read")
    k = len(msg.tokens)
    carried = len(msg.q_rows.data) + sum(len(r.ids.data) + len(r.values.data) for r in msg.q_nonzero)
    if carried > MAX_Q_BYTES and k > 1:  # one row always fits: the draft's spine is never cut below it
        raise InvalidRequest(f"a block carries {carried} bytes of q rows; at most {MAX_Q_BYTES}")
    if msg.HasField("q_rows"):
        if msg.q_nonzero:
            raise InvalidRequest("a block carries q_rows or q_nonzero, not both")
        q = tensor_from_proto(msg.q_rows)
        if q.dtype != torch.float32 or tuple(q.shape) != (k, width):
            raise InvalidRequest(f"q_rows is {_described(q)}, expected float32 [{k}, {width}]")
        _check_distribution(q, "q_rows")
        return q
    if len(msg.q_nonzero) != k:
        raise InvalidRequest(f"block of {k} tokens carries {len(msg.q_nonzero)} q rows")
    return torch.stack([_row_from_sparse(row, width, "q_nonzero") for row in msg.q_nonzero])


def _sparse_row(row: torch.Tensor, ids: torch.Tensor) -> pb.SparseRow:
    """A float32 row [vocab] on the host by its ids with mass (ids: its nonzero ones, ascending)."""
    return pb.SparseRow(ids=tensor_to_proto(ids.to(torch.int32)), values=tensor_to_proto(row[ids]))


def _row_from_sparse(msg: pb.SparseRow, width: int, name: str) -> torch.Tensor:
    """A row [width] float32 from its ids with mass, checked (name: the field, for the message)."""
    ids, values = tensor_from_proto(msg.ids), tensor_from_proto(msg.values)
    if ids.dtype != torch.int32 or values.dtype != torch.float32 or ids.dim() != 1 or ids.shape != values.shape:
        raise InvalidRequest(f"{name} needs int32 ids and float32 values of one length [n]; got {_described(ids)} "
                             f"and {_described(values)}")
    if not 1 <= len(ids) <= width:
        raise InvalidRequest(f"{name} has {len(ids)} ids; a row of {width} has 1 to {width}")
    if int(ids[0]) < 0 or int(ids[-1]) >= width or (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise InvalidRequest(f"{name} ids must be ascending, each in [0, {width})")
    if not bool((torch.isfinite(values) & (values > 0)).all()):
        raise InvalidRequest(f"{name} values must be finite and above 0")
    return torch.zeros(width, dtype=torch.float32).index_put_((ids.long(),), values)


def _check_distribution(rows: torch.Tensor, name: str) -> None:
    """A row [width], or rows [k, width], each finite, at least 0, with some mass and a finite sum."""
    rows = rows.reshape(-1, rows.shape[-1])
    sums = rows.sum(dim=-1)
    if not bool((torch.isfinite(rows) & (rows >= 0)).all()) or not bool((torch.isfinite(sums) & (sums > 0)).all()):
        raise InvalidRequest(f"{name} values must be finite, at least 0, and some above 0 in every row")


def _described(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def resume_to_proto(resume: Resume) -> pb.Resume:
    msg = pb.Resume(session_id=resume.session_id, epoch=resume.epoch, base=resume.base, tokens=resume.tokens,
                    load_cap=resume.load_cap)
    if resume.stop_rule is not None:
        msg.stop_rule.CopyFrom(stop_rule_to_proto(resume.stop_rule))
    if resume.features is not None:
        msg.features.CopyFrom(tensor_to_proto(resume.features))
        msg.features_from = resume.features_from
    return msg


def resume_from_proto(msg: pb.Resume) -> Resume:
    """A malformed stop rule or tensor is an InvalidRequest; features come as sent."""
    return Resume(
        session_id=msg.session_id, epoch=msg.epoch, base=msg.base, tokens=tuple(msg.tokens), load_cap=msg.load_cap,
        stop_rule=stop_rule_from_proto(msg.stop_rule) if msg.HasField("stop_rule") else None,
        features=tensor_from_proto(msg.features) if msg.HasField("features") else None,
        features_from=msg.features_from,
    )


# Target features past this many bytes leave ahead of their Feedback or Resume in FeatureChunks of
# at most this size (a whole row where one row is larger): a 4k-token prompt's features at
# Llama-3.1-8B's width (3 x 4096 bf16) are 100 MB, past gRPC's message limit in one piece.
FEATURE_CHUNK_BYTES = 4 << 20


def draft_request_to_wire(request: DraftRequest, chunk_bytes: int | None = None) -> list[pb.DraftRequest]:
    """The messages a request travels as, in order: itself, but for target features over
    chunk_bytes, whose leading rows go ahead as FeatureChunks (the request keeps the last chunk's
    rows). A chain of verdicts is cut before each verdict whose features are chunked, so that its
    chunks arrive right before it (the draft handles a chain's verdicts in order either way).
    chunk_bytes: FEATURE_CHUNK_BYTES unless given."""
    chunk_bytes = FEATURE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if isinstance(request, Resume):
        chunks, request = _features_ahead(request, chunk_bytes)
        return [*chunks, pb.DraftRequest(resume=resume_to_proto(request))]
    if not isinstance(request, Feedback):
        return [draft_request_to_proto(request)]
    out, group = [], []
    for item in request.chain():
        chunks, item = _features_ahead(item, chunk_bytes)
        if chunks and group:
            out.append(pb.DraftRequest(feedback=_chain_to_proto(group)))
            group = []
        out += chunks
        group.append(item)
    out.append(pb.DraftRequest(feedback=_chain_to_proto(group)))
    return out


def _features_ahead(item, chunk_bytes: int):
    """A Feedback's or Resume's features over chunk_bytes as FeatureChunks of their leading rows,
    and the item with the rest (at most one chunk's rows, at least one row)."""
    features = item.features
    if features is None or features.shape[0] == 0:
        return [], item
    rows = max(1, chunk_bytes // (features.shape[1] * features.element_size()))
    tail = (features.shape[0] - 1) // rows * rows
    if tail == 0:
        return [], item
    chunks = [
        pb.DraftRequest(feature_chunk=pb.FeatureChunk(session_id=item.session_id,
                                                      features_from=item.features_from + start,
                                                      features=tensor_to_proto(features[start:start + rows])))
        for start in range(0, tail, rows)
    ]
    return chunks, dataclasses.replace(item, features=features[tail:], features_from=item.features_from + tail)


def draft_request_to_proto(request: DraftRequest) -> pb.DraftRequest:
    """What the target side's session sends its draft, as the wire says it."""
    if isinstance(request, SessionStart):
        return pb.DraftRequest(start=start_to_proto(request))
    if isinstance(request, Feedback):
        return pb.DraftRequest(feedback=feedback_to_proto(request))
    if isinstance(request, Resume):
        return pb.DraftRequest(resume=resume_to_proto(request))
    if isinstance(request, Cancel):
        return pb.DraftRequest(cancel=pb.Cancel(session_id=request.session_id))
    raise TypeError(f"not a draft request: {type(request).__name__}")


def block_to_proto(session_id: str, block: Block, resolved_token: int = NO_TOKEN, probs: bool = True) -> pb.Block:
    """probs: send each token's q (sampled acceptance needs it, `auto` learns from it; a greedy
    block of another policy needs only ids and entropies)."""
    msg = pb.Block(session_id=session_id, epoch=block.epoch, base=block.base, tokens=block.tokens)
    if resolved_token != NO_TOKEN:
        msg.resolved_token = resolved_token
    msg.entropies.CopyFrom(floats_to_proto(block.entropies))
    if probs:
        msg.q_probs.CopyFrom(floats_to_proto(block.probs))
    if block.is_tree:
        msg.sibling_counts.extend(len(options) for options in block.siblings)
        msg.sibling_tokens.extend(t for options in block.siblings for t in options)
        msg.grown_parents.extend(parent for parent, _ in block.grown or ())
        msg.grown_tokens.extend(token for _, token in block.grown or ())
        if block.q_rows is not None:  # sampled: the target tries the siblings against max(0, p - q)
            q_rows_to_proto(msg, block.q_rows)
    return msg


def drafted_to_proto(session_id: str, drafted: DraftedBlock, probs: bool = True) -> pb.Block:
    msg = block_to_proto(session_id, drafted.block, drafted.resolved_token, probs)
    msg.followup, msg.reused = drafted.followup, drafted.reused
    msg.started_at, msg.finished_at = drafted.started_at, drafted.finished_at
    msg.draft_s, msg.trigger_at, msg.grows = drafted.draft_s, drafted.trigger_at, drafted.grows
    if drafted.prepared_for is not None:
        base, accepted, token = drafted.prepared_for
        msg.prepared_for.CopyFrom(pb.PreparedFor(base=base, accepted=accepted, token=token))
    return msg


def drafted_from_proto(msg: pb.Block, width: int | None = None) -> DraftedBlock:
    """A malformed block (its q or entropies not one per token, a bad tensor, q rows not of the
    target's vocabulary of ``width``) is an InvalidRequest."""
    p = msg.prepared_for
    return DraftedBlock(
        block_from_proto(msg, width),
        followup=msg.followup,
        resolved_token=msg.resolved_token if msg.HasField("resolved_token") else NO_TOKEN,
        prepared_for=(p.base, p.accepted, p.token) if msg.HasField("prepared_for") else None,
        reused=msg.reused,
        started_at=msg.started_at,
        finished_at=msg.finished_at,
        draft_s=msg.draft_s,
        trigger_at=msg.trigger_at,
        grows=msg.grows,
    )


def draft_event_from_proto(event: pb.DraftEvent, width: int | None = None) -> DraftEvent:
    """What the draft sent, in the project's terms (a malformed block is an InvalidRequest; width:
    the target's vocabulary, which a sampled tree's q rows span)."""
    kind = event.WhichOneof("kind")
    if kind == "block":
        return drafted_from_proto(event.block, width)
    if kind == "closed":
        return DraftClosed(event.closed.session_id, event.closed.shed)
    if kind == "error":
        return DraftFailed(event.error.session_id, event.error.code, event.error.message)
    raise InvalidRequest("an empty draft event")


def stop_rule_to_proto(rule: StopRule) -> pb.StopRule:
    return pb.StopRule(weights=list(rule.weights), stop_at=rule.stop_at)


def stop_rule_from_proto(msg: pb.StopRule) -> StopRule:
    """Checked: a rule with the wrong number of weights or a bad stop_at is INVALID_ARGUMENT."""
    return StopRule(tuple(msg.weights), msg.stop_at).check()


def block_from_proto(msg: pb.Block, width: int | None = None) -> Block:
    entropies = floats_from_proto(msg.entropies) if msg.HasField("entropies") else []
    probs = floats_from_proto(msg.q_probs) if msg.HasField("q_probs") else []
    k = len(msg.tokens)
    if len(entropies) not in (0, k) or len(probs) not in (0, k):
        raise InvalidRequest(f"block of {k} tokens carries {len(probs)} probabilities and {len(entropies)} entropies")
    return Block(base=msg.base, tokens=list(msg.tokens), probs=probs, entropies=entropies, epoch=msg.epoch,
                 siblings=_siblings_from_proto(msg), grown=_grown_from_proto(msg), q_rows=q_rows_from_proto(msg, width))


def _grown_from_proto(msg: pb.Block) -> list[tuple[int, int]] | None:
    """Trees deep and deep-auto: the grown nodes (None: none); parents and ids that are not one each are an
    InvalidRequest (what they may be: wire_checks.py)."""
    parents, ids = list(msg.grown_parents), list(msg.grown_tokens)
    if not parents and not ids:
        return None
    if len(parents) != len(ids) or not msg.sibling_counts:
        raise InvalidRequest(f"block carries {len(parents)} grown parents for {len(ids)} grown ids"
                             + ("" if msg.sibling_counts else ", and no siblings to grow them from"))
    return list(zip(parents, ids))


def _siblings_from_proto(msg: pb.Block) -> list[list[int]] | None:
    """A tree's siblings place by place (None: a chain); counts that are not one per token or do
    not add up to the ids sent are an InvalidRequest (what the ids may be: wire_checks.py)."""
    counts, ids = list(msg.sibling_counts), list(msg.sibling_tokens)
    if not counts and not ids:
        return None
    if len(counts) != len(msg.tokens) or sum(counts) != len(ids):
        raise InvalidRequest(f"block of {len(msg.tokens)} tokens carries {len(counts)} sibling counts adding up to "
                             f"{sum(counts)} for {len(ids)} sibling ids")
    out, at = [], 0
    for n in counts:
        out.append(ids[at : at + n])
        at += n
    return out


def stats_to_proto(s: GenerationStats) -> pb.SessionStats:
    rounds = [
        pb.Round(
            drafted=d,
            accepted=a,
            wall_s=w,
            draft_s=ds,
            target_s=ts,
            block_transit_s=bt,
            target_queue_s=tq,
            feedback_transit_s=ft,
            draft_queue_s=dq,
            overhead_s=o,
            source=p,
        )
        for d, a, w, ds, ts, bt, tq, ft, dq, o, p in zip(
            s.draft_lengths,
            s.accepted_lengths,
            s.round_s,
            s.draft_forward_s,
            s.target_forward_s,
            s.block_transit_s,
            s.target_queue_s,
            s.feedback_transit_s,
            s.draft_queue_s,
            s.overhead_s,
            s.round_sources,
        )
    ]
    return pb.SessionStats(
        rounds=rounds,
        stop_entropies=s.stop_entropies,
        discarded_tokens=s.discarded_tokens,
        prepared_sent=s.prepared_sent,
        prepared_used=s.prepared_used,
        prepared_used_late=s.prepared_used_late,
        pauses=s.pauses,
        detached=s.detached,
        reattached=s.reattached,
        tree_nodes=s.tree_nodes,
        branches=s.branches,
        branch_tokens=s.branch_tokens,
        wall_s=s.wall_s,
        wire_bytes=s.wire_bytes,
        target_forwards=s.target_forwards,
        draft_forwards=s.draft_forwards,
        draft_busy_s=s.draft_busy_s,
        target_busy_s=s.target_busy_s,
        both_busy_s=s.both_busy_s,
        draft_wait_s=s.draft_wait_s,
        target_wait_s=s.target_wait_s,
        timeline=[pb.Span(worker=w, start=a, end=b) for w, a, b in s.timeline],
    )


def stats_from_proto(msg: pb.SessionStats) -> GenerationStats:
    r = list(msg.rounds)
    s = GenerationStats(
        rounds=len(r),
        draft_tokens=sum(x.drafted for x in r),
        accepted_tokens=sum(x.accepted for x in r),
        draft_lengths=[x.drafted for x in r],
        accepted_lengths=[x.accepted for x in r],
        stop_entropies=list(msg.stop_entropies),
        target_forwards=msg.target_forwards,
        draft_forwards=msg.draft_forwards,
        wall_s=msg.wall_s,
        round_s=[x.wall_s for x in r],
        draft_forward_s=[x.draft_s for x in r],
        target_forward_s=[x.target_s for x in r],
        block_transit_s=[x.block_transit_s for x in r],
        target_queue_s=[x.target_queue_s for x in r],
        feedback_transit_s=[x.feedback_transit_s for x in r],
        draft_queue_s=[x.draft_queue_s for x in r],
        overhead_s=[x.overhead_s for x in r],
        round_sources=[x.source for x in r],
        discarded_tokens=msg.discarded_tokens,
        prepared_sent=msg.prepared_sent,
        prepared_used=msg.prepared_used,
        prepared_used_late=msg.prepared_used_late,
        pauses=msg.pauses,
        detached=msg.detached,
        reattached=msg.reattached,
        tree_nodes=msg.tree_nodes,
        branches=msg.branches,
        branch_tokens=msg.branch_tokens,
        draft_busy_s=msg.draft_busy_s,
        target_busy_s=msg.target_busy_s,
        both_busy_s=msg.both_busy_s,
        draft_wait_s=msg.draft_wait_s,
        target_wait_s=msg.target_wait_s,
        wire_bytes=msg.wire_bytes,
        timeline=[(x.worker, x.start, x.end) for x in msg.timeline],
    )
    s.wire_bytes_per_round = s.wire_bytes / s.rounds if s.rounds else 0.0
    return s


def device_use_to_proto(timing) -> pb.EmulatedDeviceUse:
    """A KV pool's device timing (svip_common/device_timing.ForwardTiming): its device's use."""
    device, use = timing.device, timing.device.use
    return pb.EmulatedDeviceUse(name=timing.step.name, scale=device.scale, forwards=use.forwards,
                                device_s=use.device_s, overruns=use.overruns, overrun_s=use.overrun_s,
                                worst_ratio=use.worst_ratio)


def device_use_from_proto(msg: pb.EmulatedDeviceUse) -> dict:
    """A worker's device use as ForwardTiming.report gives it in process."""
    return {"model": msg.name, "scale": msg.scale, "forwards": msg.forwards, "device_s": msg.device_s,
            "overruns": msg.overruns, "overrun_s": msg.overrun_s, "worst_ratio": msg.worst_ratio}
