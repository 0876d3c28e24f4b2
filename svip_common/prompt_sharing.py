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

A sampled session's draws must reproduce from its seed alone, whether or not another session
held its prompt at that moment (CI once caught a seeded tree request drawing another token at
place 12 when the draft forked a cache its previous run had not yet closed): a fork must compute
what the session alone would have, to the bit. So a sampled session prefills a page or more in two
forwards (``splits``): every uncached token but the last, then the last in a forward of its own,
as a fork of its prompt does; and it forks only a sampled session whose prompt had its length and
its tokens but the last, whose own split prefill therefore computed the same rows in the same
shapes (``_may_fork``): a request's n choices, the same request twice. Not a prefix of another
prompt, a greedy session's or a scoring request's (``computes_own``): their prefill computed
those rows in a longer forward, equal only to float rounding. What a split costs: one more
forward of a token per sampled session, on each side. (In a batch, the other rows of a forward
move a row's last bits as well, as in any batched engine: a seed reproduces to the bit where the
batch does, and to float rounding otherwise.)
Tenants stay apart: a session shares only with sessions of its own scope (``cache_scope``: the
server's is a digest of the API key, or of the request where the API is open, and of the request's
cache_salt; a request's n choices always share one). Across scopes nothing is forked and nothing
waits, so neither the pages, the counter nor a prefill's time tell one tenant what another's
prompt holds.
No torch here."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from svip_common.sequences import common_prefix


class PromptSharing:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size, self.enabled = page_size, enabled
        # False: no session forks another's pages, sampled ones still split (a measurement's
        # "apart", whose outputs equal the shared ones': svip bench --mode choices)
        self.forks = True
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # open sessions (a closed one leaves)
        self._prompt_lens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a session's prompt's length
        self._scopes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a session's cache scope
        self._own: weakref.WeakSet = weakref.WeakSet()  # sessions that compute their whole prompt (computes_own)
        self.shared_tokens = 0  # tokens sessions took from others' pages instead of computing them

    def add(self, session, prompt_len: int = 0, scope: str = "") -> None:
        """An open session; prompt_len: its prompt's (0: not known, and a sampled one forks none of it);
        scope: the sessions it may share with (those of the same scope)."""
        self._sessions.add(session)
        self._prompt_lens[session] = prompt_len
        self._scopes[session] = scope

    def computes_own(self, session) -> None:
        """A scoring request's session: it computes every row of its prompt itself (it forks none:
        each row is scored), in the shapes of a chunked prefill, so a sampled session forks none of
        it either."""
        self._prompt_lens[session] = 0
        self._own.add(session)

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
                if shared > best and self._may_fork(session, other, committed, shared):
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
        return (self.enabled and self.forks and len(committed) - len(session.sequence) > self.page_size
                and session not in self._own)

    def _may_fork(self, session, other, committed: Sequence[int], shared: int) -> bool:
        """Whether the session may take ``shared`` of its committed tokens from the other's cache:
        never across scopes; a greedy one, any; a sampled one, all but its last, from a sampled
        session whose prompt had its length (so that its rows are those the session's own split
        prefill computes)."""
        if self._scopes.get(session, "") != self._scopes.get(other, ""):
            return False
        if session.sampling.greedy:
            return True
        return (not other.sampling.greedy and shared == len(committed) - 1
                and self._prompt_lens.get(other) == len(committed))

    def splits(self, session, uncached: int) -> bool:
        """Whether a session whose cache lacks ``uncached`` of its committed tokens computes all but
        the last of them first, and the last in a forward of its own: a sampled one that could have
        forked them (a page and more), so that its rows are the same either way."""
        return self.enabled and not session.sampling.greedy and uncached - 1 >= self.page_size

    def waits(self, session, committed: Sequence[int], prefilling: list[tuple[object, Sequence[int]]]) -> bool:
        """Whether the session waits a step: an earlier session of this step (prefilling: each one's
        session and committed tokens) prefills a page or more of its committed tokens beyond what
        its cache holds, which it may fork (the next step forks them)."""
        if not prefilling or not self._may_prefill(session, committed):
            return False
        held = common_prefix(session.sequence.tokens, committed)
        for other, tokens in prefilling:
            shared = min(common_prefix(tokens, committed), len(committed) - 1)
            if shared >= held + self.page_size and self._may_fork(session, other, committed, shared):
                return True
        return False
