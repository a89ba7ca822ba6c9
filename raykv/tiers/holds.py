"""Holds: the leases (read references) and reservations (blocks being written) a ``CpuTier``
hands out, each with a holder and a deadline.

A hold that outlives its deadline, or whose holder is gone, is reclaimed by the tier: its
read references dropped, its reserved blocks freed. So a process that dies, or forgets to
finish, pins nothing for longer than the deadline. A hold is known by its id only while it
is live: the finish of a reclaimed one finds no hold and changes nothing. The deadlines sit
in a heap, so finding the expired holds costs nothing while none is due.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

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
