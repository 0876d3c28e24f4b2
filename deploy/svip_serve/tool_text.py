"""Tool calls read out of a chat answer's text, as it streams: ``HermesCalls`` for ``tool_choice``
``auto`` (the model decides; a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format of the Hermes and Qwen chat templates, vLLM's ``hermes`` parser), ``Llama3Calls`` for
``auto`` with Llama 3.x's JSON calls (vLLM's ``llama3_json``) and ``ArrayCalls`` for
``required`` (the answer is forced by a grammar to a JSON array of ``{"name", "parameters"}``, as
vLLM forces it). Reading never changes the tokens: speculation stays exact, the text is only
split into content and calls.

A reader takes the text in pieces (``feed``, then ``finish``) and returns what it can tell so far:
content (str) and calls (``Call``); fed the whole text at once, it returns what it returns fed in
any pieces (the stream and the whole answer agree). Text that may begin a call is held back until
it is known; a call that does not parse (unknown function, not JSON, cut by max_tokens) stays
content, so nothing the model wrote is lost. Runs in the Serve replica's event loop; no model
work, no imports above svip_serve's own."""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI's tool_calls carry it


def read_all(reader, text: str) -> tuple[str | None, list[Call]]:
    """The whole answer's content (None when only calls and whitespace) and calls."""
    events = reader.feed(text) + reader.finish()
    calls = [e for e in events if isinstance(e, Call)]
    content = "".join(e for e in events if isinstance(e, str))
    return (None if calls and not content.strip() else content), calls


class HermesCalls:
    """Content, with ``<tool_call>`` blocks naming one of ``names`` taken out as calls. Whitespace
    before a call, and at the end after one, is dropped (it held the blocks apart); any other text
    stays as written."""

    def __init__(self, names):
        self._names = frozenset(names)
        self._buffer, self._space = "", ""  # text not yet told; trailing whitespace held back
        self._in_call = self._called = False

    def feed(self, text: str) -> list:
        self._buffer += text
        events: list = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                events += self._call(body)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                events += self._content(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(OPEN):], True  # the space before: kept
                # until the call is known (a block that is not one stays text as written)
                continue
            keep = _prefix_overlap(self._buffer, OPEN)
            told, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            return events + self._content(told)

    def finish(self) -> list:
        tail = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        events = self._content(tail)
        if self._space and not self._called:  # no call: the text as written, to its last space
            events.append(self._space)
        self._space = ""
        return events

    def _content(self, text: str) -> list:
        if not text.strip():
            self._space += text
            return []
        body = text.rstrip()
        told, self._space = self._space + body, text[len(body):]
        return [told]

    def _call(self, body: str) -> list:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(arguments, dict) or call.get("name") not in self._names:
            return self._content(OPEN + body + CLOSE)
        self._space, self._called = "", True
        return [Call(call["name"], json.dumps(arguments, ensure_ascii=False))]


class JsonCalls:
    """Call objects one after another, ``{"name": ..., KEY: {...}}`` with the arguments under one of
    ``keys``, each a call once it is whole; ``between``: what may separate them, ``close``: what
    ends them. The first object that is not a call of one of ``names`` (None: any) ends the reading;
    what is unread by the end (that object on, or a tail max_tokens cut) is content."""

    def __init__(self, names=None, keys=("parameters",), between=" \n\t[,", close: str | None = "]"):
        self._names = None if names is None else frozenset(names)
        self._keys, self._between, self._close = keys, between, close
        self._text, self._at, self._done, self._stuck = "", 0, False, False
        self._decoder = json.JSONDecoder()
        # the text scanned once, as it arrives, for where an object closes at the top (review M-4: it
        # was decoded again from the open call's start at every "}", quadratic on the event loop)
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> list:
        self._text += text
        if self._done or self._stuck or not self._closes(text):
            return []
        return self._items()  # decoded once it is whole: each item once

    def _closes(self, text: str) -> bool:
        """Whether the text closes an object at the top level, its braces counted outside strings."""
        closed = False
        for ch in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":  # (a stray one stays at the top: the decode then says what it is)
                self._depth = max(self._depth - 1, 0)
                closed |= self._depth == 0
        return closed

    def finish(self) -> list:
        events = self._items()
        tail = "" if self._done else self._text[self._at:]
        self._done = True
        return events + ([tail] if tail.strip() else [])

    def _items(self) -> list:
        events = []
        while not self._done and not self._stuck and (call := self._next()) is not None:
            events.append(call)
        return events

    def _next(self) -> Call | None:
        at = _skip(self._text, self._at, self._between)
        if self._close is not None and at < len(self._text) and self._text[at] == self._close:
            self._at, self._done = at + 1, True
            return None
        try:
            item, end = self._decoder.raw_decode(self._text, at)
        except ValueError:
            return None  # not whole yet
        key = next((k for k in self._keys if isinstance(item, dict) and k in item), None)
        name = item.get("name") if isinstance(item, dict) else None
        if key is None or not isinstance(item[key], dict) or not isinstance(name, str) \
                or (self._names is not None and name not in self._names):
            self._at, self._stuck = at, True  # not a call: from here on, content
            return None
        self._at = end
        return Call(name, json.dumps(item[key], ensure_ascii=False))


class ArrayCalls(JsonCalls):
    """tool_choice required: the grammar's JSON array of {"name": ..., "parameters": {...}} calls."""

    def __init__(self):
        super().__init__()


PYTHON_TAG = "<|python_tag|>"


class Llama3Calls:
    """Llama 3.x's JSON tool calls (vLLM's ``llama3_json``): an answer that begins with a JSON
    object (after ``<|python_tag|>``, where the text keeps it) is calls of ``names``, separated by
    ``;``, their arguments under "parameters" (as Llama's template asks) or "arguments"; any other
    answer is content as written."""

    def __init__(self, names):
        self._calls = JsonCalls(names, keys=("parameters", "arguments"), between=" \n\t;", close=None)
        self._head, self._kind = "", None  # the text before its kind is known; "calls" or "content"

    def feed(self, text: str) -> list:
        if self._kind == "content":
            return [text] if text else []
        if self._kind == "calls":
            return self._calls.feed(text)
        self._head += text
        lead = self._head.lstrip()
        if lead.startswith(PYTHON_TAG) or lead.startswith("{"):
            self._kind = "calls"
            return self._calls.feed(lead.removeprefix(PYTHON_TAG))
        if not lead or PYTHON_TAG.startswith(lead):
            return []  # not known yet
        self._kind = "content"
        return [self._head]

    def finish(self) -> list:
        if self._kind == "calls":
            return self._calls.finish()
        return [self._head] if self._kind is None and self._head else []


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (held back: the tag may follow)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
