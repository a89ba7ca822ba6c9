"""The node agent's protocol: what an engine process asks its node's raykv over a local socket.

The node agent is the node's ``CpuTierActor`` (inside Ray); engines are not Ray drivers. They
reach it through a Unix socket in ``agent_dir()`` named after the node (``socket_path``),
which only processes of the agent's own user may open (the folder is 0700, and the agent
checks each connection's peer credentials, ``SO_PEERCRED``). A node's first tier also links
the host's default name (``default_socket``) to its socket, so an engine that knows nothing
but the namespace finds it.

Each message is one frame: 4 bytes of length (little endian), then a pickle of
``(number, request)`` from the engine, ``(number, ok, value)`` back. Requests are the frozen
dataclasses below, one per call; the agent answers a connection's requests in the order they
came (so an ``Apply`` sent without waiting is applied before the ``Reserve`` after it); a
``Pull``, which crosses nodes, runs beside them and is answered when it is done. Pickle
is safe here because only the agent's own user can connect: the same user could read its
token files anyway.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AGENT_DIR_ENV = "RAYKV_AGENT_DIR"
_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a frame larger than this is a broken peer, not a request


def agent_dir() -> Path:
    """Where node agents put their sockets: ``RAYKV_AGENT_DIR``, else a folder of this user's
    own in the system's temp folder (the same for ``raykv up`` and the engines it serves)."""
    env = os.environ.get(AGENT_DIR_ENV)
    return Path(env) if env else Path("/tmp") / f"raykv-{os.getuid()}"


def socket_path(namespace: str, node_id: str) -> Path:
    """The socket of node ``node_id``'s agent (node ids are 56 hex digits: 16 name it)."""
    return agent_dir() / f"{namespace}-{node_id[:16]}.sock"


def default_socket(namespace: str) -> Path:
    """The host's default agent (a link to one node's socket): what an engine opens when it
    does not know its Ray node, as a vLLM engine outside Ray does not."""
    return agent_dir() / f"{namespace}.sock"


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
    return n


HEADER_BYTES = _LEN.size


# --- requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First request of a connection: the agent answers a ``Welcome``."""

    pid: int


@dataclass(frozen=True)
class Welcome:
    node_id: str
    namespace: str
    models: tuple[str, ...]


@dataclass(frozen=True)
class AddModel:
    """Serve a model (``Client.add_model``'s arguments); the answer is its ``Plan``."""

    name: str
    layers: dict[str, Any]
    max_model_len: int
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GetModel:
    """The served model named ``name`` (None: the only one): (``ServedModel``, ``Plan``)."""

    name: str | None


@dataclass(frozen=True)
class Replica:
    """The ``ReplicaSpec`` of ``model``'s prefix index replica on this node (None: none)."""

    model: str


@dataclass(frozen=True)
class Arena:
    """The ``SharedSpec`` of ``model``'s arena on this node."""

    model: str


@dataclass(frozen=True)
class Reserve:
    """``CpuTierActor.reserve`` for the connection's process (``members`` None: each entry
    is one block, its own key; no tuple per key on the wire). ``tenant``: the entries'
    (``tenant_key``; their quota, invariant 13)."""

    model: str
    keys: tuple[bytes, ...]
    members: tuple[tuple[bytes | None, ...], ...] | None
    tenant: bytes | None = None


@dataclass(frozen=True)
class LeaseGroups:
    """``CpuTierActor.lease_groups`` for the connection's process: per group, a
    ``LoadLease`` or None and, per block, (entry index in it, sub-slot) as an int64 array.
    ``tenant``: whose entries promoted from the disk tier become."""

    model: str
    keys: list[list[bytes]]
    tenant: bytes | None = None


@dataclass(frozen=True)
class Apply:
    """``CpuTierActor.apply`` of an ``OffloadEngine``'s queued calls (not waited for)."""

    model: str
    ops: list[tuple]


@dataclass(frozen=True)
class Pull:
    """``CpuTierActor.pull``: copy the leading ``keys`` other members hold into this node
    (``tenant``'s entries there)."""

    model: str
    keys: list[bytes]
    tenant: bytes | None = None


@dataclass(frozen=True)
class ReleaseAll:
    """Release every lease and reservation the connection's process holds (detach)."""


@dataclass(frozen=True)
class Counted:
    """An engine's counts of one tenant (``tenant_label``), for the node's metrics (not
    answered): lookups it answered from the replica, the blocks they hit and missed, and
    the tier entries it stored."""

    model: str
    tenant: str
    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_entries: int


Request = (
    Hello | AddModel | GetModel | Replica | Arena | Reserve | LeaseGroups | Apply | Pull
    | ReleaseAll | Counted
)  # fmt: skip
# requests the agent does not answer (the engine never waits for them)
ONE_WAY = (Counted,)
