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

The bytes move in ``raykv.service.pool.dataplane`` (``PoolDataPlane``, mixed in here): offload and
load through ``raykv.tiers`` jobs on the node's shared arena, fetches through
``raykv.transport``, a checksum for every valid block (``sums``; invariants 9 and 12 are
kept there). This module keeps requests, their epochs and the validity of blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import ray
import torch

from raykv.api import StoreResult, check_token_count
from raykv.errors import AccessDenied, InvalidInput, ServiceError
from raykv.layout import tp
from raykv.service.control.index import GPU
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.groups import (
    Chunk,
    check_servable,
    common_hit,
    complete_chunks,
    group_keys,
    key_group,
    managers,
    per_group,
    row_widths,
)
from raykv.service.member import Member
from raykv.service.pool.dataplane import PoolDataPlane
from raykv.service.pool.fanout import TpFanOut
from raykv.service.pool.pairs import CollectivePlane
from raykv.service.pool.rank import RankKV
from raykv.service.pool.rows import RankRows, as_rank_rows
from raykv.service.served import NAMESPACE, ServedModel, tier_name
from raykv.tiers.checksum import row_checksums
from raykv.tiers.jobs import NULL_BLOCK

log = logging.getLogger(__name__)
WRITE_WAIT_S = 30.0  # the longest a store or read waits for another call writing its blocks


class GpuPool(TpFanOut, CollectivePlane, PoolDataPlane, Member):
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
        from raykv.blocks import BlockManager

        super().__init__(name, node_id)
        check_servable(plan)
        if len(ranks) != plan.tp_size - 1:
            raise ServiceError(
                f"pool {name!r}: tp_size={plan.tp_size} needs {plan.tp_size - 1} other ranks, "
                f"got {len(ranks)}"
            )
        self.model, self.plan, self.device = model, plan, device
        self.bm = BlockManager(plan, enable_prefix_caching=True)
        self.local = RankKV(plan, device, 0)  # rank 0
        self.rank_names = list(ranks)
        self._rank_handles: list[Any] | None = None
        self._leaving: asyncio.Task | None = None  # set once a rank died (see _retire)
        self.gids = [g.group_id for g in plan.groups]
        self.gindex = {gid: i for i, gid in enumerate(self.gids)}
        self.widths = row_widths(plan)
        self.managers = managers(plan)
        self.copy_of = tp.copy_ranks(plan)
        self.writers = tp.writer_ranks(plan)
        self.tokens: dict[Hashable, list[int]] = {}
        # admission number of each live request: a call that awaited checks it is still the
        # same request (a free and a re-admit under the same id hand its blocks to others)
        self._gen: dict[Hashable, int] = {}
        # The client that admitted each live request: only it may step, write, load, read or
        # free it. (Ray's token keeps strangers out of the cluster; this keeps the engines
        # in it from touching each other's requests, e.g. through a reused request id.)
        self.owner: dict[Hashable, str] = {}
        self._admitted = 0
        self._hashes: dict[Hashable, list[bytes]] = {}
        # per request, its group keys as of that many hashes (a load or store asks twice)
        self._group_keys: dict[Hashable, tuple[int, list[list[bytes]]]] = {}
        self.valid: dict[bytes, int] = {}  # group key -> block holding its bytes
        self.key_of: dict[int, bytes] = {}
        self.chunk_of: dict[bytes, Chunk] = {}  # valid key -> a complete chunk it is part of
        self._writing: set[int] = set()  # blocks a store or load is writing now
        self._written: tuple[Any, asyncio.Condition] | None = None  # (loop, its condition)
        # checksums of bytes written into blocks not yet valid (moved to sums on validation)
        self._pending_sums: dict[int, tuple[int, ...]] = {}
        # blocks a load meant to fill that got no verified bytes: out of the block manager's
        # prefix map (no prefix hit finds them) and zeroed, until a write makes them whole
        self._unverified: set[int] = set()
        self.metrics = ServiceMetrics("pool")
        self._init_dataplane()

    async def start(self) -> str:
        tier = ray.get_actor(tier_name(self.node_id), namespace=NAMESPACE)
        await tier.add_model.remote(self.model.name, self.plan)
        return await super().start()

    # --- helpers ------------------------------------------------------------------------
    # The engine-facing calls take their arguments as ``raykv.client`` checked them
    # (``raykv.api``: request ids, counts, token ids and block ids of the right types and
    # forms) and check only what the pool alone can: ownership (``_mine``, ``_own_blocks``,
    # ``read``'s published-or-mine), the plan's limits and a request's state.

    def _ids(self, ids: list[int] | None, rid: Hashable = None) -> list[int] | None:
        """The request's token ids (a list of ints: the client checked them), within the
        model's length; those of a known request must extend the ones it had."""
        if ids is None:
            return None
        check_token_count(len(ids), self.plan.max_model_len, self.model.name)
        known = self.tokens.get(rid)
        n = min(len(known), len(ids)) if known is not None else 0
        if n and known[:n] != ids[:n]:
            at = next(i for i in range(n) if known[i] != ids[i])
            raise InvalidInput(
                f"token_ids of request {rid!r} differ at position {at} from the {len(known)} "
                "it was given before; a request's tokens only grow (free it and admit the new "
                "prompt under a new request id)"
            )
        return ids

    def _mine(self, client: str, rid: Hashable) -> Hashable:
        """``rid`` if no other client admitted it (else AccessDenied)."""
        owner = self.owner.get(rid)
        if owner is not None and owner != client:
            raise AccessDenied(
                f"request {rid!r} on pool {self.name!r} was admitted by another client; a "
                "request belongs to the handle that admitted it (and the handles it is pickled "
                "to): use that handle, or a request id of your own"
            )
        return rid

    def _live(self, rid: Hashable, gen: int | None) -> bool:
        return gen is not None and self._gen.get(rid) == gen

    def _keys(self, rid: Hashable) -> list[list[bytes]]:
        """Per group, the key of each full block of the request's known tokens (read-only:
        kept until the request's tokens grow)."""
        tokens = self.tokens.get(rid, [])
        hashes = self._hashes.setdefault(rid, [])
        hbs = self.bm.hasher.hash_block_size
        if len(tokens) // hbs > len(hashes):
            hashes += self.bm.hasher.hash_blocks(
                tokens, first_block=len(hashes), parent=hashes[-1] if hashes else None
            )
        known = self._group_keys.get(rid)
        if known is None or known[0] != len(hashes):
            known = self._group_keys[rid] = (len(hashes), group_keys(self.plan, hashes))
        return known[1]

    def _immutable(self, block: int) -> bool:
        """A block nobody may write now: it holds published bytes (valid), or another call
        is writing it."""
        return block in self.key_of or block in self._writing

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._written is None or self._written[0] is not loop:
            self._written = (loop, asyncio.Condition())
        return self._written[1]

    async def _settle(self, blocks: set[int]) -> None:
        """Wait until no other call is writing ``blocks`` (a request sharing a prefix block
        with one whose load or store is filling it): a store then sees whether those bytes
        were published, and a read never returns them half-written. Bounded: after
        ``WRITE_WAIT_S`` the caller goes on as before (the block counts as being written)."""
        if not blocks & self._writing:
            return
        cond = self._condition()
        async with cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    cond.wait_for(lambda: not blocks & self._writing), WRITE_WAIT_S
                )

    async def _done_writing(self, busy: set[int]) -> None:
        self._writing -= busy
        if busy and self._written is not None:
            cond = self._condition()
            async with cond:
                cond.notify_all()

    def _cached_as(self, block: int, key: bytes) -> bool:
        return self.bm.pool.block_keys[block] == (key_group(key), key[4:])

    def _invalidate(self, block: int) -> bytes | None:
        self.sums.pop(block, None)
        self.wire_sums.pop(block, None)
        key = self.key_of.pop(block, None)
        if key is not None and self.valid.get(key) == block:
            del self.valid[key]
            self.chunk_of.pop(key, None)
        return key

    def _gone(self, keys: list[bytes | None]) -> list[bytes]:
        """The keys no block here holds any more (a KV event's ``removed``)."""
        return [k for k in dict.fromkeys(keys) if k is not None and k not in self.valid]

    def _validate(
        self, rid: Hashable, written: list[list[int]]
    ) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """Mark written blocks valid where the block manager caches them under their
        position's key. Returns the newly valid (key, block) pairs and the keys that
        blocks re-keyed here held before and no block holds now."""
        tables, keys = self.bm.block_table(rid), self._keys(rid)
        out, old = [], []
        for gi, ids in enumerate(written):
            pos = {b: j for j, b in enumerate(tables[gi]) if b != NULL_BLOCK}
            for b in ids:
                j = pos[b]
                if j >= len(keys[gi]):
                    continue
                key = keys[gi][j]
                if b in self._unverified:  # written whole now: findable again, under its key
                    self._unverified.discard(b)
                    parent = keys[gi][j - 1][4:] if j else None
                    group = self.plan.groups[gi]
                    self.bm.pool.cache(group.group_id, [key[4:]], [b], parent, group.block_size)
                # one published block per key: a duplicate (the block pool keeps those
                # findable, its bytes may be a different computation of the same tokens)
                # stays private while another block serves the key
                held = self.valid.get(key)
                if held is not None and held != b:
                    continue
                if self._cached_as(b, key) and self.key_of.get(b) != key:
                    old.append(self._invalidate(b))
                    self.valid[key], self.key_of[b] = b, key
                    if (sums := self._pending_sums.pop(b, None)) is not None:
                        self.sums[b] = sums
                    out.append((key, b))
        for chunk in complete_chunks(self.plan, tables, keys):
            for m in chunk.members:
                if m is not None and m in self.valid:
                    self.chunk_of[m] = chunk
        return out, self._gone(old)

    def _own_blocks(self, rid: Hashable, tables: list[list[int]]) -> None:
        """Every non-null id must be in the request's table of its group, once. Ids are the
        plain ints the client sends: a look-alike (True, 3.0) would equal an id of the table
        and mean something else to a copy, so it is in no table."""
        have = self.bm.block_table(rid)
        for gi, ids in enumerate(tables):
            real = [b for b in ids if b != NULL_BLOCK]
            table = set(have[gi])
            bad = [b for b in real if type(b) is not int or b not in table]
            where = f" (group {gi})" if len(tables) > 1 else ""
            if bad:
                raise InvalidInput(
                    f"blocks {bad[:8]} are not in request {rid!r}'s block table{where} (it "
                    f"holds {len(have[gi])} blocks); pass ids that allocate returned for it"
                )
            if len(set(real)) != len(real):
                raise InvalidInput(f"block ids {real[:8]}...{where} hold duplicates")

    # --- engine-facing ------------------------------------------------------------------

    async def admit(
        self, client: str, rid: Hashable, num_tokens: int, token_ids: list[int] | None = None
    ) -> bool:
        rid = self._mine(client, rid)
        ids = self._ids(token_ids, rid)
        ok = self.bm.admit(rid, num_tokens, ids)
        if ok:
            self._admitted += 1
            self._gen[rid] = self._admitted
            self.owner[rid] = client
            if ids is not None:
                self.tokens[rid] = ids
        return ok

    async def blocks_needed(
        self, client: str, rid: Hashable, num_new_tokens: int, token_ids: list[int] | None = None
    ) -> int:
        rid = self._mine(client, rid)
        return self.bm.blocks_needed(rid, num_new_tokens, self._ids(token_ids, rid))

    async def allocate(
        self,
        client: str,
        rid: Hashable,
        num_new_tokens: int,
        token_ids: list[int] | None = None,
    ) -> list[list[int]] | None:
        rid = self._mine(client, rid)
        ids = self._ids(token_ids, rid)
        new = self.bm.allocate(rid, num_new_tokens, ids)
        if new is None:
            return None
        if ids is not None:
            self.tokens[rid] = ids
        self._unverified.difference_update(b for table in new for b in table)  # fresh owners
        self.bm.drain_events()  # our index is ``valid``: only written blocks count
        # Blocks whose cached prefix the manager evicted to make this step fit: their bytes
        # are still intact (nobody wrote them yet), so offload their chunks first.
        evicted = [
            b
            for table in new
            for b in table
            if b in self.key_of and not self._cached_as(b, self.key_of[b])
        ]
        if evicted:
            chunks = {c.key: c for b in evicted if (c := self.chunk_of.get(self.key_of[b]))}
            await self._offload(list(chunks.values()))
            keys = self._gone([self._invalidate(b) for b in evicted])
            self.metrics.evicted(self.model.name, GPU, len(evicted))
            await self.publish(self.model.name, [], keys)
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
        rid = self._mine(client, rid)
        tables = per_group(self.plan, block_ids)
        self._own_blocks(rid, tables)
        data: RankRows = as_rank_rows(self.plan, rows, tables, self.widths)
        real = [[b for b in t if b != NULL_BLOCK] for t in tables]
        gen = self._gen.get(rid)
        await self._settle({b for ids in real for b in ids})
        if not self._live(rid, gen):  # freed while we waited: its blocks may be others' now
            return StoreResult(0, 0, [[] for _ in real])
        keep = [[i for i, b in enumerate(ids) if not self._immutable(b)] for ids in real]
        written = [[ids[i] for i in k] for ids, k in zip(real, keep, strict=True)]
        skipped = [[b for b in ids if self._immutable(b)] for ids in real]
        num_written = sum(len(w) for w in written)
        busy = {b for ids in written for b in ids}
        self._writing |= busy
        try:
            for gi, ids in enumerate(written):
                if not ids:
                    continue
                sel = None if len(ids) == len(real[gi]) else torch.tensor(keep[gi])
                per_rank = [data[r][gi] for r in range(self.plan.tp_size)]
                if sel is not None:
                    per_rank = [x[sel] for x in per_rank]
                # invariant 12: the checksum of each distinct copy, from the rows written
                sums = [row_checksums(per_rank[r]) for r in self.writers]
                for j, b in enumerate(ids):
                    self._pending_sums[b] = tuple(c[j] for c in sums)
                await self._scatter(gi, per_rank, ids)
        finally:
            await self._done_writing(busy)
        if not self._live(rid, gen):  # freed meanwhile: its blocks may be someone else's
            return StoreResult(0, num_written, skipped)
        stored, removed = self._validate(rid, written)
        await self.publish(self.model.name, stored, removed)
        self._sum_soon(stored)
        if offload and self._live(rid, gen):
            keys = self._keys(rid)
            await self._offload(complete_chunks(self.plan, self.bm.block_table(rid), keys))
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
        await self._settle({b for t in tables for b in t})  # never bytes half-written
        mine = [set() for _ in tables]
        for rid in (r for r, c in self.owner.items() if c == client):
            for gi, table in enumerate(self.bm.block_table(rid)[: len(tables)]):
                mine[gi].update(table)
        # published blocks are anyone's to load, so anyone's to read; the rest is private
        private = [b for gi, t in enumerate(tables) for b in t if b not in mine[gi]]
        foreign = [b for b in private if b not in self.key_of]
        if foreign:
            raise AccessDenied(
                f"blocks {foreign[:8]} are neither published nor in this client's live requests "
                f"on pool {self.name!r}; read your own requests' blocks (load a published prefix "
                "into them to read what others computed)"
            )
        return [(await self._gather(gi, t, [rank]))[0].numpy() for gi, t in enumerate(tables)]

    async def load(self, client: str, rid: Hashable, token_ids: list[int], into: list) -> dict:
        """Fill ``into`` (blocks of this request's tables, per group) with the KV of their
        positions from the best copies in the cluster; copies that vanished, and slots
        nobody holds (e.g. out of a sliding window), are misses. Returns the request's
        leading tokens now backed by written KV in every group."""
        t0 = time.perf_counter()
        rid = self._mine(client, rid)
        ids = self._ids(token_ids, rid)
        into_tables = per_group(self.plan, into)
        self._own_blocks(rid, into_tables)
        gen = self._gen.get(rid)
        nothing = {"num_tokens": 0, "loaded_blocks": 0, "bytes": 0, "seconds": 0.0}
        if ids is not None and len(ids) > len(self.tokens.get(rid, [])):
            self.tokens[rid] = ids
        tables, keys = self.bm.block_table(rid), self._keys(rid)
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
            todo.append(sorted((pos[b], b) for b in real if not self._immutable(b)))
        filled: set[int] = set()
        moved = 0
        busy = {b for want in todo for _, b in want}
        self._writing |= busy
        # held while the load writes them: freed meanwhile, they reach nobody else before
        # their bytes are verified or dropped (``_drop_unverified``)
        self.bm.pool.touch(busy)
        try:
            for gi, want in enumerate(todo):
                # 1) another block of this pool already holds the bytes
                local = [(j, b) for j, b in want if keys[gi][j] in self.valid]
                if local:
                    src = [self.valid[keys[gi][j]] for j, _ in local]
                    n = await self._copy_blocks(gi, src, [b for _, b in local])
                    filled.update(b for _, b in local[:n])
                # 2) the node's CPU tier or another node, best copy first
                rest = [(keys[gi][j], b) for j, b in want if b not in filled]
                if rest:
                    moved += await self._fetch(rid, gen, gi, rest, filled)
                if not self._live(rid, gen):  # freed meanwhile: nothing to publish
                    return nothing | {"bytes": moved}
        finally:
            try:
                await self._drop_unverified([[b for _, b in want if b not in filled]
                                             for want in todo])  # fmt: skip
            finally:
                await self._done_writing(busy)
                self.bm.pool.free(busy)
        written = [[b for b in t if b in filled] for t in into_tables]
        valid, removed = self._validate(rid, written)
        await self.publish(self.model.name, valid, removed)
        self._sum_soon(valid)

        def backed(gi: int, j: int) -> bool:
            b = tables[gi][j]
            return b != NULL_BLOCK and (b in filled or self.key_of.get(b) == keys[gi][j])

        limit = min(len(k) * g.block_size for k, g in zip(keys, self.plan.groups, strict=True))
        self.metrics.moved(self.model.name, "load", moved)
        return {
            "num_tokens": common_hit(self.managers, backed, limit),
            "loaded_blocks": sum(len(w) for w in written),
            "bytes": moved,
            "seconds": time.perf_counter() - t0,
        }

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
        self._unverified.update(flat)
        for b in flat:
            self._pending_sums.pop(b, None)
        try:
            for gi, ids in enumerate(blocks):
                if ids:
                    zeros = torch.zeros((len(ids), self.widths[gi]), dtype=torch.uint8)
                    await self._scatter(gi, [zeros] * self.plan.tp_size, ids)
        except ServiceError as e:  # a rank died: the group retires, its KV goes with it
            log.warning("pool %s: cannot zero blocks %s (%s)", self.name, flat[:8], e)

    async def block_table(self, client: str, rid: Hashable) -> list[list[int]]:
        """The request's logical block ids per group now (null slots are 0)."""
        return self.bm.block_table(self._mine(client, rid))

    async def free(self, client: str, rid: Hashable) -> None:
        self.bm.free(self._mine(client, rid))
        self.owner.pop(rid, None)
        self.tokens.pop(rid, None)
        self._hashes.pop(rid, None)
        self._group_keys.pop(rid, None)
        self._gen.pop(rid, None)
        self.metrics.used(self.model.name, GPU, self.bm.pool.num_used_blocks)

    # --- membership ---------------------------------------------------------------------

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {self.model.name: [(h, b) for h, b in self.valid.items()]}

    def extra_snapshot(self) -> dict[str, Any]:
        return {"model": self.model.name, "models": {self.model.name: (self.model, self.plan)}}

    def stats(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "tp_size": self.plan.tp_size,
            "ranks": [self.name, *self.rank_names],
            "blocks_total": self.bm.pool.num_usable_blocks,
            "blocks_used": self.bm.pool.num_used_blocks,
            "blocks_valid": len(self.valid),
            "requests": len(self.tokens),
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
        return [me, *await self._remote([h.info.remote() for h in self._ranks()])]
