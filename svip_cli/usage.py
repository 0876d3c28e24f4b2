"""docs/usage.md's reference tables, generated: every flag of each command (from the parser, so from
the knobs' declaration and each command's own flags) and every knob with its default, bounds and
the surfaces that carry it. `python -m svip_cli.usage` rewrites them in place;
tests/unit/test_usage_doc.py fails while the file and the parser disagree."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from svip_common.knob import ACCOUNTED, BENCH, CHART, GENERATE, PLAN, SERVE, SETTINGS
from svip_common.knobs import KNOBS

DOC = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
COMMANDS = (GENERATE, SERVE, BENCH, PLAN)
_SECTION = re.compile(r"(<!-- generated: ([\w-]+) -->\n).*?(<!-- end generated -->)", re.S)


def flag_table(parser: argparse.ArgumentParser) -> str:
    """A command's flags, one row each, under its groups' headings."""
    rows = ["| flag | what it does |", "|---|---|"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        rows.append(f"| **{group.title}** | |")
        for action in actions:
            rows.append(f"| {_flag(action)} | {_cell(_help(action))} |")
    return "\n".join(rows)


def knob_table() -> str:
    """Every knob: its default, what it must be, and where it is set."""
    rows = ["| knob | default | must be | set by |", "|---|---|---|---|"]
    for k in KNOBS:
        where = [f"`{'svip ' + s if s in COMMANDS else s}`" for s in k.on if s not in (CHART, SETTINGS)]
        where += ["Serve `args`"] if SETTINGS in k.on else []
        where += [f"chart `{k.chart}`"] if k.chart else []
        differs = "".join(f"; {s}: `{_shown(v)}` ({why})" for s, (v, why) in k.differs.items() if s in ACCOUNTED)
        default = f"`{k.default}`" if k.default not in (None, ()) else (k.unset or "none")
        must = k.describe() + (" or null" if k.optional else "")
        rows.append(f"| `{k.name}` | {_cell(default + differs)} | {_cell(must)} | {', '.join(where)} |")
    return "\n".join(rows)


def sections() -> dict[str, str]:
    from svip_cli.main import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {f"flags-{name}": flag_table(parser) for name, parser in action.choices.items()}
    out["knobs"] = knob_table()
    return out


def render(text: str) -> str:
    """``text`` with each generated section's body made anew."""
    tables = sections()
    return _SECTION.sub(lambda m: m.group(1) + tables[m.group(2)] + "\n" + m.group(3), text)


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`"
    metavar = action.metavar or (action.dest.upper() if action.nargs != 0 else None)
    return ", ".join(f"`{s}{' ' + metavar if metavar else ''}`" for s in action.option_strings)


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%%", "%")
    shown = action.default not in (None, False, (), argparse.SUPPRESS) and "default" not in text
    return text + (f" (default: {action.default})" if shown and f"({action.default})" not in text else "")


def _shown(value) -> str:
    return json.dumps(value) if isinstance(value, dict) or value == "" else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote {DOC}", file=sys.stderr)
