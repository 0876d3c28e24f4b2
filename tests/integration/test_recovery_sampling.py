"""A sampled session that loses its draft while a verdict is in flight, and goes on with the target
alone once its hold expires, still samples from the target's distribution: the verdict in flight is
voided whatever it says (a rejection's correction would need the lost draft), then the target draws
each token itself. Checked like tests/integration/test_sampling_exact.py: the marginals of the first
two tokens against the target's exact ones by chi-square (alpha 1e-3 each), and, for power, the
same samples against the draft's must fail. (Voiding the verdict only when it rejects, the bug the
rule guards against, fails this test at p ~ 1e-65 on the first token.)

Real gRPC on loopback to a real draft service and a real session host (hosted here, without Ray);
the fault is injected at the one point that matters: each session's draft is lost as its first
block's verdict comes back from the target's batched step."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.distributed import DistributedEngine
from coordinator.session.pipeline import SessionPipeline
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.models import load_model_info
from tests.integration.test_sampling_exact import assert_first_tokens_follow_the_target
from tests.workers import in_process_workers

SAMPLES = 2500
AT_ONCE = 250


@pytest.fixture(scope="module")
def workers(models, loop):
    """The draft keeps every session it was sent (its link is not really lost here, so nothing frees
    them until the host closes): its pool has room for all of them. The target takes nothing in
    while idle: a prompt prefilled ahead lets the stored row reject a first block on arrival, a
    verdict never in flight, and this test is about the one in flight."""
    with in_process_workers(loop, models, draft_kv_tokens=100_000, load_aware="off", idle_prefill="off") as w:
        yield w.host, w.limits, w.target_address, w.draft_address


@pytest.fixture
def draft_lost_at_first_verdict(monkeypatch):
    """Each session's draft is lost just as its first verdict arrives (on the host's compute thread,
    where a lost draft's detach runs too), so that verdict is in flight when the session detaches,
    and its hold for the draft expires at once: the target goes on alone."""
    verified = SessionPipeline.verified

    def losing(self, now, *args):
        effects = []
        if self.stats.detached == 0 and not self.detached:
            effects = self.detach(now, False) + self.hold_expired(float("inf"))  # its hold is over at once
        return effects + verified(self, now, *args)

    monkeypatch.setattr(SessionPipeline, "verified", losing)


@pytest.mark.slow
def test_a_sampled_session_going_on_alone_after_a_lost_draft_follows_the_target(
        workers, models, model_dirs, prompt_ids, loop, draft_lost_at_first_verdict):
    host, limits, target_address, draft_address = workers
    prompt, sampling = prompt_ids["medium"], SamplingParams(temperature=1.0)
    policy = PolicyConfig(name="constant", draft_length=3)
    engine = DistributedEngine(load_model_info(model_dirs.target), limits, target_address, draft_address, "async")

    async def run_all():
        await engine.connect()
        results = []
        try:
            for first in range(0, SAMPLES, AT_ONCE):
                reqs = [
                    GenerationRequest(prompt, 2, SamplingParams(temperature=1.0, seed=seed), policy, ignore_eos=True)
                    for seed in range(first, min(SAMPLES, first + AT_ONCE))
                ]
                results += await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            await engine.close()
        return results

    results = loop.run_until_complete(run_all())
    assert all(r.stats.detached == 1 and r.stats.reattached == 0 for r in results)
    assert sum(r.stats.discarded_tokens for r in results) >= SAMPLES  # every first block was voided
    assert all(r.stats.round_sources == ["detached", "detached"] for r in results)  # the target drew both
    loop.run_until_complete(host.Stats(None, None))  # the host's compute thread is past the steps that closed them
    assert not host.sessions and host.pool.used_pages == 0
    assert_first_tokens_follow_the_target(models, prompt, sampling, results)
