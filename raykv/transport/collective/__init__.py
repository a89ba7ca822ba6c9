"""The collective routes (``nccl`` between GPU pools, ``gloo`` between CPU-device pools):
batches move rank to rank over two-rank torch.distributed groups, straight into the reader's
blocks. ``collective``: this process's end of its pairs (``Collective``) and its ``Transport``
entry; ``pair``: one direction between two endpoints and the rendezvous they form through;
``wire``: how a batch is cut into messages and an MLA copy into shares; ``window``: a pair's
holder pool mapped into the reader through NCCL, read in place; ``rank``: one TP rank's end
of these routes and of peer reads (``RankLinks``), the part a rank's KV holds."""

from raykv.transport.collective.collective import TIMEOUT_S, Collective, CollectiveTransport
from raykv.transport.collective.pair import Pair, serve_rendezvous
from raykv.transport.collective.rank import RankLinks

__all__ = [
    "TIMEOUT_S",
    "Collective",
    "CollectiveTransport",
    "Pair",
    "RankLinks",
    "serve_rendezvous",
]
