"""`svip generate --mode distributed --input` outlives its workers (issue 11): while the batch runs,
the draft worker is SIGKILLed, then the target worker, then the draft is SIGSTOPped for 10 s;
every output equals the in-process engine's, and the stats say what recovered."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from svip_bench.fault_drill import PROMPTS, worker_pid

MAX_NEW = 120


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "svip_cli", "generate", "--temperature", "0", "--max-new-tokens", str(MAX_NEW),
            "--json", *args]


def test_a_distributed_batch_is_exact_through_worker_faults(tmp_path):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:7]))
    reference = [json.loads(line)["token_ids"] for line in
                 subprocess.run(_cli("--input", str(batch)), capture_output=True, text=True, check=True).stdout.splitlines()]
    proc = subprocess.Popen(_cli("--input", str(batch), "--mode", "distributed"), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    records, timers = [], []
    try:
        for line in proc.stdout:  # one line per finished request; the next is in flight
            records.append(json.loads(line))
            if len(records) == 1:
                os.kill(worker_pid(proc.pid, "draft"), signal.SIGKILL)
            elif len(records) == 3:
                os.kill(worker_pid(proc.pid, "target"), signal.SIGKILL)
            elif len(records) == 5:
                stopped = worker_pid(proc.pid, "draft")
                os.kill(stopped, signal.SIGSTOP)
                timers.append(threading.Timer(10.0, os.kill, (stopped, signal.SIGCONT)))
                timers[-1].start()
        assert proc.wait(timeout=300) == 0
    finally:
        for timer in timers:
            timer.join()
        if proc.poll() is None:
            proc.kill()
    assert [r["token_ids"] for r in records] == reference
    stats = [r["stats"] for r in records]
    assert sum(s["detached"] for s in stats) >= 2  # the kill and the stop
    assert sum(s["target_restarts"] for s in stats) >= 1
