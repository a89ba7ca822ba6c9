"""Where the router runs, a replica of the whole cluster's prefix index: per block key, the
places that hold it (node id, "gpu" pool or "cpu" tier).

A node's own replica (``raykv.service.node.replica``) sees the cluster from that node; a
router ranks replicas on every node, so it keeps the places themselves, fed by the
coordinator's change feed (``Coordinator.placement_changes``: the keys whose holders changed
since the last call, each with all its places, or everything after a coordinator restart) a
fraction of a second behind. A request is then ranked with no call at all: its prompt's
block keys are looked up here, once for every candidate node (``PlacementView.hits``).

A stale answer only misranks: the replica's engine looks its prompt up again on its own node
and loads what is really there, verified (invariant 12); at worst it recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from raykv.service.control.index import CPU, GPU, unpack
from raykv.service.served import COORDINATOR, NAMESPACE

log = logging.getLogger(__name__)
Place = tuple[str, str]  # (node id, GPU | CPU)


@dataclass(frozen=True)
class NodeHit:
    """Leading prompt tokens a replica on one node would not compute, by where each block's
    nearest copy is: the node's GPU pools, its CPU tier, or another node (a pull)."""

    gpu: int = 0
    cpu: int = 0
    remote: int = 0

    @property
    def tokens(self) -> int:
        return self.gpu + self.cpu + self.remote

    @property
    def local(self) -> int:
        return self.gpu + self.cpu


class PlacementView:
    """The cluster's block places, per model, kept current by ``refresh`` (a task on the
    router's event loop calls it every ``interval_s`` once ``start`` ran). ``fresh`` is
    False while the coordinator does not answer (then nothing here should be trusted)."""

    STALE_S = 5.0  # no answer from the coordinator for this long: not fresh
    FIRST_ANSWER_S = 3.0  # after start, how long a request may wait for the first answer

    def __init__(self, interval_s: float = 0.1, namespace: str = NAMESPACE) -> None:
        self.interval_s, self.namespace = interval_s, namespace
        self.places: dict[str, dict[bytes, tuple[Place, ...]]] = {}
        self._epoch, self._since = "", 0
        self._answered = 0.0  # monotonic time of the last answer
        self._first_answer = threading.Event()
        self._started_at = 0.0
        self._coordinator: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def fresh(self) -> bool:
        return time.monotonic() - self._answered < self.STALE_S

    async def refresh(self, timeout_s: float = 5.0) -> int:
        """Apply the coordinator's changes since the last call; returns how many keys
        changed. Raises Ray's errors and TimeoutError (the caller decides what a failure
        means)."""
        if self._coordinator is None:
            self._coordinator = ray.get_actor(COORDINATOR, namespace=self.namespace)
        try:
            blob = await asyncio.wait_for(
                self._coordinator.placement_changes.remote(self._epoch, self._since),
                timeout_s,
            )
        except (ray.exceptions.RayError, TimeoutError):
            self._coordinator = None  # re-resolved next time (it may have been re-created)
            raise
        epoch, since, resync, changes = unpack(blob, 4, "placement_changes")
        if resync:
            self.places = {}
        for model, key, places in changes:
            table = self.places.setdefault(model, {})
            if places:
                table[key] = places
            else:
                table.pop(key, None)
        self._epoch, self._since, self._answered = epoch, since, time.monotonic()
        self._first_answer.set()
        return len(changes)

    async def ready(self) -> bool:
        """``fresh``, except that in the first ``FIRST_ANSWER_S`` after ``start`` it waits for
        the coordinator's first answer: the requests that start a router are ranked too,
        where the service answers in time (after an outage nothing waits)."""
        if self.fresh:
            return True
        left = self._started_at + self.FIRST_ANSWER_S - time.monotonic()
        if self._first_answer.is_set() or left <= 0:
            return False
        await asyncio.to_thread(self._first_answer.wait, left)
        return self.fresh

    def start(self) -> None:
        """Refresh in a task on the running event loop while this view is in use and Ray
        runs in this process; failures are logged once per outage."""
        if self._task is None:
            self._started_at = time.monotonic()
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(_refresh_while_used(weakref.ref(self)))

    def hits(
        self, model: str, keys: Sequence[bytes], nodes: Iterable[str], block_size: int = 1
    ) -> dict[str, NodeHit]:
        """For each of ``nodes``, the leading ``keys`` (one group's block keys, prompt order,
        of ``block_size`` tokens each) it would get without computing them, in tokens, by
        where the nearest copy is. The prefix ends at the first block nobody holds."""
        table = self.places.get(model, {})
        held: list[tuple[Place, ...]] = []
        for k in keys:
            places = table.get(k)
            if not places:
                break
            held.append(places)
        out = {}
        for node in set(nodes):
            gpu = cpu = remote = 0
            here_gpu, here_cpu = (node, GPU), (node, CPU)
            for places in held:
                if here_gpu in places:
                    gpu += 1
                elif here_cpu in places:
                    cpu += 1
                else:
                    remote += 1
            out[node] = NodeHit(gpu * block_size, cpu * block_size, remote * block_size)
        return out


async def _refresh_while_used(ref: weakref.ref[PlacementView]) -> None:
    """``view.refresh`` every ``interval_s`` (1 s after a failure) until the view is
    dropped (the task holds it weakly: a router Serve lets go takes its refreshes with it)
    or Ray shuts down here (a call then would start a new Ray)."""
    down = False
    while (view := ref()) is not None and ray.is_initialized():
        try:
            await view.refresh()
            if down:
                log.info("raykv: the prefix index answers again")
            down, wait = False, view.interval_s
        except Exception as e:  # the service is down or restarting: retry, slower
            if not down:
                log.warning("raykv: cannot read the prefix index (%s); retrying", e)
            down, wait = True, 1.0
        del view
        await asyncio.sleep(wait)
