"""The rules a request applies to the target's rows by place (svip_common/row_rules.py): each row
penalised by the tokens generated before its own place, and a request's stop ids held back until
min_tokens, computed by hand here."""

from __future__ import annotations

import torch

from svip_common.contracts import SamplingParams
from svip_common.row_rules import RowRules


def test_penalties_count_the_generated_tokens_before_each_place_not_the_prompt():
    rules = RowRules.of(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 2, frozenset())
    rows = torch.zeros(3, 6)
    out = rules.apply(rows, [4, 4], [[], [1], [1, 1, 3]])
    assert out[0].tolist() == [0.0] * 6  # nothing generated yet: the prompt's 4s do not count
    assert out[1].tolist() == [0, -0.75, 0, 0, 0, 0]
    assert out[2].tolist() == [0, -1.0, 0, -0.75, 0, 0]
    assert rows.abs().sum() == 0  # a new tensor


def test_min_tokens_holds_the_stop_ids_back_until_then():
    rules = RowRules.of(SamplingParams(min_tokens=2), 1, frozenset({0, 5, 99}))
    out = rules.apply(torch.zeros(3, 6), [7], [[], [2], [2, 3]])
    inf = float("-inf")
    assert out[0].tolist() == [inf, 0, 0, 0, 0, inf] and out[1].tolist() == [inf, 0, 0, 0, 0, inf]
    assert out[2].tolist() == [0.0] * 6  # two generated: free again (99 is past the row: ignored)


def test_no_knob_no_rule():
    assert not RowRules.of(SamplingParams(), 3, frozenset({0})).active
    assert not RowRules.of(SamplingParams(min_tokens=4), 3, frozenset()).active
    assert RowRules.of(SamplingParams(frequency_penalty=-0.1), 3, frozenset()).active


def test_repetition_divides_a_seen_tokens_positive_logit_and_multiplies_a_negative_one_prompt_included():
    rules = RowRules.of(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), 2, frozenset())
    rows = torch.tensor([[4.0, -4.0, 4.0, -4.0, 9.0]] * 2)
    out = rules.apply(rows, [0, 1], [[], [2, 2]])
    assert out[0].tolist() == [2.0, -8.0, 4.0, -4.0, 9.0]  # the prompt's 0 and 1 count; nothing generated yet
    assert out[1].tolist() == [2.0, -8.0, 1.0, -4.0, 9.0]  # 2 seen: 4 / 2, then its presence penalty
    assert RowRules.of(SamplingParams(repetition_penalty=0.5), 0, frozenset()).by_place
    assert not RowRules.of(SamplingParams(repetition_penalty=1.0), 0, frozenset()).active


def _by_hand(rules: RowRules, rows: torch.Tensor, before: list[list[int]]) -> torch.Tensor:
    """The rules row by row from each row's whole sequence (what apply computed before review M-2)."""
    out = rows.clone()
    width = rows.shape[-1]
    for r, tokens in enumerate(before):
        if rules.repetition != 1.0 and tokens:
            seen = torch.tensor(sorted({t for t in tokens if t < width}), dtype=torch.long)
            values = out[r, seen]
            out[r, seen] = torch.where(values > 0, values / rules.repetition, values * rules.repetition)
        generated = tokens[rules.prompt_len:]
        if generated:
            counts = torch.bincount(torch.tensor(generated), minlength=width)[:width].to(rows.dtype)
            out[r] -= rules.frequency * counts + rules.presence * (counts > 0).to(rows.dtype)
        if len(generated) < rules.min_tokens:
            out[r, [t for t in rules.stop_ids if t < width]] = float("-inf")
    return out


def test_running_counts_follow_appends_and_rolled_back_tails_as_counting_afresh_would():
    """Review M-2: a session's counts are kept between calls and brought to each call's committed
    tokens by what changed (appended tokens; a speculative tail taken back, as a draft's follow-up
    context is); every call equals the rules worked out from each row's whole sequence."""
    generator = torch.Generator().manual_seed(7)
    sampling = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_tokens=9)
    rules = RowRules.of(sampling, 5, frozenset({0, 3}))
    committed = torch.randint(0, 12, (5,), generator=generator).tolist()
    for _ in range(40):
        change = int(torch.randint(0, 3, (1,), generator=generator))
        if change == 0 and len(committed) > 6:
            committed = committed[: len(committed) - int(torch.randint(1, 4, (1,), generator=generator))]
        else:
            committed = committed + torch.randint(0, 14, (int(torch.randint(0, 4, (1,), generator=generator)),),
                                                  generator=generator).tolist()
        paths = [torch.randint(0, 14, (n,), generator=generator).tolist() for n in range(4)]
        rows = torch.randn(4, 12, generator=generator)
        expected = _by_hand(rules, rows, [committed + path for path in paths])
        assert torch.allclose(rules.apply(rows, committed, paths), expected, atol=1e-6)


def test_a_places_row_has_the_same_bits_whichever_of_its_tokens_are_committed():
    """Greedy exactness: the target alone commits every token before a place; speculation verifies
    the same place with some of them drafted (its row's path). The rules give both the same bits."""
    generator = torch.Generator().manual_seed(3)
    sampling = SamplingParams(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.9)
    sequence = torch.randint(0, 50, (40,), generator=generator).tolist()
    row = torch.randn(1, 50, generator=generator) * 7
    rows = {}
    for drafted in range(0, 12):
        rules = RowRules.of(sampling, 20, frozenset())
        rules.apply(row, sequence[:25 - drafted], [[]])  # an earlier call: the counts carried over
        rows[drafted] = rules.apply(row, sequence[:40 - drafted], [sequence[40 - drafted:]])
    assert all(torch.equal(rows[0], r) for r in rows.values())
