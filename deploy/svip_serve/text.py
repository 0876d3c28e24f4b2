"""Token ids to text as they settle: incremental detokenization that never splits a multi-byte
character, and OpenAI `stop` strings that end the output and never appear in it, even when a
stop string spans several tokens or arrives inside one block."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


class IncrementalDetokenizer:
    """Decodes a growing id list a bounded window at a time (prefix / read offsets, as vLLM), so
    each token costs O(window), not O(sequence): special tokens (skipped in the text) never
    enter the window, ids that add no text join the window's context without growing it past
    CONTEXT_TOKENS, and at most MAX_PENDING_TOKENS ids wait to complete a character."""

    CONTEXT_TOKENS = 16
    MAX_PENDING_TOKENS = 8  # a UTF-8 character is at most 4 bytes: longer is not a character

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = frozenset(tokenizer.all_special_ids)
        self.ids: list[int] = []  # the window's ids (special ids left out)
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this have been turned into text

    def push(self, token_id: int) -> str:
        """The text that token adds; '' while it ends in an incomplete character."""
        if token_id in self._special:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        pending = len(self.ids) - self._read
        if now.endswith(REPLACEMENT) and pending < self.MAX_PENDING_TOKENS:
            return ""
        if len(now) <= len(before):  # no text: the id stays as context
            self._read = len(self.ids)
            self._prefix = max(self._prefix, self._read - self.CONTEXT_TOKENS)
            self._trim()
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self._trim()
        return now[len(before) :]

    def _trim(self) -> None:
        """Forget ids before the window."""
        if self._prefix > self.CONTEXT_TOKENS:
            del self.ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StopMatcher:
    """Holds back the tail of the text that could still become a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # text not yet released: a possible stop-string prefix

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to release, stopped). After a stop, what preceded it is released and the
        stop string and anything after it are dropped."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = self._longest_stop_prefix_suffix()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """The longest tail of the pending text that begins a stop string: only the last
        len(stop) - 1 characters are looked at, and only where that stop string's first
        character stands, so a token costs O(stop lengths), whatever the stop strings say."""
        best = 0
        for stop in self.stops:
            first, tail = stop[0], min(len(stop) - 1, len(self.pending))
            start = len(self.pending) - tail
            i = self.pending.find(first, start)
            while i >= 0 and len(self.pending) - i > best:
                if stop.startswith(self.pending[i:]):
                    best = len(self.pending) - i
                    break
                i = self.pending.find(first, i + 1)
        return best


class TextStream:
    """Ids in, text deltas out, with stop strings applied; counts the tokens that made the text."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.text = ""  # released so far
        self.token_count = 0  # tokens consumed, up to and including the one that hit a stop
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """The text released by these tokens; stops consuming at a stop string."""
        out = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.token_count += 1
            piece, self.stopped = self.matcher.feed(self.detok.push(token_id))
            out.append(piece)
        delta = "".join(out)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release what was held back as a possible stop prefix (the output ended without one)."""
        delta = "" if self.stopped else self.matcher.flush()
        self.text += delta
        return delta
