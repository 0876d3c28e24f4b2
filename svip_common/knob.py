"""What a knob is: one setting a user gives the system (a model, a budget, a default), declared once
with its type, default, bounds, help text and the surfaces that carry it (svip_common/knobs.py
lists them all). Everything that reads a knob checks it here, so a bad value is the same error on
every surface, naming the key (or the flag). No torch, no argparse: the CLI builds its flags from
these (svip_cli/knob_flags.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from svip_common.errors import InvalidRequest

GENERATE, SERVE, BENCH, PLAN = "generate", "serve", "bench", "plan"  # the CLI's subcommands
SETTINGS = "settings"  # the Serve app's arguments (ServeSettings: deploy/serve-config.yaml's `args`)
CHART = "chart"  # the Helm chart's values (deploy/helm/svip/values.yaml)
SURFACES = (GENERATE, SERVE, BENCH, PLAN, SETTINGS, CHART)
ACCOUNTED = (GENERATE, SERVE, SETTINGS, CHART)  # each knob carries these or says why not (bench and plan measure)


@dataclass(frozen=True, eq=False)
class Knob:
    name: str  # the key: a Serve argument, a PairConfig field, the flag's dest (--name-with-dashes)
    kind: type  # bool, int, float, str, tuple (a list of strings), dict (an object)
    default: object
    help: str  # what it does, for --help and docs/usage.md (the default is appended)
    on: tuple[str, ...]  # the surfaces that carry it (SURFACES)
    off: Mapping[str, str] = field(default_factory=dict)  # an ACCOUNTED surface that leaves it out: why
    low: float | None = None  # the least value (inclusive; low_open: exclusive)
    high: float | None = None  # the most value (inclusive)
    low_open: bool = False
    choices: tuple | None = None
    words: tuple[str, ...] = ()  # strings a number knob also takes (a threshold's "auto")
    optional: bool = False  # None is a value: `unset` says what it means
    unset: str = ""
    flag: str | None = None  # the CLI flag, where not --name-with-dashes
    metavar: str | None = None
    group: str = "workers"  # the --help section it is listed under
    scope: str = ""  # "distributed": svip generate refuses it with --mode inprocess
    chart: str | None = None  # its path in the chart's values, e.g. serve.kvCacheTokens
    differs: Mapping[str, tuple[object, str]] = field(default_factory=dict)  # surface -> (its default, why)
    extra: Callable[[object], None] | None = None  # a check past type and bounds (a spec's grammar)
    parse: Callable[[str], object] | None = None  # the CLI's text to a value, where kind(text) is not it

    def default_on(self, surface: str) -> object:
        """The default a surface gives it: the declaration's, unless `differs` names the surface."""
        return self.differs[surface][0] if surface in self.differs else self.default

    @property
    def cli_flag(self) -> str:
        """--name-with-dashes; a switch that is on unless given, --no-name-with-dashes."""
        off = "no-" if self.kind is bool and self.default else ""
        return self.flag or "--" + off + self.name.replace("_", "-")

    def describe(self) -> str:
        """What a value must be, e.g. 'an integer >= 1' or 'one of off, greedy, all'."""
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        noun = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                tuple: "a list of strings", dict: "an object"}[self.kind]
        words = "".join(f" or {w!r}" for w in self.words)
        return noun + _bounds(self.low, self.high, self.low_open) + words

    def json_schema(self, nullable: bool) -> dict:
        """Its constraints as JSON Schema (the chart's values.schema.json checks them; nullable: null is a value)."""
        kind = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object",
                tuple: "array"}[self.kind]
        out: dict = {"type": [kind, "null"] if nullable else kind}
        if self.choices is not None:
            out["enum"] = list(self.choices) + ([None] if nullable else [])
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        if self.words:
            return {"anyOf": [out, {"enum": list(self.words)}]}
        return out

    def check(self, value, label: str | None = None):
        """The value, checked (ints as floats where the knob is a float, lists as tuples);
        InvalidRequest names the label (the key by default)."""
        if value is None and self.optional:
            return None
        if not self._fits(value):
            raise InvalidRequest(f"{label or self.name} must be {self.describe()}"
                                 f"{' or null' if self.optional else ''}, got {value!r}")
        if self.kind is float and not isinstance(value, str):
            value = float(value)
        elif self.kind is tuple:
            value = tuple(value)
        if self.extra is not None:
            self.extra(value)
        return value

    def _fits(self, value) -> bool:
        if isinstance(value, str) and value in self.words:
            return True
        if self.choices is not None:
            return isinstance(value, (str, int, float)) and not isinstance(value, bool) and value in self.choices
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is tuple:
            return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        if self.kind is dict:
            return isinstance(value, dict)
        if self.kind is str:
            return isinstance(value, str)
        numeric = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            return False
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)


def _bounds(low, high, low_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{_n(low)}, {_n(high)}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {_n(low)}"
    return "" if high is None else f" <= {_n(high)}"


def _n(number) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)
