"""Peer reads: a pool copies another pool's blocks of the same host straight into its own.

Between two pools of one host no message needs to cross: the holder's KV is memory the
reader can map (a CUDA pool's one exportable allocation, ``raykv.tiers.peer_memory``, read
over NVLink; a CPU pool's ``/dev/shm`` files, ``raykv.tiers.shm``), so the reader's own
kernel copies block to block (``raykv.ops.pools.PoolCopy``): one pass over the bytes, no
staging, no gather on the holder, no scatter after. The holder takes part only in the
control call that names the blocks (``raykv.service.pool.pairs``): it holds them (no eviction, no
rewrite) until the reader releases them or a deadline passes, and states each block's wire
sum (``PoolCopy`` without a destination). The reader takes the same sums while it copies; only the
leading rows whose sums match become valid, so a block the holder changed after all (its
hold expired) is a miss, never wrong KV.

Every write of a peer read is the reader's own kernel into its own blocks: nothing another
process does can land in them later (a cancelled read needs no abort protocol), and a
holder that dies leaves its memory mapped until the reader lets go of it (``PeerMaps``
drops the mappings of owners that are gone).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from raykv.errors import TransportError
from raykv.ops.pools import PoolCopy
from raykv.tiers.shm import process_alive
from raykv.transport import completion
from raykv.transport.base import DirectTransport

PEER = "peer"  # how status names a pair that reads this way
SWEEP_S = 2.0  # how often a reader drops the mappings of holders that are gone


def enabled() -> bool:
    """Whether pools read each other in place (``RAYKV_PEER_READS=1``; off by default:
    measured beside the NCCL pipeline: docs/performance.md, "NCCL between GPU pools")."""
    return os.environ.get("RAYKV_PEER_READS", "0") == "1"


def owner_pid(handle: Any) -> int | None:
    """The pid of the process that exported ``handle`` (in its name), None if unknown."""
    from raykv.tiers import peer_memory, shm

    if isinstance(handle, peer_memory.PeerSpec):
        name = handle.socket
    elif handle and isinstance(handle[0], shm.SharedSpec):
        name = os.path.basename(handle[0].path)
    else:
        return None
    for part in name.split("-"):
        if part.isdigit():
            return int(part)
    return None


class PeerMaps:
    """The holders' memory this process has mapped, by handle, opened on first use by
    ``open_fn`` (handle -> whatever the caller reads from). A mapping whose owner process is
    gone is dropped at the next lookup or ``sweep`` (the pool sweeps every ``SWEEP_S``), so a
    dead holder's memory is freed (a re-placed pool on that GPU needs it back); at most
    ``limit`` are kept."""

    def __init__(self, open_fn: Callable[[Any], Any], limit: int = 8) -> None:
        self._open, self._limit = open_fn, limit
        self._maps: dict[Any, tuple[int | None, Any]] = {}

    def sweep(self) -> None:
        """Drop the mappings whose owner process is gone."""
        for key, (pid, _) in list(self._maps.items()):
            if pid is not None and not process_alive(pid):
                del self._maps[key]

    def get(self, handle: Any) -> Any:
        self.sweep()
        key = handle if not isinstance(handle, list) else tuple(handle)
        hit = self._maps.get(key)
        if hit is None:
            hit = self._maps[key] = (owner_pid(handle), self._open(handle))
            while len(self._maps) > self._limit:
                self._maps.pop(next(iter(self._maps)))
        return hit[1]

    def __len__(self) -> int:
        return len(self._maps)


def stated_sums(copy: PoolCopy, block_ids: Sequence[int]) -> np.ndarray:
    """The holder's half: each of its blocks' wire sum (``copy`` has no destination), after
    everything queued on the pool's stream so far, waited for; int64, so the reader compares
    without converting (a list of 512 ints costs ~16 us to convert, a tenth of a read)."""
    got = copy.start(block_ids)
    if copy.device.type == "cuda":
        torch.cuda.current_stream(copy.device).synchronize()
    return copy.sums(got).copy()  # the pinned buffer goes back to torch's allocator


async def read_blocks(
    copy: PoolCopy,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    sent_sums: Sequence[int],
    timeout_s: float,
) -> int:
    """The reader's half: copies the holder's blocks ``src_ids`` (``copy``: from its memory
    mapped here into our pool) into ``dst_ids`` and returns how many leading rows arrived as
    the holder stated them (``sent_sums``); only those may become valid. On a GPU the copy
    is queued on the pool's current stream (it waits for no other process, so it cannot
    stall it) and polled from the event loop, bounded by ``timeout_s`` (TransportError)."""
    if not src_ids:
        return 0
    done = copy.event() if copy.device.type == "cuda" else None
    got = copy.start(src_ids, dst_ids, done)
    if done is not None:
        await asyncio.sleep(0)  # other reads ready to start queue their copies first
        try:  # a copy takes ~0.1 ms: its spin checks without a loop turn in between
            await completion.until_done(done.query, timeout_s, yield_loop=False)
        except TimeoutError:
            raise TransportError(
                f"a peer read of {len(src_ids)} blocks did not finish within "
                f"{timeout_s:.0f}s; a miss"
            ) from None
        copy.reuse(done)
    return copy.leading_good(got, sent_sums)


class PeerTransport(DirectTransport):
    """The ``Transport`` entry for peer reads: a pool advertises it where its blocks can be
    mapped by another process of its node. Its endpoint names the node and the blocks'
    layout; the coordinator routes a pair over it only where both ends' endpoints are equal
    (``raykv.transport.select.choose``). Like NCCL it lands straight in the reader's blocks
    (``direct``): the pool drives it (``raykv.service.pool.pairs``), not ``fetch``."""

    name = PEER
    instead = "peer reads copy blocks straight into the reader's blocks"

    def __init__(self, node_id: str, layout: tuple) -> None:
        self._endpoint = {"node": node_id, "layout": list(layout)}

    def endpoint(self) -> dict[str, Any]:
        return dict(self._endpoint)
