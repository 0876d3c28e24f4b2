"""The target's hidden states a feature draft reads, kept per session between the forward that
computes them and the verdict that hands them over (with the positions it commits). Runs wherever
the verifier does (target_worker/verifier.py); imports svip_common only."""

from __future__ import annotations

import dataclasses

import torch

from svip_common.contracts import Verdict


class HeldFeatures:
    def __init__(self):
        self.rows: torch.Tensor | None = None  # feature_layers at positions start.. not yet handed over
        self.start = 0
        self.handed = 0  # positions whose features a verdict has handed over (the draft holds them)

    def evicted(self) -> None:
        """The cache is gone (recomputed later): those the draft has already are not handed again."""
        self.rows, self.start = None, self.handed

    def take(self, first: int, features: torch.Tensor) -> None:
        """A forward's features from position ``first`` on (a prefill chunk's, or a block's): kept,
        after those still kept before ``first`` (a chunk continued), until a verdict hands over
        those of committed positions; what was kept from ``first`` on is stale (a rollback)."""
        if first < self.handed:  # recomputed after an eviction: the draft holds these already
            skip = min(self.handed - first, features.shape[0])
            features, first = features[skip:], first + skip
            if not features.shape[0]:
                return
        if self.rows is not None:
            before = first - self.start
            if 0 < before <= self.rows.shape[0]:
                features, first = torch.cat([self.rows[:before], features]), self.start
        self.rows, self.start = features, first

    def hand(self, verdict: Verdict) -> Verdict:
        """The verdict with the features of the positions it leaves committed and computed: up to
        the last accepted drafted token, or a tree's nodes taken after them (the verdict's own
        token has none yet)."""
        taken = verdict.base + verdict.accepted + len(verdict.branch)
        end = -1 if self.rows is None else taken - self.start
        if end <= 0:
            return verdict
        handed, rest, at = self.rows[:end], self.rows[end:], self.start
        self.rows, self.start = (rest if rest.shape[0] else None), at + end
        self.handed = at + end
        return dataclasses.replace(verdict, features=handed, features_from=at)

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a tree's verdict: of the features the step computed (a row per node from ``base``
        on, the tree's layout), those of the accepted path, at its places; the other nodes' go."""
        at = None if self.rows is None else base - self.start
        if at is None or not 0 <= at < len(self.rows):
            return
        nodes = torch.tensor([at + node for node in path], dtype=torch.long, device=self.rows.device)
        self.rows = torch.cat([self.rows[:at], self.rows[nodes]])
