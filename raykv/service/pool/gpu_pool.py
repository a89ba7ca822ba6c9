"""GpuPool: the paged KV of one engine instance's TP group as a Ray actor, for one model.

It is rank 0 of the group and its leader: it owns the ``BlockManager`` (every rank uses the
same block ids) and rank 0's ``GpuKV``; ranks 1..tp-1 are ``RankPool`` actors it drives
(tp_size=1: it is the whole group). Any plan the layout makes is served: hybrid groups
(block tables per group, keys per group, null blocks skipped), TP ranks (per-rank rows; the
CPU tier keeps each distinct copy once) and CPU-tier entries of several GPU blocks.

A block becomes *valid* — published to the coordinator's index under its group key,
servable to other nodes — only once its bytes were written by ``store`` or ``load`` and the
block manager caches it under the same key. A valid block is immutable: ``store`` and
``load`` skip it (and any block another call is writing at that moment), so the first write
of a shared prefix block is the only one and its bytes never change while it stays valid.
Under memory pressure the block manager evicts cached blocks; the pool copies each complete
chunk (``raykv.service.groups``) an evicted valid block belongs to into the node's CPU tier
before handing the block out (nothing can overwrite it in between: its new owner learns its
id only when ``allocate`` returns, and the offload fences the blocks before its first
await). On a node without GPUs the same actors run with ``device="cpu"`` (development and
CI).

The pool is its public (Ray-called) methods over named parts, each given in its
constructor only what it uses: ``requests`` (``raykv.service.pool.requests``: who owns each
request, its tokens and keys, and the validity and checksums of blocks), ``ranks`` (the TP
fan-out, ``fanout``), ``tier_io`` (offload to and load from the node's CPU tier through
``raykv.tiers`` jobs on the shared arena, ``dataplane``), ``fetch`` (blocks from other
members through ``raykv.transport``, ``dataplane``), ``pairs`` (NCCL / gloo batches and peer
reads between pools, ``pairs``) and ``member`` (the coordinator: registration, heartbeats,
KV events, ``raykv.service.member``). Invariants 9 and 12 are kept in ``dataplane``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import ray
import torch

from raykv.api import StoreResult
from raykv.blocks import BlockManager
from raykv.errors import AccessDenied, InvalidInput, ServiceError
from raykv.service.control.index import GPU
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.groups import (
    check_servable,
    common_hit,
    complete_chunks,
    key_group,
    managers,
    per_group,
)
from raykv.service.member import Membership
from raykv.service.pool.dataplane import Fetch, TierIO
from raykv.service.pool.fanout import Ranks
from raykv.service.pool.pairs import Pairs
from raykv.service.pool.rank import RankKV
from raykv.service.pool.requests import Requests
from raykv.service.pool.rows import RankRows, as_rank_rows
from raykv.service.served import NAMESPACE, ServedModel, tier_name
from raykv.service.transports import reader_transports
from raykv.tiers.checksum import row_checksums
from raykv.tiers.jobs import NULL_BLOCK
from raykv.transport import export_rows

log = logging.getLogger(__name__)


class GpuPool:
    """One TP group's paged KV for one model (see the module docstring)."""

    kind = "pool"

    def __init__(
        self,
        name: str,
        model: ServedModel,
        plan: Any,
        node_id: str,
        device: str = "cpu",
        ranks: Sequence[str] = (),
    ) -> None:
        check_servable(plan)
        if len(ranks) != plan.tp_size - 1:
            raise ServiceError(
                f"pool {name!r}: tp_size={plan.tp_size} needs {plan.tp_size - 1} other ranks, "
                f"got {len(ranks)}"
            )
        self.name, self.node_id = name, node_id
        self.model, self.plan, self.device = model, plan, device
        self.bm = BlockManager(plan, enable_prefix_caching=True)
        self.local = RankKV(plan, device, 0)  # rank 0
        self.rank_names = list(ranks)
        self.gindex = {g.group_id: i for i, g in enumerate(plan.groups)}
        self.managers = managers(plan)
        self.metrics = ServiceMetrics("pool")
        self.member = Membership(name, node_id, self.kind, self.metrics, self, self.export_blocks)
        self.ranks = Ranks(name, plan, self.local, self.rank_names, self.member.leave)
        self.requests = Requests(name, model, plan, self.bm, self.metrics)
        transports = reader_transports()  # the object store, and UCX where it runs
        # nccl (GPU KV) or gloo (host KV), and peer reads where they run, join them
        self.pairs = Pairs(name, model, node_id, plan, self.local.links, self.ranks,
                           self.requests, self.bm, self.metrics, transports)  # fmt: skip
        self.tier_io = TierIO(name, model, plan, node_id, self.local, self.ranks, self.requests,
                              self.bm, self.metrics, self.member.publish)  # fmt: skip
        self.fetch = Fetch(name, model, node_id, self.ranks, self.requests, self.tier_io,
                           self.pairs, self.metrics, transports)  # fmt: skip

    async def start(self) -> str:
        tier = ray.get_actor(tier_name(self.node_id), namespace=NAMESPACE)
        await tier.add_model.remote(self.model.name, self.plan)
        return await self.member.start()

    # --- engine-facing ------------------------------------------------------------------
    # They take their arguments as ``raykv.client`` checked them (``raykv.api``); the pool's
    # own checks (ownership, the plan's limits, a request's state) are ``Requests``'.

    async def admit(
        self, client: str, rid: Hashable, num_tokens: int, token_ids: list[int] | None = None
    ) -> bool:
        rid = self.requests.mine(client, rid)
        ids = self.requests.ids(token_ids, rid)
        ok = self.bm.admit(rid, num_tokens, ids)
        if ok:
            self.requests.admitted(rid, client, ids)
        return ok

    async def blocks_needed(
        self, client: str, rid: Hashable, num_new_tokens: int, token_ids: list[int] | None = None
    ) -> int:
        rid = self.requests.mine(client, rid)
        return self.bm.blocks_needed(rid, num_new_tokens, self.requests.ids(token_ids, rid))

    async def allocate(
        self,
        client: str,
        rid: Hashable,
        num_new_tokens: int,
        token_ids: list[int] | None = None,
    ) -> list[list[int]] | None:
        rid = self.requests.mine(client, rid)
        ids = self.requests.ids(token_ids, rid)
        new = self.bm.allocate(rid, num_new_tokens, ids)
        if new is None:
            return None
        if ids is not None:
            self.requests.tokens[rid] = ids
        self.requests.unverified.difference_update(
            b for table in new for b in table
        )  # fresh owners
        self.bm.drain_events()  # our index is ``valid``: only written blocks count
        # Blocks whose cached prefix the manager evicted to make this step fit: their bytes
        # are still intact (nobody wrote them yet), so offload their chunks first.
        evicted = [
            b
            for table in new
            for b in table
            if b in self.requests.key_of and not self.requests.cached_as(b, self.requests.key_of[b])
        ]
        if evicted:
            chunks = {
                c.key: c
                for b in evicted
                if (c := self.requests.chunk_of.get(self.requests.key_of[b]))
            }
            await self.tier_io.offload(list(chunks.values()))
            keys = self.requests.gone([self.requests.invalidate(b) for b in evicted])
            self.metrics.evicted(self.model.name, GPU, len(evicted))
            await self.member.publish(self.model.name, [], keys)
        self.metrics.used(self.model.name, GPU, self.bm.pool.num_used_blocks)
        return new

    async def store(
        self, client: str, rid: Hashable, block_ids: list, rows: Any, offload: bool = False
    ) -> StoreResult:
        """Write the KV bytes of ``block_ids`` (this request's blocks, per group; null ids
        skipped) on every rank; full blocks become hits for everyone. Blocks holding
        published bytes (valid here: written before and cached under their prefix key, by
        this request or one sharing the block through a prefix hit) are immutable: they are
        skipped, their bytes unchanged, and reported in ``skipped``. A block another call is
        writing now (a request sharing it is loading it) is waited for first (at most
        ``WRITE_WAIT_S``), then skipped if that call published it, else written. ``offload``
        also copies the request's complete chunks to the node's CPU tier now. Returns a
        ``StoreResult``: the blocks newly published (its int value), the blocks written and
        the ones skipped."""
        rid = self.requests.mine(client, rid)
        tables = per_group(self.plan, block_ids)
        self.requests.own_blocks(rid, tables)
        data: RankRows = as_rank_rows(self.plan, rows, tables, self.ranks.widths)
        real = [[b for b in t if b != NULL_BLOCK] for t in tables]
        gen = self.requests.gen.get(rid)
        await self.requests.settle({b for ids in real for b in ids})
        if not self.requests.live(rid, gen):  # freed while we waited: its blocks may be others' now
            return StoreResult(0, 0, [[] for _ in real])
        keep = [[i for i, b in enumerate(ids) if not self.requests.immutable(b)] for ids in real]
        written = [[ids[i] for i in k] for ids, k in zip(real, keep, strict=True)]
        skipped = [[b for b in ids if self.requests.immutable(b)] for ids in real]
        num_written = sum(len(w) for w in written)
        busy = {b for ids in written for b in ids}
        self.requests.writing |= busy
        try:
            for gi, ids in enumerate(written):
                if not ids:
                    continue
                sel = None if len(ids) == len(real[gi]) else torch.tensor(keep[gi])
                per_rank = [data[r][gi] for r in range(self.plan.tp_size)]
                if sel is not None:
                    per_rank = [x[sel] for x in per_rank]
                # invariant 12: the checksum of each distinct copy, from the rows written
                sums = [row_checksums(per_rank[r]) for r in self.ranks.writers]
                for j, b in enumerate(ids):
                    self.requests.pending_sums[b] = tuple(c[j] for c in sums)
                await self.ranks.scatter(gi, per_rank, ids)
        finally:
            await self.requests.done_writing(busy)
        if not self.requests.live(rid, gen):  # freed meanwhile: its blocks may be someone else's
            return StoreResult(0, num_written, skipped)
        stored, removed = self.requests.validate(rid, written)
        await self.member.publish(self.model.name, stored, removed)
        self.pairs.sum_soon(stored)
        if offload and self.requests.live(rid, gen):
            keys = self.requests.keys(rid)
            await self.tier_io.offload(complete_chunks(self.plan, self.bm.block_table(rid), keys))
        return StoreResult(len(stored), num_written, skipped)

    async def read(self, client: str, block_ids: list, rank: int = 0) -> list[np.ndarray]:
        """Rows of ``block_ids`` (per group) on ``rank``: uint8 [n, row_bytes] per group; only
        published blocks and blocks of the caller's own live requests (else AccessDenied)."""
        tables = per_group(self.plan, block_ids)
        if not 0 <= rank < self.plan.tp_size:
            raise InvalidInput(
                f"rank {rank} is outside tp_size={self.plan.tp_size}; pass a TP rank in "
                f"0..{self.plan.tp_size - 1}"
            )
        # plain ints only, as ``_own_blocks`` takes them: a look-alike is no block id
        n = self.plan.num_gpu_blocks
        bad = [b for t in tables for b in t if type(b) is not int or not 0 < b < n]
        if bad:
            raise InvalidInput(f"block ids {bad[:8]} out of range 1..{n - 1}")
        await self.requests.settle({b for t in tables for b in t})  # never bytes half-written
        mine = [set() for _ in tables]
        for rid in (r for r, c in self.requests.owner.items() if c == client):
            for gi, table in enumerate(self.bm.block_table(rid)[: len(tables)]):
                mine[gi].update(table)
        # published blocks are anyone's to load, so anyone's to read; the rest is private
        private = [b for gi, t in enumerate(tables) for b in t if b not in mine[gi]]
        foreign = [b for b in private if b not in self.requests.key_of]
        if foreign:
            raise AccessDenied(
                f"blocks {foreign[:8]} are neither published nor in this client's live requests "
                f"on pool {self.name!r}; read your own requests' blocks (load a published prefix "
                "into them to read what others computed)"
            )
        return [(await self.ranks.gather(gi, t, [rank]))[0].numpy() for gi, t in enumerate(tables)]

    async def load(self, client: str, rid: Hashable, token_ids: list[int], into: list) -> dict:
        """Fill ``into`` (blocks of this request's tables, per group) with the KV of their
        positions from the best copies in the cluster; copies that vanished, and slots
        nobody holds (e.g. out of a sliding window), are misses. Returns the request's
        leading tokens now backed by written KV in every group."""
        t0 = time.perf_counter()
        rid = self.requests.mine(client, rid)
        ids = self.requests.ids(token_ids, rid)
        into_tables = per_group(self.plan, into)
        self.requests.own_blocks(rid, into_tables)
        gen = self.requests.gen.get(rid)
        nothing = {"num_tokens": 0, "loaded_blocks": 0, "bytes": 0, "seconds": 0.0}
        if ids is not None and len(ids) > len(self.requests.tokens.get(rid, [])):
            self.requests.tokens[rid] = ids
        tables, keys = self.bm.block_table(rid), self.requests.keys(rid)
        todo: list[list[tuple[int, int]]] = []
        for gi, blocks in enumerate(into_tables):
            pos = {b: j for j, b in enumerate(tables[gi]) if b != NULL_BLOCK}
            real = [b for b in blocks if b != NULL_BLOCK]
            late = [b for b in real if pos[b] >= len(keys[gi])]
            if late:
                raise InvalidInput(
                    f"blocks {late[:8]} hold positions past the request's known full blocks "
                    f"({len(keys[gi])}); pass the request's token_ids"
                )
            # published blocks keep their bytes (valid under this key: already backed)
            todo.append(sorted((pos[b], b) for b in real if not self.requests.immutable(b)))
        filled: set[int] = set()
        moved = 0
        busy = {b for want in todo for _, b in want}
        self.requests.writing |= busy
        # held while the load writes them: freed meanwhile, they reach nobody else before
        # their bytes are verified or dropped (``_drop_unverified``)
        self.bm.pool.touch(busy)
        try:
            for gi, want in enumerate(todo):
                # 1) another block of this pool already holds the bytes
                local = [(j, b) for j, b in want if keys[gi][j] in self.requests.valid]
                if local:
                    src = [self.requests.valid[keys[gi][j]] for j, _ in local]
                    n = await self._copy_blocks(gi, src, [b for _, b in local])
                    filled.update(b for _, b in local[:n])
                # 2) the node's CPU tier or another node, best copy first
                rest = [(keys[gi][j], b) for j, b in want if b not in filled]
                if rest:
                    moved += await self.fetch.fetch(rid, gen, gi, rest, filled)
                if not self.requests.live(rid, gen):  # freed meanwhile: nothing to publish
                    return nothing | {"bytes": moved}
        finally:
            try:
                await self._drop_unverified([[b for _, b in want if b not in filled]
                                             for want in todo])  # fmt: skip
            finally:
                await self.requests.done_writing(busy)
                self.bm.pool.free(busy)
        written = [[b for b in t if b in filled] for t in into_tables]
        valid, removed = self.requests.validate(rid, written)
        await self.member.publish(self.model.name, valid, removed)
        self.pairs.sum_soon(valid)

        def backed(gi: int, j: int) -> bool:
            b = tables[gi][j]
            return b != NULL_BLOCK and (b in filled or self.requests.key_of.get(b) == keys[gi][j])

        limit = min(len(k) * g.block_size for k, g in zip(keys, self.plan.groups, strict=True))
        self.metrics.moved(self.model.name, "load", moved)
        return {
            "num_tokens": common_hit(self.managers, backed, limit),
            "loaded_blocks": sum(len(w) for w in written),
            "bytes": moved,
            "seconds": time.perf_counter() - t0,
        }

    async def _copy_blocks(self, gi: int, src: list[int], dst: list[int]) -> int:
        """Block ``dst[i]`` gets block ``src[i]``'s bytes on every rank, for the leading
        blocks whose bytes still match their checksums on every copy's writer (invariant
        12); returns how many. The first corrupt source is dropped (a miss)."""
        valid_sums, copy_of = self.requests.sums, self.ranks.copy_of

        def expected(r: int) -> list[int] | None:
            if r not in self.ranks.writers:
                return None
            c = copy_of[r]
            return [valid_sums[b][c] if b in valid_sums else -1 for b in src]

        sums = [valid_sums.get(b) for b in src]  # the bytes' checksums, read before any await
        n = await self.ranks.copy(gi, src, dst, expected)
        for s_, d in zip(sums[:n], dst[:n], strict=True):
            self.requests.pending_sums[d] = s_
        if n < len(src):
            self.requests.corrupt([src[n]])
            if self.requests.key_of.get(src[n]) is not None and valid_sums.get(src[n]) == sums[n]:
                await self.member.publish(self.model.name, [], self.requests.drop([src[n]]))
        return n

    async def _drop_unverified(self, blocks: list[list[int]]) -> None:
        """Blocks (per group) a load meant to fill that got no verified bytes: bytes that
        failed a check, or that only some ranks wrote, may have landed in them (a collective
        or peer batch lands before it is checked; ranks copy further than their common
        prefix; a scatter can fail partway). They leave the prefix map at once (no prefix
        hit, on any path, finds them) and are zeroed on every rank; a later store or load
        that writes them whole makes them findable again (``_validate``)."""
        flat = [b for ids in blocks for b in ids]
        if not flat:
            return
        self.bm.pool.uncache(flat)  # before anything awaits
        self.requests.unverified.update(flat)
        for b in flat:
            self.requests.pending_sums.pop(b, None)
        try:
            for gi, ids in enumerate(blocks):
                if ids:
                    zeros = torch.zeros((len(ids), self.ranks.widths[gi]), dtype=torch.uint8)
                    await self.ranks.scatter(gi, [zeros] * self.plan.tp_size, ids)
        except ServiceError as e:  # a rank died: the group retires, its KV goes with it
            log.warning("pool %s: cannot zero blocks %s (%s)", self.name, flat[:8], e)

    async def block_table(self, client: str, rid: Hashable) -> list[list[int]]:
        """The request's logical block ids per group now (null slots are 0)."""
        return self.bm.block_table(self.requests.mine(client, rid))

    async def free(self, client: str, rid: Hashable) -> None:
        self.bm.free(self.requests.mine(client, rid))
        self.requests.forget(rid)
        self.metrics.used(self.model.name, GPU, self.bm.pool.num_used_blocks)

    # --- serving other members ----------------------------------------------------------

    async def export_blocks(
        self, model: str, keys: list[bytes], out: np.ndarray | None = None
    ) -> tuple[int, np.ndarray, list[list[int]]]:
        """For ``raykv.transport``: the leading ``keys`` (one group) still valid here, as one
        buffer uint8 [distinct copies, count, row_bytes] plus their checksums per copy.
        ``out`` (a UCX server's spare buffer) is not used: the rows come off the pool's
        device in a buffer of the gather's own."""
        blocks = self.requests.exportable(model, keys)
        gid = key_group(keys[0]) if keys else None
        self.metrics.miss(model, GPU, len(keys) - len(blocks))
        writers = self.ranks.writers
        if not blocks:
            return 0, np.empty((len(writers), 0, 0), np.uint8), []
        # the checksums of the bytes the gather reads now, before anything may yield
        sums = [[self.requests.sums[b][c] for b in blocks] for c in range(len(writers))]
        rows = await self.ranks.gather(self.gindex[gid], blocks, writers)
        self.metrics.hit(model, GPU, len(blocks))
        self.metrics.moved(model, GPU, rows.numel())
        return len(blocks), export_rows(rows), sums

    async def drop_keys(self, model: str, keys: list[bytes]) -> None:
        """A reader found these blocks' bytes corrupt: unpublish them (misses from now; the
        reader counted them, ``checksum_errors`` "remote")."""
        valid = self.requests.valid
        bad = [valid[k] for k in keys if model == self.model.name and k in valid]
        if bad:
            log.warning("pool %s: a reader found blocks %s corrupt; dropped", self.name, bad[:8])
            await self.member.publish(model, [], self.requests.drop(bad))

    async def collective_export(
        self, model: str, keys: list[bytes], reader: dict[str, Any]
    ) -> tuple[int, list[list[int]], int, list[str]]:
        """The control call of a collective fetch (``Pairs.export``)."""
        return await self.pairs.export(model, keys, reader)

    async def peer_export(self, model: str, keys: list[bytes]) -> dict[str, Any] | None:
        """The control call of a peer read (``Pairs.peer_export``)."""
        return await self.pairs.peer_export(model, keys)

    async def release_peer_hold(self, token: int) -> None:
        """A peer reader is done with the blocks of hold ``token`` (a no-op once expired)."""
        await self.pairs.release_peer_hold(token)

    # --- membership (``Membership``: what it asks of the pool, ``Contents``) ---------------

    def snapshot(self) -> dict[str, Any]:
        return self.member.snapshot()

    async def watch(self, seconds: float) -> str | None:
        return await self.member.watch(seconds)

    def endpoints(self) -> dict[str, Any]:
        """Every transport this pool serves, with what a reader needs to reach it."""
        out = self.member.endpoints()
        for name, t in self.fetch.transports.items():
            if hasattr(t, "endpoint"):
                out[name] = t.endpoint()
        return out

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {self.model.name: [(h, b) for h, b in self.requests.valid.items()]}

    def extra_snapshot(self) -> dict[str, Any]:
        return {"model": self.model.name, "models": {self.model.name: (self.model, self.plan)}}

    def stats(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "tp_size": self.plan.tp_size,
            "ranks": [self.name, *self.rank_names],
            "blocks_total": self.bm.pool.num_usable_blocks,
            "blocks_used": self.bm.pool.num_used_blocks,
            "blocks_valid": len(self.requests.valid),
            "requests": len(self.requests.tokens),
            **self.metrics.tally,
        }

    async def get_stats(self) -> dict[str, Any]:
        return self.stats()

    async def kv_share(self, client: str) -> tuple[str, list[Any]]:
        """Rank 0's KV tensors for an engine process of this node (``Client.pool_kv``):
        ("shm", ``SharedSpec``s) on a CPU device (/dev/shm files, ``GpuKV.attach``), else
        ("cuda_ipc", torch's CUDA IPC handles, or with peer reads on the pool's ``PeerSpec``:
        ``GpuKV.open_handles`` opens either)."""
        kv = self.local.kv  # ``client``: the caller, as every pool call names it
        if kv.device.type == "cuda":
            return "cuda_ipc", kv.share_handles()
        return "shm", list(kv.shared_specs)

    async def rank_info(self) -> list[dict[str, Any]]:
        """Where each rank of the group runs (rank 0 first)."""
        me = {
            "name": self.name,
            "rank": 0,
            "device": self.device,
            "node_id": ray.get_runtime_context().get_node_id(),
            "bytes": self.local.kv.total_bytes,
        }
        return [me, *await self.ranks.remote([h.info.remote() for h in self.ranks.handles()])]
