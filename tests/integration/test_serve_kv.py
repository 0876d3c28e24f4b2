"""Admission by KV tokens in the Serve app, as a client meets it: `svip serve` with a KV pool of
384 tokens per worker, on the embedded pair. A request holds its prompt plus max_tokens, in whole pages, from admission
to its end: one of 256 tokens runs, a second waits for its room, a third past the waiting limit
gets 429; one larger than the pool is a clear 400; every page comes back after a finish, a
client that cancels mid-stream and a client that is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serving import svip_serve

POOL = 384
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FILLS = POOL - 128 - len(PROMPT)  # max_tokens of a request that takes 256 of the pool's 384 tokens


@pytest.fixture(scope="module")
def server():
    # the embedded pair: slow enough on a CPU (a few ms a token) that a stream outlives a few requests
    with svip_serve("--model-name", "tiny",
                    "--kv-cache-tokens", str(POOL), "--max-in-flight", "4", "--max-waiting", "1") as srv:
        yield srv


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def kv_pages_used(server) -> dict[str, int]:
    workers = httpx.get(f"{server['base']}/v1/svip/workers", timeout=10).json()
    return {role: w["kv_pages_used"] for role, w in workers.items()}


def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_request_larger_than_the_pool_is_400_naming_the_kv_cache(server):
    r = httpx.post(f"{server['base']}/v1/completions", json=body(POOL), timeout=30)
    assert r.status_code == 400
    assert "KV cache of 384 tokens" in r.json()["error"]["message"]
    assert httpx.post(f"{server['base']}/v1/completions", json=body(4), timeout=30).status_code == 200


def test_a_full_pool_queues_then_refuses_with_429(server):
    health = lambda: httpx.get(f"{server['base']}/health", timeout=10).json()  # noqa: E731
    first_chunk, results = threading.Event(), {}

    def stream_first():
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body(FILLS, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                first_chunk.set()
                results.setdefault("first", []).append(line)

    def queued():
        results["second"] = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=120)

    threads = [threading.Thread(target=stream_first)]
    threads[0].start()
    assert first_chunk.wait(60)
    threads.append(threading.Thread(target=queued))
    threads[1].start()
    wait_until(lambda: health()["waiting"] == 1)  # the pool is full: it waits for room, not for a slot
    assert health()["running"] == 1
    refused = httpx.post(f"{server['base']}/v1/completions", json=body(4), timeout=30)
    for t in threads:
        t.join(120)
    assert refused.status_code == 429 and refused.headers["retry-after"]
    assert "waiting" in refused.json()["error"]["message"]
    assert results["second"].status_code == 200  # ran once the first gave its pages back
    assert results["second"].json()["usage"]["completion_tokens"] == FILLS
    assert "data: [DONE]" in results["first"]
    wait_until(lambda: set(kv_pages_used(server).values()) == {0})


def test_pages_come_back_after_a_client_cancels_mid_stream(server):
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body(FILLS, stream=True), timeout=60) as r:
        lines = r.iter_lines()
        while max(kv_pages_used(server).values()) == 0:  # until the session holds its pages
            assert next(lines) != "data: [DONE]", "the stream ended before its pages were seen"
    wait_until(lambda: set(kv_pages_used(server).values()) == {0})


def test_pages_come_back_after_a_client_is_killed(server):
    client = (
        "import httpx, sys\n"
        f"with httpx.stream('POST', {server['base'] + '/v1/completions'!r}, json={body(FILLS, True)!r}, timeout=60) as r:\n"
        "    for line in r.iter_lines():\n"
        "        print(line, flush=True)\n"
        "        sys.stdin.readline()\n"  # one line per line the test asks for
    )
    proc = subprocess.Popen([sys.executable, "-c", client], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while max(kv_pages_used(server).values()) == 0:
        line = proc.stdout.readline()
        assert line and line.strip() != "data: [DONE]", "the stream ended before its pages were seen"
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: set(kv_pages_used(server).values()) == {0})
    r = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=120)  # the whole room is free again
    assert r.status_code == 200
