"""`--threshold auto` for a feature head: calibration by drafting, not by a teacher-forced pass.

A draft model's calibration (coordinator/calibration.py) reads a block drafted anywhere as a slice
of one teacher-forced pass, which holds for a draft that sees tokens only. A head's second and
later tokens read its own predicted features, not the target's, and it is much weaker there, so
the same slice would overrate every long block. Here the head drafts, at every place of the
target's greedy continuation, the block it would draft there: its cache fed the target's fused
features up to that place, then its own outputs, CHAIN_DEPTH tokens deep; each drafted token's
entropy and whether it is the target's token. SVIP is replayed on those blocks for the same grid
of thresholds and cost model (the head's step timed against the target's forward), and the
threshold with the least modelled time per token is kept. Block lengths are all it changes:
exactness is untouched.

Runs where the engine runs (in process); imports what coordinator/calibration.py imports.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from coordinator.calibration import (
    CALIBRATION_PROMPTS,
    Calibration,
    CostModel,
    costs_beside,
    fit_threshold,
    greedy_continuation,
)
from draft_worker.feature_head import FeatureHead, HeadCache
from svip_common.kv_cache import KVCache, wait_for_device
from svip_common.models import LoadedModel
from svip_common.sampling import entropy

CHAIN_DEPTH = 8  # tokens a calibration block drafts at most (one SVIP would not stop by then counts as the cap)


@dataclass
class Chains:
    """A head's blocks drafted at each place of the target's continuation, on its own outputs."""

    entropies: list[list[float]]  # per place: the entropy of each token the head drafts there
    matches: list[list[bool]]  # per place: whether each drafted token is the target's

    def __len__(self) -> int:
        return len(self.matches)

    def block(self, start: int, cap: int) -> tuple[list[float], list[bool], int]:
        """The block drafted at ``start``; one that ran CHAIN_DEPTH deep unstopped drafts to the cap."""
        entropies, matches = self.entropies[start][:cap], self.matches[start][:cap]
        return entropies, matches, cap if len(matches) == CHAIN_DEPTH else len(matches)


@torch.inference_mode()
def record_chains(target: LoadedModel, head: FeatureHead, prompt_ids: list[int], new_tokens: int,
                  depth: int = CHAIN_DEPTH, embedding: torch.nn.Module | None = None) -> Chains:
    """The target's greedy continuation of the prompt, then the head's block at each place of it.
    embedding: the target's input embedding as the head reads it (default: the target's own; a
    tensor-parallel target's shard holds a part of it: the head's copy)."""
    embedding = embedding if embedding is not None else target.model.get_input_embeddings()
    sequence = prompt_ids + greedy_continuation(target, prompt_ids, new_tokens)
    ids = torch.tensor([sequence], device=target.model.device)
    hidden = _hidden_states(target, sequence)
    features = head.fuse(tuple(h.to(head.fc.weight.dtype) for h in hidden))  # [n, h]: the fused layers
    embeds = embedding(ids[0]).to(head.fc.weight.dtype)  # [n, h]
    first = len(prompt_ids)  # the first place a block is drafted at: the token after the prompt
    head_cache = HeadCache()
    last = head(embeds[1:first], features[: first - 1], head_cache)[-1:]  # the output that predicts x_first
    out_entropies, out_matches = [], []
    for place in range(first, len(sequence)):  # committed: sequence[:place]
        known = len(sequence) - place  # the target's tokens from this place on
        entropies, matches, feature = [], [], last
        for step in range(min(depth, known)):
            probs = torch.softmax(head.logits(feature).float(), dim=-1)[0]  # over the head's vocabulary
            drafted = int(head.target_ids(torch.argmax(probs)))
            entropies.append(float(entropy(probs)))
            matches.append(drafted == sequence[place + step])
            if step + 1 < min(depth, known):  # the next token reads the head's own output
                feature = head(embedding(torch.tensor([drafted], device=ids.device)).to(embeds.dtype), feature,
                               head_cache)
        out_entropies.append(entropies)
        out_matches.append(matches)
        head_cache.rollback(place - 1)  # the own pairs go; the target's pair at place - 1 comes in
        if place + 1 < len(sequence):
            last = head(embeds[place : place + 1], features[place - 1 : place], head_cache)
    return Chains(out_entropies, out_matches)


def _hidden_states(target: LoadedModel, sequence: list[int]) -> tuple[torch.Tensor, ...]:
    """Every hidden state of one forward over the sequence, [n, hidden] each, indexed as
    transformers' ``hidden_states``: through the paged pool, as the verifier computes them (a
    tensor-parallel shard's are whole: its residual stream is summed over the ranks)."""
    layers = target.model.config.get_text_config(decoder=True).num_hidden_layers + 1
    with KVCache(target.model) as cache:
        _, features = cache.forward_features(sequence, tuple(range(layers)))
    return tuple(features.chunk(layers, dim=-1))


@torch.inference_mode()
def head_step_time(head: FeatureHead, embedding: torch.nn.Module, context: int = 64, repeats: int = 15) -> float:
    """Median time of one drafted token: the head's layer for one pair after a warm cache of
    `context`, its LM head and the argmax's read."""
    c, device, dtype = head.config, head.fc.weight.device, head.fc.weight.dtype
    generator = torch.Generator().manual_seed(0)
    cache = HeadCache()
    head(torch.randn(context, c.hidden_size, generator=generator).to(device, dtype),
         torch.randn(context, c.hidden_size, generator=generator).to(device, dtype), cache)
    feature = torch.randn(1, c.hidden_size, generator=generator).to(device, dtype)
    times = []
    for i in range(repeats):
        wait_for_device(device)
        start = time.perf_counter()
        embed = embedding(torch.tensor([i + 1], device=device)).to(dtype)
        out = head(embed, feature, cache)
        int(torch.argmax(head.logits(out)))
        times.append(time.perf_counter() - start)
        cache.rollback(context)
    return statistics.median(times)


def head_costs(target: LoadedModel, head: FeatureHead, repeats: int = 15,
               embedding: torch.nn.Module | None = None) -> CostModel:
    embedding = embedding if embedding is not None else target.model.get_input_embeddings()
    return costs_beside(target, head_step_time(head, embedding, repeats=repeats), repeats=repeats)


def calibrate_head(target: LoadedModel, head: FeatureHead, prompts: tuple[str, ...] = CALIBRATION_PROMPTS,
                   new_tokens: int = 96, entropy_scale: float = 0.15, cap: int = 40,
                   embedding: torch.nn.Module | None = None) -> Calibration:
    """embedding: the target's input embedding as the head reads it (default: the target's own)."""
    chains = [record_chains(target, head, list(target.tokenizer(p)["input_ids"]), new_tokens, embedding=embedding)
              for p in prompts]
    return fit_threshold(chains, head_costs(target, head, embedding=embedding), entropy_scale, cap)
