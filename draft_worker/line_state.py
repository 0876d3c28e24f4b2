"""The state of one draft session of the distributed protocol, declared once (``LineState``), with
the parts it is made of: a block in the making (``Job``), the continuations finished and kept until
their verdict (``Prepared``), when a verdict is due (``VerdictTiming``). The protocol over it:
stepping.py (the worker's batched steps), pipelined.py (the target's messages); what it is and why:
pipelined.py's docstring. Pure: no clock, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_worker.drafter import BlockDraft, DraftSession
from draft_worker.growth import Growth
from svip_common.contracts import NO_TOKEN, PREPARED_PER_BLOCK, Block
from svip_common.messages import DraftedBlock, PreparedKey
from svip_common.step_cost import UNLIMITED, Ewma

EMA = 0.2  # weight of the newest sample in the running estimates of a verdict's wait and a forward's time
# a prepared continuation drafting on past its stop is sent as it stands once this many more forwards would
# not end before its verdict is due (docs/benchmarks.md, late prepared continuations: one a step earlier
# than its extension ends, so that the target holds it when a verdict comes sooner than the mean wait)
EARLY_FORWARDS = 2


@dataclass
class Job:
    """A block in the making: the next main-line block, the follow-up, or a prepared continuation."""

    draft: BlockDraft
    prepared_for: PreparedKey | None
    started_at: float
    trigger_at: float = 0.0  # the feedback it answers arrived then (critical jobs)
    resolved_token: int = NO_TOKEN  # the sampled correction it carries (critical jobs)
    taken_up: bool = False  # prepared for the rejection its verdict made, before it was done (critical jobs)

    @property
    def followup(self) -> bool:
        return self.prepared_for is None

    def release(self, session: DraftSession) -> None:
        """Its fork, if it drafts on one, goes back to the pool."""
        if self.draft.cache is not None:
            session.release(self.draft.cache)

    def take_up(self, session: DraftSession, resolved: int) -> None:
        """Prepared for the rejection a verdict made and not finished yet, it goes on as the block
        the target waits for, where it stands (what a new block would draft, forwards already
        spent): its fork becomes the session's cache."""
        if self.draft.cache is not None:
            session.adopt(self.draft.cache)
            self.draft.cache = None
        self.prepared_for, self.resolved_token, self.taken_up = None, resolved, True


@dataclass
class LineState:
    """One async (or sync) draft session's state, declared here once: the line (what is known,
    the epoch, the blocks sent and unanswered, the block the target waits for) and the speculation
    ahead of its verdicts (the jobs in the making, the agenda, the finished continuations, the
    follow-up that grows, the verdicts' timing). stepping.py advances it by the worker's batched
    steps; pipelined.py applies the target's messages to it. Pure: no clock, no I/O."""

    session: DraftSession
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    pipelined: bool  # async: work ahead while a block is verified
    prepare: int = PREPARED_PER_BLOCK  # prepared continuations per block at most (async); 0: follow-ups only
    parallel: int = 1  # speculative blocks drafted side by side, each prepared one on a fork (async)
    send_prepared: bool = True  # where the target settles a rejected place (greedy, a sampled tree): send them
    # ahead; where the draft draws the correction (a sampled chain): keep them here
    known: list[int] = field(default_factory=list)  # committed, as the target's feedback settled it
    epoch: int = 0
    outstanding: list[DraftedBlock] = field(default_factory=list)  # main-line blocks sent, unanswered (<= 2)
    # prepared continuations sent before they ended, as the target holds them: their jobs draft on, and what
    # they draft past the sent tokens goes on as the next follow-up if the verdict uses one (stepping.py)
    sent_early: dict[PreparedKey, DraftedBlock] = field(default_factory=dict)
    agenda: list[tuple[float, PreparedKey | None]] = field(default_factory=list)  # (score, prepared_for)
    jobs: list[Job] = field(default_factory=list)  # the speculative blocks in the making
    critical: Job | None = None  # the main-line block the target waits for, drafted before any speculation
    load_cap: int = UNLIMITED  # the most tokens a block may hold at the target's load (its latest word)
    row_price: float = 0.0  # what a speculative row costs the blocks targets wait for, as a share of a step (the
    # worker's, learnt: service.py): a continuation is prepared only if the draft gives it more chance than that
    shared: bool = False  # the worker drafts for other sessions too (service.py): their targets' blocks keep the
    # target busy, so a follow-up late for its verdict misses a forward there (it grows: growth.py)
    paused: bool = False  # load_cap 0: nothing is drafted until a Resume
    now: float = 0.0  # the time of the event being handled: every event takes it first (no clock is read here)
    rate_since: tuple[float, int] | None = None  # (when, tokens known) at its first verdict: its rate counts from there

    def __post_init__(self):
        self.known = list(self.prompt)
        self.limit = len(self.prompt) + self.max_new_tokens
        self.timing = VerdictTiming()
        self.prepared = Prepared(self.session)  # finished continuations, by the rejection they assume
        self.growth = Growth()  # the follow-up sent at its first stop and drafted on (growth.py)

    @property
    def cached_tokens(self) -> int:
        return self.session.cached_tokens

    @property
    def _forking(self) -> bool:
        return self.parallel > 1 and self.session.can_fork

    def _cancel(self, job: Job, drop: bool = True) -> None:
        """A speculative job no longer wanted: its fork (if any) goes back; drop: out of the jobs."""
        job.release(self.session)
        if drop:
            self.jobs.remove(job)

    def _outgoing(self, draft: BlockDraft, started: float, prepared_for, trigger_at: float) -> DraftedBlock:
        block = draft.block
        block.epoch = self.epoch
        drafting_s = max(0.0, draft.compute_s - draft.prefill_s)  # a sum less its part: rounding may go below 0
        return DraftedBlock(block, self._continues(block), prepared_for=prepared_for, started_at=started,
                            finished_at=self.now, draft_s=drafting_s, trigger_at=trigger_at,
                            alternatives=draft.alternatives)

    def _continues(self, block: Block) -> bool:
        """A follow-up will come on top of this block (async), unless it ends the output."""
        return self.pipelined and bool(block.tokens) and block.tokens[-1] not in self.stop_token_ids \
            and self.limit - (block.base + len(block)) - 1 >= 1

    @property
    def _stopped(self) -> bool:
        """The output already ended on a stop token."""
        return len(self.known) > len(self.prompt) and self.known[-1] in self.stop_token_ids

    def _finished(self) -> bool:
        return self._stopped or len(self.known) >= self.limit


class Prepared:
    """The prepared continuations finished and kept until their verdict, by the rejection they
    assume (base, accepted, token), with the forks of the session's cache they were drafted on:
    the one the verdict calls for becomes the session's cache, the rest go back to the pool."""

    def __init__(self, session: DraftSession):
        self.session = session
        self.blocks: dict[PreparedKey, DraftedBlock] = {}
        self.forks: dict[PreparedKey, object] = {}

    def __contains__(self, key: PreparedKey) -> bool:
        return key in self.blocks

    def keep(self, key: PreparedKey, item: DraftedBlock, cache) -> None:
        """A prepared block finished, on this fork (None: on the session's own cache, nothing to
        keep); a fork kept for the same rejection before goes back (never two held for one key)."""
        self.blocks[key] = item
        self._release(key)
        if cache is not None:
            self.forks[key] = cache

    def drop(self, base: int) -> None:
        """The block at base was accepted whole: the continuations for its rejections are void."""
        for key in [key for key in self.blocks if key[0] == base]:
            del self.blocks[key]
            self._release(key)

    def settle(self, adopt: PreparedKey | None = None) -> None:
        """A verdict rolled the line back (or the session ends): every one is void; the fork of
        ``adopt``, if one is held, becomes the session's cache."""
        if adopt in self.forks:
            self.session.adopt(self.forks.pop(adopt))
        self.blocks = {}
        self.release_forks()

    def release_forks(self) -> bool:
        """Every fork goes back (the blocks keep their tokens); whether any was held."""
        held, self.forks = self.forks, {}
        for cache in held.values():
            self.session.release(cache)
        return bool(held)

    def _release(self, key: PreparedKey) -> None:
        if key in self.forks:
            self.session.release(self.forks.pop(key))


class VerdictTiming:
    """When is the verdict on the oldest outstanding block due, and may a forward of speculation
    start now? Its verification starts when it reaches the target or when the verdict before it
    was given, whichever is later; the wait from there is learnt, as is a forward's time.

    A forward still running when the verdict comes delays the block that verdict needs only if it
    needs one drafted afresh (a rejection nothing was prepared or is being prepared for); any
    other verdict takes up what the forward drafted (the follow-up, a continuation, finished or
    not). So a forward is priced at its time times the learnt share of verdicts that need a fresh
    block, and starts if that much ends before the verdict is due: with no verdict seen, every
    forward must end before it (the draft is free when the feedback comes)."""

    def __init__(self):
        self.verifying_since = 0.0
        self.verdict_wait = Ewma(EMA, empty=None)
        self.forward_s = Ewma(EMA, empty=None)
        self.fresh = Ewma(EMA, empty=1.0)  # the share of verdicts that need a block drafted afresh

    def room_for_a_forward(self, now: float, outstanding: list[DraftedBlock]) -> bool:
        wait, forward_s = self.verdict_wait.value, self.forward_s.value
        if wait is None or forward_s is None or not outstanding:
            return True
        due = max(self.verifying_since, outstanding[0].finished_at) + wait
        return now + self.fresh.value * forward_s < due

    def learn_fresh(self, fresh: bool) -> None:
        """What the last verdict needed: a block drafted afresh, or what speculation made."""
        self.fresh.update(1.0 if fresh else 0.0)

    def learn_wait(self, answered: DraftedBlock, received_at: float) -> None:
        self.verdict_wait.update(received_at - max(self.verifying_since, answered.finished_at))
        self.verifying_since = received_at
