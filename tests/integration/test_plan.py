"""`svip plan`: a pair's predicted tokens/s on the devices a spec names, the target alone, in process
(a virtual device the two models share) and distributed sync and async (the simulated clock), each
policy at each session count, every output the target alone's; the advice is the fastest row; bad
arguments are one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from svip_bench.plan import advice, parse_plan_policies, parse_sessions
from svip_cli.main import main
from svip_common.errors import InvalidRequest

SPEC = "target=llama-3.1-8b@h100,draft=llama-3.2-1b@h100,link=25gbe"


def run_plan(capsys, *args: str) -> tuple[dict, object]:
    """`svip plan` with these arguments (--out among them): its plan.json, with no output that
    differs from the target alone's, and what it printed."""
    out = args[args.index("--out") + 1]
    code = main(["plan", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    doc = json.loads((Path(out) / "plan.json").read_text())
    assert doc["exactness_violations"] == []
    return doc, captured


def test_plan_predicts_every_placement_and_policy_and_advises_the_fastest(tmp_path, model_dirs, capsys):
    out = tmp_path / "plan"
    doc, captured = run_plan(capsys, "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--emulate",
                             SPEC, "--prompts-per-category", "2", "--max-new-tokens", "8", "--sessions", "1,2",
                             "--policies", "svip,constant-2,constant-2+cape", "--out", str(out))
    assert {(r["sessions"], r["placement"], r["policy"]) for r in doc["rows"]} == {
        (n, "target alone", "none") for n in (1, 2)} | {
        (n, p, policy) for n in (1, 2) for p in ("in process", "sync", "async")
        for policy in ("svip", "constant-2", "constant-2+cape")}
    assert all(r["tokens_per_s"] > 0 and r["mean_request_s"] > 0 for r in doc["rows"])
    for n in ("1", "2"):
        best = max((r for r in doc["rows"] if str(r["sessions"]) == n), key=lambda r: r["tokens_per_s"])
        assert (doc["advice"][n]["placement"], doc["advice"][n]["policy"]) == (best["placement"], best["policy"])
    assert "Advice:" in captured.out and "- 2 sessions in flight: " in captured.out
    for n, a in doc["advice"].items():  # where the split pipeline does not lead, the advice says what it makes
        assert ("split" in a) is (a["placement"] not in ("sync", "async"))
    assert set(doc["header"]["costs_ms"]) == {"target forward", "draft token, own devices", "draft token, in process"}
    assert (out / "plan.png").stat().st_size > 1000


def test_a_plan_at_host_scale_zero_counts_the_devices_alone(tmp_path, model_dirs, capsys):
    """--host-scale 0: no row counts this machine's host work, so two plans of the same pair are
    the same to the bit, and the report says so (constant blocks: SVIP's threshold is the pair's
    calibration, which times this machine)."""
    docs = []
    for run in ("a", "b"):
        doc, captured = run_plan(capsys, "--target", model_dirs.target, "--draft", model_dirs.close_draft,
                                 "--emulate", SPEC, "--prompts-per-category", "1", "--max-new-tokens", "6",
                                 "--sessions", "1,2", "--policies", "constant-2", "--host-scale", "0",
                                 "--out", str(tmp_path / run))
        docs.append(doc)
    assert docs[0]["header"]["host_scale"] == 0
    assert [r["tokens_per_s"] for r in docs[0]["rows"]] == [r["tokens_per_s"] for r in docs[1]["rows"]]
    assert "host work not counted (--host-scale 0: the devices alone)" in captured.out


def test_a_count_of_n_sessions_runs_n_distinct_prompts_where_there_are_enough(tmp_path, model_dirs, capsys,
                                                                             monkeypatch):
    """One session runs --prompts-per-category of each category; a wave of n runs the first
    max(n, those), interleaved by category, distinct (a prompt repeated in a wave runs in lockstep
    with its copies), each output the target alone's."""
    import svip_bench.command as command
    from svip_bench.datasets import Prompt
    from svip_bench.plan import sample_prompts

    doc, captured = run_plan(capsys, "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--emulate",
                             SPEC, "--categories", "code", "--prompts-per-category", "1", "--max-new-tokens", "6",
                             "--sessions", "1,3", "--policies", "constant-2", "--host-scale", "0",
                             "--out", str(tmp_path / "plan"))
    assert (doc["header"]["prompts"], doc["header"]["prompts_at_load"]) == (1, 3)
    assert "1 prompts (n sessions run the first max(n, 1) of 3, distinct in each wave)" in captured.out
    loaded = [Prompt(c, f"{c}{i}", f"{c} {i}") for c in ("qa", "rag") for i in range(4)]
    monkeypatch.setattr(command, "prompts_for", lambda categories, dataset, per: loaded[:per] + loaded[4:4 + per])
    prompts, few = sample_prompts("qa,rag", None, 1, 3)
    assert [p.prompt_id for p in prompts] == ["qa0", "rag0", "qa1"] and few == 2
    prompts, few = sample_prompts("qa,rag", None, 2, 1)
    assert [p.prompt_id for p in prompts] == ["qa0", "rag0", "qa1", "rag1"] and few == 4


def test_plan_plans_a_feature_head_in_every_placement(tmp_path, capsys):
    """--draft eagle: the embedded target's head, on the devices of an EAGLE-3 head, in process
    (its steps on the virtual device beside the target's) and across the workers (the simulated
    clock times its steps whole), chains and deep trees, every output the target alone's."""
    doc, _ = run_plan(capsys, "--draft", "eagle", "--emulate",
                      "target=llama-3.1-8b@h100,draft=eagle3-llama-3.1-8b@h100,link=0.1ms", "--categories", "code",
                      "--prompts-per-category", "1", "--max-new-tokens", "8", "--sessions", "1",
                      "--policies", "svip,svip+deep", "--out", str(tmp_path / "plan"))
    assert {(r["placement"], r["policy"]) for r in doc["rows"]} == {("target alone", "none")} | {
        (p, policy) for p in ("in process", "sync", "async") for policy in ("svip", "svip+deep")}


def test_the_virtual_device_counts_each_forward_at_its_step_not_this_machines_time(model_dirs, models, prompt_ids):
    """In process on a virtual device, a run's time is its forwards' modelled time plus the host
    work, whatever this CPU takes for them: a device ten times slower adds nine times the modelled
    time of the target alone's forwards (one for the prompt and its first token, one per token after)."""
    from coordinator.engine import SpeculativeEngine
    from svip_bench.plan import _in_process
    from svip_common.contracts import GenerationRequest, PolicyConfig
    from svip_common.device_profile import step_model
    from svip_common.emulation import parse_emulation

    engine = SpeculativeEngine(models["target"], None)
    prompt, n = prompt_ids["medium"], 16
    requests = [GenerationRequest(prompt, n, ignore_eos=True, policy=PolicyConfig(name="none"))]
    (fast, _), out_fast = _in_process(engine, parse_emulation("target=llama-3.1-70b@4xh100"), requests, 1)
    (slow, _), out_slow = _in_process(engine, parse_emulation("target=llama-3.1-70b@4xh100,scale=10"), requests, 1)
    assert out_fast == out_slow
    step, p = step_model("llama-3.1-70b@4xh100"), len(prompt)
    modelled = step.forward_s([(p, 0)]) + sum(step.forward_s([(1, p + i)]) for i in range(n - 1))
    assert n / slow - n / fast == pytest.approx(9 * modelled, rel=0.05)  # the host work cancels out
    assert engine.verifier.pool.timing is None  # taken off again


def test_the_in_process_rows_run_load_aware_off_as_the_split_rows_and_the_report_say(models, prompt_ids,
                                                                                    monkeypatch):
    """The report says load-aware off, and the split rows run so (SplitPairs): the in-process
    rows too, whatever the engine's own setting (the knob's default, greedy, once paused every
    in-process block at 32 sessions: those rows were the target alone's), which comes back after."""
    from coordinator.engine import SpeculativeEngine
    from svip_bench.plan import _in_process
    from svip_common.contracts import GenerationRequest, PolicyConfig
    from svip_common.emulation import parse_emulation

    engine = SpeculativeEngine(models["target"], models["close_draft"])
    engine.load_aware = "greedy"
    seen, generate = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda request: seen.append(engine.load_aware) or generate(request))
    requests = [GenerationRequest(prompt_ids["medium"], 4, ignore_eos=True, policy=PolicyConfig(name="svip"))]
    _in_process(engine, parse_emulation(SPEC), requests, 1)
    assert seen == ["off"] and engine.load_aware == "greedy"


@pytest.mark.parametrize("call, words", [
    (lambda: parse_plan_policies("svip,fastest"), "--policies: svip, auto"),
    (lambda: parse_plan_policies("constant-99"), "constant-K (K in 1..16)"),
    (lambda: parse_plan_policies("svip+deepest"), "optionally +cape, +auto, +deep or +deep-auto"),
    (lambda: parse_plan_policies("svip+off"), "optionally +cape, +auto, +deep or +deep-auto"),
    (lambda: parse_sessions("0,8"), "--sessions: session counts must be in [1, 64]"),
    (lambda: parse_sessions("1,100"), "--sessions: session counts must be in [1, 64]"),
    (lambda: parse_sessions("one"), "--sessions: expected comma-separated integers"),
])
def test_bad_plan_arguments_are_named(call, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        call()


def test_the_cli_refuses_a_plan_it_cannot_make(capsys):
    for args, words in ((["--emulate", "target=llama-3.1-8b@h100"], "--emulate needs draft=MODEL@DEVICE"),
                        (["--emulate", "target=gpt-5@h100,draft=llama-3.2-1b@h100"], "unknown model 'gpt-5'"),
                        (["--sessions", "65"], "--sessions: session counts must be in [1, 64]"),
                        (["--host-scale", "1000"], "--host-scale must be in [0, 100], got 1000.0"),
                        (["--host-scale", "-1"], "--host-scale must be in [0, 100], got -1.0"),
                        (["--host-scale", "nan"], "--host-scale must be in [0, 100], got nan")):
        assert main(["plan", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1


def test_advice_is_the_fastest_row_at_each_count():
    rows = [{"sessions": 1, "placement": "target alone", "policy": "none", "tokens_per_s": 10.0},
            {"sessions": 1, "placement": "async", "policy": "svip", "tokens_per_s": 15.0},
            {"sessions": 8, "placement": "target alone", "policy": "none", "tokens_per_s": 80.0},
            {"sessions": 8, "placement": "sync", "policy": "svip", "tokens_per_s": 60.0}]
    got = advice(rows)
    assert (got["1"]["placement"], got["1"]["over_alone"]) == ("async", 1.5)
    assert (got["8"]["placement"], got["8"]["over_alone"]) == ("target alone", 1.0)
    assert "split" not in got["1"] and got["8"]["split"] == {"placement": "sync", "policy": "svip",
                                                             "tokens_per_s": 60.0, "over_best": 0.75}
