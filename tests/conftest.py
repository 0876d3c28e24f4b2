"""Shared fixtures: small random model pairs built once per session and saved to disk, loaded
back through the same from_pretrained path as real models."""

from __future__ import annotations

import os

# Ray must bind to loopback only (DESIGN.md, Placement); set before ray is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import dataclasses
from pathlib import Path

import pytest
import torch

from svip_common.models import load_model
from tests.tiny_models import build_model, build_tokenizer, perturbed_copy, save_model

torch.set_num_threads(1)

PROMPTS = {
    "short": "def",
    "medium": "def fibonacci(n):\n    if n < 2:",
    "long": "The quick brown fox jumps over the lazy dog. " * 6,
}


@dataclasses.dataclass
class ModelDirs:
    target: str
    random_draft: str  # unrelated random weights: almost nothing is accepted
    close_draft: str  # the target's weights plus noise: partial acceptance, real rejections
    peaky: str  # low-entropy model: drafts of itself run up to the cap


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> ModelDirs:
    root: Path = tmp_path_factory.mktemp("models")
    tok = build_tokenizer()
    target = build_model(tok, seed=1, hidden=64, layers=2)
    return ModelDirs(
        target=save_model(root / "target", tok, target),
        random_draft=save_model(root / "random_draft", tok, build_model(tok, seed=2, hidden=32, layers=1)),
        close_draft=save_model(root / "close_draft", tok, perturbed_copy(target, noise=0.15, seed=3)),
        peaky=save_model(root / "peaky", tok, build_model(tok, seed=4, logit_scale=60.0)),
    )


@pytest.fixture(scope="session")
def models(model_dirs):
    return {name: load_model(path) for name, path in dataclasses.asdict(model_dirs).items()}


@pytest.fixture(scope="session")
def prompt_ids(models):
    tok = models["target"].tokenizer
    return {name: tuple(tok(text)["input_ids"]) for name, text in PROMPTS.items()}
