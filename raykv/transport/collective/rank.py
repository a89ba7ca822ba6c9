"""``RankLinks``: one TP rank's end of the direct routes between pools, the part a rank's KV
(``raykv.service.pool.rank.RankKV``) holds.

The pool drives both halves of a batch rank to rank (``raykv.service.pool.pairs``); each rank
runs its own share here, on its own tensors: over NCCL / gloo its ``Collective`` (made on first
use, named after the rank's actor: a re-placed actor forms new pairs) sends or receives the
batch; a peer read (``raykv.transport.peer_read``) or a read through an NCCL pair's window
(``window``: the holder's pool as NCCL mapped it here) copies the holder's blocks straight into
this rank's, with the one reader's copy both share (``read_blocks``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch

from raykv.errors import TransportError
from raykv.ops.pools import PoolCopy
from raykv.transport.collective.collective import TIMEOUT_S, Collective
from raykv.transport.collective.pair import Pair
from raykv.transport.peer_read import SWEEP_S, PeerMaps, read_blocks, stated_sums

if TYPE_CHECKING:
    from raykv.layout.plan import Plan
    from raykv.tiers.gpu_kv import GpuKV


def actor_ident(name: str) -> str:
    """An endpoint's ident: its actor name and incarnation (a re-placed actor forms new
    pairs), or the process's when not in an actor."""
    aid = None
    if ray.is_initialized():  # get_runtime_context() would start a local Ray otherwise
        aid = ray.get_runtime_context().get_actor_id()
    return f"{name}#{(aid or str(os.getpid()))[-12:]}"


class RankLinks:
    """One rank's ``Collective`` and its halves of a batch, and its peer reads: over ``kv``
    (the rank's ``GpuKV`` of ``plan``), whose tensors per group are ``entries`` and rows
    ``widths`` bytes."""

    def __init__(
        self,
        plan: Plan,
        kv: GpuKV,
        entries: list[list[torch.Tensor]],
        widths: list[int],
    ) -> None:
        self.plan, self.kv, self.entries, self.widths = plan, kv, entries, widths
        self._coll: Collective | None = None
        self._peers: PeerMaps | None = None
        self._sums_of: list[PoolCopy] | None = None
        self._windowed: dict[Pair, tuple[torch.Tensor, GpuKV, dict]] | None = None

    def collective(self, name: str) -> Collective:
        if self._coll is None:
            device = self.entries[0][0].device if self.entries and self.entries[0] else "cpu"
            self._coll = Collective(actor_ident(name), device)
            if self.kv.export is not None:  # its NCCL pairs read it through windows
                self._coll.window_memory = (self.kv.export.buffer, self.kv.export.spec.tensors)
        return self._coll

    def start_send(self, name: str, pair: Pair, gi: int, block_ids: list[int]) -> Awaitable[int]:
        """Gather now (before any later call may write the blocks), send in the background;
        returns the send's awaitable."""
        return self.collective(name).start_send(pair, self.entries[gi], block_ids, self.widths[gi])

    async def recv(
        self,
        name: str,
        pair: Pair,
        gi: int,
        block_ids: list[int],
        expected: Sequence[int] | None,
        replicas: Sequence[str] = (),
    ) -> int:
        """``pair``'s batch into ours; ``replicas`` (this group's idents of the ranks that
        hold this rank's copy, more than one): the copy comes in shares (``recv_shares``)."""
        coll = self.collective(name)
        if len(replicas) > 1:
            return await coll.recv_shares(
                pair, replicas, self.entries[gi], block_ids, self.widths[gi], expected
            )
        return await coll.recv_batch(pair, self.entries[gi], block_ids, self.widths[gi], expected)

    # --- peer reads (``raykv.transport.peer_read``) ---

    def peer_handle(self) -> Any:
        """What another process of this node needs to map this rank's blocks (a CUDA pool's
        ``PeerSpec``, a CPU pool's shared-memory specs), or None where they cannot be."""
        kv = self.kv
        if kv.export is not None:
            return kv.export.spec
        return list(kv.shared_specs) if kv.shared_specs else None

    @staticmethod
    async def _sweep_peers(peers: PeerMaps) -> None:
        """Free the mappings of holders that died, also while this rank reads nothing."""
        while True:
            await asyncio.sleep(SWEEP_S)
            peers.sweep()

    def peer_sums(self, gi: int, block_ids: list[int]) -> np.ndarray:
        """Each block's wire sum, as a peer reader's copy will take it."""
        if self._sums_of is None:
            self._sums_of = [PoolCopy(e) for e in self.entries]
        return stated_sums(self._sums_of[gi], block_ids)

    async def peer_read(
        self, gi: int, handle: Any, src_ids: list[int], dst_ids: list[int], sums: np.ndarray
    ) -> int:
        """Copy a peer's blocks (``handle``: its ``peer_handle``, or the ``Pair`` whose NCCL
        window maps it, ``raykv.transport.collective.window``) into ours; how many leading
        ones arrived as the peer stated them."""
        from raykv.tiers.gpu_kv import GpuKV

        if isinstance(handle, Pair):
            peer, copies = self._window_pool(handle)
        else:
            if self._peers is None:
                self._peers = PeerMaps(lambda h: (GpuKV.open_handles(self.plan, h), {}))
                asyncio.get_running_loop().create_task(self._sweep_peers(self._peers))
            peer, copies = self._peers.get(handle)
        copy = copies.get(gi)
        if copy is None:  # the pair of pools checked once, its segment tables kept
            src = peer.entries(self.plan.groups[gi].group_id)
            copy = copies[gi] = PoolCopy(src, self.entries[gi])
        return await read_blocks(copy, src_ids, dst_ids, sums, TIMEOUT_S)

    def has_window(self, pair: Pair) -> bool:
        """Whether this rank reads ``pair``'s holder through an NCCL window."""
        return self._coll is not None and self._coll.window(pair) is not None

    def _window_pool(self, pair: Pair) -> tuple[GpuKV, dict]:
        """The holder's pool mapped through ``pair``'s NCCL window (its layout is ours: the
        window formed only where both were equal) and this pair's copies by group."""
        from raykv.tiers.gpu_kv import GpuKV
        from raykv.tiers.peer_memory import carve

        memory = self._coll.window(pair) if self._coll is not None else None
        if memory is None:
            raise TransportError(f"no NCCL window from {pair.src} (its pair was dropped)")
        if self._windowed is None:
            self._windowed = {}
            asyncio.get_running_loop().create_task(self._sweep_windows())
        got = self._windowed.get(pair)
        if got is None or got[0] is not memory:
            tensors = carve(memory, self.kv.export.spec.tensors)
            got = self._windowed[pair] = (memory, GpuKV.of_raw(self.plan, tensors), {})
        return got[1], got[2]

    async def _sweep_windows(self) -> None:
        """Drop the windows (pairs) of holders that died, also while this rank reads none."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self._coll.sweep_windows()
            for p in [p for p in self._windowed if self._coll.window(p) is None]:
                del self._windowed[p]
