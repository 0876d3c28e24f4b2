"""Prometheus metrics through Ray's metrics agent (every node exports them on its metrics port).
Names follow vLLM's speculative-decoding counters (docs/architecture.md, Metrics): `vllm:spec_decode_*` is
`ray_svip_spec_decode_*` here (Ray prefixes `ray_` and, from 2.60, drops names with a colon;
counters end in `_total`), so a vLLM dashboard carries over by renaming; SVIP's own series sit
beside them."""

from __future__ import annotations

from svip_common.acceptance import FEATURES
from svip_common.contracts import DRAFT_LENGTH_CAP, GenerationStats

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
LENGTH_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40]
ENTROPY_BUCKETS = [0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MAX_POSITION_LABELS = DRAFT_LENGTH_CAP  # positions past the default block cap are not labelled
BYTES_BUCKETS = [64, 128, 256, 512, 1024, 4096, 16384, 65536, 262144, 1048576]


class ServeMetrics:
    def __init__(self, model_name: str):
        from ray.util import metrics as m

        tags = ("model_name",)
        self.tags = {"model_name": model_name}

        def counter(name, doc, extra=()):
            return m.Counter(f"svip_{name}", doc, tag_keys=tags + extra)

        def histogram(name, doc, buckets):
            return m.Histogram(f"svip_{name}", doc, boundaries=buckets, tag_keys=tags)

        # vLLM's spec-decode counters
        self.drafts = counter("spec_decode_num_drafts", "Draft blocks verified by the target (rounds).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the block (0-based).", ("position",))
        self.emitted = counter("spec_decode_num_emitted_tokens", "Tokens emitted (accepted, corrections, bonuses).")
        # SVIP's own
        self.discarded = counter("spec_decode_num_discarded_tokens", "Pre-drafted tokens dropped by rollbacks.")
        self.tree_nodes = counter("spec_decode_num_tree_nodes",
                                  "Nodes of token trees verified (drafted tokens, siblings, nodes grown below).")
        self.branches = counter("spec_decode_num_branches", "Rounds where a token tree's sibling settled the "
                                "rejected place (one token more that round).")
        self.branch_tokens = counter("spec_decode_num_branch_tokens", "Tokens token trees settled off the spine "
                                     "(a sibling, and the nodes grown below it that were taken).")
        self.pauses = counter("spec_decode_num_pauses",
                              "Times a session stopped drafting: it did not pay at the target's load.")
        self.both_busy = counter("spec_decode_overlap_seconds", "Time draft and target computed at once.")
        self.draft_wait = counter("spec_decode_draft_wait_seconds", "Time the draft worker idled (bubbles).")
        self.target_wait = counter("spec_decode_target_wait_seconds", "Time the target worker idled (bubbles).")
        self.draft_length = histogram("spec_decode_draft_length", "Length of each draft block.", LENGTH_BUCKETS)
        self.stop_entropy = histogram("spec_decode_stop_entropy", "Draft entropy (nats) where a block stopped.",
                                      ENTROPY_BUCKETS)
        self.wire_bytes = histogram("spec_decode_wire_bytes_per_round", "gRPC bytes per round, both workers.",
                                    BYTES_BUCKETS)
        # recovery: sessions that outlived a worker (coordinator/session/draft_port.py, coordinator/distributed.py)
        self.detached = counter("sessions_detached", "Times a session went on without its draft (lost or stalled).")
        self.reattached = counter("sessions_reattached", "Times a draft took a session up again.")
        self.worker_restarts = counter("worker_restarts", "Workers replaced under running sessions.", ("role",))
        self.forks_released = counter("draft_forks_released", "Times the draft worker's short KV pool took back the "
                                      "pages of continuations prepared side by side, before it would shed a session.")
        self.sessions_shed = counter("draft_sessions_shed", "Sessions whose draft work the draft worker gave up (its "
                                     "KV pool full, a failed step): they go on with the target alone.")
        self.prepared_tokens = counter("draft_prepared_tokens", "Tokens the draft worker drafted for continuations "
                                       "prepared after a rejection, taken up or not (what preparing costs).")
        self.prompt_shared = counter("prompt_tokens_shared", "Prompt tokens the target took from another session's "
                                     "KV pages (n choices, a common prefix) instead of prefilling them.")
        self.reprefilled = counter("reprefilled_tokens", "Tokens prefilled again on a replaced target worker.")
        self.recover_time = histogram("time_to_recover_seconds", "A session's wait from its target worker's loss "
                                      "to going on on the replaced one.", LATENCY_BUCKETS)
        # requests
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens returned to clients.")
        self.requests = counter("request_success", "Finished requests.", ("finished_reason",))
        self.rejected = counter("request_rejected", "Requests refused before generating.", ("reason",))
        self.latency = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.",
                                 LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first settled token.", LATENCY_BUCKETS)
        self.running = m.Gauge("svip_num_requests_running", "Sessions generating on this replica.", tag_keys=tags)
        self.waiting = m.Gauge("svip_num_requests_waiting", "Requests waiting for a session slot or KV room.",
                               tag_keys=tags)
        self.cached_tokens = m.Gauge("svip_worker_cached_tokens", "Tokens in a worker's KV caches.",
                                     tag_keys=tags + ("role",))
        self.open_sessions = m.Gauge("svip_worker_open_sessions", "Sessions open on a worker.",
                                     tag_keys=tags + ("role",))
        self.draft_lost = m.Gauge("svip_draft_lost", "1 while the target has no draft worker (sessions go on without "
                                  "speculation, the draft is being replaced); alert when it stays 1.", tag_keys=tags)
        self.auto_acceptance = m.Gauge("svip_auto_acceptance", "Policy auto: mean acceptance of the verdicted drafted "
                                       "tokens, as predicted by the pair's estimate and as observed.",
                                       tag_keys=tags + ("kind", "source"))
        self.auto_weight = m.Gauge("svip_auto_weight",
                                   "Policy auto: the pair's acceptance model, one weight per feature.",
                                   tag_keys=tags + ("kind", "feature"))
        self._totals = Totals()  # what the workers' own counts were when last read
        self.kv_usage = m.Gauge("svip_kv_cache_usage_perc",
                                "Share of a worker's KV pool pages in use (vLLM's cache usage).",
                                tag_keys=tags + ("role",))

    def record_generation(self, stats: GenerationStats, prompt_tokens: int, completion_tokens: int,
                          finish_reason: str, latency_s: float, ttft_s: float | None) -> None:
        t = self.tags
        self._inc(self.drafts, stats.rounds)
        self._inc(self.draft_tokens, stats.draft_tokens)
        self._inc(self.accepted, stats.accepted_tokens)
        per_pos: dict[int, int] = {}
        for accepted in stats.accepted_lengths:
            for pos in range(min(accepted, MAX_POSITION_LABELS)):  # a bounded label set
                per_pos[pos] = per_pos.get(pos, 0) + 1
        for pos, count in per_pos.items():
            self.accepted_per_pos.inc(count, {**t, "position": str(pos)})
        self._inc(self.emitted, completion_tokens)
        self._inc(self.discarded, stats.discarded_tokens)
        self._inc(self.tree_nodes, stats.tree_nodes)
        self._inc(self.branches, stats.branches)
        self._inc(self.branch_tokens, stats.branch_tokens)
        self._inc(self.pauses, stats.pauses)
        self._inc(self.detached, stats.detached)
        self._inc(self.reattached, stats.reattached)
        self._inc(self.reprefilled, stats.reprefilled_tokens)
        if stats.target_restarts:
            self.recover_time.observe(stats.recover_s, t)
        self._inc(self.both_busy, stats.both_busy_s)
        self._inc(self.draft_wait, stats.draft_wait_s)
        self._inc(self.target_wait, stats.target_wait_s)
        for length in stats.draft_lengths:
            self.draft_length.observe(length, t)
        for entropy in stats.stop_entropies:
            self.stop_entropy.observe(entropy, t)
        if stats.rounds:
            self.wire_bytes.observe(stats.wire_bytes_per_round, t)
        self._inc(self.prompt_tokens, prompt_tokens)
        self._inc(self.generation_tokens, completion_tokens)
        self.requests.inc(1, {**t, "finished_reason": finish_reason})
        self.latency.observe(latency_s, t)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, t)

    def set_workers(self, stats: dict) -> None:
        """stats: role -> WorkerStats (the engine's worker_stats())."""
        for role, s in stats.items():
            self.cached_tokens.set(s.cached_tokens, {**self.tags, "role": role})
            self.open_sessions.set(s.open_sessions, {**self.tags, "role": role})
            if s.kv_pages_total:
                self.kv_usage.set(s.kv_pages_used / s.kv_pages_total, {**self.tags, "role": role})
        if "target" in stats:
            shared = self._totals.delta("prompt_tokens_shared", stats["target"].prompt_tokens_shared)
            self._inc(self.prompt_shared, shared)
        if "draft" in stats:
            self._inc(self.forks_released, self._totals.delta("forks_released", stats["draft"].forks_released))
            self._inc(self.sessions_shed, self._totals.delta("sessions_shed", stats["draft"].sessions_shed))
            self._inc(self.prepared_tokens, self._totals.delta("prepared_tokens", stats["draft"].prepared_tokens))

    def set_auto(self, target) -> None:
        """target: the target's WorkerStats, which carry the pair's `auto` estimate."""
        for kind, state in (("greedy", target.auto_greedy), ("sampled", target.auto_sampled)):
            if state.observed_tokens:
                self.auto_acceptance.set(state.predicted_acceptance, {**self.tags, "kind": kind, "source": "predicted"})
                self.auto_acceptance.set(state.observed_acceptance, {**self.tags, "kind": kind, "source": "observed"})
            for feature, weight in zip(FEATURES, state.weights):
                self.auto_weight.set(weight, {**self.tags, "kind": kind, "feature": feature})

    def set_draft_lost(self, lost: bool) -> None:
        self.draft_lost.set(1.0 if lost else 0.0, self.tags)

    def set_restarts(self, restarts: dict[str, int]) -> None:
        """restarts: role -> workers replaced so far (counted up to it)."""
        for role, count in restarts.items():
            if (more := self._totals.delta(f"restarts/{role}", count)) > 0:
                self.worker_restarts.inc(more, {**self.tags, "role": role})

    def record_rejected(self, reason: str) -> None:
        self.rejected.inc(1, {**self.tags, "reason": reason})

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running, self.tags)
        self.waiting.set(waiting, self.tags)

    def _inc(self, counter, value: float) -> None:
        if value > 0:  # Ray counters refuse 0 increments
            counter.inc(value, self.tags)


class Totals:
    """Counters a worker keeps as running totals, turned into increments: what each total grew by
    since it was last read. A total that went down belongs to a replaced worker, counting again
    from 0: all of it is new."""

    def __init__(self):
        self._seen: dict[str, int] = {}

    def delta(self, name: str, total: int) -> int:
        seen = self._seen.get(name, 0)
        self._seen[name] = total
        return total if total < seen else total - seen
