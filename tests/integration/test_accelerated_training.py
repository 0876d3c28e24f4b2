"""training/accelerated.py end to end on the CPU with tiny budgets: the corpus is prepared with its
licenses, the time-boxed run writes a pair in the shipped layout, and that pair loads through
from_pretrained, shares one vocabulary and decodes exactly (greedy SVIP equals the target alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.models import check_same_vocabulary, load_model

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "training.accelerated", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_prepare_then_a_time_boxed_run_writes_a_pair_that_decodes_exactly(tmp_path):
    data, out = tmp_path / "data", tmp_path / "pair"
    run("prepare", "--out", str(data), "--packages", "requests")
    sources = json.loads((data / "sources.json").read_text())
    assert [s["license"] for s in sources][0] == "PSF-2.0" and sources[1]["source"].startswith("requests ")
    assert sources[1]["license"] and sources[1]["tokens"] > 10_000
    corpus = np.load(data / "corpus.npz")
    assert len(corpus["train"]) == sum(s["tokens"] for s in sources) and len(corpus["validation"]) > 100_000

    log = run("train", "--data", str(data), "--out", str(out), "--size", "draft", "--target-s", "4", "--draft-s", "2",
              "--batch", "4", "--seq-len", "64", "--generations", "4", "--generation-batch", "4",
              "--drafts", "0", "--draft-names", "draft")
    assert "ms/step" in log and "target generations" in log
    target_info = json.loads((out / "target" / "training.json").read_text())
    assert target_info["device"] == "CPU" and target_info["steps"] > 10 and target_info["best_validation"] < 9.0
    assert target_info["corpus"] == sources
    draft_info = json.loads((out / "draft" / "training.json").read_text())
    assert draft_info["teacher_layers"] == [0] and draft_info["generations"] == 4
    assert (out / "split.json").read_text() == (ROOT / "svip_assets/pair/split.json").read_text()

    leg = tmp_path / "second-leg"  # distill only: the same target, the draft taken further
    run("train", "--data", str(data), "--out", str(leg), "--teacher", str(out / "target"), "--init", str(out),
        "--draft-s", "2", "--batch", "4", "--seq-len", "64", "--generations", "4", "--generation-batch", "4")
    again = json.loads((leg / "draft" / "training.json").read_text())
    assert again["earlier_legs"][0]["steps"] == draft_info["steps"] and again["teacher_layers"] == [0]
    assert (leg / "target" / "model.safetensors").read_bytes() == (out / "target" / "model.safetensors").read_bytes()

    target, draft = load_model(str(out / "target")), load_model(str(leg / "draft"))
    check_same_vocabulary(target, draft)
    ids = tuple(target.tokenizer("def walk(path):")["input_ids"])
    request = GenerationRequest(ids, 24, policy=PolicyConfig(name="svip", threshold=0.6), ignore_eos=True)
    alone = SpeculativeEngine(target, None).generate(GenerationRequest(ids, 24, ignore_eos=True))
    assert SpeculativeEngine(target, draft, load_aware="off").generate(request).token_ids == alone.token_ids


def test_an_interrupted_fit_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    import pytest
    import torch

    from training.accelerated import Fit

    def fit(checkpoint=None, stop_at=None):
        torch.manual_seed(0)
        model, rng = torch.nn.Linear(8, 1), np.random.default_rng(0)

        def loss_of(step):
            if step == stop_at:
                raise KeyboardInterrupt  # the run is killed here
            x = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))
            return ((model(x) - 1.0) ** 2).mean()

        return (
            model,
            Fit(model, torch.device("cpu"), 1e-2, 1e9, 40, lambda msg: None, rng, checkpoint, every_s=0.0),
            loss_of,
        )

    model, run, loss_of = fit()
    assert run.run(loss_of)["steps"] == 40
    whole = model.weight.detach().clone()
    checkpoint = tmp_path / "fit.pt"
    for stop_at in (25, 35):  # before and after the step plan
        checkpoint.unlink(missing_ok=True)
        model, run, loss_of = fit(checkpoint, stop_at)
        with pytest.raises(KeyboardInterrupt):
            run.run(loss_of)
        assert torch.load(checkpoint, weights_only=False)["step"] == stop_at
        model, run, loss_of = fit(checkpoint)
        assert run.run(loss_of)["steps"] == 40
        assert torch.equal(model.weight, whole)
