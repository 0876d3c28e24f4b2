"""The target's KV pages by use, across the sessions the host holds: a session takes pages as it
grows (not its worst case up front); when a step finds too few, the newest session gives its pages
back and waits in line, to be recomputed from its committed tokens once there is room again,
oldest first. A session also starts in line when there is no room for its prompt, or when others
already wait. Decides who yields and who goes next; the host runs the steps (host.py).

Who yields (review L-4: a large late session could be evicted again mid-recompute, each time the
others grew, its chunks wasted): the newest session that is not still computing its committed
tokens (a resumed or new one more than a page behind them) and has yielded fewer than
MAX_YIELDS times; only when every holder is one of those, the newest of them."""

from __future__ import annotations

import itertools
import logging

from svip_common.kv_cache import PoolFull

log = logging.getLogger(__name__)
WATERMARK_DIVISOR = 50  # a session starts or resumes only while 1/50 of the pool stays free after it
MAX_YIELDS = 3  # a session that gave its pages back this often is the last to give them back again


class PageLine:
    def __init__(self, pool):
        self.pool = pool
        self._order = itertools.count()
        self._started: dict[str, int] = {}  # session id -> when it started (the newest yields first)
        self.waiting: dict[str, int] = {}  # session id -> its place in line for pages (FIFO)
        self.preemptions = 0  # sessions that gave their pages back for a step to fit
        self.yields: dict[str, int] = {}  # session id -> times it gave its pages back

    def admit(self, session_id: str, prompt_tokens: int) -> None:
        """A new session: in line if others wait, or if its prompt has no room now."""
        self._started[session_id] = next(self._order)
        if self.waiting or not self.room_for(prompt_tokens + 1):
            self.waiting[session_id] = next(self._order)

    def forget(self, session_id: str) -> None:
        self._started.pop(session_id, None)
        self.waiting.pop(session_id, None)
        self.yields.pop(session_id, None)

    def room_for(self, tokens: int) -> bool:
        """Whether ``tokens`` more fit the pool now, with the watermark left over (so that the
        sessions running can grow a while before anyone yields)."""
        return self.pool.pages_for(tokens) + self._watermark() <= self.pool.free_pages

    def _watermark(self) -> int:
        return max(1, self.pool.pages // WATERMARK_DIVISOR)

    def resume(self, sessions: dict, blocks: dict[str, int]) -> None:
        """Sessions in line take their turn again, oldest first, each once its committed tokens
        and its next block (``blocks``: session id -> its tokens) fit."""
        if not self.waiting:
            return
        # nobody else holds pages: the head of the line takes what it needs, watermark or not (one
        # as large as the pool, which admission allows, would otherwise wait for ever); a session
        # resumed here holds none yet, so this stays true down the line
        alone = not any(sid not in self.waiting and s.target.cached_tokens for sid, s in sessions.items())
        for session_id in sorted(self.waiting, key=self.waiting.get):
            session = sessions.get(session_id)
            if session is None:
                self.waiting.pop(session_id)
                continue
            need = len(session.committed) + blocks.get(session_id, 0) + 1
            if not (self.room_for(need) or (alone and self.pool.pages_for(need) <= self.pool.free_pages)):
                return  # first come, first served: nobody passes the head of the line
            del self.waiting[session_id]

    def verify(self, verifier, sessions: dict, ready: list, budget: int | None,
               riders: list, lookahead: dict | None = None) -> tuple[list, list, list]:
        """The step's verdicts for the jobs of ``ready`` still holding their place, with the rows
        of ``riders`` (sessions waiting on their drafts, ``IdleWork.riders``) and the follow-ups
        of ``lookahead`` (Verifier.verify_batch's) in the same forward. When the pool is short the
        follow-ups go first, then the riders, then the newest session yields its pages until the
        step fits (PoolFull changes nothing). Returns (the jobs verified, their verdicts, the
        riders whose rows rode)."""
        while True:
            jobs = [job for job in ready if job[0] not in self.waiting]
            if not jobs:
                return [], [], []
            try:
                return jobs, verifier.verify_apart([(s.target, s.committed, checked) for _, s, _, checked, _ in jobs],
                                                   budget, [(s.target, s.committed) for _, s in riders],
                                                   lookahead), riders
            except PoolFull:
                if lookahead:
                    lookahead = None
                elif riders:
                    riders = []
                elif not self.evict_newest(sessions, [job[0] for job in jobs]):
                    raise

    def evict_newest(self, sessions: dict, stepping: list[str]) -> bool:
        """The newest session holding pages, or taking some in this step (sessions admitted
        together, none prefilled yet, can ask one step for more than the pool), gives them back
        and waits; whether one did."""
        holding = [sid for sid in sessions if sid not in self.waiting
                   and (sid in stepping or sessions[sid].target.cached_tokens)]
        if not holding:
            return False
        victim = max(holding, key=lambda sid: self._yields_first(sid, sessions[sid]))
        sessions[victim].target.evict()
        self.waiting[victim] = next(self._order)
        self.preemptions += 1
        self.yields[victim] = self.yields.get(victim, 0) + 1
        log.info("session %s gave its KV pages back for the step to fit (%d free of %d); it waits its turn",
                 victim, self.pool.free_pages, self.pool.pages)
        return True

    def _yields_first(self, session_id: str, session) -> tuple[bool, bool, int]:
        """Greater yields first: done computing its committed tokens, under MAX_YIELDS, newest."""
        computing = len(session.committed) - session.target.cached_tokens > self.pool.page_size
        return not computing, self.yields.get(session_id, 0) < MAX_YIELDS, self._started.get(session_id, -1)
