"""Shared fixtures: small random model pairs built once per session and saved to disk, loaded
back through the same from_pretrained path as real models."""

from __future__ import annotations

import os

# Ray must bind to loopback only (docs/architecture.md, Placement); set before ray is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import tempfile

from svip_common.test_hooks import GATE_DIR_VAR

# Where tests hold a target worker's steps (svip_common/test_hooks.py). Set before any Ray or
# `svip serve` starts, so every worker process of the session inherits it; one per pytest-xdist
# worker (each inherits the controller's environment), so parallel files never hold each other.
if os.environ.get("PYTEST_XDIST_WORKER") or GATE_DIR_VAR not in os.environ:
    os.environ[GATE_DIR_VAR] = tempfile.mkdtemp(prefix="svip-gates-")

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from svip_common.models import load_model
from tests.gates import TargetGate
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


@pytest.fixture
def target_gate():
    gate = TargetGate(os.environ[GATE_DIR_VAR])
    yield gate
    gate.release()


@pytest.fixture(scope="module")
def loop():
    """An event loop per test module, for tests that drive gRPC servers and clients by hand."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


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


@dataclasses.dataclass
class WidePair:
    """A target and a draft whose embeddings are wider than their shared tokenizer, by different
    amounts (as Qwen2.5 7B: 152064 rows and 0.5B: 151936, for 151665 tokens)."""

    target: str
    draft: str
    tokens: int  # len(tokenizer): the ids every model embeds
    draft_width: int
    target_width: int


@pytest.fixture(scope="session")
def wide_pair(tmp_path_factory) -> WidePair:
    root: Path = tmp_path_factory.mktemp("wide")
    tok = build_tokenizer()
    n = len(tok)
    target = build_model(tok, seed=1, hidden=64, layers=2, width=n + 64)
    draft = perturbed_copy(target, noise=0.15, seed=3)
    draft_small = build_model(tok, seed=5, hidden=64, layers=2, width=n + 8)
    with torch.no_grad():  # the close draft's weights, cut to its narrower embedding
        state = {k: (v[: n + 8] if v.shape[0] == n + 64 else v) for k, v in draft.state_dict().items()}
        draft_small.load_state_dict(state)
    return WidePair(
        save_model(root / "target", tok, target), save_model(root / "draft", tok, draft_small), n, n + 8, n + 64
    )


@pytest.fixture(scope="session")
def models(model_dirs):
    return {name: load_model(path) for name, path in dataclasses.asdict(model_dirs).items()}


@pytest.fixture(scope="session")
def prompt_ids(models):
    tok = models["target"].tokenizer
    return {name: tuple(tok(text)["input_ids"]) for name, text in PROMPTS.items()}
