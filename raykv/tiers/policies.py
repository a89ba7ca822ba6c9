"""Eviction policies of the CPU tier: LRU and ARC behind one small interface.

A policy only orders the READABLE keys; the tier decides what may go. ``victims(n, ok)``
picks ``n`` keys for which ``ok(key)`` holds, without changing anything, or returns None when
fewer than ``n`` such keys exist: eviction is all-or-nothing, so the tier asks first and
evicts only when every victim is found. The tier calls ``evict`` for each victim it drops.
Not thread-safe on its own: the tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol

from raykv.errors import ConfigError

Key = Hashable


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None:
        """A key became readable."""

    def touch(self, key: Key) -> None:
        """A key was hit (looked up, loaded or stored again)."""

    def remove(self, key: Key) -> None:
        """A key left the tier for another reason than eviction (failure, corruption)."""

    def evict(self, key: Key) -> None:
        """A key chosen by ``victims`` was evicted."""

    def victims(self, n: int, ok: Callable[[Key], bool]) -> list[Key] | None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Key]: ...


def _take(n: int, candidates: Iterable[Key], ok: Callable[[Key], bool]) -> list[Key]:
    out: list[Key] = []
    for key in candidates:
        if len(out) == n:
            break
        if ok(key):
            out.append(key)
    return out


class LRUPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    evict = remove

    def victims(self, n: int, ok: Callable[[Key], bool]) -> list[Key] | None:
        out = _take(n, self._order, ok)
        return out if len(out) == n else None

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._order)


class ARCPolicy:
    """Adaptive replacement cache (Megiddo & Modha): T1 holds keys seen once, T2 keys seen
    at least twice; ghost lists B1/B2 remember recent evictions and move the target size
    ``p`` of T1 toward whichever list would have hit. Victims come from T1 while it is over
    target, else from T2, falling back to the other list when the first runs out of keys
    that may be evicted (blocks being read or written stay)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:  # T1 was too small: grow its target
            self.p = min(c, self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # T2 was too small: shrink T1's target
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        elif key in self.t1 or key in self.t2:
            self.touch(key)
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()

    def victims(self, n: int, ok: Callable[[Key], bool]) -> list[Key] | None:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        if not first:
            first, second = second, first
        out = _take(n, first, ok)
        out += _take(n - len(out), second, ok)
        return out if len(out) == n else None

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while len(self.b1) > max(0, c - len(self.t1)):
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) + len(self.t1) + len(self.t2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[Key]:
        yield from self.t1
        yield from self.t2


POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}"
        ) from None
