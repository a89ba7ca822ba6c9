"""Who holds a CPU-tier lease or reservation: a process of the tier's node, named so that the
tier can tell when it is gone.

A ``Holder`` is the process's pid plus what makes the pid unambiguous: the host's boot id,
the pid namespace and the process's start time (a reused pid starts later). ``gone`` says
True only when sure: same boot, same pid namespace as the asking process, and no process
with that pid and start time. A holder in another container (another pid namespace) or on
another host is never judged gone; its holds end at their deadline instead. Ray actors and
workers are such processes: a killed engine, pool or driver is seen gone on the tier's next
sweep, and its leases are released right away.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import cache

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
