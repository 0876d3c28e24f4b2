"""Load-aware speculation on the target side, for one session (svip_common/step_cost.py says what
pays): the cap its draft's next blocks get at the target's load now and, while the session is
paused (a cap of 0), the tokens the target settles alone, which the Resume hands the draft.
Decides nothing about the round: SessionPipeline says when it pauses and resumes;
tests/unit/test_session_parts.py drives it without models."""

from __future__ import annotations

from collections.abc import Callable

import torch

from svip_common.acceptance import StopRule
from svip_common.contracts import GenerationStats
from svip_common.messages import Resume
from svip_common.step_cost import SessionGate

LoadCap = Callable[[SessionGate], int]  # the most tokens the session's next block should hold at the load now


class LoadPause:
    def __init__(self, load_cap: LoadCap | None, gate: SessionGate, stats: GenerationStats):
        """load_cap: None when the policy drafts as configured at any load."""
        self.load_cap, self.gate, self.stats = load_cap, gate, stats
        self.settled: list[int] = []  # settled by the target alone since the pause
        self._features: list[torch.Tensor] = []  # a feature draft's: the target's features since, in order
        self._features_from = 0

    def cap(self) -> int | None:
        """The most tokens the next block should hold (None: no cap; 0: drafting does not pay)."""
        return None if self.load_cap is None else self.load_cap(self.gate)

    def pause(self) -> None:
        self.settled, self._features = [], []
        self.stats.pauses += 1

    def settle(self, tokens: list[int], features: torch.Tensor | None = None, features_from: int = 0) -> None:
        """Tokens the target settled alone while paused (the draft learns them on resume), and a
        feature draft's features that their verdict handed over (the draft gets them too)."""
        self.settled += tokens
        if features is not None:
            if not self._features:
                self._features_from = features_from
            self._features.append(features)

    def resume(self, session_id: str, epoch: int, committed: int, cap: int, stop_rule: StopRule | None) -> Resume:
        """The Resume that hands the draft what was settled since the pause, from where its own
        tokens end (committed: the session's tokens now)."""
        features = torch.cat(self._features) if self._features else None
        resume = Resume(session_id, epoch, committed - len(self.settled), tuple(self.settled), cap, stop_rule,
                        features, self._features_from)
        self.settled, self._features = [], []
        return resume

    def forget(self) -> None:
        """The session detached: the draft that was paused is gone."""
        self.settled, self._features = [], []
