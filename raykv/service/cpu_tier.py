"""CpuTierActor: the CPU tier of one node (pinned to it), one ``raykv.tiers.CpuTier`` arena
per served model.

An entry is one chunk (``raykv.service.groups``): ``block_size_factor`` GPU blocks of one
group, keyed by its last block's key, holding every distinct TP copy (invariant 5: the
arena is sized from the plan, ``cpu_num_blocks x cpu_bytes_per_block``). Null sub-slots
carry nothing. Outside, the tier answers per GPU-block key: it publishes the key of every
block an entry carries, and ``read_hashes`` serves a block from whichever entry holds it,
so a lookup or a load never needs to know how blocks were chunked.

The node's pools offload chunks here (before their GPU blocks are evicted, or on a store
with ``offload=True``), read them back (local CPU hits); other nodes' pools fetch from it
through a ``BlockMover``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from raykv.errors import InvalidInput
from raykv.service.groups import check_servable, key_group, row_widths
from raykv.service.index import CPU
from raykv.service.member import Member
from raykv.service.metrics import ServiceMetrics
from raykv.service.rows import as_tensor
from raykv.service.spec import tier_name
from raykv.tiers.jobs import StoreJob

Members = tuple[bytes | None, ...]


class _ModelTier:
    """One model's arena plus the block-key -> (entry key, sub-slot) map."""

    def __init__(self, plan: Any) -> None:
        from raykv.tiers.cpu_tier import CpuTier

        check_servable(plan)
        self.plan = plan
        self.tier = CpuTier(plan, "lru")
        self.widths = {g.group_id: w for g, w in zip(plan.groups, row_widths(plan), strict=True)}
        self.entries: dict[bytes, Members] = {}  # entry key -> its members
        self.where: dict[bytes, dict[bytes, int]] = {}  # block key -> {entry key: sub-slot}

    def forget(self, entry: bytes) -> list[bytes]:
        """Drop an evicted entry's members; returns block keys no entry holds any more."""
        gone = []
        for s, m in enumerate(self.entries.pop(entry, ())):
            held = self.where.get(m) if m is not None else None
            if held is not None and held.pop(entry, None) == s and not held:
                del self.where[m]
                gone.append(m)
        return gone

    def note(self, entry: bytes, members: Members) -> list[bytes]:
        """Record a stored entry; returns block keys that became available."""
        self.entries[entry] = members
        new = []
        for s, m in enumerate(members):
            if m is None:
                continue
            held = self.where.setdefault(m, {})
            if not held:
                new.append(m)
            held[entry] = s
        return new


class CpuTierActor(Member):
    kind = "tier"

    def __init__(self, node_id: str, plans: dict[str, Any] | None = None) -> None:
        super().__init__(tier_name(node_id), node_id)
        # the served models' arenas from the start: a tier placed again after it died must
        # take its node's offloads before it registers (its pools added them to the old one)
        self.tiers: dict[str, _ModelTier] = {m: _ModelTier(p) for m, p in (plans or {}).items()}
        self.metrics = ServiceMetrics("tier")

    async def add_model(self, model: str, plan: Any) -> int:
        """Make room for ``model`` (idempotent); returns its CPU-tier block count."""
        if model not in self.tiers:
            self.tiers[model] = _ModelTier(plan)
        return self.tiers[model].tier.num_blocks

    def _tier(self, model: str) -> _ModelTier:
        mt = self.tiers.get(model)
        if mt is None:
            raise InvalidInput(f"the CPU tier on node {self.node_id[:12]} holds no model {model!r}")
        return mt

    async def store(
        self, model: str, job: StoreJob, members: tuple[Members, ...], rows: list[np.ndarray]
    ) -> int:
        """Store the chunks of ``job`` (all or nothing; LRU evicts to make room; keys already
        held are skipped). ``rows[g]``: uint8 [copies, group_sizes[g], row_bytes(g)], the
        carried blocks of group g in job order. Returns the entries newly stored."""
        mt = self._tier(model)
        tier, f = mt.tier, mt.tier.factor
        masks = job.valid_masks()
        if len(members) != len(job.keys) or any(
            len(m) != w or [x is not None for x in m] != list(masks[k])
            for k, (m, w) in enumerate(zip(members, job.key_widths, strict=True))
        ):
            raise InvalidInput("each stored entry needs one member key per sub-slot it carries")
        if any(w != f for w in job.key_widths):
            raise InvalidInput(f"entries of model {model!r} hold {f} GPU blocks each")
        slices = job.group_slices()
        gids = [g.group_id for g in mt.plan.groups]
        src = []
        for gi, sl in enumerate(slices):
            t = as_tensor(rows[gi])
            want = (tier.copies, sl.stop - sl.start, mt.widths[gids[gi]])
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise InvalidInput(
                    f"CPU tier rows of group {gi} must be uint8 {list(want)}, got {t.dtype} "
                    f"{list(t.shape)}"
                )
            src.append(t)
        res = tier.prepare_store(job.keys)
        if res is None:
            return 0
        at = res.block_of()
        try:
            for gi, sl in enumerate(slices):
                pick = [i for i, (k, _) in enumerate(job.slots[sl]) if job.keys[k] in at]
                if not pick:
                    continue
                arena_rows = torch.tensor(
                    [at[job.keys[job.slots[sl][i][0]]] * f + job.slots[sl][i][1] for i in pick],
                    dtype=torch.long,
                )
                width = src[gi].shape[2]
                sel = src[gi][:, torch.tensor(pick, dtype=torch.long)]
                for c in range(tier.copies):
                    tier.rows(c)[:, :width].index_copy_(0, arena_rows, sel[c])
        except Exception:
            tier.finish_store(res, ok=False)
            gone = [m for e in res.evicted for m in mt.forget(e)]  # evicted at prepare
            await self.publish(model, [], [m for m in gone if m not in mt.where])
            raise
        index = {k: i for i, k in enumerate(job.keys)}
        tier.finish_store(res, ok=True, valid=[masks[index[k]] for k in res.keys])
        removed = [m for e in res.evicted for m in mt.forget(e)]
        added = [m for k in res.keys for m in mt.note(k, members[index[k]])]
        removed = [m for m in removed if m not in mt.where]  # re-added by this very store
        self.metrics.evicted(model, CPU, len(res.evicted))
        self.metrics.used(model, CPU, tier.num_blocks - tier.num_free)
        await self.publish(model, [(m, -1) for m in added], removed)
        return len(res.keys)

    async def read_hashes(
        self, model: str, keys: list[Hashable], block_ids: list[int] | None = None
    ) -> tuple[int, np.ndarray]:
        """Rows of the leading block ``keys`` (one group) held here:
        (count, uint8 [copies, count, row_bytes])."""
        mt = self.tiers.get(model)
        if mt is None or not keys:
            return 0, np.empty((1, 0, 0), np.uint8)
        tier, gid = mt.tier, key_group(keys[0])
        chosen: list[tuple[bytes, int]] = []
        for key in keys:
            held = mt.where.get(key)
            if not held or key_group(key) != gid:
                break
            chosen.append(next(iter(held.items())))
        entries = list(dict.fromkeys(e for e, _ in chosen))
        lease = tier.prepare_load(entries) if entries else None
        if lease is None:
            self.metrics.miss(model, CPU, len(keys))
            return 0, np.empty((tier.copies, 0, mt.widths[gid]), np.uint8)
        self.metrics.miss(model, CPU, len(keys) - len(chosen))
        try:
            block_of = dict(zip(lease.keys, lease.blocks, strict=True))
            idx = torch.tensor([block_of[e] * tier.factor + s for e, s in chosen], dtype=torch.long)
            rows = tier.arena[:, idx, : mt.widths[gid]].numpy()
        finally:
            tier.finish_load(lease)
        self.metrics.hit(model, CPU, len(chosen))
        self.metrics.moved(model, CPU, rows.nbytes)
        return len(chosen), rows

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {m: [(k, -1) for k in mt.where] for m, mt in self.tiers.items()}

    def stats(self) -> dict[str, Any]:
        tiers = [mt.tier for mt in self.tiers.values()]
        return {
            "blocks_used": sum(t.num_blocks - t.num_free for t in tiers),
            "blocks_total": sum(t.num_blocks for t in tiers),
            "bytes": sum(t.total_bytes for t in tiers),
            "per_model": {
                m: {
                    "blocks_total": mt.tier.num_blocks,
                    "blocks_used": mt.tier.num_blocks - mt.tier.num_free,
                    "bytes": mt.tier.total_bytes,
                    "copies": mt.tier.copies,
                    "block_size_factor": mt.tier.factor,
                }
                for m, mt in self.tiers.items()
            },
        } | dict(self.metrics.tally)
