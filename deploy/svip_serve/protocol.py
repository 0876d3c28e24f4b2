"""The OpenAI request and response shapes: one validating parser per endpoint, turning a JSON
body into an ApiRequest or an ApiError that names the field at fault, and the builders of
completion, chat and streaming-chunk bodies. Nothing here touches models or Ray."""

from __future__ import annotations

import json
import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace

from svip_common.contracts import (
    INT32_MAX,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    POLICY_NAMES,
    PolicyConfig,
    SamplingParams,
)
from svip_common.errors import InvalidRequest
from svip_common.grammar import Grammar
from svip_common.trees import TREES
from svip_serve.tools import MAX_TOOLS, ToolPlan, ToolsError, finish_reason, tool_plan

MAX_STOP_STRINGS = 16
MAX_MESSAGES = 1024  # a chat's messages: each costs the template's own tokens, content or not
MESSAGE_CHARS = 16  # what a message counts for besides its strings (the template's tokens around it)
MAX_STOP_CHARS = 256  # each stop string: the text matcher holds back at most this many characters
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CACHE_SALT = 256  # a request's cache_salt, in characters (it is hashed into the sharing scope)


class ApiError(Exception):
    """A request the server refuses, as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class ApiRequest:
    kind: str  # "completion" or "chat"
    model: str | None
    prompt: str | list[int] | None = None  # completions
    messages: list[dict] | None = None  # chat
    max_tokens: int | None = None  # None: the deployment's default_max_tokens, within the context (chat)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's extension: ids that end the output, as the model's EOS
    stream: bool = False
    include_usage: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ignore_eos: bool = False
    n: int = 1  # choices of the prompt: choice i is the request alone with seed sample_seed(seed, i)
    logprobs: int | None = None  # the target's logprob of each token and this many top ones (None: none)
    echo: bool = False  # completions: the prompt's text (and with logprobs, its tokens' logprobs) first
    tools: ToolPlan | None = None  # chat: the function definitions and what tool_choice makes of the answer
    cache_salt: str | None = None  # vLLM's: requests share KV pages only with requests of the same salt (and key)


# --- the body ------------------------------------------------------------------------------------

def parse_json(raw: bytes):
    """The request body as JSON, or a 400 that says what is wrong with it: not JSON, nested too
    deeply, a number too long to read, a string that is not Unicode (a lone surrogate)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except ValueError:  # Python reads at most 4300 digits of an integer
        raise bad("a number in the request body is too long to read") from None
    if _SURROGATE_ESCAPE.search(raw) is not None and (where := _lone_surrogate(body)) is not None:
        param = None if where.startswith(("a key", "the request")) else where.split("[")[0].split(".")[0]
        raise bad(f"{where} is not valid Unicode (a lone surrogate)", param)
    return body


# UTF-8 cannot carry a surrogate, so one can only come from a \\uD800-\\uDFFF escape: without one
# in the raw body, nothing needs walking
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value) -> str | None:
    """Where the first string with an unpaired surrogate is (JSON admits \\ud800), or None. The
    walk builds no paths; the one path reported is found again only when there is one."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return _path_to(value, item)
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_to(value, target: str, path: str = "") -> str | None:
    """The path of the string `target` (by identity) inside value, as the error names it."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if item is target:
            return where or "the request body"
        if isinstance(item, dict):
            stack += [(k, where or "a key") for k in item]
            stack += [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(item)]
    return "the request body"


# --- field readers: each names the field and the type it wanted ---------------------------------

def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {_shown(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number", name)
    return value


def _integer(body: dict, name: str, default: int | None, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX) -> int | None:
    """An integer in [lo, hi] (int32 unless told otherwise: integer fields travel as int32)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_shown(value)}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be in [{_power(lo)}, {_power(hi + 1)}), got {_shown_int(value)}", name)
    return value


def _power(n: int) -> str:
    """2^31 for 2147483648: bounds as people write them."""
    sign, m = ("-", -n) if n < 0 else ("", n)
    return f"{sign}2^{m.bit_length() - 1}" if m > 1024 and m & (m - 1) == 0 else str(n)


def _shown_int(value: int) -> str:
    return str(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {_shown(value)}", name)
    return value


def _shown(value) -> str:
    names = {bool: "boolean", str: "string", list: "array", dict: "object", int: "integer", float: "number",
             type(None): "null"}
    kind = names.get(type(value), type(value).__name__)
    return kind if isinstance(value, (list, dict, type(None))) else f"{kind} {value!r}"


# --- the parameters both endpoints share ---------------------------------------------------------

def _common(body: dict, kind: str, defaults: PolicyConfig) -> ApiRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_shown(model)}", "model")
    n = _integer(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
    best_of = _integer(body, "best_of", 1)
    if best_of != 1:
        raise bad(f"'best_of' must be 1, got {best_of}", "best_of")
    _refuse_unsupported(body, kind)
    echo = _echo(body, kind)
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1) if kind == "chat" else None
    max_tokens = _integer(body, "max_tokens", max_tokens, lo=0 if echo else 1)  # 0: score the prompt alone
    if kind == "completion" and max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"'temperature' must be >= 0 (0 is greedy), got {temperature:g}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p:g}", "top_p")
    top_k = _integer(body, "top_k", 0, lo=0)  # 0 disables it
    seed = _integer(body, "seed", None, lo=0, hi=2**63 - 1)
    if seed is None:
        seed = secrets.randbelow(2**31)
    knobs = {name: _number(body, name, 0.0) for name in ("presence_penalty", "frequency_penalty")}
    knobs["repetition_penalty"] = _number(body, "repetition_penalty", 1.0)
    knobs["logit_bias"] = _logit_bias(body.get("logit_bias"))
    for name, value in knobs.items():  # their bounds: SamplingParams.validate, named as the field
        _within_bounds(name, SamplingParams(**{name: value}))
    sampling = SamplingParams(temperature, top_k, top_p, seed, **knobs,
                              min_tokens=_integer(body, "min_tokens", 0, lo=0), grammar=_grammar(body))
    policy = _policy(body, defaults)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad(f"'stream_options' must be an object, got {_shown(stream_options)}", "stream_options")
    return ApiRequest(
        kind=kind,
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        stream=_boolean(body, "stream", False),
        include_usage=_boolean(stream_options, "include_usage", False),
        policy=policy,
        ignore_eos=_boolean(body, "ignore_eos", False),
        n=n,
        logprobs=_logprobs(body, kind),
        echo=echo,
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: a non-empty string of at most MAX_CACHE_SALT characters (None: not sent)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
        shown = f"{len(salt)} characters" if isinstance(salt, str) else _shown(salt)
        raise bad(f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters, got {shown}", "cache_salt")
    return salt


def _echo(body: dict, kind: str) -> bool:
    """Completions' echo: the prompt first (a scoring request: with logprobs and max_tokens 0)."""
    if kind == "chat":
        if body.get("echo") not in (None, False):
            raise bad("'echo' is a completions parameter; chat does not take it", "echo")
        return False
    return _boolean(body, "echo", False)


def _logprobs(body: dict, kind: str) -> int | None:
    """Completions: ``logprobs`` N, the top N per token besides the token's own (0 included).
    Chat: ``logprobs`` true, and ``top_logprobs`` N (0 unless sent; only with logprobs)."""
    if kind == "completion":
        return _integer(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if not _boolean(body, "logprobs", False):
        if top is not None:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _within_bounds(name: str, params: SamplingParams) -> None:
    try:
        params.validate()
    except InvalidRequest as exc:
        raise bad(str(exc), name) from None


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (as strings) to numbers, read (its bounds:
    SamplingParams.validate; its ids against the model's vocabulary: when the request is shaped).
    The entries are counted before they are read."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad(f"'logit_bias' must be an object from token ids to numbers, got {_shown(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX):
            raise bad(f"'logit_bias' keys must be token ids, got {_shown(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad(f"'logit_bias' values must be numbers, got {_shown(bias)}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Parameters that would change the output: refused rather than silently ignored (chat's
    tools: svip_serve/tools.py)."""
    for name in ("suffix", "functions", *(("tools", "tool_choice") if kind == "completion" else ())):
        value = body.get(name)
        if value not in (None, False, 0, "", [], {}):
            raise bad(f"'{name}' is not supported by this server", name)


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "lark"}  # vLLM's extra fields


def _grammar(body: dict) -> Grammar | None:
    """Structured output: OpenAI's response_format (text, json_object, json_schema) or one of
    vLLM's guided_json / guided_regex / guided_grammar (Lark), at most one; bounded and compiled
    here (svip_common/grammar.py), a 400 naming the field otherwise."""
    given = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise bad(f"at most one of response_format, {', '.join(GUIDED)}; got {', '.join(given)}", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    grammar = _response_format(value) if name == "response_format" else _guided(name, value)
    if grammar is not None:
        try:
            grammar.validate()
        except InvalidRequest as exc:
            raise bad(str(exc), name) from None
    return grammar


def _response_format(value) -> Grammar | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {_shown(value)}", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return Grammar("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be an object with a 'schema' object", "response_format")
    return Grammar.of_schema(spec.get("schema", {}))


def _guided(name: str, value) -> Grammar:
    if name == "guided_json":
        if isinstance(value, str):
            return Grammar("json_schema", value)
        if not isinstance(value, dict):
            raise bad(f"'guided_json' must be a JSON schema (an object, or one as a string), got {_shown(value)}", name)
        return Grammar.of_schema(value)
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string, got {_shown(value)}", name)
    return Grammar(GUIDED[name], value)


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"'stop' must be a string or an array of strings, got {_shown(value)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if (longest := max((len(s) for s in stops), default=0)) > MAX_STOP_CHARS:
        raise bad(f"each 'stop' string is at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop")
    return tuple(s for s in stops if s)


def _stop_token_ids(value) -> tuple[int, ...]:
    """At most MAX_STOP_TOKEN_IDS ids (within the vocabulary: when the request is shaped)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(f"'stop_token_ids' must be an array of token ids, got {_shown(value)}", "stop_token_ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise bad(f"'stop_token_ids' holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}", "stop_token_ids")
    if any(not 0 <= t <= INT32_MAX for t in value):
        raise bad(f"'stop_token_ids' must be token ids in [0, 2^31), got {_shown(value)}", "stop_token_ids")
    return tuple(value)


def _policy(body: dict, defaults: PolicyConfig) -> PolicyConfig:
    """Extension parameters (send them with the OpenAI client's extra_body); the deployment's
    defaults where a request gives none."""
    name = body.get("policy") or defaults.name
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise bad(f"'policy' must be one of {', '.join(POLICY_NAMES)}, got {_shown(name)}", "policy")
    threshold = body.get("threshold")
    if threshold is None:
        threshold = defaults.threshold
    elif threshold != "auto":
        threshold = _number(body, "threshold", defaults.threshold)
    tree = body.get("tree", defaults.tree)
    if not isinstance(tree, str) or tree not in TREES:
        raise bad(f"'tree' must be one of {', '.join(TREES)}, got {_shown(tree)}", "tree")
    policy = PolicyConfig(
        name=name,
        threshold=threshold,
        entropy_scale=_number(body, "entropy_scale", defaults.entropy_scale),
        draft_length=_integer(body, "draft_length", defaults.draft_length, lo=1),
        max_draft_length=_integer(body, "max_draft_length", defaults.max_draft_length, lo=1),
        confidence=_number(body, "confidence", defaults.confidence),
        tree=tree,
    )
    return policy


# --- endpoints ------------------------------------------------------------------------------------

def parse_completion(body, defaults: PolicyConfig = PolicyConfig()) -> ApiRequest:
    request = _common(body, "completion", defaults)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt")
    request.prompt = _prompt(body["prompt"])
    return request


def rendered_chars(messages: list[dict], tools: list[dict] | None = None) -> int:
    """What a chat's messages (and its tools) put through the template, in characters: every value
    in them, strings and the rest as JSON writes them (a past call's arguments render with
    `tojson`: a 2 MB array of numbers once counted 81 characters and tokenized to 2,000,044 ids,
    review M-3), and MESSAGE_CHARS a message for the template's own text around it (20,000 empty
    messages once counted 0 and tokenized to 100,006 ids)."""
    return sum(MESSAGE_CHARS + _value_chars(m) for m in messages) + _value_chars(tools or [])


def _value_chars(value) -> int:
    """A value's characters as a template renders it: a string's own, a number's as JSON writes
    it, a container's items and one separator each (iteratively: no recursion limit)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            total += 1 + len(item)
            stack.extend(item)
        else:
            total += len(json.dumps(item))
    return total


def _prompt(value) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0])  # a batch of one
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad(f"'prompt' holds {len(value)} prompts; send one prompt per request", "prompt")
    raise bad(f"'prompt' must be a string or an array of token ids, got {_shown(value)}", "prompt")


def parse_chat(body, defaults: PolicyConfig = PolicyConfig(), tool_parser: str = "hermes") -> ApiRequest:
    """tool_parser: the format tool_choice auto reads calls in (the deployment's tool_call_parser)."""
    request = _common(body, "chat", defaults)
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"'messages' holds at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        if msg["role"] == "assistant" and "tool_calls" in msg:
            msg["tool_calls"] = _past_calls(msg["tool_calls"], i)
            msg["content"] = "" if msg.get("content") is None else _content(msg["content"], i)
        else:
            msg["content"] = _content(msg.get("content"), i)
    request.messages = messages
    try:
        request.tools = tool_plan(body, tool_parser)
    except ToolsError as exc:
        raise bad(str(exc), exc.param) from None
    arguments = None if request.tools is None else request.tools.grammar
    if arguments is not None:
        if request.sampling.grammar is not None:
            raise bad("a forced 'tool_choice' sets the answer's format: send it without response_format or "
                      "guided_*", "tool_choice")
        request.sampling = replace(request.sampling, grammar=arguments)
    return request


def _past_calls(calls, i: int) -> list[dict]:
    """An assistant message's earlier tool calls, their arguments as objects (as chat templates
    render them); a 400 for any that is not a function call with a name and JSON object arguments."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise bad(f"{where} must be an array of at most {MAX_TOOLS} tool calls", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(parsed, dict):
            raise bad(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": "
                      "a JSON object}}}", "messages")
        out.append({**call, "function": {**function, "arguments": parsed}})
    return out


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(_is_text_part(p) for p in value):
        return "".join(p["text"] for p in value)
    raise bad(f"messages[{i}].content must be a string or an array of text parts", "messages")


# --- responses ------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choices_body(kind: str, rid: str, model: str, choices: list[tuple[str, str, dict, dict | None]],
                 usage_: dict, tools: ToolPlan | None = None) -> dict:
    """choices: (text, finish_reason, svip stats, logprobs field) each, in index order; the
    top-level `svip` is the first's, and with several each choice carries its own. tools: what a
    chat's tools make of its text (calls read out of it: svip_serve/tools.py)."""
    out = []
    for index, (text, reason, svip, logprobs) in enumerate(choices):
        if kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        else:
            message, called = ({"role": "assistant", "content": text}, False) if tools is None else tools.message(text)
            choice = {"index": index, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason(reason, called)}
        if len(choices) > 1:
            choice["svip"] = svip
        out.append(choice)
    return {
        "id": rid,
        "object": "text_completion" if kind == "completion" else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage_,
        "svip": choices[0][2],
    }


def chunk_body(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
    calls: list[dict] | None = None,
) -> dict:
    """calls: the delta's tool_calls (svip_serve/tools.py's stream), in place of text."""
    if kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {"tool_calls": calls} if calls else ({} if text is None else {"content": text})
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, created: int, usage_: dict, svip: dict) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_, "svip": svip}


def _is_text_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
