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

import collections
import functools
import threading
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


class CompiledGrammars:
    """A process's grammars compiled for a tokenizer, each lexer warmed by a first mask: never moved
    itself, each session takes a copy (``deep_copy``, microseconds), so requests that send the same
    schema (an application's response_format, a tool's parameters) compile it once per worker.
    The last MAX_KEPT that compiled are kept (one in error is not: L-6); a worker compiles a start's
    grammar off its compute thread and holds it (``hold``) until the start is handled, so no other
    compile pushes it out meanwhile. Thread-safe: compiles run on a worker's compile thread."""

    MAX_KEPT = 64

    def __init__(self):
        self._kept: collections.OrderedDict = collections.OrderedDict()  # (grammar, tokenizer) -> matcher
        self._held: dict = {}  # (grammar, tokenizer) -> [matcher, holders]
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (each found again was not)

    def ready(self, grammar: Grammar, tokenizer) -> bool:
        """Whether get() would answer without compiling."""
        with self._lock:
            return (grammar, tokenizer) in self._held or (grammar, tokenizer) in self._kept

    def get(self, grammar: Grammar, tokenizer):
        """The compiled matcher (one in error: the session's start names the problem);
        InvalidRequest where the compiler refuses the grammar outright."""
        key = (grammar, tokenizer)
        with self._lock:
            if key in self._held:
                found = self._held[key][0]
                if isinstance(found, InvalidRequest):
                    raise found
                return found
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        matcher = _compile(grammar, tokenizer)  # outside the lock: a compile takes a while
        self.compiles += 1
        if not matcher.is_error():
            with self._lock:
                self._kept[key] = matcher
                while len(self._kept) > self.MAX_KEPT:
                    self._kept.popitem(last=False)
        return matcher

    def hold(self, grammar: Grammar, tokenizer) -> None:
        """Compile (or find) it and keep it, in error too (its refusal as well), until release()."""
        try:
            matcher = self.get(grammar, tokenizer)
        except InvalidRequest as exc:
            matcher = exc
        with self._lock:
            self._held.setdefault((grammar, tokenizer), [matcher, 0])[1] += 1

    def release(self, grammar: Grammar, tokenizer) -> None:
        with self._lock:
            held = self._held.get((grammar, tokenizer))
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._held[(grammar, tokenizer)]


def _compile(grammar: Grammar, tokenizer):
    from llguidance import LLMatcher

    try:
        compiled = grammar.compiled()
    except (ValueError, RuntimeError) as exc:  # what the compiler refuses before building
        raise InvalidRequest(f"the {grammar.kind} does not compile: {str(exc)[:300]}") from None
    matcher = LLMatcher(tokenizer, compiled, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher


COMPILED = CompiledGrammars()  # the process's: both workers' sessions and the in-process engine's


def compiled_matcher(grammar: Grammar, tokenizer):
    """A grammar compiled for a tokenizer (COMPILED's): what a session copies."""
    return COMPILED.get(grammar, tokenizer)


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
