"""Two Ray nodes on this machine, as a cluster runs them: each node in a network namespace of its
own with its own address, the two joined by a veth pair, so the draft and the target talk across
a real network link and every listener is on its namespace's address.

Latency between the nodes: where the kernel has netem, ``tc qdisc ... netem delay`` on the link;
where it has not (this project's machines: no sch_netem), a relay namespace sits on the link and
forwards every Ethernet frame after the delay (AF_PACKET sockets, offloads off so frames are
whole). Either way the delay is on the wire, below TCP and gRPC, in each direction half the
round trip asked for.

Needs root and iproute2; ``unavailable()`` says why not where they are missing. Everything it
makes (namespaces, links, the relay, both Ray nodes and their workers) is removed on exit.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RAY_PORT = 6379
TARGET_RESOURCE, DRAFT_RESOURCE = "svip_target", "svip_draft"
_RELAY = Path(__file__).with_name("frame_relay.py")


def unavailable() -> str | None:
    """Why two-node namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"svip-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _run(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


class TwoNodes:
    def __init__(self, delay_ms: float = 0.0, cpus: tuple[int, int] = (1, 1)):
        self.delay_ms = delay_ms
        self.cpus = cpus
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.ns = {"a": f"svip-a-{tag}", "b": f"svip-b-{tag}", "m": f"svip-m-{tag}"}
        subnet = random.randrange(10, 250)
        self.ip = {"a": f"10.213.{subnet}.1", "b": f"10.213.{subnet}.2"}
        self.address = f"{self.ip['a']}:{RAY_PORT}"
        self.how = ""  # "direct", "netem" or "relay"
        self._procs: list[subprocess.Popen] = []
        # the cluster's files apart from any local Ray's (whose ray_current_cluster it must not replace)
        self.temp_dir = f"/tmp/svip-two-nodes-{tag}"
        # Ray's token authentication, with a token of this cluster's own for both nodes and drivers
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")
        }
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> TwoNodes:
        try:
            self._link()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in self.ns.values():  # every process of ours lives in one of the namespaces
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(int(pid), sig)
                    except (ProcessLookupError, ValueError):
                        pass
                if sig == signal.SIGTERM and pids:
                    time.sleep(1.0)
        for proc in self._procs:
            proc.wait(timeout=10) if proc.poll() is None else None
        for ns in self.ns.values():
            _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # --- the link -------------------------------------------------------------------------------

    def _link(self) -> None:
        a, b, m = self.ns["a"], self.ns["b"], self.ns["m"]
        for ns in (a, b):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "set", "dev", "lo", "up", ns=ns)
        if self.delay_ms and self._netem_available():
            self.how = "netem"
        elif self.delay_ms:
            self.how = "relay"
        else:
            self.how = "direct"
        if self.how == "relay":
            _run("ip", "netns", "add", m)
            _run("ip", "link", "set", "dev", "lo", "up", ns=m)
            _run("ip", "link", "add", "sv0", "netns", a, "type", "veth", "peer", "name", "relay-a", "netns", m)
            _run("ip", "link", "add", "sv0", "netns", b, "type", "veth", "peer", "name", "relay-b", "netns", m)
            for ifname in ("relay-a", "relay-b"):
                _run("ip", "link", "set", "dev", ifname, "up", "promisc", "on", ns=m)
        else:
            _run("ip", "link", "add", "sv0", "netns", a, "type", "veth", "peer", "name", "sv0", "netns", b)
        for side in ("a", "b"):
            ns = self.ns[side]
            _run("ip", "addr", "add", f"{self.ip[side]}/24", "dev", "sv0", ns=ns)
            _run("ip", "link", "set", "dev", "sv0", "up", ns=ns)
            if self.how == "netem":
                _run("tc", "qdisc", "add", "dev", "sv0", "root", "netem", "delay", f"{self.delay_ms / 2}ms", ns=ns)
            if self.how == "relay":  # whole frames with real checksums: the relay forwards them as they are
                _run("ip", "link", "set", "dev", "sv0", "gso_max_size", "1500", ns=ns)
                _run(sys.executable, "-c", "from svip_bench.two_nodes import offloads_off; offloads_off('sv0')", ns=ns)
        if self.how == "relay":
            relay = subprocess.Popen(
                ["ip", "netns", "exec", m, sys.executable, str(_RELAY), "relay-a", "relay-b", str(self.delay_ms / 2)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            self._procs.append(relay)
            if relay.stdout.readline().strip() != "relay up":
                raise RuntimeError("the frame relay did not start")

    @staticmethod
    def _netem_available() -> bool:
        name = f"svip-netem-{os.getpid()}"
        try:
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1", ns=name)
            return (
                _run(
                    "tc", "qdisc", "add", "dev", "d0", "root", "netem", "delay", "1ms", ns=name, check=False
                ).returncode
                == 0
            )
        except (subprocess.CalledProcessError, FileNotFoundError):
            return False
        finally:
            _run("ip", "netns", "del", name, check=False)

    # --- Ray --------------------------------------------------------------------------------------

    def _start_ray(self) -> None:
        env = self.env  # a cluster: not bound to loopback
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--disable-usage-stats", "--block", "--include-log-monitor=false", f"--temp-dir={self.temp_dir}"]
        head = [
            "--head",
            f"--node-ip-address={self.ip['a']}",
            f"--port={RAY_PORT}",
            f"--num-cpus={self.cpus[0]}",
            f"--resources={json.dumps({TARGET_RESOURCE: 1})}",
            "--include-dashboard=false",
        ]
        worker = [
            f"--address={self.address}",
            f"--node-ip-address={self.ip['b']}",
            f"--num-cpus={self.cpus[1]}",
            f"--resources={json.dumps({DRAFT_RESOURCE: 1})}",
        ]
        for side, args in (("a", head), ("b", worker)):
            self._procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", self.ns[side], ray, "start", *args, *common],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            if side == "a":
                self._wait_for_port(self.ns["a"], RAY_PORT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.run([sys.executable, "-c", _COUNT_NODES], timeout=60).stdout.strip() == "2":
                return
            time.sleep(1)
        raise RuntimeError("the two Ray nodes did not come up in 90 s")

    def _wait_for_port(self, ns: str, port: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = _run("ss", "-ltnH", ns=ns, check=False).stdout.splitlines()
            if any(row.split()[3].endswith(f":{port}") for row in rows if len(row.split()) > 3):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nothing listens on port {port} in {ns} after {timeout:.0f} s")

    # --- using it -------------------------------------------------------------------------------

    def run(self, argv: list[str], timeout: float, node: str = "a") -> subprocess.CompletedProcess:
        """Run a command in a node's namespace (a driver there reaches the cluster at self.address)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[node], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, "RAY_ADDRESS": self.address},
        )

    def popen(self, argv: list[str], node: str = "a") -> subprocess.Popen:
        """Start a command in a node's namespace, its stdin and stdout piped."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns[node], *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, "RAY_ADDRESS": self.address},
        )

    def listeners(self) -> dict[str, list[tuple[str, str]]]:
        """Every TCP listener in each node's namespace: (local address, process)."""
        out = {}
        for side in ("a", "b"):
            rows = _run("ss", "-ltnpH", ns=self.ns[side], check=False).stdout.splitlines()
            out[side] = [(row.split()[3], row.split()[-1] if "users:" in row else "") for row in rows if row.strip()]
        return out


_COUNT_NODES = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"


def offloads_off(ifname: str) -> None:
    """TSO, GSO, scatter-gather and checksum offload off (the ethtool ioctls), so every frame on
    the link is a whole Ethernet frame with its checksums computed."""
    siocethtool = 0x8946
    commands = (0x1F, 0x24, 0x19, 0x17)  # ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SSG, ETHTOOL_STXCSUM

    class EthtoolValue(ctypes.Structure):
        _fields_ = [("cmd", ctypes.c_uint32), ("data", ctypes.c_uint32)]

    class IfReq(ctypes.Structure):
        _fields_ = [("ifr_name", ctypes.c_char * 16), ("ifr_data", ctypes.c_void_p)]

    with socket.socket() as s:
        for cmd in commands:
            value = EthtoolValue(cmd, 0)
            fcntl.ioctl(s.fileno(), siocethtool, IfReq(ifname.encode(), ctypes.addressof(value)))
