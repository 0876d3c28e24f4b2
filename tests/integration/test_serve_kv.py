"""Admission by KV use in the Serve app, as a client meets it: `svip serve` with a KV pool of 384
tokens per worker, on the embedded pair (issue 40). A request is admitted by its prompt and takes
pages as it grows; where they run short the target's newest session yields its pages and is
recomputed later, exact: two requests whose worst cases together pass the pool run side by side
and equal the target alone; a chat without max_tokens (its default the whole pool) leaves room
for four small requests beside it (before: 0 of 4 served while it streamed); one larger than the
pool is a clear 400; every page comes back after a finish, a client that cancels mid-stream and a
client that is killed. The target's steps are held (tests/gates.py) wherever a request must still
be running."""

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

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

POOL = 384
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FILLS = POOL - 128 - len(PROMPT)  # max_tokens of a request that takes 256 of the pool's 384 tokens
CHAT_DEFAULT = 2048  # the deployment's default_max_tokens: a chat without max_tokens may take the whole pool


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


def target_alone_text(max_tokens: int) -> str:
    """The embedded target's own greedy text after PROMPT, decoded as the server decodes it."""
    from coordinator.engine import SpeculativeEngine
    from svip_assets import default_pair
    from svip_common.contracts import GenerationRequest
    from svip_common.models import load_model

    target = load_model(default_pair()[0])
    ids = SpeculativeEngine(target, None).generate(GenerationRequest(tuple(PROMPT), max_tokens, ignore_eos=True))
    return target.tokenizer.decode(ids.token_ids, skip_special_tokens=True)


def test_requests_whose_worst_cases_pass_the_pool_run_side_by_side_exact(server, target_gate):
    """Two requests of 256 tokens each on a 384-token pool: both admitted at once (before, the
    second waited for the first's worst case); pages run short as they grow, the newer yields and
    is recomputed, and both equal the target alone."""
    results = {}

    def run(name):
        results[name] = httpx.post(f"{server['base']}/v1/completions", json=body(FILLS), timeout=600)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    with target_gate.held():
        for t in threads:
            t.start()
        wait_until(lambda: health(server)["running"] == 2, what="both admitted at once")
        assert health(server)["waiting"] == 0
    for t in threads:
        t.join(600)
    expected = target_alone_text(FILLS)
    for r in results.values():
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == FILLS, r.text[:300]
        assert r.json()["choices"][0]["text"] == expected
    wait_until(lambda: set(kv_pages_used(server).values()) == {0}, what="every page back")


def test_a_chat_without_max_tokens_leaves_room_for_small_requests(server, target_gate):
    """The issue's run: a streaming chat without max_tokens, its default as large as the pool, then
    four small completions. Admitted by its worst case it held the replica alone (0 of 4 served
    while it streamed); admitted by use, the four run beside it."""
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
        t.join(600)
    assert all(r.status_code == 200 for r in results.values()), {k: r.text[:200] for k, r in results.items()}
    chunks = [json.loads(line[6:]) for line in results["chat"].text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] <= POOL
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
