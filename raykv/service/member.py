"""What pools and tiers share: registering with the coordinator, heartbeats, KV events
(``Membership``, a part each of them holds; what it reports comes from the actor, through
``Contents``).

Each batch of KV events carries a sequence number. The coordinator applies a batch only if
it follows the last one it saw from this member; otherwise (it restarted, or a batch was
lost while it was down) it answers False and the member sends a full snapshot instead. So
the cluster index converges to the members' real contents whatever fails in between.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol

import ray

from raykv.service.control.metrics import ServiceMetrics
from raykv.service.served import COORDINATOR, NAMESPACE
from raykv.transport.select import OBJECT_STORE, UCX

_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
HEARTBEAT_S = 1.0
CALL_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)
# how a member's parts tell the coordinator which blocks of a model became valid (key,
# block) or went away (keys), in order: ``Membership.publish``
Publish = Callable[[str, list[tuple[Hashable, int]], list[Hashable]], Awaitable[None]]


class Contents(Protocol):
    """What a member tells the coordinator about itself (a pool, a tier)."""

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        """model -> [(block hash, block id)] of every valid block held."""

    def stats(self) -> dict[str, Any]: ...

    def extra_snapshot(self) -> dict[str, Any]: ...

    def endpoints(self) -> dict[str, Any]:
        """Transport name -> how a reader reaches this member over it (``raykv.transport``);
        ``Membership.endpoints`` plus what the member runs (an NCCL rank, ...)."""


class Membership:
    """One member's side of the coordinator: its registration, heartbeats, KV events and,
    where it serves blocks (``serve``: its ``export_blocks``), its UCX server."""

    def __init__(
        self,
        name: str,
        node_id: str,
        kind: str,
        metrics: ServiceMetrics,
        contents: Contents,
        serve: Callable[..., Any] | None = None,
        lends_rows: bool = False,
    ) -> None:
        self.name = name
        self.node_id = node_id
        self.kind = kind
        self.metrics = metrics
        self.contents = contents
        self.serve, self.lends_rows = serve, lends_rows
        self.ucx: Any = None  # its UCX server (``raykv.service.transports.serve_ucx``), if any
        self.seq = 0
        self._coordinator = None
        self._coord_down = False  # the last coordinator call failed
        self._beat: asyncio.Task | None = None
        self._leaving: asyncio.Task | None = None  # set once it leaves (``leave``)

    def endpoints(self) -> dict[str, Any]:
        """The transports every member serves: the object store, UCX where it runs one."""
        out: dict[str, Any] = {OBJECT_STORE: None}
        if self.ucx is not None:
            out[UCX] = self.ucx.endpoint
        return out

    def snapshot(self) -> dict[str, Any]:
        """Everything the coordinator needs to rebuild this member's part of its state."""
        c = self.contents
        return {
            "name": self.name,
            "kind": self.kind,
            "node_id": self.node_id,
            "seq": self.seq,
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "blocks": c.blocks(),
            "stats": c.stats(),
            "transports": c.endpoints(),
            **c.extra_snapshot(),
        }

    def _coord(self):
        if self._coordinator is None:
            self._coordinator = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        return self._coordinator

    async def call(self, method: str, *args) -> Any:
        """One coordinator call; None if it is unreachable (it may be restarting)."""
        try:
            ref = getattr(self._coord(), method).remote(*args)
            out = await asyncio.wait_for(ref, CALL_TIMEOUT_S)
        except Exception as e:  # down, restarting, or gone: heartbeats will catch up
            # a warning once per outage (every heartbeat fails while it restarts)
            (log.debug if self._coord_down else log.warning)(
                "%s: coordinator %s failed: %r", self.name, method, e
            )
            self.metrics.failed("coordinator_call")
            self._coordinator, self._coord_down = None, True
            return None
        self._coord_down = False
        return out

    async def start(self) -> str:
        """Register and start heartbeats (idempotent). Returns the member's name."""
        if self._beat is None:
            if self.serve is not None:  # it serves blocks: over UCX too, if it can
                from raykv.service.transports import serve_ucx

                self.ucx = serve_ucx(self.name, self.serve, self.metrics, self.lends_rows)
            await self.call("register", self.snapshot())
            self._beat = asyncio.get_running_loop().create_task(self._heartbeats())
        return self.name

    async def watch(self, seconds: float) -> str | None:
        """Answer after ``seconds`` with this actor's id: the coordinator keeps one such call
        open, so it learns of this member's death as soon as Ray reports it."""
        await asyncio.sleep(seconds)
        return ray.get_runtime_context().get_actor_id()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if await self.call("heartbeat", self.name, self.seq, self.contents.stats()) is False:
                await self.call("register", self.snapshot())

    async def publish(
        self, model: str, stored: list[tuple[Hashable, int]], removed: list[Hashable]
    ) -> None:
        """Tell the coordinator which blocks became valid or went away, in order."""
        if not stored and not removed:
            return
        self.seq += 1
        keys, blocks = list(map(_FIRST, stored)), list(map(_SECOND, stored))  # C: 2048 each
        ok = await self.call("events", self.name, self.seq, model, keys, blocks, removed)
        if ok is False:
            await self.call("register", self.snapshot())

    def leave(self) -> None:
        """Leave the index and exit (a pool whose TP rank died: its KV is incomplete), so
        the coordinator places a fresh one."""
        if self._leaving is not None:
            return
        if self._beat is not None:
            self._beat.cancel()

        async def leave() -> None:
            await self.call("member_failed", self.name)
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

        self._leaving = asyncio.get_running_loop().create_task(leave())
