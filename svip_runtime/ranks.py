"""A tensor-parallel target's ranks past 0 as Ray actors (svip_common/tensor_parallel.py), started
by the target worker itself (rank 0, coordinator/session/actor.py) when it loads its shard: each
rank takes a GPU of the target's placement bundle (a CPU core without GPUs), joins the group at
rank 0's address, loads its shard and follows rank 0's steps. They are rank 0's own actors, so they
share its fate: a target worker that dies or is replaced takes its ranks with it (no rank is left
holding the group), and its replacement starts new ones; a rank that dies fails rank 0's next
collective (RankLost), and the worker exits to be replaced, its sessions recovering as after any
target loss."""

from __future__ import annotations

import asyncio
import os

import torch

from svip_common.models import DTYPES
from svip_common.tensor_parallel import follow_as_rank


class TargetRank:
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


def start_ranks(path: str, dtype: str, device: str, world: int, host: str, port: int, gpus: bool,
                cpus: float = 1.0) -> list:
    """The ranks 1..world-1 as actors of the calling actor (its placement group's bundle, where it
    has one), each already following: returns their handles (keep them: they live as long as
    their owner holds them)."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": cpus, "num_gpus": 1 if gpus else 0, "max_restarts": 0}
    group = get_current_placement_group()
    if group is not None:  # the bundle with room: the target's (it asks for every rank's GPU and CPU)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=group)
    ranks = [ray.remote(TargetRank).options(**options).remote(path, dtype, "cuda" if gpus else "cpu")
             for _ in range(1, world)]
    for rank, actor in enumerate(ranks, start=1):
        actor.follow.remote(host, port, rank, world)
    return ranks
