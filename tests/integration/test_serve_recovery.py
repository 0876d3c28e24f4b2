"""Streams in flight through a worker's loss, against `svip serve` as an operator runs it (issue 11),
with real signals on the real worker processes: 16 greedy streams through a draft SIGKILL, a draft
SIGSTOP and a target SIGKILL each complete with exactly the text of an undisturbed run and no error
event (the stopped draft resumes only after they all ended). Each fault lands while the target
holds its steps (tests/gates.py), so every stream is under way and none can end first. Then the target's restarts are
spent: the streams end with an error event and [DONE] (never a hang), new requests get 503 with
Retry-After, and Serve replaces the replica, exact again. The drill is svip_bench/fault_drill.py."""

from __future__ import annotations

import time

import httpx
import pytest

from svip_bench.fault_drill import PROMPTS, run_streams, summarize
from tests.drills import faults
from tests.serving import svip_serve

pytestmark = [pytest.mark.drill, pytest.mark.system]

CLIENTS = 16
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server():
    with svip_serve(
        "--max-in-flight",
        str(CLIENTS),
        "--max-waiting",
        str(CLIENTS),
        "--worker-restarts",
        "1",
        "--allow-ignore-eos",
        "--health-check-period-s",
        "2",
        "--draft-stall-s",
        "1.5",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server):
    run = run_streams(server["base"], PROMPTS[:CLIENTS], MAX_TOKENS)
    assert all(r.done for r in run["results"]), [r.error for r in run["results"]]
    return [r.text for r in run["results"]]


@pytest.mark.parametrize("fault", faults(["target-kill"], ["draft-kill", "draft-stop"]))
def test_sixteen_streams_are_exact_through_a_fault(server, reference, fault, target_gate):
    # the fault lands while the target holds (every stream under way, none can end first); a stopped
    # draft resumes only after every stream has ended: so they ended without it, on any machine
    run = run_streams(server["base"], PROMPTS[:CLIENTS], MAX_TOKENS, fault, server["proc"].pid, None, gate=target_gate)
    try:
        row = summarize(run, reference)
        assert row["errors"] == 0 and row["complete_exact"] == CLIENTS, (row["complete_exact"], row["first_error"])
        if fault.startswith("draft"):
            assert row["detached"] >= 1, row
        else:
            assert row["target_restarts"] >= 1, row
    finally:
        if run["timer"] is not None:
            run["timer"].join()


def test_a_target_gone_for_good_ends_streams_with_an_error_and_serve_replaces_the_replica(
    server, reference, target_gate
):
    """Last: its one restart spent above, a second target kill cannot be recovered."""
    run = run_streams(server["base"], PROMPTS[:4], MAX_TOKENS, "target-kill", server["proc"].pid, gate=target_gate)
    for i, r in enumerate(run["results"]):
        assert r.error is not None and r.error["code"] == "worker_unavailable", r.error
        assert r.text and reference[i].startswith(r.text)  # what was sent stays sent, and is exact
    ok, codes, deadline = None, [], time.monotonic() + 600
    while ok is None and time.monotonic() < deadline:
        r = httpx.post(
            server["base"] + "/v1/completions",
            timeout=600,
            json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        )
        codes.append(r.status_code)
        if r.status_code == 200:
            ok = r.json()
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
            assert r.headers["retry-after"], r.headers
            time.sleep(1)
    assert ok is not None, codes
    assert ok["choices"][0]["text"] == reference[0]
