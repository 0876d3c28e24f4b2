"""`svip generate --mode distributed --input` outlives its workers (issue 11): while the batch runs,
the draft worker is SIGKILLed, then the target worker, then the draft is SIGSTOPped until a request
has finished without it; every output equals the in-process engine's, and the stats say what
recovered."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from svip_bench.fault_drill import PROMPTS, worker_pid
from tests.gates import wait_until

pytestmark = [pytest.mark.drill, pytest.mark.system]

MAX_NEW = 64


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "svip_cli", "generate", "--temperature", "0", "--max-new-tokens", str(MAX_NEW),
            "--json", *args]


def test_a_distributed_batch_is_exact_through_worker_faults(tmp_path, target_gate):
    """Each fault lands while the target holds its steps (tests/gates.py: a request is in flight
    and cannot end first, on any machine); the next fault waits for a request to finish after it.
    The stopped draft resumes only once a request finished without it."""
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:7]))
    reference = [
        json.loads(line)["token_ids"]
        for line in subprocess.run(
            _cli("--input", str(batch)), capture_output=True, text=True, check=True
        ).stdout.splitlines()
    ]
    proc = subprocess.Popen(
        _cli("--input", str(batch), "--mode", "distributed"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True)
    reader.start()
    records, stopped = [], None

    def next_record():
        line = lines.get(timeout=300)
        assert line is not None, "the batch ended before the faults"
        records.append(json.loads(line))

    try:
        for fault in ("draft-kill", "target-kill", "draft-stop"):
            with target_gate.held(steps=1):  # the prompt's prefill and first verdict
                wait_until(
                    lambda: target_gate.holding() or proc.poll() is not None,
                    timeout_s=300,
                    what="a request in flight, held",
                )
                assert proc.poll() is None, "the batch ended before the faults"
                pid = worker_pid(proc.pid, fault.split("-")[0])
                if fault == "draft-stop":
                    os.kill(pid, signal.SIGSTOP)
                    stopped = pid
                else:
                    os.kill(pid, signal.SIGKILL)
            next_record()  # a request finished after the fault (the stopped draft is still stopped)
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
                stopped = None
        while (line := lines.get(timeout=300)) is not None:
            records.append(json.loads(line))
        assert proc.wait(timeout=300) == 0
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert [r["token_ids"] for r in records] == reference
    stats = [r["stats"] for r in records]
    # the kill detaches; the stop is weathered by a request that finishes while the draft is stopped
    # (the loop above): its session detached at its stall deadline, or was settled by the target
    # alone, its rows riding the steps of the sessions that had detached (idle_work.py, riders)
    assert sum(s["detached"] for s in stats) >= 1
    assert sum(s["target_restarts"] for s in stats) >= 1
