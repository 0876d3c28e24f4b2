"""Text from settling tokens: incremental detokenization equals decoding the whole sequence, never
emits half a character, and stop strings end the text before them, across token boundaries."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from svip_assets import default_pair
from svip_serve.text import IncrementalDetokenizer, StopMatcher, TextStream

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "naïve café — 東京 🐍🐍 ünïcödé\n\ttabs  and   spaces",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_pair()[0])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # a split multi-byte character is held, not emitted


def test_multibyte_character_split_over_tokens_is_held(tokenizer):
    ids = tokenizer("🐍")["input_ids"]
    assert len(ids) > 1  # byte-level BPE: the emoji spans several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🐍"


def test_stop_string_spanning_pieces_is_cut():
    m = StopMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)  # "ST" could begin the stop string: held
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)


def test_held_prefix_is_released_when_it_does_not_complete():
    m = StopMatcher(("STOP",))
    assert m.feed("xST") == ("x", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_stop_string_wins():
    m = StopMatcher(("world", "lo w"))
    assert m.feed("hello world") == ("hel", True)


def test_text_stream_counts_tokens_up_to_the_stop(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, ("gamma",))
    out = stream.push(ids)
    assert stream.stopped and out == stream.text == "alpha beta "
    consumed = tokenizer.decode(ids[: stream.token_count])
    assert "gamma" in consumed and "gamma" not in tokenizer.decode(ids[: stream.token_count - 1])
    assert stream.finish() == ""


def test_text_stream_without_stop_releases_everything(tokenizer):
    ids = tokenizer(TEXTS[1])["input_ids"]
    stream = TextStream(tokenizer, ("never there",))
    text = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert text == TEXTS[1] and stream.token_count == len(ids) and not stream.stopped


def test_a_long_stop_string_costs_each_token_its_length_not_its_square():
    """The matcher looks only at the tail a stop string could still complete, from where its first
    character stands: feeding a 255-character prefix of a 256-character stop holds it back, and
    the token that breaks it releases everything (review M6: a 100k stop prefix used to cost 0.13 s)."""
    stop = "a" * 255 + "b"
    m = StopMatcher((stop,))
    out = [m.feed("a") for _ in range(255)]
    assert all(text == "" for text, _ in out) and len(m.pending) == 255
    assert m.feed("c") == ("a" * 255 + "c", False)
    assert m.feed("a" * 255 + "b") == ("", True)


def test_the_longest_held_tail_is_found_past_a_false_start():
    m = StopMatcher(("abab", "xyz"))
    assert m.feed("zzaba") == ("zz", False)  # "aba" could begin "abab"
    assert m.feed("x") == ("aba", False)  # "x" could begin "xyz"
    assert m.feed("yz!") == ("", True)
