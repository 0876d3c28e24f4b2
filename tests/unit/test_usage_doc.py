"""docs/usage.md's flag and knob tables are the parser's (svip_cli/usage.py generates them)."""

from __future__ import annotations

from svip_cli import usage


def test_the_usage_doc_lists_every_flag_as_the_parser_has_it():
    text = usage.DOC.read_text()
    assert text.count("<!-- generated: ") == len(usage.sections()), "each table has its place in docs/usage.md"
    assert usage.render(text) == text, "docs/usage.md is stale: run `python -m svip_cli.usage`"


def test_a_stale_table_is_told():
    text = usage.DOC.read_text()
    stale = text.replace("| `--kv-cache-tokens N` |", "| `--kv-cache-tokens N` | (gone) |", 1)
    assert stale != text and usage.render(stale) == text
