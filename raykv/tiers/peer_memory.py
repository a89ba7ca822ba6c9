"""GPU memory other processes of the host can map: a pool's KV on CUDA, read in place.

The GPU analogue of ``raykv.tiers.shm``. A CUDA pool's tensors are one allocation made with
the driver's virtual memory API (``cuMemCreate``, in raykv's extension,
``kernels/peer_memory.cpp``), exportable as a POSIX file descriptor. Its owner serves the
descriptor on an abstract Unix socket (``PeerExport``); a process on the same host that asks
(``open_peer``) receives it (``SCM_RIGHTS``), maps the memory for its own GPU and reads the
owner's blocks over NVLink with its own kernel (``raykv.ops.pools.PoolCopy``). This works
between processes that each see only their own GPU (``CUDA_VISIBLE_DEVICES`` under Ray),
where torch's CUDA IPC handles do not; an engine on the pool's own GPU maps it the same way.

Who may ask: only processes of the same user (the socket checks ``SO_PEERCRED``; any such
process could read the owner's memory through ``ptrace`` anyway). The socket's name carries
the owner's pid and a random tag, so a stale name finds nobody.

Lifetime: the memory lives while any process maps it (the driver counts references), so a
reader's mapping stays valid after the owner exits; it frees its mapping with the tensor.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass

import torch

from raykv.errors import TransportError

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes between the tensors carved out of one allocation (vector loads)
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PeerSpec:
    """What another process needs to map an exported allocation: the owner's socket name (an
    abstract Unix socket), the allocation's size, and where each tensor sits in it."""

    socket: str
    nbytes: int
    tensors: tuple[tuple[int, tuple[int, ...]], ...]  # (byte offset, uint8 shape) per tensor


def _module():
    from raykv import ops

    m = ops.kernel_module()
    return m if m is not None and hasattr(m, "exportable_zeros") else None


def available(device: torch.device) -> bool:
    """Whether tensors on ``device`` can be made exportable here (a CUDA device, raykv's
    extension built, the driver's virtual memory API present)."""
    if torch.device(device).type != "cuda":
        return False
    m = _module()
    return m is not None and bool(m.peer_memory_available())


def layout(shapes: list[tuple[int, ...]]) -> tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]:
    """(total bytes, (offset, shape) per uint8 tensor) of ``shapes`` packed into one
    allocation, each tensor starting at a multiple of 256 bytes."""
    out, at = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append((at, tuple(shape)))
        at += -(-n // _ALIGN) * _ALIGN
    return max(at, _ALIGN), tuple(out)


def carve(
    buf: torch.Tensor, tensors: tuple[tuple[int, tuple[int, ...]], ...]
) -> list[torch.Tensor]:
    """The uint8 tensors ``layout`` placed in ``buf`` (views of it)."""
    views = []
    for offset, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        views.append(buf[offset : offset + n].view(shape))
    return views


class PeerExport:
    """One exportable allocation of this process and the thread that hands its descriptor to
    processes of the same user that ask (``open_peer``)."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device) -> None:
        nbytes, tensors = layout(shapes)
        with torch.cuda.device(device):
            self.buffer, self._fd = _module().exportable_zeros(nbytes)
        self.tensors = carve(self.buffer, tensors)
        name = f"raykv-peer-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(16)
        self.spec = PeerSpec(name, nbytes, tensors)
        threading.Thread(target=self._serve, name="raykv-peer-export", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                    pid, uid, _gid = struct.unpack("3i", creds)
                    if uid != os.getuid():
                        log.warning("peer memory: refused pid %d of uid %d", pid, uid)
                        continue
                    socket.send_fds(conn, [struct.pack("q", self.spec.nbytes)], [self._fd])
                except OSError as e:
                    log.debug("peer memory: a reader left early: %r", e)

    def close(self) -> None:
        self._sock.close()


def open_peer(spec: PeerSpec, device: torch.device) -> list[torch.Tensor]:
    """Maps another process's ``PeerExport`` (same host, same user) for ``device``: its
    tensors, readable (and writable) by this process's kernels. TransportError where the
    owner is gone or the memory cannot be mapped here."""
    m = _module()
    if m is None:
        raise TransportError("peer memory: raykv's CUDA extension is not loaded here")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_S)
            s.connect("\0" + spec.socket)
            msg, fds, _, _ = socket.recv_fds(s, 8, 1)
    except OSError as e:
        raise TransportError(f"peer memory: {spec.socket} did not answer ({e})") from e
    if len(fds) != 1 or len(msg) != 8 or struct.unpack("q", msg)[0] != spec.nbytes:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"peer memory: {spec.socket} sent no descriptor of {spec.nbytes} B")
    try:
        with torch.cuda.device(device):
            buf = m.import_fd(fds[0], spec.nbytes)  # owns the descriptor from here on
    except RuntimeError as e:
        raise TransportError(f"peer memory: cannot map {spec.socket} here ({e})") from e
    return carve(buf, spec.tensors)


def open_tensors(handle: PeerSpec | list, device: torch.device) -> list[torch.Tensor]:
    """The raw tensors another process of this host shares, mapped here: a ``PeerSpec``
    (``open_peer``, for ``device``) or a CPU pool's ``SharedSpec`` list (``/dev/shm``)."""
    if isinstance(handle, PeerSpec):
        return open_peer(handle, device)
    from raykv.tiers import shm

    return [shm.attach(spec) for spec in handle]
