"""A pair's stored `auto` prior: a file beside the draft ({"weights": [...], "cost": tau}; save_prior
writes one from an estimate, the embedded pair ships one), read by whichever process builds the
pair's estimate (the target worker's actor, the in-process engine). Reading it loads no model."""

from __future__ import annotations

import json
import math
from pathlib import Path

from svip_common.acceptance import FEATURES, PRIOR_WEIGHTS, AutoEstimate
from svip_common.auto_settings import AutoSettings

PRIOR_FILE = "svip_auto_prior.json"  # in the draft's directory: the pair's stored prior (`svip calibrate`)


def stored_prior(draft_path: str | None) -> dict | None:
    """The prior stored beside a draft ({"weights": [...], "cost": tau}), or None (none there, or
    not readable as one: then the pair starts from the generic prior, or measures its own)."""
    if draft_path is None:
        return None
    try:
        data = json.loads((Path(draft_path) / PRIOR_FILE).read_text())
        prior = {"weights": [float(w) for w in data["weights"]], "cost": float(data["cost"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(prior["weights"]) != len(PRIOR_WEIGHTS) or not all(map(math.isfinite, prior["weights"])):
        return None
    if not math.isfinite(prior["cost"]) or prior["cost"] <= 0:
        return None
    return prior


def estimate_from(prior: dict | None, settings: AutoSettings = AutoSettings()) -> AutoEstimate:
    """A pair's `auto` estimate from a stored prior (None: the generic one)."""
    if prior is None:
        return AutoEstimate(settings=settings)
    return AutoEstimate(tuple(prior["weights"]), prior["cost"], settings)


def save_prior(estimate: AutoEstimate, draft_path: str) -> Path:
    path = Path(draft_path) / PRIOR_FILE
    model = estimate.model(True)
    path.write_text(json.dumps({"weights": [round(w, 6) for w in model.weights], "cost": round(estimate.prior_cost, 6),
                                "features": list(FEATURES)}, indent=1) + "\n")
    return path
