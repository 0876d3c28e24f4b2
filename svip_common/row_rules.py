"""What a request changes in a row of logits before anything reads it: its logit_bias (every place
alike, sampling.add_bias), the repetition penalty over every token before the place, the prompt's
included (vLLM's and transformers': a seen token's logit divided by it where positive, multiplied
where negative), then OpenAI's presence and frequency penalties over the tokens generated before
the place, min_tokens (the request's stop ids cannot be chosen before it has that many), and a
grammar (structured output: what it does not allow after the tokens generated before the place
is -inf; svip_common/grammar_mask.py). A verification judges several places at once, so each row
is adjusted by the tokens before its own place: the committed ones and the drafted path up to it
(a tree's node: its ancestors), as the target decoding alone would have them there. Greedy output
then equals the target alone's with the same knobs, and sampled output follows its distribution,
whatever the draft proposed (target_worker/verifier.py applies them to every row before it is
judged, stored or warped; the draft, draft_worker/drafter.py, before it chooses).

What a row costs is its path, not the context (review M-2: rebuilding from the whole sequence for
every row of every block cost 35 ms of host time a session-step at an 18k context): a session's
``RunningCounts`` keep, on the rows' device, how often each token occurs in the committed tokens and
in their generated part, updated by what changed since the last call (tokens appended, or a
speculative tail rolled back); each row adds its own path's tokens, and every rule is applied to
all rows at once (the grammar's mask, a matcher's walk, row by row)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from svip_common.contracts import SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.grammar_mask import GrammarMask
from svip_common.sampling import add_bias
from svip_common.sequences import common_prefix


class RunningCounts:
    """How often each token id occurs in a session's committed tokens (all, and their generated
    part), over a row's width on a device; ``sync`` brings them to the committed tokens of a call
    by what changed since the last one (on a worker's compute thread, one session's)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.tokens: list[int] = []  # the committed tokens counted
        self.every: torch.Tensor | None = None  # float [width]: each id's count in them
        self.generated: torch.Tensor | None = None  # float [width]: in those past the prompt

    def sync(self, committed: Sequence[int], width: int, device) -> None:
        if self.every is None or self.every.shape[0] != width or self.every.device != torch.device(device):
            self.tokens = []
            self.every = torch.zeros(width, device=device)
            self.generated = torch.zeros(width, device=device)
        keep = common_prefix(self.tokens, committed)
        self._count(keep, self.tokens[keep:], -1.0)
        self._count(keep, committed[keep:], 1.0)
        self.tokens = list(committed)

    def _count(self, first: int, tokens: Sequence[int], sign: float) -> None:
        """Add (sign 1) or take away (-1) tokens that stand from position ``first`` on."""
        width = self.every.shape[0]
        kept = [t for t in tokens if t < width]
        if kept:
            self.every.index_add_(0, _ids(kept, self.every.device), torch.full((len(kept),), sign,
                                                                                 device=self.every.device))
        generated = [t for t in tokens[max(0, self.prompt_len - first):] if t < width]
        if generated:
            self.generated.index_add_(0, _ids(generated, self.every.device),
                                      torch.full((len(generated),), sign, device=self.every.device))


@dataclass(frozen=True)
class RowRules:
    prompt_len: int  # tokens before the first generated one
    bias: tuple[tuple[int, float], ...] = ()  # logit_bias: (token id, bias) pairs
    presence: float = 0.0
    frequency: float = 0.0
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    repetition: float = 1.0
    grammar: GrammarMask | None = None  # structured output: this session's matcher
    counts: RunningCounts | None = field(default=None, compare=False)  # the session's (made by ``of``)

    @classmethod
    def of(cls, sampling: SamplingParams, prompt_len: int, stop_ids: frozenset[int], tokenizer=None) -> RowRules:
        """tokenizer: llguidance's (grammar_mask.grammar_tokenizer), for a request with a grammar."""
        grammar = None
        if sampling.grammar is not None:
            if tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer, and this model has none")
            grammar = GrammarMask(sampling.grammar, tokenizer)
        return cls(prompt_len, sampling.logit_bias, sampling.presence_penalty, sampling.frequency_penalty,
                   sampling.min_tokens, frozenset(stop_ids), sampling.repetition_penalty, grammar,
                   RunningCounts(prompt_len))

    @property
    def by_place(self) -> bool:
        """Some rule reads the tokens before a row's place (``apply``'s ``committed`` and ``paths``)."""
        return bool(self.presence or self.frequency or (self.min_tokens and self.stop_ids) or self.repetition != 1.0
                    or self.grammar is not None)

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.by_place

    def apply(self, rows: torch.Tensor, committed: Sequence[int] = (), paths: Sequence[Sequence[int]] = ()
              ) -> torch.Tensor:
        """rows [n, width], row r the logits for the place after ``committed`` + ``paths[r]`` (the
        whole sequence up to it, prompt included: the committed tokens, then the drafted path to
        the row; read only when ``by_place``): the rows themselves when no rule applies, else a new
        tensor with the rules applied."""
        out = add_bias(rows, self.bias)
        if not self.by_place:
            return out
        out = out.clone() if out is rows else out
        width, device = rows.shape[-1], rows.device
        counts = self.counts if self.counts is not None else RunningCounts(self.prompt_len)
        counts.sync(committed, width, device)
        skip = max(0, self.prompt_len - len(committed))  # a path's tokens still in the prompt, if any
        if self.repetition != 1.0:
            out = self._repeat(out, counts.every, _cells(paths, 0, width, device))
        if self.presence or self.frequency:
            out = self._penalise(out, counts.generated, _cells(paths, skip, width, device))
        lengths = [max(0, len(committed) - self.prompt_len) + max(0, len(path) - skip) for path in paths]
        if self.min_tokens and self.stop_ids:
            early = [r for r, n in enumerate(lengths) if n < self.min_tokens]
            stops = [t for t in self.stop_ids if t < width]
            if early and stops:
                out[_ids(early, device)[:, None], _ids(stops, device)[None, :]] = float("-inf")
        if self.grammar is not None:
            before = list(committed[self.prompt_len:])
            for r, path in enumerate(paths):
                out[r].masked_fill_(~self.grammar.allowed(before + list(path[skip:]), width, device), float("-inf"))
        return out

    # Each rule over every row from the committed tokens' counts, then again at the cells a row's own
    # path adds to, from those cells' values before the rule: the same elementwise operations on
    # the same (whole) counts as a row computed from its whole sequence, so a place's row has the
    # same bits whichever of its tokens were committed and which drafted (greedy exactness rests on it).

    def _repeat(self, out: torch.Tensor, every: torch.Tensor, cells) -> torch.Tensor:
        """The repetition penalty: a seen token's logit divided by it where positive, else multiplied."""
        def penalised(x):
            return torch.where(x > 0, x / self.repetition, x * self.repetition)

        before = out[cells.rows, cells.ids] if cells is not None else None
        out = torch.where(every > 0, penalised(out), out)
        if cells is not None:  # a path's token the committed ones do not hold: seen in that row alone
            held = every[cells.ids] > 0
            out[cells.rows, cells.ids] = torch.where(held, out[cells.rows, cells.ids], penalised(before))
        return out

    def _penalise(self, out: torch.Tensor, generated: torch.Tensor, cells) -> torch.Tensor:
        """OpenAI's frequency and presence penalties over the generated tokens' counts."""
        def penalty(counts):
            counts = counts.to(out.dtype)
            return self.frequency * counts + self.presence * (counts > 0).to(out.dtype)

        before = out[cells.rows, cells.ids] if cells is not None else None
        out = out - penalty(generated)
        if cells is not None:
            out[cells.rows, cells.ids] = before - penalty(generated[cells.ids] + cells.counts)
        return out


@dataclass(frozen=True)
class _Cells:
    """Each row's own path tokens, one cell per (row, id), with how often the path holds it."""

    rows: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


def _cells(paths: Sequence[Sequence[int]], skip: int, width: int, device) -> _Cells | None:
    counted: dict[tuple[int, int], int] = {}
    for r, path in enumerate(paths):
        for t in path[skip:]:
            if t < width:
                counted[(r, t)] = counted.get((r, t), 0) + 1
    if not counted:
        return None
    return _Cells(_ids([r for r, _ in counted], device), _ids([t for _, t in counted], device),
                  torch.tensor(list(counted.values()), dtype=torch.float32, device=device))


def _ids(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
