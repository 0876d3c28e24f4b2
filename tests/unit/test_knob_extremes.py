"""Every knob at its extremes (tests/knob_extremes.py) gets the answer its case names from the
parser and the deployment's checks: a 400 that names the field, or a request that is served.
And a served one warps to a proper distribution: finite, summing to one, never an empty set."""

from __future__ import annotations

import pytest
import torch

from svip_common.contracts import Limits
from svip_common.errors import InvalidRequest
from svip_common.sampling import warp_probs
from svip_serve.protocol import ApiError
from tests.knob_extremes import CASES, generation_request

LIMITS = Limits(tokens=320, positions=512)
PROMPT = (5, 6, 7)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_extreme_gets_its_answer(case):
    try:
        request = generation_request(case.body(), PROMPT, LIMITS)
    except ApiError as exc:
        assert case.outcome == "400", exc.message
        assert exc.status == 400 and exc.message
        return
    except InvalidRequest as exc:  # the deployment's checks: the server answers these 400 too
        assert case.outcome == "400", str(exc)
        return
    assert case.outcome == "ok", f"served: {request}"
    logits = torch.randn(4, 320, generator=torch.Generator().manual_seed(0)) * 8
    logits[:, 300:] = float("-inf")  # padding columns, as mask_padding leaves them (NaN at T > 3.4e38 once)
    probs = warp_probs(logits, request.sampling)
    assert torch.isfinite(probs).all() and (probs > 0).any(dim=-1).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))
