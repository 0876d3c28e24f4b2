"""The target's log-probabilities of the tokens a request settles, for a request that asks for them
(``GenerationRequest.logprobs``): each settled token's, and the ``top`` likeliest at its place.

Every settled token has a row the target computed for its place, after exactly the tokens before
it: the row a verification computed along the accepted path (a drafted token's, the correction's
or the bonus token's, a tree's taken sibling's), or the row stored by a prefill. So speculation
stays on: ``LogprobRows`` keeps each row the target computes, with the path it was computed
after, until the place is settled, and reads the settled token's log-probability from it then.
What is reported is the distribution the target's rows give with the request's own rules applied
(logit_bias, penalties, min_tokens: what it decodes from), before any warping (temperature,
top-k, top-p), as OpenAI and vLLM report theirs; equal to the target decoding alone, to float
rounding (a batched row is not bitwise a row alone)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from svip_common.contracts import TokenLogprob
from svip_common.trees import node_paths

Path = tuple[int, ...]


class LogprobRows:
    """The rows of the places not yet settled, each with the tokens it was computed after from
    the base of its step (the tokens before the base were settled already then)."""

    def __init__(self, top: int):
        self.top = top
        self._rows: dict[int, list[tuple[int, Path, torch.Tensor]]] = {}  # place -> [(base, path, row [vocab])]

    def keep(self, rows: Sequence[tuple[int, int, Path, torch.Tensor]]) -> None:
        """A step's rows: (place, base, path after the base, row). A place's rows from an earlier
        step are dropped (a row is computed again only when the tokens before it changed)."""
        fresh: dict[int, list] = {}
        for place, base, path, row in rows:
            fresh.setdefault(place, []).append((base, path, row))
        self._rows.update(fresh)

    def settle(self, sequence: Sequence[int], start: int, end: int) -> list[TokenLogprob]:
        """The settled tokens sequence[start:end]: each one's log-probability and its place's top
        alternatives, read in one pass; their rows are let go."""
        if end <= start:
            return []
        rows = torch.stack([self._row(sequence, place) for place in range(start, end)])
        for place in [p for p in self._rows if p < end]:
            del self._rows[place]
        return read_logprobs(rows, sequence[start:end], self.top)

    def _row(self, sequence: Sequence[int], place: int) -> torch.Tensor:
        for base, path, row in self._rows.get(place, ()):
            if tuple(sequence[base:place]) == path:
                return row
        raise RuntimeError(f"no target row kept for place {place} after the settled tokens")


class PromptScores:
    """A scoring request's prompt logprobs (OpenAI's echo): every prompt token's after the first,
    read as its prefill computes the rows, a chunk at a time (at most the step's max_batched_tokens),
    each chunk's rows read to their tokens' logprobs and top alternatives at once and dropped, so the
    prompt's [L, vocab] logits are never held and a long prompt's scoring interleaves with the other
    sessions' steps (review M-1: one unchunked forward of up to 16k tokens kept every row). The
    prefill keeps the prompt's last token for the step that verifies the first block, as a sampled
    session's split prefill does; its row is the first generated place's."""

    def __init__(self, prompt: Sequence[int], top: int):
        self.prompt, self.top = tuple(prompt), top
        self.scored: list[TokenLogprob] = []
        self.sent = False  # the worker sent them to the caller

    @property
    def pending(self) -> bool:
        return len(self.scored) < len(self.prompt) - 1

    def rows_to_keep(self, start: int, count: int) -> int:
        """Of a chunk computing positions [start, start + count) of the prompt, how many of its last
        rows score tokens not scored yet (a chunk recomputed after an eviction scores nothing again)."""
        return max(0, start + count - max(start, len(self.scored)))

    def take(self, first: int, rows: torch.Tensor) -> None:
        """rows [n, vocab]: the rows of positions first.. (each the place of the next prompt token)."""
        if first != len(self.scored):
            raise RuntimeError(f"prompt rows from position {first}; {len(self.scored)} scored so far")
        tokens = self.prompt[first + 1 : first + 1 + rows.shape[0]]
        self.scored += read_logprobs(rows[: len(tokens)], tokens, self.top)


def read_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of logits [n, vocab] and the row's ``top``
    likeliest, worked out together and read to the host in one copy."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    parts = [logprobs.gather(-1, torch.tensor(list(tokens), device=logprobs.device)[:, None])]
    if top:
        best = torch.topk(logprobs, top, dim=-1)
        parts += [best.indices.to(logprobs.dtype), best.values]
    host = torch.cat(parts, dim=-1).tolist()
    return [TokenLogprob(token, row[0], tuple(zip(map(int, row[1 : 1 + top]), row[1 + top :])))
            for token, row in zip(tokens, host)]


def block_rows(base: int, drafted: Sequence[int], siblings: Sequence[Sequence[int]] | None,
               logits: torch.Tensor, grown: Sequence[tuple[int, int]] | None = None,
               ) -> list[tuple[int, int, Path, torch.Tensor]]:
    """A verification's rows as ``LogprobRows.keep`` takes them: logits [1 + nodes, vocab], the
    row for the block's first place, then one after each node (the drafted tokens, then a tree's
    siblings place by place, then the nodes grown below them)."""
    rows = [(base, base, (), logits[0])]
    for node, path in enumerate(node_paths(drafted, siblings, grown)):
        rows.append((base + len(path), base, path, logits[1 + node]))
    return rows
