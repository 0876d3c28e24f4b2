"""The gRPC contract: checked-in generated code matches the .proto, tensors travel as raw bytes,
conversions round-trip, bad wire data is an InvalidRequest, greedy blocks are ids only."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from svip_common.acceptance import PRIOR_WEIGHTS, StopRule
from svip_common.contracts import Block, GenerationStats, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.messages import (
    Cancel,
    DraftClosed,
    DraftedBlock,
    DraftFailed,
    Feedback,
    Resume,
    SessionStart,
)
from svip_common.outcome import outcome_of
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
    biased = SamplingParams(seed=1, logit_bias=((5, -100.0), (9, 2.5)), presence_penalty=0.5,
                            frequency_penalty=-1.25, min_tokens=7, repetition_penalty=1.25)
    assert convert.sampling_from_proto(convert.sampling_to_proto(biased)) == biased
    assert not convert.sampling_to_proto(s).HasField("repetition_penalty")  # unset: 1, off
    with pytest.raises(InvalidRequest, match="repetition_penalty must be in"):
        convert.sampling_from_proto(pb.SamplingParams(top_p=1.0, repetition_penalty=0.0))  # set, not unset
    with pytest.raises(InvalidRequest, match="2 ids and 1 values"):
        convert.sampling_from_proto(pb.SamplingParams(logit_bias_ids=[5, 9], logit_bias=[1.0]))
    with pytest.raises(InvalidRequest, match="at most 300"):
        convert.sampling_from_proto(pb.SamplingParams(top_p=1.0, logit_bias_ids=range(301), logit_bias=[1.0] * 301))


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
        tree_nodes=9,
        branches=1,
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


def test_a_start_the_target_sends_is_the_start_the_draft_reads():
    start = SessionStart(
        session_id="s", prompt_ids=(5, 6), max_new_tokens=7, sampling=SamplingParams(temperature=0.5, seed=3),
        policy=PolicyConfig(name="auto"), stop_token_ids=frozenset({3, 0}), pipeline="sync", epoch=2, load_cap=0,
        stop_rule=StopRule(PRIOR_WEIGHTS, 0.4),
    )
    msg = convert.draft_request_to_proto(start)
    assert msg.WhichOneof("kind") == "start" and list(msg.start.stop_token_ids) == [0, 3]
    back = convert.start_from_proto(msg.start)
    assert back == start
    bare = convert.draft_request_to_proto(SessionStart("t", (1,), 1, SamplingParams(), PolicyConfig(name="svip"),
                                                       frozenset(), "async"))
    assert not bare.start.HasField("load_cap") and not bare.start.HasField("stop_rule")


def test_a_tree_block_travels_with_its_siblings_and_a_chain_without():
    tree = Block(base=4, tokens=[5, 6, 7], probs=[], entropies=[0.1, 0.2, 0.3], siblings=[[8, 9], [], [10]])
    msg = convert.block_to_proto("s", tree, probs=False)
    assert list(msg.sibling_counts) == [2, 0, 1] and list(msg.sibling_tokens) == [8, 9, 10]
    assert convert.block_from_proto(msg).siblings == [[8, 9], [], [10]]
    chain = convert.block_to_proto("s", dataclasses.replace(tree, siblings=[[], [], []]), probs=False)
    assert not chain.sibling_counts and convert.block_from_proto(chain).siblings is None


def test_a_deep_trees_grown_nodes_travel_with_it():
    tree = Block(base=4, tokens=[5, 6], probs=[], entropies=[0.1, 0.2], siblings=[[8], [9]], grown=[(2, 11), (3, 12)])
    back = convert.block_from_proto(convert.block_to_proto("s", tree, probs=False))
    assert (back.siblings, back.grown, back.nodes) == ([[8], [9]], [(2, 11), (3, 12)], 6)
    msg = pb.Block(session_id="s", base=4, tokens=[5], sibling_counts=[1], sibling_tokens=[8], grown_parents=[1, 1],
                   grown_tokens=[9])
    with pytest.raises(InvalidRequest, match="2 grown parents for 1 grown ids"):
        convert.block_from_proto(msg)
    with pytest.raises(InvalidRequest, match="no siblings to grow them from"):
        convert.block_from_proto(pb.Block(session_id="s", base=4, tokens=[5], grown_parents=[1], grown_tokens=[9]))


@pytest.mark.parametrize("counts, ids", [([2, 0], [8, 9, 10]), ([1], [8]), ([1, 1, 1, 1], [8, 9, 10, 11])])
def test_sibling_counts_that_do_not_fit_the_block_are_invalid(counts, ids):
    msg = pb.Block(session_id="s", base=4, tokens=[5, 6, 7], sibling_counts=counts, sibling_tokens=ids)
    with pytest.raises(InvalidRequest, match="sibling"):
        convert.block_from_proto(msg)


def test_a_branch_and_a_node_price_travel_with_their_verdict():
    head = verdict_feedback(1, 10, 4, 1, 7, branch=(9, 4), node_price=0.25, then=verdict_feedback(1, 13, 2, 2, 3))
    back = convert.feedback_from_proto(convert.draft_request_to_proto(head).feedback, 2)
    assert [(f.branch, f.node_price) for f in back.chain()] == [((9, 4), 0.25), ((), None)]
    for price in (-1.0, math.nan, 1e7):
        msg = convert.draft_request_to_proto(dataclasses.replace(head, node_price=price, then=None)).feedback
        with pytest.raises(InvalidRequest, match="node_price"):
            convert.feedback_from_proto(msg, 2)


def test_a_feedback_chain_travels_as_one_message_earliest_first():
    rule = StopRule(PRIOR_WEIGHTS, 0.3)
    later = verdict_feedback(1, 14, 2, 0, 7, prepared_used=True, stop_rule=rule)
    head = verdict_feedback(1, 10, 4, 4, -1, load_cap=0, p_row=torch.tensor([0.25, 0.75], dtype=torch.float64),
                    sent_at=5.0, then=later)
    msg = convert.draft_request_to_proto(head).feedback
    assert (msg.base, msg.drafted, msg.accepted, msg.token, msg.sent_at) == (10, 4, 4, -1, 5.0)
    assert msg.HasField("load_cap") and msg.load_cap == 0 and not msg.HasField("stop_rule")
    assert convert.tensor_from_proto(msg.p_row).tolist() == [0.25, 0.75] and msg.p_row.dtype == "float32"
    then = msg.then
    assert (then.base, then.accepted, then.token, then.prepared_used) == (14, 0, 7, True)
    assert not then.HasField("load_cap") and not then.HasField("p_row") and not then.HasField("then")
    assert convert.stop_rule_from_proto(then.stop_rule) == rule
    back = convert.feedback_from_proto(msg, 2)  # what the draft reads: the same chain, earliest first
    assert [(f.base, f.drafted, f.accepted, f.token, f.prepared_used, f.load_cap, f.stop_rule, f.sent_at)
            for f in back.chain()] == [(10, 4, 4, -1, False, 0, None, 5.0), (14, 2, 0, 7, True, None, rule, 0.0)]
    assert back.p_row.tolist() == [0.25, 0.75] and back.then.p_row is None and back.features is None


def test_a_bad_verdict_late_in_a_chain_refuses_the_whole_chain():
    """The draft reads a chain whole before it applies any verdict of it."""
    later = pb.Feedback(session_id="s", base=14, drafted=2, token=7, stop_rule=pb.StopRule(weights=[1.0]))
    msg = pb.Feedback(session_id="s", base=10, drafted=4, accepted=4, token=3, then=later)
    with pytest.raises(InvalidRequest):
        convert.feedback_from_proto(msg, 2)


def test_a_p_row_with_few_ids_with_mass_travels_by_them_and_comes_back_the_same_bits():
    from svip_common.sampling import warp_probs

    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3)) * 4
    nucleus = warp_probs(logits, SamplingParams(temperature=0.7, top_p=0.9, seed=1))[0]  # a few ids with mass
    everywhere = torch.softmax(logits[0], dim=-1)  # every id with mass
    for row, sparse in ((nucleus, True), (everywhere, False), (nucleus.double(), True)):
        msg = convert.draft_request_to_proto(verdict_feedback(1, 10, 4, 2, -1, p_row=row)).feedback
        assert msg.HasField("p_nonzero") == sparse and msg.HasField("p_row") != sparse
        assert torch.equal(convert.p_row_from_proto(msg, 4096), row.float())
    small = convert.draft_request_to_proto(verdict_feedback(1, 10, 4, 2, -1, p_row=nucleus)).feedback
    assert small.ByteSize() < 4096 * 4 / 10
    assert convert.p_row_from_proto(pb.Feedback(session_id="s"), 4096) is None


def test_a_sampled_trees_q_rows_travel_by_ids_with_mass_where_smaller_and_come_back_the_same_bits():
    from svip_common.sampling import warp_probs

    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(5)) * 4
    nucleus = warp_probs(logits, SamplingParams(temperature=0.7, top_p=0.9, seed=1))  # few ids with mass
    everywhere = torch.softmax(logits, dim=-1)
    for rows, sparse in ((nucleus, True), (everywhere, False)):
        block = Block(base=4, tokens=[1, 2, 3], probs=[0.5] * 3, entropies=[0.1] * 3, q_rows=rows,
                      siblings=[[7], [], [8, 9]])
        msg = convert.block_to_proto("s", block)
        assert bool(msg.q_nonzero) == sparse and msg.HasField("q_rows") != sparse
        back = convert.block_from_proto(msg, 4096)
        assert torch.equal(back.q_rows, rows.float()) and back.siblings == [[7], [], [8, 9]]
    chain = Block(base=4, tokens=[1], probs=[0.5], entropies=[0.1], q_rows=everywhere[:1])
    assert not convert.block_to_proto("s", chain).HasField("q_rows")  # a chain's q stays with the draft


def _q_block(k=2, dense=None, sparse=()) -> pb.Block:
    msg = pb.Block(session_id="s", base=3, tokens=list(range(1, k + 1)))
    if dense is not None:
        msg.q_rows.CopyFrom(convert.tensor_to_proto(dense))
    msg.q_nonzero.extend(sparse)
    return msg


def _row(ids, values) -> pb.SparseRow:
    return pb.SparseRow(ids=convert.tensor_to_proto(torch.tensor(ids, dtype=torch.int32)),
                        values=convert.tensor_to_proto(torch.tensor(values, dtype=torch.float32)))


@pytest.mark.parametrize("msg, width, words", [
    (_q_block(dense=torch.full((2, 8), 0.125)), None, "q rows where none are read"),
    (_q_block(dense=torch.full((2, 8), 0.125), sparse=[_row([1], [1.0])] * 2), 8, "q_rows or q_nonzero, not both"),
    (_q_block(dense=torch.full((2, 7), 0.125)), 8, "q_rows is float32 [2, 7], expected float32 [2, 8]"),
    (_q_block(dense=torch.full((3, 8), 0.125)), 8, "q_rows is float32 [3, 8], expected float32 [2, 8]"),
    (_q_block(dense=torch.full((2, 8), 0.125, dtype=torch.float64)), 8, "q_rows is float64 [2, 8]"),
    (_q_block(dense=torch.tensor([[0.5, -0.5] + [0.0] * 6] * 2)), 8, "finite, at least 0, and some above 0"),
    (_q_block(dense=torch.zeros(2, 8)), 8, "finite, at least 0, and some above 0"),
    (_q_block(sparse=[_row([1], [1.0])]), 8, "block of 2 tokens carries 1 q rows"),
    (_q_block(sparse=[_row([1], [1.0]), _row([9], [1.0])]), 8, "q_nonzero ids must be ascending, each in [0, 8)"),
    (_q_block(sparse=[_row([1], [1.0]), _row([2], [float("nan")])]), 8, "q_nonzero values must be finite"),
], ids=["unread", "both", "width", "rows", "dtype", "negative", "no-mass", "count", "id-past-width", "nan"])
def test_bad_q_rows_are_refused_in_one_line(msg, width, words):
    with pytest.raises(InvalidRequest) as err:
        convert.block_from_proto(msg, width)
    assert words in str(err.value) and "\n" not in str(err.value)


def _sparse(ids, values, ids_dtype=torch.int32, values_dtype=torch.float32) -> pb.Feedback:
    msg = pb.Feedback(session_id="s")
    msg.p_nonzero.ids.CopyFrom(convert.tensor_to_proto(torch.tensor(ids, dtype=ids_dtype)))
    msg.p_nonzero.values.CopyFrom(convert.tensor_to_proto(torch.tensor(values, dtype=values_dtype)))
    return msg


def _dense(values, dtype=torch.float32) -> pb.Feedback:
    msg = pb.Feedback(session_id="s")
    msg.p_row.CopyFrom(convert.tensor_to_proto(torch.tensor(values, dtype=dtype)))
    return msg


def _both() -> pb.Feedback:
    msg = _sparse([1], [1.0])
    msg.p_row.CopyFrom(convert.tensor_to_proto(torch.ones(8)))
    return msg


@pytest.mark.parametrize("msg, words", [
    (_both(), "p_row or p_nonzero, not both"),
    (_sparse([1, 2], [0.5, 0.5], ids_dtype=torch.int64), "int32 ids and float32 values"),
    (_sparse([1, 2], [0.5, 0.5], values_dtype=torch.float64), "int32 ids and float32 values"),
    (_sparse([1, 2], [0.5]), "of one length"),
    (_sparse([], []), "has 0 ids"),
    (_sparse(list(range(9)), [0.1] * 9), "has 9 ids; a row of 8 has 1 to 8"),
    (_sparse([3, 2], [0.5, 0.5]), "ascending"),
    (_sparse([2, 2], [0.5, 0.5]), "ascending"),
    (_sparse([-1, 2], [0.5, 0.5]), "ascending, each in [0, 8)"),
    (_sparse([2, 8], [0.5, 0.5]), "ascending, each in [0, 8)"),
    (_sparse([1, 2], [0.5, float("nan")]), "finite and above 0"),
    (_sparse([1, 2], [0.5, float("inf")]), "finite and above 0"),
    (_sparse([1, 2], [0.5, 0.0]), "finite and above 0"),
    (_sparse([1, 2], [0.5, -0.5]), "finite and above 0"),
    (_dense([0.125] * 7), "p_row is float32 [7], expected float32 [8]"),
    (_dense([0.125] * 8, dtype=torch.float64), "p_row is float64 [8], expected float32 [8]"),
    (_dense([0.5, float("nan")] + [0.0] * 6), "finite, at least 0, and some above 0"),
    (_dense([0.5, -0.5] + [0.0] * 6), "finite, at least 0, and some above 0"),
    (_dense([0.0] * 8), "finite, at least 0, and some above 0"),
], ids=["both", "int64-ids", "float64-values", "lengths", "empty", "too-many", "descending", "duplicate",
        "negative-id", "id-past-width", "nan", "inf", "zero", "negative",
        "dense-width", "dense-dtype", "dense-nan", "dense-negative", "dense-no-mass"])
def test_a_bad_p_row_is_refused_in_one_line(msg, words):
    with pytest.raises(InvalidRequest) as err:
        convert.p_row_from_proto(msg, 8)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_resume_and_cancel_on_the_wire():
    msg = convert.draft_request_to_proto(Resume("s", 3, 40, (8, 9), 4, StopRule(PRIOR_WEIGHTS, 0.2)))
    r = msg.resume
    assert (r.session_id, r.epoch, r.base, list(r.tokens), r.load_cap) == ("s", 3, 40, [8, 9], 4)
    assert convert.stop_rule_from_proto(r.stop_rule) == StopRule(PRIOR_WEIGHTS, 0.2)
    assert convert.resume_from_proto(r) == Resume("s", 3, 40, (8, 9), 4, StopRule(PRIOR_WEIGHTS, 0.2))
    assert convert.draft_request_to_proto(Cancel("s")).cancel.session_id == "s"
    with pytest.raises(TypeError, match="not a draft request"):
        convert.draft_request_to_proto(object())


def test_a_drafted_block_round_trips_with_its_place_in_the_protocol():
    block = Block(base=17, tokens=[5, 6], probs=[0.5, 0.25], entropies=[0.5, 0.25], epoch=2)
    sent = DraftedBlock(block, followup=True, resolved_token=0, prepared_for=(15, 1, 9), reused=True,
                        started_at=1.0, finished_at=2.0, draft_s=0.5, trigger_at=0.75)
    msg = convert.drafted_to_proto("s1", sent)
    assert msg.session_id == "s1" and msg.resolved_token == 0  # token 0 is a real token
    got = convert.draft_event_from_proto(pb.DraftEvent(block=msg))
    assert got == sent
    plain = convert.drafted_from_proto(convert.drafted_to_proto("s1", DraftedBlock(block)))
    assert plain.prepared_for is None and plain.resolved_token == -1 and not plain.followup


def test_a_growth_and_a_follow_ups_count_travel_and_a_count_elsewhere_is_refused():
    """growth.py on the wire: a growth says how many tokens the follow-up (or a prepared
    continuation sent before it ended) holds already (Block.grows); the verdict that goes on with
    either says how many of it the target verifies (Feedback.next_tokens), which no other verdict
    may carry, and at least one."""
    tail = DraftedBlock(Block(base=17, tokens=[8], probs=[], entropies=[0.5], epoch=2), followup=True, grows=3)
    assert convert.draft_event_from_proto(pb.DraftEvent(block=convert.drafted_to_proto("s", tail))) == tail
    outcome = outcome_of(1, 10, 4, 4, -1, (), True, False, next_tokens=3)
    head = Feedback("s", outcome)
    back = convert.feedback_from_proto(convert.draft_request_to_proto(head).feedback, 2)
    assert back.outcome.next_tokens == 3
    prepared = Feedback("s", outcome_of(2, 10, 4, 1, 9, (), False, True, next_tokens=2))
    assert convert.feedback_from_proto(convert.draft_request_to_proto(prepared).feedback, 2) == prepared
    older = dataclasses.replace(head, outcome=outcome_of(1, 10, 4, 4, -1, (), True, False))
    assert not convert.draft_request_to_proto(older).feedback.HasField("next_tokens")
    for msg in (pb.Feedback(session_id="s", base=10, drafted=4, accepted=2, token=7, next=pb.NEXT_SETTLED,
                            next_tokens=3),
                pb.Feedback(session_id="s", base=10, drafted=4, accepted=4, token=-1, next=pb.NEXT_FOLLOWUP,
                            next_tokens=0)):
        with pytest.raises(InvalidRequest, match="prepared continuation's outcome says how many"):
            convert.feedback_from_proto(msg, 2)


def test_draft_events_read_in_the_projects_terms():
    shed = convert.draft_event_from_proto(pb.DraftEvent(closed=pb.Closed(session_id="s", shed=True)))
    assert shed == DraftClosed("s", shed=True)
    error = convert.draft_event_from_proto(pb.DraftEvent(error=pb.Error(session_id="s", code=8, message="full")))
    assert error == DraftFailed("s", 8, "full")
    with pytest.raises(InvalidRequest, match="empty draft event"):
        convert.draft_event_from_proto(pb.DraftEvent())
    bad = pb.Block(session_id="s", base=1, tokens=[1, 2])
    bad.entropies.CopyFrom(convert.floats_to_proto([0.5]))
    with pytest.raises(InvalidRequest, match="1 entropies"):
        convert.draft_event_from_proto(pb.DraftEvent(block=bad))


def verdict_feedback(epoch: int, base: int, drafted: int, accepted: int, token: int, prepared_used: bool = False,
                     branch: tuple[int, ...] = (), **fields) -> Feedback:
    """A Feedback whose outcome is what the target decides for these parts (svip_common/outcome.py)."""
    from svip_common.outcome import outcome_of

    deferred = accepted == drafted and token == -1 and not prepared_used
    return Feedback("s", outcome_of(epoch, base, drafted, accepted, token, branch, deferred, prepared_used), **fields)
