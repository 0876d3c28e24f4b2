"""Structured output (issue 45; svip_common/grammar.py, grammar_mask.py): a grammar masks every
row, the target's and the draft's, to what it allows after the tokens before the place. Greedy
output equals the target decoding alone with the same grammar, token for token, in process (one
at a time, batched, as trees) and through both pipelines (the grammar crosses the wire); a JSON
schema's answer parses and validates for every policy; sampled output follows the masked target's
distribution (chi-square); a grammar that does not compile or is too large is refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest, PolicyConfig, SamplingParams
from svip_common.errors import InvalidRequest
from svip_common.grammar import MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH, Grammar
from svip_common.grammar_mask import GrammarMask, grammar_tokenizer
from svip_common.sampling import warp_probs
from tests.integration.test_in_memory import DRAFT_FIRST, TARGET_FIRST, make_pair
from tests.integration.test_sampling_exact import ALPHA, chi_square_pvalue
from tests.policies import POLICIES, TREE_POLICIES

MAX_NEW = 40
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"], "additionalProperties": False}
GRAMMARS = {
    "json_object": Grammar("json_object"),
    "json_schema": Grammar.of_schema(SCHEMA),
    "regex": Grammar("regex", r"(def|class) [a-z_]{1,12}\((x|y)?\):"),
    "lark": Grammar("lark", 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/'),
}


@pytest.fixture(scope="module")
def alone(models):
    return SpeculativeEngine(models["target"], None)


def _request(ids, grammar, policy=POLICIES["svip"], sampling=SamplingParams()) -> GenerationRequest:
    return GenerationRequest(ids, MAX_NEW, SamplingParams(**{**vars(sampling), "grammar": grammar}), policy)


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_greedy_equals_the_target_alone_with_the_grammar_in_process(models, prompt_ids, alone, grammar):
    """One at a time and batched, chains, CaPE's trees and deep ones: the target alone's tokens, which the
    grammar allows (a deep tree's children drafted under it along their siblings' paths)."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    requests = [_request(ids, GRAMMARS[grammar], policy)
                for ids in prompt_ids.values()
                for policy in (POLICIES["svip"], TREE_POLICIES["constant-cape"], TREE_POLICIES["svip-deep"])]
    expected = [alone.generate(r).token_ids for r in requests]
    results = [engine.generate(r) for r in requests]
    assert [r.token_ids for r in results] == expected
    assert [r.token_ids for r in engine.generate_many(requests, len(requests))] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the draft drafted under the grammar too
    for request, tokens in zip(requests, expected):
        _check_allowed(models, GRAMMARS[grammar], tokens)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize("schedule", ["target first", "draft first"])
def test_greedy_equals_the_target_alone_with_the_grammar_across_the_workers(models, prompt_ids, alone, pipeline,
                                                                            schedule):
    pair = make_pair(models, pipeline, TARGET_FIRST if schedule == "target first" else DRAFT_FIRST)
    requests = [_request(ids, grammar, policy) for ids in prompt_ids.values() for grammar in GRAMMARS.values()
                for policy in (POLICIES["svip"], TREE_POLICIES["svip-cape"])]
    results = pair.generate_all(requests)
    assert [r.token_ids for r in results] == [alone.generate(r).token_ids for r in requests]
    assert all(r.stats.detached == 0 for r in results)
    if schedule == "draft first":  # (target first: the target settles its own tokens while blocks are on their way)
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("policy", [*POLICIES, *TREE_POLICIES])
def test_a_json_schema_answer_parses_and_validates_for_every_policy(models, prompt_ids, policy):
    """Long enough to close (the schema bounds the answer), the text is JSON its schema accepts."""
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    tok = models["target"].tokenizer
    for ids in prompt_ids.values():
        result = engine.generate(GenerationRequest(ids, 200, SamplingParams(grammar=GRAMMARS["json_schema"]),
                                                   (POLICIES | TREE_POLICIES)[policy]))
        assert result.finish_reason == "stop", tok.decode(result.token_ids)
        jsonschema.validate(json.loads(tok.decode(result.token_ids, skip_special_tokens=True)), SCHEMA)


@pytest.mark.parametrize("pipeline", ["async", pytest.param("sync", marks=pytest.mark.system)])
def test_sampled_output_follows_the_masked_target(models, prompt_ids, pipeline):
    """The first two tokens of 1,500 seeded requests through the workers, a grammar on them: they
    fit the target's marginals under the grammar's masks, not the unmasked target's."""
    grammar = GRAMMARS["regex"]
    prompt = prompt_ids["medium"]
    sampling = SamplingParams(temperature=1.0)
    pair = make_pair(models, pipeline)
    requests = [GenerationRequest(prompt, 3, SamplingParams(temperature=1.0, seed=s, grammar=grammar),
                                  PolicyConfig(name="constant", draft_length=3)) for s in range(1500)]
    results = [r for i in range(0, len(requests), 50) for r in pair.generate_all(requests[i:i + 50])]
    assert sum(a < d for r in results for a, d in zip(r.stats.accepted_lengths, r.stats.draft_lengths)) > 0
    firsts, seconds = [r.token_ids[0] for r in results], [r.token_ids[1] for r in results]
    p1, p2 = _masked_marginals(models, prompt, sampling, grammar)
    assert chi_square_pvalue(firsts, p1) > ALPHA and chi_square_pvalue(seconds, p2) > ALPHA
    free1, _ = _masked_marginals(models, prompt, sampling, None)
    assert chi_square_pvalue(firsts, free1) < ALPHA


@pytest.mark.parametrize("grammar, words", [
    (Grammar("yaml", "a: 1"), "unknown grammar kind 'yaml'"),
    (Grammar("regex", "[a-"), "the regex does not compile"),
    (Grammar("regex", ""), "an empty regex"),
    (Grammar("json_object", "{}"), "a json_object grammar takes no text"),
    (Grammar("json_schema", "{not json"), "the json_schema is not JSON"),
    (Grammar("json_schema", "[1]"), "must be a JSON object"),
    (Grammar("json_schema", '{"type": "foo"}'), "does not compile"),
    (Grammar("json_schema", '{"a":' * (MAX_SCHEMA_DEPTH + 1) + "1" + "}" * (MAX_SCHEMA_DEPTH + 1)), "nests 33 deep"),
    (Grammar("json_schema", "[" * 60_000), "nests too deep"),
    (Grammar("regex", "a" * (MAX_GRAMMAR_BYTES + 1)), f"at most {MAX_GRAMMAR_BYTES}"),
    (Grammar("lark", "start: undefined_rule"), "the lark does not compile"),
])
def test_a_bad_grammar_is_refused_by_name(models, prompt_ids, alone, grammar, words):
    with pytest.raises(InvalidRequest, match=words) as err:
        alone.generate(_request(prompt_ids["short"], grammar))
    assert "\n" not in str(err.value)


def _check_allowed(models, grammar: Grammar, tokens: list[int]) -> None:
    """Each token was one the grammar allowed at its place."""
    target = models["target"]
    mask = GrammarMask(grammar, grammar_tokenizer(target.tokenizer, target.vocab_size))
    for i, token in enumerate(tokens):
        assert mask.allowed(tokens[:i], target.vocab_size, "cpu")[token], (i, token)


def test_sessions_of_one_grammar_compile_it_once_and_move_apart(models):
    """A worker compiles a grammar once (grammar_mask.COMPILED) and each session moves its own copy:
    one session's path leaves another's mask, and the compiled one, where they were."""
    from svip_common.grammar_mask import COMPILED

    target = models["target"]
    tokenizer = grammar_tokenizer(target.tokenizer, target.vocab_size)
    grammar = Grammar("regex", "(ab|ba)+c(d|e)")
    before = COMPILED.compiles
    first, second = GrammarMask(grammar, tokenizer), GrammarMask(grammar, tokenizer)
    assert COMPILED.compiles - before == 1
    start = first.allowed([], target.vocab_size, "cpu")
    path = [int(start.nonzero()[0])]
    moved = first.allowed(path, target.vocab_size, "cpu")
    assert not torch.equal(moved, start)
    assert torch.equal(second.allowed([], target.vocab_size, "cpu"), start)
    assert torch.equal(GrammarMask(grammar, tokenizer).allowed([], target.vocab_size, "cpu"), start)


def _masked_marginals(models, prompt, sampling, grammar) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1) and p(t2) = sum_x p(t1 = x) p(t2 | x) of the target with each place's mask."""
    target = models["target"]
    vocab = target.vocab_size
    masks = None if grammar is None else GrammarMask(grammar, grammar_tokenizer(target.tokenizer, vocab))

    def masked(logits, before):
        if masks is not None:
            logits = logits.masked_fill(~masks.allowed(before, vocab, "cpu"), float("-inf"))
        return logits

    with torch.inference_mode():
        first = target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        p1 = warp_probs(masked(first, [])[None], sampling)[0].double()
        allowed = [x for x in range(vocab) if p1[x] > 0]
        inputs = torch.tensor([[*prompt, x] for x in allowed])
        second = target.model(input_ids=inputs).logits[:, -1]
        rows = torch.stack([masked(second[i], [x]) for i, x in enumerate(allowed)])
        p2_given = warp_probs(rows, sampling).double()
    return p1, p1[allowed] @ p2_given


def test_a_feature_head_drafts_under_the_grammar_and_the_output_is_the_target_alones(prompt_ids):
    """The embedded target with its head: the head's rows masked as the target's (it has the
    target's tokenizer), greedy output equal to the target alone's with the grammar, in process
    and through both pipelines."""
    from draft_worker.feature_draft import load_feature_draft
    from svip_assets import default_head, default_pair
    from svip_common.models import load_model
    from tests.integration.test_feature_draft_distributed import pair_for

    target = load_model(default_pair()[0])
    head = load_feature_draft(default_head(), target)
    requests = [GenerationRequest(tuple(target.tokenizer(text)["input_ids"]), MAX_NEW,
                                  SamplingParams(grammar=GRAMMARS[name]), POLICIES["svip"])
                for text in ("Reply in JSON:", "def parse(argv):") for name in ("json_schema", "regex")]
    expected = [SpeculativeEngine(target, None).generate(r).token_ids for r in requests]
    results = [SpeculativeEngine(target, head, load_aware="off").generate(r) for r in requests]
    assert [r.token_ids for r in results] == expected and sum(r.stats.accepted_tokens for r in results) > 0
    for pipeline in ("sync", "async"):
        assert [r.token_ids for r in pair_for(target, head, pipeline).generate_all(requests)] == expected
