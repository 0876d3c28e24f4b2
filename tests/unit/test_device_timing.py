"""Device timing on this machine (svip_common/device_timing.py) and the spec that names it
(svip_common/emulation.py): a forward lasts its step model's time, a slower one is counted, the
scale multiplies the steps alike, a shared device lets one forward at a time, and the outputs do
not change. Time is a clock the test moves, so nothing here depends on this machine's speed."""

from __future__ import annotations

import pytest
import torch

from svip_common.device_profile import step_model
from svip_common.device_timing import EmulatedDevice
from svip_common.emulation import parse_emulation
from svip_common.errors import InvalidRequest
from svip_common.kv_cache import KVPool


class FakeTime:
    """A clock a forward's body moves (what the real forward 'took') and that sleeping moves."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


STEP = step_model("llama-3.1-8b@h100")


def test_a_forward_faster_than_its_step_waits_out_the_rest():
    t = FakeTime()
    timing = EmulatedDevice("h100", clock=t, sleep=t.sleep).timing(STEP)
    due = STEP.forward_s([(6, 300)])
    with timing.forward([(6, 300)]):
        t.now += 0.001  # the real forward
    assert t.now == pytest.approx(due) and t.slept == [pytest.approx(due - 0.001)]
    use = timing.device.use
    assert (use.forwards, use.overruns, use.device_s) == (1, 0, pytest.approx(due))


def test_a_forward_slower_than_its_step_is_counted_not_hidden():
    t = FakeTime()
    device = EmulatedDevice("h100", clock=t, sleep=t.sleep)
    timing = device.timing(STEP)
    due = STEP.forward_s([(1, 10)])
    with timing.forward([(1, 10)]):
        t.now += 3 * due
    assert t.slept == [] and t.now == pytest.approx(3 * due)
    assert (device.use.overruns, device.use.overrun_s) == (1, pytest.approx(2 * due))
    assert device.use.worst_ratio == pytest.approx(3.0)
    assert "1 of 1 forwards ran past their step" in device.use.summary()


def test_a_virtual_device_waits_for_nothing_and_keeps_the_account():
    t = FakeTime()
    device = EmulatedDevice("h100", clock=t, sleep=None)
    with device.timing(STEP).forward([(1, 10)]):
        t.now += 0.001
    due = STEP.forward_s([(1, 10)])
    assert t.now == pytest.approx(0.001) and device.use.real_s == pytest.approx(0.001)
    assert device.use.device_s == pytest.approx(due)  # a run's time on it: wall - real_s + device_s


def test_the_scale_multiplies_every_step_alike():
    t = FakeTime()
    device = EmulatedDevice("h100", scale=4, clock=t, sleep=t.sleep)
    with device.timing(STEP).forward([(1, 10)]):
        pass
    assert t.now == pytest.approx(4 * STEP.forward_s([(1, 10)]))
    with pytest.raises(ValueError, match="scale"):
        EmulatedDevice("h100", scale=0)


def test_two_models_on_one_device_take_turns():
    """The in-process placement: while the target's forward runs the device is held, so the
    draft's cannot start on it; a device of its own is free."""
    device = EmulatedDevice("h100")
    target, draft = device.timing(step_model("llama-3.1-8b@h100")), device.timing(step_model("llama-3.2-1b@h100"))
    other = EmulatedDevice("h100").timing(step_model("llama-3.2-1b@h100"))
    with target.forward([(1, 10)]):
        assert not draft.device.lock.acquire(blocking=False)
        with other.forward([(1, 10)]):
            pass
    with draft.forward([(1, 10)]):
        pass
    assert device.use.forwards == 2 and other.device.use.forwards == 1


def test_device_timing_changes_when_a_forward_ends_never_what_it_computes(models, prompt_ids):
    model = models["target"]
    plain, timed = KVPool(model.model, 256), KVPool(model.model, 256)
    t = FakeTime()
    timed.timing = EmulatedDevice("h100", clock=t, sleep=t.sleep).timing(STEP)
    ids = list(prompt_ids["medium"])
    a, b = plain.sequence(), timed.sequence()
    first = plain.forward([(a, ids, 1)])[0], timed.forward([(b, ids, 1)])[0]
    second = plain.forward([(a, ids[:3], 3)])[0], timed.forward([(b, ids[:3], 3)])[0]
    assert torch.equal(*first) and torch.equal(*second)
    use = timed.timing.device.use
    assert use.forwards == 2
    assert use.device_s == pytest.approx(STEP.forward_s([(len(ids), 0)]) + STEP.forward_s([(3, len(ids))]))


def test_the_spec_names_target_draft_link_and_scale():
    e = parse_emulation("target=llama-3.1-70b@4xh100, draft=llama-3.1-8b@h100, link=0.1ms, scale=2")
    assert (e.target.name, e.draft.name, e.link.latency_s, e.scale) == ("llama-3.1-70b@4xh100",
                                                                        "llama-3.1-8b@h100", 1e-4, 2.0)
    assert not e.draft_on_target_devices
    assert parse_emulation("target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@4xh100").draft_on_target_devices
    alone = parse_emulation("target=llama-3.1-8b@h200")
    assert alone.draft is None and alone.link.name == "node" and alone.scale == 1
    together = e.co_located()
    assert together.draft.name == "llama-3.1-8b@4xh100" and together.draft_on_target_devices
    assert parse_emulation(together.spec) == together
    target, draft = e.shared_timings()
    assert target.device is draft.device
    assert e.target_timing().device is not e.draft_timing().device


@pytest.mark.parametrize("spec, words", [
    ("draft=llama-3.1-8b@h100", "target=MODEL@DEVICE is required"),
    ("target=llama-9b@h100", "unknown model 'llama-9b'; known: "),
    ("target=llama-3.1-8b@a100", "unknown device 'a100'; known: "),
    ("target=llama-3.1-8b@h100,speed=2", "unknown key 'speed'; known: target, draft, link, scale"),
    ("target=llama-3.1-8b@h100,link=fast", "unknown link 'fast'"),
    ("target=llama-3.1-8b@h100,scale=0", "scale must be in (0, 1000]"),
    ("target=llama-3.1-8b@h100,scale=lots", "scale='lots' is not a number"),
    ("target=llama-3.1-8b@h100,target=llama-3.1-8b@h200", "target given twice"),
    ("llama-3.1-8b@h100", "write KEY=VALUE pairs"),
    ("target=llama-3.1-70b@h100", "do not fit 1 x 80 GB"),
])
def test_a_bad_spec_is_a_one_line_error_that_names_it(spec, words):
    with pytest.raises(InvalidRequest) as info:
        parse_emulation(spec)
    assert words in str(info.value) and "\n" not in str(info.value)
