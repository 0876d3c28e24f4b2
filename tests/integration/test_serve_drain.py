"""A stop signal drains `svip serve`, it does not cut (issue 40): tried as an operator would,
SIGTERM (what systemd, Docker and Kubernetes send) while two streaming completions are in flight.
Before, both streams ended without a finish_reason and the process exited within seconds (once by
SIGABRT). Now: new requests get 503 with Retry-After and /health says draining, the two streams
finish whole (the target's steps are held by the test's gate until then, so they are still in
flight when the signal comes, by construction), and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from svip_assets import default_pair
from svip_common.models import load_model
from tests.gates import wait_until
from tests.serving import svip_serve

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

MAX_NEW = 24


def stream(base: str, out: list, seed: int) -> None:
    body = {"model": "svip-pair", "prompt": "def fibonacci(n):", "max_tokens": MAX_NEW, "temperature": 0,
            "stream": True, "seed": seed}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    out.append(events)


def test_sigterm_stops_admitting_lets_the_streams_finish_and_exits_0(target_gate):
    target = load_model(default_pair()[0])
    streams: list[list[str]] = []
    with svip_serve("--drain-timeout-s", "300") as srv:
        base, proc = srv["base"], srv["proc"]
        health = lambda: httpx.get(f"{base}/health", timeout=60)  # noqa: E731
        with target_gate.held():
            threads = [threading.Thread(target=stream, args=(base, streams, i)) for i in range(2)]
            for t in threads:
                t.start()
            wait_until(lambda: health().json().get("running") == 2 and target_gate.holding(),
                       what="both streams in flight, held")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: health().status_code == 503, what="the replica draining")
            assert health().json() == {"status": "draining", "running": 2, "waiting": 0}
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "shutting_down"
            assert proc.poll() is None  # still serving what it holds
        for t in threads:
            t.join(timeout=600)
        assert proc.wait(timeout=300) == 0
    assert len(streams) == 2
    expected = target.tokenizer.decode(
        _target_alone(target), skip_special_tokens=True)
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert "every request finished" in proc.stdout.read()


def _target_alone(target) -> list[int]:
    from coordinator.engine import SpeculativeEngine
    from svip_common.contracts import GenerationRequest

    ids = tuple(target.tokenizer("def fibonacci(n):")["input_ids"])
    return SpeculativeEngine(target, None).generate(GenerationRequest(ids, MAX_NEW)).token_ids
