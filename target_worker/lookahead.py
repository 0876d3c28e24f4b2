"""Rows a target forward stores past the next place: the tokens fed after a greedy chain (its
follow-up, as the target held it when the chain's forward began) and the row at each. A follow-up
that begins with those tokens is judged by them, no forward of its own where they reach past it
(target_worker/verifier.py). Runs wherever the verifier does; imports svip_common only."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from svip_common.rejection import accept_greedy
from svip_common.sequences import common_prefix


@dataclass
class Lookahead:
    """The tokens fed after a block and the row at each (the place after it), with its argmax.
    They hold while the sequence is the committed tokens and then these."""

    tokens: tuple[int, ...]
    rows: torch.Tensor  # [len(tokens), vocab]
    choices: list[int] = dataclasses.field(default_factory=list)  # each row's argmax

    def after(self, n: int) -> Lookahead | None:
        """What is left once the first n fed tokens are committed."""
        return Lookahead(self.tokens[n:], self.rows[n:], self.choices[n:]) if n < len(self.tokens) else None


def judged(tokens: Sequence[int], choices: Sequence[int], fed: Sequence[int]) -> int | None:
    """Greedy, by stored rows: choices[i] is the target's token at the block's place i, read from
    a row that holds while the block's tokens before it are ``fed``'s. Returns the tokens accepted
    where the rows decide the block (a rejection among them, or every token judged, the row after
    the last one stored too), else None: a forward judges the rest."""
    reach = 1 + common_prefix(tokens, fed)  # the places whose rows hold for this block
    accepted = accept_greedy(choices, tokens[:reach])
    return accepted if accepted < min(reach, len(tokens)) or len(tokens) < reach else None
