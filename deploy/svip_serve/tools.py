"""Chat's function calling: ``tools`` (OpenAI's function definitions) and ``tool_choice``.

- A named function (or ``required`` with one tool): the answer is forced to be that function's
  arguments, JSON its ``parameters`` schema accepts, through the same grammar path as
  ``response_format`` (svip_common/grammar.py), so it stays exact under speculation.
- ``required`` with several tools: the answer is forced to a JSON array of calls, each
  ``{"name": ..., "parameters": ...}`` for one of the tools (vLLM's way), read out as it streams.
- ``auto`` (the default with tools, as OpenAI's): the model decides; its text is read for calls in
  the deployment's tool-call format (``tool_call_parser``: ``hermes``, the Hermes and Qwen
  templates' tags, or ``llama3_json``, Llama 3.x's JSON; ``none`` refuses ``auto``).
  With a ``response_format`` too, the format masks the text and no call can be written.
- ``none``: the tools go to the chat template only.

The text is only read, never changed (svip_serve/tool_text.py): every token is the target's.
Runs in the Serve replica's request path, before any model work."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar
from svip_common.knobs import TOOL_CALL_PARSERS  # noqa: F401 (the formats auto reads calls in; none: refused)
from svip_serve.tool_text import ArrayCalls, HermesCalls, Llama3Calls, read_all

MAX_TOOLS = 128  # OpenAI's bound on a request's tools
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
ANY_OBJECT = {"type": "object"}  # a function without parameters takes any object
AUTO_READERS = {"hermes": HermesCalls, "llama3_json": Llama3Calls}
MAX_PARALLEL_CALLS = 16  # tool_choice required: calls in one answer at most (one without parallel_tool_calls)


class ToolsError(InvalidRequest):
    """A 400 on the field ``param`` (the parser, svip_serve/protocol.py, answers it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bad(message: str, param: str) -> ToolsError:
    return ToolsError(message, param)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its answer."""

    tools: list[dict]  # for the chat template
    mode: str  # "none", "named", "required" or "auto"
    name: str | None = None  # named: the function called
    grammar: Grammar | None = None  # named and required: what the answer's tokens must follow
    names: tuple[str, ...] = ()  # the functions' names
    parser: str = "hermes"  # auto: the format the model's calls are read in (TOOL_CALL_PARSERS)
    parallel: bool = True  # parallel_tool_calls: false keeps an answer's first call alone (auto too: review I-3)

    def reader(self):
        """A fresh reader of the answer's calls (svip_serve/tool_text.py), or None: the text is
        content (none) or one call's arguments (named)."""
        if self.mode == "auto":
            return AUTO_READERS[self.parser](self.names)
        return ArrayCalls() if self.mode == "required" else None

    def message(self, text: str) -> tuple[dict, bool]:
        """The chat message of a whole answer, and whether the model called (finish_reason tool_calls)."""
        if self.mode == "named":
            call = tool_call(self.name, text, new_call_id())
            return {"role": "assistant", "content": None, "tool_calls": [call]}, False
        reader = self.reader()
        if reader is None:
            return {"role": "assistant", "content": text}, False
        content, calls = read_all(reader, text)
        calls = calls if self.parallel else calls[:1]
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call(c.name, c.arguments, new_call_id()) for c in calls]
        return message, bool(calls)


class CallStream:
    """One choice's answer as a stream's deltas: each piece of text becomes (content, None) or
    (None, tool_calls entries); ``called`` once a call was read (finish_reason tool_calls)."""

    def __init__(self, plan: ToolPlan):
        self._plan, self._reader, self._calls = plan, plan.reader(), 0
        self._named_id = new_call_id() if plan.mode == "named" else None
        self.called = False

    def opening(self) -> list[dict] | None:
        """The first chunk's tool_calls: a named function's call, its arguments to follow."""
        return None if self._named_id is None else [{"index": 0, **tool_call(self._plan.name, "", self._named_id)}]

    def feed(self, text: str) -> list[tuple[str | None, list[dict] | None]]:
        if self._named_id is not None:
            return [(None, [{"index": 0, "function": {"arguments": text}}])]
        return self._told([text] if self._reader is None else self._reader.feed(text))

    def finish(self) -> list[tuple[str | None, list[dict] | None]]:
        return [] if self._reader is None else self._told(self._reader.finish())

    def _told(self, events) -> list[tuple[str | None, list[dict] | None]]:
        out = []
        for event in events:
            if isinstance(event, str):
                out.append((event, None))
                continue
            if self._calls and not self._plan.parallel:
                continue  # parallel_tool_calls false: the first call alone
            out.append((None, [{"index": self._calls, **tool_call(event.name, event.arguments, new_call_id())}]))
            self._calls, self.called = self._calls + 1, True
        return out


def tool_plan(body: dict, parser: str = "hermes") -> ToolPlan | None:
    """The chat request's tools and what its tool_choice makes of them (None: no tools); a 400
    naming the field otherwise. parser: the deployment's tool_call_parser."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    functions = _functions(tools)
    names = tuple(functions)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan(tools, "none", names=names)
    if choice == "auto":
        if parser == "none":
            raise bad("'tool_choice' 'auto' needs the deployment's tool_call_parser (it is 'none'): name a function, "
                      "send 'required' or 'none'", "tool_choice")
        return ToolPlan(tools, "auto", names=names, parser=parser, parallel=parallel)
    if choice == "required" and len(functions) > 1:
        schema = _calls_schema(functions, MAX_PARALLEL_CALLS if parallel else 1)
        grammar = _checked(Grammar.of_schema(schema), "the tools")
        return ToolPlan(tools, "required", grammar=grammar, names=names)
    name = _chosen(choice, functions)
    schema = functions[name].get("parameters", ANY_OBJECT)
    grammar = _checked(Grammar.of_schema(schema), f"the parameters of tool {name!r}")
    return ToolPlan(tools, "named", name=name, grammar=grammar, names=names)


def _calls_schema(functions: dict[str, dict], most: int) -> dict:
    """tool_choice required: a JSON array of one to ``most`` calls, each one of the functions'."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f.get("parameters", ANY_OBJECT)},
              "required": ["name", "parameters"], "additionalProperties": False} for name, f in functions.items()]
    return {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": calls}}


def _checked(grammar: Grammar, what: str) -> Grammar:
    try:
        grammar.validate()
    except InvalidRequest as exc:
        raise bad(f"{what}: {exc}", "tools") from None
    return grammar


def finish_reason(reason: str, called: bool) -> str:
    """A choice's finish_reason: "tool_calls" where the model called (its text ended as text would), as OpenAI's."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _functions(tools) -> dict[str, dict]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be an array of at most {MAX_TOOLS} function definitions", "tools")
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a name "
                      "of 1 to 64 letters, digits, '_' or '-'", "tools")
        if name in out:
            raise bad(f"tools[{i}] repeats the function name {name!r}", "tools")
        if not isinstance(function.get("parameters", ANY_OBJECT), dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = function
    if len(json.dumps(tools)) > 4 * 64 * 1024:  # every schema bounded again when its grammar is made
        raise bad("'tools' is too large", "tools")
    return out


def _chosen(choice, functions: dict[str, dict]) -> str:
    if choice == "required":  # with one tool
        return next(iter(functions))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in functions:
            return name
        raise bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    raise bad("'tool_choice' must be 'auto', 'none', 'required' or name a function "
              "({\"type\": \"function\", \"function\": {\"name\": ...}})", "tool_choice")
