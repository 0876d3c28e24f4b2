"""Who gives its KV pages back when a step does not fit (coordinator/session/pages.py): the newest
session that has computed its committed tokens and has not yielded MAX_YIELDS times already; a
session recomputing after a yield is not sent back mid-recompute while another can yield (review
L-4: a large late session once thrashed, its recompute chunks wasted each time)."""

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


@dataclass
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
