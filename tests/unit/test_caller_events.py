"""A session's events for its caller are made into wire messages where the stream sends them
(coordinator/session/caller_events.py), in order with the rest and sized for the stream's bursts."""

from coordinator.session.caller_events import FinishedEvent, SettledEvent, wire
from coordinator.session.effects import Finish
from svip_common.contracts import GenerationStats, TokenLogprob
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_runtime.wire_batch import MAX_BATCH, split_bursts


def _stats(rounds: int) -> GenerationStats:
    stats = GenerationStats(wall_s=1.5)
    for i in range(rounds):
        stats.record_round(3, 2, 0.25)
        stats.round_s.append(0.01 * i)
        stats.draft_forward_s.append(0.002)
        stats.target_forward_s.append(0.016)
        stats.block_transit_s.append(1e-4)
        stats.target_queue_s.append(0.003)
        stats.feedback_transit_s.append(1e-4)
        stats.draft_queue_s.append(0.002)
        stats.overhead_s.append(0.001)
        stats.round_sources.append("followup")
        stats.timeline += [("draft", 0.02 * i, 0.02 * i + 0.003), ("target", 0.02 * i + 0.003, 0.02 * i + 0.019)]
    return stats


def test_the_events_become_the_messages_the_host_built_on_its_compute_thread_in_order():
    logprobs = (TokenLogprob(7, -0.5, ((7, -0.5), (9, -1.25))),)
    stats = _stats(4)
    error = pb.GenerateEvent(error=pb.Error(session_id="s", code=3, message="bad"))
    events = [SettledEvent("s", (7,), logprobs), error, FinishedEvent("s", Finish("length", lambda: stats))]
    made = wire(events)
    settled = pb.GenerateEvent(settled=pb.Settled(session_id="s", tokens=[7],
                                                  logprobs=convert.logprobs_to_proto(logprobs)))
    finished = pb.GenerateEvent(finished=pb.Finished(session_id="s", finish_reason="length",
                                                     stats=convert.stats_to_proto(stats)))
    assert made == [settled, error, finished]
    assert convert.stats_from_proto(made[2].finished.stats) == stats


def test_an_event_is_sized_and_sent_as_its_message_made_once():
    stats = _stats(50)
    ends = [FinishedEvent(f"s{i}", Finish("stop", lambda: stats)) for i in range(MAX_BATCH + 44)]
    size = ends[0].ByteSize()
    assert size == ends[0].message.ByteSize() > 0 and ends[0].message is wire(ends[:1])[0]  # made once
    bursts = split_bursts(ends)
    assert [len(b) for b in bursts] == [len(b) for b in split_bursts([e.message for e in ends])]
    assert [len(b) for b in bursts] == [MAX_BATCH, 44]


def test_a_sessions_end_works_out_its_statistics_where_its_message_is_made_once():
    """The session's last step only says it ended; its figures (RoundLog.final) are worked out when
    the stream makes the message, on the event loop, and once however often it is read."""
    worked = []

    def final():
        worked.append(1)
        return _stats(3)

    end = FinishedEvent("s", Finish("stop", final))
    assert worked == []
    assert end.ByteSize() == end.message.ByteSize() and wire([end])[0] is end.message
    assert end.end.stats.rounds == 3 and worked == [1]
