"""The draft session's part that the worker's batched steps drive (service.py): which blocks it
advances in the next step (the critical one first, else the speculation its agenda ranks), what
a step finished (blocks to send, continuations to keep, the follow-up's growth) and a step it sits
out; a part of PipelinedDraft (pipelined.py) over the state line_state.py declares. Pure: each call
takes the time now."""

from __future__ import annotations

from draft_worker.drafter import BlockDraft
from draft_worker.growth import growth_of
from draft_worker.line_state import EARLY_FORWARDS, Job, LineState, Prepared
from svip_common.messages import DraftedBlock, PreparedKey
from svip_common.trees import grows as tree_grows


class Stepping(LineState):
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

    def preparing(self, draft: BlockDraft) -> bool:
        """Whether this block, one of the session's in a step, is a continuation prepared after a
        rejection (not the critical block, not the follow-up)."""
        return any(job.draft is draft and job.prepared_for is not None for job in self.jobs)

    def after_step(self, now: float, forward_s: float) -> list[DraftedBlock]:
        """What the step finished (it ended now and took forward_s): blocks to send now."""
        self.now = now
        self.timing.forward_s.update(forward_s)
        if self.critical is not None:
            return self._send_critical() if self.critical.draft.done else []
        return self._finished_jobs()

    def sat_out(self, now: float, drafts: list[BlockDraft]) -> list[DraftedBlock]:
        """The worker's step, which starts now, leaves out these speculative blocks past their
        stops (it carries a block some target waits for): one that could not grow after it
        before its verdict is due ends where it stands (``BlockDraft.end_extension``) and is
        sent now, rather than at the verdict. Blocks to send now."""
        self.now = now
        ended = [draft.end_extension() for draft in drafts]
        return self._finished_jobs() if any(ended) and self.critical is None else []

    def _finished_jobs(self) -> list[DraftedBlock]:
        """The speculative jobs done: each sent (or kept) as its kind says; then the follow-up's
        growth (growth.py): its first stop passed, it is sent, and what it adds after goes too."""
        grown = self._grown() + self._sent_now()
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
            early = self.sent_early.get(job.prepared_for)
            if early is None:
                if self.send_prepared:
                    sent.append(item)
            elif len(item.tokens) > len(early.tokens):  # sent before it ended: the rest, as a growth of it
                sent.append(growth_of(item, len(early.tokens), self.now))
        if any(job.followup and len(job.draft.block.tokens) == 1 for job in self.jobs):
            self._plan()  # the follow-up's first token is drafted: prepare for its likely rejections too
        return sent + grown

    def _grown(self) -> list[DraftedBlock]:
        """The follow-up past its first stop: sent then, and grown after each forward until its
        clock, the cap or a stop token ends it, or its verdict comes."""
        job = next((job for job in self.jobs if job.followup), None)
        if job is None or not (self.growth.grows(job) or (self._grows(job) and job.draft.extended)):
            return []
        if not self.growth.grows(job):
            self.growth.start(job, self._outgoing(job.draft, job.started_at, None, 0.0))
            self.outstanding.append(self.growth.item)
            self._plan()
            sent = [self.growth.item]
        else:
            more = self.growth.more(self.now, self._continues(job.draft.block))
            sent = [] if more is None else [more]
        if job.draft.done:
            self.growth.finish()
            self.jobs.remove(job)
        return sent

    def _sent_now(self) -> list[DraftedBlock]:
        """Prepared continuations drafting on past their stops, sent as they stand once their
        verdict is near (EARLY_FORWARDS). Sent only when they ended, about half reached the target
        after a verdict that came sooner than the mean wait, and at several sessions its next
        forward had begun without them. Each is sent once and drafts on (the rest follows as a
        growth of it when it ends); if the verdict uses it, what it drafted past the tokens the
        target held goes on as the next follow-up (pipelined.py ``_take_sent``). Greedy chains and
        flat trees, where the worker drafts for several sessions (at one, the target waits for a
        late one)."""
        if not (self.shared and self.send_prepared and self.outstanding) or self._sent_whole:
            return []
        ahead = self.now + EARLY_FORWARDS * (self.timing.forward_s.value or 0.0)
        if self.timing.room_for_a_forward(ahead, self.outstanding):
            return []
        sent = []
        for job in self.jobs:
            key, draft = job.prepared_for, job.draft
            if key is None or draft.done or not draft.extended or key in self.sent_early:
                continue
            item = self._outgoing(draft, job.started_at, key, 0.0)
            item.block, item.alternatives = draft.block.after(0), list(draft.alternatives)  # as sent: the job goes on
            self.sent_early[key] = item
            sent.append(item)
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
        followup = next((job.draft for job in self.jobs if job.followup and not self.growth.grows(job)), None)
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
        for it, no continuation waits for its place (a session that drafts one block at a time,
        without forks: a feature head, ``parallel`` 1), where sessions share the target its next
        token's chance to settle (at most the block's reach) beats what a verified node costs every
        session in the target's step (the target's ``node_price``; at one session the row rides
        free), and another forward ends before its verdict is due (VerdictTiming). Greedy only: a
        sampled session's blocks end by its tokens, never the clock (its seed reproduces). Measured
        with the EAGLE-3 head on emulated H100s: a follow-up drafting on held the one place,
        continuations were prepared after 7% of the rejections, and async made 0.91x sync
        (docs/benchmarks.md, one block at a time); at 32 sessions, 70B/1B, unpriced tokens past a
        stop carried six times sync's rows into each target forward (docs/benchmarks.md, a token
        drafted past a stop pays for its node)."""
        if job is self.critical or not self.outstanding or not self.session.sampling.greedy:
            return False
        if not self._forking and self.agenda:  # its place is wanted: the likeliest continuations go first
            return False
        if self.shared and job.draft.reach <= self.session.node_price:
            return False
        return self.timing.room_for_a_forward(self.now + (self.timing.forward_s.value or 0.0), self.outstanding)

    def _grows(self, job: Job) -> bool:
        """A greedy chain's or flat tree's follow-up grows at the target where other sessions keep
        it busy: at one session the target waits for a late follow-up, filling its first place
        itself (measured: docs/benchmarks.md, the follow-up that grows)."""
        return self.shared and job.followup and not self._sent_whole and self.session.sampling.greedy

    @property
    def _sent_whole(self) -> bool:
        """The session's blocks are sent whole, as they end, never grown at the target: its trees
        grow nodes below their siblings (deep, deep-auto), which follow the spine in the layout, so
        a longer spine would move them; the target refuses a growth of such a session
        (wire_checks.py). Whether one block may be cut is the block's own: ``BlockDraft.grows_below``."""
        return tree_grows(self.session.tree)


def work(draft: Stepping, now: float) -> list[DraftedBlock] | None:
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
