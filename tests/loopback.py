"""The check both distributed modes share: every TCP listener of Ray, its workers and the app is
on 127.0.0.1 (docs/architecture.md, Placement)."""

from __future__ import annotations

import subprocess

RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "python")


def assert_loopback_listeners() -> None:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if any(n in line for n in RAY_PROCESSES)]
    assert lines
    for line in lines:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")), line
