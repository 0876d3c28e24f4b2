"""A session outlives its workers (issue 11), on real Ray actors, real gRPC and real signals:
a draft worker SIGKILLed mid-stream (the sessions go on without it, then re-attach to the one Ray
restarts), a draft worker SIGSTOPped (the sessions go on past their stall deadline and end while it is
still stopped), a target worker SIGKILLed mid-stream (the caller starts each session again on the
restarted target, on its prompt plus what had settled). Every output equals an undisturbed run,
token for token, with no error; a seeded sampled session too. A worker killed for good: the draft
leaves the target alone (still exact), the target ends the session with WorkerUnavailable. Every
fault lands while the target holds its steps (tests/gates.py): the sessions are under way and
none can end before it, whatever the machine's speed."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import WorkerUnavailable
from svip_common.pair_config import PairConfig
from tests.drills import full_drill
from tests.gates import async_wait_until

pytestmark = [pytest.mark.drill, pytest.mark.system]

SVIP = PolicyConfig(name="svip", threshold=0.6)
CONSTANT = PolicyConfig(name="constant", draft_length=4)
NEW = 280  # more than 3 steps can settle (the long prompt is 204 tokens of 512)
STALL_S = 1.0


@pytest.fixture(scope="module")
def pair(model_dirs):
    import ray

    init_local_ray(pairs=2)
    pair = WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, load_aware="off",
                                 draft_stall_s=STALL_S, sampled_hold_s=60.0))
    yield pair
    pair.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(pair, loop):
    engine = DistributedEngine.for_pair(pair, "async")
    loop.run_until_complete(engine.connect())
    yield engine
    loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def requests(prompt_ids):
    prompts = list(prompt_ids.values())
    return [
        GenerationRequest(prompts[i % len(prompts)], NEW - 10 * i, policy=SVIP if i % 2 else CONSTANT, ignore_eos=True)
        for i in range(6)
    ]


@pytest.fixture(scope="module")
def expected(models, requests):
    alone = SpeculativeEngine(models["target"], None)
    return [alone.generate(r).token_ids for r in requests]


def run_through(loop, engine, requests, fault, gate, steps: int = 3):
    """Run the requests at once; fault() once the target has verified `steps` batches and holds
    the next (the gate opens after the fault). A step settles at most a block plus one (41 tokens)
    per session, so after 3 no session of NEW - 70 or more tokens can have ended, on any machine."""

    async def go():
        with gate.held(steps):
            tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
            await async_wait_until(lambda: asyncio.sleep(0, gate.holding()), what="the target holding")
            assert not any(t.done() for t in tasks), "a session ended before the fault"
            fault()
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    return loop.run_until_complete(go())


def wait_for_draft_link(loop, engine, timeout: float = 120.0) -> None:
    """Until the target's link to its (replaced) draft is up again: the replacement serving is not
    enough, the target dials it on its own schedule, and a session started before that begins
    detached (exact, but not what the check after a replacement is about)."""
    deadline = time.monotonic() + timeout
    while loop.run_until_complete(engine.worker_stats())["target"].draft_lost:
        assert time.monotonic() < deadline, "the target did not reconnect to the replaced draft"
        loop.run_until_complete(asyncio.sleep(0.1))


def test_a_draft_killed_mid_stream_leaves_every_session_exact(loop, engine, pair, requests, expected, target_gate):
    draft_pid = pair.pids()["draft"]
    results = run_through(loop, engine, requests, lambda: os.kill(draft_pid, signal.SIGKILL), target_gate)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.detached for r in results) >= 1
    loop.run_until_complete(pair.draft_serving_address())  # Ray restarts it
    assert pair.pids()["draft"] != draft_pid
    wait_for_draft_link(loop, engine)
    # the replaced draft drafts again: a new session speculates
    again = loop.run_until_complete(engine.generate(requests[1]))
    assert again.token_ids == expected[1] and again.stats.draft_tokens > 0 and again.stats.detached == 0


@full_drill
def test_a_stopped_draft_is_left_behind_and_speculates_again_once_it_resumes(
    loop, engine, pair, requests, expected, target_gate
):
    """The draft is stopped mid-stream and resumed only after every session has ended: so they
    ended without it (detached, exact), on any machine; then it answers again and speculates."""
    draft_pid = pair.pids()["draft"]
    try:
        results = run_through(loop, engine, requests, lambda: os.kill(draft_pid, signal.SIGSTOP), target_gate)
    finally:
        os.kill(draft_pid, signal.SIGCONT)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.detached for r in results) >= 1

    async def draft_caught_up():  # it answers the cancels it missed, and the target's link is up
        stats = await engine.worker_stats()
        return "draft" in stats and stats["draft"].open_sessions == 0 and not stats["target"].draft_lost

    loop.run_until_complete(async_wait_until(draft_caught_up, what="the resumed draft catching up"))
    again = loop.run_until_complete(engine.generate(requests[0]))
    assert again.token_ids == expected[0] and again.stats.draft_tokens > 0


@full_drill
def test_a_target_killed_mid_stream_is_replaced_and_every_session_goes_on_exact(
    loop, engine, pair, requests, expected, target_gate
):
    target_pid = pair.pids()["target"]
    results = run_through(loop, engine, requests, lambda: os.kill(target_pid, signal.SIGKILL), target_gate)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    restarted = [r for r in results if r.stats.target_restarts]
    assert restarted and all(r.stats.reprefilled_tokens > 0 for r in restarted)
    loop.run_until_complete(pair.recover_target())
    assert pair.pids()["target"] != target_pid
    assert engine.recoveries.restarts >= 1


@full_drill
def test_a_seeded_sampled_session_through_a_draft_kill_equals_it_undisturbed(
    loop, engine, pair, prompt_ids, target_gate
):
    request = GenerationRequest(
        prompt_ids["medium"], NEW, sampling=SamplingParams(temperature=0.9, seed=77), policy=SVIP, ignore_eos=True
    )
    wait_for_draft_link(loop, engine)  # a target restarted by the test before dials its draft anew
    undisturbed = loop.run_until_complete(engine.generate(request))
    assert undisturbed.stats.draft_tokens > 0 and undisturbed.stats.detached == 0
    draft_pid = pair.pids()["draft"]
    (disturbed,) = run_through(loop, engine, [request], lambda: os.kill(draft_pid, signal.SIGKILL), target_gate)
    assert disturbed.stats.detached >= 1 and disturbed.stats.reattached >= 1
    assert disturbed.token_ids == undisturbed.token_ids


def test_a_seeded_sampled_session_through_a_target_kill_equals_it_undisturbed(
    loop, engine, pair, prompt_ids, target_gate
):
    # constant blocks: SVIP on a top-p-filtered q drafts 40-token blocks that are mostly rejected (slow, not the point)
    request = GenerationRequest(
        prompt_ids["short"],
        NEW,
        sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=5),
        policy=CONSTANT,
        ignore_eos=True,
    )
    wait_for_draft_link(loop, engine)  # a target restarted by the test before dials its draft anew
    undisturbed = loop.run_until_complete(engine.generate(request))
    target_pid = pair.pids()["target"]
    (disturbed,) = run_through(loop, engine, [request], lambda: os.kill(target_pid, signal.SIGKILL), target_gate)
    assert disturbed.stats.target_restarts == 1
    assert disturbed.token_ids == undisturbed.token_ids


def test_a_worker_killed_for_good(model_dirs, models, loop, prompt_ids, target_gate):
    """Restarts spent: without its draft the session finishes exact on the target alone; without
    its target it ends with WorkerUnavailable, never a hang."""
    doomed = WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, load_aware="off",
                                   worker_restarts=0))
    engine = DistributedEngine.for_pair(doomed, "async")
    loop.run_until_complete(engine.connect())
    request = GenerationRequest(prompt_ids["long"], 300, policy=CONSTANT, ignore_eos=True)
    try:
        (result,) = run_through(loop, engine, [request], lambda: doomed.kill("draft"), target_gate)
        assert result.stats.detached == 1 and result.stats.reattached == 0
        assert result.token_ids == SpeculativeEngine(models["target"], None).generate(request).token_ids
        with pytest.raises(WorkerUnavailable, match="gone for good|did not come back"):
            run_through(loop, engine, [request], lambda: doomed.kill("target"), target_gate)
    finally:
        loop.run_until_complete(engine.close())
        doomed.shutdown()


def test_a_stuck_compute_thread_makes_the_worker_unavailable(models, loop):
    """Stats probes the compute thread: one that does not answer in time is reported (and a
    health check then replaces the worker); once it answers again, so does Stats."""
    from draft_worker.drafter import Drafter
    from draft_worker.service import DraftService
    from svip_common.contracts import Limits

    limits = Limits(tokens=models["target"].token_limit, positions=512)

    async def probe():
        service = DraftService(Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens), limits)
        service.compute_probe_s = 0.5
        unstick = threading.Event()
        try:
            assert (await service.Stats(None, None)).unavailable == ""
            service.compute.post(unstick.wait)  # stuck until the test says so
            stuck = (await service.Stats(None, None)).unavailable
            unstick.set()
            return stuck, (await service.Stats(None, None)).unavailable
        finally:
            unstick.set()
            await service.close()

    stuck, after = loop.run_until_complete(probe())
    assert "compute thread has not answered" in stuck and after == ""


@pytest.mark.parametrize("error, code", [("CUDA error: device-side assert triggered", 70), ("shapes do not match", 0)])
def test_a_device_failure_makes_the_worker_exit_so_it_is_replaced(error, code):
    import subprocess
    import sys

    script = f"from svip_common.errors import exit_on_device_failure\nexit_on_device_failure(RuntimeError({error!r}))\n"
    assert subprocess.run([sys.executable, "-c", script], capture_output=True).returncode == code
