"""The types every part of the system speaks: request parameters, the draft block, the target's
verdict, the per-step state a length policy sees, and the result of a generation.

Words (see docs/architecture.md): *committed* tokens are settled by the target and never change; a *block* is
a run of draft tokens proposed on a committed prefix of length ``base``; a *verdict* says how many
of them the target accepted and which token resolves the next position (a *correction* after a
rejection, a *bonus* after full acceptance).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar
from svip_common.trees import check_tree

if TYPE_CHECKING:  # tensors ride on blocks and verdicts; the CLI reads this module without loading torch
    import torch

POLICY_NAMES = ("auto", "svip", "constant", "heuristic", "confidence", "none")
INT32_MAX = 2**31 - 1  # integer fields travel as int32
DRAFT_LENGTH_CAP = 64  # default cap on draft_length / max_draft_length (a deployment may change it)
# speculative blocks an async session drafts side by side (the follow-up and prepared continuations): they ride
# one batched draft forward, nearly free while it is memory-bound; how many are worth it the draft worker learns
# (a row's price, draft_worker/service.py), these are the caps. 8B/1B on H100s, one session, simulated: 8 -> 16
# with the learnt price took async from 1.39x to 1.48x the in-process pair (docs/benchmarks.md)
DRAFT_PARALLEL = 16
PREPARED_PER_BLOCK = 8  # prepared continuations per outstanding block (and for a follow-up's first token) at most
MAX_DRAFT_PARALLEL = 16  # a deployment's bound on them (each side-by-side block holds forked KV pages)
MAX_CHOICES = 8  # a request's n at most: each choice is a session (a place in the batch, its pages past the prompt)
GREEDY_BELOW = 1e-5  # temperatures under this are greedy: 1/T overflows and the warped q turns NaN
AUTO = "auto"  # threshold learnt for the model pair (coordinator/calibration.py)
MAX_LOGIT_BIAS = 300  # a request's logit_bias entries at most (OpenAI's bound)
MAX_LOGPROBS = 20  # a request's top alternatives per settled token at most (OpenAI's bound)
MAX_CACHE_SCOPE = 128  # a cache scope's characters at most (the server sends a 64-character digest)
MAX_STOP_TOKEN_IDS = 64  # a request's stop_token_ids at most (each ends its output, as the model's EOS)
PENALTY_BOUND = 2.0  # presence and frequency penalties in [-2, 2] (OpenAI's); repetition_penalty in (0, 2]
LOGIT_BIAS_BOUND = 100.0  # each bias in [-100, 100] (OpenAI's): -100 bans a token, +100 all but forces it
ORACLE = "oracle"  # benchmark-only ceiling: needs the target's own greedy continuation


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int = 0
    # added to the target's logits (and the draft's) at these ids before anything reads them:
    # (token id, bias) pairs, ids distinct (svip_common/sampling.py: add_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties over the tokens generated before each place (not the prompt's), and
    # min_tokens: the request's stop ids (EOS included) cannot be chosen before it has this many
    # (svip_common/row_rules.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    # vLLM's and transformers': a token in the prompt or generated before the place has its logit
    # divided by this where positive, multiplied where negative (1: off; > 1 discourages repeats)
    repetition_penalty: float = 1.0
    # structured output: the tokens must follow this grammar (svip_common/grammar.py): every row, the
    # target's and the draft's, masked to what it allows after the tokens generated before the place
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def warp_key(self) -> tuple[float, int, float]:
        """Requests with equal keys warp logits alike (greedy: a plain softmax, whatever else is
        set), so their rows can be warped in one batched call."""
        return (0.0, 0, 1.0) if self.greedy else (self.temperature, self.top_k, self.top_p)

    def validate(self, compile_grammar: bool = True) -> None:
        """compile_grammar False: a grammar's bounds alone (a worker reading the wire builds its
        matcher off its compute thread, and a grammar that does not compile fails its session)."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise InvalidRequest(f"top_k must be in [0, 2^31) (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be in [0, 2^63), got {self.seed}")
        self._validate_bias()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= PENALTY_BOUND):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise InvalidRequest(f"min_tokens must be in [0, 2^31), got {self.min_tokens}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= PENALTY_BOUND):
            raise InvalidRequest(f"repetition_penalty must be in (0, 2] (1 disables it), got {self.repetition_penalty}")
        if self.grammar is not None:
            self.grammar.validate() if compile_grammar else self.grammar.check_bounds()

    def _validate_bias(self) -> None:
        """At most MAX_LOGIT_BIAS entries, distinct ids in [0, 2^31), each bias a finite number in
        [-LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND] (ids against the vocabulary: GenerationRequest.validate)."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("logit_bias names a token id twice")
        for token, bias in self.logit_bias:
            if not 0 <= token <= INT32_MAX:
                raise InvalidRequest(f"logit_bias token id {token} is outside [0, 2^31)")
            if not (math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_BOUND):
                raise InvalidRequest(f"logit_bias for token {token} must be in [-100, 100], got {bias}")


@dataclass(frozen=True)
class PolicyConfig:
    """Which length policy drafts a block, and its knobs (unused knobs are ignored)."""

    name: str = "auto"  # the default: a stop learnt for the pair (svip: the paper's rule, as published)
    threshold: float | str = 0.3  # svip: stop once sqrt(entropy_scale * H) > threshold; or "auto"
    entropy_scale: float = 0.15
    draft_length: int = 5  # constant: k; heuristic: the starting k
    max_draft_length: int = 40  # hard cap on any block
    confidence: float = 0.4  # confidence: stop when q(drafted token) < confidence
    oracle_tokens: tuple[int, ...] = ()  # oracle: prompt + the target's greedy continuation
    tree: str = "off"  # "cape": each block a token tree, CaPE's siblings at each drafted place (svip_common/trees.py)

    def validate(self, cap: int = DRAFT_LENGTH_CAP) -> None:
        """cap: the longest block this deployment drafts; draft_length and max_draft_length beyond it are refused."""
        if self.name == ORACLE and not self.oracle_tokens:
            raise InvalidRequest("the oracle policy needs the target's greedy continuation")
        if self.name not in POLICY_NAMES and self.name != ORACLE:
            raise InvalidRequest(
                f"unknown policy {self.name!r}; choose one of {', '.join(POLICY_NAMES)}"
            )
        if isinstance(self.threshold, str):
            if self.threshold != AUTO:
                raise InvalidRequest(f"threshold must be a number >= 0 or 'auto', got {self.threshold!r}")
        elif not math.isfinite(self.threshold) or self.threshold < 0:
            raise InvalidRequest(f"threshold must be a number >= 0 or 'auto', got {self.threshold}")
        if not math.isfinite(self.entropy_scale) or self.entropy_scale <= 0:
            raise InvalidRequest(f"entropy_scale must be > 0, got {self.entropy_scale}")
        if not 1 <= self.draft_length <= cap:
            raise InvalidRequest(f"draft length must be in [1, {cap}], got {self.draft_length}")
        if not 1 <= self.max_draft_length <= cap:
            raise InvalidRequest(f"max draft length must be in [1, {cap}], got {self.max_draft_length}")
        if not (0.0 <= self.confidence <= 1.0):
            raise InvalidRequest(f"confidence must be in [0, 1], got {self.confidence}")
        check_tree(self.tree)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a deployment: ids its models all embed, their shortest
    context, and the cap on any block."""

    tokens: int  # valid ids are [0, tokens): the tokenizer's and every model's embedding
    positions: int | None  # context length (None: the configs state none)
    max_draft_length: int = DRAFT_LENGTH_CAP
    kv_tokens: int | None = None  # the KV pool: no session may need more (None: not known here)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    policy: PolicyConfig = PolicyConfig()
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation, besides the model's EOS
    ignore_eos: bool = False  # generate to max_new_tokens through the model's EOS (benchmarks)
    logprobs: int | None = None  # each settled token's log-probability and this many top ones (None: none)
    prompt_logprobs: bool = False  # each prompt token's too (after the first), from the prompt's prefill
    # sessions share KV pages only with sessions of the same scope (svip_common/prompt_sharing.py): the
    # server's is a digest of the API key (or the request, where the API is open) and the request's
    # cache_salt; "" is one user's (the CLI, the in-process engine)
    cache_scope: str = ""

    def checked_for(self, has_draft: bool, limits: Limits) -> GenerationRequest:
        """This request validated against a deployment, with policy 'none' when no draft is loaded."""
        request = self
        if not has_draft and self.policy.name != "none":
            request = dataclasses.replace(self, policy=dataclasses.replace(self.policy, name="none"))
        request.validate(limits)
        return request

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The ids that end this request's output."""
        eos = () if self.ignore_eos else eos_token_ids
        return frozenset(eos) | frozenset(self.stop_token_ids)

    def validate(self, limits: Limits) -> None:
        check_prompt_ids(self.prompt_ids, limits.tokens)
        check_length(len(self.prompt_ids), self.max_new_tokens, limits.positions, limits.kv_tokens)
        self.sampling.validate()
        check_token_ids([token for token, _ in self.sampling.logit_bias], limits.tokens, "logit_bias token id")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{len(self.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}")
        check_token_ids(self.stop_token_ids, limits.tokens, "stop token id")
        check_logprobs(self.logprobs, self.prompt_logprobs)
        check_cache_scope(self.cache_scope)
        self.policy.validate(limits.max_draft_length)
        if self.policy.name == ORACLE and not self.sampling.greedy:
            raise InvalidRequest("the oracle policy is defined for greedy decoding only")


def check_cache_scope(scope: str) -> None:
    """A session's sharing scope: a string of at most MAX_CACHE_SCOPE characters."""
    if not isinstance(scope, str) or len(scope) > MAX_CACHE_SCOPE:
        shown = f"{len(scope)} characters" if isinstance(scope, str) else repr(type(scope).__name__)
        raise InvalidRequest(f"cache_scope must be a string of at most {MAX_CACHE_SCOPE} characters, got {shown}")


def check_logprobs(top: int | None, prompt_logprobs: bool = False) -> None:
    """A request's logprobs: None, or the top alternatives' count in [0, MAX_LOGPROBS]; the
    prompt's only with them."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per token), "
                             f"got {top!r}")
    if prompt_logprobs and top is None:
        raise InvalidRequest("prompt_logprobs needs logprobs (the top alternatives' count)")


@dataclass(frozen=True)
class TokenLogprob:
    """A settled token's log-probability under the target, and its place's top alternatives
    (target_worker/logprobs.py says which distribution)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), likeliest first


def check_token_ids(ids, limit: int, what: str = "token id") -> None:
    """Every id in [0, limit): an InvalidRequest that names the first one outside, never an index error."""
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        raise InvalidRequest(f"{what} {bad} is outside the vocabulary [0, {limit})")


def check_prompt_ids(ids, limit: int) -> None:
    if not ids:
        raise InvalidRequest("prompt is empty")
    check_token_ids(ids, limit, "prompt token id")


def check_length(prompt_tokens: int, max_new_tokens: int, positions: int | None, kv_tokens: int | None = None) -> None:
    """max_new_tokens in [1, 2^31) and the prompt plus it within the context and the KV pool."""
    if not 1 <= max_new_tokens <= INT32_MAX:
        raise InvalidRequest(f"max_new_tokens must be in [1, 2^31), got {max_new_tokens}")
    if positions is not None and prompt_tokens + max_new_tokens > positions:
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens})"
            f" exceeds the model's context of {positions} tokens"
        )
    if kv_tokens is not None and prompt_tokens + max_new_tokens > kv_tokens:
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) does not fit the KV cache of "
            f"{kv_tokens} tokens"
        )


@dataclass(frozen=True)
class StepState:
    """What a length policy sees after the draft picked one token of the block."""

    index: int  # 1-based: how many tokens the block holds, this one included
    position: int  # the token's absolute position in the sequence (prompt included)
    token_id: int
    prob: float  # q(token) under the distribution the token was drawn from
    entropy: float  # H in nats: of softmax(raw logits) when greedy, of the warped q when sampling


@dataclass
class Block:
    """Draft tokens proposed after the first ``base`` committed tokens."""

    base: int
    tokens: list[int]
    probs: list[float]  # q(d_i) for each drafted token
    entropies: list[float]
    q_rows: torch.Tensor | None = None  # [k, vocab] warped q, kept on the draft side (sampling)
    epoch: int = 0
    # a token tree (svip_common/trees.py): per drafted place, the siblings of its token there (None: a chain)
    siblings: list[list[int]] | None = None
    # trees deep and deep-auto: nodes grown below the siblings, (parent node, token) each, after the siblings
    grown: list[tuple[int, int]] | None = None

    @property
    def is_tree(self) -> bool:
        """It has siblings to verify (a tree whose places kept none is verified as the chain it is)."""
        return bool(self.siblings) and any(self.siblings)

    @property
    def nodes(self) -> int:
        """The tokens the target verifies: the drafted ones, their siblings and the nodes grown below those."""
        return len(self.tokens) + (sum(map(len, self.siblings)) if self.siblings else 0) + len(self.grown or ())

    def __len__(self) -> int:
        return len(self.tokens)

    def after(self, keep: int) -> Block:
        """Its tokens past its first ``keep``, with their q and entropies (and a tree's siblings at
        each place), as a block of their own (its base that many places on, its epoch). Not a
        tree with nodes grown below its siblings: they hang from the places cut off."""
        if self.grown:
            raise ValueError(f"cut a tree with {len(self.grown)} nodes grown below its siblings")
        siblings = None if self.siblings is None else [list(s) for s in self.siblings[keep:]]
        return Block(base=self.base + keep, tokens=self.tokens[keep:], probs=self.probs[keep:],
                     entropies=self.entropies[keep:], epoch=self.epoch, siblings=siblings)

    def keep_first(self, n: int) -> None:
        """It ends after its first ``n`` places, in place: the rest go, with their q, entropies,
        q rows and a tree's siblings. Not a tree with nodes grown below its siblings."""
        if self.grown:
            raise ValueError(f"cut a tree with {len(self.grown)} nodes grown below its siblings")
        del self.tokens[n:], self.probs[n:], self.entropies[n:]
        if self.siblings is not None:
            del self.siblings[n:]
        if self.q_rows is not None:
            self.q_rows = self.q_rows[:n]


NO_TOKEN = -1


@dataclass(frozen=True)
class Verdict:
    """The target's answer to a block: ``accepted`` drafted tokens, then ``token`` settles the next
    position (a correction if accepted < len(block), else a bonus). ``token`` is NO_TOKEN when
    the correction is left to the draft side, which holds q: then ``p_row`` is the target's
    warped p at the rejected position, [vocab]. A tree block's verdict may take a sibling at the
    rejected place and nodes grown below it (``branch``): then ``token`` settles the place after them."""

    base: int
    accepted: int
    token: int
    epoch: int = 0
    branch: tuple[int, ...] = ()  # a tree: the tokens settled from place base + accepted on, off the spine
    p_row: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # a feature draft's input (the verifier's feature_layers): the target's hidden states at
    # positions features_from.. that this verdict leaves committed, [n, layers x hidden]
    features: torch.Tensor | None = field(default=None, compare=False, repr=False)
    features_from: int = -1


ROUND_PARTS = ("draft_forward_s", "target_forward_s", "block_transit_s", "target_queue_s", "feedback_transit_s",
               "draft_queue_s", "overhead_s")  # the per-round breakdown (distributed mode)


@dataclass
class GenerationStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    stop_entropies: list[float] = field(default_factory=list)  # entropy of each block's last token
    target_forwards: int = 0
    draft_forwards: int = 0
    wall_s: float = 0.0
    round_s: list[float] = field(default_factory=list)  # per round: since the previous verdict
    draft_forward_s: list[float] = field(default_factory=list)  # per round: the draft's compute on the critical path
    target_forward_s: list[float] = field(default_factory=list)  # per round
    # distributed mode only; per round (a round's transit and queueing on the wire and threads):
    # draft done -> block at the target (serialize, wire, parse)
    block_transit_s: list[float] = field(default_factory=list)
    target_queue_s: list[float] = field(default_factory=list)  # block at the target -> verification starts
    feedback_transit_s: list[float] = field(default_factory=list)  # feedback sent -> at the draft
    draft_queue_s: list[float] = field(default_factory=list)  # feedback at the draft -> drafting starts
    overhead_s: list[float] = field(default_factory=list)  # round_s minus the forwards on its critical path
    round_sources: list[str] = field(default_factory=list)  # "first", "followup" / "prepared" (ready at the
    # verdict before it: no round trip), "drafted" (after that verdict's feedback), "none" (target alone),
    # "paused" (load-aware: the target alone while drafting does not pay), "filled" (the target's own token
    # while the session waited on its draft's block)
    discarded_tokens: int = 0  # pre-drafted tokens never verified (stale, or prepared and not used)
    tree_nodes: int = 0  # token trees: the nodes verified, drafted tokens, siblings and nodes grown below them
    branches: int = 0  # rounds where a sibling covered the rejected place (one more token settled)
    branch_tokens: int = 0  # tokens those rounds settled off the spine: the siblings, and nodes grown below them
    prepared_sent: int = 0  # prepared continuations that reached the target in time
    prepared_used: int = 0  # of them, verified with no round trip
    prepared_used_late: int = 0  # prepared continuations the draft sent (or finished) as the next block, late
    pauses: int = 0  # load-aware: times drafting paused because it no longer paid at the target's load
    # recovery (distributed): the session outlived a worker (coordinator/session/pipeline.py,
    # coordinator/distributed.py)
    detached: int = 0  # times it went on without its draft (the draft lost, or stalled past its deadline)
    reattached: int = 0  # times a draft took it up again from its committed tokens
    target_restarts: int = 0  # times it was started again on a replaced target worker
    reprefilled_tokens: int = 0  # tokens prefilled again there (prompt + what had settled)
    recover_s: float = 0.0  # time from a target worker's loss to the session going on
    draft_busy_s: float = 0.0
    target_busy_s: float = 0.0
    both_busy_s: float = 0.0  # overlap: draft and target computing at once
    draft_wait_s: float = 0.0  # bubbles: wall time the draft was idle
    target_wait_s: float = 0.0
    wire_bytes: int = 0  # this session's messages between the workers, both directions
    wire_bytes_per_round: float = 0.0
    timeline: list[tuple[str, float, float]] = field(default_factory=list)  # (worker, start, end), s from start

    def record_tree(self, nodes: int, branch: int) -> None:
        """A tree block's nodes (its drafted tokens, their siblings, the nodes grown below them), and
        the tokens its verdict took off the spine (0: none)."""
        self.tree_nodes += nodes
        self.branches += branch > 0
        self.branch_tokens += branch

    def record_round(self, drafted: int, accepted: int, stop_entropy: float | None) -> None:
        """A verified block: its length, what was accepted, the entropy where drafting stopped."""
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.draft_lengths.append(drafted)
        self.accepted_lengths.append(accepted)
        if stop_entropy is not None:
            self.stop_entropies.append(stop_entropy)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    def breakdown(self) -> dict[str, float]:
        """Median per round of each part of a round, in seconds (the parts measured)."""
        return {key: statistics.median(getattr(self, key)) for key in ("round_s", *ROUND_PARTS) if getattr(self, key)}

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("round_s", "stop_entropies", *ROUND_PARTS):
            out[key] = [round(x, 6) for x in out[key]]
        out["timeline"] = [(w, round(a, 6), round(b, 6)) for w, a, b in self.timeline]
        out["wall_s"] = round(self.wall_s, 6)
        out["acceptance_rate"] = round(self.acceptance_rate, 6)
        out["mean_acceptance_length"] = round(self.mean_acceptance_length, 6)
        out["breakdown"] = {k: round(v, 6) for k, v in self.breakdown().items()}
        return out


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" (EOS / stop id), "length", or "error" (one of a batch failed on its own)
    stats: GenerationStats
    error: str | None = None  # with finish_reason "error": what failed (the batch's other requests went on)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # per prompt token after the first, when asked for


def clip_settled(settled: list[int], budget: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """Cut the settled tokens at the first stop id (kept) or at the token budget."""
    for i, token in enumerate(settled[:budget]):
        if token in stop_ids:
            return settled[: i + 1], "stop"
    if len(settled) >= budget:
        return settled[:budget], "length"
    return settled, None
