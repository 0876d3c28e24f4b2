"""The in-process engine: draft and target in one process, one round at a time.

This is the reference every other mode must match token for token. A round reads as its
algorithm: propose a block, verify it, commit the settled tokens, and let both caches roll back
on the next call to what the committed sequence still shares.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from coordinator.calibration import Calibration, calibrate
from draft_worker.drafter import Drafter, NullDraftSession
from svip_common.contracts import (
    AUTO,
    Block,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Verdict,
)
from svip_common.models import LoadedModel, check_same_vocabulary, pair_limits
from target_worker.verifier import Verifier

# Called after each round with the block, its verdict and the tokens it settled (streaming,
# benchmarks).
OnRound = Callable[[Block, Verdict, list[int]], None]


class SpeculativeEngine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None):
        if draft is not None:
            check_same_vocabulary(target, draft)
        self.target = target
        self.limits = pair_limits(target, draft)
        self.verifier = Verifier(target, self.limits.tokens)
        self.drafter = Drafter(draft, target.vocab_size, self.limits.tokens) if draft is not None else None
        self._calibration: Calibration | None = None

    @property
    def draft_path(self) -> str | None:
        return None if self.drafter is None else self.drafter.draft.path

    def calibration(self) -> Calibration:
        """The pair's learnt SVIP threshold, measured on first use (a few seconds)."""
        if self._calibration is None:
            self._calibration = calibrate(self.target, self.drafter.draft)
        return self._calibration

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """The request as it will run: validated, policy 'none' when there is no draft, and
        threshold 'auto' replaced by the pair's calibrated value."""
        request = request.checked_for(self.drafter is not None, self.limits)
        policy = request.policy
        if policy.threshold == AUTO:
            threshold = self.calibration().threshold_for(policy.entropy_scale) if self.drafter else 0.0
            request = dataclasses.replace(request, policy=dataclasses.replace(policy, threshold=threshold))
        return request

    def generate(self, request: GenerationRequest, on_round: OnRound | None = None) -> GenerationResult:
        request = self.resolve(request)
        stop_ids = request.stop_ids(self.target.eos_token_ids)
        target = self.verifier.open(request.sampling)
        if self.drafter is None or request.policy.name == "none":
            draft = NullDraftSession()
        else:
            draft = self.drafter.open(request.sampling, request.policy, tuple(stop_ids))
        stats = GenerationStats()
        committed, generated = list(request.prompt_ids), []
        start = time.perf_counter()
        finish_reason = None
        while finish_reason is None:
            round_start = time.perf_counter()
            draft_s, target_s = draft.forward_s, target.forward_s
            budget = request.max_new_tokens - len(generated)
            block = draft.propose(committed, budget=budget - 1)
            verdict = target.verify(committed, block)
            draft.feedback(len(block), verdict.accepted)
            settled = [*block.tokens[: verdict.accepted], verdict.token]
            settled, finish_reason = clip_settled(settled, budget, stop_ids)
            committed += settled
            generated += settled
            _record_round(stats, block, verdict.accepted)
            stats.round_s.append(time.perf_counter() - round_start)
            stats.draft_forward_s.append(draft.forward_s - draft_s)
            stats.target_forward_s.append(target.forward_s - target_s)
            if on_round is not None:
                on_round(block, verdict, settled)
        stats.wall_s = time.perf_counter() - start
        stats.draft_forwards, stats.target_forwards = draft.forwards, target.forwards
        return GenerationResult(
            prompt_ids=list(request.prompt_ids),
            token_ids=generated,
            finish_reason=finish_reason,
            stats=stats,
        )


def clip_settled(settled: list[int], budget: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """Cut the settled tokens at the first stop id (kept) or at the token budget."""
    for i, token in enumerate(settled[:budget]):
        if token in stop_ids:
            return settled[: i + 1], "stop"
    if len(settled) >= budget:
        return settled[:budget], "length"
    return settled, None


def _record_round(stats: GenerationStats, block, accepted: int) -> None:
    stats.rounds += 1
    stats.draft_tokens += len(block)
    stats.accepted_tokens += accepted
    stats.draft_lengths.append(len(block))
    stats.accepted_lengths.append(accepted)
    if block.entropies:
        stats.stop_entropies.append(block.entropies[-1])

