"""The draft side of one distributed session: what to draft next, given the target's feedback.
Pure protocol logic over a DraftSession; the gRPC service (service.py) runs it on the draft
worker's compute thread.

Sync mode drafts a block, sends it and waits for its feedback. Async mode keeps working while the
block is verified, on the continuations its verdict most likely calls for, most likely first and
one forward at a time (a feedback that arrives preempts the work):

- the follow-up: the next block, on the assumption that the whole block is accepted. It is sent at
  once (the block says ``followup``), so on a full acceptance the target starts it with no round
  trip, its first token checked against the target's own row for that place;
- prepared continuations: where a rejection is likely (the draft's own uncertainty: SVIP ends a
  block where its entropy is high), the block that would follow each of the draft's next most
  likely tokens there, the places and tokens ranked by the chance the draft gives them (its q
  of the tokens before, times its q of the alternative). The places span the block being
  verified and its follow-up, whose first token the target judges against a row it already
  holds. Greedy: sent at once, tagged with the rejection they assume; the target verifies one
  with no round trip when its correction is that token. Sampled (the correction is drawn here,
  from the target's p row): kept, and sent as soon as the drawn correction matches. Either way
  every token is still verified by the target.

Two clocks. The block the target waits for (critical) ends where the length policy ends it: SVIP
prices a drafted token as if it sat on the critical path, and there it does. A block the target is
not waiting for (the follow-up, a prepared continuation) is off that path: it drafts on past the
policy's stops while another forward fits before the verdict it waits on is due (PEARL's
post-verify), the stops it passed marking where the draft expects a rejection; a follow-up that
becomes critical past a stop leaves at once. (Greedy sessions: a sampled one's blocks end where its
policy ends them, so that its seed reproduces whatever the timing.) What it delays is priced by the worker's step
(service.py): a token drafted past a stop never rides a step that carries a block some target waits
for, so at several sessions speculation ahead for one never holds up another's critical block. At
one session nothing waits on it, and the draft, which idled half the time, fills the verification's
shadow (docs/benchmarks.md, "the bound").

Several of these are drafted side by side (``parallel``): each prepared continuation on a fork of
the session's cache (pages shared, copied on write), the follow-up on the cache itself, one
batched forward advancing them all. A fork is kept with its block until the verdict: the one the
verdict calls for becomes the session's cache (its follow-up drafts on with nothing re-read), the
rest go back to the pool. ``parallel`` 1 drafts one at a time on the session's cache.

Load-aware speculation: the target's feedback caps the next blocks (``load_cap``); a cap of 0
pauses the session, which drafts nothing until a Resume brings the tokens the target settled
alone meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_worker.drafter import BlockDraft, DraftSession
from svip_common.contracts import NO_TOKEN, PREPARED_PER_BLOCK, Block
from svip_common.errors import InvalidRequest
from svip_common.messages import DraftedBlock, Feedback, PreparedKey
from svip_common.outcome import DRAW, FOLLOWUP, PREPARED, SETTLED, Outcome
from svip_common.step_cost import UNLIMITED, Ewma
from svip_common.trees import begins_branch, children_of, node_parents, node_tokens

EMA = 0.2  # weight of the newest sample in the running estimates of a verdict's wait and a forward's time


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
class PipelinedDraft:
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
    agenda: list[tuple[float, PreparedKey | None]] = field(default_factory=list)  # (score, prepared_for)
    jobs: list[Job] = field(default_factory=list)  # the speculative blocks in the making
    critical: Job | None = None  # the main-line block the target waits for, drafted before any speculation
    load_cap: int = UNLIMITED  # the most tokens a block may hold at the target's load (its latest word)
    row_price: float = 0.0  # what a speculative row costs the blocks targets wait for, as a share of a step (the
    # worker's, learnt: service.py): a continuation is prepared only if the draft gives it more chance than that
    paused: bool = False  # load_cap 0: nothing is drafted until a Resume
    now: float = 0.0  # the time of the event being handled: every event takes it first (no clock is read here)

    def __post_init__(self):
        self.known = list(self.prompt)
        self.limit = len(self.prompt) + self.max_new_tokens
        self.timing = VerdictTiming()
        self.prepared = Prepared(self.session)  # finished continuations, by the rejection they assume

    @property
    def cached_tokens(self) -> int:
        return self.session.cached_tokens

    def close(self) -> None:
        """The session ends: its pages go back to the draft's pool."""
        self.release_forks()
        self.prepared.settle()
        self.jobs, self.critical, self.agenda = [], None, []
        self.session.close()

    def release_forks(self) -> bool:
        """Give up the speculation held on forks (the pool is short): jobs drafting on one are
        dropped, finished blocks keep only their tokens. Whether anything was given back."""
        held = [job for job in self.jobs if job.draft.cache is not None]
        for job in held:
            self._cancel(job)
        return self.prepared.release_forks() or bool(held)

    @property
    def _forking(self) -> bool:
        return self.parallel > 1 and self.session.can_fork

    # --- messages: a start, a feedback -------------------------------------------------------------
    # Each takes the time now first and returns the blocks ready to send at once; a block that must
    # be drafted first becomes the critical job, advanced by the worker's batched steps before any
    # speculation.

    def start(self, now: float, load_cap: int | None = None) -> list[DraftedBlock]:
        self.now = now
        if load_cap is not None:
            self.load_cap = load_cap
        if self.load_cap == 0:
            self.paused = True
            return []
        return self._next_block(NO_TOKEN, now)

    def on_resume(
        self, now: float, epoch: int, base: int, tokens: list[int], load_cap: int, received_at: float, features=None,
        features_from: int = 0,
    ) -> list[DraftedBlock]:
        """Drafting pays again: take the tokens the target settled alone since the pause (and a
        feature draft's features for them), then draft the next block (checked at once)."""
        self.now = now
        _check_resume(self.paused, len(self.known), self.limit, base, len(tokens), load_cap)
        self.known += tokens
        self.session.take_features(features, features_from)
        self.epoch, self.load_cap, self.paused = epoch, load_cap, False
        return self._next_block(NO_TOKEN, received_at)

    def on_feedback(self, now: float, feedback: Feedback, received_at: float, features=None,
                    features_from: int = 0) -> list[DraftedBlock]:
        """Apply a verdict's outcome, decided on the target (svip_common/outcome.py), to the oldest
        outstanding block (checked at once). features: the target's at positions features_from..
        (a feature draft's input)."""
        self.now, outcome = now, feedback.outcome
        if feedback.load_cap is not None:
            self.load_cap = feedback.load_cap
        head = self.outstanding[0].block if self.outstanding else None
        if head is None or head.base != outcome.base or len(head) != outcome.drafted:
            raise InvalidRequest(f"feedback for a block at base {outcome.base} of {outcome.drafted} tokens that "
                                 "this session did not send")
        _check_branch(head, outcome.accepted, outcome.branch)
        answered = self.outstanding.pop(0)
        self.session.feedback(outcome.drafted, outcome.accepted)
        self.session.take_features(features, features_from)
        self.timing.learn_wait(answered, received_at)
        if self.load_cap == 0 and outcome.next != SETTLED:
            raise InvalidRequest("a pause (load_cap 0) must settle its token at the target")
        if outcome.next == FOLLOWUP:
            self.timing.learn_fresh(False)
            return self._go_on(answered, received_at)
        return self._roll_back(answered, outcome, feedback.p_row, received_at)

    def _go_on(self, answered: DraftedBlock, received_at: float) -> list[DraftedBlock]:
        """The whole block was accepted and its follow-up settles what comes next: the line goes on,
        and the follow-up, if the target now waits for it, is critical."""
        if not answered.followup:
            raise InvalidRequest("deferred feedback for a block that has no follow-up")
        base = answered.block.base
        self.known += answered.block.tokens
        self.prepared.drop(base)
        for job in [job for job in self.jobs if not job.followup and job.prepared_for[0] == base]:
            self._cancel(job)
        if not self.outstanding:  # the target now waits for the follow-up: it is critical
            followup = next((job for job in self.jobs if job.followup), None) or self._begin(None)
            self.jobs.remove(followup)
            return self._make_critical(followup, received_at)
        self._plan()
        return []

    def _roll_back(self, answered: DraftedBlock, outcome: Outcome, p_row, received_at: float) -> list[DraftedBlock]:
        """A rejection (or a pause at a whole block): the line rolls back to what the outcome leaves
        known, and goes on from the continuation prepared there, or a new block."""
        block = answered.block
        resolved = NO_TOKEN
        if outcome.next == DRAW:
            if p_row is None or block.q_rows is None:
                raise InvalidRequest("a sampled rejection needs the target's p row")
            resolved = self.session.resolve_correction(block, outcome.accepted, p_row)
        key = outcome.prepared_key_for(resolved)
        used = outcome.next == PREPARED
        usable = outcome.accepted < outcome.drafted and self.load_cap != 0 and (len(outcome.branch) <= 1 or used)
        ready = self.prepared.blocks.get(key) if usable else None
        budget = min(self.limit - (key[0] + key[1] + 1) - 1, self.load_cap)
        drafting = in_the_making(self.jobs, key, budget, self.session.sampling.greedy) \
            if usable and not used and ready is None and not outcome.branch else None
        # what a forward still running now would have delayed: a block to draft or send now
        self.timing.learn_fresh(not used and drafting is None and self.load_cap != 0)
        for job in self.jobs:
            if job is not drafting:
                self._cancel(job, drop=False)
        self.jobs, self.critical, self.agenda = [], None, []
        self.known = self.known[: outcome.base] + outcome.known(block.tokens, resolved)
        self.epoch = outcome.epoch
        self.outstanding.clear()
        if outcome.after_sibling and ready is not None:
            _check_begins_branch(ready.block, outcome.branch)
        # what comes next was drafted on the fork of the one that goes on: drafting goes on from it
        self.prepared.settle(key if ready is not None and (used or not outcome.branch) else None)
        if self.load_cap == 0:  # paused: the target goes on alone until a Resume
            self.paused = True
            return []
        if used:
            if ready is None or ready.prepared_for is None or ready.reused:
                raise InvalidRequest("feedback uses a prepared continuation this session did not send")
            ready.block.epoch = outcome.epoch
            self.outstanding.append(ready)
            self._plan()
            return []
        if ready is not None and not outcome.branch:  # prepared here, not used there (late, or sampled): send it
            ready.block.epoch, ready.prepared_for, ready.reused = outcome.epoch, None, True
            ready.resolved_token, ready.trigger_at = resolved, received_at
            self.outstanding.append(ready)
            self._plan()
            return [ready]
        if drafting is not None:  # half drafted already: it goes on as the block the target waits for
            drafting.take_up(self.session, resolved)
            return self._make_critical(drafting, received_at)
        return self._next_block(resolved, received_at)

    def _make_critical(self, job: Job, trigger_at: float) -> list[DraftedBlock]:
        """A speculative job is now the block the target waits for (the feedback that made it so
        arrived at trigger_at); past a stop of its policy already, it leaves now."""
        self.critical, job.trigger_at = job, trigger_at
        if job.draft.extended and job.draft.block.tokens:
            job.draft.done = True
            return self._send_critical()
        return []

    def _next_block(self, resolved: int, trigger_at: float) -> list[DraftedBlock]:
        """The next main-line block after what is known: the critical job, or an empty block
        when there is nothing to draft (the budget is spent, or the correction ends the output;
        it lets the target settle the next position, or at least carries the correction)."""
        budget = min(self.limit - len(self.known) - 1, self.load_cap)  # the verdict's own token fills the last place
        if budget >= 1 and not self._stopped:
            draft = self.session.begin(self.known, budget, alternatives=self.pipelined)
            self.critical = Job(draft, None, self.now, trigger_at, resolved)
            return []
        if resolved == NO_TOKEN and self._finished():
            return []
        item = DraftedBlock.empty(len(self.known), self.epoch, resolved_token=resolved, started_at=self.now,
                                  finished_at=self.now, trigger_at=trigger_at)
        self.outstanding.append(item)
        return [item]

    # --- the worker's batched steps: one forward for every session's next token ---------------------

    def next_drafts(self, now: float) -> list[BlockDraft]:
        """The blocks this session advances in the next batched step, which starts now: its
        critical job, else the most likely continuations not yet drafted, ``parallel`` at most
        (if they would finish before the verdict is due); none: nothing to do now."""
        self.now = now
        if self.critical is not None:
            return [self.critical.draft]
        if self.paused or not self.timing.room_for_a_forward(self.now, self.outstanding):
            return []
        while len(self.jobs) < (self.parallel if self._forking else 1) and self.agenda:
            _, prepared_for = self.agenda.pop(0)
            self._begin(prepared_for)
        return [job.draft for job in self.jobs]

    def after_step(self, now: float, forward_s: float) -> list[DraftedBlock]:
        """What the step finished (it ended now and took forward_s): blocks to send now."""
        self.now = now
        self.timing.forward_s.update(forward_s)
        if self.critical is not None:
            return self._send_critical() if self.critical.draft.done else []
        finished = sorted((job for job in self.jobs if job.draft.done), key=lambda job: job.followup)
        self.jobs = [job for job in self.jobs if not job.draft.done]
        sent = []
        for job in finished:  # prepared ones first: the follow-up's plan leaves them out
            if not job.draft.block.tokens:
                self._cancel(job, drop=False)
                continue
            item = self._outgoing(job.draft, job.started_at, job.prepared_for, 0.0)
            if job.followup:
                self.outstanding.append(item)
                self._plan()  # its first places may be rejected too: prepare for them as well
                sent.append(item)
                continue
            self.prepared.keep(job.prepared_for, item, job.draft.cache)
            if self.send_prepared:
                sent.append(item)
        if any(job.followup and len(job.draft.block.tokens) == 1 for job in self.jobs):
            self._plan()  # the follow-up's first token is drafted: prepare for its likely rejections too
        return sent

    def _send_critical(self) -> list[DraftedBlock]:
        """The critical block is done: it is sent, and the work ahead of its verdict planned."""
        job, self.critical = self.critical, None
        item = self._outgoing(job.draft, job.started_at, None, job.trigger_at)
        item.resolved_token, item.reused = job.resolved_token, job.taken_up
        self.outstanding.append(item)
        self._plan()
        return [item]

    def _plan(self) -> None:
        """What to prepare while the outstanding blocks are verified (``agenda``)."""
        followup = next((job.draft for job in self.jobs if job.followup), None)
        working = {job.prepared_for for job in self.jobs}
        self.agenda = agenda(self.outstanding, followup, self.prepared, working, self.prepare, self.limit,
                             self.stop_token_ids, self.row_price) if self.pipelined else []

    def _begin(self, prepared_for: PreparedKey | None) -> Job:
        """A speculative job begins: the follow-up on the session's cache, a prepared
        continuation on a fork of it when forking (else on the cache too, one job at a time)."""
        if prepared_for is None:  # the follow-up: after every outstanding block
            seq = self.known + [t for o in self.outstanding for t in o.block.tokens]
        else:
            base, j, token = prepared_for  # outstanding blocks follow one another from the known tokens
            sent = [t for o in self.outstanding for t in o.block.tokens]
            seq = self.known + sent[: base - len(self.known) + j] + [token]
        fork = prepared_for is not None and self._forking
        draft = self.session.begin(seq, min(self.limit - len(seq) - 1, self.load_cap), alternatives=True, fork=fork)
        job = Job(draft, prepared_for, self.now)
        draft.extends = lambda: self._extends(job)
        self.jobs.append(job)
        return job

    def _extends(self, job: Job) -> bool:
        """Whether a speculative block drafts on past its policy's stop: the target is not waiting
        for it, and another forward ends before its verdict is due (VerdictTiming). Greedy only: a
        sampled session's blocks end by its tokens, never the clock (its seed reproduces)."""
        if job is self.critical or not self.outstanding or not self.session.sampling.greedy:
            return False
        return self.timing.room_for_a_forward(self.now + (self.timing.forward_s.value or 0.0), self.outstanding)

    def _cancel(self, job: Job, drop: bool = True) -> None:
        """A speculative job no longer wanted: its fork (if any) goes back; drop: out of the jobs."""
        job.release(self.session)
        if drop:
            self.jobs.remove(job)

    def _outgoing(self, draft: BlockDraft, started: float, prepared_for, trigger_at: float) -> DraftedBlock:
        block = draft.block
        block.epoch = self.epoch
        # a follow-up will come on top of it (async), unless it ends the output
        followup = self.pipelined and bool(block.tokens) and block.tokens[-1] not in self.stop_token_ids \
            and self.limit - (block.base + len(block)) - 1 >= 1
        return DraftedBlock(block, followup, prepared_for=prepared_for, started_at=started, finished_at=self.now,
                            draft_s=draft.compute_s - draft.prefill_s, trigger_at=trigger_at,
                            alternatives=draft.alternatives)

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


def work(draft: PipelinedDraft, now: float) -> list[DraftedBlock] | None:
    """One forward of this session alone, at the time now (next_drafts, then after_step, the
    forward timed by the drafter's own account); None: nothing to do."""
    drafts = draft.next_drafts(now)
    if not drafts:
        return None
    before = sum(d.compute_s for d in drafts)
    draft.session._drafter.step(drafts)
    for d in drafts:
        if d.error is not None:
            raise d.error
    forward_s = sum(d.compute_s for d in drafts) - before
    return draft.after_step(now + forward_s, forward_s)


def in_the_making(jobs: list[Job], key: PreparedKey, budget: int, greedy: bool) -> Job | None:
    """The continuation being prepared for this rejection, if one is (not finished yet), and it
    may go on under ``budget`` (the cap the target's latest word sets). Greedy only: a sampled
    block's length must not depend on when its verdict came (its stops before then were taken
    under the policy's state of that time; a seeded request reproduces)."""
    job = next((job for job in jobs if job.prepared_for == key), None)
    return job if job is not None and greedy and job.draft.cap(budget) else None


def _check_resume(paused: bool, known: int, limit: int, base: int, tokens: int, load_cap: int) -> None:
    """A Resume of ``tokens`` at base fits a session that is paused and knows ``known`` tokens of
    at most ``limit``."""
    if not paused:
        raise InvalidRequest("resume for a session that is not paused")
    if base != known:
        raise InvalidRequest(f"resume at base {base}; this session knows {known} tokens")
    if base + tokens > limit:
        raise InvalidRequest(f"resume past the session's {limit} tokens (prompt + max_new_tokens)")
    if load_cap < 1:
        raise InvalidRequest("resume with load_cap 0")


def _check_branch(block: Block, accepted: int, branch: tuple[int, ...]) -> None:
    """A verdict's branch is a path of the block's own nodes: a sibling at the rejected place,
    then nodes grown below it, each a child of the one before."""
    if not branch:
        return
    k = len(block.tokens)
    if accepted >= k or not block.siblings:
        raise InvalidRequest(f"feedback takes {branch[0]} at place {accepted}, "
                             "not a sibling this session drafted there")
    tokens = node_tokens(block.tokens, block.siblings, block.grown)
    children, at = children_of(node_parents(k, block.siblings, block.grown)), accepted - 1
    for depth, token in enumerate(branch):
        at = next((node for node in children.get(at, ()) if node >= k and tokens[node] == token), None)
        if at is None:
            what = "a sibling this session drafted" if depth == 0 else "a node this session grew"
            raise InvalidRequest(f"feedback takes {token} at place {accepted + depth}, not {what} there")


def _check_begins_branch(block: Block, branch: tuple[int, ...]) -> None:
    """A continuation prepared after a branch's sibling serves the branch only if it begins with
    the nodes the branch took below that sibling."""
    if not begins_branch(block.tokens, branch):
        raise InvalidRequest(f"feedback uses the continuation prepared after {branch[0]}, which does not begin "
                             f"with the branch's nodes below it {list(branch[1:])}")


def agenda(outstanding: list[DraftedBlock], followup: BlockDraft | None, prepared: Prepared, working: set,
           prepare: int, limit: int, stop_token_ids: frozenset[int],
           floor: float = 0.0) -> list[tuple[float, PreparedKey | None]]:
    """What to prepare while the outstanding blocks are verified, most likely first: the follow-up,
    then continuations after a rejection at each place of each outstanding block (the block being
    verified, then its follow-up), and at the first token of the follow-up being drafted (judged at
    once by the target's stored row when the block before it is accepted whole: the likeliest
    rejection of all), each scored by the draft's own chance of that outcome, at most ``prepare``
    per block, none the draft gives less chance than ``floor`` (a row's price); none already made
    (``prepared``) or in the making (``working``)."""
    out = []
    if not outstanding:
        return out
    reach = 1.0  # the draft's chance that every token before this place is accepted
    for position, item in enumerate(outstanding):
        candidates, reach = _candidates(item, reach, limit, stop_token_ids, prepared, floor)
        out += candidates[:prepare]
        if position == len(outstanding) - 1 and item.followup and len(outstanding) < 2:
            out.append((reach, None))  # the follow-up: everything outstanding accepted
    if followup is not None and followup.alternatives:
        item = DraftedBlock(followup.block, True, alternatives=followup.alternatives[:1])
        out += _candidates(item, reach, limit, stop_token_ids, prepared, floor)[0][:prepare]
    return sorted((a for a in out if a[1] not in working), key=lambda c: -c[0])


def _candidates(item: DraftedBlock, reach: float, limit: int, stop_token_ids: frozenset[int],
                prepared: Prepared, floor: float) -> tuple[list[tuple[float, PreparedKey]], float]:
    """The continuations worth preparing after a rejection in this outstanding block, most
    likely first (reach: the draft's chance that every token before it is accepted), and the
    reach past it; none already prepared, none past the session's limit. After a tree's sibling
    as after a correction: the target takes it up when the verdict settles that token there."""
    block, candidates = item.block, []
    for j, options in enumerate(item.alternatives):
        fits = limit - (block.base + j + 1) - 1 >= 1
        for token, q in options:
            key = (block.base, j, token)
            worth = reach * q > floor and token not in stop_token_ids
            if worth and fits and key not in prepared:
                candidates.append((reach * q, key))
        reach *= block.probs[j]
    return sorted(candidates, key=lambda c: -c[0]), reach
