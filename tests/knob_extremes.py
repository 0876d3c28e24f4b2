"""Every knob a request sets, at its extremes (issue 40): zero, subnormal, huge, NaN and infinity
where JSON allows them, negative, the wrong type, one past each cap. Each case is a patch on a
well-formed sampled completion body and the outcome it must get: "400" (refused, naming the
field) or "ok" (served, correctly). The same table drives the parser's unit test, the engine in
process, both distributed pipelines and the live Serve app, so a value is held to one answer
everywhere."""

from __future__ import annotations

import dataclasses

from svip_common.contracts import DRAFT_LENGTH_CAP, GREEDY_BELOW, GenerationRequest, Limits
from svip_common.errors import InvalidRequest
from svip_common.grammar import MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH

NAN, INF = float("nan"), float("inf")
TINY = 5e-324  # the smallest subnormal double
HUGE = 1.7976931348623157e308  # the largest double
BASE = {"prompt": "def f(", "max_tokens": 6, "temperature": 1.0, "seed": 1}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
DEEP = {"type": "array", "items": {}}  # nested past the cap below
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "array", "items": DEEP}


@dataclasses.dataclass(frozen=True)
class Case:
    patch: dict
    outcome: str  # "ok" or "400"

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v!r}"[:40] for k, v in self.patch.items())

    def body(self) -> dict:
        return {**BASE, **self.patch}


def _cases(field: str, ok: list, refused: list, **with_) -> list[Case]:
    return [Case({**with_, field: v}, "ok") for v in ok] + [Case({**with_, field: v}, "400") for v in refused]


CASES: list[Case] = [
    *_cases("temperature", [0, -0.0, TINY, GREEDY_BELOW, 1.0000001 * GREEDY_BELOW, 1e-3, 1e300, HUGE],
            [-TINY, -1, NAN, INF, -INF, "1", []]),
    *_cases("top_p", [TINY, 1e-46, 1e-45, 1e-38, 1e-7, 0.5, 1],
            [1.0000000000000002, 0, -0.0, -1, NAN, INF, 2]),
    *_cases("top_k", [0, 1, 2, 2**31 - 1], [2**31, -1, 10**30, 1.5, "5"]),
    *_cases("seed", [0, 2**63 - 1], [2**63, -1, 1.5, 10**400]),
    *_cases("max_tokens", [1], [0, -1, 2**31 - 1, 2**31, 10**30, NAN]),
    *_cases("stop", ["", [""], ["x" * 256] * 16, "\u0000"], [["x"] * 17, ["x" * 257], 5, [None]]),
    *_cases("threshold", [0, TINY, 1e308, "auto"], [-1, -TINY, NAN, INF, "high"], policy="svip"),
    *_cases("entropy_scale", [TINY, 1e308], [0, -1, NAN], policy="svip"),
    *_cases("draft_length", [1, DRAFT_LENGTH_CAP], [0, DRAFT_LENGTH_CAP + 1, -1, 2**31], policy="constant"),
    *_cases("max_draft_length", [1, DRAFT_LENGTH_CAP], [0, DRAFT_LENGTH_CAP + 1]),
    *_cases("confidence", [0, 1, TINY], [1.0000001, -0.1, NAN], policy="confidence"),
    *_cases("policy", ["auto", "svip", "constant", "heuristic", "confidence", "none", ""], ["oracle", 3]),
    *_cases("logit_bias", [{}, None, {"0": -100}, {"5": 100}, {"7": TINY}, {str(i): 1.0 for i in range(300)}],
            [{str(i): 1.0 for i in range(301)}, {"5": 100.00001}, {"5": NAN}, {"5": INF}, {"5": "1"}, {"-1": 1},
             {"x": 1}, {"2147483647": 1}, {"99999999999999999999": 1}, [], "5"]),
    *_cases("stop_token_ids", [[], None, [0], [319], list(range(64))],
            [[2**31 - 1], [-1], [2**31], list(range(65)), [1.5], ["5"], [True], 5]),
    *_cases("presence_penalty", [0, -2, 2, TINY, -0.0], [2.0000001, -3, NAN, INF, "1"]),
    *_cases("frequency_penalty", [0, -2, 2, 1e-300], [2.0000001, -2.5, NAN, -INF, []]),
    *_cases("min_tokens", [0, 1, 6, 2**31 - 1], [-1, 2**31, 1.5, "2"]),
    *_cases("repetition_penalty", [1, 2, TINY, 0.5, 1.3], [0, -0.0, -1, 2.0000001, NAN, INF, "1.2"]),
    Case({"presence_penalty": 2, "frequency_penalty": 2, "min_tokens": 6, "temperature": 0}, "ok"),
    *_cases("n", [1, 2, 8], [0, 9, -1, 1.5, "2", 2**31]),
    *_cases("logprobs", [0, 1, 20, None], [21, -1, 1.5, "2", True, 2**31]),
    Case({"logprobs": 20, "n": 8, "temperature": 0}, "ok"),
    *_cases("echo", [True, False], ["yes", 1]),
    Case({"echo": True, "max_tokens": 0, "logprobs": 20}, "ok"),
    Case({"echo": True, "max_tokens": 0}, "ok"),
    Case({"echo": True, "stream": True, "logprobs": 20}, "ok"),
    *_cases("tree", ["off", "cape", "auto", "deep", "deep-auto"], ["deepest", 1, None], temperature=0),
    *_cases("tree", ["off", "cape", "auto"], []),  # sampled: the trees' q rows cross the workers
    *_cases("response_format", [{"type": "text"}, {"type": "json_object"},
                                {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                                {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {}}}],
            [{"type": "xml"}, "json", [], {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
             {"type": "json_schema", "json_schema": {"schema": DEEP}},
             {"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * MAX_GRAMMAR_BYTES]}}}]),
    *_cases("guided_regex", ["[a-z]{1,3}", "(x|y)*"], ["[a-", "", 5, "a" * (MAX_GRAMMAR_BYTES + 1)]),
    *_cases("guided_json", [SCHEMA, '{"type": "integer"}'], [5, "{nope", DEEP]),
    *_cases("guided_grammar", ['start: "a" | "bb"'], ["start: undefined", "", ["x"]]),
    Case({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "400"),
    *_cases("cache_salt", [None, "a", "x" * 256, "\u0000\U0001f600"], ["", "x" * 257, 5, ["a"], {"a": 1}]),
    Case({"temperature": 0, "top_p": TINY, "top_k": 2**31 - 1, "seed": 2**63 - 1}, "ok"),
    Case({"temperature": HUGE, "top_p": TINY, "top_k": 1}, "ok"),
]


def top1(request: GenerationRequest) -> bool:
    """Greedy in all but name: the target's own argmax at every position (so its output equals
    greedy decoding's whatever the draws, but for exact ties)."""
    s = request.sampling  # past ~1e30 float32 flattens the row: the order itself is gone
    return s.greedy or ((s.top_k == 1 or s.top_p <= 1e-7) and s.temperature <= 1e30)


def generation_request(body: dict, prompt_ids: tuple[int, ...], limits: Limits) -> GenerationRequest:
    """The request a body becomes, as the server makes it (parsed, then checked against the
    deployment): ApiError or InvalidRequest for a refused one. ignore_eos, so it runs its length."""
    from svip_serve.protocol import parse_completion

    api = parse_completion(body)
    request = GenerationRequest(prompt_ids, max(api.max_tokens, 1), api.sampling, api.policy, api.stop_token_ids,
                                ignore_eos=True, logprobs=api.logprobs,
                                prompt_logprobs=api.echo and api.logprobs is not None)
    return request.checked_for(True, limits)


def served(prompt_ids: tuple[int, ...], limits: Limits) -> list[tuple[Case, GenerationRequest]]:
    """The cases a deployment serves, with their requests (the refused ones are the parser's test)."""
    from svip_serve.protocol import ApiError

    out = []
    for case in CASES:
        try:
            out.append((case, generation_request(case.body(), prompt_ids, limits)))
        except (ApiError, InvalidRequest):
            continue
    return out
