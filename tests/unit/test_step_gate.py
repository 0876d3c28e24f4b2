"""The test gate on a worker's steps (svip_common/test_hooks.py): a grant lets exactly its steps
through, `holding` says so only under the latest grant, and a new grant while closed counts afresh."""

from __future__ import annotations

from svip_common import test_hooks


def _gate(tmp_path):
    return test_hooks.StepGate("target", {test_hooks.GATE_DIR_VAR: str(tmp_path)})


def test_open_without_a_gate_file(tmp_path):
    gate = _gate(tmp_path)
    assert all(gate.open() for _ in range(5))
    assert not test_hooks.holding(tmp_path, "target")


def test_a_grant_lets_its_steps_through_then_holds(tmp_path):
    gate = _gate(tmp_path)
    test_hooks.hold(tmp_path, "target", 2)
    assert not test_hooks.holding(tmp_path, "target")
    assert [gate.open() for _ in range(4)] == [True, True, False, False]
    assert test_hooks.holding(tmp_path, "target")


def test_a_new_grant_while_holding_counts_afresh(tmp_path):
    gate = _gate(tmp_path)
    test_hooks.hold(tmp_path, "target", 1)
    assert [gate.open() for _ in range(2)] == [True, False]
    test_hooks.hold(tmp_path, "target", 1)  # same count, a new grant
    assert not test_hooks.holding(tmp_path, "target")  # the old grant's marker does not count
    assert [gate.open() for _ in range(2)] == [True, False]
    assert test_hooks.holding(tmp_path, "target")


def test_release_opens_and_clears(tmp_path):
    gate = _gate(tmp_path)
    test_hooks.hold(tmp_path, "target", 0)
    assert not gate.open()
    test_hooks.release(tmp_path, "target")
    assert gate.open() and not test_hooks.holding(tmp_path, "target")


def test_the_hooks_are_read_once_logged_loudly_and_a_bad_delay_fails_the_start(caplog):
    """Review N5: the hooks were read silently on every step and forward, and a delay that was not
    a number made every forward raise. Now a worker announces them at its start (CRITICAL, and its
    Stats), and a bad delay fails the start in one line."""
    import logging

    import pytest

    env = {test_hooks.GATE_DIR_VAR: "/tmp/gates", test_hooks.FORWARD_DELAY_VAR: "0.002"}
    with caplog.at_level(logging.CRITICAL):
        hooks = test_hooks.announce("target", env)
    assert hooks == ["SVIP_TEST_GATE_DIR=/tmp/gates", "SVIP_TEST_FORWARD_DELAY_S=0.002"]
    assert caplog.text.count("never set it in production") == 2
    assert test_hooks.announce("draft", {}) == []
    with pytest.raises(ValueError, match="SVIP_TEST_FORWARD_DELAY_S='fast' is not a number of seconds"):
        test_hooks.announce("target", {test_hooks.FORWARD_DELAY_VAR: "fast"})
