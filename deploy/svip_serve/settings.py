"""What one deployment of the app serves and how it is placed: the `args` of the Serve config
(deploy/serve-config.yaml, the Helm chart's serveConfigV2) and of `svip serve`, checked up front
with errors that name the key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from svip_assets import check_draft_kind
from svip_common.auto_settings import AutoSettings
from svip_common.contracts import DRAFT_LENGTH_CAP, DRAFT_PARALLEL, POLICY_NAMES, PolicyConfig, check_draft_parallel
from svip_common.errors import InvalidRequest
from svip_common.hub import split_revision
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.pair_config import PairConfig, Recovery, check_tp_degree, worker_emulation
from svip_common.step_cost import check_idle_prefill, check_load_aware
from svip_serve.auth import split_name
from svip_serve.tools import TOOL_CALL_PARSERS

EMBEDDED_MODEL_NAME = "svip-pair"
REPLICA_CPUS = 0.5  # the replica only relays: asyncio, gRPC and tokenization
TARGET_BUNDLE, DRAFT_BUNDLE = 1, 2  # bundle 0 holds the replica


@dataclass(frozen=True)
class ServeSettings:
    target: str | None = None  # model directory or hub id; None: the embedded pair
    draft: str | None = None  # None with the embedded target: its draft; "none": the target alone
    draft_kind: str | None = None  # "eagle": the draft is a feature head, a directory or hub id; "model" or
    # None: a draft model (a directory whose config.json names an EAGLE architecture is still a head)
    model_name: str | None = None  # the id clients pass as `model` (default: the target directory's name, or hub id)
    dtype: str = "float32"
    device: str = "cpu"  # "cpu", or "cuda": the workers take GPUs from the replica's placement group
    target_gpus: int = 1  # cuda: GPUs the target spans (one node)
    target_tp: int = 1  # the target's tensor-parallel ranks: a GPU each (svip_common/tensor_parallel.py)
    draft_gpus: int = 1
    worker_cpus: float = 1.0  # logical CPUs each worker reserves
    pipeline: str = "async"
    num_replicas: int = 1  # one pipeline (draft + target) per replica
    max_in_flight: int = 16  # requests generating at once on a replica's pipeline (each of n choices a session)
    kv_cache_tokens: int = DEFAULT_KV_TOKENS  # each worker's KV pool; admission counts prompt + max_tokens against it
    max_batched_tokens: int = 512  # at most this many tokens in one target forward; longer prompts prefill in chunks
    load_aware: str = "greedy"  # whose blocks follow the target's load: off, greedy, all (svip_common/step_cost.py)
    idle_prefill: str = "auto"  # the target, idle, takes in what waiting sessions need first: auto, always, off
    draft_parallel: int = DRAFT_PARALLEL  # blocks an async session drafts side by side (its follow-up, continuations)
    max_waiting: int = 32  # requests a replica holds for a free slot; past it: 429
    max_wait_s: float = 30.0  # a request that waited this long for a place gets 429
    max_requests_per_key: int = 0  # requests one API key may have running or waiting on a replica (0: no limit)
    default_max_tokens: int = 2048  # a chat request without max_tokens generates at most this (the cap and context too)
    max_tokens_cap: int = 4096  # a request's max_tokens past this is a 400 (the context caps it too)
    max_kv_tokens_per_key: int = 0  # KV tokens (prompt + max_tokens) one API key may hold or wait for (0: no limit)
    allow_ignore_eos: bool = False  # whether a request may ask to generate past the end of its text
    body_read_timeout_s: float = 30.0  # a request body not read in full by then: 408
    max_queued_requests: int = 64  # Serve's own queue per proxy when every replica is full; past it: 429
    policy: str = "auto"  # request default; a request's `policy` overrides it
    threshold: float = 0.3
    tree: str = "off"  # request default: one of svip_common/trees.py TREES; a request's `tree` overrides it
    tool_call_parser: str = "hermes"  # the format chat's tool_choice auto reads calls in; none: auto refused
    auto_learn: bool = True  # policy auto: keep fitting the pair's estimate on live verdicts (off: its prior stays)
    auto_cost: float | None = None  # policy auto: a fixed cost of a drafted token (tau) in place of the measured one
    auto_window: int = 4096  # policy auto: verdicted tokens the live fit rests on
    draft_length_cap: int = DRAFT_LENGTH_CAP  # cap on a request's draft_length / max_draft_length (and any block)
    max_request_bytes: int = 4 * 1024 * 1024  # a larger body is refused with 413 before it is parsed
    max_grammar_compile_ms: int = 250  # a request's grammar that takes longer to compile is a 400 (a key: 16x a minute)
    api_key_sha256: tuple[str, ...] = ()  # SHA-256 (hex) of the API keys; $SVIP_API_KEY adds more; none: open
    grpc_tls_dir: str | None = None  # mutual TLS between a pipeline's workers: ca.crt, tls.crt, tls.key (every node)
    worker_start_timeout_s: float = 600.0
    worker_restarts: int = 5  # Ray restarts a worker that dies this many times; sessions in flight go on (issue 11)
    draft_stall_s: float = 3.0  # the least a session waits on its draft before it goes on without it
    sampled_hold_s: float = 30.0  # a sampled session waits this long for a lost draft (so its seed reproduces)
    autoscaling: dict | None = None  # {min_replicas, max_replicas, target_ongoing_requests}: Serve scales the pipelines
    health_check_period_s: float = 10.0  # Serve checks each replica this often (three failures in a row replace it)
    drain_timeout_s: float = 60.0  # on stop, requests in flight (streams too) get this long to finish
    emulate: str | None = None  # device timing on this machine (svip_common/emulation.py): each worker's forwards
    # last its model's step on the devices this names; for measuring without GPUs, never on real ones

    @classmethod
    def from_args(cls, args: dict | None) -> ServeSettings:
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise InvalidRequest(f"unknown app argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if isinstance(args.get("api_key_sha256"), list):  # YAML and JSON give lists
            args["api_key_sha256"] = tuple(args["api_key_sha256"])
        settings = cls(**args)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise InvalidRequest(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.target is None and self.draft not in (None, "none", "eagle"):
            raise InvalidRequest("a draft was given without a target; give both, or neither for the embedded pair "
                                 "(its draft 'eagle': the embedded target's feature head)")
        if self.target is not None and self.draft == "eagle":
            raise InvalidRequest("draft 'eagle' is the embedded target's feature head; with a target give its "
                                 "head's directory")
        check_draft_kind(self.draft, self.draft_kind)
        if self.target is not None and self.draft is None:
            raise InvalidRequest("a target needs a draft: a model directory or hub id, or 'none' for the target alone")
        if self.pipeline not in ("sync", "async"):
            raise InvalidRequest(f"pipeline must be 'sync' or 'async', got {self.pipeline!r}")
        for name in (
            "target_gpus",
            "draft_gpus",
            "num_replicas",
            "max_in_flight",
            "draft_length_cap",
            "max_request_bytes",
            "max_grammar_compile_ms",
            "kv_cache_tokens",
            "max_batched_tokens",
            "default_max_tokens",
            "max_tokens_cap",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("max_waiting", "max_queued_requests", "worker_restarts", "max_requests_per_key",
                     "max_kv_tokens_per_key"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise InvalidRequest(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        check_load_aware(self.load_aware)
        check_idle_prefill(self.idle_prefill)
        check_draft_parallel(self.draft_parallel)
        check_tp_degree(self.target_tp, "target_tp")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidRequest(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                                 f"got {self.tool_call_parser!r}")
        if self.worker_cpus <= 0:
            raise InvalidRequest(f"worker_cpus must be > 0, got {self.worker_cpus}")
        if not isinstance(self.allow_ignore_eos, bool):
            raise InvalidRequest(f"allow_ignore_eos must be true or false, got {self.allow_ignore_eos!r}")
        for name in (
            "worker_start_timeout_s",
            "draft_stall_s",
            "max_wait_s",
            "body_read_timeout_s",
            "health_check_period_s",
            "drain_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise InvalidRequest(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.sampled_hold_s, (int, float)) or not 0 <= self.sampled_hold_s < 1e6:
            raise InvalidRequest(f"sampled_hold_s must be a number of seconds >= 0, got {self.sampled_hold_s!r}")
        if self.autoscaling is not None:
            _check_autoscaling(self.autoscaling)
        if self.policy not in POLICY_NAMES:
            raise InvalidRequest(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        self.policy_defaults().validate(self.draft_length_cap)
        if not isinstance(self.auto_learn, bool):
            raise InvalidRequest(f"auto_learn must be true or false, got {self.auto_learn!r}")
        if self.auto_cost is not None and not isinstance(self.auto_cost, (int, float)):
            raise InvalidRequest(f"auto_cost must be a number, got {self.auto_cost!r}")
        if not isinstance(self.auto_window, int):
            raise InvalidRequest(f"auto_window must be an integer, got {self.auto_window!r}")
        self.auto()
        if self.emulate is not None:
            if not isinstance(self.emulate, str):
                raise InvalidRequest(f"emulate must be a spec such as target=MODEL@DEVICE,..., got {self.emulate!r}")
            worker_emulation(self.emulate, self.draft != "none")
        bad_hash = next((h for h in self.api_key_sha256 if not _is_key_digest(h)), None)
        if bad_hash is not None or not isinstance(self.api_key_sha256, tuple):
            raise InvalidRequest(
                "api_key_sha256 must be a list of SHA-256 digests (64 hex digits, optionally "
                "`name:` before them), not the keys"
            )

    def pair_config(self) -> PairConfig:
        """A replica's pair and its workers (svip_common/pair_config.py), packed on the replica's
        node (its placement group is STRICT_PACK: the workers talk over the node's loopback)."""
        target, draft = self.model_paths()
        recovery = Recovery(max_restarts=self.worker_restarts, draft_stall_s=float(self.draft_stall_s),
                            sampled_hold_s=float(self.sampled_hold_s),
                            draft_recover_s=float(self.worker_start_timeout_s))  # one ask may take as long as a start
        return PairConfig(
            target=target, draft=draft, dtype=self.dtype, device=self.device,
            target_gpus=(self.target_gpus if self.target_tp == 1 else 1) if self.gpus else 0,
            draft_gpus=self.draft_gpus if self.gpus else 0, target_tp=self.target_tp,
            worker_cpus=self.worker_cpus, packed=True, grpc_tls_dir=self.grpc_tls_dir,
            kv_cache_tokens=self.kv_cache_tokens, max_batched_tokens=self.max_batched_tokens,
            max_draft_length=self.draft_length_cap, load_aware=self.load_aware, idle_prefill=self.idle_prefill,
            draft_parallel=self.draft_parallel,
            auto=self.auto(), recovery=recovery, start_timeout_s=self.worker_start_timeout_s, emulate=self.emulate,
        ).checked()

    def auto(self) -> AutoSettings:
        """The `auto` policy's settings, checked (svip_common/acceptance.py)."""
        cost = None if self.auto_cost is None else float(self.auto_cost)
        return AutoSettings(learn=self.auto_learn, cost=cost, window=self.auto_window).check()

    def policy_defaults(self) -> PolicyConfig:
        """What a request that names no policy knobs gets; within the cap."""
        base = PolicyConfig()
        return PolicyConfig(
            name=self.policy,
            threshold=self.threshold,
            tree=self.tree,
            draft_length=min(base.draft_length, self.draft_length_cap),
            max_draft_length=min(base.max_draft_length, self.draft_length_cap),
        )

    def model_paths(self) -> tuple[str, str | None]:
        """(target, draft or None) as directories or hub ids."""
        if self.target is None:
            from svip_assets import default_pair

            target, draft = default_pair()
            if self.draft == "eagle":
                from svip_assets import head_path

                return target, head_path(self.draft)
            return target, None if self.draft == "none" else draft
        if self.draft_kind == "eagle":
            from svip_assets import head_path

            return self.target, head_path(self.draft, self.draft_kind)  # a hub id: fetched into the hub cache
        return self.target, None if self.draft == "none" else self.draft

    @property
    def served_name(self) -> str:
        """The id clients pass as `model`: never a filesystem path (a target directory is known by
        its last component; a hub id as it is)."""
        if self.model_name:
            return self.model_name
        if self.target is None:
            return EMBEDDED_MODEL_NAME
        if Path(self.target).expanduser().exists():
            return Path(self.target).name
        return split_revision(self.target)[0]  # a hub id as it is, without a pinned revision

    @property
    def gpus(self) -> bool:
        return self.device == "cuda"

    def bundles(self) -> list[dict[str, float]]:
        """The replica's placement group: the replica itself, then the target, then the draft,
        packed onto one node (the workers listen on that node's loopback)."""
        target, draft = {"CPU": self.worker_cpus * self.target_tp}, {"CPU": self.worker_cpus}  # every rank's
        if self.gpus:
            target_gpus = self.target_gpus if self.target_tp == 1 else self.target_tp  # a GPU each rank
            target["GPU"], draft["GPU"] = float(target_gpus), float(self.draft_gpus)
        bundles = [{"CPU": REPLICA_CPUS}, target]
        return bundles + [draft] if self.draft != "none" else bundles


def _is_key_digest(value) -> bool:
    """A SHA-256 hex digest, or `name:` and one."""
    if not isinstance(value, str):
        return False
    _, hexdigest = split_name(value)
    return len(hexdigest) == 64 and all(c in "0123456789abcdef" for c in hexdigest)


AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests")


def _check_autoscaling(config) -> None:
    if not isinstance(config, dict) or set(config) != set(AUTOSCALING_KEYS):
        raise InvalidRequest(
            f"autoscaling must be an object with exactly {', '.join(AUTOSCALING_KEYS)}, got {config!r}"
        )
    low, high, target = (config[k] for k in AUTOSCALING_KEYS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not 1 <= low <= high:
        raise InvalidRequest(f"autoscaling: need 1 <= min_replicas <= max_replicas (integers), got {low!r}, {high!r}")
    if not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0:
        raise InvalidRequest(f"autoscaling.target_ongoing_requests must be > 0, got {target!r}")
