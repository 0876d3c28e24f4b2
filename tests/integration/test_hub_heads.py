"""A feature head named by a hub id (draft kind 'eagle'), beside a target named by a hub id: the
head's snapshot and the target's embedding come through huggingface_hub from a hub cache laid out
as its client writes it, offline (HF_HUB_OFFLINE=1), in child processes that read HF_HOME as a
deployed replica or worker does. Misnamed heads fail in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from svip_assets import HEAD_DIR, default_pair
from tests.hub_cache import add_repo, offline_env

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET_ID, HEAD_ID, DRAFT_ID = "svip-test/embedded-target", "svip-test/embedded-eagle", "svip-test/embedded-draft"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    target, draft = default_pair()
    add_repo(home, TARGET_ID, Path(target))
    add_repo(home, HEAD_ID, HEAD_DIR)
    add_repo(home, DRAFT_ID, Path(draft))
    return home


def child(hf_home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=offline_env(hf_home, REPO))


def svip(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    return child(hf_home, "-m", "svip_cli", *args)


# a fixed stop and no load-aware cap: the same blocks both ways (auto and the load-aware gate learn
# from timed costs, which another test's load on the machine moves: 16 drafted tokens against 7 seen)
GENERATE = ["generate", "--prompt-ids", "10,11,12,13,14,15,16,17", "--max-new-tokens", "24", "--json",
            "--policy", "svip", "--threshold", "0.6", "--load-aware", "off"]


def test_a_head_and_a_target_by_hub_id_draft_what_the_embedded_head_drafts(hf_home):
    by_id = svip(hf_home, *GENERATE, "--target", TARGET_ID, "--draft", HEAD_ID, "--draft-kind", "eagle")
    embedded = svip(hf_home, *GENERATE, "--draft", "eagle")
    assert by_id.returncode == 0 and embedded.returncode == 0, by_id.stderr[-2000:] + embedded.stderr[-2000:]
    got, want = json.loads(by_id.stdout), json.loads(embedded.stdout)
    assert got["token_ids"] == want["token_ids"]
    assert got["stats"]["draft_tokens"] == want["stats"]["draft_tokens"] > 0  # the head drafted, the same blocks


def test_the_draft_worker_reads_a_hub_targets_embedding_and_the_serve_settings_resolve_the_head(hf_home):
    """What a deployed replica and its draft worker do with hub ids: the settings fetch the head's
    snapshot (its prior too), the worker reads the target's embedding table from the hub cache."""
    script = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from draft_worker.feature_draft import load_head_beside
        from svip_assets import HEAD_DIR, default_pair
        from svip_serve.local import check_models
        from svip_serve.settings import ServeSettings

        settings = ServeSettings.from_args(
            {{"target": {TARGET_ID!r}, "draft": {HEAD_ID!r}, "draft_kind": "eagle"}})
        target, head = settings.model_paths()
        assert target == {TARGET_ID!r} and Path(head).is_dir() and "models--svip-test--embedded-eagle" in head, head
        assert (Path(head) / "svip_auto_prior.json").is_file()
        check_models(settings)
        by_id = load_head_beside(head, {TARGET_ID!r})
        local = load_head_beside(str(HEAD_DIR), default_pair()[0])
        assert torch.equal(by_id.embedding.weight, local.embedding.weight)
        pairs = zip(by_id.head.state_dict().values(), local.head.state_dict().values())
        assert all(torch.equal(a, b) for a, b in pairs)
        print("ok")
    """)
    proc = child(hf_home, "-c", script)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "draft, words",
    [
        (DRAFT_ID, "is not a feature head"),  # a draft model named as a head
        ("svip-test/no-such-head", "not in the hub cache"),
        ("/no/such/head", "no such directory"),
    ],
)
def test_a_misnamed_head_is_one_line(hf_home, draft, words):
    proc = svip(hf_home, *GENERATE, "--target", TARGET_ID, "--draft", draft, "--draft-kind", "eagle")
    assert proc.returncode == 1 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1


def test_draft_kind_eagle_needs_a_draft(hf_home):
    proc = svip(hf_home, *GENERATE, "--draft-kind", "eagle")
    assert proc.returncode != 0 and "draft_kind 'eagle' needs a draft" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_distributed_workers_load_a_head_and_a_target_by_hub_id(hf_home):
    """The chart's path: the draft worker (a Ray actor) reads the hub target's embedding beside the
    head the driver fetched; the tokens are the in-process engine's."""
    args = [*GENERATE, "--target", TARGET_ID, "--draft", HEAD_ID, "--draft-kind", "eagle"]
    distributed = svip(hf_home, *args, "--mode", "distributed", "--pipeline", "sync")
    in_process = svip(hf_home, *args)
    assert distributed.returncode == 0 and in_process.returncode == 0, distributed.stderr[-3000:]
    got, want = json.loads(distributed.stdout), json.loads(in_process.stdout)
    assert got["token_ids"] == want["token_ids"]
    assert got["stats"]["config"]["mode"] == "distributed" and got["stats"]["draft_tokens"] > 0


def test_a_published_head_without_layer_ids_fuses_eagle3s_default_layers(tmp_path):
    """SafeAILab's heads name no fused layers in a flat config.json: the head takes EAGLE-3's own
    (2, L/2, L-3) from the target it loads beside, on both sides of the wire, and stays exact."""
    import shutil

    from coordinator.engine import SpeculativeEngine
    from draft_worker.feature_draft import head_layers, load_feature_draft
    from svip_common.contracts import GenerationRequest, PolicyConfig
    from svip_common.errors import ModelLoadError
    from svip_common.models import load_model

    flat = tmp_path / "flat-head"
    shutil.copytree(HEAD_DIR, flat)
    config = json.loads((flat / "config.json").read_text())
    del config["eagle_config"]
    (flat / "config.json").write_text(json.dumps(config))
    target = load_model(default_pair()[0])
    layers = target.model.config.num_hidden_layers
    assert head_layers(str(flat), layers) == (2, layers // 2, layers - 3)
    with pytest.raises(ModelLoadError, match="must name three target layers"):
        head_layers(str(flat))  # no target to take the default from
    engine = SpeculativeEngine(target, load_feature_draft(str(flat), target), load_aware="off")
    alone = SpeculativeEngine(target, None)
    request = GenerationRequest(tuple(range(10, 30)), 24, policy=PolicyConfig(name="constant", draft_length=3))
    result = engine.generate(request)
    assert result.token_ids == alone.generate(request).token_ids and result.stats.draft_tokens > 0


def test_a_hub_reference_pinned_to_a_revision_loads_that_revision(hf_home):
    """Review N6: hub fetches took the default branch, so a pod started later could load other
    weights than its peers. `owner/name@revision` pins every fetch (config, tokenizer, weights,
    single files): the cache holds two commits of one repository, main at the later one."""
    target, draft = default_pair()
    first, later = "1" * 40, "2" * 40
    add_repo(hf_home, "svip-test/pinned", Path(target), revision=first)
    add_repo(hf_home, "svip-test/pinned", Path(draft), revision=later)  # main moves on
    script = textwrap.dedent(f"""
        from svip_common.hub import local_file
        from svip_common.models import load_model, load_model_info
        from svip_assets import default_pair
        pinned, main = load_model_info("svip-test/pinned@{first}"), load_model_info("svip-test/pinned")
        want = [load_model_info(p).num_layers for p in default_pair()]
        assert [pinned.num_layers, main.num_layers] == want, ([pinned.num_layers, main.num_layers], want)
        assert load_model("svip-test/pinned@{first}").model.config.num_hidden_layers == want[0]
        assert "/snapshots/{first}/" in str(local_file("svip-test/pinned@{first}", "config.json"))
        try:
            local_file("svip-test/pinned@{first}", "../../../etc/passwd")
        except Exception as exc:
            assert "leaves the checkpoint" in str(exc), exc
        else:
            raise AssertionError("a file name out of the checkpoint was fetched")
        print("ok")
    """)
    done = child(hf_home, "-c", script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
