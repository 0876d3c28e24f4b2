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
judged, stored or warped; the draft, draft_worker/drafter.py, before it chooses)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from svip_common.contracts import SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.grammar_mask import GrammarMask
from svip_common.sampling import add_bias


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

    @classmethod
    def of(cls, sampling: SamplingParams, prompt_len: int, stop_ids: frozenset[int], tokenizer=None) -> RowRules:
        """tokenizer: llguidance's (grammar_mask.grammar_tokenizer), for a request with a grammar."""
        grammar = None
        if sampling.grammar is not None:
            if tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer, and this model has none")
            grammar = GrammarMask(sampling.grammar, tokenizer)
        return cls(prompt_len, sampling.logit_bias, sampling.presence_penalty, sampling.frequency_penalty,
                   sampling.min_tokens, frozenset(stop_ids), sampling.repetition_penalty, grammar)

    @property
    def by_place(self) -> bool:
        """Some rule reads the tokens before a row's place (``apply``'s ``before``)."""
        return bool(self.presence or self.frequency or (self.min_tokens and self.stop_ids) or self.repetition != 1.0
                    or self.grammar is not None)

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.by_place

    def apply(self, rows: torch.Tensor, before: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        """rows [n, width], row r the logits for the place after the tokens ``before[r]`` (the
        whole sequence up to it, prompt included; read only when ``by_place``): the rows
        themselves when no rule applies, else a new tensor with the rules applied."""
        out = add_bias(rows, self.bias)
        if not self.by_place:
            return out
        out = out.clone() if out is rows else out
        width = rows.shape[-1]
        for r, tokens in enumerate(before):
            if self.repetition != 1.0 and tokens:
                seen = torch.tensor(sorted({t for t in tokens if t < width}), dtype=torch.long, device=rows.device)
                values = out[r, seen]
                out[r, seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
            generated = tokens[self.prompt_len:]
            if generated and (self.presence or self.frequency):
                counts = torch.bincount(torch.tensor(generated, dtype=torch.long, device=rows.device), minlength=width)
                counts = counts[:width].to(rows.dtype)
                out[r] -= self.frequency * counts + self.presence * (counts > 0).to(rows.dtype)
            if len(generated) < self.min_tokens and self.stop_ids:
                out[r, [t for t in self.stop_ids if t < width]] = float("-inf")
            if self.grammar is not None:
                out[r].masked_fill_(~self.grammar.allowed(generated, width, rows.device), float("-inf"))
        return out
