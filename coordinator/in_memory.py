"""The distributed pipeline in memory: the target worker's session host and the draft worker's
service (coordinator/session/host.py, draft_worker/service.py), with the real verifier and
drafter, run by hand in one thread, no sockets, no Ray. It is the third transport of the same
protocol (after gRPC workers and Ray actors), for the tests that must reach any interleaving and
for anything that wants the protocol without the network.

Every message crosses as the gRPC links carry it: serialised by its sender, a burst packed as one
message (svip_runtime/wire_batch.py), parsed and unpacked by the receiver, and handed to the same
entry points the links call. Each worker's compute loop is a ManualLoop (svip_runtime/compute_loop.py):
what arrived runs in order, idle work (a batched forward) only while nothing waits. A schedule
decides each step what happens next:

    to_target, to_draft, to_caller   the messages in flight that way arrive (posted to the receiver)
    target, draft                    the worker runs the oldest message or step posted to it
    target_idle, draft_idle          the worker's batched step (a verification, a draft forward);
                                     the schedule also says whether what is in flight towards that
                                     worker arrives during it (before the step's own results)

So a test can force a follow-up arriving mid-verify, a prepared continuation used late, a draft that
never answers (then ``check`` at a later clock: the stall), or a lost one (``lose_draft``).
The caller's end speaks as coordinator/distributed.py does (its StartSession, its error mapping)."""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from coordinator.distributed import OnTokens, error_from_proto, resolved, start_message
from coordinator.session.host import SessionHost
from draft_worker.service import DraftService
from svip_common.acceptance import AutoEstimate
from svip_common.contracts import (
    DRAFT_PARALLEL,
    PREPARED_PER_BLOCK,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Limits,
)
from svip_common.models import LoadedModel, ModelInfo
from svip_common.pair_config import PairConfig
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_runtime.compute_loop import ManualLoop
from svip_runtime.wire_batch import pack_requests, split_bursts, unpack

DELIVERIES = ("to_target", "to_draft", "to_caller")
WORK = ("target", "draft")
STEPS = ("target_idle", "draft_idle")


class Schedule(Protocol):
    def next(self, options: list[str]) -> str:
        """Which of the possible actions happens next (each named as in the module's docstring)."""

    def arrives_during(self, step: str) -> bool:
        """Whether what is in flight towards the worker arrives while its batched step runs."""


@dataclasses.dataclass
class InOrder:
    """The first possible action of ``order``; messages arrive during a step when ``during``.
    The default: everything in flight arrives at once and is handled before any forward, and the
    target verifies before the draft works ahead (a fast link, a draft that is never early)."""

    order: tuple[str, ...] = (*DELIVERIES, *WORK, *STEPS)
    during: bool = False

    def next(self, options: list[str]) -> str:
        return min(options, key=self.order.index)

    def arrives_during(self, step: str) -> bool:
        return self.during


class Seeded:
    """A random interleaving, reproducible by its seed: each step any possible action, alike."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def next(self, options: list[str]) -> str:
        return self.rng.choice(sorted(options))

    def arrives_during(self, step: str) -> bool:
        return self.rng.random() < 0.5


class Wire:
    """One direction's messages in flight, serialised as their sender wrote them."""

    def __init__(self):
        self.in_flight: list[bytes] = []

    def take(self) -> list[bytes]:
        """Everything in flight (a delivery packs it as the link would: _deliver)."""
        burst, self.in_flight = self.in_flight, []
        return burst


class MemoryLink:
    """The target's link to its draft (what DraftPort writes to): serialised DraftRequests in flight."""

    def __init__(self, wire: Wire):
        self.wire, self.broken = wire, None

    def send(self, session_id: str, data: bytes) -> None:
        self.wire.in_flight.append(data)


class MemoryStream:
    """A worker's side of a session stream (what SessionService emits to): its events in flight."""

    def __init__(self, serialise: Callable[[list], list[bytes]]):
        self.sessions = 0
        self.closed = False  # as a gRPC stream's: the host drops what waits on one whose peer went away
        self.emitted: list = []
        self._serialise = serialise

    def emit(self, event) -> None:
        self.emitted.append(event)

    def flush(self, wire: Wire) -> None:
        """What was emitted goes onto the wire in bursts, as a worker's stream takes them from its
        queue (wire_batch.Bursts: at most MAX_BATCH messages each), each packed as the worker packs it."""
        events, self.emitted = self.emitted, []
        for burst in split_bursts(events):
            wire.in_flight += self._serialise(burst)


@dataclasses.dataclass
class Pending:
    """A request in flight: what it has settled, and how it ended."""

    request: GenerationRequest
    session_id: str
    on_tokens: OnTokens | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # per generated token, when asked for
    prompt_logprobs: list | None = None
    finished: pb.Finished | None = None
    error: Exception | None = None
    stopped: bool = False

    @property
    def done(self) -> bool:
        return self.finished is not None or self.error is not None

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        reason = "stop" if self.stopped else self.finished.finish_reason
        stats = convert.stats_from_proto(self.finished.stats) if self.finished is not None else GenerationStats()
        logprobs = self.logprobs if self.request.logprobs is not None else None
        return GenerationResult(list(self.request.prompt_ids), self.generated, reason, stats, logprobs=logprobs,
                                prompt_logprobs=self.prompt_logprobs)


class InMemoryPair:
    def __init__(self, target: LoadedModel | ModelInfo, verifier, drafter, limits: Limits, pipeline: str = "async",
                 schedule: Schedule | None = None, clock: Callable[[], float] = time.time,
                 prepare: int = PREPARED_PER_BLOCK,
                 draft_clock: Callable[[], float] | None = None, parallel: int = DRAFT_PARALLEL,
                 auto: AutoEstimate | None = None, **host_options):
        """target: the target model (its end-of-sequence ids); verifier, drafter: the workers' models
        (target_worker/verifier.py, draft_worker/drafter.py; drafter None: the target alone);
        schedule: what happens next (InOrder() by default); clock: the time now, for the host and
        its sessions; draft_clock: the draft worker's (its timestamps and its steps' durations;
        None: the machine's); prepare, parallel: the draft worker's (draft_worker/service.py); auto:
        the pair's `auto` estimate, as a target worker keeps it across its sessions (None: the
        generic prior);
        host_options: the pair's configuration as flat options (PairConfig.of: load_aware,
        idle_prefill, max_batched_tokens, the recovery's fields)."""
        self.target, self.limits, self.pipeline = target, limits, pipeline
        self.schedule = schedule or InOrder()
        self.clock = clock
        self.wires = {name: Wire() for name in DELIVERIES}
        self.wires["to_host"] = Wire()  # the caller's requests
        timing = {} if draft_clock is None else {"clock": draft_clock, "timer": draft_clock}
        self.draft = None if drafter is None else DraftService(drafter, limits, prepare, compute=ManualLoop,
                                                                 parallel=parallel, **timing)
        link = None if drafter is None else MemoryLink(self.wires["to_draft"])
        draft_path = getattr(getattr(drafter, "draft", None), "path", None)
        config = PairConfig.of(getattr(target, "path", "target"), draft_path, **host_options)
        self.host = SessionHost(verifier, limits, config, draft_link=link, compute=ManualLoop, clock=clock, auto=auto)
        self._caller_stream = MemoryStream(lambda events: [e.SerializeToString() for e in self.host.pack(events)])
        self._draft_stream = None
        if self.draft is not None:
            self._draft_stream = MemoryStream(lambda events: [m.SerializeToString() for m in self.draft.pack(events)])
        self.pending: dict[str, Pending] = {}
        self.steps = 0  # actions taken (a test's measure of how far a run went)
        self._idle_spent: set[str] = set()  # workers whose last batched step did nothing, nothing since

    # --- the caller's end ---------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_tokens=None) -> Pending:
        """Start a request (it runs as ``run`` steps the pair); on_tokens(tokens, logprobs) as DistributedEngine's."""
        request = resolved(request, self.draft is not None, self.limits)
        pending = Pending(request, uuid.uuid4().hex, on_tokens)
        self.pending[pending.session_id] = pending
        start = start_message(pending.session_id, request, self.target, self.pipeline)
        self._send_to_host(pb.GenerateRequest(start=start))
        return pending

    def cancel(self, pending: Pending) -> None:
        self._send_to_host(pb.GenerateRequest(cancel=pb.Cancel(session_id=pending.session_id)))

    def generate(self, request: GenerationRequest, on_tokens=None) -> GenerationResult:
        pending = self.submit(request, on_tokens)
        self.run()
        return pending.result()

    def generate_all(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Every request in flight together (one batch as far as the steps make it)."""
        pending = [self.submit(request) for request in requests]
        self.run()
        return [p.result() for p in pending]

    def _send_to_host(self, request: pb.GenerateRequest) -> None:
        self.wires["to_host"].in_flight.append(request.SerializeToString())

    # --- faults ------------------------------------------------------------------------------------

    def lose_draft(self, reason: str = "the draft worker went away (in memory)") -> None:
        """The draft's link breaks: what is in flight either way is lost, the sessions go on alone."""
        self.wires["to_draft"].in_flight.clear()
        self.wires["to_target"].in_flight.clear()
        self.host.draft.broke(reason)

    def draft_back(self) -> None:
        """A replaced draft serves again (empty: the old one's sessions went with it)."""
        for session_id in list(self.draft.sessions):
            self.draft.close_session(session_id, self.draft.owner(session_id))
        self._draft_stream.emitted.clear()
        self.host.draft.relink(MemoryLink(self.wires["to_draft"]))

    def check(self) -> None:
        """The host's periodic check (stalls, holds, re-attach backoffs), at the clock's time now."""
        self.host.compute.post(self.host.check_sessions)

    # --- running ----------------------------------------------------------------------------------

    def run(self, max_steps: int = 1_000_000) -> None:
        """Step until every request is done. A pair that can do nothing more while one is not is a
        protocol deadlock: RuntimeError, with what waits."""
        while not all(p.done for p in self.pending.values()):
            if not self.step():
                waiting = {sid: self.host.sessions[sid].mode.value for sid in self.host.sessions}
                raise RuntimeError(f"the in-memory pair is stuck with requests unfinished (sessions: {waiting})")
            if self.steps > max_steps:
                raise RuntimeError(f"the in-memory pair ran {max_steps} steps without finishing")

    def step(self) -> str | None:
        """One action, as the schedule picks it; None when none is possible."""
        self._flush()
        options = self.options()
        if not options and self.host.compute.wake_in() is not None:  # only time can move the target on:
            self.host.idle_work.end_hold()  # its held step starts, as a real loop's timeout would start it
            self._idle_spent.discard("target_idle")
            options = self.options()
        if not options:
            return None
        action = self.schedule.next(options)
        did = getattr(self, f"_{action}")()
        if action in STEPS and not did:
            self._idle_spent.add(action)  # not offered again until something else happens
        else:
            self._idle_spent.clear()
        self._flush()
        self.steps += 1
        return action

    def options(self) -> list[str]:
        out = [name for name in DELIVERIES if self.wires[name].in_flight]
        if self.wires["to_host"].in_flight:
            out.append("to_target")
        for name, service in (("target", self.host), ("draft", self.draft)):
            if service is None:
                continue
            if service.compute.inbox:
                out.append(name)
            elif f"{name}_idle" not in self._idle_spent:  # its loop runs idle work only while nothing waits
                out.append(f"{name}_idle")
        return sorted(set(out))

    def _flush(self) -> None:
        self._caller_stream.flush(self.wires["to_caller"])
        if self._draft_stream is not None:
            self._draft_stream.flush(self.wires["to_target"])

    # --- the actions --------------------------------------------------------------------------------

    def _to_target(self) -> None:
        self._deliver("to_host", self.wires["to_host"].take(), self.clock())
        self._deliver("to_target", self.wires["to_target"].take(), self.clock())

    def _to_draft(self) -> None:
        self._deliver("to_draft", self.wires["to_draft"].take(), self.draft.clock())

    def _to_caller(self) -> None:
        self._deliver("to_caller", self.wires["to_caller"].take(), self.clock())

    def _deliver(self, name: str, burst: list[bytes], now: float) -> None:
        """A burst of messages that arrived on ``name`` at ``now``, handed to their receiver as the
        links hand them over (parsed, a batch unpacked; posted to the receiver's loop)."""
        if not burst:
            return
        if name == "to_host":
            for data in burst:
                self.host.compute.post(self.host.receive, self._caller_stream, pb.GenerateRequest.FromString(data), now)
        elif name == "to_target":
            for data in burst:
                for event, size in unpack(pb.DraftEvent.FromString(data), pb.DraftEvent, len(data)):
                    self.host.draft_event_arrived(event, now, size)
        elif name == "to_draft":
            for part in split_bursts(burst):
                message = pb.DraftRequest.FromString(pack_requests(part))
                self.draft.compute.post(self.draft.receive, self._draft_stream, message, now)
        else:
            for data in burst:
                self._caller_event(pb.GenerateEvent.FromString(data))

    def _target(self) -> None:
        self.host.compute.run_one()

    def _draft(self) -> None:
        self.draft.compute.run_one()

    def _target_idle(self) -> bool:
        during = self.schedule.arrives_during("target_idle")
        return self.host.compute.run_idle(self._to_target if during else None)

    def _draft_idle(self) -> bool:
        during = self.schedule.arrives_during("draft_idle")
        return self.draft.compute.run_idle(self._to_draft if during else None)

    def _caller_event(self, event: pb.GenerateEvent) -> None:
        kind = event.WhichOneof("kind")
        pending = self.pending.get(getattr(event, kind).session_id)
        if pending is None or pending.done:
            return
        if kind == "settled" and not pending.stopped:
            logprobs, prompt_logprobs = convert.settled_logprobs(event.settled, pending.request.prompt_ids)
            if prompt_logprobs is not None:
                pending.prompt_logprobs = prompt_logprobs
            pending.generated += list(event.settled.tokens)
            pending.logprobs += logprobs
            if pending.on_tokens is not None and pending.on_tokens(list(event.settled.tokens), logprobs):
                pending.stopped = True
                self.cancel(pending)
        elif kind == "finished":
            pending.finished = event.finished
        elif kind == "error":
            pending.error = error_from_proto(event.error)
