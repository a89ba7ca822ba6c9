"""An engine's KV tensors attached to its node's CPU tier through shared memory.

``AttachedKV`` maps the tier's arena (``/dev/shm``, ``CpuTierView``) into the engine's own
process and runs the same ``raykv.tiers.OffloadEngine`` jobs the pools run: a store is one
paged copy from the engine's blocks into the arena (``StoreJob``, checksums computed) and a
load one paged copy back (``LoadJob``, checksums verified first: a corrupt entry is a miss,
dropped and counted, never copied, invariant 12). Around each copy go two small messages to
the node agent (``raykv.engine.agent``, a local socket; no Ray in this process) carrying
keys, block numbers and checksums: one round trip before it (``Reserve`` / ``LeaseGroups``,
whose answer also names the arena) and one after it that is not waited for (``Apply``: the
agent answers a connection's requests in order, so the next request sees it applied;
``flush`` waits for every apply sent). No KV byte is pickled. Entries stored this way are
published like any pool's offload, so every node's lookup and load finds them.

The engine keeps its own blocks: a block passed to ``store_from`` must not be rewritten until
the call returns (it is synchronous; on CUDA it waits for the copy). Every lease and
reservation belongs to the agent connection: when the engine detaches (``close``) or its
process ends, the agent releases them at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raykv.blocks.hashing import BlockHasher, Tenant
from raykv.engine.agent import EngineCounts, NodeAgent
from raykv.errors import InvalidInput, RaykvError
from raykv.service.groups import as_tables, complete_chunks, factors, group_keys
from raykv.service.node import agent_protocol as p
from raykv.tiers.cpu_tier import CpuTierView, LoadLease, int_array
from raykv.tiers.gpu_kv import GpuKV
from raykv.tiers.jobs import JobArrays, LoadJob, StoreJob, slots_of
from raykv.tiers.offload import JobResult, OffloadEngine

log = logging.getLogger(__name__)
PULL_TIMEOUT_S = 60.0  # a pull crosses nodes: as long as a transport may take
# A store or load moves in pieces of at most this much (the first a quarter of it, each next
# twice the one before), the node agent's bookkeeping of the next piece (a round trip)
# running beside the copy of this one: 128 MiB is ~2.4 ms over PCIe 5, longer than the agent
# takes for its 256 blocks of 512 KiB.
PIECE_BYTES = 128 << 20


@dataclass(frozen=True)
class TierLease:
    """Read references the node's CPU tier holds for this engine on its copies of a prompt's
    blocks: per group, the blocks from position ``first[g]`` on that it holds, as a
    ``LoadLease`` on their entries and, per block, (entry index in it, sub-slot): ``chosen[g]``,
    int64 ``[blocks, 2]`` (arrays: a 2048-block lease pickles as one buffer). Until
    released the entries stay readable (never evicted), unless the tier reclaims them
    (``RAYKV_LEASE_TIMEOUT_S`` after the lease, or at once when the engine detaches): a load
    of them is then a miss."""

    spec: Any  # the arena's SharedSpec
    first: tuple[int, ...]
    leases: tuple[LoadLease | None, ...]
    chosen: tuple[np.ndarray, ...]

    def blocks(self, group: int) -> int:
        """Leading blocks of group ``group`` held: the caller's own ``first``, then the tier's."""
        return self.first[group] + len(self.chosen[group])


class AttachedKV:
    """``store_from`` / ``load_into`` between an engine's paged KV and its node's tier."""

    def __init__(
        self,
        model: str,
        plan: Any,
        agent: NodeAgent,
        tensors: Mapping | None = None,
        *,
        num_blocks: int | None = None,
        layout: str = "kv_outer",
        device: str = "cpu",
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        if plan.tp_size != 1:
            raise InvalidInput(
                f"attach serves tp_size=1 engines (this model has tp_size={plan.tp_size}); "
                "use store/load with rows per rank"
            )
        if num_blocks is not None:  # the engine's own pool: its block count, the model's layout
            plan = dataclasses.replace(plan, num_gpu_blocks=num_blocks)
        self.model, self.plan, self.agent = model, plan, agent
        self.counts = EngineCounts(agent)  # entries stored, per tenant (the node's metrics)
        self.piece_bytes = piece_bytes
        self.kv = (
            GpuKV.allocate(plan, device)
            if tensors is None
            else GpuKV.register(plan, tensors, layout=layout)
        )
        self.hasher = BlockHasher(plan.hash_block_size)
        # pieces are cut at whole entries of every group: multiples of this many tokens
        self._unit = math.lcm(
            *(g.block_size * f for g, f in zip(plan.groups, factors(plan), strict=True))
        )
        self._view: CpuTierView | None = None
        self.engine: OffloadEngine | None = None
        self._applying: list[Future] = []  # applies sent, not yet seen answered
        self._held: list[list[tuple]] = []  # tier calls ``send`` sends
        self._held_lock = threading.Lock()  # an engine may send from another thread
        try:  # map the arena now (every page: shm.attach), not on the first load's path
            self._engine(agent.call(p.Arena(model)))
        except RaykvError as e:  # no arena yet: the first store / load maps it
            log.info("attach: the tier's arena of %s is not mapped yet (%s)", model, e)

    def _engine(self, spec: Any) -> OffloadEngine:
        """The engine on the arena ``spec`` names (mapped again if the tier was replaced)."""
        if self._view is None or self._view.spec != spec:
            if self._view is not None:  # the tier was placed again: its old arena is gone
                self._view.close()
            self._view = CpuTierView(self.plan, spec)
            self.engine = OffloadEngine(self.kv, self._view, checksums=True)
        return self.engine

    def _apply(self, ops: list[tuple]) -> None:
        """Send the engine's queued tier calls without waiting for them."""
        if ops:
            self._applying.append(self.agent.send(p.Apply(self.model, ops)))

    def _answered(self) -> None:
        """Forget the applies answered; their failures surface here, as in ``flush``."""
        self.send()
        done = [f for f in self._applying if f.done()]
        self._applying = [f for f in self._applying if not f.done()]
        for f in done:
            f.result()

    def send(self) -> None:
        """Send what ``load_leased`` left to send (its lease's release and any corrupt
        entry's drop): an engine calls this once its forward is under way or done, so the
        send costs the load nothing; the next store / load / ``flush`` sends it anyway."""
        with self._held_lock:
            held, self._held = self._held, []
        for ops in held:
            self._apply(ops)

    def flush(self) -> None:
        """Wait until the tier applied every call sent so far. Failures surface here."""
        self.send()
        pending, self._applying = self._applying, []
        for f in pending:
            f.result(self.agent.timeout_s)

    def close(self) -> int:
        """Detach: send and wait for every call still queued, then have the tier release
        whatever this engine still holds (a store or load cut short). Returns how many
        leases and reservations that was (0 where the agent is gone: they went with it)."""
        try:
            self.flush()
            self.counts.flush()
            return self.agent.call(p.ReleaseAll())
        except RaykvError as e:
            log.info("detach: %s", e)
            return 0

    def keys(self, token_ids: Sequence[int], tenant: Tenant = None) -> list[list[bytes]]:
        """Per group, the keys of the full blocks of ``tenant``'s prompt ``token_ids``."""
        return group_keys(self.plan, self.hasher.hash_blocks_joined(token_ids, tenant=tenant))

    def _cuts(self, num_tokens: int) -> list[int]:
        """Where a copy of a prompt's first ``num_tokens`` is cut into pieces (token
        positions, 0 first and ``num_tokens`` last; each cut whole entries of every group):
        the first piece about a quarter of ``piece_bytes`` (its copy starts early), each
        next one twice the one before, up to ``piece_bytes``."""
        plan, unit = self.plan, self._unit
        unit_bytes = plan.gpu_bytes_per_block * unit // plan.groups[0].block_size
        most = max(1, self.piece_bytes // max(unit_bytes, 1))
        cuts, size = [0], max(1, most // 4)
        while cuts[-1] + unit <= num_tokens:
            cuts.append(min(num_tokens // unit, cuts[-1] // unit + size) * unit)
            size = min(most, 2 * size)
        return [*cuts, num_tokens] if cuts[-1] < num_tokens or len(cuts) == 1 else cuts

    def _pieces(
        self, token_ids: Sequence[int], tables: list, cuts: list[int], tenant: Tenant
    ) -> Iterator:
        """Per piece (tokens ``cuts[i]`` to ``cuts[i + 1]``), hashed as it is needed (the
        chain goes on from the piece before; ``tenant`` enters the first): (each group's
        first position in it, its keys per group, its block ids per group)."""
        hbs, parent = self.plan.hash_block_size, None
        for a, b in itertools.pairwise(cuts):
            hashes = self.hasher.hash_blocks(token_ids, first_block=a // hbs, end_block=b // hbs,
                                             parent=parent, tenant=tenant)  # fmt: skip
            parent = hashes[-1] if hashes else parent
            at = [a // g.block_size for g in self.plan.groups]
            groups = zip(tables, at, self.plan.groups, strict=True)
            part = [t[f : b // g.block_size] for t, f, g in groups]
            yield at, group_keys(self.plan, hashes), part

    def _covered(self, token_ids: Sequence[int], tables: list) -> int:
        """The prompt's tokens any group's table reaches: the most a store or load hashes."""
        most = max(len(t) * g.block_size for t, g in zip(tables, self.plan.groups, strict=True))
        return min(len(token_ids), most)

    def store_from(
        self, token_ids: Sequence[int], block_ids: Sequence, tenant: Tenant = None
    ) -> int:
        """Copy the engine's blocks ``block_ids`` (per group, by position; a flat list for
        one group) holding ``token_ids``' full blocks into the node's CPU tier, keyed as
        ``tenant``'s (``tenant_key``: only its lookups and loads find them); returns the
        entries newly stored (0 when the tier has no room: a miss later, never wrong).

        A store of more than a quarter of ``piece_bytes`` goes in pieces of the prompt,
        each hashed and reserved (all or nothing) while the piece before it copies, and each
        made readable as its copy completes once every reservation is in (no piece's
        reservation may evict another's entries): the tier's bookkeeping runs beside the
        copy. Where the tier has no room for a piece, it and the pieces after it are not
        stored (the ones before are: a prefix); where ``tenant``'s quota leaves a piece's
        last entries out (invariant 13), the pieces after it are not stored either."""
        tables = as_tables(self.plan, block_ids)
        cuts = self._cuts(self._covered(token_ids, tables))
        pieces = self._pieces(token_ids, tables, cuts, tenant)
        self._answered()
        sent: list[tuple[StoreJob, Future]] = []

        def ask() -> None:  # the next piece with entries to store: its reservation asked
            for _, keys, part in pieces:
                job = StoreJob.build(self.plan, "attached", part, keys)
                if job.keys:
                    members = None  # entries of one block each: their own only member
                    if not (job.arrays.widths == 1).all():
                        members = tuple(c.members for c in complete_chunks(self.plan, part, keys))
                    request = p.Reserve(self.model, job.keys, members, tenant)
                    sent.append((job, self.agent.send(request)))
                    return

        ask()
        counts: dict[int, int] = {}
        results: list[JobResult] = []
        eng: OffloadEngine | None = None
        try:
            for job, asked in sent:  # ``ask`` appends the next one as this one is taken
                ask()
                spec, res = self.agent.answer(asked, "Reserve")
                if res is None or (eng is not None and spec != self._view.spec):
                    break  # no room (or the tier was placed again): a prefix is stored
                eng = self._engine(spec)
                counts[eng.submit_store(job, res)] = len(res.keys)
                if len(res.keys) + len(res.present) < len(set(job.keys)):
                    break  # its tenant's quota left the last out: the rest would follow a gap
            for job_id in list(counts)[:-1]:  # readable as they complete, the last below
                results += eng.wait(job_id)
                self._apply(eng.tier.take())
        finally:  # the copies end before the call returns (they read the engine's blocks)
            if eng is not None:
                results += eng.wait_all()
                self._apply(eng.tier.take())
            self._give_back([asked for _, asked in sent[len(counts) :]])
        stored = sum(counts[r.job_id] for r in results if r.ok)
        self.counts.add(self.model, tenant, stored_entries=stored)
        return stored

    def _give_back(self, sent: list[Future]) -> None:
        """Release the reservations asked for pieces not stored (a piece before had no
        room, or the store failed)."""
        ops = []
        for f in sent:
            with contextlib.suppress(RaykvError):
                _, res = self.agent.answer(f, "Reserve")
                if res is not None:
                    ops.append(("finish_store", res, False, None, None, 0))
        self._apply(ops)

    def pull(
        self, token_ids: Sequence[int], num_blocks: int | Sequence[int], tenant: Tenant = None
    ) -> list[int]:
        """Make the node's tier hold the first ``num_blocks`` blocks (per group, or one count
        for all) of ``tenant``'s prompt that other members hold: ``CpuTierActor.pull`` copies
        what it lacks into its arena, verified. Returns, per group, the leading blocks it
        holds."""
        keys = self.keys(token_ids, tenant)
        counts = [num_blocks] * len(keys) if isinstance(num_blocks, int) else list(num_blocks)
        asked = [
            self.agent.send(p.Pull(self.model, gk[:n], tenant)) if n else None
            for gk, n in zip(keys, counts, strict=True)
        ]
        return [f.result(PULL_TIMEOUT_S) if f is not None else 0 for f in asked]

    def _leased(self, sent: Future, first: Sequence[int]) -> TierLease:
        spec, groups = self.agent.answer(sent, "LeaseGroups")
        leases = tuple(lease for lease, _ in groups)
        return TierLease(spec, tuple(first), leases, tuple(c for _, c in groups))

    def lease(
        self,
        token_ids: Sequence[int],
        num_blocks: Sequence[int],
        skip: Sequence[int],
        tenant: Tenant = None,
    ) -> TierLease:
        """Read references on the tier's copies of ``tenant``'s prompt's blocks: per group,
        positions ``skip[g]`` to ``num_blocks[g]``."""
        keys = [k[:n] for k, n in zip(self.keys(token_ids, tenant), num_blocks, strict=True)]
        first = [min(s, len(k)) for s, k in zip(skip, keys, strict=True)]
        self._answered()
        wanted = [list(k[f:]) for k, f in zip(keys, first, strict=True)]
        return self._leased(self.agent.send(p.LeaseGroups(self.model, wanted, tenant)), first)

    def load_into(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence,
        skip: int | Sequence[int] = 0,
        tenant: Tenant = None,
    ) -> int:
        """Fill the engine's blocks ``block_ids`` (per group, by position from the prompt's
        first block) with the tier's verified copies of ``tenant``'s prompt ``token_ids``;
        returns the leading tokens now loaded in every group (entries that fail their
        checksum are dropped: misses).
        ``skip`` (per group, or one count for all): leading positions the engine already
        holds (its own prefix cache, or null blocks out of a window); they are neither read
        nor written and count as loaded.

        A load of more than a quarter of ``piece_bytes`` goes in pieces of the prompt, each
        hashed and leased while the piece before it copies."""
        tables = as_tables(self.plan, block_ids)
        skips = [skip] * len(tables) if isinstance(skip, int) else list(skip)
        covered = self._covered(token_ids, tables)
        groups = zip(tables, self.plan.groups, strict=True)
        ends = [min(len(t), covered // g.block_size) for t, g in groups]
        first = [min(s, e) for s, e in zip(skips, ends, strict=True)]
        pieces = self._pieces(token_ids, tables, self._cuts(covered), tenant)
        self._answered()
        sent: list[tuple[list[int], Future]] = []

        def ask() -> None:  # the next piece's lease asked: its positions from ``first`` on
            for at, keys, _ in pieces:
                start = [min(max(a, f), e) for a, f, e in zip(at, first, ends, strict=True)]
                spans = zip(keys, start, at, ends, strict=True)
                want = [list(k[max(s - a, 0) : max(e - a, 0)]) for k, s, a, e in spans]
                request = p.LeaseGroups(self.model, want, tenant)  # promotions: its entries
                sent.append((start, self.agent.send(request)))
                return

        ask()
        loading: list[tuple[list[int], _Loading]] = []
        taken = 0
        try:
            for start, asked in sent:  # ``ask`` appends the next one as this one is taken
                ask()
                lease, taken = self._leased(asked, start), taken + 1
                if loading and self._view is not None and lease.spec != self._view.spec:
                    self._hold([("finish_load", x, 0) for x in lease.leases if x is not None])
                    break  # the tier was placed again: the pieces loaded are the hit
                loading.append((start, self._submit_leased(lease, tables, start)))
        finally:
            results = self._wait([piece for _, piece in loading])
            for _, asked in sent[taken:]:  # leased but never loaded: released with ``send``
                with contextlib.suppress(RaykvError):
                    unused = self._leased(asked, first).leases
                    self._hold([("finish_load", x, 0) for x in unused if x is not None])
        reached = list(first)
        for start, piece in loading:  # each group's leading positions loaded, in order
            for g, got in enumerate(piece.reached(results)):
                if reached[g] >= start[g]:
                    reached[g] = max(reached[g], got)
        self.send()
        return min(r * g.block_size for r, g in zip(reached, self.plan.groups, strict=True))

    def load_leased(
        self, lease: TierLease, block_ids: Sequence, skip: int | Sequence[int] = 0
    ) -> int:
        """``load_into`` with the references taken already (``lease``, from position
        ``skip`` on or before it). Releases ``lease``, whatever happens, with the next
        ``send`` (or store / load / ``flush``). Positions the lease does not cover are not
        loaded."""
        tables = as_tables(self.plan, block_ids)
        skips = [skip] * len(tables) if isinstance(skip, int) else list(skip)
        loading = self._submit_leased(lease, tables, skips)
        got = loading.reached(self._wait([loading]))
        return min(r * g.block_size for r, g in zip(got, self.plan.groups, strict=True))

    def _submit_leased(self, lease: TierLease, tables: list, skips: Sequence[int]) -> _Loading:
        """Start the copies of ``lease``'s blocks into ``tables`` (each group's from position
        ``skips[g]``); the references of groups with nothing to copy go back with ``send``."""
        loading = _Loading()
        unused = []
        try:
            for gi, (g, table) in enumerate(zip(self.plan.groups, tables, strict=True)):
                s, first, lease_g = skips[gi], lease.first[gi], lease.leases[gi]
                picks = lease.chosen[gi][max(s - first, 0) : max(len(table) - first, 0)]
                if s >= len(table) or lease_g is None or s < first or not len(picks):
                    loading.groups.append((len(table) if s >= len(table) else s, None, (), picks))
                    unused.append(lease_g)
                else:
                    job = self._load_job(g.group_id, gi, lease_g.keys, table[s : s + len(picks)],
                                         picks)  # fmt: skip
                    job_id = self._engine(lease.spec).submit_load(job, lease_g)
                    loading.groups.append((s, job_id, lease_g.keys, picks))
        finally:  # the references of groups not loaded go back too (``send``)
            leased = len(loading.groups)
            unused += [lease.leases[gi] for gi in range(leased, len(lease.leases))]
            self._hold([("finish_load", u, 0) for u in unused if u is not None])
        return loading

    def _wait(self, loading: list[_Loading]) -> dict[int, JobResult]:
        """Wait for the copies of ``loading``, checking each piece's as it lands while the
        next ones copy; their tier calls go with the next ``send``."""
        jobs = [job for piece in loading for _, job, _, _ in piece.groups if job is not None]
        results: dict[int, JobResult] = {}
        for job in jobs:
            if job not in results:
                results |= {r.job_id: r for r in self.engine.wait(job)}
        if jobs:
            self._hold(self.engine.tier.take())
        return results

    def _hold(self, ops: list[tuple]) -> None:
        """Queue tier calls for ``send``."""
        if ops:
            with self._held_lock:
                self._held.append(ops)

    def _load_job(
        self, group_id: int, gi: int, keys: tuple[bytes, ...], ids: Sequence[int], picks: Any
    ) -> LoadJob:
        """The ``LoadJob`` of one group's leased ``keys`` into blocks ``ids``: block ``i``
        from sub-slot ``picks[i, 1]`` of entry ``picks[i, 0]``, its arrays handed over (no
        step per block to read them back from the tuples)."""
        picks = np.asarray(picks, np.int64).reshape(-1, 2)
        f, n = max(1, self.plan.block_size_factor), len(keys)
        sizes = [0] * len(self.plan.groups)
        sizes[gi] = len(picks)
        entry, sub = picks[:, 0].copy(), picks[:, 1].copy()
        job = LoadJob("attached", keys, (group_id,) * n, (f,) * n, tuple(ids), tuple(sizes),
                      slots_of(entry, sub))  # fmt: skip
        arrays = JobArrays(int_array(job.block_ids), entry, sub, np.full(n, f, np.int64))
        job.__dict__["arrays"] = arrays  # what ``arrays`` would compute
        return job


@dataclass
class _Loading:
    """A leased load's copies, submitted: per group (its first position, the copy's job id
    or None where nothing is copied, the leased keys, the (entry, sub-slot) picks)."""

    groups: list[tuple[int, int | None, tuple[bytes, ...], Any]] = field(default_factory=list)

    def reached(self, results: dict[int, JobResult]) -> list[int]:
        """Per group, the position up to which its blocks are loaded."""
        return [s if job is None else s + _loaded(results[job], keys, picks)
                for s, job, keys, picks in self.groups]  # fmt: skip


def _loaded(res: JobResult, keys: tuple[bytes, ...], picks: Any) -> int:
    """Leading blocks of ``picks`` (entry index, sub-slot) a load's result ``res`` loaded:
    up to the first whose entry it missed (every one, if it failed)."""
    if res.ok and not res.missed:
        return len(picks)
    lost = set(res.missed) if res.ok else set(keys)
    missed = np.fromiter(map(lost.__contains__, keys), bool, len(keys))
    bad = missed[np.asarray(picks, np.int64).reshape(-1, 2)[:, 0]]
    return int(bad.argmax()) if bad.any() else len(picks)
