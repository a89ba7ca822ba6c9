"""An engine's KV tensors attached to its node's CPU tier through shared memory.

``AttachedKV`` maps the tier's arena (``/dev/shm``, ``CpuTierView``) into the engine's own
process and runs the same ``raykv.tiers.OffloadEngine`` jobs the pools run: a store is one
paged copy from the engine's blocks into the arena (``StoreJob``, checksums computed) and a
load one paged copy back (``LoadJob``, checksums verified first: a corrupt entry is a miss,
dropped and counted, never copied, invariant 12). Around each copy go two small messages to
the tier carrying keys, block numbers and checksums: one round trip before it (reserve /
lease, which also names the arena) and one after it that is not waited for (apply; the
next store / load first makes sure it was applied, ``flush`` waits for it).
No KV byte is pickled. Entries stored this way are published like any pool's
offload, so every node's lookup and load finds them.

The engine keeps its own blocks: a block passed to ``store_from`` must not be rewritten until
the call returns (it is synchronous; on CUDA it waits for the copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from raykv.blocks.hashing import BlockHasher
from raykv.errors import InvalidInput
from raykv.service.groups import as_tables, complete_chunks, group_keys
from raykv.tiers.cpu_tier import CpuTierView
from raykv.tiers.gpu_kv import GpuKV
from raykv.tiers.jobs import LoadJob, StoreJob
from raykv.tiers.offload import OffloadEngine


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
            GpuKV.allocate(plan, "cpu")
            if tensors is None
            else GpuKV.register(plan, tensors, layout=layout)
        )
        self.hasher = BlockHasher(plan.hash_block_size)
        self._view: CpuTierView | None = None
        self.engine: OffloadEngine | None = None
        self._applying: list = []  # tier calls sent without waiting (checked on the next)

    def _engine(self, spec: Any) -> OffloadEngine:
        """The engine on the arena ``spec`` names (mapped again if the tier was replaced)."""
        if self._view is None or self._view.spec != spec:
            self._view = CpuTierView(self.plan, spec)
            self.engine = OffloadEngine(self.kv, self._view, checksums=True)
        return self.engine

    def _send(self, ops: list[tuple]) -> None:
        """Send the engine's queued tier calls without waiting for them."""
        if ops:
            self._applying.append(self.tier.apply.remote(self.model, ops, False))

    def flush(self) -> None:
        """Wait until the tier applied every call sent so far. Each store / load does this
        first (an async actor may start calls out of order; by then they are done, usually),
        so its reserve / lease sees the previous copy's result. Failures surface here."""
        pending, self._applying = self._applying, []
        ray.get(pending)

    def _keys(self, token_ids: Sequence[int]) -> list[list[bytes]]:
        return group_keys(self.plan, self.hasher.hash_blocks(list(token_ids)))

    def store_from(self, token_ids: Sequence[int], block_ids: Sequence) -> int:
        """Copy the engine's blocks ``block_ids`` (per group, by position; a flat list for
        one group) holding ``token_ids``' full blocks into the node's CPU tier; returns the
        entries newly stored (0 when the tier has no room: a miss later, never wrong)."""
        tables = as_tables(self.plan, block_ids)
        keys = self._keys(token_ids)
        self.flush()
        job = StoreJob.build(self.plan, "attached", tables, keys)
        if not job.keys:
            return 0
        members = tuple(c.members for c in complete_chunks(self.plan, tables, keys))
        spec, res = ray.get(self.tier.reserve.remote(self.model, job.keys, members, 1))
        if res is None:
            return 0
        eng = self._engine(spec)
        eng.submit_store(job, res)
        (done,) = eng.wait_all()
        self._send(eng.tier.take())
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
        keys = self._keys(token_ids)
        skips = [skip] * len(tables) if isinstance(skip, int) else list(skip)
        self.flush()
        loaded = []
        for gi, (g, table) in enumerate(zip(self.plan.groups, tables, strict=True)):
            s = skips[gi]
            want = list(zip(keys[gi][s : len(table)], table[s:], strict=False))
            if not want:
                loaded.append(min(s, len(table)) * g.block_size)
                continue
            spec, lease, chosen = ray.get(self.tier.lease.remote(self.model, [k for k, _ in want]))
            if lease is None:
                loaded.append(s * g.block_size)
                continue
            f = max(1, self.plan.block_size_factor)
            sizes = [0] * len(self.plan.groups)
            sizes[gi] = len(chosen)
            n_keys = len(lease.keys)
            job = LoadJob(
                "attached", lease.keys, (g.group_id,) * n_keys, (f,) * n_keys,
                tuple(b for _, b in want[: len(chosen)]), tuple(sizes), tuple(chosen),
            )  # fmt: skip
            eng = self._engine(spec)
            eng.submit_load(job, lease)
            (res,) = eng.wait_all()
            self._send(eng.tier.take())
            lost = set(res.missed) if res.ok else set(lease.keys)
            n = next((i for i, (e, _) in enumerate(chosen) if lease.keys[e] in lost), len(chosen))
            loaded.append((s + n) * g.block_size)
        return min(loaded) if loaded else 0
