"""One host read per step: a draft step (greedy, or sampled sessions sharing a warp) and a greedy
verification step bring their results to the host in one copy for the whole batch, not one (or
five) per session. Counted: every
``.item()`` / ``int()`` / ``float()`` / ``bool()`` of a tensor is an ``aten::_local_scalar_dense``
under the profiler, and every ``.tolist()`` is counted by a wrapper around it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from draft_worker.drafter import Drafter
from svip_common import sampling
from svip_common.contracts import Block, PolicyConfig, SamplingParams
from svip_common.sampling import warp_probs
from target_worker.verifier import Verifier

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]


def host_reads(run) -> int:
    lists = []
    tolist = torch.Tensor.tolist

    def counted(self):
        lists.append(self.shape)
        return tolist(self)

    torch.Tensor.tolist = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    finally:
        torch.Tensor.tolist = tolist
    return len(lists) + sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense")


def draft_step_reads(models, batch: int, sampling: SamplingParams = SamplingParams()) -> int:
    draft = models["close_draft"]
    drafter = Drafter(draft, draft.token_limit, kv_cache_tokens=4096)
    policy = PolicyConfig(name="constant", draft_length=8)
    blocks = [drafter.open(dataclasses.replace(sampling, seed=i), policy, []).begin(PROMPT[: 3 + i], budget=8)
              for i in range(batch)]
    drafter.step(blocks)  # the prompts' prefill
    reads = host_reads(lambda: drafter.step(blocks))
    assert all(len(b.block) == 2 for b in blocks)
    return reads


def verify_step_reads(models, batch: int, sampling: SamplingParams = SamplingParams(), q_rows: bool = False) -> int:
    target = models["target"]
    verifier = Verifier(target, kv_cache_tokens=4096)
    sessions = [verifier.open(dataclasses.replace(sampling, seed=i)) for i in range(batch)]
    vocab = target.model.config.vocab_size
    q = torch.full((3, vocab), 1.0 / vocab) if q_rows else None  # in process: q is here; distributed: with the draft
    jobs = [(s, PROMPT[: 3 + i], Block(base=3 + i, tokens=[1, 2, 3], probs=[0.3] * 3, entropies=[0.0] * 3, q_rows=q))
            for i, s in enumerate(sessions)]
    verifier.verify_batch(jobs)  # the prompts' prefill with a first block
    return host_reads(lambda: verifier.verify_batch(jobs))  # the same blocks again: a verify step


def followup_step_reads(models, batch: int, sampling: SamplingParams = SamplingParams(), q_rows: bool = False,
                        on_arrival: bool = False) -> int:
    """A step of follow-ups: each block continues one the target accepted whole, so its first
    token is judged against the stored row before the forward (Verifier.judge_first), then the
    blocks that pass are verified. Half of the sessions' first tokens are the target's own choice.
    on_arrival: as the distributed pipeline does, each block is judged when it arrives and only
    those that pass go to the step, which does not judge them again."""
    target = models["target"]
    verifier = Verifier(target, kv_cache_tokens=4096)
    sessions = [verifier.open(dataclasses.replace(sampling, seed=i)) for i in range(batch)]
    vocab = target.model.config.vocab_size
    q = torch.full((3, vocab), 1.0 / vocab) if q_rows else None
    firsts = [Block(base=3 + i, tokens=[1, 2], probs=[0.3] * 2, entropies=[0.0] * 2, q_rows=q) for i in range(batch)]
    verifier.verify_batch([(s, PROMPT[: 3 + i], b) for i, (s, b) in enumerate(zip(sessions, firsts))])
    stored = [int(torch.argmax(s._pending)) for s in sessions]
    jobs = [(s, [*PROMPT[: 3 + i], 1, 2],
             Block(base=5 + i, tokens=[stored[i] if i % 2 else 7, 3], probs=[0.3] * 2, entropies=[0.0] * 2, q_rows=q))
            for i, s in enumerate(sessions)]
    if on_arrival:
        jobs = [job for job in jobs if job[0].judge_first(job[1], job[2]) is None]
        if not jobs:
            return 0
    forwards = [s.forwards for s in sessions]
    reads = host_reads(lambda: verifier.verify_batch(jobs))
    decided_early = [s.forwards == f for s, f in zip(sessions, forwards)]
    if not on_arrival:
        assert decided_early[0] and (batch == 1 or not all(decided_early))  # token 7: not the target's choice
    return reads


SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("count, most", [
    (draft_step_reads, 1),
    (lambda models, batch: draft_step_reads(models, batch, SAMPLED), 1),
    (verify_step_reads, 1),
    (lambda models, batch: verify_step_reads(models, batch, SAMPLED), 2),  # p at the drafted tokens, the draws
    (lambda models, batch: verify_step_reads(models, batch, SAMPLED, q_rows=True), 2),
    (followup_step_reads, 1),
    (lambda models, batch: followup_step_reads(models, batch, SAMPLED), 4),  # first tokens, their draws, then as above
    (lambda models, batch: followup_step_reads(models, batch, SAMPLED, q_rows=True), 4),
    (lambda models, batch: followup_step_reads(models, batch, SAMPLED, q_rows=True, on_arrival=True), 2),
], ids=["draft-greedy", "draft-sampled", "verify-greedy", "verify-sampled", "verify-sampled-q-here",
        "follow-up-greedy", "follow-up-sampled", "follow-up-sampled-q-here", "follow-up-judged-on-arrival"])
def test_host_reads_do_not_grow_with_the_batch(models, count, most, monkeypatch):
    # counted as on a GPU, where a read waits for the device: top-p by one sort, no read (on a CPU
    # the filter reads how far each nucleus reaches, which waits on nothing; counted below)
    monkeypatch.setattr(sampling, "HOST_DEVICES", ())
    one, many = count(models, 1), count(models, 8)
    assert many <= most and one <= most, f"{one} host reads at batch 1, {many} at batch 8"


@pytest.mark.parametrize("rows", [1, 16])
def test_top_p_reads_on_a_cpu_are_a_few_a_warp_whatever_its_rows_and_none_elsewhere(rows, monkeypatch):
    flat = torch.randn(rows, 8192) * 0.05  # nuclei past every candidate count: the most reads
    params = SamplingParams(temperature=1.0, top_p=0.9)
    assert host_reads(lambda: warp_probs(flat, params)) == len(sampling.TOP_P_CANDIDATES)
    monkeypatch.setattr(sampling, "HOST_DEVICES", ())
    assert host_reads(lambda: warp_probs(flat, params)) == 0
