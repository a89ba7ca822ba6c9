"""NCCL windows: a pair's holder pool mapped into the reader through the pair's communicator.

Between two GPUs that can load from each other (NVLink or PCIe peer access: NCCL's "LSA
team"), staging a batch costs more than the wire: the holder's gather, one message, the
reader's scatter, each a pass over the bytes (at 512 x 64 KiB on an H200 ~0.75 x a
contiguous send on the GPUs alone). So where both ends of an NCCL pair keep their pool in
one allocation of the driver's virtual memory API (``raykv.tiers.peer_memory``) of the same
size and layout, the pair registers it as an NCCL window (``ncclCommWindowRegister``, NCCL
2.28+, in ``kernels/peer_memory.cpp``) when it forms, and NCCL maps the holder's pool into the
reader. A batch is then read in place, exactly like a peer read (``raykv.transport.peer_read``:
the holder holds the blocks and states their wire sums, the reader's kernel copies them
straight into its own blocks taking the same sums, only matching leading rows become valid);
NCCL only forms and tears down the mapping. Where NCCL maps nothing (no peer access, another
node) or the pools differ, the pair keeps the staged pipeline (``raykv.transport.collective``).

Both ends decide alike: each states its offer (NCCL version, allocation size, tensor layout)
in the pair's rendezvous store and registers only where the two offers are equal, so the
collective registration is always entered by both or by neither. The mapping lives as long
as the pair's communicator: the reader drops it (aborting the pair) when the pair is
forgotten or its holder's process is gone, so a dead pool's GPU memory comes back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from raykv import ops
from raykv.tiers.shm import process_alive
from raykv.transport.collective.pair import Pair

log = logging.getLogger(__name__)


def offer(memory: torch.Tensor | None, layout: Any) -> str:
    """What this end can register as a window: its NCCL version, the allocation's size and
    its tensors' layout; '' where it cannot (no exportable pool, raykv's extension or an
    NCCL whose windows raykv reads)."""
    module = ops.kernel_module()
    if memory is None or module is None or not hasattr(module, "nccl_window_version"):
        return ""
    version = int(module.nccl_window_version())
    return f"{version}/{memory.numel()}/{layout!r}" if version else ""


class Windows:
    """The holders' pools this process reads through NCCL windows, by pair (reader side),
    with each holder's pid (its process gone: the pair is dropped)."""

    def __init__(self) -> None:
        self._peers: dict[Pair, tuple[torch.Tensor, int]] = {}

    def form_pair(
        self, pair: Pair, ident: str, comm: int, client: Any, offered: tuple | None
    ) -> None:
        """``Collective``'s call as ``pair``'s communicator ``comm`` comes up at the end
        ``ident``: ``form`` over the pair's own prefix of the rendezvous store (``client``)
        with the pool this end offers (``(memory, layout)`` or None). A failure leaves the
        pair staging its batches, as it always could."""
        import torch.distributed as dist

        rank = 0 if pair.src == ident else 1
        memory, layout = offered or (None, None)
        try:
            store = dist.PrefixStore(f"{pair.prefix}window/", client)
            self.form(pair, rank, comm, store, memory, layout)
        except Exception as e:
            log.warning("nccl window %s -> %s: none (%r)", pair.src, pair.dst, e)

    def form(
        self, pair: Pair, rank: int, comm: int, store: Any, memory: torch.Tensor | None,
        layout: Any,
    ) -> None:  # fmt: skip
        """Both ends of a freshly formed NCCL pair call this together (``rank`` 0 the
        holder, 1 the reader; ``store`` the pair's own rendezvous prefix): the window is
        registered where both offers are equal, and the reader keeps the holder's memory."""
        mine = offer(memory, layout) if comm else ""
        store.set(f"offer{rank}", f"{os.getpid()}|{mine}")
        pid, theirs = store.get(f"offer{1 - rank}").decode().split("|", 1)
        if not mine or mine != theirs:
            return
        peer, why = ops.kernel_module().nccl_window(comm, memory, rank)
        if why:
            log.info("nccl window %s -> %s: none (%s); the pair stages its batches",
                     pair.src, pair.dst, why)  # fmt: skip
        elif rank == 1 and process_alive(int(pid)):  # a holder this process cannot see
            self._peers[pair] = (peer, int(pid))  # (another pid namespace) is never read

    def peer(self, pair: Pair) -> torch.Tensor | None:
        """The holder's pool (one uint8 tensor) mapped here through ``pair``'s window."""
        got = self._peers.get(pair)
        return got[0] if got is not None else None

    def drop(self, pair: Pair) -> bool:
        """Forget ``pair``'s window (its communicator is going); whether it had one."""
        return self._peers.pop(pair, None) is not None

    def dead(self) -> list[Pair]:
        """The pairs whose holder's process is gone."""
        return [p for p, (_, pid) in self._peers.items() if not process_alive(pid)]
