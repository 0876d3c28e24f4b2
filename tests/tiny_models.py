"""Small random-init model pairs the tests build and save, so every load goes through the same
``from_pretrained`` path as a real model. A byte-level BPE tokenizer is trained on a few lines of
text and saved beside each model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts, then verifies.",
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.getcwd(), sys.argv)\n",
    "A draft model knows when to stop: it keeps proposing tokens until its entropy is high.",
]


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token=None, pad_token="<|endoftext|>"
    )


def build_model(
    tokenizer,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    logit_scale: float = 1.0,
    max_positions: int = 512,
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
) -> LlamaForCausalLM:
    """A random Llama. logit_scale > 1 sharpens its next-token distributions (low entropy).
    width > len(tokenizer): embeddings and logits with padding rows past the tokenizer (as Qwen2.5
    checkpoints have), whose logits are made huge, so a model that did not mask them would pick them."""
    config = LlamaConfig(
        vocab_size=width or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        model.lm_head.weight[len(tokenizer):].mul_(100.0)  # padding rows, if any
    return model.to(dtype).eval()


def save_model(directory: Path, tokenizer, model) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory)
    return str(directory)


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """The same architecture and weights plus Gaussian noise (relative to each weight's std):
    a draft that agrees with the target often, but not always."""
    generator = torch.Generator().manual_seed(seed)
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            scale = param.std() if param.numel() > 1 else param.abs()
            param.add_(torch.randn(param.shape, generator=generator) * noise * scale)
    return copy.eval()
