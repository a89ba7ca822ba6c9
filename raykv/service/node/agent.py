"""The node agent: the door through which engine processes on this node reach raykv.

The node's ``CpuTierActor`` runs it (an asyncio Unix-socket server on the actor's own event
loop, ``raykv.service.node.agent_protocol``), so an engine is never a Ray driver: its life is not
tied to the Ray head, it exports nothing, and a dead service is a closed socket it sees at
once. The agent answers each connection's requests in order (a ``Pull``, which crosses nodes,
runs beside them), with the tier's own methods (``reserve``, ``lease_groups``, ``apply``,
``pull``) for the connection's process, and forwards what only
the coordinator knows (``AddModel``, ``GetModel``). Each connection is one holder
(``raykv.tiers.holds``): when it closes (the engine detached, exited or crashed) its
leases and reservations are released at once.

Access: the socket's folder is the agent's user's alone (0700), and each connection's peer
credentials (``SO_PEERCRED``) must name that user (or root); anyone else is refused before
a byte is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import ray

from raykv.errors import RaykvError, ServiceError
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.node import agent_protocol as p
from raykv.service.node.replica import ReplicaSpec
from raykv.service.served import COORDINATOR, served_model
from raykv.tiers import holds

log = logging.getLogger(__name__)
COORDINATOR_TIMEOUT_S = 60.0  # an AddModel places pools: as long as placement may take
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _answers(path: Path) -> bool:
    """Whether an agent listens at ``path`` (a socket file of a dead one refuses)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class ServedTier(Protocol):
    """What the agent uses of the tier that runs it (``raykv.service.tier.actor.CpuTierActor``):
    its node, its models and counters, and the methods it answers requests with."""

    node_id: str
    tiers: Mapping[str, Any]  # model -> its part of the tier
    metrics: ServiceMetrics

    async def reserve(
        self,
        model: str,
        keys: tuple[bytes, ...],
        members: tuple[tuple[bytes | None, ...], ...] | None,
        writers: int = 1,
        holder: Any = None,
        tenant: bytes | None = None,
    ) -> Any: ...

    async def lease_groups(
        self, model: str, keys: list[list[bytes]], holder: Any = None, tenant: bytes | None = None
    ) -> Any: ...

    async def apply(self, model: str, ops: list[tuple], wait_publish: bool = True) -> int: ...

    async def arena(self, model: str) -> Any: ...

    async def pull(self, model: str, keys: list[bytes], tenant: bytes | None = None) -> int: ...

    async def release_holder(self, holder: Any) -> int: ...

    def replica_spec(self, model: str) -> ReplicaSpec | None: ...

    async def add_model(self, model: str, plan: Any) -> int: ...


class AgentServer:
    """Serves ``raykv.service.node.agent_protocol`` requests for one tier (see the module
    docstring)."""

    def __init__(self, tier: ServedTier, namespace: str) -> None:
        self.tier, self.namespace = tier, namespace
        self.path = p.socket_path(namespace, tier.node_id)
        self._server: asyncio.AbstractServer | None = None
        self._connections = 0
        self.clients = 0  # connections open now (``raykv status``)

    async def start(self) -> Path:
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            raise ServiceError(
                f"the agent folder {folder} belongs to another user; set RAYKV_AGENT_DIR "
                "to a folder of your own"
            )
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by a tier that died on this node
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o600)
        self._link_default()
        return self.path

    def _link_default(self) -> None:
        """Point the host's default name at this socket unless a live agent has it; remove
        the sockets agents that died left in the folder."""
        for old in self.path.parent.glob("*.sock"):
            if old.is_socket() and old != self.path and not _answers(old):
                with contextlib.suppress(OSError):
                    old.unlink()
        link = p.default_socket(self.namespace)
        if os.path.realpath(link) != str(self.path) and _answers(link):
            return  # another node's live agent on this host (a test cluster) keeps it
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(self.path, tmp)
        os.replace(tmp, link)  # dangling (its tier died) or ours: take it over atomically

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid = peer_credentials(sock)
        if uid not in (os.getuid(), 0):
            log.warning("agent %s: refused pid %d of uid %d", self.path, pid, uid)
            writer.close()
            return
        self._connections += 1
        self.clients += 1
        holder = holds.process_holder(f"engine #{self._connections}", pid)
        writing = asyncio.Lock()  # answers of concurrent pulls and of the in-order requests
        pulls: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    head = await reader.readexactly(p.HEADER_BYTES)
                    number, request = pickle.loads(await reader.readexactly(p.frame_length(head)))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                reply = self._reply(writer, writing, number, request, holder, pid)
                if isinstance(request, p.Pull):  # crosses nodes: the rest need not wait
                    task = asyncio.get_running_loop().create_task(reply)
                    pulls.add(task)
                    task.add_done_callback(pulls.discard)
                else:
                    await reply
        finally:
            for task in pulls:
                task.cancel()
            self.clients -= 1
            writer.close()
            released = await self.tier.release_holder(holder)
            if released:
                log.info("agent %s: %s closed holding %d leases; released", self.path,
                         holder, released)  # fmt: skip

    async def _reply(
        self,
        writer: asyncio.StreamWriter,
        writing: asyncio.Lock,
        number: int,
        request: p.Request,
        holder: holds.Holder,
        pid: int,
    ) -> None:
        try:
            out = (number, True, await self.answer(request, holder, pid))
        except RaykvError as e:
            out = (number, False, e)
        except Exception as e:  # never a raw error to the engine: say what failed
            log.warning("agent %s: %s failed: %r", self.path, type(request).__name__, e)
            out = (number, False, ServiceError(
                f"the node agent could not do {type(request).__name__} ({e!r}); "
                "raykv status shows the service's state"))  # fmt: skip
        if not isinstance(request, p.ONE_WAY):
            async with writing:
                writer.write(p.frame(out))
                await writer.drain()

    async def answer(self, request: p.Request, holder: holds.Holder, pid: int) -> Any:
        tier = self.tier
        match request:
            case p.Hello():
                return p.Welcome(tier.node_id, self.namespace, tuple(tier.tiers))
            case p.Reserve(model, keys, members, tenant):
                return await tier.reserve(model, keys, members, 1, holder, tenant)
            case p.LeaseGroups(model, keys, tenant):
                return await tier.lease_groups(model, keys, holder, tenant)
            case p.Apply(model, ops):
                return await tier.apply(model, ops, False)
            case p.Arena(model):
                return await tier.arena(model)
            case p.Pull(model, keys, tenant):
                return await tier.pull(model, keys, tenant)
            case p.ReleaseAll():
                return await tier.release_holder(holder)
            case p.Replica(model):
                return tier.replica_spec(model)
            case p.Counted(model, tenant, lookups, hits, misses, stored):
                tier.metrics.engine_counts(model, tenant, lookups, hits, misses, stored)
                return None
            case p.AddModel(name, layers, max_model_len, settings):
                model = served_model(name, layers, max_model_len, settings)
                plan = await self._coordinator("add_model", model)
                await tier.add_model(name, plan)  # its arena and replica exist on return
                return plan
            case p.GetModel(name):
                return await self._coordinator("get_model", name)
        raise ServiceError(f"the node agent does not know the request {request!r}")

    async def _coordinator(self, method: str, *args: Any) -> Any:
        try:
            coordinator = ray.get_actor(COORDINATOR, namespace=self.namespace)
            ref = getattr(coordinator, method).remote(*args)
            return await asyncio.wait_for(ref, COORDINATOR_TIMEOUT_S)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RaykvError):
                raise e.cause from None
            raise
        except (ValueError, ray.exceptions.RayError, TimeoutError) as e:
            raise ServiceError(
                f"the raykv coordinator did not answer {method!r} ({type(e).__name__}); "
                "it may be restarting: retry, and check raykv status"
            ) from None
