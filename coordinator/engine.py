"""The in-process engine: draft and target in one process, one round at a time.

This is the reference every other mode must match token for token. A round reads as its
algorithm: propose a block, verify it, commit the settled tokens, and let both caches roll back
on the next call to what the committed sequence still shares.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from coordinator.batch import BatchEngine
from coordinator.calibration import Calibration, auto_prior, calibrate
from coordinator.head_calibration import calibrate_head
from draft_worker.drafter import Drafter, NullDraftSession
from draft_worker.feature_draft import FeatureDrafter, LoadedHead
from svip_common.acceptance import AutoEstimate, SessionStop
from svip_common.auto_prior import estimate_from, stored_prior
from svip_common.contracts import (
    AUTO,
    Block,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Verdict,
    clip_settled,
)
from svip_common.emulation import Emulation
from svip_common.errors import InvalidRequest, SvipError
from svip_common.models import LoadedModel, check_same_vocabulary, pair_limits
from svip_common.pair_config import PairConfig
from svip_common.step_cost import UNLIMITED, Ewma, SessionGate, load_aware_for
from svip_common.trees import forward_price, node_price
from svip_common.trees import priced as tree_priced
from target_worker.verifier import Verifier

# Called after each round with the block, its verdict and the tokens it settled (streaming,
# benchmarks).
OnRound = Callable[[Block, Verdict, list[int]], None]


class SpeculativeEngine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | LoadedHead | None = None,
                 config: PairConfig | None = None, **changes):
        """config: the pair's configuration (svip_common/pair_config.py), the distributed pair's own;
        None: its defaults for these models; changes: fields changed from it (load_aware="off":
        each length policy exactly as configured, the paper's reference). The engine reads its
        kv_cache_tokens (each model's KV pool, every session in flight sharing it),
        max_batched_tokens (a batch's cap on the tokens of one forward), load_aware (whose blocks
        hold no more tokens than pay at the target's measured load: svip_common/step_cost.py) and
        policy auto's knobs (svip_common/acceptance.py)."""
        if config is None:
            config = PairConfig(target.path, None if draft is None else draft.path)
        self.config = config = config.replace(**changes)
        kv_cache_tokens, max_batched_tokens = config.kv_cache_tokens, config.max_batched_tokens
        head = draft if isinstance(draft, LoadedHead) else None
        model = None if head is not None else draft  # a token draft: a model of its own
        if model is not None:
            check_same_vocabulary(target, model)
        self.target = target
        layers = head.head.config.target_layers if head is not None else ()
        self.verifier = Verifier(target, pair_limits(target, model).tokens, kv_cache_tokens, feature_layers=layers)
        self.limits = pair_limits(target, model, kv_tokens=self.verifier.pool.tokens)
        if head is not None:
            # the head's own copy of the target's embedding where it has one (a tensor-parallel shard holds a part)
            embedding = head.embedding if head.embedding is not None else target.model.get_input_embeddings()
            self.drafter = FeatureDrafter(head, embedding, target.vocab_size, self.limits.tokens)
        elif model is not None:
            self.drafter = Drafter(model, target.vocab_size, self.limits.tokens, kv_cache_tokens, max_batched_tokens)
        else:
            self.drafter = None
        self._calibration: Calibration | None = None
        self._auto: AutoEstimate | None = None
        self.draft_token_s = Ewma(0.2)  # what a drafted token cost recent sessions (a new session's gate starts there)
        self.in_step = 1  # sessions the next target step verifies (generate_many's batch sets it each step)

    @property
    def load_aware(self) -> str:
        return self.config.load_aware

    @load_aware.setter
    def load_aware(self, mode: str) -> None:
        """A bench's method runs under its own mode (svip_bench/methods.py): the configuration changed."""
        self.config = self.config.replace(load_aware=mode)

    def close(self) -> None:
        """Nothing to stop: the models are this process's (the engine front's close, coordinator/front.py)."""

    def time_as(self, emulation: Emulation | None, virtual: bool = False) -> None:
        """Device timing on this machine (svip_common/device_timing.py): the target's and the draft's
        forwards take turns on one emulated device, each lasting its own step model's time (virtual:
        waiting for nothing, only keeping the account; None: as the models run)."""
        if emulation is None:
            self.verifier.pool.timing = None
            if self.drafter is not None:
                self.drafter.time_as(None)
            return
        target, draft = emulation.shared_timings(virtual)
        if self.drafter is not None and draft is None:
            raise InvalidRequest(f"--emulate {emulation.spec!r} names no draft, and the pair has one "
                                 "(draft=MODEL@DEVICE)")
        self.verifier.pool.timing = target
        if self.drafter is not None:
            self.drafter.time_as(draft)

    def device_use(self) -> dict | None:
        """The emulated device's use so far ({"device": ...}), or None without device timing."""
        timing = self.verifier.pool.timing
        return None if timing is None else {"device": timing.report()}

    @property
    def draft_path(self) -> str | None:
        return None if self.drafter is None else self.drafter.draft.path

    @property
    def feature_draft(self) -> bool:
        """Whether the draft is a feature head (it drafts from the target's hidden states)."""
        return isinstance(self.drafter, FeatureDrafter)

    def calibration(self) -> Calibration:
        """The pair's learnt SVIP threshold, measured on first use (a few seconds; a feature head's
        by drafting its own blocks, coordinator/head_calibration.py)."""
        if self._calibration is None:
            if self.feature_draft:
                self._calibration = calibrate_head(self.target, self.drafter.head, embedding=self.drafter.embedding)
            else:
                self._calibration = calibrate(self.target, self.drafter.draft)
        return self._calibration

    def auto_estimate(self) -> AutoEstimate:
        """The pair's `auto` estimate, from its prior on first use (``new_auto_estimate``); it
        learns from every request after."""
        if self._auto is None:
            self._auto = self.new_auto_estimate()
        return self._auto

    def new_auto_estimate(self) -> AutoEstimate:
        """The pair's `auto` estimate as a new deployment starts it: from the prior stored beside
        the draft, or measured here (about two seconds on a CPU)."""
        prior = stored_prior(self.drafter.draft.path)
        if prior is not None or self.feature_draft:  # a head without a stored prior: the generic one
            return estimate_from(prior, self.config.auto)
        return auto_prior(self.target, self.drafter.draft, self.config.auto)

    def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """The request as it will run: validated, policy 'none' when there is no draft, and
        threshold 'auto' replaced by the pair's calibrated value."""
        request = request.checked_for(self.drafter is not None, self.limits)
        policy = request.policy
        if policy.threshold == AUTO:
            threshold = self.calibration().threshold_for(policy.entropy_scale) if self.drafter else 0.0
            request = dataclasses.replace(request, policy=dataclasses.replace(policy, threshold=threshold))
        return request

    def open(self, request: GenerationRequest) -> EngineSession:
        """A request's session on both models (resolved and validated first)."""
        return EngineSession(self, self.resolve(request))

    def generate_many(self, requests: list[GenerationRequest], batch_size: int) -> list[GenerationResult]:
        """Up to batch_size requests in flight at once through the batched steps (coordinator/batch.py)."""
        return self.batch(batch_size, self.config.max_batched_tokens).generate_all(requests)

    def batch(self, batch_size: int, max_batched_tokens: int | None = None) -> BatchEngine:
        """A batch over this engine's models and sessions (coordinator/batch.py)."""
        return BatchEngine(self.resolve, self.open, self.drafter, self.verifier, batch_size, max_batched_tokens,
                           on_step=self._price_steps_at)

    def _price_steps_at(self, sessions: int) -> None:
        self.in_step = sessions  # what the load the sessions' gates see is priced at

    def generate(self, request: GenerationRequest, on_round: OnRound | None = None) -> GenerationResult:
        session = self.open(request)
        self.in_step = 1
        try:
            while not session.done:
                round_start = time.perf_counter()
                draft_s, target_s = session.draft.forward_s, session.target.forward_s
                block = session.propose()
                verdict = session.target.verify(session.committed, block)
                settled = session.settle(block, verdict)
                session.time_round(time.perf_counter() - round_start, session.draft.forward_s - draft_s,
                                   session.target.forward_s - target_s)
                if on_round is not None:
                    on_round(block, verdict, settled)
            return session.result()
        finally:
            session.close()


class EngineSession:
    """One request in the in-process engine: its sessions on the draft and the target, what is
    committed, its stats. A round is propose (draft a block), verify (the target, alone or in a
    batch), settle (feedback to the policy, commit, finish)."""

    def __init__(self, engine: SpeculativeEngine, request: GenerationRequest):
        self.request = request
        self.stop_ids = request.stop_ids(engine.target.eos_token_ids)
        self.target = engine.verifier.open(request.sampling, len(request.prompt_ids), self.stop_ids, request.logprobs,
                                           request.cache_scope)
        if engine.drafter is None or request.policy.name == "none":
            self.draft = NullDraftSession()
        else:
            self.draft = engine.drafter.open(request.sampling, request.policy, tuple(self.stop_ids),
                                             len(request.prompt_ids), request.cache_scope)
        self.committed = list(request.prompt_ids)
        self.generated: list[int] = []
        self.logprobs = None if request.logprobs is None else []  # per generated token (target_worker/logprobs.py)
        if request.prompt_logprobs:  # read as its prefill runs (target_worker/logprobs.py)
            self.target.score(request.prompt_ids, request.logprobs)
        self.finish_reason: str | None = None
        self.error: str | None = None  # finish_reason "error": what failed
        self.stats = GenerationStats()
        self.started = time.perf_counter()
        self._engine = engine
        drafts = not isinstance(self.draft, NullDraftSession)
        auto = drafts and request.policy.name == "auto"
        # load-aware: the gate pauses drafting that does not pay (and cuts blocks, but not auto's)
        self.gated = drafts and load_aware_for(engine.load_aware, request.sampling.greedy)
        self.gate = SessionGate(cuts=not auto, shared_draft_token_s=engine.draft_token_s) if self.gated else None
        self.stop = SessionStop(engine.auto_estimate(), request.sampling.greedy) if auto else None
        self._draft_mark = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        return self.request.max_new_tokens - len(self.generated)

    def propose(self) -> Block:
        """Draft this round's block (a forward at a time, alone)."""
        return self.draft.propose(self.committed, budget=self.draft_budget())

    def begin(self):
        """This round's block to draft in lockstep with other sessions (None: no draft)."""
        if isinstance(self.draft, NullDraftSession):
            return None
        return self.draft.begin(self.committed, self.draft_budget())

    def draft_budget(self) -> int:
        """The most tokens this round's block may hold: the verdict's own token fills the last
        place, and at load no more than pay (0: this round runs as the target alone)."""
        cap = UNLIMITED
        engine = self._engine
        priced = tree_priced(self.request.policy.tree)
        load = engine.verifier.load(engine.in_step) if self.gated or self.stop is not None or priced else None
        if priced:
            self.draft.node_price = 0.0 if load is None else node_price(load.plain_rate, load.verify_token_s)
            self.draft.forward_price = 0.0 if load is None else forward_price(load.plain_rate, self._draft_forward_s)
        if self.gated:
            cap = self.gate.cap(load)
        if self.stop is not None:
            self.draft.policy.tune(self.stop.rule(load))
        self._draft_mark = self.draft.compute_s - self.draft.prefill_s
        return min(self.budget - 1, cap)

    @property
    def _draft_forward_s(self) -> float:
        """What one of this session's draft forwards has taken, with its work on the token (its
        prompt's prefill left out), on average; 0 before the first."""
        draft = self.draft
        return max(0.0, draft.compute_s - draft.prefill_s) / draft.forwards if draft.forwards else 0.0

    def settle(self, block: Block, verdict: Verdict) -> list[int]:
        self.draft.feedback(len(block), verdict.accepted)
        self.draft.take_features(verdict.features, verdict.features_from)
        drafting_s = self.draft.compute_s - self.draft.prefill_s - self._draft_mark  # its forwards and work, no prefill
        if self.gate is not None:
            self.gate.record(len(block), verdict.accepted, drafting_s)
        if self.stop is not None:
            self.stop.record(block.entropies, block.probs, verdict.accepted, drafting_s)
        settled = [*block.tokens[: verdict.accepted], *verdict.branch, verdict.token]  # branch: a tree's, off the spine
        settled, self.finish_reason = clip_settled(settled, self.budget, self.stop_ids)
        self.committed += settled
        self.generated += settled
        if self.logprobs is not None:
            self.logprobs += self.target.settled_logprobs(self.committed, len(settled))
        self.stats.record_round(len(block), verdict.accepted, block.entropies[-1] if block.entropies else None)
        if block.siblings is not None:
            self.stats.record_tree(block.nodes, len(verdict.branch))
        return settled

    def fail(self, exc: Exception) -> None:
        """This session failed on its own in a batched step (the others went on): it ends with the
        tokens settled so far and the error."""
        self.finish_reason = "error"
        self.error = str(exc) if isinstance(exc, SvipError) else f"{type(exc).__name__}: {exc}"

    def time_round(self, round_s: float, draft_s: float, target_s: float) -> None:
        self.stats.round_s.append(round_s)
        self.stats.draft_forward_s.append(draft_s)
        self.stats.target_forward_s.append(target_s)

    def result(self) -> GenerationResult:
        stats = self.stats
        stats.wall_s = time.perf_counter() - self.started
        stats.draft_forwards, stats.target_forwards = self.draft.forwards, self.target.forwards
        stats.pauses = self.gate.pauses if self.gated else 0
        scoring = self.target.scoring
        return GenerationResult(list(self.request.prompt_ids), self.generated, self.finish_reason, stats, self.error,
                                self.logprobs, None if scoring is None else scoring.scored)

    def close(self) -> None:
        """Both sessions' pages go back to their pools."""
        self.target.close()
        self.draft.close()


