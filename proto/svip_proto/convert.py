"""All conversion between svip_common.contracts and the wire messages, in one place.

Tensors travel as raw little-endian bytes + dtype + shape, never as repeated floats or pickles.
"""

from __future__ import annotations

import sys

import torch

from svip_common.contracts import DRAFT_LENGTH_CAP, NO_TOKEN, Block, PolicyConfig, SamplingParams, Verdict
from svip_common.errors import InvalidRequest
from svip_proto import svip_pb2 as pb

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
        raise InvalidRequest(f"tensor of shape {shape} and dtype {msg.dtype} needs {count * itemsize} bytes, got {len(msg.data)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    params = SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)
    params.validate()
    return params


def policy_to_proto(p: PolicyConfig) -> pb.PolicyConfig:
    if isinstance(p.threshold, str):
        raise ValueError("resolve threshold 'auto' before sending a policy")
    return pb.PolicyConfig(
        name=p.name, threshold=p.threshold, entropy_scale=p.entropy_scale, draft_length=p.draft_length,
        max_draft_length=p.max_draft_length, confidence=p.confidence,
    )


def policy_from_proto(msg: pb.PolicyConfig, cap: int = DRAFT_LENGTH_CAP) -> PolicyConfig:
    policy = PolicyConfig(
        name=msg.name, threshold=msg.threshold, entropy_scale=msg.entropy_scale, draft_length=msg.draft_length,
        max_draft_length=msg.max_draft_length, confidence=msg.confidence,
    )
    policy.validate(cap)
    return policy


def block_to_proto(session_id: str, block: Block, greedy: bool, resolved_token: int = NO_TOKEN) -> pb.Block:
    msg = pb.Block(session_id=session_id, epoch=block.epoch, base=block.base, tokens=block.tokens,
                   resolved_token=resolved_token)
    msg.entropies.CopyFrom(tensor_to_proto(torch.tensor(block.entropies, dtype=torch.float32)))
    if not greedy:  # greedy verification needs no probabilities at all
        msg.q_probs.CopyFrom(tensor_to_proto(torch.tensor(block.probs, dtype=torch.float32)))
    return msg


def block_from_proto(msg: pb.Block) -> Block:
    entropies = tensor_from_proto(msg.entropies).tolist() if msg.HasField("entropies") else []
    probs = tensor_from_proto(msg.q_probs).tolist() if msg.HasField("q_probs") else []
    k = len(msg.tokens)
    if len(entropies) not in (0, k) or len(probs) not in (0, k):
        raise InvalidRequest(f"block of {k} tokens carries {len(probs)} probabilities and {len(entropies)} entropies")
    return Block(base=msg.base, tokens=list(msg.tokens), probs=probs, entropies=entropies, epoch=msg.epoch)


def verdict_to_proto(session_id: str, verdict: Verdict) -> pb.Verdict:
    msg = pb.Verdict(session_id=session_id, epoch=verdict.epoch, base=verdict.base,
                     accepted=verdict.accepted, token=verdict.token)
    if verdict.p_row is not None:
        msg.p_row.CopyFrom(tensor_to_proto(verdict.p_row.float()))
    return msg


def verdict_from_proto(msg: pb.Verdict) -> Verdict:
    p_row = tensor_from_proto(msg.p_row) if msg.HasField("p_row") else None
    return Verdict(base=msg.base, accepted=msg.accepted, token=msg.token, epoch=msg.epoch, p_row=p_row)
