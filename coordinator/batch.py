"""Many requests at once in one process, through the same batched steps as the workers: each
draft forward advances every session that is drafting (each stops at its own SVIP place), each
target forward verifies every block that is ready, a ragged batch over the paged KV pools. A
finished session's place goes to the next request at once (continuous batching). Admission counts
KV tokens: a session holds room for its prompt plus max_new_tokens in both pools, so none ever
runs out of pages midway. Outputs equal the engine's one request at a time, token for token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from draft_worker.drafter import Drafter
from svip_common.contracts import Block, GenerationRequest, GenerationResult, Verdict
from svip_common.errors import InvalidRequest
from target_worker.verifier import Verifier


class BatchSession(Protocol):
    """What the batch asks of a request's session (coordinator/engine.py's EngineSession)."""

    committed: list[int]
    draft: object  # its draft session: forward_s
    target: object  # its target session: forward_s, and what the verifier verifies it against

    @property
    def done(self) -> bool: ...

    def begin(self): ...

    def settle(self, block: Block, verdict: Verdict) -> list[int]: ...

    def fail(self, error: Exception) -> None: ...

    def time_round(self, wall_s: float, draft_s: float, target_s: float) -> None: ...

    def result(self) -> GenerationResult: ...

    def close(self) -> None: ...


@dataclass
class _Slot:
    index: int  # the request's place in the input
    session: BatchSession
    pages: int  # KV pages reserved in each pool
    block: Block | None = None  # drafted, waiting for its verdict
    draft: object = None  # the BlockDraft in the making
    marks: tuple = field(default_factory=tuple)  # (round start, draft forward_s, target forward_s)


class BatchEngine:
    def __init__(self, resolve: Callable[[GenerationRequest], GenerationRequest],
                 open_session: Callable[[GenerationRequest], BatchSession], drafter: Drafter | None,
                 verifier: Verifier, batch_size: int, max_batched_tokens: int | None = None,
                 on_step: Callable[[int], None] = lambda sessions: None):
        """Built from the engine's parts (SpeculativeEngine.batch): resolve a request (checked,
        as it will run), open its session, the two models; on_step(n): the next target step
        verifies n sessions (what the load their gates see is priced at)."""
        if batch_size < 1:
            raise InvalidRequest(f"batch size must be >= 1, got {batch_size}")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise InvalidRequest(f"max batched tokens must be >= 1, got {max_batched_tokens}")
        self.resolve, self.open_session, self.on_step = resolve, open_session, on_step
        self.drafter, self.verifier = drafter, verifier
        self.batch_size, self.max_batched_tokens = batch_size, max_batched_tokens
        self.steps = 0  # target forwards run
        self.batch_sizes: list[int] = []  # sessions verified per target step

    def generate_all(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        requests = [self.resolve(r) for r in requests]  # every bad request named before any runs
        for r in requests:
            self._check_fits(r)
        results: list[GenerationResult | None] = [None] * len(requests)
        waiting, active = deque(enumerate(requests)), []
        reserved = 0
        try:
            while waiting or active:
                while (
                    waiting
                    and len(active) < self.batch_size
                    and reserved + self._pages(waiting[0][1]) <= self._capacity()
                ):
                    index, request = waiting.popleft()
                    pages = self._pages(request)
                    active.append(_Slot(index, self.open_session(request), pages))
                    reserved += pages
                self.on_step(len(active))
                self._draft(active)
                self._verify(active)
                for slot in [s for s in active if s.session.done]:
                    results[slot.index] = slot.session.result()
                    slot.session.close()
                    reserved -= slot.pages
                    active.remove(slot)
        finally:
            for slot in active:
                slot.session.close()
        return results

    def _draft(self, active: list[_Slot]) -> None:
        """A block for every session without one, drafted in lockstep: one draft forward per
        step for all of them, each block ending at its own place."""
        drafting = []
        for slot in active:
            if slot.block is not None:
                continue
            slot.marks = (time.perf_counter(), slot.session.draft.forward_s, slot.session.target.forward_s)
            slot.draft = slot.session.begin()
            if slot.draft is None:
                slot.block = Block(base=len(slot.session.committed), tokens=[], probs=[], entropies=[])
            else:
                drafting.append(slot)
        while live := [s.draft for s in drafting if not s.draft.done]:
            self.drafter.step(live)
        for slot in drafting:
            if slot.draft.error is not None:  # its own choice failed: it ends, the others go on
                slot.session.fail(slot.draft.error)
            slot.block, slot.draft = slot.draft.block, None

    def _verify(self, active: list[_Slot]) -> None:
        """One target forward for every block (a long prompt prefilled in chunks under the budget)."""
        active = [s for s in active if not s.session.done]  # not one that failed drafting
        if not active:
            return
        jobs = [(s.session.target, s.session.committed, s.block) for s in active]
        verdicts = self.verifier.verify_apart(jobs, self.max_batched_tokens)  # a failure, its own
        self.steps += 1
        self.batch_sizes.append(len(active))
        for slot, verdict in zip(active, verdicts):
            if verdict is None:  # only a chunk of its prompt this step
                continue
            session = slot.session
            if isinstance(verdict, Exception):  # failed on its own: the others go on
                session.fail(verdict)
                continue
            session.settle(slot.block, verdict)
            started, draft_s, target_s = slot.marks
            session.time_round(
                time.perf_counter() - started, session.draft.forward_s - draft_s, session.target.forward_s - target_s
            )
            slot.block = None

    def _pages(self, request: GenerationRequest) -> int:
        return self.verifier.pool.pages_for(len(request.prompt_ids) + request.max_new_tokens)

    def _capacity(self) -> int:
        drafter = self.drafter
        pools = [self.verifier.pool] + ([drafter.pool] if drafter is not None and drafter.pool else [])
        return min(p.pages for p in pools)

    def _check_fits(self, request: GenerationRequest) -> None:
        need = len(request.prompt_ids) + request.max_new_tokens
        if self._pages(request) > self._capacity():
            raise InvalidRequest(
                f"a request of {need} tokens (prompt + max_new_tokens) does not fit the KV pool of "
                f"{self._capacity() * self.verifier.pool.page_size} tokens; raise --kv-cache-tokens"
            )
