"""Who gives its KV pages back when a step does not fit (coordinator/session/pages.py): the newest
session that has computed its committed tokens and has not yielded MAX_YIELDS times already; a
session recomputing after a yield is not sent back mid-recompute while another can yield (review
L-4: a large late session once thrashed, its recompute chunks wasted each time). Before anyone
yields, the step sheds what it can do without: the follow-ups fed after their blocks, then the
riders."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.session.pages import MAX_YIELDS, PageLine


@dataclass
class Pool:
    pages: int = 100
    page_size: int = 16
    free_pages: int = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclass(eq=False)  # by identity, as a TargetSession: a key of the fed follow-ups
class Target:
    cached_tokens: int
    evictions: int = 0

    def evict(self) -> None:
        self.evictions += 1
        self.cached_tokens = 0


@dataclass
class Session:
    committed: list = field(default_factory=list)
    target: Target = None


def session(committed: int, cached: int) -> Session:
    return Session(list(range(committed)), Target(cached))


def test_the_newest_session_done_computing_yields_not_one_mid_recompute():
    line = PageLine(Pool())
    sessions = {"old": session(100, 100), "mid": session(200, 200), "late": session(4000, 64)}
    for sid in sessions:
        line.admit(sid, 0)
    line.waiting.clear()
    assert line.evict_newest(sessions, [])
    assert sessions["mid"].target.evictions == 1 and sessions["late"].target.evictions == 0


def test_a_session_that_yielded_max_times_yields_last():
    line = PageLine(Pool())
    sessions = {"a": session(50, 50), "b": session(50, 50)}
    for sid in sessions:
        line.admit(sid, 0)
    line.waiting.clear()
    for _ in range(MAX_YIELDS):
        assert line.evict_newest(sessions, [])
        line.waiting.clear()
        sessions["b"].target.cached_tokens = 50  # recomputed
    assert sessions["b"].target.evictions == MAX_YIELDS
    assert line.evict_newest(sessions, [])
    assert sessions["a"].target.evictions == 1  # b has yielded enough: the older one now


class ShortVerifier:
    """verify_apart that raises PoolFull while the step holds more than ``fits`` items (a job
    counts one, a rider one, a fed follow-up one), recording each try."""

    def __init__(self, fits: int):
        self.fits, self.tries = fits, []

    def verify_apart(self, jobs, budget, riders, lookahead):
        from svip_common.kv_cache import PoolFull

        self.tries.append((len(jobs), len(riders), len(lookahead or {})))
        if len(jobs) + len(riders) + len(lookahead or {}) > self.fits:
            raise PoolFull("no free pages")
        return [None] * len(jobs)


def test_a_short_pool_drops_the_fed_follow_ups_first_then_the_riders_then_a_session_yields():
    line = PageLine(Pool())
    sessions = {sid: session(50, 50) for sid in ("a", "b", "c")}
    for sid in sessions:
        line.admit(sid, 0)
    line.waiting.clear()
    ready = [(sid, s, None, None, None) for sid, s in sessions.items()]
    riders = [("r", session(10, 10))]
    lookahead = {sessions["a"].target: (1, 2), sessions["b"].target: (3,)}
    verifier = ShortVerifier(fits=2)
    verified, verdicts, rode = line.verify(verifier, sessions, ready, None, riders, lookahead)
    assert verifier.tries == [(3, 1, 2), (3, 1, 0), (3, 0, 0), (2, 0, 0)]
    assert [job[0] for job in verified] == ["a", "b"] and rode == [] and sessions["c"].target.evictions == 1
