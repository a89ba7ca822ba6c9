"""The transports a member reads over and serves (``raykv.transport``), in one place.

Every member (GPU pool, CPU tier) reads through the object store and, where this node can
(``raykv[ucx]`` installed, ``RAYKV_TRANSPORT_SECRET`` set, ``RAYKV_UCX`` not 0), over UCX;
and where it can, it also runs a UCX server for its ``export_blocks`` and advertises it
(``Membership.endpoints``: ``{"ucx": (host, worker address hex, hello tag)}``: readers connect
by worker address, nothing listens on a port), so the coordinator routes the pair over UCX
when both ends have it. Without ucxx or the secret nothing advertises UCX and every
fetch takes the object store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray

from raykv.service.control.metrics import ServiceMetrics
from raykv.service.served import NAMESPACE
from raykv.transport import FALLBACK, ObjectStoreTransport, Transport
from raykv.transport.select import UCX

log = logging.getLogger(__name__)


def reader_transports() -> dict[str, Transport]:
    """Name -> transport this process fetches over (the fallback always)."""
    out: dict[str, Transport] = {FALLBACK: ObjectStoreTransport(NAMESPACE)}
    from raykv.transport.ucx import ucx_reader

    try:
        ucx = ucx_reader()
    except Exception as e:  # UCX is an optimization: a member never fails over it
        log.warning("UCX reader unavailable here (%r); fetching over the object store", e)
        ucx = None
    if ucx is not None:
        out[UCX] = ucx
    return out


def serve_ucx(
    name: str, export_blocks: Callable[..., Any], metrics: ServiceMetrics, lends: bool
) -> Any:
    """Start member ``name``'s UCX server for its ``export_blocks`` (on its actor's running
    loop), or None. Refused peers are counted in ``metrics`` (``failures_transport_auth``)."""
    from raykv.transport.ucx import ucx_server

    def refused(reason: str) -> None:
        metrics.failed("transport_auth")

    try:
        return ucx_server(
            export_blocks,
            host=ray.util.get_node_ip_address(),
            owner_loop=asyncio.get_running_loop(),
            on_refused=refused,
            lends=lends,
        )
    except Exception as e:  # UCX is an optimization: a member never fails over it
        log.warning("%s: no UCX listener (%r); serving over the object store", name, e)
        return None
