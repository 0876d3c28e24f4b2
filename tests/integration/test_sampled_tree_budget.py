"""A sampled tree's q rows cross the workers within a byte budget (the security review's H-3): the
draft cuts a sampled tree's spine to what MAX_Q_BYTES holds dense at its width (6 places at
Qwen2.5's 152k vocabulary: a block was 37 MiB and 144 ms of the target's compute thread before),
whatever the request's policy asks; the target refuses a block past it by name and checks the rows
it takes in one pass. Outputs stay the target's: the greedy tree reference holds, and the sampled
distribution tests (test_sampling_exact.py) run these trees at the default budget."""

from __future__ import annotations

import pytest
import torch

import svip_common.trees
from svip_common.contracts import Block, GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.trees import MAX_Q_BYTES, q_rows_within
from svip_proto import convert
from tests.integration.test_in_memory import DRAFT_FIRST, make_pair

QWEN_WIDTH = 152064


def wide_block(rows: int, width: int = QWEN_WIDTH) -> Block:
    q = torch.softmax(torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)), dim=-1)
    return Block(base=5, tokens=list(range(1, rows + 1)), probs=[0.5] * rows, entropies=[1.0] * rows,
                 siblings=[[rows + 1]] + [[] for _ in range(rows - 1)], q_rows=q)


def test_at_a_152k_vocabulary_six_dense_rows_fit_and_seven_are_refused():
    assert q_rows_within(QWEN_WIDTH) == 6 and q_rows_within(4096) == 256 and q_rows_within(10**9) == 1
    fits = convert.block_to_proto("s", wide_block(6))
    assert fits.ByteSize() <= MAX_Q_BYTES + 4096
    q = convert.q_rows_from_proto(fits, QWEN_WIDTH)
    assert q.shape == (6, QWEN_WIDTH) and torch.equal(q, wide_block(6).q_rows)
    with pytest.raises(InvalidRequest, match="bytes of q rows; at most"):
        convert.q_rows_from_proto(convert.block_to_proto("s", wide_block(7)), QWEN_WIDTH)


def test_a_row_that_is_not_a_distribution_is_refused_in_one_pass():
    block = wide_block(3, width=320)
    block.q_rows[1] = 0.0  # no mass
    with pytest.raises(InvalidRequest, match="some above 0 in every row"):
        convert.q_rows_from_proto(convert.block_to_proto("s", block), 320)
    block.q_rows[1, 7] = float("inf")
    with pytest.raises(InvalidRequest, match="finite"):
        convert.q_rows_from_proto(convert.block_to_proto("s", block), 320)


@pytest.mark.parametrize("tree", ["cape", "deep"])
def test_the_draft_cuts_a_sampled_trees_spine_to_the_budget(models, prompt_ids, monkeypatch, tree):
    """T=1, a constant policy asking 8 places: with a budget of three dense rows at the test width,
    every block that crosses carries at most three rows, and at most that many bytes."""
    width = models["target"].vocab_size
    monkeypatch.setattr(svip_common.trees, "MAX_Q_BYTES", 3 * 4 * width)
    sent = []
    real = convert.q_rows_to_proto

    def recorded(msg, q_rows):
        real(msg, q_rows)
        sent.append((q_rows.shape[0], len(msg.q_rows.data) + sum(len(r.ids.data) + len(r.values.data)
                                                                  for r in msg.q_nonzero)))

    monkeypatch.setattr(convert, "q_rows_to_proto", recorded)
    pair = make_pair(models, "async", DRAFT_FIRST)
    policy = PolicyConfig(name="constant", draft_length=8, tree=tree)
    requests = [GenerationRequest(ids, 24, SamplingParams(temperature=1.0, seed=s), policy, ignore_eos=True)
                for s, ids in enumerate(prompt_ids.values())]
    results = pair.generate_all(requests)
    assert all(len(r.token_ids) == 24 for r in results)
    assert sent and max(rows for rows, _ in sent) == 3 and max(size for _, size in sent) <= 3 * 4 * width
