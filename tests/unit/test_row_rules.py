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
    out = rules.apply(rows, [[4, 4], [4, 4, 1], [4, 4, 1, 1, 3]])
    assert out[0].tolist() == [0.0] * 6  # nothing generated yet: the prompt's 4s do not count
    assert out[1].tolist() == [0, -0.75, 0, 0, 0, 0]
    assert out[2].tolist() == [0, -1.0, 0, -0.75, 0, 0]
    assert rows.abs().sum() == 0  # a new tensor


def test_min_tokens_holds_the_stop_ids_back_until_then():
    rules = RowRules.of(SamplingParams(min_tokens=2), 1, frozenset({0, 5, 99}))
    out = rules.apply(torch.zeros(3, 6), [[7], [7, 2], [7, 2, 3]])
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
    out = rules.apply(rows, [[0, 1], [0, 1, 2, 2]])
    assert out[0].tolist() == [2.0, -8.0, 4.0, -4.0, 9.0]  # the prompt's 0 and 1 count; nothing generated yet
    assert out[1].tolist() == [2.0, -8.0, 1.0, -4.0, 9.0]  # 2 seen: 4 / 2, then its presence penalty
    assert RowRules.of(SamplingParams(repetition_penalty=0.5), 0, frozenset()).by_place
    assert not RowRules.of(SamplingParams(repetition_penalty=1.0), 0, frozenset()).active
