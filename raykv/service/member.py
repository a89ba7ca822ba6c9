"""What pools and tiers share: registering with the coordinator, heartbeats, KV events.

Each batch of KV events carries a sequence number. The coordinator applies a batch only if
it follows the last one it saw from this member; otherwise (it restarted, or a batch was
lost while it was down) it answers False and the member sends a full snapshot instead. So
the cluster index converges to the members' real contents whatever fails in between.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from collections.abc import Hashable
from typing import Any

import ray

from raykv.service.served import COORDINATOR, NAMESPACE
from raykv.transport.select import OBJECT_STORE, UCX

_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
HEARTBEAT_S = 1.0
CALL_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)


class Member:
    kind = "member"
    metrics: Any = None  # pools and tiers set their ServiceMetrics
    ucx: Any = None  # its UCX server (``raykv.service.transports.serve_ucx``), if any

    def __init__(self, name: str, node_id: str) -> None:
        self.name = name
        self.node_id = node_id
        self.seq = 0
        self._coordinator = None
        self._coord_down = False  # the last coordinator call failed
        self._beat: asyncio.Task | None = None

    # --- to be provided by pools and tiers ----------------------------------------------

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        """model -> [(block hash, block id)] of every valid block held."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def extra_snapshot(self) -> dict[str, Any]:
        return {}

    def endpoints(self) -> dict[str, Any]:
        """Transport name -> how a reader reaches this member over it (``raykv.transport``);
        pools and tiers add what they run (a UCX listener, an NCCL rank)."""
        out: dict[str, Any] = {OBJECT_STORE: None}
        if self.ucx is not None:
            out[UCX] = self.ucx.endpoint
        return out

    # --- protocol -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the coordinator needs to rebuild this member's part of its state."""
        return {
            "name": self.name,
            "kind": self.kind,
            "node_id": self.node_id,
            "seq": self.seq,
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "blocks": self.blocks(),
            "stats": self.stats(),
            "transports": self.endpoints(),
            **self.extra_snapshot(),
        }

    def _coord(self):
        if self._coordinator is None:
            self._coordinator = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        return self._coordinator

    async def _call(self, method: str, *args) -> Any:
        """One coordinator call; None if it is unreachable (it may be restarting)."""
        try:
            ref = getattr(self._coord(), method).remote(*args)
            out = await asyncio.wait_for(ref, CALL_TIMEOUT_S)
        except Exception as e:  # down, restarting, or gone: heartbeats will catch up
            # a warning once per outage (every heartbeat fails while it restarts)
            (log.debug if self._coord_down else log.warning)(
                "%s: coordinator %s failed: %r", self.name, method, e
            )
            if self.metrics is not None:
                self.metrics.failed("coordinator_call")
            self._coordinator, self._coord_down = None, True
            return None
        self._coord_down = False
        return out

    async def start(self) -> str:
        """Register and start heartbeats (idempotent). Returns the member's name."""
        if self._beat is None:
            if hasattr(self, "export_blocks"):  # it serves blocks: over UCX too, if it can
                from raykv.service.transports import serve_ucx

                self.ucx = serve_ucx(self)
            await self._call("register", self.snapshot())
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
            if await self._call("heartbeat", self.name, self.seq, self.stats()) is False:
                await self._call("register", self.snapshot())

    async def publish(
        self, model: str, stored: list[tuple[Hashable, int]], removed: list[Hashable]
    ) -> None:
        """Tell the coordinator which blocks became valid or went away, in order."""
        if not stored and not removed:
            return
        self.seq += 1
        keys, blocks = list(map(_FIRST, stored)), list(map(_SECOND, stored))  # C: 2048 each
        ok = await self._call("events", self.name, self.seq, model, keys, blocks, removed)
        if ok is False:
            await self._call("register", self.snapshot())
