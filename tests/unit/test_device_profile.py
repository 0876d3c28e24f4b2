"""Step-time models for devices this machine does not have (svip_common/device_profile.py),
checked against numbers worked out by hand and against the shapes' known sizes."""

from __future__ import annotations

import pytest

from svip_common.device_profile import DEVICES, MODELS, Efficiency, StepModel, link, step_model
from svip_common.errors import InvalidRequest


@pytest.mark.parametrize("name, billions", [
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("llama-3.2-1b", 1.24), ("qwen2.5-7b", 7.62),
    ("qwen2.5-0.5b", 0.49),
])
def test_the_shipped_shapes_have_their_checkpoints_parameter_counts(name, billions):
    assert MODELS[name].params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_a_decode_step_is_its_weights_over_the_bandwidth_plus_the_floor():
    m = step_model("llama-3.1-8b@h100")
    s, e = m.shape, m.efficiency
    kv = 513 * s.kv_bytes_per_token(2)  # 512 cached, the new one
    by_hand = (s.params() * 2 + kv) / (3.35e12 * e.bandwidth) + 32 * e.floor_per_layer_s
    assert m.forward_s([(1, 512)]) == pytest.approx(by_hand)
    assert 5e-3 < m.forward_s([(1, 512)]) < 8e-3  # what engines measure on an H100 at batch 1, bf16


def test_verifying_a_block_costs_about_a_decode_step_until_compute_binds():
    m = step_model("llama-3.1-8b@h100")
    one, block = m.forward_s([(1, 512)]), m.forward_s([(6, 512)])
    assert block == pytest.approx(one, rel=0.02)  # memory-bound: six tokens for the price of one
    big = m.forward_s([(6, 512)] * 256)  # 1,536 tokens: compute-bound
    flops = 2 * m.shape.compute_params() * 1536 + 256 * 4 * 32 * 4096 * 6 * 518
    assert big == pytest.approx(flops / (989e12 * m.efficiency.flops) + 32 * m.efficiency.floor_per_layer_s)


def test_tensor_parallel_splits_the_bytes_and_adds_its_all_reduces():
    one = StepModel(MODELS["llama-3.1-70b"], DEVICES["h200"], 1, efficiency=Efficiency(floor_per_layer_s=0))
    four = StepModel(MODELS["llama-3.1-70b"], DEVICES["h200"], 4, efficiency=Efficiency(floor_per_layer_s=0))
    step = [(1, 100)]
    all_reduces = 2 * 80 * (8e-6 + 2 * 3 / 4 * 8192 * 2 / 450e9)
    assert four.forward_s(step) == pytest.approx(one.forward_s(step) / 4 + all_reduces)


def test_a_measured_row_replaces_the_model_where_it_has_one():
    m = step_model("qwen2.5-7b@h100").with_measured([{"batch": 1, "tokens_per_seq": 1, "ms": 9.5}])
    assert m.forward_s([(1, 300)]) == pytest.approx(9.5e-3)
    assert m.forward_s([(2, 300)]) != pytest.approx(9.5e-3)  # no row: the model


@pytest.mark.parametrize("spec, words", [
    ("llama-9b@h100", "unknown model 'llama-9b'; known: eagle3-llama-3.1-8b, eagle3-llama-3.3-70b, llama-3.1-70b"),
    ("llama-3.1-8b@a100", "unknown device 'a100'; known: h100, h200"),
    ("llama-3.1-70b@h100", "do not fit 1 x 80 GB"),
    ("llama-3.1-8b@16xh100", "1 to 8 devices"),
    ("llama-3.1-8b", "MODEL@DEVICE"),
])
def test_a_bad_placement_is_one_line_naming_what_is_known(spec, words):
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(")):
        step_model(spec)


def test_links_by_name_or_latency():
    assert link("100gbe").transfer_s(12_500) == pytest.approx(25e-6 + 1e-6)
    assert link("0.1ms").latency_s == pytest.approx(1e-4)
    with pytest.raises(InvalidRequest, match="known: node, 25gbe, 100gbe"):
        link("carrier pigeon")
