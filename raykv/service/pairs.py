"""A GPU pool's batches over NCCL / gloo (``raykv.transport.collective``), rank to rank.

The reader's leader makes ONE control call to the holder's leader
(``collective_export``: the keys, its ranks' endpoint idents, the pair generation, the
rendezvous store); the holder answers with how many leading blocks it serves, their stored
checksums per distinct TP copy, the row width and its ranks' idents, and meanwhile each of
its writer ranks (the first rank of each distinct copy, ``raykv.layout.tp.writer_ranks``)
gathers its copy into one staging buffer and sends it to the reader's rank of the same
index. So a TP-N pair moves rank to rank, each over its own pair group, and an MLA latent
(one copy per TP group) crosses once: the reader's writer rank passes it on to the other
ranks of its copy (``Collective.recv_batch(forward=...)``), in its own group. Each receiving rank
checks the message and scatters the leading intact rows into its blocks; the batch is what
every rank wrote (the least). One collective fetch at a time per reader pool keeps the
order of every pair's messages the same at both ends; a failure anywhere bumps the reader's
generation (fresh groups next time) and is a ``TransportError`` (``_fetch_remote`` retries
the batch over the object store, then the source counts as failed: misses).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from raykv.errors import TransportError
from raykv.service.spec import NAMESPACE
from raykv.transport.collective import (
    TIMEOUT_S,
    Collective,
    CollectiveTransport,
    Pair,
)

log = logging.getLogger(__name__)


def actor_ident(name: str) -> str:
    """An endpoint's ident: its actor name and incarnation (a re-placed actor forms new
    pairs), or the process's when not in an actor."""
    import os

    aid = None
    if ray.is_initialized():  # get_runtime_context() would start a local Ray otherwise
        aid = ray.get_runtime_context().get_actor_id()
    return f"{name}#{(aid or str(os.getpid()))[-12:]}"


class RankCollective:
    """Mixed into ``RankKV``: this rank's ``Collective`` (made on first use) and its halves
    of a batch. Needs ``entries``, ``widths`` and ``kv``."""

    _coll: Collective | None = None

    def collective(self, name: str) -> Collective:
        if self._coll is None:
            device = self.entries[0][0].device if self.entries and self.entries[0] else "cpu"
            self._coll = Collective(actor_ident(name), device)
        return self._coll

    def start_send(self, name: str, pair: Pair, gi: int, block_ids: list[int]) -> Any:
        """Gather now (before any later call may write the blocks), send in the background;
        returns the send's awaitable."""
        return self.collective(name).start_send(pair, self.entries[gi], block_ids, self.widths[gi])

    async def recv(
        self, name: str, pair: Pair, gi: int, block_ids: list[int], expected, forward
    ) -> int:
        return await self.collective(name).recv_batch(
            pair, self.entries[gi], block_ids, self.widths[gi], expected, forward
        )


class CollectivePlane:
    """Mixed into ``GpuPool``: needs ``name``, ``local``, ``_ranks()``, ``_remote()``,
    ``transports``, ``writers``, ``copy_of``, ``gindex``, ``sums``, ``model``, ``metrics``,
    ``_exportable`` and ``_pending_sums``."""

    def _init_collective(self) -> None:
        coll = self.local.collective(self.name)
        self.transports[coll.backend] = CollectiveTransport(coll)
        self._coll_gen = 0
        self._coll_lock: asyncio.Lock | None = None
        self._coll_idents: list[str] | None = None
        self._sending: set[asyncio.Future] = set()

    async def _idents(self) -> list[str]:
        """Every rank's endpoint ident, rank 0 first."""
        if self._coll_idents is None:
            rest = await self._remote([h.coll_ident.remote() for h in self._ranks()])
            self._coll_idents = [self.local.collective(self.name).ident, *rest]
        return self._coll_idents

    def _background(self, aw: Any, what: str) -> None:
        async def run() -> None:
            try:
                await aw
            except Exception as e:  # the reader sees it too (its receive fails): a miss
                log.warning("pool %s: %s failed: %s", self.name, what, e)
                self.metrics.failed("collective_send")

        task = asyncio.ensure_future(run())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def collective_export(
        self, model: str, keys: list[bytes], reader: dict[str, Any]
    ) -> tuple[int, list[list[int]], int, list[str]]:
        """The control call of a collective fetch (see the module docstring): the leading
        ``keys`` still valid here are sent to ``reader``'s ranks; returns (count, stored
        checksums per copy, row width, this group's idents)."""
        from raykv.service.groups import key_group
        from raykv.service.index import GPU

        idents = await self._idents()  # before choosing blocks: nothing awaits after that
        blocks = self._exportable(model, keys)
        self.metrics.miss(model, GPU, len(keys) - len(blocks))
        if not blocks:
            return 0, [], 0, idents
        gi = self.gindex[key_group(keys[0])]
        sums = [[self.sums[b][c] for b in blocks] for c in range(len(self.writers))]
        store = tuple(reader["store"])
        handles = self._ranks()
        for w in self.writers:
            pair = Pair(idents[w], reader["idents"][w], int(reader["gen"]), store)
            if w == 0:
                send = self.local.start_send(self.name, pair, gi, blocks)
            else:
                send = handles[w - 1].coll_send.remote(pair, gi, blocks)
            self._background(send, f"sending {len(blocks)} blocks to {pair.dst}")
        width = self.widths[gi]
        self.metrics.hit(model, GPU, len(blocks))
        self.metrics.moved(model, GPU, len(blocks) * width * len(self.writers))
        return len(blocks), sums, width, idents

    async def _collective_fetch(
        self, loc: Any, gi: int, want: list[tuple[bytes, int]], filled: set[int], live: Any
    ) -> tuple[int, int]:
        """One batch from ``loc``'s pool over NCCL / gloo, straight into every rank's blocks;
        (blocks, bytes). TransportError if it could not move (the caller falls back)."""
        if self._coll_lock is None:
            self._coll_lock = asyncio.Lock()
        async with self._coll_lock:
            return await self._collective_fetch_locked(loc, gi, want, filled, live)

    async def _collective_fetch_locked(
        self, loc: Any, gi: int, want: list[tuple[bytes, int]], filled: set[int], live: Any
    ) -> tuple[int, int]:
        idents = await self._idents()
        gen, store = self._coll_gen, tuple((loc.endpoint or {}).get("store") or ())
        if len(store) != 2:
            raise TransportError(f"no rendezvous store in {loc.transport} route to {loc.member}")
        reader = {"idents": idents, "gen": gen, "store": store}
        source = ray.get_actor(loc.member, namespace=NAMESPACE)
        keys = [k for k, _ in want]
        try:
            n, sums, width, src = await asyncio.wait_for(
                source.collective_export.remote(self.model.name, keys, reader), TIMEOUT_S
            )
        except TimeoutError:
            self._coll_gen += 1
            raise TransportError(
                f"{loc.member} did not answer a {loc.transport} export in {TIMEOUT_S:.0f}s"
            ) from None
        if not n:
            return 0, 0
        blocks = [b for _, b in want[:n]]
        calls = []
        for r in range(len(self.copy_of)):
            c = self.copy_of[r]
            w = self.writers[c]
            if r == w:  # crosses from the holder's rank w; passed on to our replicas of c
                feed = Pair(src[w], idents[w], gen, store)
                fwd = [
                    Pair(idents[w], idents[x], gen, store)
                    for x in range(len(self.copy_of))
                    if x != w and self.copy_of[x] == c
                ]
            else:  # a replica: from our rank w, inside this group
                feed, fwd = Pair(idents[w], idents[r], gen, store), []
            if r == 0:
                calls.append(self.local.recv(self.name, feed, gi, blocks, sums[c], fwd))
            else:
                calls.append(self._ranks()[r - 1].coll_recv.remote(feed, gi, blocks, sums[c], fwd))
        try:
            counts = await asyncio.gather(*calls)
        except Exception as e:  # a rank's receive failed: fresh groups next time
            self._coll_gen += 1
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"{loc.transport} batch from {loc.member} failed: {e}") from e
        good = min(counts)
        if not live():
            return 0, 0
        if good < n:  # a row failed its check: a miss from there on, counted
            self.metrics.checksum_errors(self.model.name, "remote", 1)
            log.warning("pool %s: block from %s failed its %s check; a miss",
                        self.name, loc.member, loc.transport)  # fmt: skip
            try:
                await source.drop_keys.remote(self.model.name, [want[good][0]])
            except ray.exceptions.RayError as e:
                log.warning("pool %s: cannot tell %s to drop (%s)", self.name, loc.member, e)
        # each block's stored checksums, one per copy
        self._pending_sums.update(zip(blocks[:good], zip(*sums, strict=True), strict=False))
        filled.update(blocks[:good])
        return good, good * width * len(self.writers)
