"""One API request on the pipeline: the coordinator's settled tokens become text deltas as they
settle, stop strings end the session early, and a consumer that goes away (client disconnect)
cancels the session, which frees both workers' caches."""

from __future__ import annotations

import asyncio
import time

from svip_common.contracts import GenerationRequest, GenerationResult, TokenLogprob
from svip_serve.logprobs import body_for
from svip_serve.text import TextStream

_END = object()


class Generation:
    def __init__(self, engine, request: GenerationRequest, tokenizer, stops: tuple[str, ...], echo: str | None = None,
                 score_only: bool = False):
        """echo: the prompt's text, put first (completions' echo); score_only: max_tokens 0, the
        one token the prompt's prefill settles is left out of the answer."""
        self.engine, self.request = engine, request
        self.echo, self.score_only = echo, score_only
        self.text = TextStream(tokenizer, stops)
        self.tokenizer = tokenizer
        self.result: GenerationResult | None = None
        self.first_token_at: float | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._logprobs: list[TokenLogprob] = []  # per settled token, when the request asked for them
        self._logprobs_sent = 0  # of them, handed to a stream's chunks
        self._logprob_chars = 0  # their tokens' text, in characters (a completion's text_offset)
        self._prompt_scored: list[TokenLogprob] | None = None  # echo with logprobs: the prompt's, from its prefill

    def _on_tokens(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> bool:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._logprobs += logprobs
        delta = self.text.push(token_ids)
        if delta:
            self._queue.put_nowait(delta)
        return self.text.stopped  # True ends the session: the rest would be cut anyway

    def _on_prompt(self, logprobs: list[TokenLogprob]) -> None:
        self._prompt_scored = logprobs

    async def deltas(self):
        """Text as it settles. Raises what the pipeline raised (after the text before it)."""
        on_prompt = self._on_prompt if self.request.prompt_logprobs else None
        task = asyncio.ensure_future(self.engine.generate(self.request, on_tokens=self._on_tokens, on_prompt=on_prompt))
        task.add_done_callback(lambda _: self._queue.put_nowait(_END))
        try:
            while (text := await self._next_text()) is not _END:
                yield text
            try:
                self.result = task.result()
            except Exception:  # text held back as a possible stop-string prefix goes out before the error
                if tail := self.text.finish():
                    yield tail
                raise
            tail = self.text.finish()
            if tail:
                yield tail
        finally:
            if not task.done():  # the consumer left: cancel the session on both workers
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    async def _next_text(self):
        """Everything settled since the last call as one delta (a consumer that falls behind
        gets fewer, larger chunks), or _END once the session ended and all text was taken."""
        item = await self._queue.get()
        if item is _END:
            return _END
        parts = [item]
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is _END:
                self._queue.put_nowait(_END)  # seen on the next call, after this text
                break
            parts.append(item)
        return "".join(parts)

    async def run(self) -> str:
        """The whole text (non-streaming), the echoed prompt first."""
        async for _ in self.deltas():
            pass
        return (self.echo or "") + ("" if self.score_only else self.text.text)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped else self.result.finish_reason

    @property
    def completion_tokens(self) -> int:
        if self.score_only:
            return 0
        return self.text.token_count if self.text.stopped else len(self.result.token_ids)

    def logprobs(self, kind: str) -> dict | None:
        """The choice's ``logprobs`` field once the output ended: every output token's (to the stop
        string's cut); None when the request asked for none."""
        if self.request.logprobs is None:
            return None
        prompt = None
        if self.request.prompt_logprobs and self.result.prompt_logprobs is not None:
            prompt = (self.request.prompt_ids[0], self.result.prompt_logprobs)
        return body_for(kind, self.tokenizer, self._logprobs[: self.completion_tokens], prompt=prompt)

    def echo_logprobs(self, kind: str) -> dict | None:
        """A streamed echo's chunk's ``logprobs``: the prompt's tokens' (the first one's null), once
        its prefill scored them (before any token settles); the answer's offsets follow on."""
        if self.request.logprobs is None or self._prompt_scored is None:
            return None
        body = body_for(kind, self.tokenizer, [], prompt=(self.request.prompt_ids[0], self._prompt_scored))
        self._logprob_chars += sum(len(t) for t in body.get("tokens", ()))
        return body

    def logprobs_chunk(self, kind: str, final: bool = False) -> dict | None:
        """A stream chunk's ``logprobs``: the tokens settled since the last chunk (to the stop
        string's cut); final: the output ended, the rest of them."""
        if self.request.logprobs is None:
            return None
        end = self.completion_tokens if final else min(len(self._logprobs), self.text.token_count)
        entries = self._logprobs[self._logprobs_sent : max(end, self._logprobs_sent)]
        body = body_for(kind, self.tokenizer, entries, self._logprob_chars)
        self._logprobs_sent += len(entries)
        self._logprob_chars += sum(len(t) for t in body.get("tokens", ()))
        return body

    def stats(self) -> dict:
        """The request's speculative-decoding stats: the `svip` field of a response."""
        s = self.result.stats
        policy = self.request.policy
        return {
            "policy": policy.name,
            "threshold": policy.threshold if policy.name == "svip" else None,
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": round(s.acceptance_rate, 6),
            "mean_acceptance_length": round(s.mean_acceptance_length, 6),
            "draft_lengths": s.draft_lengths,
            "accepted_lengths": s.accepted_lengths,
            "discarded_tokens": s.discarded_tokens,
            "pauses": s.pauses,
            "detached": s.detached,
            "reattached": s.reattached,
            "target_restarts": s.target_restarts,
            "both_busy_s": round(s.both_busy_s, 6),
            "wire_bytes": s.wire_bytes,
            "wall_s": round(s.wall_s, 6),
        }


async def merged(generations: list[Generation]):
    """The choices' text as each settles, (index, text), and (index, None) when that choice ends;
    one that raises ends them all (the others cancelled, their sessions with them) and raises."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for text in generation.deltas():
                queue.put_nowait((index, text))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
