"""init_local_ray keeps a local Ray on 127.0.0.1 whatever the caller imported first: Ray reads its
loopback switch once, when it is imported, and `svip bench --mode pipeline` once imported ray
before init_local_ray ran, which put the whole local cluster on the machine's network address."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.loopback import assert_loopback_listeners

REPO = Path(__file__).resolve().parents[2]
IMPORTS_RAY_FIRST = (
    "import ray\n"
    "from coordinator.cluster import init_local_ray\n"
    "init_local_ray()\n"
    "print(ray.util.get_node_ip_address(), flush=True)\n"
    "input()\n"  # holds the cluster up while the test looks at its listeners
    "ray.shutdown()\n"
)


def test_a_process_that_imported_ray_first_still_gets_a_loopback_cluster():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    proc = subprocess.Popen([sys.executable, "-c", IMPORTS_RAY_FIRST], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address = proc.stdout.readline().strip()
        assert address == "127.0.0.1", proc.stderr.read()[-2000:] if not address else address
        assert_loopback_listeners()
    finally:
        out, err = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, err[-2000:]
