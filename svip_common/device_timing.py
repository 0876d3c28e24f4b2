"""Device timing on this machine: a model's forwards take the time its device's step model gives
(svip_common/device_profile.py), so the real pipeline (its workers, gRPC, Ray, the protocol, the
real models giving every token) runs here as it would beside GPUs, and what it loses is its own.

The real forward runs for the real tokens; then the thread waits out the rest of the step's time
off the CPU, as a GPU's host thread waits on its device. A forward slower than its step is counted
(``overruns``, ``overrun_s``) and reported, never hidden: that step took this machine's time, not
the device's. ``scale`` multiplies every step's time alike (the host's work is not scaled), so a
profile faster than this machine can keep up with still runs, slower by that factor, and says so.

One ``EmulatedDevice`` per worker; the in-process engine's draft and target share one, so their
forwards take turns on it (``lock``), as two models on one GPU do. Device timing changes when a
forward ends, never what it computes."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from svip_common.device_profile import StepModel

MAX_SCALE = 1000.0


@dataclass
class DeviceUse:
    """What an emulated device's forwards took."""

    forwards: int = 0
    device_s: float = 0.0  # the step models' time of every forward, scaled
    overruns: int = 0  # forwards this machine ran slower than their step
    overrun_s: float = 0.0  # the time they took past it
    real_s: float = 0.0  # what this machine's forwards took (a virtual device: wall - real_s + device_s)
    worst_ratio: float = 0.0  # a forward's real time over its step's, the largest seen

    def summary(self) -> str:
        return use_summary(dataclasses.asdict(self))


def use_summary(use: dict) -> str:
    """A device's use in words (a DeviceUse's fields, or a worker's report of them)."""
    if not use["forwards"]:
        return "no forwards"
    if not use["overruns"]:
        return f"{use['forwards']} forwards, every one within its step"
    return f"{use['overruns']} of {use['forwards']} forwards ran past their step ({use['overrun_s'] * 1e3:.1f} ms " \
           f"in all, the worst {use['worst_ratio']:.2f}x)"


class EmulatedDevice:
    def __init__(self, name: str, scale: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] | None = time.sleep):
        """name: what it stands for (its step models' devices); scale: every step's time times this;
        sleep None: a virtual device, which waits for nothing and only keeps the account (a run's
        time on it is its wall time less ``use.real_s`` plus ``use.device_s``)."""
        if not 0 < scale <= MAX_SCALE:
            raise ValueError(f"a device time scale must be in (0, {MAX_SCALE:g}], got {scale}")
        self.name, self.scale = name, scale
        self.clock, self.sleep = clock, sleep
        self.lock = threading.Lock()  # one forward at a time on a device
        self.use = DeviceUse()

    def timing(self, step: StepModel) -> ForwardTiming:
        """How a model placed on this device, whose forwards take ``step``'s time, is timed."""
        return ForwardTiming(self, step)

    def account(self, due_s: float, took_s: float) -> None:
        use = self.use
        use.forwards += 1
        use.device_s += due_s
        use.real_s += took_s
        if due_s > 0:
            use.worst_ratio = max(use.worst_ratio, took_s / due_s)
        if took_s > due_s:
            use.overruns += 1
            use.overrun_s += took_s - due_s


class ForwardTiming:
    """A model's forwards on an emulated device (what a KV pool's ``timing`` holds)."""

    def __init__(self, device: EmulatedDevice, step: StepModel):
        self.device, self.step = device, step
        self.last_s = 0.0  # the last forward's time on the device (a virtual one's: its step model's)

    @property
    def virtual(self) -> bool:
        """Waits for nothing: a forward's time is what the account says, not the clock."""
        return self.device.sleep is None

    def report(self) -> dict:
        """Its device's use so far, named (what `svip generate --json` and the benches print)."""
        return {"model": self.step.name, "scale": self.device.scale, **dataclasses.asdict(self.device.use)}

    @contextlib.contextmanager
    def forward(self, sequences: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Around one forward over ``sequences`` (new tokens, tokens cached before them): the device
        held for it, and the forward made to last its step's time."""
        device = self.device
        with device.lock:
            started = device.clock()
            yield
            due = self.step.forward_s(sequences) * device.scale
            took = device.clock() - started
            device.account(due, took)
            self.last_s = max(due, took) if device.sleep is not None else due
            if took < due and device.sleep is not None:
                device.sleep(due - took)
