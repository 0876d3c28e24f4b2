"""The pair's one typed configuration (svip_common/pair_config.py): checked once, a bad field named
in one line; the Serve app's settings and the CLI build it, the worker pair takes it whole."""

from __future__ import annotations

import dataclasses

import pytest

from svip_common.errors import InvalidRequest
from svip_common.pair_config import PairConfig, Recovery


def test_the_defaults_check_and_a_copy_is_checked_again():
    config = PairConfig("t", "d").checked()
    assert config.replace(load_aware="all").load_aware == "all"
    with pytest.raises(InvalidRequest, match="load_aware must be one of off, greedy, all, got 'sometimes'"):
        config.replace(load_aware="sometimes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "bfloat16"


@pytest.mark.parametrize("changes, words", [
    ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ({"layout": "scatter"}, "layout must be one of pack, spread"),
    ({"target_gpus": 0}, r"target_gpus must be an integer in \[1, 8\], got 0"),
    ({"worker_cpus": 0}, r"worker_cpus must be a number in \(0, 256\]"),
    ({"kv_cache_tokens": 0}, "kv_cache_tokens must be an integer >= 1"),
    ({"max_batched_tokens": 0}, "max_batched_tokens must be an integer >= 1 or null"),
    ({"draft_length_cap": 10_000}, r"draft_length_cap must be an integer in \[1, 64\]"),
    ({"idle_prefill": "never"}, "idle_prefill must be one of auto, always, off"),
    ({"draft_parallel": 0}, r"draft_parallel must be an integer in \[1, 16\], got 0"),
    ({"draft_parallel": 17}, r"draft_parallel must be an integer in \[1, 16\], got 17"),
    ({"draft_parallel": 2.5}, "draft_parallel must be an integer"),
    ({"draft_parallel": True}, "draft_parallel must be an integer"),
    ({"worker_start_timeout_s": 0}, r"worker_start_timeout_s must be a number in \(0, "),
    ({"auto_cost": float("inf")}, "auto_cost must be a number"),
    ({"auto_window": 10}, r"auto_window must be an integer in \[64, "),
    ({"worker_restarts": -1}, r"worker_restarts must be an integer in \[0, 1000\]"),
    ({"draft_stall_s": float("nan")}, "draft_stall_s must be a number"),
    ({"target_tp": 2, "target_gpus": 2}, "takes one GPU a rank"),
    ({"emulate": "target=llama-3.1-8b@h100"}, "names no draft, and the pair has one"),
    ({"emulate": "target=llama-3.1-8b@h100,draft=llama-3.2-1b@v100"}, "unknown device 'v100'"),
])
def test_each_bad_field_is_named(changes, words):
    with pytest.raises(InvalidRequest, match=words):
        PairConfig("t", "d", **changes).checked()


def test_the_recovery_defaults_have_one_home():
    from coordinator.session.draft_port import DEFAULT_RECOVER_S, DEFAULT_STALL_S

    r = PairConfig("t", "d").recovery
    assert (DEFAULT_STALL_S, DEFAULT_RECOVER_S) == (r.draft_stall_s, r.draft_recover_s)


def test_a_setting_that_is_not_the_pairs_is_refused():
    with pytest.raises(InvalidRequest, match="not a pair setting: max_in_flight"):
        PairConfig.of("t", "d", max_in_flight=3)


def test_gpus_are_asked_for_on_cuda_alone():
    cpu, gpu = PairConfig("t", "d", target_gpus=2), PairConfig("t", "d", device="cuda", target_gpus=2)
    assert (cpu.gpus_of("target"), cpu.gpus_of("draft")) == (0, 0)
    assert (gpu.gpus_of("target"), gpu.gpus_of("draft")) == (2, 1)
    assert PairConfig("t", "d", device="cuda", target_tp=4).gpus_of("target") == 1  # a GPU each rank


def test_the_serve_settings_build_the_pairs_configuration(tmp_path):
    from svip_serve.settings import ServeSettings

    settings = ServeSettings.from_args({"target": str(tmp_path), "draft": "none", "device": "cuda",
                                        "target_gpus": 2, "kv_cache_tokens": 8192, "load_aware": "all",
                                        "worker_restarts": 2, "draft_stall_s": 5.0, "worker_start_timeout_s": 90.0})
    config = settings.pair_config()
    assert (config.target, config.draft, config.target_gpus, config.draft_gpus) == (str(tmp_path), None, 2, 1)
    assert config.packed and config.kv_cache_tokens == 8192 and config.load_aware == "all"
    assert config.recovery == Recovery(worker_restarts=2, draft_stall_s=5.0, sampled_hold_s=30.0, draft_recover_s=90.0)
    assert config.worker_start_timeout_s == 90.0 and config.max_batched_tokens == settings.max_batched_tokens


def test_device_timing_reaches_the_pair_from_the_serve_settings():
    from svip_serve.settings import ServeSettings

    spec = "target=llama-3.1-8b@h100,draft=llama-3.2-1b@h100,scale=2"
    config = ServeSettings.from_args({"emulate": spec}).pair_config()
    assert config.emulate == spec and config.emulation().draft.name == "llama-3.2-1b@h100"
    assert ServeSettings.from_args({"draft": "none", "emulate": "target=llama-3.1-8b@h100"}).emulate is not None
    for bad, words in ((12, "emulate must be a string"), ("target=llama-3.1-8b@h100", "names no draft")):
        with pytest.raises(InvalidRequest, match=words):
            ServeSettings.from_args({"emulate": bad})
