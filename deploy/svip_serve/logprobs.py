"""The target's logprobs (target_worker/logprobs.py: its distribution with the request's logit_bias
and penalties, before temperature, top-k and top-p) in OpenAI's two shapes: a completion's
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, and a chat's ``content`` list.
A token's text is the tokenizer's decoding of that token alone (so a character split over tokens
shows as its pieces, and its ``bytes`` are those of that text). Each id's text is decoded once per
tokenizer and kept (the vocabulary is finite: review L-3 measured 3 us a decode, 344k of them for one
request of n 8 x 2,047 tokens x 21 ids)."""

from __future__ import annotations

import weakref

from svip_common.contracts import TokenLogprob

_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {id: its text alone}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int = 0,
                        prompt: tuple[int, list[TokenLogprob]] | None = None) -> dict:
    """offset: where the first entry's text starts in the choice's text (a stream's earlier chunks);
    prompt: echo's (the prompt's first token, the logprobs of the rest), put first, the first
    token's logprob and alternatives null (nothing comes before it), as OpenAI has them."""
    first, before = (None, []) if prompt is None else prompt
    entries = [*before, *entries]
    texts = ([] if first is None else [_text(tokenizer, first)]) + [_text(tokenizer, e.token) for e in entries]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    lead = [] if first is None else [None]
    return {
        "tokens": texts,
        "token_logprobs": lead + [e.logprob for e in entries],
        "top_logprobs": lead + [{_text(tokenizer, t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    return {
        "content": [{**_item(tokenizer, e.token, e.logprob),
                     "top_logprobs": [_item(tokenizer, t, v) for t, v in e.top]} for e in entries],
        "refusal": None,
    }


def body_for(kind: str, tokenizer, entries: list[TokenLogprob] | None, offset: int = 0,
             prompt: tuple[int, list[TokenLogprob]] | None = None) -> dict | None:
    """A choice's (or a stream chunk's) ``logprobs`` field: None when the request asked for none;
    prompt: a completion's echo (completion_logprobs)."""
    if entries is None:
        return None
    return completion_logprobs(tokenizer, entries, offset, prompt) if kind == "completion" else chat_logprobs(
        tokenizer, entries)


def _item(tokenizer, token: int, logprob: float) -> dict:
    text = _text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _text(tokenizer, token: int) -> str:
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS.setdefault(tokenizer, {})
    text = texts.get(token)
    if text is None:
        text = texts[token] = tokenizer.decode([token])
    return text
