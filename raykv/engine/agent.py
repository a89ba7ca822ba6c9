"""An engine's connection to its node agent, behind a circuit breaker.

``NodeAgent.call`` sends one request (``raykv.service.node.agent_protocol``) and waits for
its answer; ``send`` does not wait (a ``Future``). One reader thread matches answers to
requests. Any failure of the connection (the agent's process died, the Ray head went down
and took the node's raykv with it, a call timed out) opens the breaker: pending calls fail
with ``AgentUnavailable``, and so does every call until a background thread has connected
again (it re-probes every ``reprobe_s``). An engine therefore never waits on a dead cache: a
call while the breaker is open fails at once, and the engine computes (a miss).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from raykv.blocks.hashing import Tenant, tenant_label
from raykv.errors import RaykvError, ServiceError
from raykv.service.node import agent_protocol as p

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 10.0  # a control call (reserve, lease, apply) the agent answers in ~0.1 ms
CONNECT_TIMEOUT_S = 1.0
REPROBE_S = 1.0
COUNT_S = 0.05  # an engine's counts go to the agent in batches this far apart


class AgentUnavailable(ServiceError):
    """The node's raykv agent is not reachable now: a miss for the engine, never a wait."""


class NodeAgent:
    """One connection to the agent at ``path`` (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
        reprobe_s: float = REPROBE_S,
        on_up: Callable[[p.Welcome], None] | None = None,
    ) -> None:
        self.path, self.timeout_s, self.reprobe_s = Path(path), timeout_s, reprobe_s
        self.on_up = on_up  # called after each (re)connection, on the connecting thread
        self.welcome: p.Welcome | None = None
        self.trips = 0  # times the breaker opened
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the socket's writes and the state below
        self._pending: dict[int, Future] = {}
        self._numbers = itertools.count(1)
        self._reprobe: threading.Thread | None = None
        self._closed = False
        self._why = "not connected yet"

    # --- state ----------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._sock is not None

    def connect(self) -> bool:
        """Connect now (once); True if the agent answered. Else the breaker is open and a
        background thread keeps trying."""
        try:
            self._connect()
            return True
        except (OSError, RaykvError, FutureTimeout) as e:
            self._trip(f"{type(e).__name__}: {e}")
            return False

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        with self._lock:
            self._sock = sock
        threading.Thread(target=self._read, args=(sock,), daemon=True,
                         name="raykv-agent-reader").start()  # fmt: skip
        welcome = self._submit(p.Hello(os.getpid())).result(CONNECT_TIMEOUT_S)
        self.welcome = welcome
        if self.on_up is not None:
            self.on_up(welcome)

    def _trip(self, why: str) -> None:
        """Open the breaker: fail what is pending, drop the socket, re-probe in the
        background."""
        if self._drop(why, trip=True):
            log.warning("raykv: the node agent at %s is gone (%s); the engine computes "
                        "without the cache until it is back", self.path, why)  # fmt: skip
        with self._lock:
            start = not self._closed and (self._reprobe is None or not self._reprobe.is_alive())
            if start:
                self._reprobe = threading.Thread(target=self._reconnect, daemon=True,
                                                 name="raykv-agent-reprobe")  # fmt: skip
        if start:
            self._reprobe.start()

    def _reconnect(self) -> None:
        while not self._closed and self._sock is None:
            time.sleep(self.reprobe_s)
            try:
                self._connect()
            except (OSError, RaykvError, FutureTimeout) as e:
                self._drop(f"{type(e).__name__}: {e}")
                continue
            log.warning("raykv: connected to the node agent at %s again", self.path)
            return

    def _drop(self, why: str, trip: bool = False) -> bool:
        """Drop the socket and fail every call pending on it; True if there was one. A
        ``trip`` is counted under the same lock, so no reader sees the breaker open (``up``
        false) before its trip is counted."""
        with self._lock:
            sock, self._sock, self._why = self._sock, None, why
            if trip and sock is not None:
                self.trips += 1
            pending, self._pending = self._pending, {}
        if sock is not None:  # shut down first: the reader's file keeps the socket open
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for f in pending.values():
            if not f.done():
                f.set_exception(self._unavailable())
        return sock is not None

    def _unavailable(self) -> AgentUnavailable:
        return AgentUnavailable(
            f"the raykv node agent at {self.path} is not reachable ({self._why}); the engine "
            "computes without the cache meanwhile and reconnects by itself (is raykv up? "
            "raykv status)"
        )

    def close(self) -> None:
        self._closed = True
        self._drop("closed")

    # --- calls ----------------------------------------------------------------------------

    def _submit(self, request: p.Request) -> Future:
        f: Future = Future()
        one_way = isinstance(request, p.ONE_WAY)
        with self._lock:
            sock = self._sock
            if sock is None:
                f.set_exception(self._unavailable())
                return f
            n = next(self._numbers)
            if not one_way:
                self._pending[n] = f
            try:
                sock.sendall(p.frame((n, request)))
            except OSError as e:
                self._pending.pop(n, None)
                failed = e
            else:
                failed = None
        if failed is not None:
            self._trip(f"send failed: {failed!r}")
            if not f.done():
                f.set_exception(self._unavailable())
        elif one_way:
            f.set_result(None)
        return f

    def send(self, request: p.Request) -> Future:
        """Send without waiting; the future holds the answer or the error."""
        return self._submit(request)

    def call(self, request: p.Request, timeout_s: float | None = None) -> Any:
        """Send and wait (``timeout_s``, default ``self.timeout_s``). Raises the agent's
        raykv error, or ``AgentUnavailable`` (the breaker opens on a timeout)."""
        return self.answer(self._submit(request), type(request).__name__, timeout_s)

    def answer(self, sent: Future, what: str, timeout_s: float | None = None) -> Any:
        """Wait for the answer of a request ``send`` sent (``what``: its name, for the
        error), as ``call`` waits: its raykv error raised, or ``AgentUnavailable``."""
        try:
            return sent.result(self.timeout_s if timeout_s is None else timeout_s)
        except FutureTimeout:
            self._trip(f"{what} took over {timeout_s or self.timeout_s:.1f}s")
            raise self._unavailable() from None

    def _read(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        try:
            while True:
                head = reader.read(p.HEADER_BYTES)
                if len(head) < p.HEADER_BYTES:
                    raise ConnectionError("the agent closed the connection")
                body = reader.read(p.frame_length(head))
                number, ok, value = pickle.loads(body)
                with self._lock:
                    f = self._pending.pop(number, None)
                if f is None:
                    continue
                if ok:
                    f.set_result(value)
                else:
                    f.set_exception(value)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
            if self._sock is sock:
                self._trip(f"{type(e).__name__}: {e}")


class EngineCounts:
    """An engine's counts for its node's metrics (``raykv status``, Prometheus), per model
    and tenant (``tenant_label``: a short hash of its key, never the salt), told the agent
    in one-way ``Counted`` messages at most every ``COUNT_S``: counting costs a request no
    round trip, and counts lost with the agent are only metrics."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self._lock = threading.Lock()  # a worker counts from its save thread
        self._counts: dict[tuple[str, str], list[int]] = {}
        self._sent_at = 0.0

    def add(
        self,
        model: str,
        tenant: Tenant,
        *,
        lookups: int = 0,
        hit_blocks: int = 0,
        miss_blocks: int = 0,
        stored_entries: int = 0,
    ) -> None:
        with self._lock:
            c = self._counts.setdefault((model, tenant_label(tenant)), [0, 0, 0, 0])
            c[0], c[1] = c[0] + lookups, c[1] + hit_blocks
            c[2], c[3] = c[2] + miss_blocks, c[3] + stored_entries
            now = time.monotonic()
            if now - self._sent_at < COUNT_S:
                return
            counts, self._counts, self._sent_at = self._counts, {}, now
        self._send(counts)

    def flush(self) -> None:
        """Send what is counted now (an engine detaching or closing)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        self._send(counts)

    def _send(self, counts: dict[tuple[str, str], list[int]]) -> None:
        for (model, label), c in counts.items():
            self.agent.send(p.Counted(model, label, *c))
