"""The coordinator's sessions, hosted in the target worker's process beside the verifier.

The caller (the CLI, a Serve replica) opens one Generate stream to the target worker and starts
sessions on it; each session's logic (coordinator/session/pipeline.py) runs on the target's compute
thread and talks to the draft worker over one stream (``DraftLink``), so a round is one hop each
way: block in, verify, feedback out. Settled tokens stream back to the caller as they settle.
Why here and not beside the draft: the target holds the verdict, and the verdict decides both
what the caller is told and what the draft does next; beside the verifier the decision leaves the
process once, to each.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from coordinator.session.caller_events import FinishedEvent, SettledEvent, wire
from coordinator.session.draft_port import DraftPort
from coordinator.session.effects import DraftAnswered, Effect, Finish, Settle, ToDraft, Verify
from coordinator.session.idle_work import IdleWork
from coordinator.session.pages import PageLine
from coordinator.session.pipeline import SessionPipeline
from svip_common.acceptance import AutoEstimate, SessionStop
from svip_common.contracts import PolicyConfig
from svip_common.errors import InvalidRequest, Overloaded, SvipError
from svip_common.kv_cache import PoolFull
from svip_common.kv_sizes import whole_pages
from svip_common.messages import DraftedBlock, DraftEvent
from svip_common.pair_config import PairConfig
from svip_common.step_cost import SessionGate, load_aware_for
from svip_common.test_hooks import StepGate
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.compute_loop import ComputeLoop
from svip_runtime.grpc_server import SessionService, SessionStream, session_id_of, status_of
from svip_runtime.step_metrics import StepMetrics
from svip_runtime.tls import TlsFiles
from target_worker.verifier import Verifier

log = logging.getLogger(__name__)
ReadEvent = tuple[str | None, DraftEvent | InvalidRequest | None]  # read_draft_event's (below)
CHECK_EVERY_S = 0.2  # how often stalls and hold deadlines are checked
GATE_POLL_S = 0.005  # how often a step that a test holds looks at its gate again


class SessionHost(SessionService, pb_grpc.TargetWorkerServicer):
    role = "target"

    def __init__(self, verifier: Verifier, limits, config: PairConfig, draft_address: str | None = None,
                 tls: TlsFiles | None = None, draft_actor=None, auto: AutoEstimate | None = None, draft_link=None,
                 compute=ComputeLoop, clock=time.time):
        """config: the pair's (svip_common/pair_config.py); what the host reads of it:
        max_batched_tokens (a long prompt is prefilled in chunks under it), load_aware (whose
        blocks hold no more tokens than pay at the load measured here; svip_common/step_cost.py),
        idle_prefill (what the target does while no block is ready: idle_work.py) and the
        recovery's draft_stall_s, sampled_hold_s and draft_recover_s (draft_port.py). draft_address:
        the draft worker's (None: the target alone, unless draft_actor or draft_link); draft_actor:
        its Ray actor, asked for a replacement when the draft is lost; auto: the pair's `auto`
        estimate (svip_common/acceptance.py), kept here beside the verifier, where every verdict
        is seen (None: from the generic prior); draft_link: a link to the draft already open (the
        in-memory transport's, coordinator/in_memory.py); compute: the loop that owns the sessions
        (SessionService); clock: the time now, for the sessions and their steps."""
        # what idle() reads is made before the compute thread starts (in super().__init__)
        self._gate = StepGate("target")
        self._ready: list[tuple[str, SessionPipeline, DraftedBlock, object, tuple[float, str]]] = []  # to verify
        self.pages = PageLine(verifier.pool)  # KV by use: who yields pages, who waits for them
        self.clock = clock
        config = config.checked()
        self.idle_work = IdleWork(verifier, config.idle_prefill, config.max_batched_tokens, clock)
        super().__init__(limits, compute, verifier.grammar_tokenizer)
        self.verifier = verifier
        self.max_batched_tokens = config.max_batched_tokens
        self.load_aware = config.load_aware
        self.sampled_hold_s = config.recovery.sampled_hold_s
        self.auto = auto if auto is not None else AutoEstimate()
        self.step_metrics = StepMetrics("target")
        self.draft: DraftPort | None = None
        if draft_address is not None or draft_actor is not None or draft_link is not None:
            recovery = config.recovery
            self.draft = DraftPort(draft_address, draft_actor, self.draft_event_arrived, self.draft_lost,
                                   self.draft_back, tls, recovery.draft_stall_s, recovery.draft_recover_s, draft_link)
        self._checker: asyncio.Task | None = None

    async def start(self) -> None:
        if self.draft is not None:
            await self.draft.open()
            self._checker = asyncio.get_running_loop().create_task(self._check_periodically())

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self.draft is not None:
            await self.draft.close()
        await super().close()

    def processed_tokens(self) -> int:
        return self.verifier.tokens_verified

    @property
    def pool(self):
        return self.verifier.pool

    def draft_state(self) -> tuple[int, str]:
        if self.draft is None:
            return 0, ""
        return self.draft.replacements, "" if self.draft.available else (self.draft.lost or "connecting")

    async def Generate(self, request_iterator, context):
        async for event in self._serve_stream(request_iterator):
            yield event

    # --- the event loop hands draft events to the compute thread -----------------------------------

    def draft_event_arrived(self, event: pb.DraftEvent, received_at: float, size: int) -> None:
        """What a link to the draft calls on the event loop for each event it reads (DraftLink,
        the in-memory transport's delivery): read here, handled on the compute thread."""
        self.compute.post(self.on_draft_event, read_draft_event(event, self.verifier.target.vocab_size),
                          received_at, size)

    def draft_lost(self, reason: str) -> None:
        self.compute.post(self._each_session, "detach", False)

    def draft_back(self) -> None:
        self.compute.post(self._each_session, "attach")

    async def _check_periodically(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            self.compute.post(self.check_sessions)

    # --- on the compute thread ----------------------------------------------------------------------

    def handle(self, request: pb.GenerateRequest, stream: SessionStream, received_at: float) -> None:
        kind = request.WhichOneof("kind")
        if kind == "start":
            self.check_start(request.start)
            start = convert.start_from_proto(request.start, self.limits.max_draft_length)
            self.admit(start.session_id, stream)
            tokens = whole_pages(len(start.prompt_ids) + start.max_new_tokens, self.verifier.pool.page_size)
            if tokens > self.verifier.pool.tokens:
                raise Overloaded(f"the target's KV pool holds {self.verifier.pool.tokens} tokens; this session "
                                 f"needs {tokens} (its prompt and max_new_tokens)")
            speculate = start.speculates and self.draft is not None
            policy = start.policy if speculate else PolicyConfig(name="none")
            sid, sampling, scope = start.session_id, start.sampling, start.cache_scope
            session = SessionPipeline(
                sid,
                start.request(policy),
                start.stop_token_ids,
                self.limits,
                self.verifier.open(sampling, len(start.prompt_ids), start.stop_token_ids, start.logprobs, scope),
                speculate,
                start.pipeline,
                self.clock(),
                load_cap=self.load_cap if load_aware_for(self.load_aware, sampling.greedy) else None,
                hold_s=self.sampled_hold_s,
                auto=SessionStop(self.auto, sampling.greedy) if policy.name == "auto" else None,
                load=self.verifier.load,
            )
            self.new_session(sid, session, stream)
            self.pages.admit(sid, len(start.prompt_ids))
            if start.prompt_logprobs:  # read as its prefill runs, in the steps (target_worker/logprobs.py)
                session.target.score(start.prompt_ids, start.logprobs)
            self._step(sid, session.start, self._draft_available())
        else:  # cancel
            session_id = request.cancel.session_id
            self._step(session_id, self.session(session_id, stream).cancel)

    def pack(self, events: list) -> list:
        """The caller's stream's events as it sends them (on the event loop): a session's settled
        tokens and its end made into their messages there (caller_events.py)."""
        return wire(events)

    def close_session(self, session_id: str, owner) -> None:
        super().close_session(session_id, owner)
        if session_id not in self.sessions:  # closed (and not another stream's session of that id)
            self.pages.forget(session_id)

    def release(self, session_id: str, session: SessionPipeline) -> None:
        self._apply(session_id, session, session.close(self.clock()))

    def _draft_available(self) -> bool:
        return self.draft is not None and self.draft.available

    def add_stats(self, stats: pb.WorkerStats) -> None:
        for field, greedy in (("auto_greedy", True), ("auto_sampled", False)):
            model = self.auto.model(greedy)
            getattr(stats, field).CopyFrom(
                pb.AutoModelState(
                    weights=list(model.weights),
                    observed_tokens=model.observed,
                    fits=model.fits,
                    predicted_acceptance=model.predicted_sum / max(model.observed, 1),
                    observed_acceptance=model.accepted_sum / max(model.observed, 1),
                )
            )
        stats.auto_prior_cost = self.auto.prior_cost
        stats.preemptions = self.pages.preemptions
        stats.prompt_tokens_shared = self.verifier.sharing.shared_tokens

    def load_cap(self, gate: SessionGate) -> int:
        """The most tokens a session's next block should hold at the load measured here (its
        drafting cost per token comes with its blocks: their share of the draft's forwards)."""
        return gate.cap(self.verifier.load())

    def on_draft_event(self, read: ReadEvent, received_at: float, size: int) -> None:
        """The draft's message, as ``read_draft_event`` read it, to its session; one that could
        not be read gives the draft up for that session."""
        session_id, message = read
        session = self.sessions.get(session_id)
        if session is None:  # none named, or a late event of an ended session
            return
        if isinstance(message, InvalidRequest):
            self._step(session_id, session.on_bad_draft_message, f"draft worker sent a bad block: {message}")
            return
        self._step(session_id, session.on_draft_event, message, received_at, size, self._draft_available())

    def idle(self) -> bool:
        """One batched step: a single target forward verifies every block that is ready, each
        session's prefix and block length its own (a ragged batch); its verdicts are decided
        after whatever arrived meanwhile is taken in."""
        ready = [job for job in self._ready if self.sessions.get(job[0]) is job[1] and not job[1].done]
        self.pages.resume(self.sessions, {job[0]: len(job[2].block.tokens) for job in ready})
        if not any(job[0] not in self.pages.waiting for job in ready):
            self._ready = ready  # those waiting for pages, if any
            self.idle_work.drop_hold()  # no step to hold (its sessions ended, or wait for pages)
            return self._gate.idle_allowed() and self.idle_work.run(self.sessions, self.pages.waiting, self._step)
        if not self._gate.open():  # a test holds this worker (svip_common/test_hooks.py): look again soon,
            self._ready = ready  # answering every message meanwhile
            time.sleep(GATE_POLL_S)
            return True
        if self.idle_work.holds_step(self.sessions, ready, self.pages.waiting):  # blocks about to come pay
            self._ready = ready
            return False
        self.idle_work.fill_beside(self.sessions, self.pages.waiting, self._step)  # tokens known already
        riders = self.idle_work.riders(self.sessions, ready, self.pages.waiting)  # waiting sessions' rows
        started = self.clock()
        try:  # a session that fails, alone; the newest yields its pages when they run short
            lookahead = {s.target: tokens for _, s, block, _, _ in ready if (tokens := s.ahead.followup_on(block))}
            verified, verdicts, riders = self.pages.verify(self.verifier, self.sessions, ready, self.max_batched_tokens,
                                                           riders, lookahead)
        except PoolFull as exc:  # no session holds a page to yield: the step cannot fit at all
            verified = [job for job in ready if job[0] not in self.pages.waiting]
            verdicts, riders = [exc] * len(verified), []
        ended = self.clock()
        self._ready = [job for job in ready if job[0] in self.pages.waiting]  # waiting for pages
        self._ready += [job for job, verdict in zip(verified, verdicts) if verdict is None]  # prefilled a chunk
        self.step_metrics.record(len(verified), self.verifier.last_step_tokens, self.verifier.pool)
        self.idle_work.ridden(riders, verdicts, self._step, started, ended)
        for (session_id, session, block, _, (received_at, source)), verdict in zip(verified, verdicts):
            if isinstance(verdict, Exception):
                self._fail_alone(session_id, verdict)
            elif verdict is not None:  # decided after what arrived during the forward is taken in
                self.compute.post(self._step, session_id, session.verified, block, verdict, received_at, source,
                                  started, ended)
        return True

    def idle_wake_in(self) -> float | None:
        return self.idle_work.wake_in()

    def check_sessions(self) -> None:
        """A session that waited on its draft past the stall deadline goes on without it; a
        sampled one that held for a lost draft long enough, too."""
        now, deadline = self.clock(), self.draft.stall_deadline()
        for session_id, session in list(self.sessions.items()):
            if session.stalled(now, deadline):
                log.warning("session %s: no draft block for %.1f s; going on without the draft", session_id, deadline)
                self._step(session_id, session.detach, True)
            else:
                self._step(session_id, session.hold_expired)
                self._step(session_id, session.retry_attach)

    def _each_session(self, name: str, *args) -> None:
        for session_id, session in list(self.sessions.items()):
            self._step(session_id, getattr(session, name), *args)

    def _step(self, session_id: str, event, *args) -> list[Effect] | None:
        """Run one event of a session (a SessionPipeline method marked @event) at the time now and
        carry out its effects, which it returns; an error ends the session with an error event to
        its caller (None)."""
        session = self.sessions.get(session_id)
        if session is None:
            return None
        try:
            effects = event(self.clock(), *args)
            self._apply(session_id, session, effects)
        except SvipError as exc:
            self._fail(session_id, status_of(exc), str(exc))
            return None
        except Exception:
            log.exception("session %s failed", session_id)
            self._fail(session_id, grpc.StatusCode.INTERNAL, "internal worker error (see the target worker's log)")
            return None
        self._reap(session_id)
        return effects

    def _apply(self, session_id: str, session: SessionPipeline, effects: list[Effect]) -> None:
        """A session's effects, in order: the transport's half of its protocol; a scoring
        request's prompt logprobs first, once its prefill has read them all."""
        scoring = session.target.scoring
        if scoring is not None and not scoring.pending and not scoring.sent:
            scoring.sent = True
            settled = pb.Settled(session_id=session_id, prompt_logprobs=convert.logprobs_to_proto(scoring.scored))
            self.owner(session_id).emit(pb.GenerateEvent(settled=settled))
        for effect in effects:
            if isinstance(effect, ToDraft):
                session.log.wire_bytes += self.draft.send(session_id, effect.request)
            elif isinstance(effect, Verify):
                if effect.waited is not None:
                    self.idle_work.arrivals.observe(effect.waited)
                self._ready.append((session_id, session, effect.block, effect.checked,
                                    (effect.received_at, effect.source)))
            elif isinstance(effect, Settle):  # made into its message where the stream sends it (caller_events.py)
                self.owner(session_id).emit(SettledEvent(session_id, effect.tokens, effect.logprobs))
            elif isinstance(effect, Finish):
                self.owner(session_id).emit(FinishedEvent(session_id, effect))
            elif isinstance(effect, DraftAnswered):
                self.draft.answered(effect.seconds)

    def _fail_alone(self, session_id: str, exc: Exception) -> None:
        """A session whose verification failed on its own (Verifier.verify_apart): it ends with an
        error that says so; the sessions batched with it went on."""
        if isinstance(exc, SvipError):
            self._fail(session_id, status_of(exc), str(exc))
            return
        log.error("session %s: its verification failed on its own; the sessions beside it went on",
                  session_id, exc_info=exc)
        self._fail(session_id, grpc.StatusCode.INTERNAL,
                   f"this request failed in the target's verification ({type(exc).__name__}; see the target "
                   f"worker's log); the requests batched with it were not affected")

    def _reap(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.done:
            self.close_session(session_id, self.owner(session_id))

    def _fail(self, session_id: str, code: grpc.StatusCode, message: str) -> None:
        stream = self.owner(session_id)
        stream.emit(self.error_event(session_id, code, message))
        self.close_session(session_id, stream)

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.GenerateEvent:
        return pb.GenerateEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))


def read_draft_event(event: pb.DraftEvent, vocab_size: int) -> ReadEvent:
    """The draft's message read into the project's terms (the session's logic never sees protobuf;
    vocab_size: the target's, which a sampled tree's q rows span), where it was parsed: on the event
    loop, beside the target's forward, not on the compute thread, which every round's work waits
    for (an async session's follow-ups, growths and prepared continuations make two messages a round
    where sync sends one; docs/benchmarks.md). The session it names (None: none can be read) and the
    message, or why it cannot be read: whatever reading it raises fails that session's draft, not
    the link that carried it (raised on the loop, it would break the link for every session)."""
    try:
        session_id = session_id_of(event)
    except InvalidRequest:
        return None, None
    try:
        return session_id, convert.draft_event_from_proto(event, vocab_size)
    except InvalidRequest as exc:
        return session_id, exc
    except Exception as exc:  # noqa: BLE001 - a message no rule foresaw: its session alone, never the link
        log.exception("session %s: a draft message could not be read", session_id)
        return session_id, InvalidRequest(f"unreadable message ({type(exc).__name__})")
