"""A target and a draft wider than their tokenizer, by different amounts (Qwen2.5 7B / 0.5B): ids
are checked against the smaller embedding and the tokenizer, everywhere a request enters; the
padding columns are never chosen, greedy or sampled; greedy output still equals the target alone
(Hugging Face's generate with the padding ids suppressed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_cli.main import main
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.models import load_model
from svip_common.pair_config import PairConfig

PROMPT = (5, 6, 7, 8)
MAX_NEW = 24
POLICIES = [
    PolicyConfig(name="svip", threshold=0.6),
    PolicyConfig(name="constant", draft_length=4),
    PolicyConfig(name="none"),
]


@pytest.fixture(scope="module")
def wide(wide_pair):
    return load_model(wide_pair.target), load_model(wide_pair.draft)


@pytest.fixture(scope="module")
def reference(wide, wide_pair):
    """The target alone through Hugging Face's greedy generate, padding ids suppressed."""
    model = wide[0].model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            suppress_tokens=list(range(wide_pair.tokens, wide_pair.target_width)),
        )
    unmasked = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert max(unmasked[0, len(PROMPT) :].tolist()) >= wide_pair.tokens  # unmasked, padding would win
    return out[0, len(PROMPT) :].tolist()


def test_the_pair_limits_are_the_smallest_width_and_the_tokenizer(wide, wide_pair):
    engine = SpeculativeEngine(*wide, load_aware="off")
    assert engine.limits.tokens == wide_pair.tokens
    assert wide[0].vocab_size == wide_pair.target_width and wide[1].vocab_size == wide_pair.draft_width


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_greedy_never_emits_padding_and_equals_the_target_alone(wide, reference, policy):
    engine = SpeculativeEngine(*wide, load_aware="off")
    result = engine.generate(GenerationRequest(PROMPT, MAX_NEW, policy=policy, ignore_eos=True))
    assert result.token_ids == reference


def test_sampling_never_emits_padding(wide, wide_pair):
    engine = SpeculativeEngine(*wide, load_aware="off")
    for seed in range(30):
        request = GenerationRequest(
            PROMPT, 12, SamplingParams(temperature=1.5, seed=seed), PolicyConfig(name="constant", draft_length=3)
        )
        assert max(engine.generate(request).token_ids) < wide_pair.tokens


@pytest.mark.parametrize("bad", ["draft_width", "target_width"])
def test_ids_past_the_smaller_embedding_are_refused(wide, wide_pair, bad):
    engine = SpeculativeEngine(*wide, load_aware="off")
    for token in (wide_pair.tokens, wide_pair.draft_width, getattr(wide_pair, bad) - 1):
        with pytest.raises(InvalidRequest, match=f"prompt token id {token} is outside the vocabulary"):
            engine.generate(GenerationRequest((5, token), 4))


def test_the_cli_refuses_them_too(wide_pair, capsys):
    code = main(
        [
            "generate",
            "--prompt-ids",
            f"5,{wide_pair.draft_width + 3}",
            "--target",
            wide_pair.target,
            "--draft",
            wide_pair.draft,
            "--max-new-tokens",
            "4",
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and f"prompt token id {wide_pair.draft_width + 3} is outside the vocabulary [0, {wide_pair.tokens})" in err
    )


@pytest.mark.system
def test_distributed_greedy_equals_the_target_alone_and_refuses_wide_ids(wide_pair, reference):
    import ray

    init_local_ray()
    pair = WorkerPair(PairConfig(wide_pair.target, wide_pair.draft))
    loop = asyncio.new_event_loop()
    try:
        assert pair.limits.tokens == wide_pair.tokens
        for mode in ("sync", "async"):
            engine = DistributedEngine(pair.target_info, pair.limits, pair.target_address, pair.draft_address, mode)
            loop.run_until_complete(engine.connect())
            result = loop.run_until_complete(
                engine.generate(
                    GenerationRequest(
                        PROMPT, MAX_NEW, policy=PolicyConfig(name="constant", draft_length=4), ignore_eos=True
                    )
                )
            )
            assert result.token_ids == reference, mode
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                loop.run_until_complete(engine.generate(GenerationRequest((5, wide_pair.draft_width), 4)))
            loop.run_until_complete(engine.close())
    finally:
        loop.close()
        pair.shutdown()
        ray.shutdown()
