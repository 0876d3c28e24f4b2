"""A tensor-parallel model's ranks past 0 as Ray actors (svip_common/tensor_parallel.py), started
by its worker itself (rank 0: the target's or the draft's, svip_runtime/actor.py) when it loads
its shard: each rank takes a GPU of the worker's placement bundle (a CPU core without GPUs), joins
the group at rank 0's address, loads its shard and follows rank 0's steps. They are rank 0's own
actors, so they share its fate: a worker that dies or is replaced takes its ranks with it (no rank
is left holding the group), and its replacement starts new ones; a rank that dies fails rank 0's
next collective (RankLost), and the worker exits to be replaced, its sessions recovering as after
any loss of that worker."""

from __future__ import annotations

import asyncio
import os

import torch

from svip_common.models import DTYPES
from svip_common.tensor_parallel import follow_as_rank


class ModelRank:
    def __init__(self, path: str, dtype: str, device: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.path, self.dtype, self.device = path, DTYPES.get(dtype, "auto"), device

    def placed(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    async def follow(self, host: str, port: int, rank: int, world: int) -> None:
        """Join the group, load the shard, follow rank 0 until it stops (off the actor's event
        loop, which keeps answering pid())."""
        await asyncio.to_thread(follow_as_rank, self.path, rank, world, host, port, self.dtype, self.device)


def load_rank_zero(path: str, dtype: str, device: str, world: int, host: str | None, bundle: int | None,
                   cpus: float = 1.0):
    """In the calling actor: the model's other ranks started (start_ranks), the group joined at this
    node's address (host: the worker's, where it listens on one), rank 0's shard loaded. Returns the
    model and the ranks' handles."""
    import ray

    from svip_common.models import load_model
    from svip_common.tensor_parallel import connect, free_port

    gpus = device.startswith("cuda")
    host = host or ray.util.get_node_ip_address()
    port = free_port(host)
    ranks = start_ranks(path, dtype, device, world, host, port, gpus, cpus, bundle)
    group = connect(0, world, host, port, "cuda" if gpus else "cpu")
    return load_model(path, dtype, "cuda" if gpus else device, group=group), ranks


def start_ranks(path: str, dtype: str, device: str, world: int, host: str, port: int, gpus: bool,
                cpus: float = 1.0, bundle: int | None = None) -> list:
    """The ranks 1..world-1 as actors of the calling actor (in its placement group's bundle, where
    it has one: the caller's, which asks for every rank's GPU and CPU), each already following:
    returns their handles (keep them: they live as long as their owner holds them)."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": cpus, "num_gpus": 1 if gpus else 0, "max_restarts": 0}
    group = get_current_placement_group()
    if group is not None:
        index = -1 if bundle is None else bundle  # -1: any bundle with room
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=group,
                                                                          placement_group_bundle_index=index)
    ranks = [ray.remote(ModelRank).options(**options).remote(path, dtype, "cuda" if gpus else "cpu")
             for _ in range(1, world)]
    for rank, actor in enumerate(ranks, start=1):
        actor.follow.remote(host, port, rank, world)
    return ranks
