"""Length policies: when does the draft stop a block?

A policy is a small pure object. ``should_stop(step)`` is asked after each drafted token (the token
that triggers a stop is still sent); ``update(drafted, accepted)`` hears each verdict. The drafter
enforces the hard cap, EOS and max_new_tokens itself, so a policy only says what is its own.
"""

from __future__ import annotations

import math
from typing import Protocol

from svip_common.acceptance import StopRule
from svip_common.contracts import PolicyConfig, StepState
from svip_common.errors import InvalidRequest


class LengthPolicy(Protocol):
    name: str

    def max_length(self) -> int:
        """The longest block this policy may draft now (0: do not draft)."""

    def should_stop(self, step: StepState) -> bool: ...

    def update(self, drafted: int, accepted: int) -> None: ...


def svip_stops(entropy: float, entropy_scale: float, threshold: float) -> bool:
    """SVIP's rule, its one home: stop once sqrt(entropy_scale * H) > threshold (H clamped at 0,
    which a float's rounding can undershoot)."""
    return math.sqrt(entropy_scale * max(entropy, 0.0)) > threshold


class SvipPolicy:
    """SVIP (Zhang et al., 2024): stop once sqrt(entropy_scale * H(q_t)) > threshold."""

    name = "svip"

    def __init__(self, threshold: float, entropy_scale: float, cap: int):
        self.threshold, self.entropy_scale, self.cap = threshold, entropy_scale, cap

    def max_length(self) -> int:
        return self.cap

    def should_stop(self, step: StepState) -> bool:
        return svip_stops(step.entropy, self.entropy_scale, self.threshold)

    def update(self, drafted: int, accepted: int) -> None:
        pass


class ConstantPolicy:
    """Always k tokens (the hard cap still bounds k)."""

    name = "constant"

    def __init__(self, k: int, cap: int):
        self.k, self.cap = k, cap

    def max_length(self) -> int:
        return min(self.k, self.cap)

    def should_stop(self, step: StepState) -> bool:
        return False

    def update(self, drafted: int, accepted: int) -> None:
        pass


class HeuristicPolicy:
    """Hugging Face's schedule: +2 after a fully accepted block, -1 otherwise, floor 1."""

    name = "heuristic"

    def __init__(self, k: int, cap: int):
        self.k, self.cap = k, cap

    def max_length(self) -> int:
        return min(self.k, self.cap)

    def should_stop(self, step: StepState) -> bool:
        return False

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)


class ConfidencePolicy:
    """Stop when the drafted token's probability falls below c."""

    name = "confidence"

    def __init__(self, confidence: float, cap: int):
        self.confidence, self.cap = confidence, cap

    def max_length(self) -> int:
        return self.cap

    def should_stop(self, step: StepState) -> bool:
        return step.prob < self.confidence

    def update(self, drafted: int, accepted: int) -> None:
        pass


class AutoPolicy:
    """Learnt stop (svip_common/acceptance.py): draft one more token while the block's chance of
    surviving to it, times its own predicted acceptance, is at least the rule's stop_at. The rule
    comes from beside the verifier (``tune``) and changes between blocks, never within one."""

    name = "auto"

    def __init__(self, cap: int, rule: StopRule = StopRule()):
        self.cap, self.rule = cap, rule
        self._survival = 1.0

    def tune(self, rule: StopRule) -> None:
        self.rule = rule.check()

    def max_length(self) -> int:
        return self.cap

    def should_stop(self, step: StepState) -> bool:
        if step.index == 1:
            self._survival = 1.0
        rule = self.rule
        self._survival *= rule.accept_prob(step.entropy, step.prob, step.index)
        return self._survival * rule.accept_prob(step.entropy, step.prob, step.index + 1) < rule.stop_at

    def update(self, drafted: int, accepted: int) -> None:
        pass


class NoDraftPolicy:
    """The target alone: no block is ever drafted."""

    name = "none"

    def max_length(self) -> int:
        return 0

    def should_stop(self, step: StepState) -> bool:
        return True

    def update(self, drafted: int, accepted: int) -> None:
        pass


class OraclePolicy:
    """Benchmark ceiling, greedy only: knows the target's continuation and stops a block at the
    first drafted token the target will reject (that token is still sent, as with any policy)."""

    name = "oracle"

    def __init__(self, reference: tuple[int, ...], cap: int):
        self.reference, self.cap = reference, cap

    def max_length(self) -> int:
        return self.cap

    def should_stop(self, step: StepState) -> bool:
        return step.position >= len(self.reference) or step.token_id != self.reference[step.position]

    def update(self, drafted: int, accepted: int) -> None:
        pass


def make_policy(config: PolicyConfig) -> LengthPolicy:
    config.validate()
    cap = config.max_draft_length
    if config.name == "svip":
        if isinstance(config.threshold, str):
            raise InvalidRequest("threshold 'auto' must be resolved for the model pair before drafting")
        return SvipPolicy(config.threshold, config.entropy_scale, cap)
    if config.name == "constant":
        return ConstantPolicy(config.draft_length, cap)
    if config.name == "heuristic":
        return HeuristicPolicy(config.draft_length, cap)
    if config.name == "confidence":
        return ConfidencePolicy(config.confidence, cap)
    if config.name == "auto":
        return AutoPolicy(cap)
    if config.name == "oracle":
        return OraclePolicy(config.oracle_tokens, cap)
    return NoDraftPolicy()
