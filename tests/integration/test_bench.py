"""`svip bench` end to end on the small test pair: every method runs, every greedy output equals
the target alone (the bench itself checks and fails otherwise), and JSON, markdown and plots are
written. Speed is not asserted here: that is what the benchmark reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from svip_bench.methods import Run
from svip_bench.report import summarize
from svip_cli.main import main
from svip_common.trees import TREES

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)


def test_bench_runs_every_method(tmp_path, model_dirs, capsys):
    dataset = tmp_path / "spec.jsonl"
    rows = [
        {"question_id": i, "category": cat, "prompt": f"{cat} prompt number {i}: def f(x):"}
        for i, cat in enumerate(["qa", "qa", "translation", "translation", "qa"])
    ]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    code = main([
        "bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--dataset", str(dataset),
        "--categories", "qa,translation,code", "--prompts-per-category", "2", "--repeats", "2",
        "--max-new-tokens", "16", "--ks", "2,3", "--out", str(out),
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "results.json").read_text())
    assert doc["exactness_violations"] == []
    assert set(doc["results"]) == {"qa", "translation", "code", "all"}
    methods = set(doc["results"]["all"])
    assert methods == {"target", "constant-2", "constant-3", "heuristic", "confidence", "svip", "svip-auto",
                       "auto", "oracle", "defaults", "hf-constant-2", "hf-constant-3", "hf-heuristic"}
    assert doc["best_constant"] in ("constant-2", "constant-3")
    learnt = doc["learnt_over_best_fixed"]["all"]
    assert learnt["best_fixed"] in methods
    assert learnt["best_fixed"].startswith(("constant", "heuristic", "confidence", "svip"))
    assert learnt["auto"]["held_out"] > 0 and learnt["defaults"]["in_hindsight"] > 0
    hf = doc["results"]["all"]
    assert hf["hf-constant-2"]["draft_forwards_per_token"] != hf["hf-constant-3"]["draft_forwards_per_token"]
    oracle, const = doc["results"]["all"]["oracle"], doc["results"]["all"]["constant-3"]
    assert oracle["target_forwards_per_token"] <= const["target_forwards_per_token"] + 1e-9
    assert any(b["tokens"] for b in doc["entropy_acceptance"])
    for name in ("speedup.png", "draft_lengths.png", "entropy_acceptance.png"):
        assert (out / name).stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "| all | svip |" in md and "c = 0.05" in md and "held out" in md
    assert "bench [" in captured.err  # progress bar


def test_bench_runs_the_feature_draft_rows_beside_the_small_drafts(tmp_path, model_dirs, models, capsys):
    """--head: every policy and the oracle on the feature head as eagle-* rows, exact like the
    others, their own entropy bands, and the head-against-draft summary."""
    from draft_worker.feature_head import save_head
    from tests.integration.test_feature_draft import random_head

    head = save_head(random_head(models["target"], seed=7), tmp_path / "head")
    out = tmp_path / "out"
    code = main([
        "bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--head", str(head),
        "--categories", "code", "--prompts-per-category", "2", "--repeats", "1", "--max-new-tokens", "16",
        "--ks", "2,3", "--thresholds", "0.5", "--no-hf", "--out", str(out),
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "results.json").read_text())
    assert doc["exactness_violations"] == []
    eagle = {m for m in doc["results"]["all"] if m.startswith("eagle-")}
    assert eagle == {"eagle-constant-2", "eagle-constant-3", "eagle-heuristic", "eagle-confidence", "eagle-svip",
                     "eagle-svip-auto", "eagle-auto", "eagle-oracle", "eagle-svip-0.5"}
    assert doc["header"]["head_auto_calibration"]["tokens"] > 0  # the head's own blocks, drafted
    assert doc["header"]["head"] == str(head)
    assert any(b["tokens"] for b in doc["head_entropy_acceptance"])
    assert doc["head_summary"]["best_head_constant"] in ("eagle-constant-2", "eagle-constant-3")
    assert "| all | eagle-svip |" in (out / "results.md").read_text()
    assert main(["bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--head",
                 model_dirs.target, "--categories", "code"]) == 2
    assert "holds no feature head" in capsys.readouterr().err
    assert main(["bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--head", str(head),
                 "--mode", "pipeline"]) == 2
    assert "--head applies to --mode policies" in capsys.readouterr().err


def run_mode(tmp_path, model_dirs, capsys, mode: str, prompts: list[str], *flags: str):
    """`svip bench --mode MODE` on a dataset of these qa prompts; (its JSON, what it printed)."""
    dataset = tmp_path / "spec.jsonl"
    rows = [{"question_id": i, "category": "qa", "prompt": p} for i, p in enumerate(prompts)]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    code = main(["bench", "--mode", mode, "--target", model_dirs.target, "--draft", model_dirs.close_draft,
                 "--dataset", str(dataset), *flags, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads((out / f"{mode}.json").read_text()), captured


def test_replay_bench_replays_every_policy_without_the_wall_clock(tmp_path, model_dirs, capsys):
    doc, captured = run_mode(tmp_path, model_dirs, capsys, "replay", [f"question {i}: def f(x):" for i in range(2)],
                             "--categories", "qa,code", "--prompts-per-category", "2", "--max-new-tokens", "24",
                             "--ks", "2,4", "--thresholds", "0.5")
    rows = doc["speedup"]["all"]
    assert set(rows) == {"constant-2", "constant-4", "heuristic", "confidence", "svip", "svip-auto", "svip-0.5",
                         "auto", "defaults", "oracle"}
    assert all(0 < v < 100 for v in rows.values())
    if doc["header"]["cost"]["tau"] < 1:  # drafting can pay: nothing drafts better than the oracle
        assert all(rows["oracle"] >= v - 1e-9 for v in rows.values())
    assert doc["over_best_fixed"]["all"]["best_fixed"] not in ("auto", "defaults", "oracle")
    assert "| auto |" in captured.out and "oracle over it" in captured.out


def test_choices_bench_shares_the_prompt_and_keeps_every_output(tmp_path, model_dirs, capsys):
    doc, captured = run_mode(tmp_path, model_dirs, capsys, "choices", ["question: " + "def f(x): return x + 1. " * 8],
                             "--categories", "qa", "--prompts-per-category", "1", "--max-new-tokens", "8", "--n", "3",
                             "--repeats", "1")
    prompt = doc["header"]["prompt_tokens"][0]
    assert doc["header"]["prompt_tokens_shared"] == {"target": 2 * (prompt - 1), "draft": 2 * (prompt - 1)}
    rows = doc["rows"]
    for worker in ("target", "draft"):
        saved = rows["apart"][f"{worker}_forward_tokens"] - rows["shared"][f"{worker}_forward_tokens"]
        assert saved == 2 * (prompt - 1), worker
    assert "Command: `svip bench" in captured.out and "| shared |" in captured.out
    assert main(["bench", "--mode", "choices", "--target", model_dirs.target, "--draft", model_dirs.close_draft,
                 "--n", "9"]) == 2
    assert "--n must be in [1, 8], got 9" in capsys.readouterr().err


def test_bench_rejects_bad_arguments(capsys, model_dirs, tmp_path):
    assert (
        main(["bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--categories", "poetry"]) == 2
    )
    assert "unknown category 'poetry'" in capsys.readouterr().err
    assert main(["bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--ks", "0"]) == 2
    assert (
        main(
            [
                "bench",
                "--target",
                model_dirs.target,
                "--draft",
                model_dirs.close_draft,
                "--dataset",
                str(tmp_path / "missing.jsonl"),
                "--categories",
                "qa",
            ]
        )
        == 2
    )
    assert "cannot read Spec-Bench prompts" in capsys.readouterr().err
    assert main(["bench", "--target", model_dirs.target, "--draft", model_dirs.close_draft, "--mode", "pipeline",
                 "--categories", "code", "--svip-threshold", "-1"]) == 2
    assert "threshold must be a number >= 0" in capsys.readouterr().err
    assert main(["bench", "--mode", "pipeline", "--emulate", "target=llama-3.1-8b@h100"]) == 2
    assert "--mode pipeline compares drafting with the target alone: --emulate needs draft=MODEL@DEVICE" in \
        capsys.readouterr().err
    assert main(["bench", "--mode", "pipeline", "--emulate", "target=llama-3.1-8b@h100,draft=x@h100"]) == 2
    assert "unknown model 'x'" in capsys.readouterr().err


def _run(method, repeat, tokens, wall, target_fwd, draft_fwd, **kw):
    return Run(method, "qa", "1", repeat, list(range(tokens)), wall, target_fwd, draft_fwd, **kw)


def test_summary_arithmetic():
    base = [_run("target", r, 100, 1.0, 100, 0) for r in range(3)]
    spec = [
        _run("svip", r, 100, w, 40, 120, draft_tokens=120, accepted_tokens=60, rounds=40, draft_lengths=[3] * 40)
        for r, w in enumerate((0.5, 0.4, 0.8))
    ]
    s = summarize(spec, base)
    assert s["speedup"] == {"median": 2.0, "min": 1.25, "max": 2.5}
    assert s["target_forwards_per_token"] == 0.4
    assert s["mean_acceptance_length"] == 1 + 180 / 120
    assert s["acceptance_rate"] == 0.5
    assert abs(s["projected_speedup"]["0.1"] - 300 / (120 + 0.1 * 360)) < 1e-12


def test_a_process_is_pinned_thread_by_thread():
    """--one-core-each pins every thread of a worker process, as the OS reports it."""
    from svip_bench.pipeline import _pin_process

    child = subprocess.Popen([sys.executable, "-c", "import sys, threading; t = threading.Thread(target="
                              "sys.stdin.read); t.start(); print('started', flush=True); t.join()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"started\n"  # its second thread runs
        _pin_process(child.pid, {1})
        assert all(os.sched_getaffinity(int(t)) == {1} for t in os.listdir(f"/proc/{child.pid}/task"))
    finally:
        child.communicate(b"")


def test_pipeline_bench(tmp_path, model_dirs, capsys):
    """`--mode pipeline`: in-process, distributed sync and async agree token for token (the bench
    fails otherwise); the throughput table, the per-round breakdown, async's block sources and
    bound, SVIP and the target alone at 1, 8 and 16 sessions in flight and the timeline are
    written; where namespaces can be made, the two-node run too."""
    from svip_bench.two_nodes import unavailable

    out = tmp_path / "pipe"
    two_nodes = unavailable() is None
    cores_before = os.sched_getaffinity(0)
    code = main(
        [
            "bench",
            "--mode",
            "pipeline",
            "--target",
            model_dirs.target,
            "--draft",
            model_dirs.close_draft,
            "--categories",
            "code",
            "--prompts-per-category",
            "2",
            "--repeats",
            "1",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
            "--load-aware",
            "greedy",
            "--one-core-each",
            *(["--latencies", "0"] if two_nodes else []),
        ]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    assert os.sched_getaffinity(0) == cores_before  # this process is where it was
    doc = json.loads((out / "pipeline.json").read_text())
    assert "core 1" in doc["header"]["cores"]
    assert doc["exactness_violations"] == []
    assert set(doc["tokens_per_s"]) == {"alone", "inprocess", "sync", "async"}  # every output the target alone's
    assert all(v["ratio_to_alone"] > 0 for v in doc["tokens_per_s"].values())
    for mode in ("sync", "async"):
        parts = doc["breakdown"][mode]
        assert parts["round_s"]["median_ms"] > 0 and "overhead_s" in parts and "block_transit_s" in parts
    assert "first" in doc["sources"]["async"] and set(doc["sources"]) == {"sync", "async"}
    assert set(doc["prepared_continuations"]) == {"sent", "used", "used_late"}
    assert doc["header"]["load_aware"] == "greedy"  # as asked: every mode that drafts gates the same way
    assert doc["async_bound"]["speedup_over_sync"] >= 1.0
    wire = doc["wire_bytes_per_round"]
    assert all(wire[m]["p95"] >= wire[m]["median"] > 0 for m in ("sync", "async"))
    assert all(doc["ttft_ms"][m]["p95_ms"] >= doc["ttft_ms"][m]["median_ms"] > 0 for m in ("sync", "async"))
    crowd = doc["concurrency"]  # SVIP and the target alone through the workers, 1 / 8 / 16 in flight
    assert {p: set(v) for p, v in crowd.items()} == {p: {"1", "8", "16"} for p in ("svip", "none")}
    assert all(tps > 0 for v in crowd.values() for tps in v.values()) and doc["timeline"]
    assert "| 16 |" in (out / "pipeline.md").read_text()
    assert (out / "timeline.png").stat().st_size > 1000
    md = (out / "pipeline.md").read_text()
    assert "Per round, median (mean) in ms" in md and "| overhead |" in md and "| target alone (in process) |" in md
    assert "load-aware greedy" in md and "| sync | first |" in md and "Time to the first token streamed" in md
    if two_nodes:
        (row,) = doc["two_nodes"]
        assert row["latency_ms"] == 0 and row["link"] == "direct" and row["violations"] == []


def test_serve_bench(tmp_path, model_dirs, capsys):
    """`--mode serve`: the Serve app over HTTP at 1/4/16/32 clients, the defaults, svip and the target alone,
    and the in-process batched engine at batch 1 and 16; every output equal to the in-process
    greedy output (the bench fails otherwise)."""
    out = tmp_path / "serve"
    code = main(
        [
            "bench",
            "--mode",
            "serve",
            "--target",
            model_dirs.target,
            "--draft",
            model_dirs.close_draft,
            "--categories",
            "code",
            "--prompts-per-category",
            "2",
            "--repeats",
            "1",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    doc = json.loads((out / "serve.json").read_text())
    assert doc["exactness_violations"] == []
    assert {(r["concurrency"], r["policy"]) for r in doc["results"]} == {
        (n, p) for n in (1, 4, 16, 32) for p in ("defaults", "svip", "none")
    }
    assert {(r["batch_size"], r["policy"]) for r in doc["inprocess_batches"]} == {
        (b, p) for b in (1, 16) for p in ("svip", "none")
    }
    assert all(r["tokens_per_s"] > 0 for r in doc["inprocess_batches"])
    assert all(r["tokens_per_s"] > 0 and 0 < r["ttft_p50"] <= r["ttft_p95"] for r in doc["results"])
    assert (out / "serve.png").stat().st_size > 1000 and "| 32 | svip |" in (out / "serve.md").read_text()


def test_spec_bench_is_found_beside_the_checkout_by_default():
    """../shared/specbench/spec-bench.jsonl relative to the project root, wherever svip_bench sits."""
    from pathlib import Path

    from svip_bench.datasets import DEFAULT_SPECBENCH

    repo = Path(__file__).resolve().parents[2]
    assert DEFAULT_SPECBENCH == repo.parent / "shared" / "specbench" / "spec-bench.jsonl"


def test_the_gpu_throughput_script_runs_where_there_is_no_gpu(tmp_path):
    """deploy/gpu-check.sh's throughput run, with tiny shapes on the CPU: the script itself works
    (on a GPU machine it builds the Qwen2.5-7B / 0.5B shapes in bf16); without CUDA, asking for
    it is a clear error."""
    from svip_bench import gpu_throughput

    out = tmp_path / "gpu"
    assert (
        gpu_throughput.main(
            [
                "--device",
                "cpu",
                "--target-shape",
                "tiny",
                "--draft-shape",
                "tiny",
                "--repeats",
                "1",
                "--prompt",
                "16",
                "--new-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "gpu_throughput.json").read_text())
    assert {(r["batch"], r["tokens_per_seq"]) for r in doc["target_step"]} >= {(1, 1), (64, 9)}
    assert {(r["batch"], r["policy"]) for r in doc["engine"]} == {(b, p) for b in (1, 16) for p in ("none", "svip")}
    assert all(r["tokens_per_s"] > 0 for r in doc["engine"])
    assert [r["batch"] for r in doc["cost_ratio"]] == [1, 16, 64] and all(r["c"] > 0 for r in doc["cost_ratio"])
    assert [r["rows"] for r in doc["sampling"]] == [1, 16, 64]
    assert all(r[k] > 0 for r in doc["sampling"] for k in ("greedy", "temperature 0.7", "top-p 0.9", "draw"))
    profiles = {(r["model"], r["batch"], r["path"]): r for r in doc["profile"]}
    paths = ("flat decoder", "modules")
    assert set(profiles) == {(m, b, p) for m in ("target", "draft") for b in (1, 16) for p in paths}
    for path in paths:
        # one attention call per layer at batch 16 (the packed short items), as at batch 1
        assert profiles[("target", 16, path)]["sdpa"] == profiles[("target", 1, path)]["sdpa"] == {"flash (cpu)": 2}
        assert profiles[("target", 16, path)]["aten_ops"] < 2 * profiles[("target", 1, path)]["aten_ops"]
    for model in ("target", "draft"):
        for batch in (1, 16):
            flat, modules = (profiles[(model, batch, p)] for p in paths)
            assert flat["aten_ops"] < modules["aten_ops"] and flat["ms"] > 0 and modules["ms"] > 0
    if not __import__("torch").cuda.is_available():
        assert gpu_throughput.main(["--out", str(out)]) == 2


def test_long_bench_runs_every_policy_at_each_length(tmp_path, model_dirs, capsys):
    out = tmp_path / "long"
    code = main(
        [
            "bench",
            "--long",
            "--target",
            model_dirs.target,
            "--draft",
            model_dirs.close_draft,
            "--prompts-per-category",
            "1",
            "--repeats",
            "1",
            "--long-lengths",
            "8,20",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "long.json").read_text())
    assert doc["exactness_violations"] == []
    assert set(doc["results"]) == {"T=0/8", "T=0/20", "T=1/8", "T=1/20"}
    for row in doc["results"].values():
        assert set(row) == {"target", "constant-3", "heuristic", "confidence", "svip", "auto", "defaults"}
        assert row["target"]["speedup"] == 1.0 and all(r["tokens_per_s"] > 0 for r in row.values())
    assert {r["tokens"] for r in doc["runs"]} == {8, 20}  # ignore_eos: every run to its length
    assert [q["positions"] for q in doc["target_loss_by_position"]][:2] == ["0-256", "256-512"]
    assert "| T=0/20 |" in (out / "long.md").read_text()


def test_long_bench_refuses_lengths_past_the_context(model_dirs, capsys):
    assert (
        main(
            [
                "bench",
                "--long",
                "--target",
                model_dirs.target,
                "--draft",
                model_dirs.close_draft,
                "--long-lengths",
                "100000",
            ]
        )
        == 2
    )
    assert "exceed the pair's context" in capsys.readouterr().err


def test_the_batched_bench_runs_each_policy_at_each_batch_size_exactly(tmp_path, model_dirs, capsys):
    """`python -m svip_bench.batched`: a row per policy and batch size, every output checked
    against the target alone's (it would exit 1 otherwise); bad sizes are a usage error."""
    from svip_bench import batched

    data = tmp_path / "spec-bench.jsonl"
    data.write_text("".join(
        json.dumps({"question_id": i, "category": c, "prompt": f"def f{i}(x):\n    return"}) + "\n"
        for i, c in enumerate(["code", "qa", "math"] * 2)
    ))
    pair = ["--target", model_dirs.target, "--draft", model_dirs.close_draft]
    args = ["--dataset", str(data), "--requests", "4", "--max-new-tokens", "6", "--json"]
    assert batched.main([*pair, *args, "--batches", "1,4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["policy"], r["batch"]) for r in rows} == {
        (p, b) for p in ("target alone", "svip (0.4)", "defaults") for b in (1, 4)
    }
    assert all(r["exact"] and r["tokens_per_s"] > 0 for r in rows)
    assert batched.main([*pair, *args, "--batches", "4", "--packing", "--repeats", "2"]) == 0  # both attentions
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["exact"] and r["per_session_tokens_per_s"] > 0 for r in rows)
    assert batched.main([*pair, *args, "--batches", "1,4", "--alternate", "--repeats", "2", "--trees"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # warm, alternating, with trees
    assert len(rows) == 2 * (3 + len(TREES) - 1) and all(r["exact"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["over_alone"] == 1.0 and r["tokens_per_round"] == 1.0 for r in rows if r["policy"] == "target alone")
    assert {r["policy"] for r in rows} >= {f"svip (0.4), tree {tree}" for tree in TREES[1:]}
    assert batched.main([*pair, *args, "--batches", "4", "--alternate", "--trees", "auto,deep-auto"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # the trees named only
    assert [r["policy"] for r in rows][3:] == ["svip (0.4), tree auto", "svip (0.4), tree deep-auto"]
    with pytest.raises(SystemExit):
        batched.main([*pair, *args, "--packing", "--alternate"])
    assert "not allowed with" in capsys.readouterr().err
    for bad, why in ((["--batches", "0"], "--batches"), (["--batches", "1,x"], "--batches"),
                     (["--repeats", "0"], "--repeats"),
                     (["--batches", "99999"], "--batches"), (["--trees", "auto,oak"], "--trees")):
        with pytest.raises(SystemExit):
            batched.main([*pair, *args, *bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        batched.main([*pair[:2], *args])  # a target without its draft
    assert "--target and --draft together" in capsys.readouterr().err
    sampled = ["--temperature", "0.7", "--top-p", "0.9"]
    assert batched.main([*pair, *args, *sampled, "--batches", "1,2", "--alternate"]) == 0  # draws: not compared
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 6 and all(r["exact"] is None and r["tokens_per_s"] > 0 for r in rows)
    for bad, why in ((["--temperature", "-1"], "temperature must be a number >= 0"),
                     (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1]")):
        with pytest.raises(SystemExit):
            batched.main([*pair, *args, *bad])
        assert why in capsys.readouterr().err


def test_the_batched_bench_runs_a_feature_head_beside_the_draft(tmp_path, model_dirs, models, capsys):
    from draft_worker.feature_head import save_head
    from svip_bench import batched
    from tests.integration.test_feature_draft import random_head

    head = save_head(random_head(models["target"], seed=7), tmp_path / "head")
    data = tmp_path / "spec-bench.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "prompt": f"def f{i}(x):"}) + "\n"
                            for i in range(3)))
    pair = ["--target", model_dirs.target, "--draft", model_dirs.close_draft]
    args = ["--dataset", str(data), "--requests", "3", "--max-new-tokens", "6", "--json", "--batches", "3"]
    assert batched.main([*pair, *args, "--head", str(head)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["policy"] for r in rows} >= {"head: svip (0.3)", "head: confidence (0.4)"}
    assert all(r["exact"] for r in rows)
    with pytest.raises(SystemExit):
        batched.main([*pair, *args, "--head", model_dirs.target])
    assert "holds no feature head" in capsys.readouterr().err


def test_forward_step_compares_packed_attention_with_one_call_per_session(capsys):
    """`python -m svip_bench.forward_step --packing`: for each model, batch and step shape, both
    attentions' medians from one process and their operator counts; the packed one runs fewer
    operators at batch 4 and the same path at batch 1 (a lone item is attended on its own)."""
    from svip_bench import forward_step

    assert forward_step.main(["--packing", "--batches", "1,4", "--context", "8", "--repeats", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["model"], r["batch"], r["shape"]) for r in rows} == {
        (m, b, s) for m in ("target", "draft") for b in (1, 4) for s in ("decode", "verify")}
    for r in rows:
        assert r["per_session_ms"] > 0 and r["packed_ms"] > 0
        assert (r["packed_ops"] < r["per_session_ops"]) == (r["batch"] == 4), r


def test_forward_step_compares_the_flat_decoder_with_the_models_modules(capsys):
    """`python -m svip_bench.forward_step --decoder`: for each model, batch and step shape, both
    paths' medians from one process and their operator counts; the decoder runs fewer operators
    everywhere. With --packing too it is refused (one comparison per run)."""
    from svip_bench import forward_step

    assert forward_step.main(["--decoder", "--batches", "1,4", "--context", "8", "--repeats", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["model"], r["batch"], r["shape"]) for r in rows} == {
        (m, b, s) for m in ("target", "draft") for b in (1, 4) for s in ("decode", "verify")}
    for r in rows:
        assert r["modules_ms"] > 0 and r["flat_ms"] > 0 and r["flat_ops"] < r["modules_ops"], r
    with pytest.raises(SystemExit):
        forward_step.main(["--decoder", "--packing"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_device_bench_runs_the_pipeline_under_device_timing_beside_the_simulation(tmp_path, model_dirs, capsys):
    """`--mode device`: real workers whose forwards last their step models' time, every mode at 1
    and 2 sessions beside the simulated clock's prediction, the in-process engine co-located, each
    worker's device use reported; every output the target alone's (the bench fails otherwise)."""
    out = tmp_path / "device"
    code = main(["bench", "--mode", "device", "--target", model_dirs.target, "--draft", model_dirs.close_draft,
                 "--categories", "code", "--prompts-per-category", "2", "--repeats", "1", "--max-new-tokens", "8",
                 "--sim-sessions", "2", "--emulate", "target=llama-3.1-8b@h100,draft=llama-3.2-1b@h100,scale=2",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    doc = json.loads((out / "device.json").read_text())
    assert doc["exactness_violations"] == []
    assert {(r["sessions"], r["mode"]) for r in doc["rows"]} == {(1, "in-process")} | {
        (n, m) for n in (1, 2) for m in ("alone", "sync", "async")}
    assert all(r["device"] > 0 and (r["mode"] == "in-process" or r["simulated"] > 0) for r in doc["rows"])
    use = doc["device_use"]
    assert use["target"]["model"] == "llama-3.1-8b@h100" and use["draft"]["model"] == "llama-3.2-1b@h100"
    assert use["target"]["forwards"] > 0 and use["target"]["scale"] == 2
    assert "in process: target llama-3.1-8b@h100, draft llama-3.2-1b@h100" in doc["header"]["in_process"] or \
        "draft llama-3.2-1b@h100" in doc["header"]["in_process"]
    assert "| 2 | async |" in (out / "device.md").read_text()
    assert main(["bench", "--mode", "device", "--emulate", "target=llama-3.1-8b@h100"]) == 2
    assert "--emulate needs draft=MODEL@DEVICE" in capsys.readouterr().err
