"""The Serve app against hostile and broken input, as a network-facing deployment meets it:
`svip serve` with API keys, a block cap, a small body limit and a one-slot admission, serving a
pair whose embeddings are wider than the tokenizer by different amounts (Qwen2.5 7B / 0.5B).
Each hole gets its input, a clear 4xx, and the server still serves exactly afterwards."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest
from svip_common.models import load_model
from tests.serving import svip_serve

KEYS = ("key-one", "key-two")
MAX_NEW = 24
PROMPT = "def fibonacci(n):"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(wide_pair):
    with svip_serve("--target", wide_pair.target, "--draft", wide_pair.draft, "--model-name", "wide",
                    "--api-key", KEYS[0], "--api-key", KEYS[1], "--draft-length-cap", "8",
                    "--max-request-bytes", str(BODY_LIMIT), "--max-in-flight", "1", "--max-waiting", "2") as srv:
        srv["auth"] = {"Authorization": f"Bearer {KEYS[1]}"}
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(wide_pair):
    """The in-process engine's greedy text for PROMPT (the target alone, padding never chosen)."""
    target, draft = load_model(wide_pair.target), load_model(wide_pair.draft)
    ids = tuple(target.tokenizer(PROMPT)["input_ids"])
    result = SpeculativeEngine(target, draft).generate(GenerationRequest(ids, MAX_NEW))
    return target.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def post(server, body=None, content=None, headers=None, timeout=60, endpoint="completions"):
    headers = {**server["auth"], **(headers or {})}
    return httpx.post(f"{server['base']}/v1/{endpoint}", json=body, content=content, headers=headers, timeout=timeout)


def assert_exact_again(client, expected):
    r = client.completions.create(model="wide", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].text == expected


def test_every_v1_route_needs_a_key_and_health_does_not(server):
    base = server["base"]
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/svip/workers"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]}):
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "x"}, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(base + "/health", timeout=30).status_code == 200


def test_the_openai_client_with_a_key_gets_the_exact_text(client, expected):
    assert_exact_again(client, expected)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()


def test_models_show_no_file_paths(client, server, wide_pair):
    text = httpx.get(server["base"] + "/v1/models", headers=server["auth"], timeout=30).text
    assert "wide" in text and wide_pair.target not in text and "/tmp" not in text and "pytest" not in text
    assert [m.id for m in client.models.list().data] == ["wide"]


@pytest.mark.parametrize("which", ["tokens", "draft_width", "target_width"])
def test_ids_past_the_drafts_embedding_are_400(server, client, expected, wide_pair, which):
    token = getattr(wide_pair, which) - (1 if which == "target_width" else 0)
    r = post(server, {"model": "wide", "prompt": [5, 6, token], "max_tokens": 4})
    assert r.status_code == 400 and f"prompt token id {token} is outside the vocabulary [0, {wide_pair.tokens})" in r.text
    assert_exact_again(client, expected)


@pytest.mark.parametrize("patch, words", [
    ({"draft_length": 9, "policy": "constant"}, "draft length must be in [1, 8], got 9"),
    ({"max_draft_length": 500}, "max draft length must be in [1, 8], got 500"),
    ({"max_draft_length": 2**31}, "'max_draft_length' must be in [1, 2^31)"),
    ({"draft_length": 10**400}, "an integer of 401 digits"),
    ({"top_k": 2**31}, "'top_k' must be in [0, 2^31)"),
    ({"max_tokens": 2**40}, "'max_tokens' must be in [1, 2^31)"),
    ({"seed": 2**64}, "'seed' must be in [0, 2^63)"),
    ({"threshold": 10**400}, "'threshold' must be a finite number"),
    ({"temperature": 10**400}, "'temperature' must be a finite number"),
])
def test_knobs_past_their_caps_and_int32_are_400(server, client, expected, patch, words):
    r = post(server, {"model": "wide", "prompt": "x", "max_tokens": 4, **patch})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert_exact_again(client, expected)


def test_a_cap_sized_block_and_a_huge_threshold_are_served(server, expected):
    for extra in ({"policy": "constant", "draft_length": 8}, {"threshold": 1e300}):
        r = post(server, {"model": "wide", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert max(r.json()["svip"]["draft_lengths"]) <= 8


def test_a_temperature_below_1e_5_is_greedy(server, expected):
    for temperature in (1e-39, 1e-6):
        r = post(server, {"model": "wide", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": temperature})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("content, status, words", [
    (b"[" * 50_000 + b"]" * 50_000, 400, "nested too deeply"),
    (b'{"model": "wide", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", 400, "too long to read"),
    (b'{"model": "wide", "prompt": "a\\ud800b"}', 400, "prompt is not valid Unicode"),
    (b'{"model": "wide", "prompt": "x", "top_p": 1e400}', 400, "'top_p' must be a finite number"),
    (b'{"model": "wide", "prompt": "x", "stop": ["\\udc00"]}', 400, "stop[0] is not valid Unicode"),
    (b'{"model": "wide", "prompt": "' + b"x" * (BODY_LIMIT + 1) + b'"}', 413, f"limit of {BODY_LIMIT} bytes"),
])
def test_bodies_that_gave_500s(server, client, expected, content, status, words):
    r = post(server, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status and words in r.json()["error"]["message"], r.text[:300]
    assert_exact_again(client, expected)


def test_a_chunked_body_past_the_limit_is_413(server):
    def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(server["base"] + "/v1/completions", content=chunks(), headers=server["auth"], timeout=60)
    assert r.status_code == 413


def test_tokenizing_a_long_prompt_does_not_block_the_event_loop(server):
    """A prompt near the body limit takes a while to tokenize; /health answers meanwhile."""
    prompt = "print('hello')  # " * (BODY_LIMIT // 20)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, server, {"model": "wide", "prompt": prompt, "max_tokens": 4})
        time.sleep(0.05)
        health = []
        while not big.done() and len(health) < 50:
            started = time.monotonic()
            assert httpx.get(server["base"] + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - started)
        response = big.result()
    assert response.status_code == 400 and "context" in response.text
    assert health, "the long prompt was tokenized before /health could be asked"
    assert min(health) < 0.25, health  # answered while the tokenizer ran


def test_non_streaming_waiters_cancelled_by_their_clients_give_their_places_back(server, client, expected):
    """One slot, two waiting places: a stream holds the slot, then more clients than there are
    places each wait and leave. Before the fix each left a place taken: 429 for ever."""
    # sampled: drafted as its policy says at any load (several seconds on this pair), so it holds the slot
    long_body = {"model": "wide", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 3,
                 "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=long_body, headers=server["auth"], timeout=120) as held:
        lines = held.iter_lines()
        next(lines)
        for _ in range(5):
            with pytest.raises(httpx.ReadTimeout):
                post(server, {"model": "wide", "prompt": PROMPT, "max_tokens": 4}, timeout=0.5)
        deadline = time.monotonic() + 15
        while (health := httpx.get(server["base"] + "/health", timeout=30).json())["waiting"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health["waiting"] == 0 and health["running"] == 1, health
    deadline = time.monotonic() + 15
    while httpx.get(server["base"] + "/health", timeout=30).json()["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_exact_again(client, expected)


def test_stream_errors_end_with_an_error_event_and_done(server):
    """A request refused after the stream was asked for: a 4xx before any byte, never a broken stream."""
    r = post(server, {"model": "wide", "prompt": [5, 10**6], "stream": True})
    assert r.status_code == 400 and "outside the vocabulary" in r.text
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=server["auth"], timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(json.loads(line[6:]) for line in lines[:-1])


def test_the_servers_own_errors_carry_a_request_id_not_the_exception():
    from coordinator.pipeline import WorkerError
    from svip_serve.server import _api_error

    error = _api_error(WorkerError("target worker: KeyError: '/secret/path/model.bin'"), "cmpl-1")
    body = error.body()["error"]
    assert error.status == 500 and "request id" in body["message"] and "secret" not in body["message"]
    assert body["type"] == "server_error"
