"""``CpuTierView``: another process's view of a shared ``CpuTier`` (its arena in
``/dev/shm``): the bytes move in the viewing process, the owner keeps the only state machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from raykv.errors import ConfigError
from raykv.layout import tp
from raykv.layout.plan import Plan
from raykv.tiers import shm
from raykv.tiers.cpu_tier import ArenaRows, Key, LoadLease, StoreReservation
from raykv.tiers.shm import SharedSpec


class CpuTierView(ArenaRows):
    """Another process's view of a shared ``CpuTier`` (``shared=True``): its arena mapped
    from ``/dev/shm``, its metadata left with the owner. ``OffloadEngine`` runs on a view as
    on the tier itself: the caller takes the reservation / lease from the owner
    (``prepare_store`` / ``prepare_load``, passed to ``submit_store`` / ``submit_load``), and
    the engine's ``finish_store`` / ``finish_load`` / ``drop`` calls queue up in ``outbox``
    for the caller to apply on the owner (``CpuTier.apply``) in one message. So the bytes
    move once, in this process, and the owner's state machine stays the only one."""

    def __init__(self, plan: Plan, spec: SharedSpec) -> None:
        self.plan, self.spec = plan, spec
        self.num_blocks = plan.cpu_num_blocks
        self.factor = max(1, plan.block_size_factor)
        self.copies = tp.plan_copies(plan)
        self.slot_bytes = plan.gpu_bytes_per_block
        want = (self.copies, self.num_blocks * self.factor, self.slot_bytes)
        if tuple(spec.shape) != want:
            raise ConfigError(
                f"shared arena {spec.path} has shape {list(spec.shape)}, the plan needs "
                f"{list(want)}; the tier and this process serve different plans"
            )
        self.arena = shm.attach(spec)
        gens = getattr(spec, "gens", None)
        if gens is not None:  # the owner's block generations and release count: ``current``
            counters = shm.attach(gens).view(torch.int64)
            self.gens = counters[: self.num_blocks]
            if counters.numel() > self.num_blocks:
                self.releases = counters[self.num_blocks :]
        self.outbox: list[tuple] = []

    def close(self) -> None:
        """Let the mappings go (a tier placed again names new files): no copy through this
        view may be in flight."""
        shm.detach(self.spec)
        gens = getattr(self.spec, "gens", None)
        if gens is not None:
            shm.detach(gens)

    def prepare_store(self, keys: Sequence[Key], writers: int = 1, **_: object) -> None:
        raise RuntimeError("reserve on the tier's owner and pass the reservation to the engine")

    def prepare_load(self, keys: Sequence[Key], **_: object) -> None:
        raise RuntimeError("lease on the tier's owner and pass the lease to the engine")

    def finish_store(self, reservation: StoreReservation, ok: bool, valid=None, checksums=None,
                     copy: int = 0) -> None:  # fmt: skip
        self.outbox.append(("finish_store", reservation, ok, valid, checksums, copy))

    def finish_load(self, lease: LoadLease, loaded: int | None = None) -> None:
        # the owner needs the blocks and keys back, not every entry's checksums again
        self.outbox.append(
            ("finish_load", dataclasses.replace(lease, valid=(), checksums=()), loaded)
        )

    def drop(self, key: Key, corrupt: bool = False) -> None:
        self.outbox.append(("drop", key, corrupt))

    def take(self) -> list[tuple]:
        out, self.outbox = self.outbox, []
        return out
