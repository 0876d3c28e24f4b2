"""Tool calls read out of a chat answer's text, as it streams: ``HermesCalls`` for ``tool_choice``
``auto`` (the model decides; a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format of the Hermes and Qwen chat templates, vLLM's ``hermes`` parser) and ``ArrayCalls`` for
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


class ArrayCalls:
    """A JSON array of ``{"name": ..., "parameters": {...}}``, each item a call once it is whole; what
    does not parse by the end (max_tokens cut it) is content."""

    def __init__(self):
        self._text, self._at, self._done = "", 0, False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list:
        self._text += text
        return self._items() if "}" in text else []  # an item can only end at a closing brace

    def finish(self) -> list:
        events = self._items()
        tail = "" if self._done else self._text[self._at:]
        self._done = True
        return events + ([tail] if tail.strip() else [])

    def _items(self) -> list:
        events = []
        while not self._done and (call := self._next()) is not None:
            events.append(call)
        return events

    def _next(self) -> Call | None:
        at = _skip(self._text, self._at, " \n\t[,")
        if at < len(self._text) and self._text[at] == "]":
            self._at, self._done = at + 1, True
            return None
        try:
            item, end = self._decoder.raw_decode(self._text, at)
        except ValueError:
            return None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("parameters"), dict):
            return None  # the grammar allows only calls; a different text is told whole at the end
        self._at = end
        return Call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))


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
