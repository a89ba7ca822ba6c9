"""The collective routes (``nccl`` between GPU pools, ``gloo`` between CPU-device pools):
batches move rank to rank over two-rank torch.distributed groups, straight into the reader's
blocks. ``collective``: this process's end of its pairs (``Collective``) and its ``Transport``
entry; ``pair``: one direction between two endpoints and the rendezvous they form through;
``wire``: how a batch is cut into messages and an MLA copy into shares; ``window``: a pair's
holder pool mapped into the reader through NCCL, read in place."""

from raykv.transport.collective.collective import TIMEOUT_S, Collective, CollectiveTransport
from raykv.transport.collective.pair import Pair, serve_rendezvous

__all__ = ["TIMEOUT_S", "Collective", "CollectiveTransport", "Pair", "serve_rendezvous"]
