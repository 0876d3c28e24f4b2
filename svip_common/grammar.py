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
grammar before any model loads."""

from __future__ import annotations

import json
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
        """Bounded and compiling (InvalidRequest names what is wrong)."""
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
        from llguidance import LLMatcher

        try:
            problem = LLMatcher.validate_grammar(self.compiled())
        except (ValueError, RuntimeError) as exc:  # what the compiler refuses before validating
            problem = str(exc) or type(exc).__name__
        if problem:
            raise InvalidRequest(f"the {self.kind} does not compile: {problem.strip().splitlines()[0][:300]}")

    def compiled(self) -> str:
        """The grammar in llguidance's terms."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        return LLMatcher.grammar_from_lark(self.text)

    @classmethod
    def of_schema(cls, schema: dict) -> Grammar:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


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
