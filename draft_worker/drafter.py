"""The drafter: hosts the draft model and proposes one variable-length block per round.

A ``DraftSession`` holds one request's place in the drafter's paged KV pool and its length policy.
A block is drafted a forward at a time (``BlockDraft``): it first rolls the sequence back to what
is still valid for the committed sequence (the rollback after a rejection), then drafts until the
policy, the hard cap, EOS or the token budget stops it. ``Drafter.step`` advances many blocks of
many sessions by one token each in one forward; each block still stops at its own place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from draft_worker.policies import LengthPolicy, make_policy
from svip_common.contracts import Block, PolicyConfig, SamplingParams, StepState
from svip_common.errors import exit_on_device_failure, narrowed
from svip_common.grammar_mask import grammar_tokenizer
from svip_common.kv_cache import KVPool
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import LoadedModel
from svip_common.prompt_sharing import PromptSharing
from svip_common.randomness import Purpose, uniform
from svip_common.rejection import recover
from svip_common.row_rules import RowRules
from svip_common.sampling import (
    HOST_DEVICES,
    entropy,
    greedy_top_on_host,
    mask_padding,
    sample_indices,
    warp_probs,
)
from svip_common.trees import (
    CAPE_WIDEST,
    GROWN_WIDEST,
    MAX_TREE_NODES,
    cape_siblings,
    grown_children,
    grows_last_place,
    kept_places,
    q_rows_within,
    sibling_nodes,
)
from svip_common.trees import grows as tree_grows
from svip_common.trees import priced as tree_priced


class Drafter:
    """The draft model and its KV pool, shared by the sessions it opens."""

    grows = True  # trees deep and deep-auto: a block's siblings get children of their own (rows from its forwards)
    # what a block's own work on each token (q, its entropy, the policy) is timed by, into the drafting time
    # its block reports (draft_s); the simulated pair sets its host-scaled clock, so that none of this
    # machine's time enters virtual time unscaled (the target prices a block's wait by it)
    host_timer = staticmethod(time.perf_counter)

    def __init__(self, draft: LoadedModel, target_vocab_size: int, token_limit: int | None = None,
                 kv_cache_tokens: int = DEFAULT_KV_TOKENS, max_batched_tokens: int | None = None):
        """max_batched_tokens: at most this many tokens in one draft forward (None: no limit): a
        block whose uncached prefix (a new prompt) does not fit is prefilled a chunk per step."""
        self.draft = draft
        self.max_batched_tokens = max_batched_tokens
        self.width = target_vocab_size  # q is laid over the target's vocabulary
        self.token_limit = min(draft.token_limit, target_vocab_size) if token_limit is None else token_limit
        self.pool = KVPool(draft.model, kv_cache_tokens)
        self.sharing = PromptSharing(self.pool.page_size)  # sessions that begin alike (svip_common/prompt_sharing.py)
        self.timing = None  # device timing on this machine (svip_common/device_timing.py)

    def time_as(self, timing) -> None:
        """Device timing on this machine (svip_common/device_timing.py): each draft step lasts its
        step model's time (a feature head has no pool: its step is timed as a whole)."""
        self.timing = timing
        if self.pool is not None:
            self.pool.timing = timing

    @torch.inference_mode()
    def step(self, drafts: Sequence[BlockDraft]) -> None:
        """One draft forward that advances every unfinished block by one token, within
        max_batched_tokens: a block whose pending tokens (a prompt's prefill) do not fit the room
        left gets a chunk of them and no token this step (the first always advances). A deep
        tree's last place's siblings ride beside its token (their rows give their children), or
        go alone once its spine is done."""
        live = [d for d in drafts if not d.done]
        if not live:
            return
        room = self.max_batched_tokens if self.max_batched_tokens is not None else float("inf")
        steps, drafting, prompts = [], [], []  # prompts: what this forward prefills (prompt_sharing.py)
        riding = []  # deep trees: (block, its step) whose last place's siblings ride in this forward
        for d in live:
            if d._riders and d._spine_done:  # the last place's siblings: a forward of their own
                steps.append((d._seq, [t for _, t in d._riders], len(d._riders), [-1] * len(d._riders)))
                riding.append((d, len(steps) - 1))
                room -= len(d._riders)
                continue
            if d.cache is None and self._shared(d, prompts):
                continue  # an earlier block of this step prefills its prompt: the next step forks it
            pending = d._pending
            if len(pending) > 1:
                prompts.append((d._session, d._context))
            splits = self.sharing.splits(d._session, len(pending))  # its last token: next step
            if (len(pending) > room or splits) and len(pending) > 1:
                chunk = int(min(room, len(pending) - 1)) if room >= 1 else 0
                if chunk > 0:  # the prefix goes in; the rest, with the block's next token, later
                    steps.append((d._seq, pending[:chunk], 0))
                    d._pending = pending[chunk:]
                    room -= chunk
                continue
            if d._riders:  # the last place's siblings beside its token: each a child of the token before
                riders = [t for _, t in d._riders]
                steps.append((d._seq, pending + riders, 1 + len(riders), [-1] * (1 + len(riders))))
                riding.append((d, len(steps) - 1))
            else:
                steps.append((d._seq, pending, 1))
            drafting.append((d, len(steps) - 1))
            d._prefilling = len(pending) > PREFILL_TOKENS
            room -= len(pending) + len(d._riders)
        rows, _, elapsed = self.pool.timed_forward(steps)
        share = elapsed / len(steps)  # each block's part of the forward
        for d, at in riding:  # before the spine's rows: absorbing them sets the next place's riders
            riders = rows[at][-len(d._riders):]
            d._seq.rollback(len(d._seq) - len(d._riders))  # the siblings' keys and values go
            self._grow(d, riders, share if d._spine_done else 0.0)
        self._absorb_rows([d for d, _ in drafting], [rows[at][:1] for _, at in drafting], share)

    def _shared(self, d: BlockDraft, prompts: list[Sequence[int]]) -> bool:
        """A block on its session's own cache starts from another session's pages of its prompt
        where they hold a page more (its pending tokens shrink to the rest); True: it waits a step
        for an earlier block of this one that prefills a page more of it."""
        if d.pending_tokens <= self.pool.page_size:
            return False
        if self.sharing.take(d._session, d._context):
            d._pending = d._session._resume(d._context)
        return self.sharing.waits(d._session, d._context, prompts)

    def _absorb_rows(self, drafting: list[BlockDraft], rows: list[torch.Tensor], share: float) -> None:
        """Each drafting block's next token from its row of logits [1, draft_vocab], chosen in
        one batched pass per warp."""
        groups: dict[tuple, list[int]] = {}  # blocks whose q is warped alike: one batched pass each
        for i, d in enumerate(drafting):
            groups.setdefault(d._session.sampling.warp_key, []).append(i)
        for indices in groups.values():
            blocks = [drafting[i] for i in indices]
            # a warp or draw that raises for one request's values fails its block, not the step
            # (svip_common.errors.narrowed; the rows are computed already: only the choice runs again)
            chosen_all = narrowed(lambda part: self._choose([b for b, _ in part], torch.cat([r for _, r in part])),
                                  [(b, rows[i]) for b, i in zip(blocks, indices)])
            for draft, chosen in zip(blocks, chosen_all):
                if isinstance(chosen, Exception):
                    draft._fail(chosen)
                    continue
                try:
                    draft._absorb(share, *chosen)
                except Exception as exc:  # its policy's own work (should_stop): this block alone
                    exit_on_device_failure(exc)
                    draft._fail(exc)

    def _grow(self, d: BlockDraft, rows: torch.Tensor, forward_s: float) -> None:
        """A deep tree: the children of the block's riders (its last place's siblings) from their
        rows [riders, vocab], under the request's rules along each sibling's path."""
        try:
            logits = mask_padding(self._widen(rows), self.token_limit)
            rules = d._session.rules
            if rules.active:  # each sibling's row by its own path
                spine = d.block.tokens
                paths = [spine[:place] + [t] for place, t in d._riders] if rules.by_place else ()
                logits = rules.apply(logits, d._context, paths)
            q = warp_probs(logits, d._session.sampling)
            top = torch.topk(q, min(GROWN_WIDEST, q.shape[-1]), dim=-1)
            ranked = [list(zip(ids, probs)) for ids, probs in zip(top.indices.tolist(), top.values.tolist())]
        except Exception as exc:  # this request's own values: this block alone
            exit_on_device_failure(exc)
            d._fail(exc)
            return
        d._grown(ranked, forward_s)

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [B, draft_vocab] laid over the target's vocabulary [B, width]."""
        return _to_width(logits, self.width)

    def _choose(self, blocks: list[BlockDraft], logits: torch.Tensor) -> list[tuple]:
        """Each block's next token from its row of logits [B, draft_vocab], the blocks sharing one
        warp: (token, q(token), the entropy of q, the most likely tokens with their q, q when
        sampled), worked out for all of them at once and read to the host in one copy. A sampled
        token is drawn with the uniform keyed by its session's seed and its position; a greedy one
        on a host device is read off q with numpy (``_greedy_on_host``)."""
        sampling = blocks[0]._session.sampling
        logits = mask_padding(self._widen(logits), self.token_limit)
        if any(b._session.rules.active for b in blocks):  # each request's own
            logits = torch.cat([b._ruled(row[None]) for row, b in zip(logits, blocks)])
        runners_up = max(b._runners_up for b in blocks)
        if sampling.greedy and logits.device.type in HOST_DEVICES:
            return _greedy_on_host(logits, runners_up)
        q = warp_probs(logits, sampling)  # [B, vocab]
        if sampling.greedy:
            tokens = torch.argmax(q, dim=-1, keepdim=True)  # [B, 1]
        else:
            keyed = [uniform(b._session.sampling.seed, b.block.base + len(b.block), Purpose.DRAFT) for b in blocks]
            tokens = sample_indices(q, torch.tensor(keyed, dtype=torch.float64, device=q.device))[:, None]
        parts = [tokens.double(), q.gather(-1, tokens).double(), entropy(q).double()[:, None]]
        if runners_up:  # the runners-up only where a block keeps them
            top = torch.topk(q, min(runners_up + 1, q.shape[-1]), dim=-1)
            parts += [top.indices.double(), top.values.double()]
        host = torch.cat(parts, dim=-1).tolist()  # the one host read
        n, kept = (len(host[0]) - 3) // 2, None if sampling.greedy else q
        return [
            (int(row[0]), row[1], row[2], list(zip(map(int, row[3 : 3 + n]), row[3 + n :])),
             None if kept is None else kept[i])
            for i, row in enumerate(host)
        ]

    def grammar_tokenizer(self):
        """The draft's tokenizer as structured output's matchers read it, over the target's vocabulary
        (None: it has none)."""
        return None if self.draft.tokenizer is None else grammar_tokenizer(self.draft.tokenizer, self.width)

    def open(
        self, sampling: SamplingParams, policy: PolicyConfig, stop_token_ids: Sequence[int], prompt_len: int = 0,
        cache_scope: str = "",
    ) -> DraftSession:
        """cache_scope: the sessions it may share KV pages with (svip_common/prompt_sharing.py)."""
        session = DraftSession(self, sampling, make_policy(policy), stop_token_ids, policy.tree, prompt_len)
        self.sharing.add(session, prompt_len, cache_scope)
        return session


class DraftSession:
    can_fork = True  # blocks drafted side by side on forks of its cache (``begin(fork=True)``)
    tree = "off"  # "cape" / "auto": each block a token tree (svip_common/trees.py); else a chain
    node_price = 0.0  # a verified node's price in tokens (the caller sets it from the load; "auto" prices its
    # siblings by it, any tree the places a continuation taken up past a sibling keeps, an async session
    # each token a block drafts past its stop)
    forward_price = 0.0  # tree "deep-auto": a draft forward of a block's own, in tokens (trees.forward_price;
    # the caller sets it from the session's rate; 0: free)
    drafted = accepted = 0  # tokens of its blocks the verdicts judged, and of them accepted (``feedback``)

    def __init__(
        self,
        drafter: Drafter,
        sampling: SamplingParams,
        policy: LengthPolicy,
        stop_token_ids: Sequence[int],
        tree: str = "off",
        prompt_len: int = 0,
    ):
        """tree: "cape" or "auto": each block a token tree (svip_common/trees.py); "off": a chain.
        prompt_len: the request's, for its penalties (the draft drafts under the target's rules)."""
        self.sampling = sampling
        tokenizer = drafter.grammar_tokenizer() if sampling.grammar is not None else None  # structured output
        self.rules = RowRules.of(sampling, prompt_len, frozenset(stop_token_ids), tokenizer)  # row_rules.py
        self.policy = policy
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tree = tree
        self._drafter = drafter
        self._seq = drafter.pool.sequence()
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0  # of forward_s, the forwards that took in a prefix (a prompt)
        self.compute_s = 0.0  # forward_s and the work on each drafted token (q, its entropy, the policy)

    @property
    def cached_tokens(self) -> int:
        return len(self._seq)

    @property
    def sequence(self):
        """The session's own cache (what another session may share: svip_common/prompt_sharing.py)."""
        return self._seq

    @sequence.setter
    def sequence(self, cache) -> None:
        self._seq = cache

    def close(self) -> None:
        """Give the session's pages back to the pool."""
        self._drafter.sharing.discard(self)
        self._seq.close()

    def propose(self, committed: Sequence[int], budget: int) -> Block:
        """Draft at most ``budget`` tokens after ``committed``."""
        draft = self.begin(committed, budget)
        while not draft.done:
            draft.step()
        return draft.block

    def begin(self, committed: Sequence[int], budget: int, alternatives: bool = False,
              fork: bool = False) -> BlockDraft:
        """A block to draft after ``committed``, a forward at a time (``BlockDraft.step``); the
        cache rolls back to what ``committed`` still shares. One at a time on the session's cache:
        beginning another there abandons this one. alternatives: keep each token's runners-up (to
        prepare continuations for rejections). fork: drafted on a fork of the cache (its pages
        shared, copied on write), beside the block on the cache itself; ``adopt`` or ``release``
        the fork (``BlockDraft.cache``) when done with it."""
        return BlockDraft(self, committed, budget, alternatives, self._seq.fork() if fork else None)

    def adopt(self, cache) -> None:
        """A fork's block is what comes next: the fork becomes the session's cache."""
        if cache is not self._seq:
            self._seq.close()
            self._seq = cache

    def release(self, cache) -> None:
        """A fork no longer needed: its pages go back (the ones it shares stay with their holders)."""
        if cache is not self._seq:
            cache.close()

    def feedback(self, drafted: int, accepted: int) -> None:
        self.policy.update(drafted, accepted)
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    @property
    def acceptance(self) -> float:
        """The share of its drafted tokens the target accepted so far (1 before any verdict)."""
        return self.accepted / self.drafted if self.drafted else 1.0

    def take_features(self, features: torch.Tensor | None, first: int) -> None:
        """A token draft reads no target features."""

    def _resume(self, committed: Sequence[int], cache=None) -> list[int]:
        """Roll the cache (the session's, or a fork of it) back to what ``committed`` still shares
        (all but its last token at most, whose logits the block's first forward gives): the
        tokens the first forward takes in."""
        kept = (cache or self._seq).rollback_to_prefix_of(committed, limit=len(committed) - 1)
        return list(committed[kept:])

    @torch.inference_mode()
    def resolve_correction(self, block: Block, accepted: int, p_row: torch.Tensor) -> int:
        """After a sampled rejection whose q stayed here: draw the correction for position
        block.base + accepted from norm(max(0, p - q)), p sent by the target."""
        position = block.base + accepted
        u = uniform(self.sampling.seed, position, Purpose.RESOLVE)
        return recover(p_row.to(block.q_rows.device).float(), block.q_rows[accepted], u)



PREFILL_TOKENS = 8  # a forward taking in more of a block's pending tokens than this is a prefill
ALTERNATIVES = 5  # per drafted token, the next most likely tokens are kept (what a rejection may settle)


class BlockDraft:
    """One block being drafted, one forward per ``step``, until the policy, the cap, a stop token
    or the budget ends it. Keeps, per drafted token, the draft's next most likely tokens and
    their probabilities: where a rejection would most likely land, and what it would settle."""

    def __init__(self, session: DraftSession, committed: Sequence[int], budget: int, alternatives: bool = False,
                 cache=None):
        """cache: a fork of the session's cache to draft on (None: the session's own)."""
        self._session = session
        self.cache = cache  # a fork: the owner adopts or releases it when done
        self._keep_alternatives = alternatives
        self._tree = session.tree != "off"
        self._price = session.node_price if tree_priced(session.tree) else 0.0
        self._forward_price = session.forward_price if tree_priced(session.tree) else 0.0
        self.reach = 1.0  # the draft's chance that its tokens so far are all accepted
        self._grows = tree_grows(session.tree) and session._drafter.grows
        # a deep tree: the last place's siblings, (place, token), whose rows the next forward gives
        # (beside the spine's next token, or alone once the spine is done); their paths' probability
        # under the draft; the children grown so far, (place, sibling) -> tokens
        self._riders: list[tuple[int, int]] = []
        self._sibling_reach: dict[tuple[int, int], float] = {}
        self._children: dict[tuple[int, int], list[int]] = {}
        self._spine_done = False
        self._runners_up = max(ALTERNATIVES if alternatives else 0, CAPE_WIDEST - 1 if self._tree else 0)
        base = len(committed)
        self.block = Block(base=base, tokens=[], probs=[], entropies=[], siblings=[] if self._tree else None)
        self.alternatives: list[list[tuple[int, float]]] = []  # per token: [(id, q(id))], most likely first
        self.compute_s = 0.0
        self.prefill_s = 0.0  # of compute_s, the forward that took in a prefix of many tokens
        self._prefilling = False
        self._limit = min(session.policy.max_length(), budget)
        if self._tree and not session.sampling.greedy:  # its q rows cross the wire: a byte budget (trees.py)
            self._limit = min(self._limit, q_rows_within(session._drafter.width))
        self._context = list(committed)  # what the block follows (the request's rules count it)
        self._q_rows: list[torch.Tensor] = []
        self._pending = session._resume(committed, cache) if self._limit > 0 else None
        self.done = self._pending is None  # nothing to draft from: the block stays empty
        self.error: Exception | None = None  # this block's own work failed in a batched step (``_fail``)
        # a block the target is not waiting for (async's follow-up, a prepared continuation) drafts on
        # past its policy's stop while extends() says so (draft_worker/pipelined.py); the policy's
        # stops it passed are counted: the places it expects a rejection
        self.extends: Callable[[], bool] | None = None
        self.extended = 0
        self.stops_passed: list[int] = []  # the block's length at each of those stops

    def cap(self, budget: int) -> bool:
        """Hold the block to at most ``budget`` tokens from now on; False (unchanged) if it holds
        that many already, or is a tree that would need a lower cap (its node budget was set by
        its spine's)."""
        if len(self.block) >= budget or (self._tree and self._limit > budget):
            return False
        self._limit = min(self._limit, budget)
        return True

    def _ruled(self, row: torch.Tensor) -> torch.Tensor:
        """The draft's row for its next place under the request's logit_bias, penalties and
        min_tokens (the target's rules: what it would accept), by the block's tokens so far."""
        rules = self._session.rules
        return rules.apply(row, self._context, [self.block.tokens] if rules.by_place else ())

    @property
    def _seq(self):
        """The paged sequence this block is drafted on."""
        return self.cache if self.cache is not None else self._session._seq

    @property
    def grows_below(self) -> bool:
        """A deep tree's block: nodes grow below its siblings (their own forward at its end)."""
        return self._grows

    @property
    def pending_tokens(self) -> int:
        """What the block's next forward takes in (tokens, or a feature draft's pairs)."""
        pending = self._pending
        return 0 if pending is None else len(pending)

    def step(self) -> bool:
        """Draft one token (a forward of its own); returns ``done``. A block whose choice failed
        raises its error here."""
        self._session._drafter.step([self])
        if self.error is not None:
            raise self.error
        return self.done

    def _fail(self, exc: Exception) -> None:
        """This block's own work failed in a batched step (its neighbours went on): it is done,
        with the error for its owner to act on (the draft worker sheds the session, the in-process
        engine ends it with the error)."""
        self.error, self.done = exc, True

    def _absorb(self, forward_s: float, token: int, prob: float, h: float,
                ranked: list[tuple[int, float]], q: torch.Tensor | None = None) -> None:
        """The token this block's last forward chose (its q, the entropy of q, the most likely
        tokens; q itself when sampled), and whether the block ends there. forward_s: this block's
        share of the forward."""
        s, block = self._session, self.block
        started = s._drafter.host_timer()
        s.forwards += 1
        s.forward_s += forward_s
        if self._prefilling:  # a prompt's (or a re-attach's) prefill: not what a drafted token costs
            self._prefilling = False
            s.prefill_s += forward_s
            self.prefill_s += forward_s
        step = StepState(len(block) + 1, block.base + len(block), token, prob, h)
        block.tokens.append(token)
        block.probs.append(prob)
        block.entropies.append(h)
        others = [(i, p) for i, p in ranked if i != token and p > 0]
        if self._keep_alternatives:
            self.alternatives.append(others[:ALTERNATIVES])
        if self._tree:  # CaPE's siblings at this place, the block's nodes bounded
            kept = cape_siblings(prob, others, self._room, self.reach, self._price)
            block.siblings.append(kept)
            if self._grows:  # their rows come with the next forward (a place after them, not a stop token)
                q_of, place = dict(others), len(block.tokens) - 1
                self._sibling_reach.update({(place, t): self.reach * q_of[t] for t in kept})
                self._riders = [(place, t) for t in kept if place + 1 < self._limit and t not in s.stop_token_ids]
        self.reach *= prob
        if q is not None:
            self._q_rows.append(q)
        stop = s.policy.should_stop(step)
        if stop and self.extends is not None and self.extends():  # off the critical path: its own clock
            stop, self.extended = False, self.extended + 1
            self.stops_passed.append(len(block.tokens))
        self.done = step.index >= self._limit or token in s.stop_token_ids or stop
        if self.done:
            self._ended()
        self._pending = [token]
        spent = forward_s + (s._drafter.host_timer() - started)  # no host work: the forward's share, exactly
        self.compute_s += spent
        s.compute_s += spent

    def _ended(self) -> None:
        """Its last token is in: its q rows stacked; a tree's last place's siblings still to grow
        take a forward of their own, where it pays (trees.grows_last_place)."""
        if self._q_rows:
            self.block.q_rows = torch.stack(self._q_rows)  # [k, vocab]
        if self._grows:
            reaches = [self._sibling_reach[rider] for rider in self._riders]
            if not grows_last_place(reaches, self._session.acceptance, self._forward_price):  # it would not pay
                self._riders = []
            self._spine_done, self.done = True, not self._riders
            if self.done:
                self._finish_tree()

    def split_off(self, keep: int) -> None:
        """Its first ``keep`` tokens are settled apart from it (a follow-up the target cut there:
        growth.py; or the tokens a verdict settled below the sibling this continuation was prepared
        after: pipelined.py); this one is now what it drafted past them, and drafts on from where
        it stands: nothing is drafted again (the cache holds them), and a greedy block's tokens
        after the cut are the ones a block begun there would draft. Greedy, a chain or a tree
        that grows nothing below its siblings (they keep their places); a block still drafting
        may keep none."""
        block = self.block
        keeps_some = 0 < keep < len(block.tokens) or (keep == len(block.tokens) > 0 and not self.done)
        if self._grows or self._q_rows or not keeps_some:
            raise ValueError(f"split a block of {len(block.tokens)} tokens after {keep} (a greedy chain's or "
                             "flat tree's, keeping some past the cut unless it drafts on)")
        self._context = self._context + block.tokens[:keep]
        self.block = block.after(keep)
        self.alternatives = self.alternatives[keep:]
        self._limit -= keep
        self.reach = math.prod(self.block.probs)
        self.stops_passed = [at - keep for at in self.stops_passed if at > keep]

    def go_on_past(self, keep: int) -> bool:
        """Taken up as the block the target waits for past its first ``keep`` tokens, which a
        verdict settled (a continuation prepared after the sibling it took: pipelined.py). Past a
        stop of its policy after them, it ends where its places stop paying for their nodes at the
        target's node price (trees.kept_places: a tree's places carry siblings, a row each in the
        target's forward; sending them all cost 8% at 8B/1B with 32 sessions), never before that
        stop. Past a stop only before them, what it holds leaves as it stands (the caller sends a
        block past a stop at once); holding nothing yet, it drafts on to a stop of its own.
        Returns ``done``."""
        self.split_off(keep)
        if self.stops_passed:
            block = self.block
            siblings = block.siblings or [[] for _ in block.tokens]
            ranked = self.alternatives or [[] for _ in block.tokens]  # kept per token, or none at all
            mass = [sum(q for token, q in at if token in place) for at, place in zip(ranked, siblings, strict=True)]
            end = kept_places(block.probs, mass, list(map(len, siblings)), self.stops_passed[0],
                              self._session.node_price)
            block.keep_first(end)
            del self.alternatives[end:]
            self.stops_passed, self.done = [], True
            self._ended()
        elif not self.block.tokens:
            self.extended = 0
        return self.done

    def end_extension(self) -> bool:
        """Past its policy's stop and drafted on by its own clock (``extends``), the block ends
        where it stands once that clock says no more forward fits; returns ``done``. For a
        forward it sits out (the worker's step carries a block some target waits for): it could
        not grow after that one in time, so it goes now."""
        if not self.done and self.extended and self.extends is not None and not self.extends():
            self.done = True
            self._ended()
        return self.done

    @property
    def _room(self) -> int:
        """Nodes the block may still add off its spine (the spine's whole cap held back for it)."""
        grown = sum(map(len, self._children.values()))
        return MAX_TREE_NODES - self._limit - sum(map(len, self.block.siblings)) - grown

    def _grown(self, ranked: list[list[tuple[int, float]]], forward_s: float) -> None:
        """The riders' rows gave each its most likely next tokens (ranked, with q): the children
        whose path pays (trees.grown_children), the block's nodes bounded. Once the spine is
        done, this was the block's last forward: its tree is finished."""
        s = self._session
        started = s._drafter.host_timer()
        for rider, options in zip(self._riders, ranked):
            kept = grown_children(options, self._sibling_reach[rider], self._price, self._room)
            if kept:
                self._children[rider] = kept
        self._riders = []
        if self._spine_done:
            self.done = True
            self._finish_tree()
            s.forwards += 1
            s.forward_s += forward_s
        spent = forward_s + (s._drafter.host_timer() - started)  # no host work: the forward's share, exactly
        self.compute_s += spent
        s.compute_s += spent

    def _finish_tree(self) -> None:
        """The block's grown nodes in the tree's layout: (the sibling's node, child), by parent."""
        nodes = sibling_nodes(len(self.block.tokens), self.block.siblings)
        grown = sorted((nodes[rider], child) for rider, children in self._children.items() for child in children)
        self.block.grown = grown or None


class NullDraftSession:
    """Stands in for a draft session when no draft model is loaded: every block is empty."""

    def __init__(self):
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0  # of forward_s, the forwards that took in a prefix (a prompt)
        self.compute_s = 0.0
        self.cached_tokens = 0

    def propose(self, committed: Sequence[int], budget: int) -> Block:
        return Block(base=len(committed), tokens=[], probs=[], entropies=[])

    def close(self) -> None:
        pass

    def feedback(self, drafted: int, accepted: int) -> None:
        pass

    def take_features(self, features: torch.Tensor | None, first: int) -> None:
        pass


def _greedy_on_host(logits: torch.Tensor, runners_up: int) -> list[tuple]:
    """Greedy rows of logits [B, vocab] on a host device: each block's (token, q(token), the
    entropy of q, the most likely tokens with their q or [] where none is kept, None): what the
    batched torch ops give, read in about two thirds of their time here (sampling.py)."""
    top = greedy_top_on_host(logits, min(runners_up + 1, logits.shape[-1]))
    return [(ids[0], q[0], h, list(zip(ids, q)) if runners_up else [], None) for ids, q, h in top]


def _to_width(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Lay the draft's logits [n, draft_vocab] over the target's vocabulary [n, width]: ids the
    draft lacks get -inf, ids the target lacks (padding rows) are cut."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
