"""init_local_ray keeps a local Ray on 127.0.0.1 whatever the caller imported first: Ray reads its
loopback switch once, when it is imported, and `svip bench --mode pipeline` once imported ray
before init_local_ray ran, which put the whole local cluster on the machine's network address."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loopback import assert_loopback_listeners

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

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


# Each script below makes the first attempt fail, then starts Ray, runs a task, prints its
# children's counts (one GCS, one raylet: the first attempt's are gone) and its own checks(),
# and holds the cluster up while the test looks at its listeners.
STARTED_AGAIN = (
    "init_local_ray()\n"
    "assert ray.get(ray.remote(lambda: 'ok').remote()) == 'ok'\n"
    "names = [p.name() for p in psutil.Process().children(recursive=True)]\n"
    "print(names.count('gcs_server'), names.count('raylet'), *checks(), flush=True)\n"
    "input()\n"
    "ray.shutdown()\n"
)

# The first ray.init finds its raylet late past Ray's fixed 30 s wait (ray/_private/node.py), as a
# busy machine once made it: the first registration check fails and node.py's clock reads 31 s on.
FIRST_START_MISSES_THE_WAIT = (
    "import logging, time, types\n"
    "logging.basicConfig()\n"
    "import ray, ray._private.node as node, ray._private.services as services, psutil\n"
    "from coordinator.cluster import init_local_ray\n"
    "real_get_node, late = services.get_node, {'checks': 0, 's': 0.0}\n"
    "def get_node(*args, **kwargs):\n"
    "    late['checks'] += 1\n"
    "    if late['checks'] == 1:\n"
    "        late['s'] = 31.0\n"
    "        raise RuntimeError('the raylet has not registered yet')\n"
    "    return real_get_node(*args, **kwargs)\n"
    "services.get_node = get_node\n"
    "node.time = types.SimpleNamespace(sleep=time.sleep, monotonic=lambda: time.monotonic() + late['s'])\n"
    "def checks(): return ()\n"
) + STARTED_AGAIN

# The first GCS never publishes its port, as a forked child that hung before exec once did: a
# stand-in that only sleeps takes its place, and that attempt's wait for the port is one second.
FIRST_GCS_NEVER_PUBLISHES = (
    "import logging, os, sys\n"
    "logging.basicConfig()\n"
    "import ray, ray._private.services as services, psutil\n"
    "from coordinator.cluster import init_local_ray\n"
    "real_start, stand_ins = services.start_gcs_server, []\n"
    "def start_gcs_server(*args, **kwargs):\n"
    "    if stand_ins:\n"
    "        os.environ['RAY_gcs_server_port_wait_time_s'] = '120'\n"
    "        return real_start(*args, **kwargs)\n"
    "    os.environ['RAY_gcs_server_port_wait_time_s'] = '1'\n"
    "    quiet = open(os.devnull, 'w')\n"  # the test reads this process's pipes to their end
    "    info = services.start_ray_process([sys.executable, '-c', 'import time; time.sleep(3600)'], 'gcs_server',\n"
    "                                      stdout_file=quiet, stderr_file=quiet, fate_share=True)\n"
    "    stand_ins.append(info.process.pid)\n"
    "    return info\n"
    "services.start_gcs_server = start_gcs_server\n"
    "def checks(): return (psutil.pid_exists(stand_ins[0]),)\n"  # whether the stand-in still lives
) + STARTED_AGAIN


def started_again(script: str, because: str) -> list[str]:
    """Run the script; what it printed after its counts, once the first attempt failed (its
    message naming ``because``) and the second started a loopback cluster that ran a task."""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = proc.stdout.readline().split()
        assert seen[:2] == ["1", "1"], proc.stderr.read()[-3000:] if not seen else seen  # one GCS, one raylet
        assert_loopback_listeners()
    finally:
        out, err = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "Ray did not start" in err and because in err, err[-3000:]
    return seen[2:]


def test_a_raylet_that_misses_rays_startup_wait_is_started_again_and_the_first_attempt_leaves_nothing():
    assert started_again(FIRST_START_MISSES_THE_WAIT, "timed out during startup") == []


def test_a_gcs_that_never_publishes_its_port_is_stopped_and_ray_started_again():
    assert started_again(FIRST_GCS_NEVER_PUBLISHES, "Timed out waiting for file") == ["False"]  # the stand-in gone
