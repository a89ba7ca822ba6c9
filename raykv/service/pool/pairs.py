"""A GPU pool's batches over NCCL / gloo (``raykv.transport.collective``), rank to rank.

The reader's leader makes ONE control call to the holder's leader
(``collective_export``: the keys, its ranks' endpoint idents, the pair generation, the
rendezvous store); the holder answers with how many leading blocks it serves, their stored
checksums per distinct TP copy, the row width and its ranks' idents, and meanwhile each of
its ranks gathers its part of the batch into one staging buffer and sends it to the reader's
rank of the same index. So a TP-N pair moves rank to rank, each over its own pair group. A
copy that several ranks replicate (an MLA latent: one copy per TP group) crosses once, in
shares (``raykv.transport.collective.wire.shares``; a small batch whole, from the copy's
first rank): each replica of the holder sends its share to the reader's rank of the same
index, which passes it on to its other replicas as it arrives (``Collective.recv_shares``,
in its own group), so every link between the groups carries part of the one copy. Each
receiving rank checks the messages and scatters the leading intact rows into its blocks; the
batch is what every rank wrote (the least). A holder's replicas hold the same bytes (every
way a block becomes valid writes each rank's copy alike; an engine's own store is checked
for it). One collective fetch at a time per reader pool keeps the order of every pair's
messages the same at both ends; a failure anywhere bumps the reader's generation (fresh
groups next time) and is a ``TransportError`` (``Fetch`` retries the batch over the object
store, then the source counts as failed: misses).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from raykv.blocks import BlockManager
from raykv.errors import TransportError
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.pool.fanout import Ranks
from raykv.service.pool.requests import Requests
from raykv.service.served import NAMESPACE, ServedModel
from raykv.transport import Fetched, Transport
from raykv.transport.collective import TIMEOUT_S, CollectiveTransport, Pair, RankLinks
from raykv.transport.collective.wire import shares
from raykv.transport.peer_read import PEER, PeerTransport, enabled
from raykv.transport.select import NCCL

HOLD_S = 2 * TIMEOUT_S  # a peer read's hold on the holder's blocks, if never released

log = logging.getLogger(__name__)


class Pairs:
    """Pool ``name``'s NCCL / gloo pairs and peer reads with the other pools: both halves of
    a batch (see the module docstring), rank 0's share through ``local`` (its ``RankLinks``),
    the other ranks' through ``ranks``. Registers its transports in ``transports`` (the
    pool's, by name)."""

    def __init__(
        self,
        name: str,
        model: ServedModel,
        node_id: str,
        plan: Any,
        local: RankLinks,
        ranks: Ranks,
        requests: Requests,
        bm: BlockManager,
        metrics: ServiceMetrics,
        transports: dict[str, Transport],
    ) -> None:
        self.name, self.model, self.local, self.ranks = name, model, local, ranks
        self.requests, self.bm, self.metrics, self.transports = requests, bm, metrics, transports
        self.gindex = {g.group_id: i for i, g in enumerate(plan.groups)}
        coll = self.local.collective(self.name)
        self.transports[coll.backend] = CollectiveTransport(coll)
        if (
            enabled()
            and self.local.peer_handle() is not None
            and len(ranks.writers) == len(ranks.copy_of)
        ):
            # every rank its own copy (an MLA group's replicas stay on NCCL: it moves once)
            layout = (self.model.name, len(ranks.copy_of), *ranks.widths)
            self.transports[PEER] = PeerTransport(node_id, layout)
        self._holds: dict[int, tuple[list[int], float]] = {}
        self._hold_seq = 0
        self._peer_handles: list[Any] | None = None
        self._coll_gen = 0
        self._coll_lock: asyncio.Lock | None = None
        self._coll_idents: list[str] | None = None
        # holder member -> (generation, the rank pairs that read it through NCCL windows, or
        # None where they stage): looked up once per generation, after its first batch
        self._window_of: dict[str, tuple[int, list[Pair] | None]] = {}
        self._read_in_place = False  # a peer has read our blocks in place: sum them early
        self._sending: set[asyncio.Future] = set()

    async def _idents(self) -> list[str]:
        """Every rank's endpoint ident, rank 0 first."""
        if self._coll_idents is None:
            rest = await self.ranks.remote([h.coll_ident.remote() for h in self.ranks.handles()])
            self._coll_idents = [self.local.collective(self.name).ident, *rest]
        return self._coll_idents

    def _background(self, aw: Any, what: str, failure: str = "collective_send") -> None:
        async def run() -> None:
            try:
                await aw
            except Exception as e:  # a send's reader sees it too (its receive fails): a miss
                log.warning("pool %s: %s failed: %s", self.name, what, e)
                self.metrics.failed(failure)

        task = asyncio.ensure_future(run())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def export(
        self, model: str, keys: list[bytes], reader: dict[str, Any]
    ) -> tuple[int, list[list[int]], int, list[str]]:
        """The control call of a collective fetch (see the module docstring): the leading
        ``keys`` still valid here are sent to ``reader``'s ranks; returns (count, stored
        checksums per copy, row width, this group's idents)."""
        from raykv.service.control.index import GPU
        from raykv.service.groups import key_group

        idents = await self._idents()  # before choosing blocks: nothing awaits after that
        blocks = self.requests.exportable(model, keys)
        self.metrics.miss(model, GPU, len(keys) - len(blocks))
        if not blocks:
            return 0, [], 0, idents
        gi = self.gindex[key_group(keys[0])]
        sums = [[self.requests.sums[b][c] for b in blocks] for c in range(len(self.ranks.writers))]
        store = tuple(reader["store"])
        handles = self.ranks.handles()
        for r, share in self._shares(len(blocks), self.ranks.widths[gi]):  # a share per replica
            if not share:
                continue
            part = blocks[share.start : share.stop]
            pair = Pair(idents[r], reader["idents"][r], int(reader["gen"]), store)
            if r == 0:
                send = self.local.start_send(self.name, pair, gi, part)
            else:
                send = handles[r - 1].coll_send.remote(pair, gi, part)
            self._background(send, f"sending {len(part)} blocks to {pair.dst}")
        width = self.ranks.widths[gi]
        self.metrics.hit(model, GPU, len(blocks))
        self.metrics.moved(model, GPU, len(blocks) * width * len(self.ranks.writers))
        return len(blocks), sums, width, idents

    def _shares(self, n: int, width: int) -> list[tuple[int, range]]:
        """(rank, its share of a batch of ``n`` rows of ``width`` bytes) for every rank: a
        copy that several ranks replicate (an MLA latent) crosses in shares, one per replica
        (a reader's rank receives its share from the holder's rank of the same index and
        passes it on to its replicas, ``Collective.recv_shares``), so one copy crosses over
        all the copy's links at once (a small batch: whole, from the first replica); a rank
        that holds its own copy sends all of it."""
        out = []
        for r in range(len(self.ranks.copy_of)):
            replicas = self.ranks.replicas(r)
            out.append((r, shares(n, len(replicas), width)[replicas.index(r)]))
        return out

    # --- peer reads: the holder's half -------------------------------------------------

    def _expire_holds(self) -> None:
        now = time.monotonic()
        for token, (blocks, deadline) in list(self._holds.items()):
            if deadline < now:
                del self._holds[token]
                self.bm.pool.free(blocks)

    async def peer_export(self, model: str, keys: list[bytes]) -> dict[str, Any] | None:
        """The control call of a peer read: the leading ``keys`` still valid here, held (not
        evicted, not rewritten) until ``release_peer_hold`` or ``HOLD_S``; returns their
        blocks, stored checksums and wire sums per copy (taken by the writer ranks at a
        block's first export, then remembered while it stays valid), the ranks' handles and
        the hold's token (None: nothing to read)."""
        from raykv.service.control.index import GPU
        from raykv.service.groups import key_group

        self._expire_holds()
        self._read_in_place = True
        if self._peer_handles is None:
            rest = await self.ranks.remote([h.peer_handle.remote() for h in self.ranks.handles()])
            self._peer_handles = [self.local.peer_handle(), *rest]
        blocks = self.requests.exportable(model, keys)
        self.metrics.miss(model, GPU, len(keys) - len(blocks))
        if not blocks:
            return None
        self.bm.pool.touch(blocks)  # before anything awaits: nothing can take them now
        self._hold_seq += 1
        token = self._hold_seq
        self._holds[token] = (blocks, time.monotonic() + HOLD_S)
        gi = self.gindex[key_group(keys[0])]
        stored = [
            [self.requests.sums[b][c] for b in blocks] for c in range(len(self.ranks.writers))
        ]
        new = [b for b in blocks if b not in self.requests.wire_sums]
        if new:  # not summed since they became valid (``sum_soon``): the ranks state them now
            try:
                await self._take_wire_sums(gi, new)
            except BaseException:
                await self.release_peer_hold(token)
                raise
            if any(
                b not in self.requests.wire_sums for b in blocks
            ):  # invalidated meanwhile: a miss
                await self.release_peer_hold(token)
                return None
        wire = [
            np.fromiter((self.requests.wire_sums[b][c] for b in blocks), np.int64, len(blocks))
            for c in range(len(self.ranks.writers))
        ]  # int64 arrays: the readers compare them as they are
        self.metrics.hit(model, GPU, len(blocks))
        self.metrics.moved(
            model, GPU, len(blocks) * self.ranks.widths[gi] * len(self.ranks.writers)
        )
        return {
            "blocks": blocks, "stored": stored, "wire": wire, "hold": token,
            "handles": [self._peer_handles[w] for w in self.ranks.writers],
        }  # fmt: skip

    async def _take_wire_sums(self, gi: int, blocks: list[int]) -> None:
        """Every writer rank states the wire sums of ``blocks`` (held by the caller: their
        bytes cannot change meanwhile), remembered for those still valid after the await."""
        handles = self.ranks.handles()

        async def here() -> np.ndarray:
            return self.local.peer_sums(gi, blocks)

        per_copy = await asyncio.gather(*(
            here() if w == 0 else handles[w - 1].peer_sums.remote(gi, blocks)
            for w in self.ranks.writers
        ))  # fmt: skip
        for j, b in enumerate(blocks):
            if b in self.requests.key_of:
                self.requests.wire_sums[b] = tuple(c[j] for c in per_copy)

    def sum_soon(self, valid: list[tuple[bytes, int]]) -> None:
        """Blocks that just became valid (``(key, block)``): where pools of this node read
        each other in place, their wire sums are taken now, in the background, each group's
        blocks held meanwhile, so a peer's first read of them waits for no pass over the
        holder's blocks (and, under TP, no call to its other ranks)."""
        if not (PEER in self.transports or self._read_in_place) or not valid:
            return
        from raykv.service.groups import key_group

        by_group: dict[int, list[int]] = {}
        for key, b in valid:
            by_group.setdefault(self.gindex[key_group(key)], []).append(b)
        for gi, blocks in by_group.items():
            self.bm.pool.touch(blocks)  # before anything awaits: nothing can take them now

            async def take(gi: int = gi, blocks: list[int] = blocks) -> None:
                try:
                    await self._take_wire_sums(gi, blocks)
                finally:
                    self.bm.pool.free(blocks)

            # failed: a first export takes them then
            self._background(take(), f"taking the wire sums of {len(blocks)} blocks", "wire_sums")

    async def release_peer_hold(self, token: int) -> None:
        """A peer reader is done with the blocks of hold ``token`` (a no-op once expired)."""
        held = self._holds.pop(token, None)
        if held is not None:
            self.bm.pool.free(held[0])
        self._expire_holds()

    # --- reading from another pool ------------------------------------------------------

    async def fetch(
        self,
        loc: Any,
        gi: int,
        want: list[tuple[bytes, int]],
        filled: set[int],
        live: Callable[[], bool],
    ) -> Fetched:
        """One batch from ``loc``'s pool over NCCL / gloo, straight into every rank's blocks
        (the pool's ``Direct`` route, ``raykv.transport.fetch_over``). TransportError if it
        could not move (the next route is taken). A peer route reads the holder's mapped
        blocks instead (``_peer_fetch``)."""
        if loc.transport == PEER:
            return await self._peer_fetch(loc, gi, want, filled, live)
        seen = self._window_of.get(loc.member)
        if seen is not None and seen[0] == self._coll_gen and seen[1] is not None:
            try:  # read in place through the pairs' NCCL windows (``collective.window``)
                return await self._peer_fetch(loc, gi, want, filled, live, seen[1])
            except TransportError:
                self._coll_gen += 1  # fresh pairs (and windows) next time
                raise
        if self._coll_lock is None:
            self._coll_lock = asyncio.Lock()
        async with self._coll_lock:
            return await self._collective_fetch_locked(loc, gi, want, filled, live)

    async def _collective_fetch_locked(
        self,
        loc: Any,
        gi: int,
        want: list[tuple[bytes, int]],
        filled: set[int],
        live: Callable[[], bool],
    ) -> Fetched:
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
            return Fetched()
        blocks = [b for _, b in want[:n]]
        calls = []
        for r in range(len(self.ranks.copy_of)):  # rank to rank; a replicated copy in shares
            feed, c = Pair(src[r], idents[r], gen, store), self.ranks.copy_of[r]
            replicas = [idents[x] for x in self.ranks.replicas(r)]  # one: its own copy, whole
            if r == 0:
                calls.append(self.local.recv(self.name, feed, gi, blocks, sums[c], replicas))
            else:
                calls.append(
                    self.ranks.handles()[r - 1].coll_recv.remote(
                        feed, gi, blocks, sums[c], replicas
                    )
                )
        try:
            counts = await asyncio.gather(*calls)
        except Exception as e:  # a rank's receive failed: fresh groups next time
            self._coll_gen += 1
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"{loc.transport} batch from {loc.member} failed: {e}") from e
        seen = self._window_of.get(loc.member)
        if loc.transport == NCCL and (seen is None or seen[0] != gen):
            pairs = [Pair(src[r], idents[r], gen, store) for r in range(len(self.ranks.copy_of))]
            await self._windows_formed(loc.member, gen, pairs)
        return self._landed(want, min(counts), n, sums, width, filled, live)

    def _landed(
        self, want: list[tuple[bytes, int]], good: int, n: int, sums: list[list[int]],
        width: int, filled: set[int], live: Callable[[], bool],
    ) -> Fetched:  # fmt: skip
        """After a batch of ``n`` blocks landed in ours, ``good`` leading ones intact: those
        become fillable (with their stored checksums, one per copy); the block after them
        failed its check (``corrupt``: the reader counts it and has the holder drop it)."""
        blocks = [b for _, b in want[:n]]
        if not live():
            return Fetched()
        self.requests.pending_sums.update(zip(blocks[:good], zip(*sums, strict=True), strict=False))
        filled.update(blocks[:good])
        return Fetched(good, good * width * len(self.ranks.writers), corrupt=good < n)

    async def _windows_formed(self, member: str, gen: int, pairs: list[Pair]) -> None:
        """Whether every rank pair with ``member`` formed an NCCL window (each rank its own
        copy: an MLA group's replicas stay staged, which moves the latent once)."""
        have = [False]
        if len(self.ranks.writers) == len(self.ranks.copy_of):
            try:
                have = await asyncio.gather(
                    asyncio.sleep(0, self.local.has_window(pairs[0])),
                    *(h.coll_has_window.remote(p) for h, p in zip(self.ranks.handles(), pairs[1:],
                                                                  strict=True)),
                )  # fmt: skip
            except ray.exceptions.RayError as e:
                log.warning("pool %s: cannot ask its ranks for windows (%s)", self.name, e)
        self._window_of[member] = (gen, pairs if all(have) else None)

    async def _peer_fetch(
        self, loc: Any, gi: int, want: list[tuple[bytes, int]], filled: set[int],
        live: Callable[[], bool], pairs: list[Pair] | None = None,
    ) -> Fetched:  # fmt: skip
        """One batch read from ``loc``'s pool on this node: one control call (the holder
        holds the blocks and states their sums), then each of our ranks copies its rank's
        blocks straight into ours (``raykv.transport.peer_read``; from its memory mapped
        through the rank pairs' NCCL windows, ``pairs``, else through its peer handles);
        the hold is released after. TransportError if it could not (the caller falls
        back)."""
        source = ray.get_actor(loc.member, namespace=NAMESPACE)
        keys = [k for k, _ in want]
        try:
            got = await asyncio.wait_for(
                source.peer_export.remote(self.model.name, keys), TIMEOUT_S
            )
        except TimeoutError:
            raise TransportError(f"{loc.member} did not answer a peer export") from None
        except ray.exceptions.RayError as e:
            raise TransportError(f"{loc.member} cannot export: {e}") from e
        if got is None:
            return Fetched()
        n = len(got["blocks"])
        blocks = [b for _, b in want[:n]]
        handles = pairs or got["handles"]
        args = [(gi, handles[r], got["blocks"], blocks, got["wire"][r])
                for r in range(len(self.ranks.copy_of))]  # fmt: skip
        calls = [
            self.local.peer_read(*args[0]),
            *(h.peer_read.remote(*a) for h, a in zip(self.ranks.handles(), args[1:], strict=True)),
        ]
        try:
            counts = await asyncio.gather(*calls)
        except Exception as e:
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"peer read from {loc.member} failed: {e}") from e
        finally:  # the copies are done (or failed): the holder may reuse its blocks
            source.release_peer_hold.remote(got["hold"])
        width = self.ranks.widths[gi]
        return self._landed(want, min(counts), n, got["stored"], width, filled, live)
