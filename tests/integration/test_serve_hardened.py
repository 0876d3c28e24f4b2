"""The Serve app against hostile and broken input, as a network-facing deployment meets it:
`svip serve` with API keys, a block cap, a small body limit and a one-slot admission, serving a
pair whose embeddings are wider than the tokenizer by different amounts (Qwen2.5 7B / 0.5B).
Each hole gets its input, a clear 4xx, and the server still serves exactly afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest

from coordinator.engine import SpeculativeEngine
from svip_common.contracts import GenerationRequest
from svip_common.models import load_model
from tests.gates import async_wait_until, wait_until
from tests.serving import svip_serve

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

KEYS = ("alice-0123456789abcdef0123456789abcdef", "bob-0123456789abcdef0123456789abcdef0")  # >= 32 characters
MAX_NEW = 24
PROMPT = "def fibonacci(n):"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(wide_pair):
    with svip_serve("--target", wide_pair.target, "--draft", wide_pair.draft, "--model-name", "wide",
                    "--api-key", f"alice:{KEYS[0]}", "--api-key", KEYS[1], "--draft-length-cap", "8",
                    "--max-request-bytes", str(BODY_LIMIT), "--max-in-flight", "1", "--max-waiting", "2",
                    "--max-requests-per-key", "2", "--max-tokens-cap", "512", "--max-kv-tokens-per-key", "768") as srv:
        srv["auth"] = {"Authorization": f"Bearer {KEYS[1]}"}
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEYS[0], max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def expected(wide_pair):
    """The in-process engine's greedy text for PROMPT (the target alone, padding never chosen)."""
    target, draft = load_model(wide_pair.target), load_model(wide_pair.draft)
    ids = tuple(target.tokenizer(PROMPT)["input_ids"])
    result = SpeculativeEngine(target, draft, load_aware="off").generate(GenerationRequest(ids, MAX_NEW))
    return target.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def post(server, body=None, content=None, headers=None, timeout=300, endpoint="completions"):
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
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "x"}, timeout=120)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(base + "/health", timeout=120).status_code == 200


def test_the_openai_client_with_a_key_gets_the_exact_text(client, expected):
    assert_exact_again(client, expected)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()


def test_models_show_no_file_paths(client, server, wide_pair):
    text = httpx.get(server["base"] + "/v1/models", headers=server["auth"], timeout=120).text
    assert "wide" in text and wide_pair.target not in text and "/tmp" not in text and "pytest" not in text
    assert [m.id for m in client.models.list().data] == ["wide"]


@pytest.mark.parametrize("which", ["tokens", "draft_width", "target_width"])
def test_ids_past_the_drafts_embedding_are_400(server, client, expected, wide_pair, which):
    token = getattr(wide_pair, which) - (1 if which == "target_width" else 0)
    r = post(server, {"model": "wide", "prompt": [5, 6, token], "max_tokens": 4})
    assert (
        r.status_code == 400 and f"prompt token id {token} is outside the vocabulary [0, {wide_pair.tokens})" in r.text
    )
    assert_exact_again(client, expected)


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"draft_length": 9, "policy": "constant"}, "draft length must be in [1, 8], got 9"),
        ({"max_draft_length": 500}, "max draft length must be in [1, 8], got 500"),
        ({"max_draft_length": 2**31}, "'max_draft_length' must be in [1, 2^31)"),
        ({"draft_length": 10**400}, "an integer of 401 digits"),
        ({"top_k": 2**31}, "'top_k' must be in [0, 2^31)"),
        ({"max_tokens": 2**40}, "'max_tokens' must be in [1, 2^31)"),
        ({"seed": 2**64}, "'seed' must be in [0, 2^63)"),
        ({"threshold": 10**400}, "'threshold' must be a finite number"),
        ({"temperature": 10**400}, "'temperature' must be a finite number"),
    ],
)
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


@pytest.mark.parametrize(
    "content, status, words",
    [
        (b"[" * 50_000 + b"]" * 50_000, 400, "nested too deeply"),
        (b'{"model": "wide", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", 400, "too long to read"),
        (b'{"model": "wide", "prompt": "a\\ud800b"}', 400, "prompt is not valid Unicode"),
        (b'{"model": "wide", "prompt": "x", "top_p": 1e400}', 400, "'top_p' must be a finite number"),
        (b'{"model": "wide", "prompt": "x", "stop": ["\\udc00"]}', 400, "stop[0] is not valid Unicode"),
        (b'{"model": "wide", "prompt": "' + b"x" * (BODY_LIMIT + 1) + b'"}', 413, f"limit of {BODY_LIMIT} bytes"),
    ],
)
def test_bodies_that_gave_500s(server, client, expected, content, status, words):
    r = post(server, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status and words in r.json()["error"]["message"], r.text[:300]
    assert_exact_again(client, expected)


def test_a_chunked_body_past_the_limit_is_413(server):
    def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(server["base"] + "/v1/completions", content=chunks(), headers=server["auth"], timeout=300)
    assert r.status_code == 413


def test_a_prompt_far_longer_than_the_context_is_refused_before_tokenizing(server, client, expected):
    """A prompt near the body limit would hold the tokenizer thread for a while: its length in
    characters alone says it cannot fit the context, so it is refused at once."""
    prompt = "print('hello')  # " * (BODY_LIMIT // 20)
    r = post(server, {"model": "wide", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400 and "far more than fits the model's context" in r.text
    chat = {"model": "wide", "messages": [{"role": "user", "content": prompt}]}
    r = post(server, chat, endpoint="chat/completions")
    assert r.status_code == 400 and "far more than fits" in r.text
    assert_exact_again(client, expected)


def test_non_streaming_waiters_cancelled_by_their_clients_give_their_places_back(server, client, expected, target_gate):
    """One slot, two waiting places: a stream holds the slot (the target holds its steps, so it
    cannot end), then more clients than there are places each wait and leave. Before the fix each
    left a place taken: 429 for ever."""
    health = lambda: httpx.get(server["base"] + "/health", timeout=120).json()  # noqa: E731
    long_body = {"model": "wide", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}
    small = {"model": "wide", "prompt": PROMPT, "max_tokens": 4}

    async def wait_and_leave(async_client, count):
        tasks = [
            asyncio.ensure_future(
                async_client.post(
                    f"{server['base']}/v1/completions", json=small, headers={"Authorization": f"Bearer {KEYS[i % 2]}"}
                )
            )
            for i in range(count)
        ]
        await async_wait_until(
            lambda: asyncio.to_thread(lambda: health()["waiting"] == count), what="the waiters in line"
        )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await async_wait_until(lambda: asyncio.to_thread(lambda: health()["waiting"] == 0), what="their places back")

    async def clients():
        async with httpx.AsyncClient(timeout=600) as async_client:
            for _ in range(3):  # six waiters leave, three times the places
                await wait_and_leave(async_client, 2)

    with target_gate.held():
        with httpx.stream(
            "POST", server["base"] + "/v1/completions", json=long_body, headers=server["auth"], timeout=600
        ) as held:
            assert held.status_code == 200 and health()["running"] == 1
            asyncio.run(clients())
            assert health() | {"model": None} == {"status": "ok", "model": None, "running": 1, "waiting": 0}
    wait_until(lambda: health()["running"] == 0, what="the stream's slot back")
    assert_exact_again(client, expected)


def test_one_key_cannot_take_every_place(server, client, expected, target_gate):
    """At most two requests per key (--max-requests-per-key 2): bob's third is refused naming his
    key while alice still gets a place in line; then everyone admitted is served."""
    health = lambda: httpx.get(server["base"] + "/health", timeout=120).json()  # noqa: E731
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    results = {}

    def call(name, key):
        results[name] = post(server, body, headers={"Authorization": f"Bearer {key}"}, timeout=600)

    threads = [
        threading.Thread(target=call, args=("bob-1", KEYS[1])),
        threading.Thread(target=call, args=("bob-2", KEYS[1])),
    ]
    with target_gate.held():
        threads[0].start()
        wait_until(lambda: health()["running"] == 1, what="bob's first running")
        threads[1].start()
        wait_until(lambda: health()["waiting"] == 1, what="bob's second waiting")
        refused = post(server, body, headers={"Authorization": f"Bearer {KEYS[1]}"})
        threads.append(threading.Thread(target=call, args=("alice", KEYS[0])))
        threads[-1].start()
        wait_until(lambda: health()["waiting"] == 2, what="alice waiting")
    for t in threads:
        t.join(120)
    assert refused.status_code == 429 and "API key 'key-" in refused.json()["error"]["message"], refused.text
    assert "limit 2" in refused.json()["error"]["message"]
    assert all(
        r.status_code == 200 and r.json()["choices"][0]["text"] == expected[: len(r.json()["choices"][0]["text"])]
        for r in results.values()
    ), {k: r.text[:200] for k, r in results.items()}


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"stop": ["x" * 100_000]}, "each 'stop' string is at most 256 characters, got one of 100000"),
        ({"ignore_eos": True}, "'ignore_eos' is not allowed on this deployment"),
    ],
)
def test_request_content_that_would_buy_server_time_is_400(server, client, expected, patch, words):
    r = post(server, {"model": "wide", "prompt": PROMPT, "max_tokens": 4, **patch})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert_exact_again(client, expected)


@pytest.mark.parametrize(
    "endpoint, patch, words",
    [
        ("completions", {"prompt": PROMPT, "max_tokens": 513}, "'max_tokens' must be at most 512 on this deployment"),
        ("chat/completions", {"messages": [{"role": "user", "content": ""}] * 1025},
         "'messages' holds at most 1024 messages, got 1025"),
        ("chat/completions", {"messages": [{"role": "r" * 100_000, "content": "hi"}]}, "far more than fits"),
        ("chat/completions", {"messages": [{"role": "user", "content": "", "name": ""}] * 600}, "far more than fits"),
    ],
)
def test_what_a_request_renders_is_counted_and_capped_before_tokenizing(server, client, expected, endpoint, patch,
                                                                        words):
    """Review H1 and M6: an explicit max_tokens up to the context was accepted (and reserved whole);
    20,000 empty messages or a 500,000-character role counted 0 characters and held the tokenizer
    thread for seconds. Now the cap, the number of messages and every rendered string (roles,
    names, and the template's text around each message) are checked before any tokenizing."""
    r = post(server, {"model": "wide", **patch}, endpoint=endpoint)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert_exact_again(client, expected)


def test_a_keys_requests_count_from_its_key_check_before_its_body_is_read(server, client, expected, target_gate):
    """Review M6: the count per key was taken at admission, after the body was read, parsed and
    tokenized, so one key's bodies could queue minutes of parsing ahead of everyone. Now bob's
    third request is a 429 while its body has not even been sent (a raw socket sends the headers
    and the body's first bytes only)."""
    health = lambda: httpx.get(server["base"] + "/health", timeout=120).json()  # noqa: E731
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    bob = {"Authorization": f"Bearer {KEYS[1]}"}
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(server, body, headers=bob, timeout=600)))
               for _ in range(2)]
    with target_gate.held():
        for t in threads:
            t.start()
        wait_until(lambda: health()["running"] + health()["waiting"] == 2, what="bob's two in flight")
        host, port = server["base"].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=120) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS[1]}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n".encode()
                         + b'{"model": "wide", "prompt": ')
            answer = _read_response(sock)
    for t in threads:
        t.join(120)
    assert answer.startswith("HTTP/1.1 429") and "limit 2" in answer, answer
    assert [r.status_code for r in results] == [200, 200]
    assert_exact_again(client, expected)


def test_a_keys_kv_tokens_in_flight_are_bounded(server, client, expected, target_gate):
    """--max-kv-tokens-per-key 768: bob holds one 400-token request; his second (another 416 KV
    tokens) is a 429 naming his KV share, while alice's of the same size is admitted."""
    health = lambda: httpx.get(server["base"] + "/health", timeout=120).json()  # noqa: E731
    long_body = {"model": "wide", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}
    with target_gate.held():
        with httpx.stream("POST", server["base"] + "/v1/completions", json=long_body,
                          headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=600) as held:
            assert held.status_code == 200
            wait_until(lambda: health()["running"] == 1, what="bob's first running")
            second = post(server, {**long_body, "stream": False}, headers={"Authorization": f"Bearer {KEYS[1]}"})
            assert second.status_code == 429 and "already holds" in second.json()["error"]["message"], second.text
            alice = threading.Thread(target=lambda: post(server, {**long_body, "stream": False, "max_tokens": 2},
                                                         headers={"Authorization": f"Bearer {KEYS[0]}"}))
            alice.start()
            wait_until(lambda: health()["waiting"] == 1, what="alice in line (one slot: bob's)")
    alice.join(300)
    wait_until(lambda: health()["running"] + health()["waiting"] == 0, what="every place back")
    assert_exact_again(client, expected)


def test_no_api_docs_and_a_health_without_reasons(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server["base"] + path, timeout=120).status_code == 404, path
    health = httpx.get(server["base"] + "/health", timeout=120).json()
    assert set(health) == {"status", "model", "running", "waiting"} and health["model"] == "wide"


def test_stream_errors_end_with_an_error_event_and_done(server):
    """A request refused after the stream was asked for: a 4xx before any byte, never a broken stream."""
    r = post(server, {"model": "wide", "prompt": [5, 10**6], "stream": True})
    assert r.status_code == 400 and "outside the vocabulary" in r.text
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, headers=server["auth"], timeout=300) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(json.loads(line[6:]) for line in lines[:-1])


def test_the_servers_own_errors_carry_a_request_id_not_the_exception():
    from svip_common.errors import WorkerError
    from svip_serve.server import _api_error

    error = _api_error(WorkerError("target worker: KeyError: '/secret/path/model.bin'"), "cmpl-1")
    body = error.body()["error"]
    assert error.status == 500 and "request id" in body["message"] and "secret" not in body["message"]
    assert body["type"] == "server_error"


def _read_response(sock: socket.socket) -> str:
    """One HTTP/1.1 response off a raw socket: the head, then as many body bytes as it declares
    (they may come in another segment)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-body: {body!r}"
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_the_helm_test_smoke_check_sends_a_named_keys_secret(server):
    """Review I-5: the key Secret's first entry may name its key (`alice:KEY`, as values.yaml
    suggests); the smoke check (helm test) sends the key itself, not the name with it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SVIP_URL": server["base"], "SVIP_MODEL": "wide", "SVIP_API_KEY": f"alice:{KEYS[0]},x"}
    out = subprocess.run([sys.executable, "-m", "svip_serve.smoke"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "svip smoke: ok" in out.stdout, out.stdout + out.stderr
