"""An engine's KV tensors attached to its node's CPU tier through shared memory.

``AttachedKV`` maps the tier's arena (``/dev/shm``, ``CpuTierView``) into the engine's own
process and runs the same ``raykv.tiers.OffloadEngine`` jobs the pools run: a store is one
paged copy from the engine's blocks into the arena (``StoreJob``, checksums computed) and a
load one paged copy back (``LoadJob``, checksums verified first: a corrupt entry is a miss,
dropped and counted, never copied, invariant 12). Around each copy go two small messages to
the tier carrying keys, block numbers and checksums: one round trip before it (reserve /
lease, which also names the arena) and one after it that is not waited for (apply, numbered:
the next reserve / lease names the applies still unanswered and the tier runs it after them,
``raykv.service.cpu_tier._AppliedOrder``, without a round trip of the engine's own; ``flush``
waits for every apply sent). A load's lease
may also be taken beforehand, by whoever looked the prompt up (``TierLease``,
``Client.lookup_lease``: an engine's scheduler, in the same round trip as its lookup): then
the load itself makes no round trip at all (``load_leased``).
No KV byte is pickled. Entries stored this way are published like any pool's
offload, so every node's lookup and load finds them.

The engine keeps its own blocks: a block passed to ``store_from`` must not be rewritten until
the call returns (it is synchronous; on CUDA it waits for the copy).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from raykv.blocks.hashing import BlockHasher
from raykv.errors import InvalidInput
from raykv.service import holders
from raykv.service.groups import as_tables, complete_chunks, group_keys, key_limit
from raykv.tiers.cpu_tier import LoadLease
from raykv.tiers.gpu_kv import GpuKV
from raykv.tiers.jobs import LoadJob, StoreJob
from raykv.tiers.offload import OffloadEngine
from raykv.tiers.tier_view import CpuTierView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierLease:
    """Read references a node's CPU tier holds for one reader on its copies of a prompt's
    blocks: per group, the blocks from position ``first[g]`` on that it holds, as a
    ``LoadLease`` on their entries and, per block, (entry index in it, sub-slot). Until
    released the entries stay readable (never evicted), unless the tier reclaims them
    (``RAYKV_LEASE_TIMEOUT_S`` after the lease, or at once when its holder exits or
    detaches): a load of them is then a miss. ``AttachedKV.load_leased`` copies them
    without asking the tier again and releases the lease; ``release`` drops one that is
    not loaded. It pickles (an engine's scheduler hands it to its worker)."""

    model: str
    tier: Any  # the CpuTierActor holding the references
    spec: Any  # its arena's SharedSpec
    first: tuple[int, ...]
    leases: tuple[LoadLease | None, ...]
    chosen: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def ask(
        tier: Any,
        model: str,
        keys: Sequence[Sequence[bytes]],
        first: Sequence[int],
        holder: holders.Holder | None = None,
        after: tuple | None = None,
    ):
        """Send the tier the request (``CpuTierActor.lease_groups``, keys from ``first[g]``
        on) for ``holder`` (this process by default; ``after``: an attached engine's applies
        to run first); ``take`` its answer."""
        return tier.lease_groups.remote(
            model,
            [list(k[f:]) for k, f in zip(keys, first, strict=True)],
            holder or holders.this_process("lookup"),
            after,
        )

    @classmethod
    def request(
        cls, tier: Any, model: str, plan: Any, hashed: tuple, held_tokens: int
    ) -> tuple[TierLease, int]:
        """The lease of a lookup (``hashed``: ids, limit, chained hashes; the caller holds
        its first ``held_tokens``) and the most tokens that lookup could hit."""
        keys = group_keys(plan, hashed[2])
        first = [
            min(held_tokens // g.block_size, len(k)) for g, k in zip(plan.groups, keys, strict=True)
        ]
        lease = cls.take(tier, model, first, cls.ask(tier, model, keys, first))
        return lease, min(key_limit(plan, keys), hashed[1])

    @classmethod
    def take(cls, tier: Any, model: str, first: Sequence[int], ref: Any) -> TierLease:
        spec, groups = ray.get(ref)
        leases = tuple(lease for lease, _ in groups)
        return cls(model, tier, spec, tuple(first), leases, tuple(tuple(c) for _, c in groups))

    def blocks(self, group: int) -> int:
        """Leading blocks of group ``group`` held: the caller's own ``first``, then the tier's."""
        return self.first[group] + len(self.chosen[group])

    def tokens(self, plan: Any) -> int:
        """Leading tokens every group holds (the caller's own first blocks included)."""
        return min(self.blocks(i) * g.block_size for i, g in enumerate(plan.groups))

    def release(self) -> Any:
        """Drop the references (not waited for; returns the call's ref). Nothing is sent
        once Ray is down (``ray_is_down``)."""
        ops = [("finish_load", lease, 0) for lease in self.leases if lease is not None]
        if not ops or ray_is_down():
            return None
        return self.tier.apply.remote(self.model, ops, False)


def ray_is_down() -> bool:
    """Whether this process's Ray has shut down: an engine closing at interpreter exit runs
    after Ray's own exit hook. A Ray call then starts a new local Ray instance (Ray's
    auto-init: a vLLM ``LLM`` detaching at exit did, dashboard and all, and 2 of 10 such
    exits ended in a segmentation fault); instead nothing is sent, and the tier frees what
    this engine held when the holder's process is gone or at the leases' deadline."""
    return not ray.is_initialized()


class AttachedKV:
    """``store_from`` / ``load_into`` between an engine's paged KV and its node's tier."""

    def __init__(
        self,
        model: str,
        plan: Any,
        tier: Any,
        tensors: Mapping | None = None,
        *,
        num_blocks: int | None = None,
        layout: str = "kv_outer",
        device: str = "cpu",
    ) -> None:
        if plan.tp_size != 1:
            raise InvalidInput(
                f"attach serves tp_size=1 engines (this model has tp_size={plan.tp_size}); "
                "use store/load with rows per rank"
            )
        if num_blocks is not None:  # the engine's own pool: its block count, the model's layout
            plan = dataclasses.replace(plan, num_gpu_blocks=num_blocks)
        self.model, self.plan, self.tier = model, plan, tier
        self.kv = (
            GpuKV.allocate(plan, device)
            if tensors is None
            else GpuKV.register(plan, tensors, layout=layout)
        )
        self.hasher = BlockHasher(plan.hash_block_size)
        # this engine's leases and reservations: released at once by ``close``, or when the
        # process exits; else reclaimed at their deadline
        self.holder = holders.this_process(f"attached {model} {id(self):x}")
        self._view: CpuTierView | None = None
        self.engine: OffloadEngine | None = None
        # applies sent without waiting: (number, ref); those to self.tier are numbered
        self._applying: list[tuple[int | None, Any]] = []
        self._engine_id, self._numbered = secrets.token_hex(8), 0
        self._held: list[tuple[Any, list[tuple]]] = []  # (tier, calls) ``send`` sends
        self._held_lock = threading.Lock()  # an engine may send from another thread
        try:  # map the arena now (every page: shm.attach), not on the first load's path
            self._engine(ray.get(tier.arena.remote(model)))
        except ray.exceptions.RayError as e:  # no arena yet: the first store / load maps it
            log.info("attach: the tier's arena of %s is not mapped yet (%r)", model, e)

    def _engine(self, spec: Any) -> OffloadEngine:
        """The engine on the arena ``spec`` names (mapped again if the tier was replaced)."""
        if self._view is None or self._view.spec != spec:
            if self._view is not None:  # the tier was placed again: its old arena is gone
                self._view.close()
            self._view = CpuTierView(self.plan, spec)
            self.engine = OffloadEngine(self.kv, self._view, checksums=True)
        return self.engine

    def _apply(self, tier: Any, ops: list[tuple]) -> None:
        """Send the engine's queued tier calls without waiting for them; numbered where they
        go to this engine's tier (its next reserve / lease names them, ``_after``)."""
        if not ops:
            return
        if tier != self.tier:  # a lease taken from another tier: nothing is ordered after it
            self._applying.append((None, tier.apply.remote(self.model, ops, False)))
            return
        sent = [n for n, _ in self._applying if n is not None]
        floor = min(sent) - 1 if sent else self._numbered  # every apply up to it answered
        self._numbered += 1
        ticket = (self._engine_id, self._numbered, floor)
        self._applying.append((self._numbered, tier.apply.remote(self.model, ops, False, ticket)))

    def _after(self) -> tuple[str, tuple[int, ...]] | None:
        """The numbers of this engine's applies to its tier not answered yet, for its next
        reserve / lease to run after (``CpuTierActor``'s ``after``); failures of the answered
        ones surface here, as in ``flush``."""
        self.send()
        if not self._applying:
            return None
        refs = [ref for _, ref in self._applying]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        answered = set(ready)
        self._applying = [(n, ref) for n, ref in self._applying if ref not in answered]
        ray.get(ready)
        pending = tuple(n for n, _ in self._applying if n is not None)
        return (self._engine_id, pending) if pending else None

    def send(self) -> None:
        """Send what ``load_leased`` left to send (its lease's release and any corrupt
        entry's drop): an engine calls this once its forward is under way or done, so the
        send costs the load nothing; the next store / load / ``flush`` sends it anyway."""
        with self._held_lock:
            held, self._held = self._held, []
        for tier, ops in held:
            self._apply(tier, ops)

    def flush(self) -> None:
        """Wait until the tiers applied every call sent so far. Failures surface here."""
        self.send()
        pending, self._applying = self._applying, []
        ray.get([ref for _, ref in pending])

    def close(self) -> int:
        """Detach: send and wait for every call still queued, then have the tier release
        whatever this engine still holds (a store or load cut short). Returns how many
        leases and reservations that was. Idempotent; store / load after it still work.
        Once Ray is down (``ray_is_down``: the process is exiting) it sends nothing and
        returns 0."""
        if ray_is_down():
            return 0
        self.flush()
        return ray.get(self.tier.release_holder.remote(self.holder))

    def _keys(self, token_ids: Sequence[int]) -> list[list[bytes]]:
        return group_keys(self.plan, self.hasher.hash_blocks(list(token_ids)))

    def store_from(self, token_ids: Sequence[int], block_ids: Sequence) -> int:
        """Copy the engine's blocks ``block_ids`` (per group, by position; a flat list for
        one group) holding ``token_ids``' full blocks into the node's CPU tier; returns the
        entries newly stored (0 when the tier has no room: a miss later, never wrong)."""
        tables = as_tables(self.plan, block_ids)
        keys = self._keys(token_ids)
        job = StoreJob.build(self.plan, "attached", tables, keys)
        if not job.keys:
            return 0
        members = tuple(c.members for c in complete_chunks(self.plan, tables, keys))
        reserve = self.tier.reserve.remote(
            self.model, job.keys, members, 1, self.holder, self._after()
        )
        spec, res = ray.get(reserve)
        if res is None:
            return 0
        eng = self._engine(spec)
        eng.submit_store(job, res)
        (done,) = eng.wait_all()
        self._apply(self.tier, eng.tier.take())
        return len(res.keys) if done.ok else 0

    def pull(self, token_ids: Sequence[int], num_blocks: int | Sequence[int]) -> list[int]:
        """Make the node's tier hold the prompt's first ``num_blocks`` blocks (per group, or
        one count for all) that other nodes hold: ``CpuTierActor.pull`` copies what it
        lacks into its arena, verified. Returns, per group, the leading blocks it holds."""
        keys = self._keys(token_ids)
        counts = [num_blocks] * len(keys) if isinstance(num_blocks, int) else list(num_blocks)
        refs = [
            self.tier.pull.remote(self.model, gk[:n]) if n else None
            for gk, n in zip(keys, counts, strict=True)
        ]
        return [ray.get(r) if r is not None else 0 for r in refs]

    def load_into(
        self, token_ids: Sequence[int], block_ids: Sequence, skip: int | Sequence[int] = 0
    ) -> int:
        """Fill the engine's blocks ``block_ids`` (per group, by position from the prompt's
        first block) with the tier's verified copies; returns the leading tokens now
        loaded in every group (entries that fail their checksum are dropped: misses).
        ``skip`` (per group, or one count for all): leading positions the engine already
        holds (its own prefix cache, or null blocks out of a window); they are neither read
        nor written and count as loaded."""
        tables = as_tables(self.plan, block_ids)
        skips = [skip] * len(tables) if isinstance(skip, int) else list(skip)
        keys = [k[: len(t)] for k, t in zip(self._keys(token_ids), tables, strict=True)]
        first = [min(s, len(k)) for s, k in zip(skips, keys, strict=True)]
        # the lease runs after every earlier apply (it sees the earlier stores' entries)
        ask = TierLease.ask(self.tier, self.model, keys, first, self.holder, self._after())
        lease = TierLease.take(self.tier, self.model, first, ask)
        loaded = self.load_leased(lease, tables, skips)
        self.send()
        return loaded

    def load_leased(
        self, lease: TierLease, block_ids: Sequence, skip: int | Sequence[int] = 0
    ) -> int:
        """``load_into`` with the references taken already (``lease``, from position
        ``skip`` on or before it): no round trip to the tier. Releases ``lease``, whatever
        happens, with the next ``send`` (or store / load / ``flush``). Positions the lease
        does not cover are not loaded."""
        tables = as_tables(self.plan, block_ids)
        skips = [skip] * len(tables) if isinstance(skip, int) else list(skip)
        pending = {gi for gi, lease_g in enumerate(lease.leases) if lease_g is not None}
        ops: list[tuple] = []
        loaded = []
        try:
            for gi, (g, table) in enumerate(zip(self.plan.groups, tables, strict=True)):
                s, first, lease_g = skips[gi], lease.first[gi], lease.leases[gi]
                picks = lease.chosen[gi][max(s - first, 0) : max(len(table) - first, 0)]
                if s >= len(table):
                    loaded.append(len(table) * g.block_size)
                    continue
                if lease_g is None or s < first or not picks:
                    loaded.append(s * g.block_size)
                    continue
                f = max(1, self.plan.block_size_factor)
                sizes = [0] * len(self.plan.groups)
                sizes[gi] = len(picks)
                n_keys = len(lease_g.keys)
                job = LoadJob(
                    "attached", lease_g.keys, (g.group_id,) * n_keys, (f,) * n_keys,
                    tuple(table[s : s + len(picks)]), tuple(sizes), tuple(picks),
                )  # fmt: skip
                eng = self._engine(lease.spec)
                pending.discard(gi)
                eng.submit_load(job, lease_g)
                (res,) = eng.wait_all()
                ops += eng.tier.take()
                lost = set(res.missed) if res.ok else set(lease_g.keys)
                n = next(
                    (i for i, (e, _) in enumerate(picks) if lease_g.keys[e] in lost), len(picks)
                )
                loaded.append((s + n) * g.block_size)
        finally:  # the references of groups not loaded go back too (``send``)
            ops += [("finish_load", lease.leases[gi], 0) for gi in sorted(pending)]
            if ops:
                with self._held_lock:
                    self._held.append((lease.tier, ops))
        return min(loaded) if loaded else 0
