"""Which transport a pair of members uses: the fastest one both ends offer.

Every member (pool or tier) advertises the transports it can serve and how to reach it
(``Membership.endpoints``: name -> endpoint info, e.g. a UCX server's worker address); the
coordinator picks, for each (holder, reader) pair, the first name of ``PREFERENCE`` both
advertise (``choose``), hands it out with every ``Location`` of a lookup, and remembers it
for ``raykv status``. ``OBJECT_STORE`` works on any Ray cluster and is always offered, so a
pair always has one. A reader whose chosen transport fails for a batch retries that batch on
the object store (``FALLBACK``) before it counts the source as failed; a failed peer read
(the holder's memory cannot be mapped here, say) is retried first over the next transport
both offer (NCCL between GPU pools), which the coordinator hands out with the peer route.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

PEER, NCCL, UCX, GLOO, OBJECT_STORE = "peer", "nccl", "ucx", "gloo", "object-store"
# fastest first: peer reads between pools of one node (the reader's kernel copies the
# holder's mapped blocks, ``raykv.transport.peer_read``), NCCL between GPUs, UCX between hosts
# (CPU tiers), torch.distributed's gloo between CPU pools, Ray's object store last
PREFERENCE = (PEER, NCCL, UCX, GLOO, OBJECT_STORE)
COLLECTIVE = (NCCL, GLOO)  # torch.distributed pairs (``raykv.transport.collective``)
FALLBACK = OBJECT_STORE


def choose(holder: Mapping[str, Any], reader: Mapping[str, Any], skip: tuple[str, ...] = ()) -> str:
    """The first transport of ``PREFERENCE`` (but ``skip``) that both ends advertise (their
    ``endpoints()``); the object store when they share nothing else. Peer reads only between
    members of one node whose blocks have one layout (their endpoints say so)."""
    for name in PREFERENCE:
        if name in skip:
            continue
        if name in holder and name in reader:
            if name == PEER and holder[name] != reader[name]:
                continue
            return name
    return OBJECT_STORE


def route(
    holder: Mapping[str, Any], reader: Mapping[str, Any], endpoint: Callable[[str], Any]
) -> tuple[str, Any]:
    """The transport a reader fetches from a holder over (``choose``) and the holder's
    ``endpoint(name)`` for it; a peer route also carries the next transport both offer and
    its endpoint (``"then"``), for ``after``."""
    name = choose(holder, reader)
    ep = endpoint(name)
    if name == PEER:  # where a peer read fails, the next one both offer before the store
        then = choose(holder, reader, skip=(PEER,))
        ep = {**ep, "then": (then, endpoint(then))}
    return name, ep


def after(name: str, endpoint: Any) -> tuple[str, Any]:
    """The route a reader retries a batch over once ``name`` (a direct route) failed for it:
    after a peer read the next transport both ends offer (``route``'s ``"then"``), else the
    object store (the endpoint unchanged)."""
    then = (endpoint or {}).get("then") if name == PEER else None
    return (then[0], then[1]) if then else (FALLBACK, endpoint)
