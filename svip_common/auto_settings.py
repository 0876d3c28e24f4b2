"""The `auto` policy's knobs for a deployment (svip_common/acceptance.py is the model they set).
No torch: the CLI and the Serve app's settings check them without loading the model stack."""

from __future__ import annotations

import math
from dataclasses import dataclass

from svip_common.errors import InvalidRequest

WINDOW = 4096  # verdicted tokens the live fit rests on (the newest)
MAX_AUTO_COST = 10.0  # a configured tau beyond this is refused (1 already means drafting never pays)
MIN_WINDOW, MAX_WINDOW = 64, 1 << 20


@dataclass(frozen=True)
class AutoSettings:
    """A deployment's `auto` knobs: learn (keep fitting on live verdicts; off: the prior stays,
    for reproducible lengths), cost (a fixed tau in place of the measured one; None: measured)
    and window (verdicted tokens the fit rests on)."""

    learn: bool = True
    cost: float | None = None
    window: int = WINDOW

    def check(self) -> AutoSettings:
        if self.cost is not None and (not math.isfinite(self.cost) or not 0.0 < self.cost <= MAX_AUTO_COST):
            raise InvalidRequest(f"auto cost must be a number in (0, {MAX_AUTO_COST}], got {self.cost}")
        if not MIN_WINDOW <= self.window <= MAX_WINDOW:
            raise InvalidRequest(f"auto window must be in [{MIN_WINDOW}, {MAX_WINDOW}] tokens, got {self.window}")
        return self
