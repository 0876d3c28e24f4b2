"""Structured output's request side: what grammar a request's tokens must follow (OpenAI's
``response_format`` json_object and json_schema, a regex, a Lark grammar), bounded and compiled
here; the mask it puts on every row is svip_common/grammar_mask.py's.

The grammar engine is llguidance (github.com/guidance-ai/llguidance): a maintained Rust library
with a small abi3 wheel and no dependencies (xgrammar, the other candidate, pulls torch,
transformers and triton builds of its own), used by vLLM, SGLang and llama.cpp; its matcher
validates a list of tokens without taking them, takes them, and rolls back any number, which is
what verifying a drafted block and rejecting its tail needs; and its own limits (``LLParserLimits``:
lexer fuel per step, grammar size) bound the work one request's grammar costs a step, so a
hostile schema cannot slow its neighbours. No torch here: the CLI and the Serve parser check a
grammar before any model loads.

What a grammar costs to compile is bounded too (review H-2): bytes bound a grammar's text, not the
time its lexer takes to build (a 62 KB schema of 1,300 `"format": "uri"` fields took 0.6-0.8 s), so
``validate`` times the compile on the calling thread's CPU clock (``compile_seconds``), which the
server holds to a budget (svip_serve/compile_budget.py, `--max-grammar-compile-ms`). A grammar's
verdict is cached by its kind and text, so the replica's second check and a request's n choices
cost a lookup; the workers build their matchers off their compute threads
(svip_runtime/grammar_waits.py)."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

from svip_common.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "regex", "lark")
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar's text at most
MAX_SCHEMA_DEPTH = 32  # a JSON schema's nesting at most (objects and arrays inside each other)
JSON_OBJECT = {"type": "object"}  # json_object: any JSON object
# JSON as OpenAI writes it, one space after each separator and none elsewhere: a model may not pad
# an answer with whitespace until it runs out of tokens (a schema's own "x-guidance" may say otherwise)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of KINDS
    text: str = ""  # json_schema: the schema as JSON; regex: the pattern; lark: the grammar; json_object: ""

    def validate(self) -> None:
        """Bounded and compiling (InvalidRequest names what is wrong); the compile's verdict cached."""
        self.check_bounds()
        problem, _ = _compile_check(self.kind, self.text)
        if problem:
            raise InvalidRequest(f"the {self.kind} does not compile: {problem}")

    def compile_seconds(self) -> float:
        """The CPU seconds its compile took, on the thread that first validated it."""
        return _compile_check(self.kind, self.text)[1]

    def check_bounds(self) -> None:
        """Its kind, size and nesting (no compile: what the workers check on the wire)."""
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"a {self.kind} of {size} bytes; at most {MAX_GRAMMAR_BYTES}")
        if self.kind == "json_object" and self.text:
            raise InvalidRequest("a json_object grammar takes no text")
        if self.kind != "json_object" and not self.text:
            raise InvalidRequest(f"an empty {self.kind}")
        if self.kind == "json_schema":
            _check_schema(self.text)
        if self.kind == "lark" and "%json" in self.text:  # its schema would escape MAX_SCHEMA_DEPTH (L-6)
            raise InvalidRequest("a lark grammar may not embed %json; send the schema as response_format "
                                 "json_schema")

    def compiled(self) -> str:
        """The grammar in llguidance's terms."""
        return _compiled(self.kind, self.text)

    @classmethod
    def of_schema(cls, schema: dict) -> Grammar:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    return LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=256)
def _compile_check(kind: str, text: str) -> tuple[str, float]:
    """What the compiler says of a bounded grammar ("" when it compiles) and the CPU seconds it
    took on this thread (llguidance compiles on the calling thread, the GIL released)."""
    from llguidance import LLMatcher

    started = time.thread_time()
    try:
        problem = LLMatcher.validate_grammar(_compiled(kind, text))
    except (ValueError, RuntimeError) as exc:  # what the compiler refuses before validating
        problem = str(exc) or type(exc).__name__
    seconds = time.thread_time() - started
    return (problem.strip().splitlines()[0][:300] if problem.strip() else ""), seconds


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"the json_schema is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"the json_schema nests too deep; at most {MAX_SCHEMA_DEPTH}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("the json_schema must be a JSON object")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"the json_schema nests {depth} deep; at most {MAX_SCHEMA_DEPTH}")


def _depth(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:  # past the cap the answer is already known
                stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest
