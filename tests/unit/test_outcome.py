"""A verdict's outcome, decided once on the target and applied by the draft (svip_common/outcome.py):
what each kind leaves known, the prepared continuation it selects, the consistency a peer's is held
to, and its trip over the wire (an older peer's, with no ``next``, read from its other fields)."""

from __future__ import annotations

import pytest

from svip_common.contracts import NO_TOKEN
from svip_common.errors import InvalidRequest
from svip_common.messages import Feedback
from svip_common.outcome import DRAW, FOLLOWUP, PREPARED, SETTLED, Outcome, outcome_of
from svip_proto import convert

TOKENS = [11, 12, 13, 14]


def test_each_kind_leaves_known_what_its_verdict_settled():
    assert outcome_of(2, 10, 4, 4, NO_TOKEN, (), True, False).next == FOLLOWUP
    settled = outcome_of(2, 10, 4, 1, 99, (), False, False)
    assert settled.next == SETTLED and settled.known(TOKENS) == [11, 99] and settled.prepared_key == (10, 1, 99)
    drawn = outcome_of(2, 10, 4, 1, NO_TOKEN, (), False, False)
    assert drawn.next == DRAW and drawn.known(TOKENS, correction=42) == [11, 42]
    assert drawn.prepared_key_for(42) == (10, 1, 42)
    branch = outcome_of(2, 10, 4, 2, 77, (5, 6), False, False)  # a tree's sibling and a node below it
    assert branch.known(TOKENS) == [11, 12, 5, 6, 77] and branch.prepared_key == (10, 2, 5)
    after = outcome_of(2, 10, 4, 2, 77, (5, 6), False, True)  # the continuation prepared after the sibling
    assert after.next == PREPARED and after.after_sibling and after.known(TOKENS) == [11, 12, 5]


def test_past_a_sibling_a_verdict_settled_its_nodes_below_it_and_the_targets_token():
    """Outcome.below_sibling: what a continuation prepared after the sibling goes on past where it
    drafted the same; nothing where no sibling was taken, its continuation goes on (PREPARED), or
    the draft draws the token (DRAW)."""
    assert outcome_of(2, 10, 4, 2, 77, (5, 6), False, False).below_sibling == (6, 77)
    assert outcome_of(2, 10, 4, 2, 77, (5,), False, False).below_sibling == (77,)
    assert outcome_of(2, 10, 4, 2, 77, (), False, False).below_sibling is None
    assert outcome_of(2, 10, 4, 2, 77, (5,), False, True).below_sibling is None
    assert outcome_of(2, 10, 4, 2, NO_TOKEN, (5,), False, False).below_sibling is None


@pytest.mark.parametrize("fields, words", [
    ((1, 10, 4, 5, 7, SETTLED), "accepts 5 of 4"),
    ((1, 10, 4, 3, 7, FOLLOWUP), "accepts the whole block"),
    ((1, 10, 4, 4, NO_TOKEN, DRAW), "follows a rejection"),
    ((1, 10, 4, 2, NO_TOKEN, PREPARED), "settles a token"),
    ((1, 10, 4, 4, 7, PREPARED), "follows a rejection"),
    ((1, 10, 4, 2, 7, "later"), "unknown outcome"),
])
def test_an_inconsistent_outcome_is_refused_by_name(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        Outcome(*fields)


def test_the_outcome_travels_whole_and_an_older_peers_is_read_from_its_fields():
    for outcome in (Outcome(3, 10, 4, 4, NO_TOKEN, FOLLOWUP), Outcome(3, 10, 4, 1, 9, PREPARED),
                    Outcome(3, 10, 4, 1, NO_TOKEN, DRAW), Outcome(3, 10, 4, 2, 8, SETTLED, (5,))):
        msg = convert.draft_request_to_proto(Feedback("s", outcome)).feedback
        assert convert.feedback_from_proto(msg, 16).outcome == outcome
        msg.ClearField("next")  # an older peer
        assert convert.feedback_from_proto(msg, 16).outcome == outcome
    msg = convert.draft_request_to_proto(Feedback("s", Outcome(3, 10, 4, 1, 9, PREPARED))).feedback
    msg.prepared_used = False
    with pytest.raises(InvalidRequest, match="prepared_used disagrees"):
        convert.feedback_from_proto(msg, 16)
