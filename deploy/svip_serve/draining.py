"""A stop signal drains `svip serve`, it does not cut (issue 40): on SIGTERM or SIGINT the
process asks every replica to stop admitting (new requests get 503 with Retry-After, /health says
"draining" so a balancer stops routing there), waits until the requests in flight have finished,
streams included, or the grace period has passed, and only then stops Serve and Ray.

The process and its replicas meet at one small named actor (``DrainBoard``), which the process
makes when it starts the app: the process sets it draining, each replica reads it a few times a
second and writes back how many requests it still holds. A deployment without the board (the
Helm chart: KubeRay stops pods, and Serve's own graceful_shutdown_timeout_s gives the requests in
flight their time) never drains through it. Runs in the `svip serve` process (``drain``) and in
each replica (``DrainWatch``)."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

log = logging.getLogger(__name__)
BOARD_NAME = "svip-drain-board"
BOARD_NAMESPACE = "svip"
WATCH_S = 0.25  # how often a replica reads the board (and, draining, writes its count)
ABSENT_WATCH_S = 5.0  # how often a replica looks for a board that is not there (a cluster has none)


@ray.remote(num_cpus=0)
class DrainBoard:
    def __init__(self):
        self.draining = False
        self.held: dict[str, int] = {}  # replica -> requests it still holds (running or waiting)

    def start(self) -> None:
        self.draining = True

    def is_draining(self) -> bool:
        return self.draining

    def report(self, replica: str, held: int) -> None:
        self.held[replica] = held

    def holdings(self) -> dict[str, int]:
        return dict(self.held)


def make_board():
    """The board, made by the process that serves (before the app starts, so replicas find it)."""
    return DrainBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True).remote()


def drain(board, replicas: int, grace_s: float, poll_s: float = WATCH_S) -> bool:
    """Ask every replica to drain and wait until each has reported holding nothing (twice in a row,
    a poll apart) or grace_s has passed. Returns whether they all drained in time."""
    ray.get(board.start.remote())
    deadline, quiet = time.monotonic() + grace_s, 0
    while time.monotonic() < deadline:
        held = ray.get(board.holdings.remote())
        quiet = quiet + 1 if len(held) >= replicas and not any(held.values()) else 0
        if quiet >= 2:
            return True
        time.sleep(poll_s)  # polls the replicas' reports: they write on their own schedule
    log.warning("the grace period of %g s ended with requests still in flight: %s", grace_s, held)
    return False


class DrainWatch:
    """In a replica: whether the serving process asked it to drain, read from the board in the
    background; once draining, it reports ``held()`` (its requests in flight) to the board."""

    def __init__(self, replica: str, held):
        self.replica, self._held = replica, held
        self.draining = False
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        """Start watching (on the replica's event loop; called from its handlers)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        board = None
        while True:
            if board is None:
                board = await asyncio.to_thread(_find_board)
                if board is None:
                    await asyncio.sleep(ABSENT_WATCH_S)
                    continue
            try:
                if not self.draining and await board.is_draining.remote():
                    self.draining = True
                    log.warning("replica %s: draining (no new requests; those in flight finish)", self.replica)
                if self.draining:
                    await board.report.remote(self.replica, self._held())
            except ray.exceptions.RayActorError:  # the serving process is going: nothing to tell
                board = None
            await asyncio.sleep(WATCH_S)


def _find_board():
    try:
        return ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    except ValueError:
        return None
