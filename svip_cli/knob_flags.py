"""The CLI's flags for the knobs a subcommand carries, built from their one declaration
(svip_common/knobs.py): the flag, its type and bounds (checked as it is parsed, the error naming
the flag), its help with the default appended. A flag not given is absent after parsing
(argparse.SUPPRESS) until fill_defaults sets it, so a command can tell what the user gave."""

from __future__ import annotations

import argparse

from svip_common.errors import InvalidRequest
from svip_common.knob import GENERATE, Knob
from svip_common.knobs import KNOBS, carried_by
from svip_common.pair_config import PairConfig, pair_options

_METAVARS = {int: "N", float: "X"}


def add_knob_flags(parser: argparse.ArgumentParser, surface: str) -> None:
    """A flag for each knob ``surface`` carries, listed under its knob's group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for k in carried_by(surface):
        if k.group not in groups:
            groups[k.group] = parser.add_argument_group(k.group)
        groups[k.group].add_argument(k.cli_flag, **_options(k, surface))


def fill_defaults(args: argparse.Namespace, surface: str) -> frozenset[str]:
    """Set each knob the user did not give to its default on ``surface`` (one the surface does not
    carry: the declaration's); returns the names of those given."""
    carried = {k.name for k in carried_by(surface)}
    given = frozenset(name for name in carried if name in vars(args))
    for k in KNOBS:
        if k.name not in given:
            setattr(args, k.name, k.default_on(surface) if k.name in carried else k.default)
    return given


def pair_config(args: argparse.Namespace) -> PairConfig:
    """The pair the flags name (no target: the embedded pair), every pair knob as given or its default."""
    from svip_assets import pair_paths

    target, draft = pair_paths(args.target, args.draft, args.draft_kind)
    return PairConfig.of(target, draft, **pair_options(vars(args)))


def _options(k: Knob, surface: str) -> dict:
    options = {"dest": k.name, "default": argparse.SUPPRESS, "help": _help(k, surface)}
    if k.kind is bool:
        return {**options, "action": "store_false" if k.default else "store_true"}
    if k.kind is tuple:
        return {**options, "action": "append", "metavar": k.metavar}
    metavar = k.metavar or ("{" + ",".join(map(str, k.choices)) + "}" if k.choices else _METAVARS.get(k.kind))
    if k.kind is float and k.name.endswith("_s") and k.metavar is None:
        metavar = "SECONDS"
    return {**options, "type": _converter(k), "metavar": metavar}


def _converter(k: Knob):
    def convert(text: str):
        try:
            value = k.parse(text) if k.parse is not None else k.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {k.describe()}, got {text!r}") from None
        try:
            return k.check(value)
        except InvalidRequest as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{k.name} ")) from None

    convert.__name__ = k.name  # argparse names the type in its own messages
    return convert


def _help(k: Knob, surface: str) -> str:
    scope = f"{k.scope}: " if k.scope and surface == GENERATE else ""
    default = k.default_on(surface)
    if k.kind is bool:
        shown = "" if not default else " (on; this flag turns it off)"
    elif default is None or default == ():
        shown = f" (default: {k.unset})" if k.unset else ""
    else:
        shown = f" (default: {default})"
    return (scope + k.help + shown).replace("%", "%%")
