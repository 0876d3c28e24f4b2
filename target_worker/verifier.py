"""The verifier: hosts the target model and answers blocks with verdicts, every block that is
ready in one forward.

A ``TargetSession`` holds one request's place in the verifier's paged KV pool. Verifying rolls
its sequence back to what the committed sequence still shares, runs the uncached committed tokens
plus the block through the target, and settles the next positions with the rejection rule.
``Verifier.verify_batch`` does that for many sessions in one forward over a ragged batch, each
session with its own prefix and its own block length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from svip_common.contracts import NO_TOKEN, Block, SamplingParams, TokenLogprob, Verdict
from svip_common.errors import narrowed
from svip_common.grammar_mask import grammar_tokenizer
from svip_common.kv_cache import KVPool, PagedSequence, PoolFull
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.models import LoadedModel
from svip_common.prompt_sharing import PromptSharing
from svip_common.randomness import Purpose, uniform
from svip_common.rejection import accept_greedy, accept_sampled, branch_sampled, residual
from svip_common.row_rules import RowRules
from svip_common.sampling import mask_padding, sample_indices, warp_probs
from svip_common.step_cost import Ewma, StepCost, TargetLoad, target_load
from svip_common.trees import children_of, greedy_path, node_parents, node_paths, node_tokens
from target_worker.features import HeldFeatures
from target_worker.logprobs import LogprobRows, PromptScores, block_rows
from target_worker.lookahead import Lookahead, judged


class Verifier:
    """The target model and its KV pool, shared by the sessions it opens."""

    def __init__(self, target: LoadedModel, token_limit: int | None = None, kv_cache_tokens: int = DEFAULT_KV_TOKENS,
                 feature_layers: tuple[int, ...] = ()):
        """feature_layers: the target's hidden states a feature draft reads (indices into them);
        each verdict then carries them at the positions it commits (``Verdict.features``)."""
        self.target = target
        self.feature_layers = tuple(feature_layers)
        self.token_limit = target.token_limit if token_limit is None else token_limit  # ids it may emit
        self.pool = KVPool(target.model, kv_cache_tokens)
        self.sharing = PromptSharing(self.pool.page_size, enabled=not self.feature_layers)  # prompt_sharing.py
        self.tokens_verified = 0  # drafted tokens, every session
        self.last_step_tokens = 0  # tokens in the last batched forward
        self.fed_ahead = 0  # follow-up tokens fed after their blocks, rows stored (Lookahead)
        self.judged_ahead = 0  # blocks decided past their first token by such rows, with no forward of their own
        # a forward's time by its tokens (load-aware speculation): over every step (cost), over
        # decode-shaped steps only (decode_cost: no prompt in them), over plain ones alone
        # (plain_cost: one token per session)
        self.cost, self.decode_cost, self.plain_cost = StepCost(), StepCost(), StepCost()
        self._sessions_per_step = Ewma(0.1)  # recent sessions per verification step

    def open(self, sampling: SamplingParams, prompt_len: int = 0, stop_ids: frozenset[int] = frozenset(),
             logprobs: int | None = None, cache_scope: str = "") -> TargetSession:
        """prompt_len and stop_ids: the request's, for its penalties and min_tokens (row_rules.py);
        logprobs: the request's top alternatives per settled token (None: no logprobs; logprobs.py);
        cache_scope: the sessions it may share KV pages with (svip_common/prompt_sharing.py)."""
        tokenizer = None if sampling.grammar is None else self.grammar_tokenizer()
        session = TargetSession(self, sampling, RowRules.of(sampling, prompt_len, stop_ids, tokenizer))
        session.logprob_rows = None if logprobs is None else LogprobRows(logprobs)
        self.sharing.add(session, prompt_len, cache_scope)
        return session

    def grammar_tokenizer(self):
        """The target's tokenizer as structured output's matchers read it (None: it has none)."""
        target = self.target
        return None if target.tokenizer is None else grammar_tokenizer(target.tokenizer, target.vocab_size)

    def load(self, sessions: int | None = None) -> TargetLoad | None:
        """The target's current load, as load-aware speculation sees it (None: nothing measured
        yet). sessions: how many sessions its next step verifies, where the caller knows: the
        in-process engine, whose draft and target forwards run in lockstep on one device, so a
        drafted row holds up every session of its step; there it is priced on decode-shaped
        steps, a plain step as measured and a row at what rows added over it (``target_load``).
        Else (the distributed target, its draft on another device) the recent steps' average
        batch and the fit over every step: priced the in-process way there, the cut rule
        shortened blocks and lost throughput through Serve; its round's cost needs modelling
        first. Both measured: docs/architecture.md, load-aware speculation."""
        if sessions is None:
            return target_load(self.cost, self._sessions_per_step.value)
        return target_load(self.decode_cost, sessions, self.plain_cost)

    @torch.inference_mode()
    def verify_batch(self, jobs: Sequence[tuple[TargetSession, Sequence[int], Block]],
                     budget: int | None = None,
                     riders: Sequence[tuple[TargetSession, Sequence[int]]] = (),
                     lookahead: Mapping[TargetSession, Sequence[int]] | None = None) -> list[Verdict | None]:
        """Every job's verdict, from one target forward for all the blocks that need one (a
        follow-up whose first token the stored row rejects needs none). budget: at most this many
        tokens in the forward (the step's max_batched_tokens): a job whose uncached prompt does
        not fit is prefilled by a chunk and answers None (verify it again in a later step), so a
        long prompt never stalls the others and no forward, the first job's included, holds more
        than the budget (but a lone block that only fits past it); the first job always advances.
        A sampled job's prompt answers None too, its last token left for the next step with the
        block (``PromptSharing.splits``). riders: sessions waiting on their blocks whose next row
        rides this forward (``prefill_next``'s, in the room the blocks leave). lookahead: per
        session, the tokens held after its block (its follow-up, drafted on the block accepted
        whole): they ride the block's forward where room is left, and their rows are stored, so
        that the follow-up is judged with no forward of its own (``TargetSession.first_greedy``)."""
        verdicts = self.judge_first(jobs)
        lookahead = lookahead or {}
        room = budget if budget is not None else float("inf")
        plans, steps, owners = {}, [], []  # owners[j]: the job step j settles (None: a prefill chunk)
        scorers = {}  # step j -> the session whose prompt chunk it is
        prefilling = False  # a prompt's tokens go through this forward
        prompts: list[Sequence[int]] = []  # committed tokens this forward prefills (prompt_sharing.py)
        for i, (session, committed, block) in enumerate(jobs):
            if verdicts[i] is not None:
                continue
            self.sharing.take(session, committed)
            if self.sharing.waits(session, committed, prompts):
                continue  # an earlier job prefills its prompt: the next step forks it
            plan = session.plan(committed, block)
            tokens = len(plan.step[1]) if plan.step is not None else 0
            prefill = tokens - (block.nodes - plan.stored) - 1  # uncached committed tokens, but the last one
            prefilling |= prefill > 0
            if prefill > 0:
                prompts.append((session, committed))
            # its last token and the block: next step (a sampled prompt's split, or a prompt it scores)
            splits = self.sharing.splits(session, prefill + 1) or session.scoring_pending
            if splits or (tokens > room and (prefill > 0 or steps)):  # else a lone block a little past the budget runs
                chunk = int(min(room, prefill))
                if chunk > 0:
                    steps.append(session.prompt_chunk(*plan.step[:2], chunk))  # a tree's step carries its parents too
                    owners.append(None)
                    scorers[len(steps) - 1] = session
                    room -= chunk
                continue
            ahead = lookahead.get(session, ())
            fits = plan.step is not None and prefill <= 0 and tokens + len(ahead) <= room
            if ahead and fits and self._looks_ahead(session, block):
                plan = plan.fed(ahead)
                tokens += len(ahead)
                self.fed_ahead += len(ahead)
            plans[i] = plan
            if plan.step is not None:
                steps.append(plan.step)
                owners.append(i)
                room -= tokens
        ridden = _Prefills(self, riders, room, prompts)
        blocks, steps = len(steps), steps + ridden.steps
        self.last_step_tokens = sum(len(step[1]) for step in steps)
        rows, features, elapsed = self.pool.timed_forward(steps, self.feature_layers) if steps else ([], [], 0.0)
        ridden.finish(rows[blocks:], elapsed)
        prefilling |= ridden.prompted
        if features:  # a feature draft's input, per session
            by_sequence = {id(session.sequence): session for session, *_ in list(jobs) + list(riders)}
            for (seq, new, *_), feats in zip(steps, features):
                by_sequence[id(seq)].features.take(len(seq) - len(new), feats)
        if steps:
            self._observe(self.last_step_tokens, elapsed, prefilling, len(steps))
            self._sessions_per_step.update(len(jobs))
        for j, session in scorers.items():
            session.scored_rows(steps[j], rows[j])
        settled = {i: jobs[i][0].processed(mask_padding(row, self.token_limit), jobs[i][1], jobs[i][2], plans[i])
                   for i, row in zip(owners, rows) if i is not None}
        choices = self._greedy_choices(jobs, plans, settled)
        sampled = []  # (job index, session, base, block, logits): judged together below
        for i, plan in plans.items():  # a plan with no step: the stored row settles it
            session, committed, block = jobs[i]
            logits = session.step_logits(block, plan, settled.get(i), elapsed)
            if session.sampling.greedy:
                verdicts[i] = session.judge_greedy(len(committed), block, plan, choices.get(i, []), logits)
            else:
                sampled.append((i, session, len(committed), block, logits))
        groups: dict[tuple, list] = {}  # sessions warped alike: judged in one pass, two host reads
        for item in sampled:
            groups.setdefault(item[1].sampling.warp_key, []).append(item)
        for group in groups.values():
            for (i, *_), verdict in zip(group, _judge_sampled(group)):
                verdicts[i] = verdict
        if self.feature_layers:
            verdicts = [v if v is None else session.features.hand(v) for (session, _, _), v in zip(jobs, verdicts)]
        return verdicts

    def verify_apart(self, jobs: Sequence[tuple[TargetSession, Sequence[int], Block]],
                     budget: int | None = None,
                     riders: Sequence[tuple[TargetSession, Sequence[int]]] = (),
                     lookahead: Mapping[TargetSession, Sequence[int]] | None = None,
                     ) -> list[Verdict | None | Exception]:
        """verify_batch, with a step that raised narrowed to the jobs (and riders) that fail on
        their own: the step's items are run again in halves (every stored row forgotten first, so
        each recomputes from its committed tokens, exact by construction), down to the single
        ones that still raise, whose place in the answer is their exception (a rider's is
        dropped: it only stores a row). One bad job among n costs about 2·log2(n) forwards, once;
        everyone else's verdict is the one it would have had."""
        def run(part):
            blocks = [item for item in part if len(item) == 3]
            verdicts = iter(self.verify_batch(blocks, budget, [item for item in part if len(item) == 2], lookahead))
            return [next(verdicts) if len(item) == 3 else None for item in part]

        def forget_rows(failed):  # the failed step may have stored rows for some: recompute
            for session, *_ in failed:
                session.forget_row()

        # PoolFull changes nothing: the caller makes room (coordinator/session/host.py)
        return narrowed(run, list(jobs) + list(riders), forget_rows, passing=(PoolFull,))[: len(jobs)]

    def _looks_ahead(self, session: TargetSession, block: Block) -> bool:
        """Whether tokens fed after this block may have their rows stored (``Lookahead``): a greedy
        chain's, whose rows the request reads no other way (no rules by place, no logprobs, no
        prompt scores, no features for a feature draft)."""
        return (session.sampling.greedy and not block.is_tree and not session.rules.by_place and not self.feature_layers
                and session.logprob_rows is None and not session.scoring_pending)

    def _observe(self, tokens: int, seconds: float, prefilling: bool, items: int) -> None:
        """A forward's time into the cost fits; the decode-shaped ones leave out a step a prompt
        went through: a prompt's hundreds of tokens (cheaper each) would set the slope, so that a
        drafted row looked cheaper than it is (measured: docs/architecture.md, load-aware
        speculation)."""
        self.cost.observe(tokens, seconds)
        if not prefilling:
            self.decode_cost.observe(tokens, seconds)
            if tokens == items:  # one token each: a plain step
                self.plain_cost.observe(tokens, seconds)

    @torch.inference_mode()
    def prefill_next(self, jobs: Sequence[tuple[TargetSession, Sequence[int]]], budget: int | None = None) -> int:
        """While the target would idle, waiting on blocks: each session's committed tokens that its
        cache lacks (the last verdict's token; a new session's prompt) go through the target in
        one forward, and the row for the next place is stored. The block drafted meanwhile then
        has its first token judged before any forward (``judge_first``: a rejection needs none)
        and its forward holds its drafted tokens only. The same rows a verification would compute
        (nothing is decided here). budget: at most this many tokens (a long prompt goes a chunk
        at a time). Returns how many sessions it advanced."""
        part = _Prefills(self, jobs, budget if budget is not None else float("inf"), [])
        if not part.steps:
            return 0
        rows, features, elapsed = self.pool.timed_forward(part.steps, self.feature_layers)
        self._observe(part.tokens, elapsed, part.prompted, len(part.steps))
        by_sequence = {id(session.sequence): session for session, _ in jobs}
        for (seq, new, *_), feats in zip(part.steps, features):
            by_sequence[id(seq)].features.take(len(seq) - len(new), feats)
        part.finish(rows, elapsed)
        return len(part.steps)

    def judge_first(self, jobs: Sequence[tuple[TargetSession, Sequence[int], Block]]) -> list[Verdict | None]:
        """Each job's early verdict: a block that continues a fully accepted one has its first
        token judged against the row already stored for that place, before any forward, by the
        same rule and the same keyed coin as the full pass. A rejection is the verdict at once (no
        forward for the tokens after it, which would all be discarded); None: the block needs its
        forward. Greedy sessions read nothing (the stored row's argmax came with its step);
        sampled ones are judged a warp group at a time: p at every first token in one host read,
        the corrections drawn together in a second. A block judged once and kept is not judged
        again (the pipeline judges on arrival, then verifies in a batch). Tensors are touched only
        for sampled groups (inference mode costs a greedy follow-up's judgement as much as the rest
        of it: every async round on the target's host thread calls this)."""
        verdicts: list[Verdict | None] = [None] * len(jobs)
        judged, groups = [], {}
        for i, (session, committed, block) in enumerate(jobs):
            if not block.tokens or session.cleared(block, committed) or not session.holds_row_for(committed):
                continue
            if session.branches_first(block):
                continue  # a sampled tree: the full pass tries its first place's siblings, coin for coin
            judged.append(i)
            if session.sampling.greedy:
                verdicts[i] = session.first_greedy(len(committed), block)
            else:
                groups.setdefault(session.sampling.warp_key, []).append(i)
        for indices in groups.values():
            with torch.inference_mode():
                judged_group = _first_sampled([jobs[i] for i in indices])
            for i, verdict in zip(indices, judged_group):
                verdicts[i] = verdict
        for i in judged:
            if verdicts[i] is None:
                session, committed, block = jobs[i]
                session.passed_first(block, len(committed))
        return verdicts

    def _greedy_choices(self, jobs, plans: dict[int, _Plan], settled: dict) -> dict[int, list[int]]:
        """The target's choice at every row the step computed for a greedy session, read to the
        host in one copy for the whole step (not one per session): job index -> its rows' argmax."""
        greedy = [i for i in plans if i in settled and jobs[i][0].sampling.greedy]
        if not greedy:
            return {}
        rows = [settled[i] for i in greedy]
        flat = torch.argmax(torch.cat(rows), dim=-1).tolist()
        choices = {}
        for i, r in zip(greedy, rows):
            choices[i], flat = flat[: r.shape[0]], flat[r.shape[0]:]
        return choices


@dataclass
class _Plan:
    # the forward this block needs (None: the stored row is all); a tree's carries its nodes' parents
    step: tuple[PagedSequence, list[int], int] | tuple[PagedSequence, list[int], int, list[int]] | None
    reuse: bool  # the first row is the stored one
    reused: Lookahead | None = None  # reused: rows stored past the first, at the block's first tokens
    ahead: tuple[int, ...] = ()  # tokens fed after the block, their rows stored for a follow-up (Lookahead)

    @property
    def stored(self) -> int:
        """The block's first tokens whose rows were stored past the first (Lookahead)."""
        return len(self.reused.tokens) if self.reused is not None else 0

    def fed(self, ahead: Sequence[int]) -> _Plan:
        """The plan with ``ahead`` fed after the block (a chain's), their rows kept past its own."""
        seq, new, rows = self.step
        return dataclasses.replace(self, step=(seq, [*new, *ahead], rows + len(ahead)), ahead=tuple(ahead))


class _Prefills:
    """Rows that take each session's committed tokens its cache lacks (the last verdict's token, a
    new session's prompt: a chunk at a time past ``room`` tokens) and store the row for its next
    place, nothing decided: planned into a forward of their own (``Verifier.prefill_next``) or
    beside a verification's blocks (its riders). prompts: the committed tokens the forward
    prefills already (prompt_sharing.py), added to."""

    def __init__(self, verifier: Verifier, jobs: Sequence[tuple[TargetSession, Sequence[int]]], room: float,
                 prompts: list):
        self.token_limit = verifier.token_limit
        self.steps, self.owners, self.before, self.scorers = [], [], [], {}  # scorers: step -> its prompt's session
        for session, committed in jobs:
            verifier.sharing.take(session, committed)
            if room < 1 or verifier.sharing.waits(session, committed, prompts):
                continue
            empty = Block(base=len(committed), tokens=[], probs=[], entropies=[])
            plan = session.plan(committed, empty)
            if plan.step is None:
                continue
            seq, new, _ = plan.step
            if len(new) > 1:
                prompts.append((session, committed))
            splits = verifier.sharing.splits(session, len(new)) or session.scoring_pending
            cut = len(new) - 1 if splits else len(new)  # the last: next step
            if len(new) > room or cut < len(new):  # a chunk of the prompt, its row later (a row stored before
                chunk = int(min(room, cut))  # is not this one's)
                if chunk > 0:
                    self.steps.append(session.prompt_chunk(seq, new, chunk))
                    self.scorers[len(self.steps) - 1] = session
                    room -= chunk
                continue
            self.steps.append(plan.step)
            self.owners.append(session)
            self.before.append((committed, empty, plan))
            room -= len(new)
        self.tokens = sum(len(new) for _, new, *_ in self.steps)
        self.prompted = any(len(new) > 1 for _, new, *_ in self.steps)

    def finish(self, rows, elapsed: float) -> None:
        """The forward's rows for these steps, in their order: each owner's row is stored."""
        for j, session in self.scorers.items():
            session.scored_rows(self.steps[j], rows[j])
        rows = [mask_padding(row, self.token_limit) for j, row in enumerate(rows)
                if j not in self.scorers and self.steps[j][2]]
        rows = [session.processed(row, *job) for row, session, job in zip(rows, self.owners, self.before)]
        greedy = [i for i, session in enumerate(self.owners) if session.sampling.greedy]
        choices = torch.argmax(torch.cat([rows[i] for i in greedy]), dim=-1).tolist() if greedy else []
        choice_of = dict(zip(greedy, choices))
        for i, (session, row) in enumerate(zip(self.owners, rows)):
            session.store_row(row, choice_of.get(i), elapsed)


class TargetSession:
    logprob_rows: LogprobRows | None = None  # the rows of places not yet settled, kept for their logprobs
    scoring: PromptScores | None = None  # a scoring request's prompt logprobs, read as its prefill computes them

    def __init__(self, verifier: Verifier, sampling: SamplingParams, rules: RowRules | None = None):
        self.sampling = sampling
        self.rules = rules if rules is not None else RowRules(0)  # logit_bias, penalties, min_tokens (row_rules.py)
        self._verifier = verifier
        self.sequence = verifier.pool.sequence()
        self._pending: torch.Tensor | None = None  # [1, vocab]: logits for position _pending_at
        self._pending_at = -1
        self._pending_choice: int | None = None  # greedy: the argmax of _pending, read with its step
        self._passed: tuple[Block, int] | None = None  # a block and its base whose first token passed judge_first
        self._ahead: Lookahead | None = None  # rows stored past _pending's (the sequence holds their tokens)
        self.features = HeldFeatures()  # what a feature draft is handed with the verdicts (features.py)
        self.forwards = 0
        self.forward_s = 0.0

    @property
    def cached_tokens(self) -> int:
        return len(self.sequence)

    def close(self) -> None:
        """Give the session's pages back to the pool."""
        self._verifier.sharing.discard(self)
        self.sequence.close()
        self.forget_row()

    def evict(self) -> None:
        """Give every page back while the session waits (the pool ran short): nothing it holds is
        lost but its cache, which its next verification recomputes from its committed tokens
        (exact by construction, as after a worker's restart). Features the draft already has are
        not handed over again."""
        self.sequence.rollback(0)
        self.forget_row()
        self.features.evicted()

    def store_row(self, row: torch.Tensor, choice: int | None, forward_s: float) -> None:
        """A prefill (Verifier.prefill_next) computed the row for the place after the cached
        tokens; choice: its argmax, for a greedy session; forward_s: the forward's time."""
        self._pending, self._pending_at, self._passed, self._pending_choice = row, len(self.sequence), None, choice
        self._ahead = None
        if self.logprob_rows is not None:
            self.logprob_rows.keep([(len(self.sequence), len(self.sequence), (), row[0])])
        self.forwards += 1
        self.forward_s += forward_s

    def settled_logprobs(self, sequence: Sequence[int], count: int) -> list[TokenLogprob]:
        """The last ``count`` tokens of ``sequence`` were just settled: their logprobs, when the
        request asked for them (target_worker/logprobs.py), else none."""
        if self.logprob_rows is None:
            return []
        return self.logprob_rows.settle(sequence, len(sequence) - count, len(sequence))

    def score(self, prompt: Sequence[int], top: int) -> None:
        """A scoring request (OpenAI's echo): its prefill reads every prompt token's logprob after
        the first, a chunk at a time (logprobs.PromptScores), before its first block is verified."""
        self.scoring = PromptScores(prompt, top)
        self._verifier.sharing.computes_own(self)

    @property
    def scoring_pending(self) -> bool:
        return self.scoring is not None and self.scoring.pending

    def prompt_chunk(self, seq: PagedSequence, new: Sequence[int], chunk: int) -> tuple:
        """A prefill chunk's step: its first ``chunk`` new tokens, keeping the rows that score them
        where the session scores its prompt; ``scored_rows`` takes the rows after the forward."""
        self.forget_row()
        keep = self.scoring.rows_to_keep(len(seq), chunk) if self.scoring_pending else 0
        return seq, new[:chunk], keep

    def scored_rows(self, step: tuple, rows: torch.Tensor) -> None:
        """A prompt chunk's kept rows (``prompt_chunk``), scored and let go."""
        seq, new, keep = step
        if keep:
            self.scoring.take(len(seq) - keep, mask_padding(rows, self._verifier.token_limit))

    def forget_row(self) -> None:
        """No row is stored: the sequence it was computed on is changing (a prompt chunk) or gone."""
        self._pending, self._pending_at, self._pending_choice, self._passed = None, -1, None, None
        self._ahead = None

    def verify(self, committed: Sequence[int], block: Block) -> Verdict:
        """Settle the block. When the block's q rows live on the draft side (distributed
        sampling), a rejection returns ``token = -1`` and ``p_row``, and the draft side draws the
        correction from norm(max(0, p_row - q)). A sampled session's split prefill takes a
        forward before the block's (svip_common/prompt_sharing.py)."""
        verdict = None
        while verdict is None:
            verdict = self._verifier.verify_batch([(self, committed, block)])[0]
        return verdict

    def judge_first(self, committed: Sequence[int], block: Block) -> Verdict | None:
        """This block's early verdict, or None: it needs its forward (``Verifier.judge_first``)."""
        return self._verifier.judge_first([(self, committed, block)])[0]

    def branches_first(self, block: Block) -> bool:
        """A sampled tree with siblings at its first place: the full pass must try them (judged
        early, the first token's rejection drew the correction at once, skipping the siblings that
        take the coins after it, and a seed must give one verdict with or without a stored row).
        A greedy one is judged early: its rejection settles the target's token either way, and a
        forward sooner (a sibling the argmax goes unused: 70B/8B CaPE 110.3 tok/s against 105.4
        when such trees waited for their forward)."""
        return not self.sampling.greedy and bool(block.siblings) and bool(block.siblings[0])

    def first_greedy(self, base: int, block: Block) -> Verdict | None:
        """The stored rows' argmax (read with their step) against the block's first tokens: the
        next place's row, then those stored past it (``Lookahead``) while the block's tokens are
        the ones they were computed on. A rejection among them, or the whole block where they reach
        past it, is the verdict (no forward); None: its forward judges the rest."""
        ahead = self._ahead
        choices = [self._pending_choice, *(ahead.choices if ahead is not None else ())]
        accepted = judged(block.tokens, choices, ahead.tokens if ahead is not None else ())
        if accepted is None:
            return None
        self._verifier.tokens_verified += len(block)
        self._verifier.judged_ahead += accepted > 0
        self._ahead = None
        if accepted == len(block):  # the row after them is the next place's now; what lies past it stays stored
            self._pending, self._pending_at = ahead.rows[accepted - 1 : accepted], base + accepted
            self._pending_choice, self._ahead = choices[accepted], ahead.after(accepted)
        return Verdict(base=base, accepted=accepted, token=choices[accepted], epoch=block.epoch)

    def next_token(self, committed: Sequence[int]) -> int | None:
        """Greedy: the target's own token for the place after ``committed``, read from the row
        stored for exactly these tokens (a prefill's, or the last verification's), no forward;
        None when no such row is stored (or the session samples)."""
        if not self.sampling.greedy or self._pending_choice is None or not self.holds_row_for(committed):
            return None
        return self._pending_choice

    def judged_alone(self, tokens: int) -> None:
        """Drafted tokens judged against the target's own tokens, settled while it waited for them
        (no forward): they count as verified, as those a verification judges."""
        self._verifier.tokens_verified += tokens

    def lacks_next_row(self, committed: Sequence[int]) -> bool:
        """The row for the place after ``committed`` is not stored (by the place alone: a cheap
        test, for deciding whether ``Verifier.prefill_next`` has work; the prefill checks the tokens)."""
        return self._pending is None or self._pending_at != len(committed)

    def passed_first(self, block: Block, base: int) -> None:
        """judge_first let this block's first token pass against the row stored for ``base``."""
        self._passed = (block, base)

    @property
    def stored_row(self) -> torch.Tensor | None:
        """The logits row stored for the next place (a prefill's or a verification's), if any."""
        return self._pending

    def count_verified(self, tokens: int) -> None:
        """Drafted tokens judged (the verifier's count, for its Stats)."""
        self._verifier.tokens_verified += tokens

    def cleared(self, block: Block, committed: Sequence[int]) -> bool:
        """This very block's first token already passed judge_first against the row stored now."""
        return self._passed is not None and self._passed[0] is block and self._passed[1] == len(committed)

    def holds_row_for(self, committed: Sequence[int]) -> bool:
        """The pool holds exactly ``committed`` (and the tokens whose rows are stored past it) and
        the row for the next place is stored (the block continues a fully accepted one)."""
        ahead = self._ahead.tokens if self._ahead is not None else ()
        return (
            self._pending is not None
            and self._pending_at == len(committed) == len(self.sequence) - len(ahead)
            and self.sequence.tokens_equal([*committed, *ahead] if ahead else committed)
        )

    def processed(self, rows: torch.Tensor, committed: Sequence[int], block: Block, plan: _Plan) -> torch.Tensor:
        """This session's rows of a step as the request has them (its logit_bias, penalties and
        min_tokens), before anything reads them: each row by the tokens before its own place."""
        if not self.rules.by_place:
            return self.rules.apply(rows)
        drafted = list(block.tokens)
        if block.is_tree:  # each node's place follows its ancestors: its path from the block's first place
            paths = [list(path) for path in node_paths(drafted, block.siblings, block.grown)]
            paths = paths if plan.reuse else [[], *paths]
        else:  # the block's places in order, the first one's row stored already when reused
            paths = [drafted[:r] for r in range(1 if plan.reuse else 0, len(drafted) + 1)]
        return self.rules.apply(rows, committed, paths)

    def plan(self, committed: Sequence[int], block: Block) -> _Plan:
        """Target logits are needed for positions len(committed) .. len(committed) + len(block):
        roll back to what the pool still shares, and reuse the stored row for the first of them
        when the pool holds exactly ``committed``, and those stored past it (``Lookahead``) for the
        block's first tokens when it begins with theirs and runs past them."""
        base, drafted, reused = len(committed), block.tokens, self._ahead
        if reused is not None and not (len(drafted) > len(reused.tokens) and not block.is_tree
                                       and tuple(drafted[: len(reused.tokens)]) == reused.tokens
                                       and self.holds_row_for(committed)):
            reused = self._ahead = None
        stored = len(reused.tokens) if reused is not None else 0
        kept = self.sequence.rollback_to_prefix_of([*committed, *reused.tokens] if stored else committed)
        reuse = kept == base + stored and self._pending_at == base and self._pending is not None
        if not reuse and kept == base:
            self.sequence.rollback(base - 1)
            kept = base - 1
        if reuse and not drafted:
            return _Plan(None, True)
        if block.is_tree:  # a tree: every node, each under its ancestors only (svip_common/trees.py)
            before = list(committed[kept:]) if not reuse else []
            nodes = node_tokens(drafted, block.siblings, block.grown)
            parents = [i - 1 for i in range(len(before))]
            parents += [p + len(before) if p >= 0 else len(before) - 1
                        for p in node_parents(len(drafted), block.siblings, block.grown)]
            return _Plan((self.sequence, before + nodes, len(nodes) + (not reuse), parents), reuse)
        if reuse:
            return _Plan((self.sequence, list(drafted[stored:]), len(drafted) - stored), True, reused)
        return _Plan((self.sequence, [*committed[kept:], *drafted], len(drafted) + 1), False)

    def step_logits(self, block: Block, plan: _Plan, rows: torch.Tensor | None, elapsed: float) -> torch.Tensor:
        """The target's logits for the block's places and the one after it [k + 1, vocab] (the
        stored row first when the plan reuses it); the last row is stored for the next block.
        rows: this block's rows of the step, their padding columns masked (verify_batch)."""
        if plan.step is None:
            logits = self._pending
        else:
            stored = [self._pending, plan.reused.rows] if plan.reused is not None else [self._pending]
            logits = torch.cat([*stored, rows]) if plan.reuse else rows  # [k + 1 (+ fed after it), vocab]
            self.forwards += 1
            self.forward_s += elapsed
        fed = len(plan.ahead)
        if fed:  # the rows at the tokens fed after the block: stored past its last (their choices: judge_greedy)
            logits, self._ahead = logits[:-fed], Lookahead(plan.ahead, logits[-fed:])
        else:
            self._ahead = None
        self._pending, self._pending_at, self._passed = logits[-1:], len(self.sequence) - fed, None
        self._verifier.tokens_verified += block.nodes
        if self.logprob_rows is not None:
            self.logprob_rows.keep(block_rows(block.base, block.tokens, block.siblings, logits, block.grown))
        return logits

    def judge_greedy(self, base: int, block: Block, plan: _Plan, choices: list[int], logits: torch.Tensor) -> Verdict:
        """choices: the argmax of each row the step computed for this block (read with the step's
        others); the stored row's argmax goes first when the plan reuses it. logits: the rows
        (step_logits), the place before the block first."""
        stored = [self._pending_choice, *(plan.reused.choices if plan.reused is not None else ())]
        target_tokens = (stored if plan.step is None or plan.reuse else []) + choices  # [1 + nodes (+ fed after)]
        if plan.ahead:
            target_tokens, self._ahead.choices = target_tokens[: -len(plan.ahead)], target_tokens[-len(plan.ahead):]
        if block.is_tree:
            return self._judge_tree(base, block, target_tokens, logits)
        self._pending_choice = target_tokens[-1]
        accepted = accept_greedy(target_tokens, block.tokens)
        return Verdict(base=base, accepted=accepted, token=target_tokens[accepted], epoch=block.epoch)

    def keep_tree_path(self, base: int, block: Block, accepted: int, branch: list[int], logits: torch.Tensor) -> None:
        """After a tree's verdict: the cache keeps the accepted path (the spine's accepted tokens
        and the nodes taken off it, branch), and the row of its last node is stored, as a chain's
        last row is (logits: the step's rows, the place before the block first)."""
        k = len(block.tokens)
        self.sequence.keep_path(base, k, accepted, branch)
        self.features.keep_path(base, list(range(accepted)) + branch)
        last = branch[-1] if branch else k - 1  # the path's last node: its row is the next place's
        self._pending, self._pending_at = logits[1 + last : 2 + last], len(self.sequence)

    def _judge_tree(self, base: int, block: Block, target_tokens: list[int], logits: torch.Tensor) -> Verdict:
        """A tree's verdict: from the token before the block, each node whose token is the
        target's choice at its parent's row is taken (the spine's as a chain's, then a sibling at
        the rejected place, then nodes grown below it); the target's choice at the last one's row
        settles the next place. The cache keeps the path taken (its last row stored, as a chain's is)."""
        k = len(block.tokens)
        tokens = node_tokens(block.tokens, block.siblings, block.grown)
        path = greedy_path(node_parents(k, block.siblings, block.grown), tokens, target_tokens)
        accepted = sum(node < k for node in path)
        branch = path[accepted:]
        self.keep_tree_path(base, block, accepted, branch, logits)
        last = path[-1] if path else -1
        self._pending_choice = target_tokens[1 + (branch[-1] if branch else k - 1)]
        return Verdict(base=base, accepted=accepted, token=target_tokens[1 + last], epoch=block.epoch,
                       branch=tuple(tokens[node] for node in branch))


def _branch_sampled(session: TargetSession, base: int, block: Block, accepted: int, r: torch.Tensor,
                    p: torch.Tensor, start: int) -> tuple[list[int], tuple[int, ...], torch.Tensor, int]:
    """A sampled tree below its rejected place: the siblings there tried against the residual r,
    then, below a sibling taken, the nodes grown from it against the target's p at its row, and
    so on down (each a fixed candidate, tried as branch_sampled tries one, so every place follows
    p). Returns the nodes taken and their tokens, the row the next token is drawn from (what is left of the last
    one tried, or p at the last node's row) and its position. p: the group's rows, this block's
    from ``start`` (the place before the block first)."""
    k, seed = len(block.tokens), session.sampling.seed
    tokens = node_tokens(block.tokens, block.siblings, block.grown)
    children = children_of(node_parents(k, block.siblings, block.grown))
    path, at, place = [], accepted - 1, base + accepted
    while options := [node for node in children.get(at, ()) if node >= k]:
        coins = [uniform(seed, place, Purpose.BRANCH, j) for j in range(len(options))]
        taken, r = branch_sampled(r, [tokens[node] for node in options], coins)
        if taken is None:
            break
        at = next(node for node in options if tokens[node] == taken)
        path.append(at)
        place += 1
        r = p[start + 1 + at]
    return path, tuple(tokens[node] for node in path), r, place


def _judge_sampled(group: list[tuple[int, TargetSession, int, Block, torch.Tensor]]) -> list[Verdict]:
    """The verdicts of sampled sessions that warp alike, (job, session, base, block, logits) each,
    in one pass: p for every row at once, p at every drafted token in one host read, the
    acceptance per session by its keyed uniforms, then every bonus or correction drawn at once in
    a second read (a correction from norm(max(0, p - q)); none here when q stayed with the draft,
    whose verdict carries the p row instead)."""
    p = warp_probs(torch.cat([logits for *_, logits in group]), group[0][1].sampling)  # [sum of k + 1, vocab]
    starts, at = [], 0
    for *_, logits in group:
        starts.append(at)
        at += logits.shape[0]
    rows = [start + i for (_, _, _, block, _), start in zip(group, starts) for i in range(len(block))]
    cols = [t for _, _, _, block, _ in group for t in block.tokens]
    p_drafted = p[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)].tolist() if rows else []
    outcomes, draws, keyed = [], [], []  # per session: (base, block, accepted, the p row it is owed, or None)
    branches = []  # per session: the tokens a tree took from the rejected place on
    for (_, session, base, block, logits), start in zip(group, starts):
        k, seed = len(block), session.sampling.seed
        mine, p_drafted = p_drafted[:k], p_drafted[k:]
        accepted = accept_sampled(mine, block.probs, [uniform(seed, base + i, Purpose.ACCEPT) for i in range(k)])
        row = p[start + accepted]
        branches.append(())
        if accepted < k and block.q_rows is None:  # the draft draws the correction: it gets the p row
            outcomes.append((base, block, accepted, row))
            continue
        outcomes.append((base, block, accepted, None))
        if accepted == k:
            if block.is_tree:
                session.keep_tree_path(base, block, accepted, [], logits)
            draws.append(row)
            keyed.append(uniform(seed, base + accepted, Purpose.RESOLVE))
            continue
        r = residual(row, block.q_rows[accepted].to(row.device))  # q rows off the wire: on the host
        place = base + accepted
        if block.is_tree:  # nodes off the spine from here: each place's draw, given them
            branch, branches[-1], r, place = _branch_sampled(session, base, block, accepted, r, p, start)
            session.keep_tree_path(base, block, accepted, branch, logits)
        draws.append(r)
        keyed.append(uniform(seed, place, Purpose.RESOLVE))
    tokens = iter(
        sample_indices(torch.stack(draws), torch.tensor(keyed, dtype=torch.float64, device=p.device)).tolist()
        if draws else []
    )
    return [
        Verdict(base=base, accepted=accepted, token=NO_TOKEN if p_row is not None else next(tokens),
                epoch=block.epoch, p_row=p_row, branch=branch)
        for (base, block, accepted, p_row), branch in zip(outcomes, branches)
    ]


def _first_sampled(group: list[tuple[TargetSession, Sequence[int], Block]]) -> list[Verdict | None]:
    """``Verifier.judge_first`` for sampled sessions that warp alike, each holding its committed
    tokens and the row for the next place: p for every stored row at once, p at every first
    token in one host read, every correction drawn at once in a second (none when q stayed with
    the draft: that verdict carries the p row instead)."""
    p = warp_probs(torch.cat([session.stored_row for session, _, _ in group]), group[0][0].sampling)  # [G, vocab]
    firsts = torch.tensor([block.tokens[0] for _, _, block in group], dtype=torch.long, device=p.device)
    p_first = p[torch.arange(len(group), device=p.device), firsts].tolist()
    verdicts: list[Verdict | None] = []
    draws, keyed, drawn = [], [], []  # the corrections drawn here: residual rows, their uniforms, verdict places
    for g, ((session, committed, block), p_d) in enumerate(zip(group, p_first)):
        base, seed = len(committed), session.sampling.seed
        if accept_sampled([p_d], block.probs[:1], [uniform(seed, base, Purpose.ACCEPT)]):
            verdicts.append(None)
            continue
        session.count_verified(len(block))
        if block.q_rows is None:
            verdicts.append(Verdict(base=base, accepted=0, token=NO_TOKEN, epoch=block.epoch, p_row=p[g]))
            continue
        draws.append(residual(p[g], block.q_rows[0].to(p.device)))
        keyed.append(uniform(seed, base, Purpose.RESOLVE))
        drawn.append(len(verdicts))
        verdicts.append(Verdict(base=base, accepted=0, token=NO_TOKEN, epoch=block.epoch))
    if draws:
        tokens = sample_indices(torch.stack(draws), torch.tensor(keyed, dtype=torch.float64, device=p.device)).tolist()
        for at, token in zip(drawn, tokens):
            verdicts[at] = dataclasses.replace(verdicts[at], token=token)
    return verdicts
