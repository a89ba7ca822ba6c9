"""Holds: the leases (read references) and reservations (blocks being written) a ``CpuTier``
hands out, each with a holder and a deadline.

A hold that outlives its deadline, or whose holder is gone, is reclaimed by the tier: its
read references dropped, its reserved blocks freed. So a process that dies, or forgets to
finish, pins nothing for longer than the deadline. A hold is known by its id only while it
is live: the finish of a reclaimed one finds no hold and changes nothing. The deadlines sit
in a heap, so finding the expired holds costs nothing while none is due.

The holder the service names is a process of the tier's node (a ``Holder``), so that the
tier can tell when it is gone: the process's pid plus what makes the pid unambiguous: the
host's boot id, the pid namespace and the process's start time (a reused pid starts later).
``gone`` says True only when sure: same boot, same pid namespace as the asking process, and
no process with that pid and start time. A holder in another container (another pid namespace) or on
another host is never judged gone; its holds end at their deadline instead. Ray actors and
workers are such processes: a killed engine, pool or driver is seen gone on the tier's next
sweep, and its leases are released right away.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache

from raykv.errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0  # a lease or reservation not finished by then is reclaimed
LOAD, STORE = "load", "store"


def check_timeout(seconds: float, what: str = "lease timeout") -> float:
    """``seconds`` as a positive float, or ConfigError naming the value and the fix."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"{what} must be a positive number of seconds, got {seconds!r}; pass e.g. "
            f"{DEFAULT_TIMEOUT_S:g} (how long a lease or reservation may stay unfinished)"
        )
    return value


@dataclass
class Hold:
    """One live lease (``LOAD``: a read reference per entry in ``blocks``, repeats allowed;
    the tier keeps them as its int64 array) or reservation (``STORE``: ``blocks`` still being
    written under it)."""

    id: int
    kind: str
    holder: Hashable
    deadline: float
    blocks: Sequence[int] = field(default_factory=list)


class Holds:
    """The live holds of one tier: by id, by holder, by deadline. Not thread-safe: the tier
    calls it under its lock."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = check_timeout(timeout_s)
        self._ids = itertools.count(1)
        self._live: dict[int, Hold] = {}
        self._by_holder: dict[Hashable, set[int]] = {}
        self._due: list[tuple[float, int]] = []  # (deadline, id); closed ids are skipped

    def open(
        self,
        kind: str,
        holder: Hashable,
        blocks: Sequence[int],
        now: float,
        timeout_s: float | None,
    ) -> Hold:
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        h = Hold(next(self._ids), kind, holder, now + t, blocks)
        self._live[h.id] = h
        self._by_holder.setdefault(holder, set()).add(h.id)
        heapq.heappush(self._due, (h.deadline, h.id))
        return h

    def get(self, hold_id: int, kind: str) -> Hold | None:
        h = self._live.get(hold_id)
        return h if h is not None and h.kind == kind else None

    def close(self, hold: Hold) -> None:
        """Forget ``hold`` (finished or reclaimed); its heap entry is skipped when due."""
        if self._live.pop(hold.id, None) is None:
            return
        ids = self._by_holder[hold.holder]
        ids.discard(hold.id)
        if not ids:
            del self._by_holder[hold.holder]
        if self._due and self._due[0][1] == hold.id:
            heapq.heappop(self._due)  # the common case: the oldest hold finishes first
        elif len(self._due) > 64 and len(self._due) > 4 * len(self._live):
            self._due = [(d, i) for d, i in self._due if i in self._live]  # closed ones out
            heapq.heapify(self._due)

    def due(self, now: float, limit: int | None = None) -> list[Hold]:
        """Live holds whose deadline passed (at most ``limit``), oldest first; still live:
        the caller reclaims and closes them."""
        out: list[Hold] = []
        while self._due and self._due[0][0] <= now and (limit is None or len(out) < limit):
            _, hold_id = heapq.heappop(self._due)
            h = self._live.get(hold_id)
            if h is not None:
                out.append(h)
        return out

    def of(self, holder: Hashable) -> list[Hold]:
        return [self._live[i] for i in sorted(self._by_holder.get(holder, ()))]

    def holders(self) -> list[Hashable]:
        return list(self._by_holder)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Hold]:
        return iter(list(self._live.values()))


# -- who holds: a process of the tier's node, and whether it is gone ------------------------

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class Holder:
    name: str  # for logs: what the process is (a pool's name, "engine", ...)
    pid: int
    start: int  # start time, clock ticks after boot (/proc/<pid>/stat field 22); 0: unknown
    pidns: int  # inode of /proc/<pid>/ns/pid; 0: unknown
    boot: str  # the host's boot id; "": unknown

    def __str__(self) -> str:
        return f"{self.name or 'process'} (pid {self.pid})"


def _start_time(pid: int | str) -> int:
    """The start time of process ``pid``; 0 if unknown; -1 if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return -1
    except OSError:
        return 0
    try:  # the command name (field 2) may hold spaces: count from its closing paren
        fields = stat[stat.rindex(b")") + 2 :].split()
        return -1 if fields[0] in (b"Z", b"X") else int(fields[19])  # a zombie exited
    except (ValueError, IndexError):
        return 0


def _pidns(pid: int | str) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


@cache
def _boot() -> str:
    with contextlib.suppress(OSError), open(_BOOT_ID) as f:
        return f.read().strip()
    return ""


def this_process(name: str = "") -> Holder:
    """The calling process as a holder named ``name`` (a forked child is another)."""
    return _holder(name, os.getpid())


def process_holder(name: str, pid: int) -> Holder:
    """Process ``pid`` of this host and pid namespace as a holder named ``name``."""
    return _holder(name, pid)


@cache
def _holder(name: str, pid: int) -> Holder:
    return Holder(name, pid, max(_start_time(pid), 0), _pidns(pid), _boot())


def gone(holder: object) -> bool:
    """Whether ``holder`` (a ``Holder``; anything else is never gone) surely exited."""
    if not isinstance(holder, Holder) or not holder.boot or not holder.pidns:
        return False
    if holder.boot != _boot() or holder.pidns != _pidns("self"):
        return False  # another host or container: this process cannot see it
    start = _start_time(holder.pid)
    return start == -1 or (start > 0 and holder.start > 0 and start != holder.start)
