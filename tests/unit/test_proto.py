"""The gRPC contract: checked-in generated code matches the .proto, tensors travel as raw bytes,
conversions round-trip, bad wire data is an InvalidRequest, greedy blocks are ids only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from svip_common.acceptance import PRIOR_WEIGHTS, StopRule
from svip_common.contracts import Block, GenerationStats, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_proto import convert
from svip_proto import svip_pb2 as pb

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def test_generated_code_matches_the_proto(tmp_path):
    """Fails when svip.proto changed but proto/regenerate.sh was not run (or vice versa)."""
    (tmp_path / "svip_proto").mkdir()
    (tmp_path / "svip_proto" / "svip.proto").write_bytes((PROTO_DIR / "svip_proto" / "svip.proto").read_bytes())
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
         "svip_proto/svip.proto"],
        cwd=tmp_path, check=True,
    )
    for name in ("svip_pb2.py", "svip_pb2.pyi", "svip_pb2_grpc.py"):
        fresh = (tmp_path / "svip_proto" / name).read_text()
        checked_in = (PROTO_DIR / "svip_proto" / name).read_text()
        assert fresh == checked_in, f"{name} drifted from svip.proto: run proto/regenerate.sh"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_tensor_round_trip_is_raw_bytes(dtype):
    t = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7).to(dtype)
    msg = convert.tensor_to_proto(t)
    assert len(msg.data) == t.numel() * t.element_size()
    assert list(msg.shape) == [2, 3, 4] and msg.dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(convert.tensor_from_proto(msg), t)


def test_bad_tensors_are_invalid_requests():
    with pytest.raises(InvalidRequest, match="needs 12 bytes"):
        convert.tensor_from_proto(pb.Tensor(data=b"\0" * 8, dtype="float32", shape=[3]))
    with pytest.raises(InvalidRequest, match="unsupported tensor dtype"):
        convert.tensor_from_proto(pb.Tensor(data=b"", dtype="complex64", shape=[0]))
    with pytest.raises(InvalidRequest, match="negative"):
        convert.tensor_from_proto(pb.Tensor(data=b"", dtype="float32", shape=[-1]))


def test_params_round_trip_and_validate():
    s = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=42)
    assert convert.sampling_from_proto(convert.sampling_to_proto(s)) == s
    p = PolicyConfig(name="heuristic", threshold=0.4, draft_length=3)
    assert convert.policy_from_proto(convert.policy_to_proto(p)) == p
    with pytest.raises(InvalidRequest, match="top_p"):
        convert.sampling_from_proto(pb.SamplingParams(temperature=1.0, top_p=0.0))
    with pytest.raises(InvalidRequest, match="unknown policy"):
        convert.policy_from_proto(pb.PolicyConfig(name="bogus", max_draft_length=4, draft_length=1))


def test_block_round_trip():
    block = Block(base=17, tokens=[5, 6, 7], probs=[0.5, 0.25, 0.125], entropies=[0.1, 0.2, 0.3], epoch=2)
    msg = convert.block_to_proto("s1", block)
    back = convert.block_from_proto(msg)
    assert (back.base, back.tokens, back.probs, back.epoch) == (17, [5, 6, 7], [0.5, 0.25, 0.125], 2)
    assert back.entropies == pytest.approx([0.1, 0.2, 0.3])
    assert not msg.HasField("resolved_token")  # absent, not 0: token 0 is a real token
    assert convert.block_to_proto("s1", block, resolved_token=0).resolved_token == 0


def test_session_stats_round_trip():
    stats = GenerationStats(
        rounds=2,
        draft_tokens=5,
        accepted_tokens=3,
        draft_lengths=[2, 3],
        accepted_lengths=[2, 1],
        stop_entropies=[0.5, 1.5],
        target_forwards=2,
        draft_forwards=7,
        wall_s=0.5,
        round_s=[0.2, 0.3],
        draft_forward_s=[0.01, 0.02],
        target_forward_s=[0.03, 0.04],
        block_transit_s=[1e-4, 2e-4],
        target_queue_s=[3e-5, 4e-5],
        feedback_transit_s=[1e-4, 0.0],
        draft_queue_s=[5e-5, 0.0],
        overhead_s=[1e-3, 2e-3],
        round_sources=["first", "prepared"],
        discarded_tokens=2,
        prepared_sent=3,
        prepared_used=1,
        prepared_used_late=1,
        draft_busy_s=0.1,
        target_busy_s=0.2,
        both_busy_s=0.05,
        draft_wait_s=0.4,
        target_wait_s=0.3,
        wire_bytes=900,
        wire_bytes_per_round=450.0,
        timeline=[("draft", 0.0, 0.01), ("target", 0.01, 0.04)],
    )
    back = convert.stats_from_proto(convert.stats_to_proto(stats))
    assert back == stats


def test_greedy_block_is_token_ids_and_a_small_header():
    block = Block(base=1000, tokens=[151_000 + i for i in range(8)], probs=[0.9] * 8, entropies=[0.1] * 8, epoch=3)
    msg = convert.block_to_proto("session-0123456789", block, probs=False)
    assert not msg.HasField("q_probs")
    size = len(msg.SerializeToString())
    # 8 ids of 3 bytes, 8 float32 entropies, a 20-byte session id, base, epoch, tags
    assert size <= 8 * 4 + 8 * 4 + 20 + 32, size


def test_mismatched_block_lengths_are_invalid():
    msg = pb.Block(session_id="s", base=1, tokens=[1, 2])
    msg.q_probs.CopyFrom(convert.tensor_to_proto(torch.tensor([0.5])))
    with pytest.raises(InvalidRequest, match="carries 1 probabilities"):
        convert.block_from_proto(msg)


def test_a_start_reads_the_same_on_both_workers():
    msg = pb.StartSession(
        session_id="s", prompt_ids=[5, 6], max_new_tokens=7, stop_token_ids=[0, 3], pipeline=pb.PIPELINE_SYNC,
        epoch=2, load_cap=0, policy=convert.policy_to_proto(PolicyConfig(name="auto")),
        sampling=convert.sampling_to_proto(SamplingParams(temperature=0.5, seed=3)),
        stop_rule=convert.stop_rule_to_proto(StopRule(PRIOR_WEIGHTS, 0.4)),
    )
    start = convert.start_from_proto(msg)
    assert (start.session_id, start.prompt_ids, start.max_new_tokens) == ("s", (5, 6), 7)
    assert start.stop_token_ids == frozenset({0, 3}) and start.pipeline == "sync" and start.epoch == 2
    assert start.load_cap == 0 and start.speculates and start.policy.name == "auto"
    assert start.sampling == SamplingParams(temperature=0.5, seed=3)
    assert start.stop_rule == StopRule(PRIOR_WEIGHTS, 0.4)
    greedy = convert.sampling_to_proto(SamplingParams())
    bare = convert.start_from_proto(pb.StartSession(session_id="t", prompt_ids=[1], max_new_tokens=1, sampling=greedy))
    assert bare.pipeline == "async" and bare.load_cap is None and bare.stop_rule is None
    assert not bare.speculates and bare.policy.name == "none"


@pytest.mark.parametrize("field, value, message", [
    ("policy", convert.policy_to_proto(PolicyConfig(name="svip", threshold=-1.0)), "threshold"),
    ("stop_rule", pb.StopRule(weights=[1.0], stop_at=0.5), "weights"),
])
def test_a_bad_start_is_invalid(field, value, message):
    msg = pb.StartSession(session_id="s", prompt_ids=[1], max_new_tokens=1,
                          policy=convert.policy_to_proto(PolicyConfig(name="auto")),
                          sampling=convert.sampling_to_proto(SamplingParams()))
    getattr(msg, field).CopyFrom(value)
    with pytest.raises(InvalidRequest, match=message):
        convert.start_from_proto(msg)
