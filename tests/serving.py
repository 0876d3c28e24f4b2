"""`svip serve` as a user runs it, for the tests that talk to it over HTTP: a subprocess on free
loopback ports, waited for until /health answers, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

RAY_AGENT_PORT = 52365  # Ray's dashboard agent's fixed port (coordinator/cluster.py): never handed out


def free_port() -> int:
    """A free loopback port, never Ray's agent's (the system's ephemeral range includes it: a
    metrics port drawn there once made the local Ray refuse to start)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != RAY_AGENT_PORT:
            return port


@contextlib.contextmanager
def svip_serve(*args: str, env: dict | None = None, startup_s: float = 600):
    """Yields {"base", "metrics", "proc"} once the server is healthy."""
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "svip_cli", "serve", "--port", str(port), "--metrics-port", str(metrics_port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polls a condition: /health answering
    else:
        proc.kill()
        pytest.fail(f"svip serve did not become healthy in {startup_s:.0f} s")
    try:
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
