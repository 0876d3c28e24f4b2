"""Chat's function calling, where the client names the function: ``tools`` (OpenAI's function
definitions) and ``tool_choice`` naming one of them (or ``required`` with exactly one) force the
answer to be that function's arguments, JSON its ``parameters`` schema accepts, through the same
grammar path as ``response_format`` (svip_common/grammar.py), so it stays exact under
speculation; the answer comes back as the message's ``tool_calls``. ``tool_choice`` ``none``
passes the tools to the chat template only. ``auto`` (the model deciding whether to call one) is
refused by name: that needs the model's own tool-call format parsed from free text, which this
server does not do. Runs in the Serve replica's request path, before any model work."""

from __future__ import annotations

import json
import re
import uuid

from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar

MAX_TOOLS = 128  # OpenAI's bound on a request's tools
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
ANY_OBJECT = {"type": "object"}  # a function without parameters takes any object


class ToolsError(InvalidRequest):
    """A 400 on the field ``param`` (the parser, svip_serve/protocol.py, answers it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bad(message: str, param: str) -> ToolsError:
    return ToolsError(message, param)


def forced_tool(body: dict) -> tuple[list[dict] | None, str | None, Grammar | None]:
    """The chat request's tools (as the chat template takes them), the function it forces (None:
    none), and that function's arguments as a grammar; a 400 naming the field otherwise."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None, None, None
    functions = _functions(tools)
    if choice == "none":
        return tools, None, None
    name = _chosen(choice, functions)
    schema = functions[name].get("parameters", ANY_OBJECT)
    grammar = Grammar.of_schema(schema)
    try:
        grammar.validate()
    except InvalidRequest as exc:
        raise bad(f"the parameters of tool {name!r}: {exc}", "tools") from None
    return tools, name, grammar


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
    if choice == "required" and len(functions) == 1:
        return next(iter(functions))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in functions:
            return name
        raise bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    raise bad("'tool_choice' must name a function ({\"type\": \"function\", \"function\": {\"name\": ...}}), be "
              "'none', or 'required' with one tool; 'auto' (the model deciding) is not supported by this server",
              "tool_choice")
