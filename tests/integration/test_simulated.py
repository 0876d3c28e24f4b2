"""The pipeline on simulated devices (coordinator/simulated.py): the real protocol and models in
virtual time. Its output is the target's own, token for token, in every mode; with no host work
counted (host_scale 0) a run is deterministic and the target alone takes exactly the sum of its
forwards' modelled times; a step's results wait for its end while messages arrive meanwhile."""

from __future__ import annotations

import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.simulated import SimulatedPair
from draft_worker.drafter import Drafter
from svip_common.contracts import DRAFT_PARALLEL, GenerationRequest, Limits, PolicyConfig
from svip_common.device_profile import step_model
from svip_common.emulation import parse_emulation
from target_worker.verifier import Verifier

TARGET, DRAFT = step_model("llama-3.1-70b@4xh100"), step_model("llama-3.1-8b@h100")
SVIP = PolicyConfig(name="svip", threshold=0.6)


def make(models, pipeline="async", draft=True, latency="0.1ms", host_scale=0.0, scale=1, draft_device=DRAFT,
         **options) -> SimulatedPair:
    limits = Limits(tokens=models["target"].token_limit, positions=512)
    drafter = Drafter(models["close_draft"], models["target"].vocab_size, limits.tokens) if draft else None
    options = {"load_aware": "off", **options}
    spec = f"target={TARGET.name},draft={draft_device.name},link={latency},scale={scale}"
    return SimulatedPair(models["target"], Verifier(models["target"], limits.tokens), drafter, limits, pipeline,
                         parse_emulation(spec), host_scale, **options)


@pytest.fixture(scope="module")
def alone(models):
    return SpeculativeEngine(models["target"], None)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("policy", [SVIP, PolicyConfig(name="constant", draft_length=4), PolicyConfig(name="auto"),
                                    PolicyConfig(name="svip", threshold=0.6, tree="cape")])
def test_the_output_is_the_targets_in_virtual_time(models, prompt_ids, alone, pipeline, policy):
    pair = make(models, pipeline, host_scale=1.0)
    requests = [GenerationRequest(ids, 24, policy=policy) for ids in prompt_ids.values()]
    run = pair.run_all(requests)
    for pending, request in zip(pair.pending.values(), requests):
        assert pending.result().token_ids == alone.generate(request).token_ids
    assert run.makespan_s > 0 and run.tokens == 3 * 24


@pytest.mark.parametrize("scale", [1, 3])
def test_the_target_alone_takes_the_sum_of_its_forwards(models, prompt_ids, scale):
    """One forward takes the prompt in and settles the first token; each next forward one token
    (every one times the emulation's scale)."""
    prompt, n = prompt_ids["medium"], 20
    pair = make(models, "sync", draft=False, scale=scale)
    run = pair.run_all([GenerationRequest(prompt, n, policy=PolicyConfig(name="none"))])
    p = len(prompt)
    by_hand = scale * (TARGET.forward_s([(p, 0)]) + sum(TARGET.forward_s([(1, p + i)]) for i in range(n - 1)))
    assert run.makespan_s == pytest.approx(by_hand)
    assert run.busy_s["target"] == pytest.approx(by_hand)


def test_a_run_without_host_time_is_deterministic(models, prompt_ids):
    requests = [GenerationRequest(ids, 24, policy=SVIP) for ids in prompt_ids.values()]
    first, second = make(models).run_all(requests), make(models).run_all(requests)
    assert first.per_request_s == second.per_request_s and first.makespan_s == second.makespan_s


def test_a_step_waits_for_blocks_a_quick_draft_is_about_to_send(models, prompt_ids, alone, monkeypatch):
    """Issue 60: a 1B draft on its own H100 sends a block about a millisecond after its verdict,
    against a 70B target's 16 ms forward: with other sessions' blocks ready the target's step
    waits for those that pay (svip_common/arrivals.py), in virtual time, and wakes when a hold's
    time is up without the block. Every output is the target's; holds happen; deterministic."""
    prompts = list(prompt_ids.values())
    requests = [GenerationRequest(prompts[i % len(prompts)], 32, policy=SVIP) for i in range(6)]
    wakes = []
    wake = SimulatedPair._event_wake
    monkeypatch.setattr(SimulatedPair, "_event_wake", lambda pair, worker: wakes.append(wake(pair, worker)))
    pair = make(models, draft_device=step_model("llama-3.2-1b@h100"), idle_prefill="auto")
    run = pair.run_all(requests)
    for pending, request in zip(pair.pending.values(), requests):
        assert pending.result().token_ids == alone.generate(request).token_ids
    assert pair.host.idle_work.holds > 0 and wakes
    again = make(models, draft_device=step_model("llama-3.2-1b@h100"), idle_prefill="auto").run_all(requests)
    assert again.per_request_s == run.per_request_s


def test_a_slower_link_costs_the_synchronous_pipeline_its_round_trips(models, prompt_ids):
    """Each sync round waits for the block and sends the feedback back: 2 ms more each way costs
    about 4 ms a round (the target does nothing of its own while it waits: idle_prefill off)."""
    request = GenerationRequest(prompt_ids["long"], 24, policy=SVIP)
    fast = make(models, "sync", idle_prefill="off")
    quick = fast.run_all([request])
    slow = make(models, "sync", latency="2ms", idle_prefill="off").run_all([request])
    rounds = len(fast.pending[next(iter(fast.pending))].result().stats.round_sources)
    assert slow.makespan_s - quick.makespan_s == pytest.approx(rounds * 2 * (2e-3 - 1e-4), rel=0.05)


def test_the_simulate_bench_reports_every_mode_against_the_target_alone(tmp_path, model_dirs, capsys):
    import json

    from svip_cli.main import main

    dataset = tmp_path / "spec.jsonl"
    dataset.write_text(json.dumps({"question_id": 1, "category": "qa", "prompt": "question: def f(x):"}) + "\n")
    out = tmp_path / "out"
    code = main(["bench", "--mode", "simulate", "--target", model_dirs.target, "--draft", model_dirs.close_draft,
                 "--dataset", str(dataset), "--categories", "qa", "--prompts-per-category", "1", "--repeats", "1",
                 "--max-new-tokens", "12", "--sim-sessions", "2", "--host-scale", "0", "--tree", "cape",
                 "--emulate", "target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=25gbe",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "simulate.json").read_text())
    modes = ("alone", "inprocess", "sync", "async", "sync+cape", "async+cape")
    assert [(r["sessions"], r["mode"]) for r in doc["rows"]] == [(n, m) for n in (1, 2) for m in modes]
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    assert doc["header"]["target_device"] == "llama-3.1-70b@4xh100" and "| 1 | alone |" in captured.out
    assert "a tree vs its chain" in captured.out and "| 2 | async+cape |" in captured.out
    assert doc["header"]["draft_parallel"] == DRAFT_PARALLEL and "prepared after a rejection" in captured.out
    assert "vs in process" in captured.out and all(r["tokens_per_target_forward"] >= 1 for r in doc["rows"])
    assert all(0 <= r["prepared_after_rejection"] <= 1 for r in doc["rows"])
    assert "prepared tokens drafted per token settled" in captured.out
    assert all(r["prepared_tokens_per_token"] == 0 for r in doc["rows"] if not r["mode"].startswith("async"))
    base = ["bench", "--mode", "simulate", "--target", model_dirs.target, "--draft", model_dirs.close_draft,
            "--dataset", str(dataset), "--categories", "qa"]
    sampled = ["--prompts-per-category", "1", "--repeats", "1", "--max-new-tokens", "12", "--sim-sessions", "1",
               "--host-scale", "0", "--tree", "cape", "--temperature", "0.8", "--out", str(out)]
    assert main(base + sampled) == 0
    assert "sampled (temperature 0.8, seeded) SVIP" in capsys.readouterr().out
    assert json.loads((out / "simulate.json").read_text())["header"]["temperature"] == 0.8
    for extra, words in ((["--emulate", "target=llama-9b@h100"], "unknown model 'llama-9b'"),
                         (["--sim-sessions", "0"], "--sim-sessions: sessions in flight must be >= 1"),
                         (["--sim-sessions", "two"], "--sim-sessions: expected comma-separated integers"),
                         (["--host-scale", "1000"], "--host-scale must be in [0, 100]"),
                         (["--draft-parallel", "0"], "--draft-parallel: must be an integer in [1, 16]"),
                         (["--draft-parallel", "17"], "--draft-parallel: must be an integer in [1, 16]"),
                         (["--temperature", "-1"], "temperature must be a number >= 0"),
                         (["--temperature", "0.5", "--mode", "policies"], "--temperature applies to --mode simulate")):
        assert main(base + extra) == 2
        assert words in capsys.readouterr().err


def test_the_simulate_bench_runs_a_feature_head_as_the_draft(tmp_path, capsys):
    """--head with --mode simulate: the embedded target's head drafts (its tokens, on the device
    --emulate names for it; test_a_feature_head_drafts_in_virtual_time_too checks a head's outputs
    there); the other modes but policies refuse it."""
    import json

    from svip_cli.main import main

    dataset = tmp_path / "spec.jsonl"
    dataset.write_text(json.dumps({"question_id": 1, "category": "qa", "prompt": "question: def f(x):"}) + "\n")
    out = tmp_path / "out"
    base = ["bench", "--dataset", str(dataset), "--categories", "qa", "--prompts-per-category", "1", "--repeats",
            "1", "--max-new-tokens", "8", "--head", "eagle"]
    code = main(base + ["--mode", "simulate", "--sim-sessions", "1", "--host-scale", "0", "--out", str(out),
                        "--emulate", "target=llama-3.1-70b@4xh100,draft=eagle3-llama-3.3-70b@h100,link=0.1ms"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["header"]["draft"].endswith("head") and doc["header"]["draft_device"] == "eagle3-llama-3.3-70b@h100"
    assert [r["mode"] for r in doc["rows"]] == ["alone", "inprocess", "sync", "async"]
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    assert main(base + ["--mode", "pipeline"]) == 2
    assert "--head applies to --mode policies and simulate" in capsys.readouterr().err


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_feature_head_drafts_in_virtual_time_too(pipeline):
    """The embedded target's head, which has no KV pool: each of its steps lasts its step model's
    time on the draft's timeline (a whole step, as device timing counts it), so with no host work
    counted two runs take the same time; the output is the target alone's, its deep trees too."""
    from draft_worker.feature_draft import FeatureDrafter, load_feature_draft
    from svip_assets import default_head, default_pair
    from svip_common.models import load_model

    target = load_model(default_pair()[0])
    head = load_feature_draft(default_head(), target)
    limits = Limits(tokens=target.token_limit, positions=target.max_positions)
    spec = parse_emulation("target=llama-3.1-8b@h100,draft=eagle3-llama-3.1-8b@h100,link=1ms")
    ids = tuple(target.tokenizer("def parse_args(argv):\n")["input_ids"])
    requests = [GenerationRequest(ids, 24, policy=PolicyConfig(name="svip", threshold=0.3, tree=tree), ignore_eos=True)
                for tree in ("off", "deep")]
    expected = SpeculativeEngine(target, None).generate(requests[0]).token_ids
    runs = []
    for _ in range(2):
        drafter = FeatureDrafter(head, target.model.get_input_embeddings(), target.vocab_size, limits.tokens)
        verifier = Verifier(target, limits.tokens, feature_layers=head.head.config.target_layers)
        pair = SimulatedPair(target, verifier, drafter, limits, pipeline, spec, 0.0, load_aware="off")
        runs.append(pair.run_all(requests))
        assert [p.result().token_ids for p in pair.pending.values()] == [expected, expected]
        assert sum(p.result().stats.draft_tokens for p in pair.pending.values()) > 0
    assert runs[0].makespan_s == runs[1].makespan_s and runs[0].busy_s["draft"] > 0


def test_the_draft_worker_times_its_steps_with_their_host_work_at_host_scale(models):
    """A real draft worker's timer reads a step's host work too (what it prices a row by): the
    simulated one reads its device time so far plus its host work so far, times host_scale. So
    does the drafter's timer of a block's own work on its tokens (its draft_s, by which the target
    prices a block's wait): none of this machine's time enters virtual time unscaled, and with no
    host work counted two runs take the same time."""
    import time

    for host_scale in (0.0, 2.0):
        pair = make(models, host_scale=host_scale)
        line = pair.timelines["draft"]
        line.clock.now = 5.0
        assert pair.draft.timer() == 5.0  # between steps: the worker's clock
        line.step_started, line.device_wall_s = time.perf_counter() - 0.010, 0.004  # 6 ms of host work so far
        read = pair.draft.timer()
        assert read == 5.0 if host_scale == 0 else read >= 5.0 + 2.0 * 0.006
        drafted = pair.draft.drafter.host_timer()
        assert drafted == 5.0 if host_scale == 0 else drafted >= read


def test_every_wave_runs_on_one_kept_pair_learning_into_one_auto_estimate(models, prompt_ids, alone, monkeypatch):
    """The split pair across waves and calls (svip_bench.simulate.SplitPairs), as a deployment's
    workers serve one session after another and as the in-process engine is kept: one pair, whose
    verifier times its steps from the first wave on and whose target keeps one `auto` estimate, made
    as a new deployment makes it (the engine's new_auto_estimate). Once each wave had a fresh pair,
    so the split pair was measured cold against a warm engine."""
    from svip_bench.simulate import SplitPairs
    from svip_common.acceptance import AutoEstimate

    engine = SpeculativeEngine(models["target"], models["close_draft"])
    made = []
    monkeypatch.setattr(engine, "new_auto_estimate", lambda: made.append(AutoEstimate()) or made[-1])
    seen = []
    run_all = SimulatedPair.run_all
    monkeypatch.setattr(SimulatedPair, "run_all", lambda self, requests: seen.append(
        (self, self.host.verifier.cost.steps)) or run_all(self, requests))
    requests = [GenerationRequest(prompt_ids[name], 8, ignore_eos=True, policy=PolicyConfig(name="auto"))
                for name in ("short", "medium")]
    spec = parse_emulation(f"target={TARGET.name},draft={DRAFT.name},link=0.1ms")
    pairs = SplitPairs(engine, spec, host_scale=0.0)
    waves = pairs.waves(requests, 1, "async")
    again = pairs.waves(requests[:1], 1, "async")
    assert len(made) == 1 and len(seen) == 3 and all(pair is seen[0][0] for pair, _ in seen)
    assert seen[0][0].host.auto is made[0] and made[0].model(True).observed > 0  # every wave's verdicts in it
    assert seen[0][1] == 0 < seen[1][1] < seen[2][1]  # each wave after the first starts with the steps timed
    expected = [alone.generate(r).token_ids for r in requests]
    assert waves.outputs == expected and again.outputs == expected[:1]


def test_a_kept_pair_times_each_run_from_its_own_start(models, prompt_ids):
    """SimulatedPair.run_all on a pair that ran before: the run starts when the pair is quiet and
    its times count from there. The target alone learns nothing its times depend on, so with no
    host work counted a second run takes exactly what the first took."""
    pair = make(models, "sync", draft=False)
    request = GenerationRequest(prompt_ids["medium"], 12, ignore_eos=True, policy=PolicyConfig(name="none"))
    first, second = pair.run_all([request, request]), pair.run_all([request, request])
    assert second.makespan_s == first.makespan_s > 0 and second.per_request_s == first.per_request_s
    assert second.busy_s == first.busy_s and second.tokens == first.tokens == 24
    assert [p.result().token_ids for p in second.pending] == [p.result().token_ids for p in first.pending]
    assert pair.now == 2 * first.makespan_s


def test_a_tree_goes_on_from_the_continuation_after_the_sibling_its_verdict_took(monkeypatch):
    """Issue 60: across the workers, a verdict that takes a CaPE sibling and settles the place
    after it at the target goes on from the continuation prepared after that sibling where it
    drafted that token: the rest of a finished one is sent at once, one in the making is taken up
    past it. With a 70B target and an 8B draft on its own device such continuations are often
    late for their verdict. The shipped pair on two held-out code prompts (the test models seldom
    take a sibling): both happen, in virtual time, and each output is the target alone's."""
    import draft_worker.pipelined as pipelined
    from draft_worker.drafter import BlockDraft
    from svip_assets import SPLIT_FILE, default_pair
    from svip_bench.datasets import load_code_prompts
    from svip_common.models import load_model

    went_on = {"finished": 0, "in the making": 0}
    past, split_off = pipelined._past, BlockDraft.split_off

    def counted_past(ready, settled):
        rest = past(ready, settled)
        went_on["finished"] += rest is not None
        return rest

    def counted_split_off(draft, keep):
        went_on["in the making"] += draft.block.siblings is not None
        return split_off(draft, keep)

    monkeypatch.setattr(pipelined, "_past", counted_past)
    monkeypatch.setattr(BlockDraft, "split_off", counted_split_off)
    target, draft = (load_model(path) for path in default_pair())
    limits = Limits(tokens=target.token_limit, positions=target.max_positions)
    spec = parse_emulation("target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms")
    policy = PolicyConfig(name="svip", threshold=0.4, tree="cape")
    for prompt in load_code_prompts(SPLIT_FILE, 2):
        ids = tuple(target.tokenizer(prompt.text)["input_ids"][-192:])
        request = GenerationRequest(ids, 48, policy=policy, ignore_eos=True)
        pair = SimulatedPair(target, Verifier(target, limits.tokens), Drafter(draft, target.vocab_size, limits.tokens),
                             limits, "async", spec, 0.0, load_aware="off")
        pair.run_all([request])
        (pending,) = pair.pending.values()
        assert pending.result().token_ids == SpeculativeEngine(target, None).generate(request).token_ids
    assert went_on["finished"] > 0 and went_on["in the making"] > 0, went_on
