"""Tool calls read out of a chat answer (deploy/svip_serve/tool_text.py, tools.py): what is read
from the whole text is what is read from it in any pieces, and nothing the model wrote is lost."""

import json

import pytest

from svip_serve.tool_text import ArrayCalls, Call, HermesCalls, Llama3Calls, read_all
from svip_serve.tools import CallStream, ToolPlan

NAMES = ("get_weather", "get_time")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ARGS = json.dumps({"city": "Oslo"})


def pieces(text: str):
    """The text whole, one character at a time, and cut in two at every place."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def read_in(reader_type, parts, *args):
    reader = reader_type(*args)
    events = [e for part in parts for e in reader.feed(part)] + reader.finish()
    calls = [e for e in events if isinstance(e, Call)]
    return "".join(e for e in events if isinstance(e, str)), calls


@pytest.mark.parametrize("text", [
    "Hello world\n",
    "  leading and trailing  \n\n",
    "a < b and <tool_ is not a tag <tool_call",  # ends in the tag's first part: told at the end
    "x\n<tool_call>not json</tool_call>\ny",  # not a call: the text as written
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # a function not among the tools
    '<tool_call>{"name": "get_weather", "arguments": "Oslo"}</tool_call>',  # arguments not an object
    "before <tool_call>{\"name\": \"get_weather\"",  # cut by max_tokens inside a call
    "",
])
def test_text_without_a_call_is_told_as_written_in_any_pieces(text):
    for parts in pieces(text):
        assert read_in(HermesCalls, parts, NAMES) == (text, [])


@pytest.mark.parametrize("text, content, calls", [
    (CALL, "", [Call("get_weather", ARGS)]),
    ("Let me look.\n" + CALL, "Let me look.", [Call("get_weather", ARGS)]),
    (CALL + "\n" + CALL.replace("get_weather", "get_time") + "\n", "",
     [Call("get_weather", ARGS), Call("get_time", ARGS)]),
    (CALL + "\nDone.", "\nDone.", [Call("get_weather", ARGS)]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>', "",
     [Call("get_time", json.dumps({"zone": "CET"}))]),  # the key some templates use
    ("Ok " + CALL.replace("get_weather", "nope") + " " + CALL, "Ok " + CALL.replace("get_weather", "nope"),
     [Call("get_weather", ARGS)]),
])
def test_calls_are_read_out_alike_in_any_pieces(text, content, calls):
    for parts in pieces(text):
        assert read_in(HermesCalls, parts, NAMES) == (content, calls)
    assert read_all(HermesCalls(NAMES), text) == (content if content.strip() else None, calls)


def test_an_array_of_calls_is_read_one_whole_item_at_a_time():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    want = ("", [Call("get_weather", ARGS), Call("get_time", "{}")])
    for parts in pieces(text):
        assert read_in(ArrayCalls, parts) == want
    reader = ArrayCalls()
    assert reader.feed(text[:40]) == [] and reader.feed(text[40:60]) == [Call("get_weather", ARGS)]


def test_an_array_cut_short_keeps_its_unread_tail_as_content():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_ti'
    for parts in pieces(text):
        assert read_in(ArrayCalls, parts) == (', {"name": "get_ti', [Call("get_weather", ARGS)])


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize("text, content, calls", [
    (LLAMA_CALL, "", [Call("get_weather", ARGS)]),
    ("<|python_tag|>" + LLAMA_CALL, "", [Call("get_weather", ARGS)]),
    ("\n " + LLAMA_CALL + "; " + LLAMA_CALL.replace("get_weather", "get_time").replace("parameters", "arguments"), "",
     [Call("get_weather", ARGS), Call("get_time", ARGS)]),
    ("The weather is fine " + LLAMA_CALL, "The weather is fine " + LLAMA_CALL, []),  # a call only at the start
    ("<b>bold</b>", "<b>bold</b>", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, not a call: content as written
    (LLAMA_CALL + '; {"name": "rm_rf", "parameters": {}}', '{"name": "rm_rf", "parameters": {}}',
     [Call("get_weather", ARGS)]),
    ('{"name": "get_weather", "parameters": {"ci', '{"name": "get_weather", "parameters": {"ci', []),  # cut short
    ("   ", "   ", []),
])
def test_llama3_json_calls_are_read_alike_in_any_pieces(text, content, calls):
    for parts in pieces(text):
        assert read_in(Llama3Calls, parts, NAMES) == (content, calls)


def test_a_stream_numbers_its_calls_and_says_it_called():
    stream = CallStream(ToolPlan([], "auto", names=NAMES))
    assert stream.opening() is None
    parts = stream.feed("Hi " + CALL + CALL) + stream.finish()
    assert parts[0] == ("Hi", None) and stream.called
    entries = [p[1][0] for p in parts[1:]]
    assert [e["index"] for e in entries] == [0, 1] and all(e["id"].startswith("call_") for e in entries)
    assert [e["function"] for e in entries] == [{"name": "get_weather", "arguments": ARGS}] * 2
    plain = CallStream(ToolPlan([], "auto", names=NAMES))
    assert plain.feed("no call") + plain.finish() == [("no call", None)] and not plain.called


def test_a_named_stream_opens_the_call_and_streams_its_arguments():
    stream = CallStream(ToolPlan([], "named", name="get_weather", names=NAMES))
    (opening,) = stream.opening()
    assert opening["function"] == {"name": "get_weather", "arguments": ""} and opening["index"] == 0
    assert stream.feed('{"city"') == [(None, [{"index": 0, "function": {"arguments": '{"city"'}}])]
    assert stream.finish() == [] and not stream.called  # a forced call finishes as "stop", as OpenAI's


def test_a_whole_answers_message():
    auto = ToolPlan([], "auto", names=NAMES)
    message, called = auto.message("Sure. " + CALL)
    assert called and message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert auto.message("plain") == ({"role": "assistant", "content": "plain"}, False)
    message, called = ToolPlan([], "named", name="get_time", names=NAMES).message("{}")
    assert not called and message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == "{}"
    assert ToolPlan([], "none", names=NAMES).message(CALL) == ({"role": "assistant", "content": CALL}, False)
    message, called = ToolPlan([], "auto", names=NAMES, parser="llama3_json").message(LLAMA_CALL)
    assert called and message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == ARGS


@pytest.mark.parametrize("reader", [lambda: ArrayCalls(), lambda: Llama3Calls(NAMES)])
def test_a_long_call_is_decoded_once_not_at_every_brace(reader, monkeypatch):
    """Review M-4: the readers decoded the open call again from its start at every "}" (1.7 s on the
    replica's event loop for a call of 4,096 pieces). Now the text is scanned once as it comes and a
    call decoded once it is whole; braces inside strings do not count."""
    decodes = []
    real = json.JSONDecoder.raw_decode
    monkeypatch.setattr(json.JSONDecoder, "raw_decode",
                        lambda self, s, idx=0: decodes.append(idx) or real(self, s, idx))
    r = reader()
    head = '[{"name": "get_weather", "parameters": {' if isinstance(r, ArrayCalls) else \
        '{"name": "get_weather", "parameters": {'
    parts = [head] + [f'"k{i}": {{"s": "}}{{\\\\\\"}}"}}, ' for i in range(4096)] + ['"end": 1}}']
    events = [e for p in parts for e in r.feed(p)] + r.finish()
    assert len(decodes) <= 3  # the call once, then a look for another after it, at the end
    calls = [e for e in events if isinstance(e, Call)]
    assert len(calls) == 1 and len(json.loads(calls[0].arguments)) == 4097
    assert json.loads(calls[0].arguments)["k7"] == {"s": '}{\\"}'}


def test_parallel_tool_calls_false_keeps_the_first_call_alone_with_auto_too():
    """Review I-3: parallel_tool_calls false held only for required; auto returned every call the
    text held. Now both a whole answer and a stream keep the first."""
    from svip_serve.tools import tool_plan

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    plan = tool_plan({"tools": tools, "parallel_tool_calls": False})
    message, called = plan.message(CALL + CALL)
    assert called and len(message["tool_calls"]) == 1
    stream = CallStream(plan)
    entries = [p[1] for p in stream.feed(CALL + CALL) + stream.finish() if p[1]]
    assert len(entries) == 1 and entries[0][0]["index"] == 0
    assert len(tool_plan({"tools": tools}).message(CALL + CALL)[0]["tool_calls"]) == 2
