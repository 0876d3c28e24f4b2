"""Loading a Hugging Face causal LM and its tokenizer, and checking that a draft fits a target.

transformers' modeling stack (AutoModelForCausalLM: ~3.5 s of imports here, torch.distributed,
dynamo, scipy) loads only when weights do: a process that needs a model's tokenizer and limits
(a Serve replica, the CLI's distributed driver) imports the tokenizer side alone."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from svip_common.contracts import DRAFT_LENGTH_CAP, Limits
from svip_common.errors import InvalidRequest, ModelLoadError
from svip_common.hub import looks_like_local_path, split_revision

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass
class LoadedModel:
    path: str
    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    vocab_size: int  # width of the logits
    max_positions: int | None  # context length, when the config states one
    eos_token_ids: tuple[int, ...]
    token_limit: int = 0  # ids below it are real tokens the model embeds (padding columns excluded)


def load_model(path: str, dtype: str = "float32", device: str = "cpu", spread: bool = False,
               group=None) -> LoadedModel:
    """Load model and tokenizer from a local directory (or a hub id where a hub is reachable).
    spread: place the layers evenly across every visible GPU (a target too large for one); group:
    a tensor-parallel group (svip_common/tensor_parallel.py) whose rank 0 this is: its shard alone
    is loaded (a local directory of safetensors files), the logits still the whole vocabulary's."""
    from transformers import AutoModelForCausalLM

    _check_local_path(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    repo, revision = split_revision(path)  # owner/name@revision: pinned
    try:
        tokenizer = AutoTokenizer.from_pretrained(repo, revision=revision)
        if group is not None:
            from svip_common.tensor_parallel import load_shard

            model, config = load_shard(path, group, DTYPES[dtype], device)
            return LoadedModel(path, model, tokenizer, config.vocab_size,
                               getattr(config, "max_position_embeddings", None), _eos_ids(model, tokenizer),
                               token_limit=min(len(tokenizer), config.vocab_size))
        placement = {"device_map": "balanced"} if spread else {}
        model = AutoModelForCausalLM.from_pretrained(repo, revision=revision, dtype=DTYPES[dtype], **placement)
    except InvalidRequest:  # what the caller asked of the model (a degree its heads do not divide)
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path!r}: {_first_line(exc)}") from None
    try:
        model = (model if spread else model.to(device)).eval()
    except (RuntimeError, AssertionError) as exc:
        raise ModelLoadError(f"cannot place model {path!r} on device {device!r}: {exc}") from None
    config = model.config.get_text_config(decoder=True)
    width = model.get_output_embeddings().weight.shape[0]
    rows = model.get_input_embeddings().weight.shape[0]
    return LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        vocab_size=width,
        max_positions=getattr(config, "max_position_embeddings", None),
        eos_token_ids=_eos_ids(model, tokenizer),
        token_limit=min(len(tokenizer), width, rows),
    )


@dataclass
class ModelInfo:
    """What the coordinator needs of a model it does not host: tokenizer and limits, no weights."""

    path: str
    tokenizer: object
    vocab_size: int
    max_positions: int | None
    eos_token_ids: tuple[int, ...]
    token_limit: int = 0  # ids below it are real tokens the model embeds (padding columns excluded)
    num_layers: int | None = None  # decoder layers (a feature head without layer ids fuses EAGLE-3's default)


def pair_limits(target: LoadedModel | ModelInfo, draft: LoadedModel | ModelInfo | None = None,
                max_draft_length: int = DRAFT_LENGTH_CAP, kv_tokens: int | None = None) -> Limits:
    """What a request may ask of this target and draft together: ids below the smaller of their
    embeddings and the tokenizer (a Qwen2.5 7B target embeds 128 padding ids its 0.5B draft
    lacks), and the shorter of their contexts."""
    models = [m for m in (target, draft) if m is not None]
    contexts = [m.max_positions for m in models if m.max_positions is not None]
    return Limits(min(m.token_limit for m in models), min(contexts) if contexts else None, max_draft_length, kv_tokens)


def load_model_info(path: str) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    _check_local_path(path)
    repo, revision = split_revision(path)  # owner/name@revision: pinned
    try:
        tokenizer = AutoTokenizer.from_pretrained(repo, revision=revision)
        config = AutoConfig.from_pretrained(repo, revision=revision).get_text_config(decoder=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path!r}: {_first_line(exc)}") from None
    try:
        eos = GenerationConfig.from_pretrained(repo, revision=revision).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ModelInfo(path, tokenizer, config.vocab_size, getattr(config, "max_position_embeddings", None), eos_ids,
                     token_limit=min(len(tokenizer), config.vocab_size),
                     num_layers=getattr(config, "num_hidden_layers", None))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_local_path(path: str) -> None:
    if looks_like_local_path(path) and not os.path.isdir(path):
        raise ModelLoadError(f"no model directory at {path!r}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path!r} is not a Hugging Face model directory (no config.json)")


def _eos_ids(model: PreTrainedModel, tokenizer) -> tuple[int, ...]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def check_same_vocabulary(target: LoadedModel | ModelInfo, draft: LoadedModel | ModelInfo) -> None:
    """The draft must map every token to the same id as the target (logit widths may differ, as in
    Qwen2.5 0.5B/7B: the draft's q is padded or cut to the target's width)."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab == d_vocab:
        return
    differing = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
    example = differing[0] if differing else ("?", -1)
    raise ModelLoadError(
        f"draft {draft.path!r} ({len(d_vocab)} tokens) does not share the vocabulary of target "
        f"{target.path!r} ({len(t_vocab)} tokens); first difference: token {example[0]!r} "
        f"at id {example[1]}"
    )


def encode(tokenizer, prompt: str | list[int]) -> tuple[int, ...]:
    """Token ids of a prompt (ids pass through; the engine checks their range)."""
    if isinstance(prompt, list):
        return tuple(prompt)
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise InvalidRequest("prompt encodes to no tokens")
    return tuple(ids)


HEAD_ARCHITECTURE = "Eagle"  # in config.json's architectures: a directory holding a feature head


def is_feature_head(path: str | None) -> bool:
    """Whether a draft directory holds a feature head (its config.json names an EAGLE architecture)."""
    if path is None:
        return False
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    return isinstance(architectures, list) and any(HEAD_ARCHITECTURE in str(a) for a in architectures)
