"""Every knob declared once (svip_common/knobs.py): each surface that carries a knob takes its name,
type, bounds and default from the declaration, a surface that leaves one out says why, and a
default that differs on a surface says why. Fails when a knob has two defaults anywhere, or a
surface carries a knob the declaration does not list."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
from pathlib import Path

import pytest
import yaml

from svip_common.errors import InvalidRequest
from svip_common.knob import ACCOUNTED, BENCH, CHART, GENERATE, PLAN, SERVE, SETTINGS, SURFACES, Knob
from svip_common.knobs import BY_NAME, KNOBS, carried_by, carrying
from tests.deploy import chart_knobs

REPO = Path(__file__).resolve().parents[2]
COMMANDS = (GENERATE, SERVE, BENCH, PLAN)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from svip_cli.main import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _knob_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in BY_NAME}


def test_each_knob_says_of_each_surface_whether_it_carries_it_or_why_not():
    for knob in KNOBS:
        assert set(knob.on) <= set(SURFACES) and knob.on, knob.name
        for surface in ACCOUNTED:
            carried, why = surface in knob.on, knob.off.get(surface, "")
            assert carried != bool(why), f"{knob.name} on {surface}: carry it, or say why not (and not both)"
        for surface, (value, why) in knob.differs.items():
            assert surface in knob.on and why and value != knob.default, f"{knob.name}'s {surface} default"
        assert (knob.chart is not None) == (CHART in knob.on), knob.name


def test_each_default_passes_its_own_check():
    for knob in KNOBS:
        for surface in knob.on:
            if not (surface == CHART and knob.kind is dict):  # the chart's own shape of an object
                knob.check(knob.default_on(surface))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_carries_the_knobs_the_declaration_names_with_their_defaults(command):
    from svip_cli.knob_flags import fill_defaults

    parser = _subparsers()[command]
    actions = _knob_actions(parser)
    assert sorted(actions) == sorted(k.name for k in carried_by(command)), \
        f"svip {command}: a flag named as a knob it does not carry, or a knob it carries without its flag"
    for name, action in actions.items():
        assert action.default is argparse.SUPPRESS, f"--{name}: its default is the declaration's, not the parser's"
        assert action.option_strings == [BY_NAME[name].cli_flag]
    args = argparse.Namespace()
    fill_defaults(args, command)
    for knob in KNOBS:
        assert vars(args)[knob.name] == (knob.default_on(command) if command in knob.on else knob.default)


def test_the_serve_apps_arguments_are_the_knobs_the_declaration_names():
    from svip_serve.settings import ServeSettings

    fields = {f.name: f.default for f in dataclasses.fields(ServeSettings)}
    assert list(fields) == [k.name for k in carried_by(SETTINGS)]
    assert all(fields[k.name] == k.default_on(SETTINGS) for k in carried_by(SETTINGS))
    assert ServeSettings.from_args({}) == ServeSettings()


def test_the_pair_configuration_takes_each_default_from_its_knob():
    from svip_common.pair_config import PairConfig

    own = {"target", "draft", "packed", "placement_timeout_s"}  # the models, and what no user sets
    for f in dataclasses.fields(PairConfig):
        if f.name in own:
            continue
        assert f.metadata.get("knob") == f.name and f.default == BY_NAME[f.name].default, f.name


def test_the_engines_take_the_configuration_not_knobs_of_their_own():
    from coordinator.engine import SpeculativeEngine
    from coordinator.front import open_engine
    from coordinator.local import LocalDistributed

    for function in (SpeculativeEngine.__init__, open_engine, LocalDistributed.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if name in BY_NAME and parameter.default is not inspect.Parameter.empty:
                assert parameter.default == BY_NAME[name].default, f"{function.__qualname__}({name}=...)"


def test_a_knob_added_to_the_declaration_appears_on_every_surface_it_names(monkeypatch):
    import svip_common.knobs as knobs

    extra = Knob("speculation_budget", int, 7, "a knob only this test declares", (GENERATE, SERVE, BENCH, PLAN,
                 SETTINGS), low=1, high=9, off={CHART: "a test's"})
    monkeypatch.setattr(knobs, "KNOBS", (*knobs.KNOBS, extra))
    monkeypatch.setitem(knobs.BY_NAME, extra.name, extra)
    for command, parser in _subparsers().items():
        action = _knob_actions(parser)["speculation_budget"]
        assert action.option_strings == ["--speculation-budget"], command
        with pytest.raises(InvalidRequest, match="--speculation-budget: must be an integer in \\[1, 9\\], got 10"):
            _parse(command, "--speculation-budget", "10")

    @carrying(SETTINGS)
    class Settings:
        pass

    assert Settings().speculation_budget == 7 and Settings(speculation_budget=3).speculation_budget == 3


def _parse(command: str, *flags: str):
    from svip_cli.main import build_parser

    return build_parser().parse_args([command, *flags])


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.kind in (int, float)], ids=lambda k: k.name)
def test_each_bound_is_held_at_its_extremes(knob):
    if knob.high is not None:
        knob.check(knob.high)
        with pytest.raises(InvalidRequest, match=f"{knob.name} must be"):
            knob.check(knob.high + 1)
    if knob.low is not None:
        if not knob.low_open:
            knob.check(knob.low)
        with pytest.raises(InvalidRequest, match=f"{knob.name} must be"):
            knob.check(knob.low if knob.low_open else knob.low - 1)
    for bad in (math.inf, math.nan, True, "7"):
        if not (isinstance(bad, str) and bad in knob.words):
            with pytest.raises(InvalidRequest, match=knob.name):
                knob.check(bad)


def test_the_chart_values_hold_each_knobs_default_and_nothing_undeclared():
    values = chart_knobs.values()
    for knob in carried_by(CHART):
        assert chart_knobs.at(values, knob.chart) == knob.default_on(CHART), \
            f"values.yaml {knob.chart}: the declaration's default, or a `differs` entry saying why"
    declared = {k.chart for k in carried_by(CHART)}
    for section in chart_knobs.SECTIONS:
        for path in chart_knobs.value_paths(values[section], section + "."):
            assert path in chart_knobs.CHART_ONLY or any(path == c or path.startswith(c + ".") for c in declared), \
                f"values.yaml {path} is no knob: declare it (svip_common/knobs.py) or say why in CHART_ONLY"


def test_the_chart_schema_holds_each_knobs_bounds():
    tree = chart_knobs.schema()
    for knob in carried_by(CHART):
        if knob.kind is dict:
            continue
        node = chart_knobs.at(tree, knob.chart, schema_tree=True)
        assert chart_knobs.schema_constraints(node) == chart_knobs.expected_schema(knob), \
            f"values.schema.json {knob.chart}: run `python -m tests.deploy.chart_knobs` to follow the declaration"


def test_the_chart_passes_each_knob_it_carries_and_no_other():
    args = chart_knobs.helper_args()
    for arg, refs in args.items():
        knob = BY_NAME.get(arg)
        assert knob is not None and SETTINGS in knob.on, f"_helpers.tpl passes {arg}, which is no app argument"
        if knob.chart is not None:
            assert any(r == knob.chart or r.startswith(knob.chart + ".") for r in refs), (arg, refs)
        else:
            assert CHART in knob.off and not refs, f"{arg}: the chart sets it itself, as its declaration says"
    missing = [k.name for k in carried_by(CHART) if k.name not in args]
    assert not missing, f"_helpers.tpl never passes {missing}"


def test_the_plain_serve_config_sets_only_what_differs_from_the_defaults():
    config = yaml.safe_load((REPO / "deploy" / "serve-config.yaml").read_text())
    args = config["applications"][0]["args"]
    for name, value in args.items():
        knob = BY_NAME[name]
        assert SETTINGS in knob.on and knob.check(value) != knob.default, \
            f"serve-config.yaml {name}: its default already (svip_common/knobs.py); leave it out"
