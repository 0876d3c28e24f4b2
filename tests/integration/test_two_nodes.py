"""Workers on different nodes, as a cluster runs them: two Ray nodes in two network namespaces
joined by a veth pair with latency on the link (svip_bench/two_nodes.py), the draft on one node
and the target on the other, mutual TLS between them. Greedy output equals the in-process engine
for every policy, sync and async; each worker listens only on its own namespace's address, and
nothing of the cluster appears on this machine's own network. Mutual TLS is also checked on
loopback: a peer without the CA's certificate cannot connect."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from coordinator.cluster import WorkerPair, init_local_ray
from coordinator.distributed import DistributedEngine
from coordinator.engine import SpeculativeEngine
from svip_bench.two_nodes import TwoNodes, unavailable
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.pair_config import PairConfig
from svip_proto import svip_pb2 as pb
from svip_proto import svip_pb2_grpc as pb_grpc
from svip_runtime.tls import TlsFiles
from tests.gates import async_wait_until
from tests.tls_certs import make_tls_dir

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

PROMPT = (5, 6, 7, 8, 9)
MAX_NEW = 24
POLICIES = {
    "svip": {"name": "svip", "threshold": 0.6},
    "constant": {"name": "constant", "draft_length": 4},
    "heuristic": {"name": "heuristic", "draft_length": 3},
    "confidence": {"name": "confidence", "confidence": 0.2},
    "none": {"name": "none"},
}


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    return make_tls_dir(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def reference(models):
    engine = SpeculativeEngine(models["target"], models["close_draft"], load_aware="off")
    return {name: engine.generate(GenerationRequest(PROMPT, MAX_NEW, policy=PolicyConfig(**p))).token_ids
            for name, p in POLICIES.items()}


def test_mutual_tls_between_the_workers(model_dirs, tls_dir, tmp_path, reference):
    import ray

    init_local_ray()
    pair = WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, grpc_tls_dir=str(tls_dir)))
    loop = asyncio.new_event_loop()
    try:
        engine = DistributedEngine.for_pair(pair, "async")
        loop.run_until_complete(engine.connect())
        result = loop.run_until_complete(
            engine.generate(GenerationRequest(PROMPT, MAX_NEW, policy=PolicyConfig(**POLICIES["svip"])))
        )
        assert result.token_ids == reference["svip"]
        loop.run_until_complete(engine.close())

        async def stats_with(open_channel):
            async with open_channel() as channel:
                return await pb_grpc.DraftWorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)

        with pytest.raises(grpc.aio.AioRpcError) as err:  # plaintext to a TLS port
            loop.run_until_complete(stats_with(lambda: grpc.aio.insecure_channel(pair.draft_address)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        stranger = TlsFiles.from_dir(str(make_tls_dir(tmp_path / "other", ca_name="another CA")))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a certificate another CA signed
            loop.run_until_complete(
                stats_with(
                    lambda: grpc.aio.secure_channel(
                        pair.draft_address, stranger.channel_credentials(), options=stranger.channel_options()
                    )
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        trusted = TlsFiles.from_dir(str(tls_dir))  # and the right one is let in

        async def draft_closed() -> bool:  # the draft frees the session once the target's link to it ends
            stats = await stats_with(
                lambda: grpc.aio.secure_channel(
                    pair.draft_address, trusted.channel_credentials(), options=trusted.channel_options()
                )
            )
            return stats.open_sessions == 0

        loop.run_until_complete(async_wait_until(draft_closed, what="the draft freeing the closed session"))
    finally:
        loop.close()
        pair.shutdown()
        ray.shutdown()


def test_a_missing_tls_file_is_named(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    with pytest.raises(Exception, match="no readable tls.crt"):
        TlsFiles.from_dir(str(tmp_path))


def _plain(address: str) -> str:
    """'[::ffff:10.0.0.1]:80' (an IPv4 address on an IPv6 socket, as ss shows it) -> '10.0.0.1:80'."""
    return address.replace("[::ffff:", "").replace("]:", ":")


def host_listeners(marker: str) -> set[str]:
    """Listeners on this machine's own network whose process belongs to the two-node cluster
    (its command line names the cluster's temp dir); other tests may listen meanwhile."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for row in out.splitlines():
        for pid in re.findall(r"pid=(\d+)", row):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.add(row.split()[3])
    return found


@pytest.mark.skipif(unavailable() is not None, reason=f"two-node namespaces: {unavailable()}")
def test_two_nodes_with_latency_on_the_link(model_dirs, tls_dir, tmp_path, reference):
    requests = [{"prompt_ids": list(PROMPT), "max_new_tokens": MAX_NEW, "policy": p} for p in POLICIES.values()]
    spec = {
        "target": model_dirs.target,
        "draft": model_dirs.close_draft,
        "layout": "spread",
        "modes": ["sync", "async"],
        "requests": requests,
        "tls_dir": str(tls_dir),
        "hold": True,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with TwoNodes(delay_ms=2.0) as nodes:
        driver = nodes.popen([sys.executable, "-m", "svip_bench.cluster_run", str(tmp_path / "spec.json")])
        try:
            line = ""
            while not line.startswith("RESULT "):
                line = driver.stdout.readline()
                assert line, driver.stderr.read()[-3000:]
            result = json.loads(line[len("RESULT ") :])
            listeners = nodes.listeners()  # while the workers serve
            leaked = host_listeners(nodes.temp_dir)
        finally:
            driver.communicate("done\n", timeout=600)
    for mode in ("sync", "async"):
        assert result["outputs"][mode] == [reference[name] for name in POLICIES], mode
    target_ip, target_port = result["target_address"].rsplit(":", 1)
    draft_ip, draft_port = result["draft_address"].rsplit(":", 1)
    assert {target_ip, draft_ip} == {nodes.ip["a"], nodes.ip["b"]}  # spread: one worker on each node
    for side in ("a", "b"):
        ours = [_plain(addr) for addr, _ in listeners[side] if addr.rsplit(":", 1)[1] in (target_port, draft_port)]
        assert ours and all(addr.rsplit(":", 1)[0] == nodes.ip[side] for addr in ours), (side, listeners[side])
    assert leaked == set(), "the two-node cluster listened on this machine's own network"
    assert nodes.how in ("netem", "relay")


def test_a_slow_start_says_whether_placing_or_loading_was_slow(model_dirs):
    """A cold start that outruns its timeout names the phase: no room to place the workers, or
    weights that took too long to load (a first download counts)."""
    import ray

    from svip_common.errors import SvipError

    init_local_ray()
    try:
        with pytest.raises(SvipError, match="placed but did not load their weights within 0 s"):
            WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, worker_start_timeout_s=0.001))
        with pytest.raises(SvipError, match=r"no room to place the pair \(spread\)"):
            WorkerPair(PairConfig(model_dirs.target, model_dirs.close_draft, layout="spread",
                                  placement_timeout_s=2))
    finally:
        ray.shutdown()
