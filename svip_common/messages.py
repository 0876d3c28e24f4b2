"""The distributed protocol's messages in the project's terms. Each worker's service converts them
to and from the wire (svip_proto/convert.py) at its edge, once; the session logic on both sides
(coordinator/session/pipeline.py, draft_worker/pipelined.py) reads and writes only these.

    target ──SessionStart, Feedback (a chain), Resume, Cancel──►  draft
    target ◄──DraftedBlock, DraftClosed, DraftFailed───────────  draft
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from svip_common.acceptance import StopRule
from svip_common.contracts import NO_TOKEN, Block, GenerationRequest, PolicyConfig, SamplingParams
from svip_common.outcome import PREPARED, Outcome

PreparedKey = tuple[int, int, int]  # (parent base, accepted, correction): the verdict a prepared block assumes


# --- target -> draft --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionStart:
    """A session's start (the caller's to the target, the target's to the draft): both workers read
    one the same way."""

    session_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    policy: PolicyConfig  # name "none": the target alone, no draft session
    stop_token_ids: frozenset[int]
    pipeline: str  # "sync" or "async"
    epoch: int = 0
    load_cap: int | None = None  # the first block's cap (0: start paused); None: the policy's own
    stop_rule: StopRule | None = None  # policy auto: the rule for the first blocks
    node_price: float | None = None  # a verified node's price in tokens, for the first blocks
    logprobs: int | None = None  # the caller's: each settled token's log-probability and this many top ones
    prompt_logprobs: bool = False  # the caller's: the prompt's too, from its prefill (needs logprobs)
    cache_scope: str = ""  # the caller's: sessions share KV pages only within one scope (prompt_sharing.py)

    @property
    def speculates(self) -> bool:
        return self.policy.name != "none"

    def request(self, policy: PolicyConfig) -> GenerationRequest:
        """The request this start runs, under the policy the worker gives it."""
        return GenerationRequest(self.prompt_ids, self.max_new_tokens, self.sampling, policy,
                                 cache_scope=self.cache_scope)


@dataclass
class Feedback:
    """The verdict on one drafted block: its outcome, decided once on the target (what is settled,
    what comes next, the epoch: svip_common/outcome.py), which the draft applies; then: the verdict
    on the next block, decided in the same step (a chain, earliest first)."""

    session_id: str
    outcome: Outcome
    load_cap: int | None = None  # load-aware speculation's cap on the next blocks (None: no cap)
    stop_rule: StopRule | None = None  # policy auto: the rule for the next blocks
    p_row: torch.Tensor | None = field(default=None, repr=False)  # sampled rejection: the target's p there
    sent_at: float = 0.0  # the target's wall clock when the feedback left
    then: Feedback | None = None
    # a feature draft's input: the target's hidden states at positions features_from.. (the verdict's)
    features: torch.Tensor | None = field(default=None, repr=False)
    features_from: int = 0
    node_price: float | None = None  # a verified node's price in tokens at the target's load

    # the outcome's fields, as the wire and the logs read them
    epoch = property(lambda self: self.outcome.epoch)
    base = property(lambda self: self.outcome.base)
    drafted = property(lambda self: self.outcome.drafted)
    accepted = property(lambda self: self.outcome.accepted)
    token = property(lambda self: self.outcome.token)
    branch = property(lambda self: self.outcome.branch)
    prepared_used = property(lambda self: self.outcome.next == PREPARED)

    def chain(self) -> list[Feedback]:
        out, item = [], self
        while item is not None:
            out.append(item)
            item = item.then
        return out


@dataclass(frozen=True)
class Resume:
    """Drafting pays again after a pause: the tokens the target settled alone since, from base."""

    session_id: str
    epoch: int
    base: int
    tokens: tuple[int, ...]
    load_cap: int
    stop_rule: StopRule | None = None
    # a feature draft's: the target's features at positions features_from.. that those tokens' verdicts handed over
    features: torch.Tensor | None = field(default=None, repr=False)
    features_from: int = 0


@dataclass(frozen=True)
class Cancel:
    session_id: str


DraftRequest = SessionStart | Feedback | Resume | Cancel


# --- draft -> target --------------------------------------------------------------------------------


@dataclass
class DraftedBlock:
    """A block as the draft sends it: the tokens (with q and entropy), and where it stands in the
    async protocol (a follow-up, a prepared continuation), with the draft's timings."""

    block: Block
    followup: bool = False  # the next block on top of this one will come (async)
    resolved_token: int = NO_TOKEN  # a sampled correction drawn by the draft, for position base - 1
    prepared_for: PreparedKey | None = None  # a prepared continuation: the verdict it assumes
    reused: bool = False  # a prepared continuation sent (or finished) as the next block after its verdict
    started_at: float = 0.0
    finished_at: float = 0.0
    draft_s: float = 0.0  # compute time
    trigger_at: float = 0.0  # when the feedback this block answers reached the draft
    alternatives: list = field(default_factory=list, repr=False)  # draft side only: per token, the runners-up
    grows: int = 0  # above 0: more tokens of the follow-up sent at base, which holds this many already (async)

    @property
    def tokens(self) -> list[int]:
        return self.block.tokens

    @property
    def elapsed_s(self) -> float:
        """How long the block took on the draft's clock, its first forward to its last: the steps
        it rode whole (other rows' shares too: draft_s counts its own), at least its compute."""
        return max(self.draft_s, self.finished_at - self.started_at)

    @property
    def base(self) -> int:
        return self.block.base

    @property
    def epoch(self) -> int:
        return self.block.epoch

    @classmethod
    def empty(cls, base: int, epoch: int, **fields) -> DraftedBlock:
        """No drafted tokens: the target settles the next place alone (fields: the rest, e.g. a
        sampled correction it carries and its timings)."""
        return cls(Block(base=base, tokens=[], probs=[], entropies=[], epoch=epoch), **fields)


@dataclass(frozen=True)
class DraftClosed:
    """The draft ended its side of the session: cancelled as asked, or shed (its KV pool is full)."""

    session_id: str
    shed: bool = False


@dataclass(frozen=True)
class DraftFailed:
    """The draft failed the session (its error: never the caller's)."""

    session_id: str
    code: int
    message: str


DraftEvent = DraftedBlock | DraftClosed | DraftFailed
