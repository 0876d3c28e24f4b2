"""What the caller's stream carries from a session, made into wire messages where the stream sends
them (``wire``: the service's ``pack``, on the event loop) rather than on the compute thread,
which runs the target's forwards. Sent in order with everything else on the stream.

Why: at 70B/1B with 32 sessions on the simulated clock, the target was busy 100% of the time, a
fifth of it host work, and a session's end alone cost it 0.3-0.7 ms of proto building (a message
for every round and every span of its timeline); the target's own host work is what that cell
gained from (docs/benchmarks.md, the target's host work). The event loop already serialises every
message; on a GPU the compute thread waits on the device meanwhile. A session's end works out its
statistics here too (RoundLog.final: its timeline's overlap, 0.21 ms a session on this CPU). An
edge of the session package: it speaks svip_proto."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from coordinator.session.effects import Finish
from svip_common.contracts import TokenLogprob
from svip_proto import convert
from svip_proto import svip_pb2 as pb


class _Made:
    """What the stream's burst sizing reads of an event (svip_runtime/wire_batch.py ``wire_size``):
    its message's size, the message made then (on the event loop), once."""

    message: pb.GenerateEvent  # each kind makes its own, once (a cached property)

    def ByteSize(self) -> int:  # noqa: N802 (protobuf's name)
        return self.message.ByteSize()


@dataclass(frozen=True)
class SettledEvent(_Made):
    """Tokens a session settled (with their logprobs where the caller asked)."""

    session_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]

    @cached_property
    def message(self) -> pb.GenerateEvent:
        settled = pb.Settled(session_id=self.session_id, tokens=self.tokens,
                             logprobs=convert.logprobs_to_proto(self.logprobs))
        return pb.GenerateEvent(settled=settled)


@dataclass(frozen=True)
class FinishedEvent(_Made):
    """A session's end: why, and its statistics, worked out here too (``Finish.stats``: nothing
    writes them after it ends)."""

    session_id: str
    end: Finish

    @cached_property
    def message(self) -> pb.GenerateEvent:
        finished = pb.Finished(session_id=self.session_id, finish_reason=self.end.reason,
                               stats=convert.stats_to_proto(self.end.stats))
        return pb.GenerateEvent(finished=finished)


def wire(events: list) -> list:
    """The stream's events as it sends them: these made into their messages, the rest as they are."""
    return [event.message if isinstance(event, _Made) else event for event in events]
