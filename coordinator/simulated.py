"""The distributed pipeline on simulated devices: the in-memory pair (in_memory.py), every message
and every step of both workers real, the real models giving every token, but time virtual. Each
model forward takes the time its device's step model says (svip_common/device_profile.py: the
target on its devices, the draft on its own), each message its link's, and each worker's host
work (everything of a step but its forward: the protocol, the sessions, serialising) the time it
really takes on this machine, times ``host_scale``. Deterministic and independent of this
machine's load, but for that host work.

Each worker is a timeline: it runs one thing at a time (a message, a batched step) from when it
is free and the thing is there. The simulation takes events in time order: a message arriving, a
worker's step finishing, a worker starting work. A step's own results (a verdict's decision, a
drafted block) join its worker's queue when the step finishes, after what arrived meanwhile, as on
a real device. What it does not model yet: two workers sharing a device (the in-process engine
beside the target), and contention on the link. Checked against device timing on this machine
(`svip bench --mode device`: the real workers, each forward held to its step model's time): the
two agree within 10% in 13 of 14 cells (README.md, docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from coordinator.in_memory import InMemoryPair
from svip_common.device_profile import StepModel
from svip_common.emulation import Emulation

WORKERS = ("target", "draft")


class WorkerClock:
    """One worker's virtual time, read as the machine's clock is (a callable)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Timeline:
    clock: WorkerClock
    free_at: float = 0.0
    finishing: float | None = None  # a batched step in flight ends then (its results held until)
    forward_s: float = 0.0  # simulated device time of the step running
    device_wall_s: float = 0.0  # of the step running: what this machine's forwards took (not host work)
    step_started: float | None = None  # this machine's time the step running began (None: none runs)
    busy_s: float = 0.0
    host_s: float = 0.0


@dataclass
class SimulatedRun:
    """What a run took in virtual time."""

    makespan_s: float
    tokens: int
    per_request_s: list[float] = field(default_factory=list)
    busy_s: dict = field(default_factory=dict)
    host_s: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)  # the run's requests (in_memory.Pending), in order


class SimulatedPair(InMemoryPair):
    def __init__(self, target, verifier, drafter, limits, pipeline: str, emulation: Emulation,
                 host_scale: float = 1.0, **host_options):
        """emulation: the target's and the draft's devices (their step models, times its scale) and
        the link between them (svip_common/emulation.py, the spec device timing reads too);
        host_scale: this machine's host work, times this, is the simulated host's."""
        self.timelines = {w: Timeline(WorkerClock()) for w in WORKERS}
        super().__init__(target, verifier, drafter, limits, pipeline, clock=self.timelines["target"].clock,
                         draft_clock=self.timelines["draft"].clock, **host_options)
        self.link, self.host_scale, self.now = emulation.link, host_scale, 0.0
        self.scale = emulation.scale
        self.arrivals: dict[str, list[float]] = {name: [] for name in self.wires}
        self.finished_at: dict[str, float] = {}
        self._device(verifier.pool, "target", emulation.target)
        if drafter is not None:  # the draft worker times its steps with their host work so far, as a real one, and
            # each block's own work by the same clock (its draft_s, by which the target prices a block's wait)
            self.draft.timer = drafter.host_timer = lambda: self._timeline_now("draft")
        if drafter is not None and drafter.pool is not None:
            self._device(drafter.pool, "draft", emulation.draft)
        elif drafter is not None:  # a feature head: no pool, its steps timed whole
            drafter.time_as(_OnTimeline(self, self.timelines["draft"], emulation.draft))

    def _device(self, pool, worker: str, step: StepModel) -> None:
        """The pool's forwards take the step model's time on the worker's timeline."""
        real = pool.timed_forward
        timeline = self.timelines[worker]

        def timed_forward(steps, layers=()):
            shape = [(len(new), len(seq)) for seq, new, *_ in steps]  # before the forward: the cached tokens
            started = time.perf_counter()
            rows, features, _ = real(steps, layers)
            timeline.device_wall_s += time.perf_counter() - started
            seconds = step.forward_s(shape) * self.scale
            timeline.forward_s += seconds
            timeline.clock.now += seconds
            return rows, features, seconds

        pool.timed_forward = timed_forward

    # --- running ------------------------------------------------------------------------------------

    def run_all(self, requests) -> SimulatedRun:
        """Every request in flight from when the pair is next quiet (time 0 when new; after the
        last run's end, the workers keeping what they learnt as deployed ones do), to the last
        one's end; the times are from that start."""
        start = self.now = max(self.now, *(line.free_at for line in self.timelines.values()))
        busy = {w: t.busy_s for w, t in self.timelines.items()}
        host = {w: t.host_s for w, t in self.timelines.items()}
        pending = [self.submit(r) for r in requests]
        self.run()
        ends = [self.finished_at[p.session_id] - start for p in pending]
        return SimulatedRun(max(ends), sum(len(p.result().token_ids) for p in pending), ends,
                            {w: t.busy_s - busy[w] for w, t in self.timelines.items()},
                            {w: t.host_s - host[w] for w, t in self.timelines.items()}, pending)

    def step(self) -> str | None:
        self._stamp()
        event = self._next_event()
        if event is None:
            return None
        at, _, kind, name = event
        self.now = max(self.now, at)
        getattr(self, f"_event_{kind}")(name)
        self._stamp()
        self.steps += 1
        return f"{kind} {name}"

    def _next_event(self):
        events = []
        for name, wire in self.wires.items():
            if wire.in_flight:
                events.append((self.arrivals[name][0], 0, "arrive", name))
        for worker in self._workers():
            line = self.timelines[worker]
            if line.finishing is not None:
                events.append((line.finishing, 1, "finish", worker))
                continue
            start = max(line.free_at, self.now)
            service = self.host if worker == "target" else self.draft
            if service.compute.inbox:
                events.append((start, 2, "work", worker))
            elif f"{worker}_idle" not in self._idle_spent:
                events.append((start, 3, "step", worker))
            elif (wake_in := service.compute.wake_in()) is not None:  # a step held for blocks to come
                events.append((max(line.clock.now + wake_in, start), 3, "wake", worker))
        return min(events) if events else None

    def _workers(self) -> list[str]:
        return ["target"] if self.draft is None else list(WORKERS)

    # --- events -------------------------------------------------------------------------------------

    def _event_arrive(self, name: str) -> None:
        """The messages on ``name`` that have arrived by now reach their receiver's queue."""
        wire, times = self.wires[name], self.arrivals[name]
        arrived = sum(1 for t in times if t <= self.now)
        burst, wire.in_flight = wire.in_flight[:arrived], wire.in_flight[arrived:]
        del times[:arrived]
        self._deliver(name, burst, self.now)
        self._idle_spent.clear()

    def _event_work(self, worker: str) -> None:
        service = self.host if worker == "target" else self.draft
        self._timed(worker, service.compute.run_one)
        self._idle_spent.clear()

    def _event_step(self, worker: str) -> None:
        service = self.host if worker == "target" else self.draft
        if self._timed(worker, lambda: service.compute.run_idle(hold=True)):
            self.timelines[worker].finishing = self.timelines[worker].free_at  # its results wait for its end
        else:
            service.compute.release()
            self._idle_spent.add(f"{worker}_idle")

    def _event_wake(self, worker: str) -> None:
        """A held step's time is up: the target looks at it again (IdleWork.holds_step)."""
        self._idle_spent.discard(f"{worker}_idle")

    def _event_finish(self, worker: str) -> None:
        line = self.timelines[worker]
        line.finishing = None
        (self.host if worker == "target" else self.draft).compute.release()
        self._idle_spent.clear()

    def _timed(self, worker: str, fn):
        """Run fn on the worker's timeline from now: its device time as simulated, its host work
        as measured here (times host_scale)."""
        line = self.timelines[worker]
        start = max(line.free_at, self.now)
        line.clock.now, line.forward_s, line.device_wall_s = start, 0.0, 0.0
        started = line.step_started = time.perf_counter()
        try:
            out = fn()
        finally:
            line.step_started = None
        host = self._host_so_far(line, started)
        line.host_s += host
        end = start + line.forward_s + host
        line.clock.now = line.free_at = end
        line.busy_s += end - start
        return out

    def _timeline_now(self, worker: str) -> float:
        """The worker's time now, within a step too: its device time so far and its host work so far
        (times host_scale), as a real worker's timer reads both."""
        line = self.timelines[worker]
        if line.step_started is None:
            return line.clock.now
        return line.clock.now + max(self._host_so_far(line, line.step_started), 0.0)

    def _host_so_far(self, line: Timeline, started: float) -> float:
        """The host work of the step that began at ``started`` (this machine's time), times host_scale:
        this machine's time since, less what its forwards took."""
        return (time.perf_counter() - started - line.device_wall_s) * self.host_scale

    # --- the wire, stamped --------------------------------------------------------------------------

    def _stamp(self) -> None:
        """What the workers emitted goes onto the wire, each message arriving a link's time after
        its sender's clock now (in order: a link delivers in order)."""
        self._flush()
        for name, wire in self.wires.items():
            times = self.arrivals[name]
            for data in wire.in_flight[len(times):]:
                last = times[-1] if times else 0.0
                times.append(max(last, self._sent_at(name) + self._transit_s(name, len(data))))

    def _sent_at(self, name: str) -> float:
        sender = {"to_caller": "target", "to_target": "draft", "to_draft": "target"}.get(name)
        return self.timelines[sender].clock.now if sender else self.now  # to_host: the caller's now

    def _transit_s(self, name: str, nbytes: int) -> float:
        """Between the workers, the link's; the caller sits beside the target (no transit)."""
        return self.link.transfer_s(nbytes) if name in ("to_draft", "to_target") else 0.0

    def _caller_event(self, event) -> None:
        super()._caller_event(event)
        kind = event.WhichOneof("kind")
        if kind in ("finished", "error"):
            self.finished_at[getattr(event, kind).session_id] = self.now


class _OnTimeline:
    """A feature head's device timing in the simulation (it has no pool whose forwards to time):
    each of its steps lasts its step model's time on the draft's timeline, as a pool's forward
    does in ``SimulatedPair._device``."""

    virtual = True

    def __init__(self, pair: SimulatedPair, timeline: Timeline, step: StepModel):
        self.pair, self.timeline, self.step = pair, timeline, step
        self.last_s = 0.0  # the last step's simulated time (what the drafter reports it took)

    @contextlib.contextmanager
    def forward(self, sequences):
        started = time.perf_counter()
        yield
        self.timeline.device_wall_s += time.perf_counter() - started
        seconds = self.last_s = self.step.forward_s(sequences) * self.pair.scale
        self.timeline.forward_s += seconds
        self.timeline.clock.now += seconds
