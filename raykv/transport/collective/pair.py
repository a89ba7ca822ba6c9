"""``Pair``: one direction between two endpoints of ``raykv.transport.collective``, and the
rendezvous its two-rank groups form through (a ``TCPStore`` the coordinator serves, keyed by
the pair's ``prefix``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


def serve_rendezvous(host: str) -> tuple[Any, str, int]:
    """A ``TCPStore`` server on ``host`` (a free port) for the pairs' rendezvous: the
    coordinator hosts it; returns (store, host, port)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    return store, host, int(store.port)


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback cluster), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray here: a single-host use
        pass
    return "127.0.0.1"


@dataclass(frozen=True)
class Pair:
    """One direction between two endpoints: ``src`` sends, ``dst`` receives."""

    src: str
    dst: str
    gen: int
    store: tuple[str, int]

    @property
    def prefix(self) -> str:
        return f"raykv/{self.src}>{self.dst}/{self.gen}/"

    @property
    def link(self) -> tuple[str, str]:
        return self.src, self.dst
