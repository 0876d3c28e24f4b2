"""Sessions that begin alike share the pages of what they share: a request's ``n`` choices (one
prompt, a session each), requests behind one system prompt. A session with a page or more of its
committed tokens uncached starts from the longest prefix of them that another open session's
cache holds (at least a page more than its own, never its last token, whose row it computes
itself): a fork of that cache (svip_common/kv_cache.py, copy on write), rolled back to the
prefix, so its prefill runs only the rest. A session that would prefill, in the same step, a page
or more of what an earlier session of that step is prefilling waits one step instead and then
forks it (``waits``): n choices sent at once prefill their prompt once. One worker's sessions (a
pool's): the target's verifier and the draft's drafter each keep one ``PromptSharing``; a session
is anything with a ``sequence`` (its PagedSequence).

The keys and values shared are the model's for the same tokens at the same positions, as its own
prefill computes them (a forward's rows do not depend on what else is in its batch beyond float
rounding, as batching and chunked prefill already rely on): the output is unchanged. A feature
draft's target (feature_layers) does not share: the draft needs every prompt position's features
from the session's own forwards.

Greedy sessions only. A forked session computes its last prompt token in a forward of its own,
where its own prefill would have computed it among the rest: the same values to float rounding,
not always to the bit. A sampled request's tokens follow the target's distribution either way,
but a seeded one must reproduce, and whether another session held its prompt at that moment is
not the request's to decide (CI caught a seeded tree request drawing another token at place 12
when the draft forked a cache its previous run had not yet closed). No torch here."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from svip_common.sequences import common_prefix


class PromptSharing:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size, self.enabled = page_size, enabled
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # open sessions (a closed one leaves)
        self.shared_tokens = 0  # tokens sessions took from others' pages instead of computing them

    def add(self, session) -> None:
        self._sessions.add(session)

    def discard(self, session) -> None:
        self._sessions.discard(session)

    def take(self, session, committed: Sequence[int]) -> int:
        """A session with a page or more of ``committed`` uncached starts from the longest prefix of
        it (but its last token) that another open session's cache holds, where that is a page more
        than its own holds; the tokens taken (0: none)."""
        if not self._may_prefill(session, committed):
            return 0
        held = common_prefix(session.sequence.tokens, committed)
        if len(committed) - 1 - held < self.page_size:
            return 0
        best, source = held + self.page_size - 1, None
        for other in list(self._sessions):
            if other is not session and len(other.sequence) >= self.page_size:
                shared = min(common_prefix(other.sequence.tokens, committed), len(committed) - 1)
                if shared > best:
                    best, source = shared, other
        if source is None:
            return 0
        session.sequence.close()
        session.sequence = source.sequence.fork()
        session.sequence.rollback(best)
        self.shared_tokens += best - held
        return best - held

    def _may_prefill(self, session, committed: Sequence[int]) -> bool:
        """Whether the session's cache is more than a page shorter than its committed tokens: the
        usual decode step is not (nothing is looked up there, whatever the context's length; a
        cache that parted from its committed tokens at an earlier place is looked at once it is
        that short, as after an eviction)."""
        return self.enabled and session.sampling.greedy and len(committed) - len(session.sequence) > self.page_size

    def waits(self, session, committed: Sequence[int], prefilling: list[Sequence[int]]) -> bool:
        """Whether the session waits a step: an earlier session of this step prefills a page or
        more of its committed tokens beyond what its cache holds (the next step forks them)."""
        if not prefilling or not self._may_prefill(session, committed):
            return False
        held = common_prefix(session.sequence.tokens, committed)
        return any(min(common_prefix(other, committed), len(committed) - 1) >= held + self.page_size
                   for other in prefilling)
