"""The Helm chart's view of the knobs (svip_common/knobs.py): which values carry them, what the
templates pass to the Serve app, and the constraints values.schema.json puts on each. Read by
tests/unit/test_knobs.py; `python -m tests.deploy.chart_knobs` rewrites the knobs' nodes of
values.schema.json from their declarations (then `git diff` shows what changed)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from svip_common.knob import CHART, SETTINGS, Knob
from svip_common.knobs import KNOBS, carried_by

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "svip"
SCHEMA, VALUES, HELPERS = (CHART_DIR / "values.schema.json", CHART_DIR / "values.yaml",
                           CHART_DIR / "templates" / "_helpers.tpl")
SECTIONS = ("model", "decoding", "serve")  # the values that feed the app's arguments
CONSTRAINTS = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "anyOf")
# values in those sections that are no knob of the app, and why
CHART_ONLY = {
    "model.revision": "the chart pins model.target to it (target@revision): the app reads one reference",
    "model.draftRevision": "the chart pins model.draft to it (draft@revision)",
}


def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def at(tree: dict, path: str, schema_tree: bool = False):
    """The node at a dotted path (of values, or of the schema's properties); KeyError if absent."""
    for part in path.split("."):
        tree = tree["properties"][part] if schema_tree else tree[part]
    return tree


def expected_schema(knob: Knob) -> dict:
    return knob.json_schema(nullable=knob.optional and knob.default_on(CHART) is None)


def schema_constraints(node: dict) -> dict:
    return {k: v for k, v in node.items() if k in CONSTRAINTS}


def value_paths(tree: dict, prefix: str = "") -> list[str]:
    """The leaf paths under a values mapping."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out += value_paths(value, path + ".") if isinstance(value, dict) else [path]
    return out


def helper_args() -> dict[str, list[str]]:
    """Each argument the chart's serveConfig passes the app, and the values paths it reads (through
    the named templates it includes)."""
    text = HELPERS.read_text()
    defines = dict(re.findall(r'{{-? define "([\w.]+)" -?}}(.*?){{-? end -?}}', text, re.S))
    block = text[text.index('{{- define "svip.serveConfig" -}}'):]
    block = block[:block.index("{{- end -}}\n\n")]
    start = block.index("$args := dict")
    lines = re.findall(r'^\s*"(\w+)" (.*)$', block[start:block.index("-}}", start)], re.M)
    lines += re.findall(r'set \$args "(\w+)" (.*?) -}}', block)
    out: dict[str, list[str]] = {}
    for arg, expression in lines:
        refs = re.findall(r"\$v\.([\w.]+)", expression)
        for name in re.findall(r'include "([\w.]+)"', expression):
            refs += re.findall(r"\.Values\.([\w.]+)", defines.get(name, ""))
        out.setdefault(arg, []).extend(refs)
    return out


def write_schema() -> list[str]:
    """Rewrite each chart knob's constraints in values.schema.json; returns the paths it changed."""
    tree, changed = schema(), []
    for knob in carried_by(CHART):
        if knob.kind is dict:
            continue  # an object of the chart's own shape (serve.autoscaling), checked by the app
        *parents, leaf = knob.chart.split(".")
        node = at(tree, ".".join(parents), schema_tree=True)["properties"].setdefault(leaf, {})
        want = expected_schema(knob)
        if schema_constraints(node) != want:
            changed.append(knob.chart)
            description = node.get("description") or knob.help
            extra = {k: v for k, v in node.items() if k not in CONSTRAINTS and k != "description"}
            node.clear()
            node.update({**want, **extra, "description": description})
    SCHEMA.write_text(json.dumps(tree, indent=2) + "\n")
    return changed


def settings_knobs() -> set[str]:
    return {k.name for k in carried_by(SETTINGS)}


__all__ = ["CHART_ONLY", "KNOBS", "SECTIONS", "at", "expected_schema", "helper_args", "schema", "schema_constraints",
           "settings_knobs", "value_paths", "values", "write_schema"]

if __name__ == "__main__":
    print("\n".join(write_schema()) or "values.schema.json already follows the knobs", file=sys.stderr)
