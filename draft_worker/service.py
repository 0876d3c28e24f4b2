"""The draft worker's gRPC service: sessions multiplexed on one stream from each target worker,
handled on one compute thread. Between messages that thread runs batched steps: one draft forward
advances every session with a block to draft by one token, the blocks the target waits for first
and, in async sessions, what the next verdict most likely calls for (draft_worker/pipelined.py)."""

from __future__ import annotations

import logging
import time

import grpc
import torch

from draft_worker.drafter import PREFILL_TOKENS, Drafter
from draft_worker.pipelined import PipelinedDraft
from draft_worker.policies import AutoPolicy
from svip_common.acceptance import StopRule
from svip_common.contracts import DRAFT_PARALLEL, NO_TOKEN, PREPARED_PER_BLOCK, check_token_ids
from svip_common.errors import InvalidRequest, exit_on_device_failure
from svip_common.kv_cache import PoolFull
from svip_common.messages import DraftedBlock, Feedback, Resume
from svip_common.step_cost import Ewma, StepCost, row_share
from svip_proto import convert
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.compute_loop import ComputeLoop
from svip_runtime.grpc_server import Refused, SessionService, SessionStream
from svip_runtime.step_metrics import StepMetrics
from svip_runtime.wire_batch import BadBatch, pack_events, unpack

RIDING_WEIGHT = 0.05  # of the newest step, in the critical blocks a speculative step carries (a running mean)
log = logging.getLogger(__name__)
FEATURE_ROWS_CAP = 1 << 20  # rows of features a session may hold ahead where no context length is known


class FeatureChunks:
    """Target features sent ahead in FeatureChunks, per session: consecutive positions, at most
    ``rows`` of them (a context's worth), joined to the Feedback or Resume they lead."""

    def __init__(self, rows: int):
        self.rows = rows
        self._held: dict[str, _Ahead] = {}

    def add(self, session_id: str, first: int, features: torch.Tensor) -> None:
        held = self._held.get(session_id)
        if held is None:
            self._held[session_id] = held = _Ahead(first)
        if first != held.end:
            raise InvalidRequest(f"a feature chunk for positions from {first}; the chunks before it end at "
                                 f"{held.end - 1}")
        if held.end + features.shape[0] - held.first > self.rows:
            self._held.pop(session_id)
            raise InvalidRequest(f"feature chunks for more than {self.rows} positions (the context)")
        held.parts.append(features)
        held.end += features.shape[0]

    def take(self, session_id: str) -> _Ahead | None:
        return self._held.pop(session_id, None)


class _Ahead:
    def __init__(self, first: int):
        self.first, self.end = first, first  # positions first .. end - 1
        self.parts: list[torch.Tensor] = []

    def joined(self, features: torch.Tensor, first: int) -> tuple[torch.Tensor, int]:
        """These chunks and the rows that continue them (from ``first``), as one tensor and its first position."""
        if first != self.end:
            raise InvalidRequest(f"target features from position {first}; the chunks sent ahead end at {self.end - 1}")
        return torch.cat([*self.parts, features]), self.first


class DraftService(SessionService, pb_grpc.DraftWorkerServicer):
    role = "draft"

    def __init__(self, drafter: Drafter, limits, prepare: int = PREPARED_PER_BLOCK, compute=ComputeLoop,
                 clock=time.time, timer=time.perf_counter, parallel: int = DRAFT_PARALLEL):
        """compute: the loop that owns the sessions (SessionService); clock: the time now, for the
        sessions' timestamps; timer: what a step's duration is read from (the in-memory
        transport's simulation gives both as its own clock)."""
        # what idle() reads is made before the compute thread starts (in super().__init__)
        self.clock, self.timer = clock, timer
        self.drafter = drafter
        self.prepare = prepare  # prepared continuations per block (async sessions)
        self.parallel = parallel  # speculative blocks a session drafts side by side (async; pipelined.py)
        self.forks_released = 0  # times a short pool took the speculation held on forks back
        self.step_metrics = StepMetrics("draft")
        self.step_cost = StepCost()  # a step's time by the tokens it takes in (prefills aside): what a row costs
        self.riding = Ewma(RIDING_WEIGHT)  # critical blocks in a step that carries speculation (a running mean)
        self.shed = 0  # sessions whose draft work was given up (the KV pool full, a failed step)
        self.prepared_tokens = 0  # drafted for continuations prepared after a rejection, taken up or not
        self.sent_batches = 0  # messages that carried more than one event (one step's, for several sessions)
        # target features sent ahead in chunks, per session, until the message they lead arrives
        self._chunks = FeatureChunks(limits.positions or FEATURE_ROWS_CAP)
        super().__init__(limits, compute, drafter.grammar_tokenizer)

    @property
    def pool(self):
        return self.drafter.pool if self.drafter.pool is not None else self.drafter.cache_use()

    @property
    def device_timing(self):
        return self.drafter.timing

    async def Session(self, request_iterator, context):
        async for event in self._serve_stream(request_iterator):
            yield event

    def pack(self, events: list[pb.DraftEvent]) -> list[pb.DraftEvent]:
        """A step's events for the target worker as one message (svip_runtime/wire_batch.py)."""
        if len(events) > 1:
            self.sent_batches += 1
        return [pack_events(events)]

    def unpack(self, request: pb.DraftRequest) -> list[pb.DraftRequest]:
        try:
            return [item for item, _ in unpack(request, pb.DraftRequest)]
        except BadBatch as exc:
            raise Refused(str(exc)) from None

    # --- on the compute thread -------------------------------------------------------------------
    def handle(self, request: pb.DraftRequest, stream: SessionStream, received_at: float) -> None:
        kind = request.WhichOneof("kind")
        if kind == "start":
            self.check_start(request.start)
            start = convert.start_from_proto(request.start, self.limits.max_draft_length)
            if not start.speculates:
                raise InvalidRequest("a draft session needs a drafting policy (not 'none')")
            self.admit(start.session_id, stream)
            session = PipelinedDraft(
                session=self.drafter.open(start.sampling, start.policy, tuple(start.stop_token_ids),
                                          len(start.prompt_ids), start.cache_scope),
                prompt=list(start.prompt_ids), max_new_tokens=start.max_new_tokens, stop_token_ids=start.stop_token_ids,
                pipelined=start.pipeline == "async", prepare=self.prepare, parallel=self.parallel,
                send_prepared=start.sampling.greedy or start.policy.tree != "off",  # the target settles the token
                epoch=start.epoch,
            )
            self.new_session(start.session_id, session, stream)
            _tune(session, start.stop_rule)
            _price(session, start.node_price)
            self._send(start.session_id, session, session.start(received_at, start.load_cap))
        elif kind == "feedback":  # a chain: the verdicts on consecutive blocks, in order
            session = self.session(request.feedback.session_id, stream)
            for item in convert.feedback_from_proto(request.feedback, self.drafter.width).chain():
                self._send(item.session_id, session, self._apply(session, item, received_at))
        elif kind == "resume":
            msg = convert.resume_from_proto(request.resume)
            session = self.session(msg.session_id, stream)
            check_token_ids(msg.tokens, self.limits.tokens, "resumed token id")
            features, first = self._features(msg, msg.base + len(msg.tokens) - 1)
            _tune(session, msg.stop_rule)
            self._send(msg.session_id, session, session.on_resume(self.clock(), msg.epoch, msg.base, list(msg.tokens),
                                                                  msg.load_cap, received_at, features, first))
        elif kind == "feature_chunk":  # a leading part of the next Feedback's or Resume's features
            msg = request.feature_chunk
            self.session(msg.session_id, stream)
            features = self._checked_features(convert.tensor_from_proto(msg.features))
            self._chunks.add(msg.session_id, msg.features_from, features)
        else:  # cancel
            self.session(request.cancel.session_id, stream)
            self.close_session(request.cancel.session_id, stream)
            stream.emit(pb.DraftEvent(closed=pb.Closed(session_id=request.cancel.session_id)))

    def _apply(self, session: PipelinedDraft, msg: Feedback, received_at: float) -> list[DraftedBlock]:
        if msg.token != NO_TOKEN:  # the target's token goes into this model's embedding next
            check_token_ids([msg.token], self.limits.tokens, "feedback token id")
        features, first = self._features(msg, msg.base + msg.accepted + len(msg.branch))  # a branch's too
        _tune(session, msg.stop_rule)
        _price(session, msg.node_price)
        return session.on_feedback(self.clock(), msg, received_at, features, first)

    def _features(self, msg: Feedback | Resume, end: int) -> tuple[torch.Tensor | None, int]:
        """A feedback's (or a resume's) target features, after the chunks of them that came ahead
        (FeatureChunk), and the position of their first row: exactly the positions up to ``end`` - 1
        that the verdicts leave committed (INVALID_ARGUMENT otherwise). (None, 0) when it has none."""
        ahead = self._chunks.take(msg.session_id)
        if msg.features is None:
            if ahead is not None:
                raise InvalidRequest("feature chunks sent ahead of a message that carries no features")
            return None, 0
        features, first = self._checked_features(msg.features), msg.features_from
        if ahead is not None:
            features, first = ahead.joined(features, first)
        last = first + features.shape[0] - 1
        if last != end - 1:
            raise InvalidRequest(f"target features for positions {first}..{last}; the verdicts "
                                 f"commit up to {end - 1}")
        return features, first

    def _checked_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features as the head that reads them takes them: its dtype, its width, at least
        one row (INVALID_ARGUMENT otherwise)."""
        head = getattr(self.drafter, "head", None)
        if head is None:
            raise InvalidRequest("target features sent to a draft that reads none (a token draft)")
        width = len(head.config.target_layers) * head.config.hidden_size
        dtype = head.fc.weight.dtype
        if features.dtype != dtype or features.dim() != 2 or features.shape[1] != width or not features.shape[0]:
            raise InvalidRequest(f"target features of dtype {str(features.dtype).removeprefix('torch.')} and shape "
                                 f"{tuple(features.shape)}; this head reads {str(dtype).removeprefix('torch.')} "
                                 f"[n >= 1, {width}]")
        return features.to(head.fc.weight.device)

    def close_session(self, session_id: str, owner: SessionStream) -> None:
        super().close_session(session_id, owner)
        if session_id not in self.sessions:
            self._chunks.take(session_id)  # chunks of a session that ended go with it

    def idle(self) -> bool:
        """One batched step: a single draft forward advances every session that has a block to
        draft by one token, critical blocks and speculation alike; each block stops at its own
        place (its policy, the cap, a stop token, the budget)."""
        # a speculative row delays each block some target waits for in its step by what it adds to the step:
        # priced at its share of a step of one times how many ride with it (none at one session: a critical
        # block steps alone)
        now, price = self.clock(), row_share(self.step_cost) * self.riding.value
        for session in self.sessions.values():
            session.row_price, session.shared = price, len(self.sessions) > 1
        batch = [(sid, session, draft) for sid, session in self.sessions.items() for draft in session.next_drafts(now)]
        if any(session.critical is not None for _, session, _ in batch):  # a block some target waits for rides
            # a block drafted past a stop delays it by a row: it rides if the draft gives it more chance than that
            rides = [not draft.extended or draft.reach > price for _, _, draft in batch]
            self._sit_out(now, [item for item, ride in zip(batch, rides) if not ride])
            batch = [item for item, ride in zip(batch, rides) if ride]
        if not batch:
            return False
        if any(session.critical is None for _, session, _ in batch):
            self.riding.update(float(sum(session.critical is not None for _, session, _ in batch)))
        pending = [draft.pending_tokens for _, _, draft in batch]  # what each row takes in
        started = self.timer()
        try:
            batch = self._step_within_pool(batch)
        except Exception as exc:  # never retried as is: the step's sessions are given up, their targets go on alone
            exit_on_device_failure(exc)
            log.exception("a draft step of %d sessions failed; shedding them", len(batch))
            for session_id, _, _ in batch:
                self._shed(session_id, f"the draft step failed: {type(exc).__name__}")
            return True
        failed = {sid: draft.error for sid, _, draft in batch if draft.error is not None}
        for session_id, error in failed.items():
            log.error("draft session %s: its block failed on its own (%s: %s); the sessions beside it go on",
                      session_id, type(error).__name__, error)
            self._shed(session_id, f"its block failed: {type(error).__name__}")
        batch = [item for item in batch if item[0] not in failed]
        if not batch:
            return True
        tokens = sum(draft.pending_tokens for _, _, draft in batch)
        self.prepared_tokens += sum(session.preparing(draft) for _, session, draft in batch)  # a token each
        elapsed = self.timer() - started
        if len(batch) == len(pending) and max(pending) <= PREFILL_TOKENS:  # a prompt's forward prices no row
            self.step_cost.observe(sum(pending), elapsed)
        now = self.clock()
        for session_id, session in {sid: session for sid, session, _ in batch}.items():
            self._send(session_id, session, session.after_step(now, elapsed))
        self.step_metrics.record(len(batch), tokens, self.pool)
        return True

    def _sit_out(self, now: float, left_out: list) -> None:
        """Blocks drafted past their stops that a step leaves out: those that cannot grow in time
        after it are sent now (PipelinedDraft.sat_out)."""
        by_session: dict[str, tuple[PipelinedDraft, list]] = {}
        for session_id, session, draft in left_out:
            by_session.setdefault(session_id, (session, []))[1].append(draft)
        for session_id, (session, drafts) in by_session.items():
            sent = session.sat_out(now, drafts)
            if sent:
                self._send(session_id, session, sent)

    def _step_within_pool(self, batch: list) -> list:
        """The draft forward over the batch. When the KV pool cannot hold it (nothing is changed
        then), the speculation held on forks goes first (every session's); then the youngest
        session gives up its draft work until the rest fits: its pages go back and a shed Closed
        tells its target to go on alone. Older sessions keep their progress."""
        while batch:
            try:
                self.drafter.step([draft for _, _, draft in batch])
                return batch
            except PoolFull as exc:
                if any([session.release_forks() for session in self.sessions.values()]):
                    self.forks_released += 1
                    batch = [item for item in batch if item[2].cache is None]
                    continue
                youngest = next(reversed(self.sessions))
                self._shed(youngest, str(exc))
                batch = [item for item in batch if item[0] != youngest]
        return batch

    def add_stats(self, stats: pb.WorkerStats) -> None:
        stats.forks_released, stats.sessions_shed = self.forks_released, self.shed
        stats.prepared_tokens = self.prepared_tokens

    def _shed(self, session_id: str, why: str) -> None:
        stream = self.owner(session_id)
        self.close_session(session_id, stream)
        self.shed += 1
        log.warning("draft session %s shed (%s); its target goes on alone", session_id, why)
        stream.emit(pb.DraftEvent(closed=pb.Closed(session_id=session_id, shed=True)))

    def _send(self, session_id: str, session: PipelinedDraft, items: list[DraftedBlock]) -> None:
        stream = self.owner(session_id)
        probs = not session.session.sampling.greedy or isinstance(session.session.policy, AutoPolicy)
        for item in items:
            self.tokens_processed += len(item.block)
            stream.emit(pb.DraftEvent(block=convert.drafted_to_proto(session_id, item, probs)))

    def error_event(self, session_id: str, code: grpc.StatusCode, message: str) -> pb.DraftEvent:
        return pb.DraftEvent(error=pb.Error(session_id=session_id, code=code.value[0], message=message))


def _price(session: PipelinedDraft, price: float | None) -> None:
    """A verified node's price at the target's load (its range checked on the wire), for the
    session's next blocks: trees auto and deep-auto price their siblings by it, any tree the places
    of a continuation taken up past a sibling, and a block drafted past its stop each token more."""
    if price is not None:
        session.session.node_price = price


def _tune(session: PipelinedDraft, rule: StopRule | None) -> None:
    """A stop rule from the target side (policy auto) applies to the session's next blocks; one
    for a session of another policy is INVALID_ARGUMENT."""
    if rule is None:
        return
    policy = session.session.policy
    if not isinstance(policy, AutoPolicy):
        raise InvalidRequest(f"a stop rule for a session of policy {policy.name!r} (only auto takes one)")
    policy.tune(rule)
