"""Every knob, declared once: what a user sets on `svip generate` / `serve` / `bench` / `plan`, in the
Serve app's arguments and in the Helm chart's values, with its one default. The CLI's flags
(svip_cli/knob_flags.py) and the Serve app's settings (deploy/svip_serve/settings.py) are built from
this table; PairConfig (svip_common/pair_config.py) takes its defaults from it; the chart's
values.schema.json and values.yaml, docs/usage.md and deploy/serve-config.yaml are checked against
it (tests/unit/test_knobs.py). A knob here appears on every surface it names with no other edit; a
surface that leaves one out says why (`off`), and one whose default differs says why (`differs`)."""

from __future__ import annotations

from dataclasses import dataclass

from svip_common.auto_settings import MAX_AUTO_COST, MAX_WINDOW, MIN_WINDOW, WINDOW
from svip_common.contracts import DRAFT_LENGTH_CAP, DRAFT_PARALLEL, MAX_DRAFT_PARALLEL, POLICY_NAMES, PolicyConfig
from svip_common.emulation import parse_emulation
from svip_common.errors import InvalidRequest
from svip_common.knob import BENCH, CHART, GENERATE, PLAN, SERVE, SETTINGS, Knob
from svip_common.kv_sizes import DEFAULT_KV_TOKENS
from svip_common.step_cost import IDLE_PREFILL_MODES, LOAD_AWARE_MODES
from svip_common.trees import TREES

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "auto")  # svip_common/models.py DTYPES
DRAFT_KINDS = ("model", "eagle")  # what a draft reference names: a draft model, or a feature head
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "none")  # the formats tool_choice auto reads calls in; none: refused
MAX_TP_DEGREE = 8  # a tensor-parallel target's ranks at most: one node's GPUs (svip_common/tensor_parallel.py)
LAYOUTS = ("pack", "spread")
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests")
_POLICY = PolicyConfig()  # a request's policy knobs: the deployment's defaults for them are the request's own

ALL_DEPLOYED = (GENERATE, SERVE, SETTINGS, CHART)
TOOLS = (GENERATE, SERVE, BENCH, PLAN, SETTINGS, CHART)
SERVER = {GENERATE: "a server's: svip generate runs the prompts it is given, once"}
ONE_CALLER = {GENERATE: "a server's cap on what a client asks; svip generate runs its own request as given"}
NO_CHART = "not in the chart's values yet: set it in the RayService's serveConfigV2 args"
PACKED = {SERVE: "a Serve replica's workers are packed on its node and talk over loopback",
          SETTINGS: "a Serve replica's workers are packed on its node and talk over loopback",
          CHART: "a Serve replica's workers are packed on its node and talk over loopback"}
GPU_CHART = "the chart deploys on GPUs"


def _emulation(spec) -> None:
    parse_emulation(spec)


def _autoscaling(config) -> None:
    if set(config) != set(AUTOSCALING_KEYS):
        raise InvalidRequest(f"autoscaling must be an object with exactly {', '.join(AUTOSCALING_KEYS)}, "
                             f"got {config!r}")
    low, high, target = (config[k] for k in AUTOSCALING_KEYS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not 1 <= low <= high:
        raise InvalidRequest(f"autoscaling: need 1 <= min_replicas <= max_replicas (integers), got {low!r}, {high!r}")
    if not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0:
        raise InvalidRequest(f"autoscaling.target_ongoing_requests must be > 0, got {target!r}")


def _device(device) -> None:
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidRequest(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _threshold(text: str):
    return text if text == "auto" else float(text)


M, W, S, D, A, L, R = "models", "workers", "speculation", "request defaults", "server", "request limits", "recovery"
KNOBS: tuple[Knob, ...] = (
    # --- the models -------------------------------------------------------------------------------
    Knob("target", str, None, "the target model: a directory or a hub id", TOOLS, optional=True,
         unset="the embedded pair", group=M, chart="model.target",
         differs={CHART: ("Qwen/Qwen2.5-7B-Instruct", "a cluster serves a real model; the embedded pair is a test's")}),
    Knob("draft", str, None, "the draft model (a directory or hub id), a feature head's directory (EAGLE-3 layout; "
         "'eagle': the embedded target's own), or 'none': the target alone", TOOLS, optional=True,
         unset="the embedded pair's draft", group=M, chart="model.draft",
         differs={CHART: ("Qwen/Qwen2.5-0.5B-Instruct", "the draft of the chart's target")}),
    Knob("draft_kind", str, "model", "eagle: the draft is a feature head, a directory or a hub id (fetched into the "
         "hub cache); model: a draft model (a directory holding a head is still told by its config.json)",
         ALL_DEPLOYED, choices=DRAFT_KINDS, group=M, chart="model.draftKind"),
    Knob("model_name", str, None, "the model id clients send", (SERVE, SETTINGS, CHART), optional=True,
         unset="the target directory's name or hub id, or svip-pair", group=M, chart="model.name",
         off={GENERATE: "svip generate has no clients to name the model"},
         differs={CHART: ("", "YAML's empty string: the target's name")}),
    Knob("dtype", str, "float32", "the models' weights", TOOLS, choices=DTYPE_NAMES, group=M, chart="model.dtype",
         differs={CHART: ("bfloat16", f"{GPU_CHART}: half the memory, the models' own precision")}),
    Knob("device", str, "cpu", "cpu, or cuda (each worker takes GPUs; cuda:N in process)",
         (GENERATE, SERVE, BENCH, PLAN, SETTINGS), group=M, extra=_device,
         off={CHART: f"{GPU_CHART}: its Serve arguments say cuda"}),
    Knob("target_tp", int, 1, "the target as this many tensor-parallel ranks, each 1/N of every layer and of the KV "
         "cache (the model's attention and KV heads and MLP columns divide by N): a GPU each (a Ray actor each; "
         "in process a thread each); with emulate, the target's device count must be N",
         (GENERATE, SERVE, BENCH, SETTINGS, CHART), low=1, high=MAX_TP_DEGREE, group=M, chart="model.tensorParallel"),
    Knob("draft_tp", int, 1, "the draft model as this many tensor-parallel ranks, as target_tp (a feature head runs "
         "on one device)", (GENERATE, SERVE, BENCH, SETTINGS, CHART), low=1, high=MAX_TP_DEGREE, group=M,
         chart="model.draftTensorParallel"),
    # --- where the workers go -----------------------------------------------------------------------
    Knob("target_gpus", int, 1, "with device cuda: GPUs the target spans (one node), its layers one GPU after "
         "another", ALL_DEPLOYED, low=1, high=MAX_TP_DEGREE, scope="distributed", chart="model.targetGpus"),
    Knob("draft_gpus", int, 1, "with device cuda: GPUs the draft worker takes", ALL_DEPLOYED, low=1,
         high=MAX_TP_DEGREE, scope="distributed", chart="model.draftGpus"),
    Knob("worker_cpus", float, 1.0, "logical CPUs each model worker reserves", ALL_DEPLOYED, low=0, low_open=True,
         high=256, scope="distributed", chart="serve.workerCpus"),
    Knob("layout", str, None, "the draft and the target on one node (pack) or on two (spread), in a placement group "
         "of the pair's own", (GENERATE,), optional=True, unset="the caller's placement", choices=LAYOUTS,
         flag="--placement", scope="distributed", off=PACKED),
    Knob("ray_address", str, None, "an existing Ray cluster", (GENERATE,), optional=True,
         unset="Ray on this machine, loopback only", scope="distributed",
         off={SERVE: "svip serve starts Ray on this machine, loopback only",
              SETTINGS: "the app runs in the Ray cluster Serve runs in", CHART: "the chart makes the Ray cluster"}),
    Knob("grpc_tls_dir", str, None, "mutual TLS between the workers: a directory holding ca.crt, tls.crt, tls.key",
         (GENERATE, SERVE, SETTINGS), optional=True, unset="none", metavar="DIR", scope="distributed",
         off={CHART: "grpcTls.secretName: the chart mounts that Secret and sets the directory"}),
    Knob("insecure_workers", bool, False, "let the workers talk plaintext gRPC on a node address (refused without "
         "TLS otherwise; packed pairs use loopback and need neither)", (GENERATE,), scope="distributed", off=PACKED),
    # --- budgets and speculation --------------------------------------------------------------------
    Knob("kv_cache_tokens", int, DEFAULT_KV_TOKENS, "each worker's KV pool in tokens; a request's prompt + max_tokens "
         "counts against it (larger: refused; the rest wait for room rather than run out of it)", ALL_DEPLOYED, low=1,
         group=S, chart="serve.kvCacheTokens"),
    Knob("max_batched_tokens", int, 512, "at most this many tokens in one forward; longer prompts are prefilled in "
         "chunks", ALL_DEPLOYED, low=1, optional=True, unset="no cap", group=S, chart="serve.maxBatchedTokens"),
    Knob("load_aware", str, "greedy", "whose blocks hold no more tokens than pay at the target's measured load: "
         "greedy requests (a seed still reproduces a sampled output), all (sampled too), or off (each policy as "
         "configured)", (GENERATE, SERVE, BENCH, SETTINGS, CHART), choices=LOAD_AWARE_MODES, group=S,
         chart="decoding.loadAware",
         differs={BENCH: ("off", "a bench compares each policy as configured, round for round (the paper's "
                          "reference); --mode serve measures the server's defaults")}),
    Knob("pipeline", str, "async", "async overlaps drafting with verification; sync drafts, then verifies",
         ALL_DEPLOYED, choices=("sync", "async"), group=S, scope="distributed", chart="decoding.pipeline"),
    Knob("idle_prefill", str, "auto", "while no block is ready, the target takes in what a waiting session needs "
         "first (its last verdict's token, its prompt), beside a step's blocks a waiting session's next row "
         "rides, and a step may wait for blocks about to come: where it pays (auto), always (no wait), or off",
         (GENERATE, SERVE, BENCH, SETTINGS, CHART), choices=IDLE_PREFILL_MODES, group=S, scope="distributed",
         chart="decoding.idlePrefill"),
    Knob("draft_parallel", int, DRAFT_PARALLEL, "async: blocks a session drafts side by side on forked KV pages, its "
         "follow-up and the continuations prepared for a rejection (1: one at a time)",
         (GENERATE, SERVE, BENCH, SETTINGS, CHART), low=1, high=MAX_DRAFT_PARALLEL, group=S, scope="distributed",
         chart="decoding.draftParallel"),
    Knob("auto_learn", bool, True, "policy auto: keep fitting the pair's estimate on live verdicts (off: its prior "
         "stays, reproducible lengths)", ALL_DEPLOYED, group=S, chart="decoding.auto.learn"),
    Knob("auto_cost", float, None, "policy auto: a drafted token's cost in target-alone tokens, fixed",
         ALL_DEPLOYED, optional=True, unset="measured", low=0, low_open=True, high=MAX_AUTO_COST, metavar="TAU",
         group=S, chart="decoding.auto.cost"),
    Knob("auto_window", int, WINDOW, "policy auto: verdicted tokens the pair's live estimate rests on",
         ALL_DEPLOYED, low=MIN_WINDOW, high=MAX_WINDOW, group=S, chart="decoding.auto.window"),
    Knob("emulate", str, None, "device timing on this machine: every forward lasts its model's step on the devices "
         "SPEC names, e.g. target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100,link=0.1ms[,scale=2] (in process "
         "the two models take turns on one device; distributed each worker has its own); for measuring without "
         "GPUs", (GENERATE, SERVE, SETTINGS), optional=True, unset="as the models run", metavar="SPEC", group=S,
         extra=_emulation, off={CHART: f"{GPU_CHART}: their forwards take what they take"}),
    # --- what a request gets when it names nothing ----------------------------------------------------
    Knob("policy", str, _POLICY.name, "the length policy (auto: a stop learnt for the pair; svip: the paper's rule)",
         ALL_DEPLOYED, choices=POLICY_NAMES, group=D, chart="decoding.policy"),
    Knob("threshold", float, _POLICY.threshold, "svip: stop drafting once sqrt(0.15 * H) > threshold, or 'auto' "
         "(learnt for the pair)", ALL_DEPLOYED, low=0, words=("auto",), parse=_threshold, group=D,
         chart="decoding.threshold"),
    Knob("tree", str, _POLICY.tree, "each block a token tree, the policy deciding its depth: cape (CaPE's siblings "
         "at each drafted place), auto (those of them that pay at the target's load), deep (cape and each "
         "sibling's own next token), deep-auto (those nodes of it that pay), off (a chain)", ALL_DEPLOYED,
         choices=TREES, group=D, chart="decoding.tree"),
    Knob("tool_call_parser", str, "hermes", "the format chat's tool_choice auto reads the model's calls in: hermes "
         "(<tool_call>{...}</tool_call>), llama3_json (Llama 3.x's JSON) or none (auto refused)",
         (SERVE, SETTINGS, CHART), choices=TOOL_CALL_PARSERS, group=D, chart="decoding.toolCallParser",
         off={GENERATE: "svip generate has no chat and no tools"}),
    # --- the server -----------------------------------------------------------------------------------
    Knob("host", str, "127.0.0.1", "the HTTP address", (SERVE,), group=A,
         off={GENERATE: SERVER[GENERATE], SETTINGS: "Serve's http_options in the Serve config",
              CHART: "the chart's service"}),
    Knob("port", int, 8000, "the HTTP port", (SERVE,), low=1, high=65535, group=A,
         off={GENERATE: SERVER[GENERATE], SETTINGS: "Serve's http_options in the Serve config",
              CHART: "service.port"}),
    Knob("metrics_port", int, 8080, "Prometheus metrics on 127.0.0.1", (SERVE,), low=1, high=65535, group=A,
         off={GENERATE: SERVER[GENERATE], SETTINGS: "Ray's metrics export port, set where Ray starts",
              CHART: "metrics.port"}),
    Knob("api_key", tuple, (), "require 'Authorization: Bearer KEY' on /v1 (repeat for several keys; at least 32 "
         "characters; `name:KEY` names one; prefer $SVIP_API_KEY, comma-separated: ps shows flags)", (SERVE,),
         metavar="KEY", group=A,
         off={GENERATE: SERVER[GENERATE], SETTINGS: "api_key_sha256: the Serve config holds digests, never keys",
              CHART: "apiKey.secretName: the keys come from a Secret into $SVIP_API_KEY"}),
    Knob("api_key_sha256", tuple, (), "SHA-256 (hex) digests of the API keys, each optionally `name:` before it; "
         "$SVIP_API_KEY adds more; none: the API is open", (SETTINGS,), group=A,
         off={GENERATE: SERVER[GENERATE], SERVE: "svip serve takes the keys themselves (--api-key, $SVIP_API_KEY)",
              CHART: "apiKey.secretName: the keys come from a Secret into $SVIP_API_KEY"}),
    Knob("allow_open", bool, False, "serve with no API key on an address other than loopback (refused otherwise)",
         (SERVE,), group=A,
         off={GENERATE: SERVER[GENERATE], SETTINGS: "a Serve config says where it listens: its operator decides",
              CHART: "apiKey.allowOpen: an Ingress without a key"}),
    Knob("num_replicas", int, 1, "pipelines (draft + target pairs) to run", (SERVE, SETTINGS, CHART), low=1,
         high=1024, flag="--replicas", group=A, chart="serve.replicas", off=SERVER),
    Knob("autoscaling", dict, None, "{min_replicas, max_replicas, target_ongoing_requests}: Serve scales the "
         "pipelines with load", (SETTINGS, CHART), optional=True, unset="a fixed num_replicas", group=A,
         extra=_autoscaling, chart="serve.autoscaling",
         off={**SERVER, SERVE: "svip serve runs on one machine: --replicas"},
         differs={CHART: ({"enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetOngoingRequests": 8},
                          "enabled: false is none; the rest is its shape when enabled")}),
    Knob("max_in_flight", int, 16, "requests generating at once per pipeline; each of a request's n choices is a "
         "session", (SERVE, SETTINGS, CHART), low=1, high=4096, group=A, chart="serve.maxInFlight", off=SERVER),
    Knob("max_waiting", int, 32, "requests waiting per pipeline for a place; past it: 429", (SERVE, SETTINGS, CHART),
         low=0, high=1 << 20, group=A, chart="serve.maxWaiting", off=SERVER),
    Knob("max_wait_s", float, 30.0, "a request that waited this long for a place gets 429", (SERVE, SETTINGS, CHART),
         low=0, low_open=True, high=1_000_000, group=A, chart="serve.maxWaitS", off=SERVER),
    Knob("max_queued_requests", int, 64, "Serve's own queue per proxy when every replica is full; past it: 429",
         (SERVE, SETTINGS, CHART), low=0, high=1 << 20, group=A, chart="serve.maxQueuedRequests", off=SERVER),
    Knob("health_check_period_s", float, 10.0, "Serve checks each pipeline this often; three failures in a row "
         "replace it", (SERVE, SETTINGS, CHART), low=0, low_open=True, high=1_000_000, group=A,
         chart="serve.healthCheckPeriodS", off=SERVER),
    Knob("drain_timeout_s", float, 60.0, "on stop (SIGTERM, Ctrl-C): no new requests (503), and those in flight "
         "(streams too) get this long to finish (the chart's pods get it and 30 s more to stop)",
         (SERVE, SETTINGS, CHART), low=0, low_open=True, high=86400, group=A, chart="serve.drainTimeoutS", off=SERVER),
    # --- what a request may ask for -------------------------------------------------------------------
    Knob("max_requests_per_key", int, 0, "requests one API key may have running or waiting per pipeline (0: no "
         "limit)", (SERVE, SETTINGS, CHART), low=0, group=L, chart="serve.maxRequestsPerKey", off=SERVER,
         differs={CHART: (8, "a cluster faces many clients: one key never takes a pipeline's every place")}),
    Knob("max_kv_tokens_per_key", int, 0, "KV tokens (prompt + max_tokens) one API key may hold or wait for per "
         "pipeline (0: no limit)", (SERVE, SETTINGS, CHART), low=0, group=L, chart="serve.maxKvTokensPerKey",
         off=SERVER, differs={CHART: (16384, "half of kvCacheTokens: one key never holds the whole pool")}),
    Knob("default_max_tokens", int, 2048, "a chat request without max_tokens generates at most this many tokens "
         "(the context caps it too)", (SERVE, SETTINGS, CHART), low=1, group=L, chart="serve.defaultMaxTokens",
         off=ONE_CALLER),
    Knob("max_tokens_cap", int, 4096, "a request's max_tokens past this is refused with 400 (the context caps it "
         "too)", (SERVE, SETTINGS, CHART), low=1, group=L, chart="serve.maxTokensCap", off=ONE_CALLER),
    Knob("draft_length_cap", int, DRAFT_LENGTH_CAP, "the longest block a request may ask for (draft_length, "
         "max_draft_length) and the workers draft", (SERVE, SETTINGS, CHART), low=1, high=DRAFT_LENGTH_CAP,
         group=L, chart="decoding.draftLengthCap",
         off={GENERATE: "a request's own --max-draft-length caps its blocks in svip generate"}),
    Knob("allow_ignore_eos", bool, False, "let requests set ignore_eos (generate to max_tokens past the end of the "
         "text)", (SERVE, SETTINGS, CHART), group=L, chart="serve.allowIgnoreEos", off=ONE_CALLER),
    Knob("max_request_bytes", int, 4 * 1024 * 1024, "a larger request body is refused with 413 before it is parsed",
         (SERVE, SETTINGS, CHART), low=1, high=1 << 30, group=L, chart="serve.maxRequestBytes", off=ONE_CALLER),
    Knob("body_read_timeout_s", float, 30.0, "a request body not read in full by then gets 408",
         (SERVE, SETTINGS, CHART), low=0, low_open=True, high=1_000_000, group=L, chart="serve.bodyReadTimeoutS",
         off=ONE_CALLER),
    Knob("max_grammar_compile_ms", int, 250, "a request's grammar (response_format, tools) that takes longer to "
         "compile is a 400; an API key may spend 16 times this a minute on the server's parse thread",
         (SERVE, SETTINGS, CHART), low=1, high=60_000, group=L, chart="serve.maxGrammarCompileMs", off=ONE_CALLER),
    # --- when a worker is lost ------------------------------------------------------------------------
    Knob("worker_start_timeout_s", float, 600.0, "a worker is placed and loads its weights within this (a first "
         "download from the hub counts); one ask for a replaced draft may take as long", ALL_DEPLOYED, low=0,
         low_open=True, high=1_000_000, group=R, scope="distributed", chart="serve.workerStartTimeoutS",
         differs={CHART: (900.0, "a pod's first start downloads the weights (a 7B target is ~15 GB)")}),
    Knob("worker_restarts", int, 5, "times Ray restarts a worker that dies; the sessions in flight go on",
         ALL_DEPLOYED, low=0, high=1000, group=R, scope="distributed", chart="serve.workerRestarts"),
    Knob("draft_stall_s", float, 3.0, "the least a session waits on its draft before it goes on without it",
         ALL_DEPLOYED, low=0, low_open=True, high=1_000_000, group=R, scope="distributed", chart="serve.draftStallS"),
    Knob("sampled_hold_s", float, 30.0, "how long a sampled session waits for a lost draft, so that its seed "
         "reproduces", ALL_DEPLOYED, low=0, high=1_000_000, group=R, scope="distributed", chart="serve.sampledHoldS"),
)

BY_NAME = {knob.name: knob for knob in KNOBS}


def knob(name: str) -> Knob:
    return BY_NAME[name]


def default(name: str):
    return BY_NAME[name].default


def carried_by(surface: str) -> tuple[Knob, ...]:
    """The knobs a surface carries, in the declaration's order."""
    return tuple(k for k in KNOBS if surface in k.on)


def checked(values: dict, surface: str, noun: str = "setting") -> dict:
    """Each value checked by its knob on ``surface`` (keys it does not carry refused, naming those it does)."""
    known = {k.name: k for k in carried_by(surface)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InvalidRequest(f"unknown {noun}(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return {name: known[name].check(value) for name, value in values.items()}


def carrying(surface: str):
    """A class decorator: the class becomes a frozen dataclass whose fields are the knobs ``surface``
    carries, in the declaration's order, each with its default there (then the class's own fields)."""

    def build(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        fields = {}
        for k in carried_by(surface):
            fields[k.name] = f"{k.kind.__name__} | None" if k.optional else k.kind.__name__
            setattr(cls, k.name, k.default_on(surface))
        cls.__annotations__ = {**fields, **own}
        return dataclass(frozen=True)(cls)

    return build
