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
  holds. Greedy: sent when done, tagged with the rejection they assume; the target verifies one
  with no round trip when its correction is that token (where the worker serves several
  sessions, one still drafting on past its stop is sent as it stands once its verdict is near,
  its rest as a growth when it ends: stepping.py ``_sent_now``, ``_take_sent`` below). Sampled
  (the correction is drawn here, from the target's p row): kept, and sent as soon as the drawn
  correction matches. Either way every token is still verified by the target. A tree's sibling
  is such a rejection's token too: where the target takes it but settles the place after it itself
  (its continuation came late), the continuation goes on past that place if it drafted the same
  token there (sent at once if finished, else taken up as the block the target waits for, keeping
  past its stop the places that pay for their nodes at the target's node price).

Two clocks. The block the target waits for (critical) ends where the length policy ends it: SVIP
prices a drafted token as if it sat on the critical path, and there it does. A block the target is
not waiting for (the follow-up, a prepared continuation) is off that path: it drafts on past the
policy's stops while another forward fits before the verdict it waits on is due (PEARL's
post-verify), the stops it passed marking where the draft expects a rejection; a follow-up that
becomes critical past a stop leaves at once. (Greedy sessions: a sampled one's blocks end where its
policy ends them, so that its seed reproduces whatever the timing.) What it delays is priced by the worker's step
(service.py): a token drafted past a stop rides a step that carries a block some target waits for
only if the draft gives its block more chance than the row costs those blocks (the price under
what is prepared, learnt from the step's times), so at several sessions speculation ahead for one
holds up another's critical block only where it pays. At one session nothing waits on it, and the
draft, which idled half the time, fills the verification's shadow (docs/benchmarks.md, "the bound").

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

from dataclasses import replace

from draft_worker.line_state import Job
from draft_worker.stepping import Stepping
from svip_common.contracts import NO_TOKEN, Block
from svip_common.errors import InvalidRequest
from svip_common.messages import DraftedBlock, Feedback, PreparedKey
from svip_common.outcome import DRAW, FOLLOWUP, PREPARED, SETTLED, Outcome
from svip_common.trees import begins_branch, children_of, forward_price, grows, node_parents, node_tokens, priced


class PipelinedDraft(Stepping):
    """The draft side of one distributed session (this module's docstring): the target's messages
    applied to the state line_state.py declares; the worker's steps drive its other part,
    stepping.py."""

    def close(self) -> None:
        """The session ends: its pages go back to the draft's pool."""
        self.release_forks()
        self.prepared.settle()
        self.growth.clear()
        self.jobs, self.critical, self.agenda, self.sent_early = [], None, [], {}
        self.session.close()

    def release_forks(self) -> bool:
        """Give up the speculation held on forks (the pool is short): jobs drafting on one are
        dropped, finished blocks keep only their tokens. Whether anything was given back."""
        held = [job for job in self.jobs if job.draft.cache is not None]
        for job in held:
            self._cancel(job)
        return self.prepared.release_forks() or bool(held)

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
        self._price_forward(received_at)
        answered = self.outstanding.pop(0)
        self.session.feedback(outcome.drafted, outcome.accepted)
        self.session.take_features(features, features_from)
        self.timing.learn_wait(answered, received_at)
        if self.load_cap == 0 and outcome.next != SETTLED:
            raise InvalidRequest("a pause (load_cap 0) must settle its token at the target")
        if outcome.next == FOLLOWUP:
            self.timing.learn_fresh(False)
            return self._go_on(answered, received_at, outcome.next_tokens)
        return self._roll_back(answered, outcome, feedback.p_row, received_at)

    def _price_forward(self, at: float) -> None:
        """A deep tree's draft forward of its own (deep-auto: its last place's children) priced for
        the blocks drafted from now: the tokens a second this session has settled since its first
        verdict, times a forward's learnt time (trees.forward_price). Only a tree that grows and is
        priced (deep-auto) reads the price: no other session keeps it."""
        tree = self.session.tree
        if not (priced(tree) and grows(tree)):
            return
        if self.rate_since is None:  # the first verdict: the rate is counted from here (the prompt's prefill apart)
            self.rate_since = (at, len(self.known))
        elapsed, settled = at - self.rate_since[0], len(self.known) - self.rate_since[1]
        rate = settled / elapsed if elapsed > 0 else 0.0
        self.session.forward_price = forward_price(rate, self.timing.forward_s.value or 0.0)

    def _go_on(self, answered: DraftedBlock, received_at: float, next_tokens: int | None) -> list[DraftedBlock]:
        """The whole block was accepted and its follow-up settles what comes next: the line goes on,
        and the follow-up, if the target now waits for it, is critical. next_tokens: of the
        follow-up sent, the tokens the target verifies (growth.py)."""
        if not answered.followup:
            raise InvalidRequest("deferred feedback for a block that has no follow-up")
        base = answered.block.base
        self.known += answered.block.tokens
        self.prepared.drop(base)
        for job in [job for job in self.jobs if not job.followup and job.prepared_for[0] == base]:
            self._cancel(job)
        self.sent_early = {key: item for key, item in self.sent_early.items() if key[0] != base}
        growing = self.growth.job
        grown, rest = self.growth.verified_at(self.outstanding[0], next_tokens) if self.outstanding else (False, None)
        if grown:
            self.outstanding[0].followup = self._continues(self.outstanding[0].block)
            if rest is not None:  # what it drafted past the cut is the next follow-up
                return self._follow_the_cut(rest, growing)
            if growing is not None:  # it is verified as it stands there: the next follow-up drafts on after it
                self._cancel(growing)
        elif next_tokens is not None and not self.outstanding:
            raise InvalidRequest("feedback verifies a follow-up this session did not send")
        if not self.outstanding:  # the target now waits for the follow-up: it is critical
            followup = next((job for job in self.jobs if job.followup), None) or self._begin(None)
            self.jobs.remove(followup)
            return self._make_critical(followup, received_at)
        self._plan()
        return []

    def _follow_the_cut(self, rest: DraftedBlock, growing: Job | None) -> list[DraftedBlock]:
        """A grown follow-up was cut at the target before all it holds here: the tokens past the
        cut are the next follow-up, sent now; the job that drafted them, if it drafts on, grows it
        (growth.py)."""
        rest.block.epoch, rest.finished_at = self.epoch, self.now
        rest.followup = self._continues(rest.block)
        self.outstanding.append(rest)
        if growing is not None:
            self.growth.start(growing, rest)
        self._plan()
        return [rest]

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
        # a sibling taken and the place after it settled there: its continuation goes on past what they settled
        below = outcome.below_sibling if usable and not used and self.session.sampling.greedy else None
        if outcome.branch and not used:
            ready = _past(ready, below)
        budget = min(self.limit - (key[0] + key[1] + 1) - 1, self.load_cap)
        drafting = in_the_making(self.jobs, key, budget, self.session.sampling.greedy, below) \
            if usable and not used and ready is None and (not outcome.branch or below is not None) else None
        sent = self.sent_early.get(key) if used else None  # the target verifies it as sent before it ended
        if sent is not None:
            drafting = next((job for job in self.jobs if job.prepared_for == key), None)  # drafting on, if it is
        # what a forward still running now would have delayed: a block to draft or send now
        self.timing.learn_fresh(not used and drafting is None and self.load_cap != 0)
        for job in self.jobs:
            if job is not drafting:
                self._cancel(job, drop=False)
        self.jobs, self.critical, self.agenda, self.sent_early = [], None, [], {}
        self.growth.clear()
        self.known = self.known[: outcome.base] + outcome.known(block.tokens, resolved)
        self.epoch = outcome.epoch
        self.outstanding.clear()
        if outcome.after_sibling and ready is not None:
            _check_begins_branch(ready.block, outcome.branch)
        # what comes next was drafted on the fork of the one that goes on: drafting goes on from it
        self.prepared.settle(key if ready is not None else None)
        if self.load_cap == 0:  # paused: the target goes on alone until a Resume
            self.paused = True
            return []
        if sent is not None:
            return self._take_sent(sent, ready, drafting, outcome.epoch, outcome.next_tokens)
        if used:
            if ready is None or ready.prepared_for is None or ready.reused:
                raise InvalidRequest("feedback uses a prepared continuation this session did not send")
            _check_verified(outcome.next_tokens, (len(ready.tokens),))
            ready.block.epoch = outcome.epoch
            self.outstanding.append(ready)
            self._plan()
            return []
        if ready is not None:  # prepared here, not used there (late, or sampled): send it
            ready.block.epoch, ready.prepared_for, ready.reused = outcome.epoch, None, True
            ready.resolved_token, ready.trigger_at = resolved, received_at
            self.outstanding.append(ready)
            self._plan()
            return [ready]
        if drafting is not None:  # half drafted already: it goes on as the block the target waits for
            if below:  # past the tokens the verdict settled below the sibling it was prepared after
                drafting.draft.go_on_past(len(below))
            drafting.take_up(self.session, resolved)
            return self._make_critical(drafting, received_at)
        return self._next_block(resolved, received_at)

    def _take_sent(self, sent: DraftedBlock, finished: DraftedBlock | None, job: Job | None, epoch: int,
                   verified: int | None) -> list[DraftedBlock]:
        """The verdict uses a prepared continuation sent before it ended (stepping.py ``_sent_now``):
        the target verifies it as it holds it (``verified`` tokens: as sent, or grown by the rest
        once it ended), and what its job drafted past those tokens (finished, or drafting on, which
        then goes on as the follow-up and grows: growth.py) is the next follow-up, sent now;
        nothing is drafted again (a greedy chain drafted on from there would draft those tokens)."""
        n = _check_verified(verified, (len(sent.tokens),) + (() if finished is None else (len(finished.tokens),)))
        if n > len(sent.tokens):  # its growth reached the target in time: the block as it ended is verified
            sent = finished
        sent.block.epoch = epoch
        self.outstanding.append(sent)
        if job is not None:  # its fork becomes the session's cache
            job.take_up(self.session, NO_TOKEN)
            if sent.followup and len(job.draft.block.tokens) > n:
                job.draft.split_off(n)
                rest = DraftedBlock(job.draft.block, False, started_at=job.started_at,
                                    alternatives=job.draft.alternatives)
                self.jobs.append(job)
                return self._follow_the_cut(rest, job)
            job.release(self.session)
        elif finished is not None and sent.followup and len(finished.tokens) > n:
            rest = DraftedBlock(finished.block.after(n), False, started_at=finished.started_at,
                                alternatives=finished.alternatives[n:])
            return self._follow_the_cut(rest, None)
        self._plan()
        return []

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


def in_the_making(jobs: list[Job], key: PreparedKey, budget: int, greedy: bool,
                  settled: tuple[int, ...] | None = None) -> Job | None:
    """The continuation being prepared for this rejection, if one is (not finished yet), and it
    may go on under ``budget`` (the cap the target's latest word sets). Greedy only: a sampled
    block's length must not depend on when its verdict came (its stops before then were taken
    under the policy's state of that time; a seeded request reproduces). settled: the tokens
    the verdict settled past the sibling it is prepared after, which it must have drafted (it
    goes on past them: a chain, or a tree that grows nothing below its siblings)."""
    job = next((job for job in jobs if job.prepared_for == key), None)
    if job is None or not greedy:
        return None
    if settled is not None and (job.draft.grows_below or not _begins_with(job.draft.block, settled)):
        return None
    return job if job.draft.cap(budget) else None


def _begins_with(block: Block, settled: tuple[int, ...]) -> bool:
    """Whether a continuation can go on past these settled tokens: it drafted them, and its
    siblings hold no nodes grown below them (a flat tree's or a chain's)."""
    return not block.grown and tuple(block.tokens[: len(settled)]) == settled


def _past(ready: DraftedBlock | None, settled: tuple[int, ...] | None) -> DraftedBlock | None:
    """A continuation finished after a sibling the verdict took, as it goes on past the tokens the
    verdict settled below that sibling: the rest, if it drafted them and holds more; else None."""
    if ready is None or settled is None or len(ready.tokens) <= len(settled) \
            or not _begins_with(ready.block, settled):
        return None
    n = len(settled)
    return replace(ready, block=ready.block.after(n), alternatives=ready.alternatives[n:])


def _check_verified(verified: int | None, held: tuple[int, ...]) -> int:
    """The tokens of a prepared continuation the target verifies: as many as it could hold of what
    this session sent (``held``: as first sent, then as grown); None: as first sent."""
    if verified is None:
        return held[0]
    if verified not in held:
        raise InvalidRequest(f"feedback verifies {verified} tokens of a prepared continuation this session sent "
                             f"as {' then '.join(map(str, held))} tokens")
    return verified


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
