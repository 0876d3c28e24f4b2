"""The OpenAI request parser names the field at fault; admission refuses past its limits and
frees places however a request ends; app settings are checked before anything starts."""

from __future__ import annotations

import asyncio
import json

import pytest

from svip_common.contracts import PolicyConfig
from svip_common.errors import InvalidRequest
from svip_serve.admission import Admission
from svip_serve.prompting import chat_prompt_ids
from svip_serve.protocol import ApiError, parse_chat, parse_completion
from svip_serve.settings import ServeSettings

BASE = {"model": "m", "prompt": "def f():"}


def test_completion_defaults_follow_openai():
    req = parse_completion(dict(BASE))
    assert req.max_tokens == 16 and req.sampling.temperature == 1.0 and req.sampling.top_p == 1.0
    assert req.stop == () and not req.stream and req.policy == PolicyConfig()


def test_extension_parameters_and_deployment_defaults():
    defaults = PolicyConfig(name="heuristic", threshold=0.5)
    assert parse_completion(dict(BASE), defaults).policy.name == "heuristic"
    req = parse_completion({**BASE, "policy": "svip", "threshold": 0.8, "top_k": 5, "stop": "\n\n"}, defaults)
    assert req.policy.name == "svip" and req.policy.threshold == 0.8
    assert req.sampling.top_k == 5 and req.stop == ("\n\n",)


def test_logit_bias_is_read_as_openai_sends_it():
    req = parse_completion({**BASE, "logit_bias": {"50256": -100, "7": 2.5}})
    assert req.sampling.logit_bias == ((50256, -100.0), (7, 2.5))
    assert parse_completion(dict(BASE)).sampling.logit_bias == ()


@pytest.mark.parametrize("value, words", [
    ([1, 2], "must be an object"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
    ({"x": 1}, "keys must be token ids"),
    ({"-5": 1}, "keys must be token ids"),
    ({"99999999999": 1}, "keys must be token ids"),
    ({"5": "a"}, "values must be numbers"),
    ({"5": True}, "values must be numbers"),
    ({"5": 100.5}, "must be in \\[-100, 100\\]"),
    ({"5": 1, "05": 2}, "twice"),
])
def test_a_bad_logit_bias_is_a_400_that_names_it(value, words):
    with pytest.raises(ApiError, match=words) as err:
        parse_completion({**BASE, "logit_bias": value})
    assert err.value.status == 400 and err.value.param == "logit_bias"


def test_a_deployments_default_tree_is_every_requests_unless_it_names_one():
    """A request's `tree` overrides the deployment's; the default applies to greedy and sampled
    requests alike (a sampled tree's q rows cross the workers)."""
    defaults = PolicyConfig(name="svip", threshold=0.4, tree="cape")
    assert parse_completion({**BASE, "temperature": 0}, defaults).policy.tree == "cape"
    assert parse_completion({**BASE, "temperature": 0, "tree": "auto"}, defaults).policy.tree == "auto"
    assert parse_completion({**BASE, "temperature": 0.8}, defaults).policy.tree == "cape"
    assert parse_completion({**BASE, "temperature": 0.8, "tree": "off"}, defaults).policy.tree == "off"


@pytest.mark.parametrize("patch, param, words", [
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": 7}, "prompt", "string or an array of token ids"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"max_tokens": 0}, "max_tokens", "[1, 2^31), got 0"),
    ({"max_tokens": -3}, "max_tokens", "[1, 2^31)"),
    ({"max_tokens": 2**31}, "max_tokens", "[1, 2^31), got 2147483648"),
    ({"top_k": 2**40}, "top_k", "[0, 2^31)"),
    ({"draft_length": 10**400}, "draft_length", "got an integer of 401 digits"),
    ({"threshold": 10**400}, "threshold", "finite number"),
    ({"max_tokens": "10"}, "max_tokens", "must be an integer"),
    ({"max_tokens": True}, "max_tokens", "must be an integer"),
    ({"temperature": -0.5}, "temperature", ">= 0"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"n": 9}, "n", "must be in [1, 8]"),
    ({"n": 0}, "n", "must be in [1, 8]"),
    ({"seed": -1}, "seed", "[0, 2^63)"),
    ({"seed": 2**64}, "seed", "[0, 2^63)"),
    ({"stop": 3}, "stop", "string or an array of strings"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"model": 5}, "model", "must be a string"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 21)"),
    ({"logprobs": True}, "logprobs", "must be an integer"),
    ({"echo": "yes"}, "echo", "must be true or false"),
    ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "must be in [-2, 2]"),
    ({"min_tokens": -1}, "min_tokens", "must be in [0, 2^31)"),
    ({"repetition_penalty": 0}, "repetition_penalty", "must be in (0, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "must be in (0, 2]"),
    ({"policy": "fastest"}, "policy", "must be one of"),
    ({"tree": "deepest"}, "tree", "must be one of off, cape, auto, deep, deep-auto"),
    ({"tree": ["cape"] * 10**5}, "tree", "must be one of"),
])
def test_bad_completion_fields_name_the_field(patch, param, words):
    body = {**BASE, **patch}
    if body["prompt"] is None:
        del body["prompt"]
    with pytest.raises(ApiError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(ApiError, match="JSON object"):
        parse_completion([1, 2])


@pytest.mark.parametrize("messages, words", [
    (None, "required"), ([], "non-empty array"), (["hi"], "string 'role'"),
    ([{"role": "user", "content": 5}], "content must be a string"),
])
def test_bad_chat_messages(messages, words):
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    with pytest.raises(ApiError, match=words):
        parse_chat(body)


def test_chat_text_parts_are_joined_and_max_completion_tokens_read():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 9})
    assert req.messages[0]["content"] == "ab" and req.max_tokens == 9


def test_a_model_without_chat_template_is_a_400(models):
    tokenizer = models["target"].tokenizer
    assert not getattr(tokenizer, "chat_template", None)
    with pytest.raises(ApiError) as err:
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], "tiny")
    assert err.value.status == 400 and "no chat template" in err.value.message


def test_admission_refuses_past_in_flight_plus_waiting():
    async def scenario():
        adm = Admission(max_in_flight=1, max_waiting=1)
        first, second = adm.reserve(), adm.reserve()
        with pytest.raises(ApiError) as err:
            adm.reserve()
        assert err.value.status == 429 and err.value.headers["Retry-After"]
        async with first:
            assert (adm.running, adm.waiting) == (1, 1)
            waiter = asyncio.ensure_future(second.__aenter__())
            await asyncio.sleep(0)
            assert not waiter.done()  # waits for the slot
        await waiter
        assert (adm.running, adm.waiting) == (1, 0)
        second.release()
        second.release()  # idempotent
        assert (adm.running, adm.waiting) == (0, 0)
        gone = adm.reserve()
        gone.release()  # a client that left before its stream started frees its place
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("args, words", [
    ({"nonsense": 1}, "unknown app argument"),
    ({"device": "tpu"}, "device must be"),
    ({"target": "/m"}, "needs a draft"),
    ({"target": "/m", "draft": "eagle"}, "the embedded target's feature head"),
    ({"device": "cuda:1"}, "take their GPUs from Ray"),
    ({"max_in_flight": 10**6}, r"max_in_flight must be an integer in \[1, 4096\]"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"policy": "x"}, "policy must be"),
    ({"threshold": -1}, "threshold"),
    ({"worker_restarts": -1}, "worker_restarts"),
    ({"worker_restarts": 2.5}, "worker_restarts"),
    ({"draft_stall_s": 0}, "draft_stall_s"),
    ({"draft_stall_s": 1e9}, "draft_stall_s"),
    ({"sampled_hold_s": -1}, "sampled_hold_s"),
    ({"sampled_hold_s": float("inf")}, "sampled_hold_s"),
    ({"default_max_tokens": 0}, "default_max_tokens"),
    ({"default_max_tokens": 2.5}, "default_max_tokens"),
    ({"max_wait_s": 0}, "max_wait_s"),
    ({"max_wait_s": float("inf")}, "max_wait_s"),
    ({"body_read_timeout_s": -1}, "body_read_timeout_s"),
    ({"max_requests_per_key": -1}, "max_requests_per_key"),
    ({"allow_ignore_eos": "yes"}, "allow_ignore_eos"),
    ({"idle_prefill": "sometimes"}, "idle_prefill must be one of"),
    ({"draft_parallel": 0}, "draft_parallel must be an integer in"),
    ({"tool_call_parser": "mistral"}, "tool_call_parser must be one of hermes, llama3_json, none"),
    ({"draft_parallel": 1_000_000}, "draft_parallel must be an integer in"),
    ({"health_check_period_s": 0}, "health_check_period_s"),
    ({"api_key_sha256": ["short-key"]}, "SHA-256 digests"),
])
def test_bad_app_arguments(args, words):
    with pytest.raises(InvalidRequest, match=words):
        ServeSettings.from_args(args)


def test_placement_bundles():
    cpu = ServeSettings.from_args({})
    assert cpu.bundles()[1:] == [{"CPU": 1.0}, {"CPU": 1.0}]
    gpu = ServeSettings.from_args({"target": "t", "draft": "d", "device": "cuda", "target_gpus": 2})
    assert gpu.bundles()[1:] == [{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]
    alone = ServeSettings.from_args({"target": "t", "draft": "none", "device": "cuda"})
    assert len(alone.bundles()) == 2 and alone.served_name == "t"


def test_the_served_name_is_never_a_filesystem_path(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    assert ServeSettings.from_args({"target": str(model), "draft": "none"}).served_name == "my-model"
    assert ServeSettings.from_args({"target": "Qwen/Qwen2.5-7B", "draft": "none"}).served_name == "Qwen/Qwen2.5-7B"
    assert ServeSettings.from_args({}).served_name == "svip-pair"
    named = ServeSettings.from_args({"api_key_sha256": ["ops:" + "a" * 64, "b" * 64]})
    assert named.api_key_sha256 == ("ops:" + "a" * 64, "b" * 64)


@pytest.mark.parametrize("patch, expected", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_logprobs_and_top_logprobs(patch, expected):
    req = parse_chat({"messages": [{"role": "user", "content": "a"}], **patch})
    assert req.logprobs == expected


@pytest.mark.parametrize("patch, words", [
    ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "must be in [0, 21)"),
    ({"logprobs": 3}, "must be true or false"),
])
def test_bad_chat_logprobs_name_the_field(patch, words):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [{"role": "user", "content": "a"}], **patch})
    assert err.value.status == 400 and words in err.value.message


def test_completion_logprobs_are_the_top_count():
    assert parse_completion({**BASE, "logprobs": 5}).logprobs == 5
    assert parse_completion(BASE).logprobs is None


def test_echo_is_for_completions_and_lets_max_tokens_be_zero():
    req = parse_completion({**BASE, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert req.echo and req.max_tokens == 0 and req.logprobs == 1
    assert parse_completion({**BASE, "echo": True, "stream": True}).echo  # streamed: the prompt's chunk first
    assert parse_completion({**BASE, "echo": True, "stream": True, "logprobs": 1}).echo  # with its logprobs
    for body, param, words in [
        ({**BASE, "max_tokens": 0}, "max_tokens", "must be in [1, "),
    ]:
        with pytest.raises(ApiError) as err:
            parse_completion(body)
        assert err.value.param == param and words in err.value.message
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [{"role": "user", "content": "a"}], "echo": True})
    assert err.value.param == "echo" and "chat does not take it" in err.value.message


def test_structured_output_fields_become_the_requests_grammar():
    """OpenAI's response_format and vLLM's guided_* fields, each as the grammar it names."""
    from svip_common.grammar import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Grammar("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         Grammar.of_schema(schema)),
        ({"guided_json": schema}, Grammar.of_schema(schema)),
        ({"guided_json": '{"type": "integer"}'}, Grammar("json_schema", '{"type": "integer"}')),
        ({"guided_regex": "[0-9]+"}, Grammar("regex", "[0-9]+")),
        ({"guided_grammar": 'start: "a"'}, Grammar("lark", 'start: "a"')),
    ]
    for patch, grammar in cases:
        assert parse_completion({**BASE, **patch}).sampling.grammar == grammar, patch
        assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **patch}).sampling.grammar \
            == grammar


DEEP = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array", "items": {}}}}}
for _ in range(13):
    DEEP = {"type": "object", "properties": {"a": DEEP}}  # alone it nests 31 deep; among the calls, past 32
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}


def test_a_named_tool_choice_forces_its_functions_arguments():
    from svip_common.grammar import Grammar

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        req = parse_chat({**CHAT_BODY, "tools": TOOLS, "tool_choice": choice})
        assert (req.tools.mode, req.tools.name, req.tools.tools) == ("named", "get_weather", TOOLS)
        assert req.sampling.grammar == Grammar.of_schema(TOOLS[0]["function"]["parameters"])
    req = parse_chat({**CHAT_BODY, "tools": TOOLS, "tool_choice": "none"})  # the template sees them; no call
    assert (req.tools.mode, req.sampling.grammar, req.tools.tools) == ("none", None, TOOLS)


def test_auto_is_the_default_with_tools_and_leaves_the_tokens_free():
    for body in ({**CHAT_BODY, "tools": TOOLS}, {**CHAT_BODY, "tools": TOOLS, "tool_choice": "auto"}):
        req = parse_chat(body)
        assert (req.tools.mode, req.tools.names, req.sampling.grammar) == ("auto", ("get_weather",), None)
    req = parse_chat({**CHAT_BODY, "tools": TOOLS, "response_format": {"type": "json_object"}})
    assert req.tools.mode == "auto" and req.sampling.grammar.kind == "json_object"  # the format wins


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]


def test_required_with_several_tools_forces_an_array_of_their_calls():
    from llguidance import LLMatcher

    req = parse_chat({**CHAT_BODY, "tools": TWO_TOOLS, "tool_choice": "required"})
    assert req.tools.mode == "required" and req.tools.names == ("get_weather", "get_time")
    schema = json.loads(req.sampling.grammar.text)
    assert schema["maxItems"] == 16 and len(schema["items"]["anyOf"]) == 2
    one = parse_chat({**CHAT_BODY, "tools": TWO_TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(one.sampling.grammar.text)["maxItems"] == 1
    matcher = LLMatcher.validate_grammar(req.sampling.grammar.compiled())
    assert not matcher  # compiles


def test_past_tool_calls_and_results_go_to_the_template():
    """An agent's next turn: the assistant's calls (content null, arguments a JSON string) and the
    tool's result; the template gets the arguments as an object, as chat templates render them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    req = parse_chat({**CHAT_BODY, "messages": messages, "tools": TOOLS})
    assert req.messages[1]["content"] == "" and req.messages[1]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Oslo"}


@pytest.mark.parametrize("calls", [
    "x", [{"type": "function", "function": {"name": "f", "arguments": "not json"}}],
    [{"type": "function", "function": {"arguments": "{}"}}], [{"type": "function"}], ["f"],
    [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
    [{"type": "function", "function": {"name": "f", "arguments": "{}"}}] * 129,
])
def test_bad_past_tool_calls_are_a_400(calls):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(ApiError, match=r"messages\[1\]\.tool_calls") as err:
        parse_chat({**CHAT_BODY, "messages": messages})
    assert err.value.status == 400 and err.value.param == "messages"


def test_auto_reads_calls_in_the_deployments_format():
    assert parse_chat({**CHAT_BODY, "tools": TOOLS}, tool_parser="llama3_json").tools.parser == "llama3_json"
    assert parse_chat({**CHAT_BODY, "tools": TOOLS}).tools.parser == "hermes"


def test_auto_is_refused_by_name_where_the_deployment_reads_no_calls():
    with pytest.raises(ApiError, match="tool_call_parser") as err:
        parse_chat({**CHAT_BODY, "tools": TOOLS}, tool_parser="none")
    assert err.value.param == "tool_choice"
    required = parse_chat({**CHAT_BODY, "tools": TOOLS, "tool_choice": "required"}, tool_parser="none")
    assert required.tools.mode == "named"


@pytest.mark.parametrize("patch, param, words", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none', 'required'"),
    ({"tools": TWO_TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "true or false"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
    ({"tools": TWO_TOOLS + [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}],
      "tool_choice": "required"}, "tools", "nests"),
    ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools", "repeats the function name"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "not among"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129, "tool_choice": "none"}, "tools", "at most 128"),
    ({"tools": "f", "tool_choice": "none"}, "tools", "an array"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools", "does not compile"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "sets the answer's format"),
    ({"tools": TWO_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "sets the answer's format"),
])
def test_bad_tools_are_a_400_naming_the_field(patch, param, words):
    with pytest.raises(ApiError, match=words) as err:
        parse_chat({**CHAT_BODY, **patch})
    assert err.value.status == 400 and err.value.param == param


def test_tools_on_completions_are_refused():
    with pytest.raises(ApiError, match="'tools' is not supported") as err:
        parse_completion({**BASE, "tools": TOOLS})
    assert err.value.param == "tools"


def test_the_sharing_scope_is_the_keys_and_salts_and_a_lone_requests_where_the_api_is_open():
    """Review H-1: requests of one key (and one salt) share a scope, other keys or salts never; with
    no key every request is a scope of its own; the scope names no key."""
    from svip_serve.auth import sharing_scope

    assert sharing_scope("alice") == sharing_scope("alice") != sharing_scope("bob")
    assert sharing_scope("alice", "s1") == sharing_scope("alice", "s1") != sharing_scope("alice", "s2")
    assert sharing_scope("alice", "s1") != sharing_scope("alice") == sharing_scope("alice", "")
    assert sharing_scope(None) != sharing_scope(None) and sharing_scope(None, "s") != sharing_scope(None, "s")
    assert "alice" not in sharing_scope("alice") and len(sharing_scope("alice")) == 64


def test_worker_stats_are_probed_once_for_calls_at_once_and_within_the_fresh_window():
    from svip_serve.fresh_stats import FreshStats

    class Engine:
        def __init__(self):
            self.calls, self.gate = 0, asyncio.Event()

        async def worker_stats(self):
            self.calls += 1
            await self.gate.wait()
            return {"n": self.calls}

    async def run():
        now = [0.0]
        engine, fresh = Engine(), FreshStats(0.25, clock=lambda: now[0])
        waiters = [asyncio.ensure_future(fresh.get(engine)) for _ in range(50)]
        await asyncio.sleep(0)
        waiters[0].cancel()  # a caller that went away leaves the probe to the others
        await asyncio.sleep(0)
        engine.gate.set()
        answers = await asyncio.gather(*waiters[1:])
        assert engine.calls == 1 and all(a == {"n": 1} for a in answers)
        now[0] = 0.2
        assert await fresh.get(engine) == {"n": 1} and engine.calls == 1
        now[0] = 0.3
        assert await fresh.get(engine) == {"n": 2} and engine.calls == 2

    asyncio.run(run())


def test_a_grammar_past_the_compile_budget_is_refused_by_name_and_a_key_past_its_minute_waits():
    """Review H-2: the replica holds a grammar to its compile time (not only its bytes) and a key to
    its parse time a minute; other keys go on. Deterministic: budgets of zero and of an hour."""
    from svip_serve.compile_budget import KEY_BUDGETS, CompileBudget

    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "format": "uri"} for i in range(40)}}
    body = {**BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    with pytest.raises(ApiError) as err:
        CompileBudget(0.0).parse("alice", parse_completion, body)
    assert err.value.status == 400 and err.value.param == "response_format"
    assert "to compile; this deployment allows 0 ms" in err.value.message
    assert parse_completion(body).sampling.grammar.compile_seconds() > 0  # timed once, cached since
    assert CompileBudget(3600.0).parse("alice", parse_completion, body).sampling.grammar is not None
    now = [0.0]
    budget = CompileBudget(0.5, clock=lambda: now[0])
    budget._charge("alice", KEY_BUDGETS * 0.5 + 1)  # a minute's worth spent, and a second more
    with pytest.raises(ApiError) as err:
        budget.parse("alice", parse_completion, dict(BASE))
    assert err.value.status == 429 and err.value.code == "parse_budget" and "Retry-After" in err.value.headers
    assert budget.parse("bob", parse_completion, dict(BASE)).prompt == BASE["prompt"]  # another key goes on
    now[0] = 60.0  # a minute later the spend has drained
    assert budget.parse("alice", parse_completion, dict(BASE)).prompt == BASE["prompt"]


def test_a_lark_grammar_may_not_embed_json_past_the_schema_bounds():
    """Review L-6: Lark's %json would carry a schema past MAX_SCHEMA_DEPTH; requests send schemas as
    response_format instead."""
    with pytest.raises(ApiError, match="may not embed %json"):
        parse_completion({**BASE, "guided_grammar": 'start: %json {"type": "object"}'})


def test_what_the_template_renders_is_counted_numbers_and_tools_too(models):
    """Review M-3: a past call's arguments of a million numbers counted as 81 characters and
    tokenized to 2,000,044 ids on the replica's one tokenizer thread. Numbers count as JSON writes
    them, the tools too; and a chat rendered past the bound is a 400 before it is tokenized."""
    from svip_serve.protocol import rendered_chars

    numbers = {"a": [0] * 1_000_000}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(numbers)}}
    req = parse_chat({"messages": [{"role": "user", "content": "x"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]}]})
    assert rendered_chars(req.messages) > 2_000_000
    tool = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "description": "d" * 9000}}}
    assert rendered_chars([{"role": "user", "content": "x"}], [tool]) > 9000
    tokenizer = models["target"].tokenizer
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        with pytest.raises(ApiError, match="render to 50001 characters"):
            chat_prompt_ids(tokenizer, [{"role": "user", "content": "y" * 50_001}], "tiny", max_chars=50_000)
        assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "y" * 10}], "tiny", max_chars=50_000)
    finally:
        tokenizer.chat_template = None
