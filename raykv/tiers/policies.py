"""Eviction policies of the CPU tier: LRU and ARC behind one small interface.

A policy only orders the READABLE keys; the tier decides what may go. ``victims(n, ok)``
picks ``n`` keys for which ``ok(key)`` holds, without changing anything, or returns None when
fewer than ``n`` such keys exist: eviction is all-or-nothing, so the tier asks first and
evicts only when every victim is found. The tier calls ``evict`` for each victim it drops.
Not thread-safe on its own: the tier holds its lock around every call.

A store or load moves thousands of keys at once: ``insert_all`` / ``touch_all`` /
``evict_all`` hand a policy the whole batch (LRU works its ordered dict directly, without a
policy call per key; a policy without these methods gets one per key), and an ``ok`` with a
``many(keys)`` method (the tier's) is asked for a batch of candidates at once.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
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
    """The first ``n`` ``candidates`` that are ``ok`` (fewer where they run out)."""
    many = getattr(ok, "many", None)
    out: list[Key] = []
    if many is not None:  # in batches of the number still missing: the same keys, in order
        it, least = iter(candidates), 16
        while len(out) < n:
            batch = list(itertools.islice(it, max(n - len(out), least)))
            if not batch:
                break
            out += itertools.compress(batch, many(batch))
            # few qualify (a tenant's own entries among everyone's, over its quota): larger
            # batches, so a scan is a few numpy calls, not one per 16 keys
            least *= 2
        return out[:n]
    for key in candidates:
        if len(out) == n:
            break
        if ok(key):
            out.append(key)
    return out


def insert_all(policy: EvictionPolicy, keys: Sequence[Key]) -> None:
    """``policy.insert`` of each key, in order."""
    bulk = getattr(policy, "insert_all", None)
    if bulk is not None:
        bulk(keys)
        return
    for key in keys:
        policy.insert(key)


def touch_all(policy: EvictionPolicy, keys: Sequence[Key]) -> None:
    """``policy.touch`` of each key, in order."""
    bulk = getattr(policy, "touch_all", None)
    if bulk is not None:
        bulk(keys)
        return
    for key in keys:
        policy.touch(key)


def evict_all(policy: EvictionPolicy, keys: Sequence[Key]) -> None:
    """``policy.evict`` of each key, in order."""
    bulk = getattr(policy, "evict_all", None)
    if bulk is not None:
        bulk(keys)
        return
    for key in keys:
        policy.evict(key)


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

    def insert_all(self, keys: Sequence[Key]) -> None:
        order, before = self._order, len(self._order)
        for key in keys:  # new keys (the rule) land at the end in order
            order[key] = None
        if len(order) - before != len(keys):  # some were there already (or repeat): to the end
            deque(map(order.move_to_end, keys), 0)

    def touch_all(self, keys: Sequence[Key]) -> None:
        try:
            deque(map(self._order.move_to_end, keys), 0)
        except KeyError:  # one is not here: the rest key by key (moved again: same order)
            for key in keys:
                self.touch(key)

    def evict_all(self, keys: Sequence[Key]) -> None:
        deque(map(self._order.pop, keys, itertools.repeat(None)), 0)  # no Python step each

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
