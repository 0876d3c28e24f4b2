"""A request's grammar never stalls its neighbours (the security review's H-2): a worker builds a
start's matcher off its compute thread, the start waiting "compiling" while every other session
keeps stepping; a request's n choices of one grammar are compiled once per worker; the replica
holds each grammar to a compile budget and each key to a parse budget.

The compile is held by construction (an event the test sets), so "the neighbour finished while the
grammar compiled" holds whatever the machine's speed."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

import svip_common.grammar_mask
from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.grammar import Grammar
from svip_common.models import load_model_info
from tests.workers import in_process_workers

CHOICES = 8
_fresh = itertools.count()


def fresh_grammar() -> Grammar:
    """A grammar this process has not compiled yet (the workers keep what they compiled)."""
    return Grammar("regex", rf"(held|kept)[0-9]{{1,4}}x{{{next(_fresh)}}}")


def hold_compiles(monkeypatch, grammar: Grammar) -> tuple[threading.Event, list[str]]:
    """Compiling ``grammar`` waits for the returned event (the rest compile as before); the list
    names the threads each of its compiles ran on."""
    release, threads = threading.Event(), []
    real = svip_common.grammar_mask._compile

    def compile_(g, tokenizer):
        if g == grammar:
            threads.append(threading.current_thread().name)
            assert release.wait(300), "the test never released the compile"
        return real(g, tokenizer)

    monkeypatch.setattr(svip_common.grammar_mask, "_compile", compile_)
    return release, threads


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_neighbour_finishes_while_eight_choices_wait_for_their_grammar(models, model_dirs, prompt_ids, loop,
                                                                         monkeypatch, pipeline):
    grammar = fresh_grammar()
    release, threads = hold_compiles(monkeypatch, grammar)
    svip = PolicyConfig(name="svip")
    held = GenerationRequest(prompt_ids["medium"], 12, SamplingParams(grammar=grammar), svip)
    neighbour = GenerationRequest(prompt_ids["long"], 24, policy=svip, ignore_eos=True)
    with in_process_workers(loop, models, load_aware="off") as w:
        engine = DistributedEngine(load_model_info(model_dirs.target), w.limits, w.target_address,
                                   w.draft_address, pipeline)

        async def run():
            await engine.connect()
            try:
                waiting = [asyncio.ensure_future(engine.generate(held)) for _ in range(CHOICES)]
                beside = await engine.generate(neighbour)  # every one of the eight still compiling
                assert not any(t.done() for t in waiting) and not release.is_set()
                stats = await w.host.Stats(None, None)  # the compute thread answers a probe meanwhile
                assert not stats.unavailable and len(w.host.grammar_waits) == CHOICES
                release.set()
                return beside, await asyncio.gather(*waiting)
            finally:
                release.set()
                await engine.close()

        beside, results = loop.run_until_complete(run())
    alone = SpeculativeEngine(models["target"], None)
    assert beside.token_ids == alone.generate(neighbour).token_ids
    assert all(r.token_ids == alone.generate(held).token_ids for r in results)
    assert len(threads) <= 2 and all("aside" in name for name in threads)  # once a worker, off its compute thread


def test_a_grammar_the_worker_cannot_compile_fails_its_request_alone(models, model_dirs, prompt_ids, loop):
    """The wire checks a grammar's bounds only; one that does not compile fails its own session with
    INVALID_ARGUMENT when its build (off the compute thread) refuses it, and its neighbour is exact."""
    from svip_common.errors import InvalidRequest

    broken = GenerationRequest(prompt_ids["short"], 8, SamplingParams(grammar=Grammar("regex", "[a-")))
    neighbour = GenerationRequest(prompt_ids["medium"], 16, policy=PolicyConfig(name="svip"), ignore_eos=True)
    with in_process_workers(loop, models, load_aware="off") as w:
        engine = DistributedEngine(load_model_info(model_dirs.target), w.limits, w.target_address,
                                   w.draft_address, "async")

        engine.resolve = lambda request: request  # a peer that skips the caller's own check

        async def run():
            await engine.connect()
            try:
                return await asyncio.gather(engine.generate(broken), engine.generate(neighbour),
                                            return_exceptions=True)
            finally:
                await engine.close()

        got = loop.run_until_complete(run())
    assert isinstance(got[0], InvalidRequest) and "does not compile" in str(got[0])
    assert got[1].token_ids == SpeculativeEngine(models["target"], None).generate(neighbour).token_ids
