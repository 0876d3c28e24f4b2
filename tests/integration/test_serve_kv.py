"""Admission by KV tokens in the Serve app, as a client meets it: `svip serve` with a KV pool of
384 tokens per worker, on the embedded pair. A request holds its prompt plus max_tokens, in whole pages, from admission
to its end: one of 256 tokens runs, a second waits for its room, a third past the waiting limit
gets 429; one larger than the pool is a clear 400; a chat without max_tokens takes the
deployment's default, not the context, and leaves room for small requests beside it; every page
comes back after a finish, a client that cancels mid-stream and a client that is killed. The
target's steps are held (tests/gates.py) wherever a request must still be running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.gates import wait_until
from tests.serving import svip_serve

POOL = 384
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FILLS = POOL - 128 - len(PROMPT)  # max_tokens of a request that takes 256 of the pool's 384 tokens
CHAT_DEFAULT = 64  # the deployment's default_max_tokens


@pytest.fixture(scope="module")
def server():
    with svip_serve("--model-name", "tiny", "--kv-cache-tokens", str(POOL), "--max-in-flight", "5",
                    "--max-waiting", "1", "--default-max-tokens", str(CHAT_DEFAULT), "--allow-ignore-eos") as srv:
        yield srv


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def kv_pages_used(server) -> dict[str, int]:
    workers = httpx.get(f"{server['base']}/v1/svip/workers", timeout=60).json()
    return {role: w["kv_pages_used"] for role, w in workers.items()}


def health(server) -> dict:
    return httpx.get(f"{server['base']}/health", timeout=60).json()


def test_a_request_larger_than_the_pool_is_400_naming_the_kv_cache(server):
    r = httpx.post(f"{server['base']}/v1/completions", json=body(POOL), timeout=120)
    assert r.status_code == 400
    assert "KV cache of 384 tokens" in r.json()["error"]["message"]
    assert httpx.post(f"{server['base']}/v1/completions", json=body(4), timeout=120).status_code == 200


def test_a_full_pool_queues_then_refuses_with_429(server, target_gate):
    results = {}

    def stream_first():
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body(FILLS, stream=True), timeout=600) as r:
            results["first"] = list(r.iter_lines())

    def queued():
        results["second"] = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=600)

    threads = [threading.Thread(target=stream_first), threading.Thread(target=queued)]
    with target_gate.held():  # nothing generates: the first holds its pages until the gate opens
        threads[0].start()
        wait_until(lambda: health(server)["running"] == 1, what="the first request admitted")
        threads[1].start()
        wait_until(lambda: health(server)["waiting"] == 1, what="the second waiting")  # for room, not a slot
        assert health(server)["running"] == 1
        refused = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=120)
    for t in threads:
        t.join(120)
    assert refused.status_code == 429 and refused.headers["retry-after"]
    assert "waiting" in refused.json()["error"]["message"]
    assert results["second"].status_code == 200  # ran once the first gave its pages back
    assert results["second"].json()["usage"]["completion_tokens"] == FILLS
    assert "data: [DONE]" in results["first"]
    wait_until(lambda: set(kv_pages_used(server).values()) == {0}, what="every page back")


def test_a_chat_without_max_tokens_leaves_room_for_small_requests(server, target_gate):
    """Before: a chat without max_tokens reserved the whole context, so with a pool as large as
    the context it held the replica alone. Now it takes default_max_tokens: four small requests
    run beside it."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "def add(a, b):"}], "stream": True,
            "temperature": 0}
    results = {}

    def run(name, path, payload):
        results[name] = httpx.post(f"{server['base']}/v1/{path}", json=payload, timeout=600)

    threads = [threading.Thread(target=run, args=("chat", "chat/completions", chat))]
    threads += [threading.Thread(target=run, args=(i, "completions", body(8))) for i in range(4)]
    with target_gate.held():
        threads[0].start()
        wait_until(lambda: health(server)["running"] == 1, what="the chat admitted")
        for t in threads[1:]:
            t.start()
        wait_until(lambda: health(server)["running"] == 5, what="four small requests beside the chat")
        assert health(server)["waiting"] == 0
    for t in threads:
        t.join(120)
    assert all(r.status_code == 200 for r in results.values()), {k: r.text[:200] for k, r in results.items()}
    chunks = [json.loads(line[6:]) for line in results["chat"].text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] <= CHAT_DEFAULT
    wait_until(lambda: set(kv_pages_used(server).values()) == {0}, what="every page back")


def test_pages_come_back_after_a_client_cancels_mid_stream(server, target_gate):
    with target_gate.held(steps=1):  # the prompt's prefill, then nothing: the session cannot end by itself
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body(FILLS, stream=True), timeout=300) as r:
            assert r.status_code == 200
            wait_until(lambda: max(kv_pages_used(server).values()) > 0, what="the session holding pages")
        wait_until(lambda: set(kv_pages_used(server).values()) == {0}, what="every page back")


def test_pages_come_back_after_a_client_is_killed(server, target_gate):
    client = (
        "import httpx, sys\n"
        f"with httpx.stream('POST', {server['base'] + '/v1/completions'!r}, json={body(FILLS, True)!r}, "
        "timeout=300) as r:\n"
        "    print(r.status_code, flush=True)\n"
        "    sys.stdin.readline()\n"  # holds the stream open until it is killed
    )
    with target_gate.held(steps=1):
        proc = subprocess.Popen(
            [sys.executable, "-c", client], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "200"
        wait_until(lambda: max(kv_pages_used(server).values()) > 0, what="the session holding pages")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: set(kv_pages_used(server).values()) == {0}, what="every page back")
    r = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=600)  # the whole room is free again
    assert r.status_code == 200
