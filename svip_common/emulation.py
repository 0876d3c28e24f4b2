"""The one way to name the devices a run is timed as, everywhere (`svip generate`, `svip serve`,
`svip bench` and `svip plan`):

    target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms,scale=2

``target`` and ``draft``: MODEL@DEVICE or MODEL@NxDEVICE from the shipped step models
(svip_common/device_profile.py); the draft may be left out (the target alone). In process both
models take turns on one device, the target's (``draft=llama-3.1-8b@4xh100`` beside
``target=...@4xh100`` names that placement; `svip bench --mode device` puts the draft there by
itself for its in-process row); distributed, each worker has a device of its own (a draft named on
devices like the target's gets devices like them). ``link``: between the draft's device and the
target's (node, 25gbe, 100gbe or a latency such as 0.1ms; default node). ``scale``: every step's
time times this (default 1), for a profile this machine cannot keep up with.

Device timing on this machine (svip_common/device_timing.py) and the simulated clock
(coordinator/simulated.py) read the same spec."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from svip_common.device_profile import Link, StepModel, link, step_model
from svip_common.device_timing import MAX_SCALE, EmulatedDevice, ForwardTiming
from svip_common.errors import InvalidRequest

KEYS = ("target", "draft", "link", "scale")


@dataclass(frozen=True)
class Emulation:
    spec: str  # as given (what a worker is handed: it parses it again)
    target: StepModel
    draft: StepModel | None
    link: Link
    scale: float = 1.0

    @property
    def draft_on_target_devices(self) -> bool:
        """The draft placed on the target's devices (the in-process placement)."""
        return self.draft is not None and (self.draft.device, self.draft.count) == (self.target.device,
                                                                                    self.target.count)

    def co_located(self) -> Emulation:
        """The same pair with the draft on the target's devices (the in-process placement)."""
        if self.draft is None or self.draft_on_target_devices:
            return self
        draft = dataclasses.replace(self.draft, device=self.target.device, count=self.target.count)
        placed = f"{draft.shape.name}@{self.target.count}x{self.target.device.name}"
        spec = ",".join(part if not part.strip().lower().startswith("draft=") else f"draft={placed}"
                        for part in self.spec.split(","))
        return dataclasses.replace(self, spec=spec, draft=draft)

    def target_timing(self) -> ForwardTiming:
        """A worker's target on a device of its own."""
        return EmulatedDevice(self.target.name, self.scale).timing(self.target)

    def draft_timing(self) -> ForwardTiming:
        """A worker's draft on a device of its own."""
        if self.draft is None:
            raise InvalidRequest(f"--emulate {self.spec!r} names no draft")
        return EmulatedDevice(self.draft.name, self.scale).timing(self.draft)

    def shared_timings(self, virtual: bool = False) -> tuple[ForwardTiming, ForwardTiming | None]:
        """The in-process engine's target and draft on one device: their forwards take turns
        (virtual: a device that waits for nothing and keeps the account, EmulatedDevice)."""
        device = EmulatedDevice(self.target.name, self.scale, sleep=None if virtual else time.sleep)
        return device.timing(self.target), None if self.draft is None else device.timing(self.draft)

    def describe(self) -> str:
        draft = "no draft" if self.draft is None else f"draft {self.draft.name}"
        scaled = "" if self.scale == 1 else f", every step's time x{self.scale:g}"
        return f"target {self.target.name}, {draft}, link {self.link.name}{scaled}"


def parse_emulation(spec: str, dtype: str = "bfloat16") -> Emulation:
    """The spec above, checked (a one-line InvalidRequest names the first thing wrong)."""
    fields: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise InvalidRequest(f"--emulate {spec!r}: write KEY=VALUE pairs separated by commas, e.g. "
                                 "target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms")
        if key not in KEYS:
            raise InvalidRequest(f"--emulate: unknown key {key!r}; known: {', '.join(KEYS)}")
        if key in fields:
            raise InvalidRequest(f"--emulate: {key} given twice")
        fields[key] = value
    if "target" not in fields:
        raise InvalidRequest(f"--emulate {spec!r}: target=MODEL@DEVICE is required")
    try:
        scale = float(fields.get("scale", "1"))
    except ValueError:
        raise InvalidRequest(f"--emulate: scale={fields['scale']!r} is not a number") from None
    if not 0 < scale <= MAX_SCALE:
        raise InvalidRequest(f"--emulate: scale must be in (0, {MAX_SCALE:g}], got {scale:g}")
    draft = step_model(fields["draft"], dtype) if "draft" in fields else None
    return Emulation(spec, step_model(fields["target"], dtype), draft, link(fields.get("link", "node")), scale)
