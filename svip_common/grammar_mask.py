"""Structured output's mask (svip_common/grammar.py says what a grammar is): one session's
llguidance matcher, moved to the tokens generated before each row's place, gives the tokens the
grammar allows there; every other column of the row is -inf before anything reads it
(svip_common/row_rules.py applies it beside the request's other rules, on the target's rows and
the draft's alike). The matcher takes a drafted path's tokens as far as the grammar allows and
rolls back to a shorter path's prefix, so one matcher serves every row of a block, a tree's
nodes and a worker's side-by-side continuations in turn.

A row after a token the grammar refuses is never read: that token's own place masks it out, so
the target rejects it there (greedy: its choice is an allowed token; sampled: p of it is 0), and
nothing after a rejected place settles. Such a row keeps the mask of its longest allowed prefix.
Runs on the thread that owns the session (a worker's compute thread)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar
from svip_common.sequences import common_prefix


@functools.lru_cache(maxsize=8)
def grammar_tokenizer(tokenizer, width: int):
    """llguidance's view of a Hugging Face tokenizer (its vocabulary, its EOS), built once per
    model (cached by the tokenizer object): what a session's matcher needs. width: the model's
    logits (ids past the tokenizer's are padding, never allowed)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=min(len(tokenizer), width))


@functools.lru_cache(maxsize=64)
def compiled_matcher(grammar: Grammar, tokenizer):
    """A grammar compiled for a tokenizer, its lexer warmed by a first mask: never moved itself,
    each session takes a copy (``deep_copy``, microseconds), so requests that send the same
    schema (an application's response_format, a tool's parameters) compile it once per worker,
    not once per session on the step that opens it."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar.compiled(), log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher


class GrammarMask:
    """One session's grammar: the tokens allowed after any path of generated tokens."""

    def __init__(self, grammar: Grammar, tokenizer):
        self._matcher = compiled_matcher(grammar, tokenizer).deep_copy()
        if self._matcher.is_error():
            raise InvalidRequest(f"the {grammar.kind} does not compile: {self._matcher.get_error()[:300]}")
        self._eos = list(tokenizer.eos_tokens)
        self._vocab = tokenizer.vocab_size
        self._taken: list[int] = []  # the tokens the matcher has consumed

    def allowed(self, generated: Sequence[int], width: int, device) -> torch.Tensor:
        """bool [width]: the tokens the grammar allows after ``generated`` (after its longest
        allowed prefix, when a token of it is refused). None allowed (past the grammar's end with
        its EOS taken): the EOS alone, so a row always keeps a token."""
        self._move_to(generated)
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        mask = torch.zeros(width, dtype=torch.bool)
        n = min(self._vocab, width)
        mask[:n] = bits.reshape(-1)[:n].bool()
        if not mask.any():
            mask[[t for t in self._eos if t < width]] = True
        return mask.to(device)

    def _move_to(self, generated: Sequence[int]) -> None:
        taken = self._taken
        common = common_prefix(taken, generated)
        if common < len(taken):
            self._matcher.rollback(len(taken) - common)
            del taken[common:]
        rest = list(generated[common:])
        if rest:
            ok = self._matcher.validate_tokens(rest)
            if ok and self._matcher.consume_tokens(rest[:ok]):
                taken += rest[:ok]
