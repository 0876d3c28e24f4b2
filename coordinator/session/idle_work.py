"""What the target does for the sessions waiting on their drafts, instead of idling or beside its
steps. A greedy one settles the target's own next token where its row is stored
(SessionPipeline.wants_fill: no forward), and a forward takes in what they need first (the last
verdict's or that token, a new prompt) after which they settle the next. So a greedy session whose
block is late is decoded by the target alone meanwhile, and the block is checked against those
tokens when it comes.

That forward is one of two kinds. While no block is ready, a forward of its own (a prefill),
for the sessions whose rows save more than the forward holds up the blocks due meanwhile
(``prefills_that_pay``, from each session's measured round trip, drafting and acceptance): at one
session, where its block comes later than a one-token forward; with several, while it ends before
the next block is due or saves more than it delays (a fill, settling a stored row, needs no
forward and always runs). While blocks are ready, those with a stored row settle its token first
(``fill_beside``), and the waiting sessions' rows ride the step that verifies them (riders): each
settles one token (finding a block that parts from it a forward sooner) and adds its row's time
to every session in the step, so it rides while the step's tokens per second rise, priced by the
target's measured cost of a row and the tokens a verified block settles (``riders``). On a GPU,
where a row is nearly free, every waiting session rides; where rows cost what a CPU's do, fewer.
Neither with a feature draft, which needs the target's features of every token, handed over with
verdicts. And while blocks are ready, the step may wait a moment for the blocks of sessions whose
drafts are drafting them after a verdict, where what they bring outweighs the time it loses
(``holds_step``, priced by svip_common/arrivals.py from the recent delays from a verdict to its
next block). Runs on the target's compute thread (the host's batched step calls it, host.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from coordinator.session.effects import Settle
from svip_common.arrivals import BlockArrivals
from svip_common.errors import exit_on_device_failure
from svip_common.step_cost import Ewma, prefills_that_pay
from target_worker.verifier import Verifier

log = logging.getLogger(__name__)
SETTLED_WEIGHT = 0.1  # of the newest step, in the running mean of the tokens a verified block settles


class IdleWork:
    def __init__(self, verifier: Verifier, mode: str, max_batched_tokens: int | None, clock: Callable[[], float]):
        """mode: "auto" (where it pays), "always", "off" (checked already)."""
        self.verifier, self.mode, self.max_batched_tokens, self.clock = verifier, mode, max_batched_tokens, clock
        self.prefills = 0  # sessions advanced by a prefill while idle
        self.fills = 0  # tokens greedy sessions settled from the target alone while they waited on their drafts
        self.rides = 0  # rows that rode a verification step for sessions waiting on their drafts
        self.settled = Ewma(SETTLED_WEIGHT, empty=1.0)  # tokens a verified block settles (recent steps' mean)
        self.arrivals = BlockArrivals()  # delays from a verdict to its session's next block (hold_s)
        self.holds = 0  # steps held for blocks about to come
        self._hold_until: float | None = None  # the step with blocks ready waits for more until then
        self._held_since: float | None = None  # since when it has waited

    def run(self, sessions: dict, out_of_pages: dict, step: Callable[..., None]) -> bool:
        """One unit of it for ``sessions`` (less those waiting for KV pages, ``out_of_pages``);
        step(session_id, event, *args): runs one event of that session and carries out its
        effects, which it returns (None: the event failed, and ended the session alone).
        Returns whether it did anything."""
        if self.mode == "off":
            return False
        filled = self.fill_beside(sessions, out_of_pages, step)
        return self._prefill(sessions, out_of_pages, step, self._fills(out_of_pages)) or filled

    def fill_beside(self, sessions: dict, out_of_pages: dict, step: Callable[..., None]) -> bool:
        """The greedy sessions waiting on their drafts settle the target's own token where its row
        is stored (a fill: no forward): while the target idles (``run``, before any prefill), and
        before a step that verifies blocks, so that their next row may ride it (``riders``) rather
        than wait for the block with a token already known. Whether any settled."""
        if self.mode == "off" or not self._fills(out_of_pages):
            return False
        now = self.clock()
        return self._fill(sessions, step, now, now)

    def _fills(self, out_of_pages: dict) -> bool:
        """Whether stored rows' tokens may settle now: not with a feature draft (it needs the
        target's features of every token), nor while a session waits for KV pages."""
        return not self.verifier.feature_layers and not out_of_pages

    def _fill(self, sessions: dict, step, started: float, ended: float) -> bool:
        """Greedy sessions waiting on their drafts settle the target's own next token where its
        row is stored; started, ended: the forward that stored them (equal: none now)."""
        settled = []
        for session_id, session in list(sessions.items()):
            if session.wants_fill():
                effects = step(session_id, session.fill, started, ended) or []
                settled.append(any(isinstance(effect, Settle) for effect in effects))
        self.fills += sum(settled)
        return any(settled)

    def _prefill(self, sessions: dict, out_of_pages: dict, step, fills: bool) -> bool:
        """One forward that takes in what the sessions waiting on their drafts will need first,
        where that pays; then (fills) greedy ones settle the token its rows give. Returns whether
        it ran a forward."""
        started = self.clock()
        waiting = self._to_prefill(sessions, out_of_pages, started)
        if not waiting:
            return False
        try:
            advanced = self.verifier.prefill_next([(s.target, s.committed) for s in waiting], self.max_batched_tokens)
        except Exception as exc:  # the verification that follows meets the failure and ends the sessions
            exit_on_device_failure(exc)
            log.exception("prefill while idle failed")
            return False
        ended = self.clock()
        for session in waiting:
            session.log.busy("target", started, ended)
        self.prefills += advanced
        if fills:
            self._fill(sessions, step, started, ended)
        return advanced > 0

    def _to_prefill(self, sessions: dict, out_of_pages: dict, now: float) -> list:
        """The sessions a prefill takes in now: every one lacking its next row (always), else
        those owing their prompt and those whose rows pay (prefills_that_pay)."""
        lacking = [s for sid, s in sessions.items() if sid not in out_of_pages and s.wants_prefill()]
        if self.mode == "always":
            return lacking
        owed = [s for s in lacking if s.prompt_owed]
        priced = [s for s in lacking if not s.prompt_owed]
        verify = self.verifier.cost
        waits = [w for w in (s.block_wait(now) for s in sessions.values()) if w is not None]
        chosen = prefills_that_pay([(s.uncached_tokens, s.prefill_gain(verify)) for s in priced], waits, verify,
                                   sum(s.uncached_tokens for s in owed))
        return owed + [priced[i] for i in chosen]

    def riders(self, sessions: dict, ready: list, out_of_pages: dict) -> list:
        """The (id, session) of the sessions waiting on their drafts whose next row rides the step
        that verifies ``ready`` (the host's jobs): cheapest first, each while the step's tokens per
        second rise with it. A row adding ``a`` seconds to a forward of F seconds that settles S
        tokens, and gaining v (``ride_value``), pays when (S + v) / (F + a) > S / F: a·S < v·F."""
        if self.mode == "off" or self.verifier.feature_layers:
            return []
        stepping = {job[0] for job in ready}
        waiting = sorted(((sid, s) for sid, s in sessions.items()
                          if sid not in stepping and sid not in out_of_pages and s.wants_ride()),
                         key=lambda item: item[1].uncached_tokens)
        if self.mode == "always":
            return waiting
        cost = self.verifier.decode_cost
        forward = self._forward_s(ready)
        settles = len(ready) * self.settled.value
        chosen = []
        for sid, session in waiting:
            adds, value = cost.per_item * session.uncached_tokens, session.ride_value
            if adds * settles >= value * forward:
                continue
            chosen.append((sid, session))
            forward, settles = forward + adds, settles + value
        return chosen

    def holds_step(self, sessions: dict, ready: list, out_of_pages: dict) -> bool:
        """Whether the step that verifies ``ready`` (the host's jobs) waits for blocks about to
        come (``hold_s``), priced again at each arrival: a block that came may make the rest worth
        a longer wait, or none. A step waits no longer in all than its forward takes; the compute
        loop calls again when the hold's time is up (``wake_in``)."""
        now = self.clock()
        if self._hold_until is not None and now >= self._hold_until:  # its time is up
            self.drop_hold()
            return False
        held = 0.0 if self._held_since is None else now - self._held_since
        hold = self.hold_s(sessions, ready, out_of_pages, now, held)
        if hold <= 0.0:
            self.drop_hold()
            return False
        if self._held_since is None:
            self._held_since = now
            self.holds += 1
        self._hold_until = now + hold
        return True

    def wake_in(self) -> float | None:
        """While a step waits for blocks about to come, the seconds left until it starts anyway
        (whether or not they came); None otherwise."""
        return None if self._hold_until is None else max(0.0, self._hold_until - self.clock())

    def drop_hold(self) -> None:
        """No step is held any more (none has blocks ready): nothing to wake for."""
        self._hold_until = self._held_since = None

    def end_hold(self) -> None:
        """The held step starts at the next look (``holds_step``): its time is up (the in-memory
        transports, which run time themselves, call this where a real loop's timeout would fire)."""
        if self._hold_until is not None:
            self._hold_until = -math.inf

    def hold_s(self, sessions: dict, ready: list, out_of_pages: dict, now: float, held: float = 0.0) -> float:
        """How long the step that verifies ``ready`` (the host's jobs) waits for the blocks of the
        sessions waiting on their drafts after a verdict (0: it starts now), priced by
        svip_common/arrivals.py: each such block adds what a verified block settles, less the
        token the target settles for a greedy one alone meanwhile where it may (from its stored
        row, or its row riding the step); held: the seconds the step has waited already (in all
        it waits no longer than its forward). Only where work is priced ("auto")."""
        if self.mode != "auto" or not self.arrivals.known or not self.verifier.decode_cost.observed:
            return 0.0
        stepping, fills = {job[0] for job in ready}, self._fills(out_of_pages)
        settles = self.settled.value
        waiting = []
        for sid, session in sessions.items():
            waited = session.block_waited(now) if sid not in stepping and sid not in out_of_pages else None
            if waited is not None:
                waiting.append((waited, settles - (1.0 if fills and session.wants_fill() else 0.0)))
        if not waiting:
            return 0.0
        forward = self._forward_s(ready)
        return self.arrivals.hold_s(waiting, forward, len(ready) * settles, forward - held)

    def _forward_s(self, ready: list) -> float:
        """The step that verifies ``ready`` (the host's jobs) as its measured decode cost prices it."""
        return self.verifier.decode_cost.time(sum(job[3].nodes + 1 for job in ready))

    def ridden(self, riders: list, verdicts: list, step: Callable[..., None], started: float, ended: float) -> None:
        """After the step: the riders settle the token their rows give (fill), and the tokens the
        step's verified blocks settled are learnt."""
        settled = [v.accepted + 1 for v in verdicts if v is not None and not isinstance(v, Exception)]
        if settled:
            self.settled.update(sum(settled) / len(settled))
        self.rides += len(riders)
        if riders:
            self._fill(dict(riders), step, started, ended)
