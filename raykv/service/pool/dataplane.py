"""How a GPU pool's blocks move: offload to and load from the node's CPU tier through
``raykv.tiers`` jobs, fetches from other members through ``raykv.transport``, checksums on
every copy. ``GpuPool`` holds the two parts that move its bytes: ``TierIO`` (the node's CPU
tier) and ``Fetch`` (from wherever a block is held); its ``Requests`` keep the requests,
their epochs and the validity of blocks.

Where the invariants are kept:

* 9 (a block with a store in flight is not reused): ``TierIO.offload`` fences the job's GPU
  blocks in the pool's ``StoreFence`` (hooked to ``BlockManager.hold_blocks`` /
  ``release_blocks``) before its first await, and the rank engines' ``StoreJob`` fences them
  again while the copy runs; only when every writer rank finished is the fence lifted.
* 12 (copied bytes are checksum-verified before the block is readable): every valid block has
  the checksum (row sum) of each distinct TP copy (``Requests.sums``), taken from the rows
  ``store`` wrote, or carried over from the copy a load verified. A load from the node's CPU
  tier runs a ``LoadJob`` (the engine verifies each entry against the checksums its
  ``StoreJob`` computed); a fetch from another member verifies each chunk as it arrives,
  before a byte of it is scattered (``raykv.transport.receive``); a copy between two blocks
  of this pool verifies the source rows; an offload compares the arena rows' checksums with
  ``sums`` (a GPU block corrupted since it was published is never offloaded). A mismatch
  drops the bad copy where it lives (pool block invalidated, tier entry dropped), counts it
  once in ``checksum_errors`` (stats, ``raykv status``, the ``raykv_checksum_errors``
  metric), where it was found: "gpu" (a pool's own block), "cpu" (a tier entry loaded on its
  node: the tier counts it as it drops it), "remote" (a copy from another member: the reader
  counts it, the holder drops it uncounted), and is a miss: the caller recomputes, never
  reads wrong KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import ray

from raykv.blocks import BlockManager
from raykv.errors import TransportError
from raykv.service.control.index import CPU, GPU, Location
from raykv.service.control.metrics import ARENA, ServiceMetrics
from raykv.service.groups import Chunk
from raykv.service.member import Publish
from raykv.service.pool.fanout import Ranks
from raykv.service.pool.pairs import Pairs
from raykv.service.pool.rank import RankKV
from raykv.service.pool.requests import Requests
from raykv.service.served import COORDINATOR, NAMESPACE, ServedModel, tier_name
from raykv.tiers import holds
from raykv.tiers.jobs import LoadJob, StoreJob
from raykv.transport import FALLBACK, BlockBatch, Fetched, Transport, fetch_over

log = logging.getLogger(__name__)


class _Freed(Exception):
    """A load's request was freed while its rows travelled: the fetch stops."""


class TierIO:
    """Pool ``name``'s copies to and from its node's CPU tier: ``offload`` (complete chunks
    of valid blocks, every distinct TP copy written by its rank's ``StoreJob`` straight into
    the shared arena) and ``load`` (a rank's ``LoadJob`` each, verified by the engine). What
    becomes unpublished goes out through ``publish``."""

    def __init__(
        self,
        name: str,
        model: ServedModel,
        plan: Any,
        node_id: str,
        local: RankKV,
        ranks: Ranks,
        requests: Requests,
        bm: BlockManager,
        metrics: ServiceMetrics,
        publish: Publish,
    ) -> None:
        from raykv.tiers.fence import StoreFence

        self.name, self.model, self.plan, self.node_id = name, model, plan, node_id
        self.local, self.ranks, self.requests = local, ranks, requests
        self.metrics, self.publish = metrics, publish
        self.gids = [g.group_id for g in plan.groups]
        # invariant 9: a fenced block keeps a block-manager reference until its store is done
        self.fence = StoreFence(hold=bm.hold_blocks, release=bm.release_blocks)
        self._fences = 0

    def _tier(self) -> Any:
        return ray.get_actor(tier_name(self.node_id), namespace=NAMESPACE)

    async def _apply(self, tier: Any, ops: list[tuple]) -> int:
        return await tier.apply.remote(self.model.name, ops) if ops else 0

    # --- GPU -> CPU tier ------------------------------------------------------------------

    def _store_job(self, chunks: list[Chunk]) -> tuple[StoreJob, tuple] | None:
        ready = [c for c in chunks if all(m is None or m in self.requests.valid for m in c.members)]
        if not ready:
            return None
        keys, kgroups, widths, ids, sizes, slots, members = [], [], [], [], [], [], []
        for gi in range(len(self.gids)):
            n = 0
            for c in (c for c in ready if c.group == gi):
                k = len(keys)
                keys.append(c.key)
                kgroups.append(self.gids[gi])
                widths.append(len(c.members))
                members.append(c.members)
                for s, m in enumerate(c.members):
                    if m is not None:
                        ids.append(self.requests.valid[m])
                        slots.append((k, s))
                        n += 1
            sizes.append(n)
        job = StoreJob(
            "offload", tuple(keys), tuple(kgroups), tuple(widths), tuple(ids), tuple(sizes),
            tuple(slots),
        )  # fmt: skip
        return job, tuple(members)

    def _corrupt_in(
        self, job: StoreJob, ops: list[tuple], copy: int, published: dict[int, Any]
    ) -> set[int]:
        """GPU blocks whose rows a writer just stored differ from the checksums they were
        published with (corrupted since): the store must not land."""
        bad: set[int] = set()
        for op in ops:
            if op[0] != "finish_store" or op[4] is None:
                continue
            res, sums = op[1], op[4]
            at = {k: i for i, k in enumerate(res.keys)}
            for b, (k, s) in zip(job.block_ids, job.slots, strict=True):
                i = at.get(job.keys[k])
                want = published.get(b)
                if i is not None and (want is None or sums[i][s] != want[copy]):
                    bad.add(b)
        return bad

    async def offload(self, chunks: list[Chunk]) -> int:
        """Copy complete chunks whose real blocks are all valid here to the node's CPU tier
        (every distinct TP copy, each written by its rank's ``StoreJob`` straight into the
        shared arena). Returns the entries newly stored; 0 when there is no tier or no room
        (a miss later, never wrong KV)."""
        built = self._store_job(chunks)
        if built is None:
            return 0
        job, members = built
        self._fences += 1
        fence_id = ("offload", self._fences)
        self.fence.fence(fence_id, job.block_ids)  # before the first await (invariant 9)
        published = {b: self.requests.sums.get(b) for b in job.block_ids}
        try:
            try:
                tier = self._tier()
                arena, res = await tier.reserve.remote(
                    self.model.name, job.keys, members, len(self.ranks.writers),
                    holds.this_process(self.name),
                )  # fmt: skip
            except (ray.exceptions.RayError, ValueError) as e:  # no tier: a miss later
                log.warning("pool %s: no CPU tier to offload to (%s)", self.name, e)
                self.metrics.copy_failed(self.model.name, CPU, "offload")
                return 0
            if res is None:
                return 0
            handles = self.ranks.handles()
            refs = [
                handles[r - 1].store_job.remote(arena, job, res) for r in self.ranks.writers if r
            ]
            ops = self.local.store_job(arena, job, res) if 0 in self.ranks.writers else []
            per_rank = (
                [ops, *await self.ranks.remote(refs)]
                if 0 in self.ranks.writers
                else [*await self.ranks.remote(refs)]
            )
            bad: set[int] = set()
            for c, rank_ops in enumerate(per_rank):
                bad |= self._corrupt_in(job, rank_ops, c, published)
            if bad:  # fail every writer's store: the entries go back to free
                self.requests.corrupt(sorted(bad))
                per_rank = [
                    [(*op[:2], False, *op[3:]) if op[0] == "finish_store" else op for op in r]
                    for r in per_rank
                ]
            try:
                n = await self._apply(tier, [op for r in per_rank for op in r])
            except ray.exceptions.RayError as e:  # the tier died since it reserved: a miss
                log.warning("pool %s: the CPU tier went away mid-offload (%s)", self.name, e)
                self.metrics.copy_failed(self.model.name, CPU, "offload")
                n = 0
        finally:
            self.fence.release(fence_id)
        if bad:
            await self.publish(
                self.model.name, [], self.requests.gone([self.requests.invalidate(b) for b in bad])
            )
        self.metrics.offloaded(self.model.name, n)
        return n

    # --- CPU tier -> GPU ------------------------------------------------------------------

    async def load(
        self, gi: int, want: list[tuple[bytes, int]], filled: set[int], live: Callable[[], bool]
    ) -> int:
        """Fill the leading blocks of ``want`` (key, our block) from the node's CPU tier: one
        ``LoadJob`` per rank on the shared arena, verified by the engine. Returns bytes."""
        tier = self._tier()
        arena, lease, chosen = await tier.lease.remote(
            self.model.name, [k for k, _ in want], holds.this_process(self.name)
        )
        if lease is None:
            return 0
        if not live():  # freed while we waited: our blocks may be someone else's now
            await self._apply(tier, [("finish_load", lease, 0)])
            return 0
        f = max(1, self.plan.block_size_factor)
        sizes = [0] * len(self.gids)
        sizes[gi] = len(chosen)
        job = LoadJob(
            "load", lease.keys, (self.gids[gi],) * len(lease.keys), (f,) * len(lease.keys),
            tuple(b for _, b in want[: len(chosen)]), tuple(sizes), tuple(chosen),
        )  # fmt: skip
        handles = self.ranks.handles()
        refs = [h.load_job.remote(arena, job, lease) for h in handles]
        missed, ops = self.local.load_job(arena, job, lease)
        lost = set(missed)
        for m, rank_ops in await self.ranks.remote(refs):
            lost |= set(m)
            ops += [op for op in rank_ops if op[0] == "drop"]  # one finish_load: the leader's
        # corrupt entries are dropped by these ops and counted once, by the tier ("cpu")
        await self._apply(tier, ops)
        # every rank loaded the same prefix of keys, unless one missed: keep the common one
        n = 0
        for e, _ in chosen:
            if lease.keys[e] in lost:
                break
            n += 1
        got = want[:n]
        for (e, s), (_, b) in zip(chosen[:n], got, strict=True):
            self.requests.pending_sums[b] = tuple(
                c[s] for c in _copies(lease.checksums[e], len(self.ranks.writers))
            )
        filled.update(b for _, b in got)
        width = self.local.widths[gi]
        return n * width * len(self.ranks.writers)


class Fetch:
    """Pool ``name``'s reads of blocks it does not hold: located at the coordinator, from
    the node's CPU tier (``tier_io``) or another member over the route the coordinator
    chose (``transports``, by name; ``fetch_over`` runs a direct route through ``pairs``), verified
    chunk by chunk, scattered to every rank."""

    def __init__(
        self,
        name: str,
        model: ServedModel,
        node_id: str,
        ranks: Ranks,
        requests: Requests,
        tier_io: TierIO,
        pairs: Pairs,
        metrics: ServiceMetrics,
        transports: dict[str, Transport],
    ) -> None:
        self.name, self.model, self.node_id = name, model, node_id
        self.ranks, self.requests, self.tier_io, self.pairs = ranks, requests, tier_io, pairs
        self.metrics, self.transports = metrics, transports

    async def fetch(
        self, rid: Hashable, gen: int | None, gi: int, want: list[tuple[bytes, int]], filled: set
    ) -> int:
        """Copy the blocks of ``want`` (key, our block) from wherever they are held: the
        node's CPU tier through the shared arena, other members through the transport."""
        try:
            coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
            where = (
                await coord.locate.remote(
                    self.model.name, [k for k, _ in want], self.node_id, self.name
                )
            ).copies
        except (ray.exceptions.RayError, ValueError) as e:  # coordinator restarting: a miss
            log.warning("pool %s: cannot locate copies (%s); loading nothing", self.name, e)
            self.metrics.copy_failed(self.model.name, GPU, "locate")
            return 0
        failed: set[str] = {self.name}
        moved, i = 0, 0

        def live() -> bool:
            return self.requests.live(rid, gen)

        while i < len(want):
            loc = next((c for c in where[i] if c.member not in failed), None)
            if loc is None:
                i += 1  # nobody (else) holds it: a miss; later slots may still be needed
                continue
            run = i
            # the run of blocks this member also holds (its copies share one Location)
            while run < len(want) and loc in where[run]:
                run += 1
            batch = want[i:run]
            before = len(filled)
            try:
                if loc.node_id == self.node_id and loc.tier == CPU:
                    nbytes = await self.tier_io.load(gi, batch, filled, live)
                    self.metrics.fetched(self.model.name, ARENA, nbytes)
                    moved += nbytes
                    n = len(filled) - before
                else:
                    n, nbytes = await self._from_member(loc, gi, batch, filled, live)
                    moved += nbytes
            except (ray.exceptions.RayActorError, ValueError, TransportError) as e:  # gone
                log.warning("pool %s: copy source %s failed (%s)", self.name, loc.member, e)
                failed.add(loc.member)
                try:
                    await coord.member_failed.remote(loc.member)
                except ray.exceptions.RayError as e2:
                    log.warning("pool %s: cannot report %s (%s)", self.name, loc.member, e2)
                continue
            if not self.requests.live(rid, gen):  # freed: our blocks may be someone else's now
                return moved
            if n < len(batch):
                failed.add(loc.member)  # it lost (or corrupted) the rest; try the next copy
            i += n
        return moved

    async def _from_member(
        self,
        loc: Location,
        gi: int,
        want: list[tuple[bytes, int]],
        filled: set[int],
        live: Callable[[], bool],
    ) -> tuple[int, int]:
        """One batch from another member over its route (``fetch_over``): a direct one rank to
        rank into our blocks (``Pairs``), a streamed one chunk by chunk, each chunk verified,
        then scattered to every rank while the next one travels; ``live()`` is checked before
        every chunk is written (a freed request's blocks may be someone else's). A corrupt
        block is counted here, once, and dropped at the holder."""
        source = loc.member

        def fell_back(name: str, e: TransportError, then: str) -> None:
            log.warning("pool %s: %s from %s failed (%s); retrying over %s",
                        self.name, name, source, e, then)  # fmt: skip
            self.metrics.failed(f"transport_{name}")

        def carried(name: str, nbytes: int) -> None:
            self.metrics.fetched(self.model.name, name, nbytes)

        async def direct(name: str, endpoint: Any) -> Fetched:  # rank to rank into our blocks
            route = replace(loc, transport=name, endpoint=endpoint)
            return await self.pairs.fetch(route, gi, want, filled, live)

        written = [0, 0]  # blocks, bytes

        async def sink(at: int, chunk: BlockBatch) -> None:
            if not live():  # freed while the rows travelled: stop, write nothing more
                raise _Freed
            blocks = [b for _, b in want[at : at + chunk.count]]
            await self.ranks.scatter_copies(gi, chunk.rows, blocks)
            for j, b in enumerate(blocks):
                self.requests.pending_sums[b] = tuple(c[j] for c in chunk.checksums)
            filled.update(blocks)
            written[0], written[1] = written[0] + chunk.count, written[1] + chunk.nbytes

        try:
            got = await fetch_over(self.transports, loc.transport, source, self.model.name,
                                   [k for k, _ in want], sink, loc.endpoint, fell_back,
                                   direct=direct, carried=carried)  # fmt: skip
        except _Freed:
            return written[0], written[1]
        if got.corrupt:  # the source's copy is corrupt: a miss, dropped there
            self.metrics.checksum_errors(self.model.name, "remote", 1)
            log.warning("pool %s: block from %s failed its checksum; a miss", self.name, source)
            try:
                await (
                    self.transports[FALLBACK]
                    .actor(source)
                    .drop_keys.remote(self.model.name, [want[got.count][0]])
                )
            except ray.exceptions.RayError as e:
                log.warning("pool %s: cannot tell %s to drop (%s)", self.name, source, e)
        return got.count, got.nbytes


def _copies(per_copy: dict[int, tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    return [per_copy[c] for c in range(n)]
