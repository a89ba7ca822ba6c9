"""StoreFence: GPU blocks with a store in flight are not handed out again (invariant 9).

The offload engine fences a store's GPU block ids before the copy starts and releases them
when the store completes or fails. The block pool (``raykv.blocks``) must not reuse a fenced
block: pass the block manager's reference hooks, ``StoreFence(hold=manager.hold_blocks,
release=manager.release_blocks)``, so a fenced block keeps a reference and is neither free
nor counted free until its store is done (tiers may import blocks, never the reverse). An
allocator of the caller's own, which ``BlockPool`` is not, can instead ask ``can_reuse`` and
subscribe to ``on_release`` to put deferred blocks back. A block can be fenced by several
stores at once (a shared prefix stored by two requests): a count per block, released per job.
The blocks one store fences are a set, the count kept only for those several fence: a job's
thousands of blocks that no other store fences (the usual case) go in and out in one set
operation each way, not a Python step per block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable

from raykv.tiers.jobs import NULL_BLOCK


class StoreFence:
    def __init__(
        self,
        hold: Callable[[tuple[int, ...]], None] | None = None,
        release: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        self._hold, self._release = hold, release
        self._lock = threading.Lock()
        self._once: set[int] = set()  # blocks one store fences
        self._more: dict[int, int] = {}  # blocks several fence (or one, twice): how many
        self._jobs: dict[Hashable, tuple[int, ...]] = {}
        self._listeners: list[Callable[[tuple[int, ...]], None]] = []

    def fence(self, job_id: Hashable, block_ids: Iterable[int]) -> None:
        ids = tuple(block_ids)
        if NULL_BLOCK in ids:  # invariant 3: null is nobody's
            ids = tuple(b for b in ids if b != NULL_BLOCK)
        with self._lock:
            if job_id in self._jobs:
                raise ValueError(f"store job {job_id!r} is already fenced")
            if self._hold is not None and ids:
                self._hold(ids)  # first, so a failing hook leaves nothing fenced
            self._jobs[job_id] = ids
            once, more, new = self._once, self._more, set(ids)
            if len(new) == len(ids) and once.isdisjoint(new) and more.keys().isdisjoint(new):
                once |= new  # blocks no store fences yet, each once
                return
            for b in ids:
                if b in more:
                    more[b] += 1
                elif b in once:
                    once.remove(b)
                    more[b] = 2
                else:
                    once.add(b)

    def release(self, job_id: Hashable) -> tuple[int, ...]:
        """Lift a job's fence; returns the block ids that are no longer fenced at all."""
        with self._lock:
            ids = self._jobs.pop(job_id, ())
            once, more = self._once, self._more
            if not more or more.keys().isdisjoint(ids):  # each fenced once, by this job
                once.difference_update(ids)
                freed: tuple[int, ...] | list[int] = ids
            else:
                freed = []
                for b in ids:
                    if b not in more:
                        once.remove(b)
                        freed.append(b)
                    elif more[b] == 2:
                        del more[b]
                        once.add(b)
                    else:
                        more[b] -= 1
            if self._release is not None and ids:
                self._release(ids)
            listeners = list(self._listeners)
        out = tuple(freed)
        if out:
            for cb in listeners:
                cb(out)
        return out

    def is_fenced(self, block_id: int) -> bool:
        with self._lock:
            return block_id in self._once or block_id in self._more

    def can_reuse(self, block_id: int) -> bool:
        """The hook for the block pool: may ``block_id`` be handed out now?"""
        return not self.is_fenced(block_id)

    def fenced_blocks(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._once).union(self._more)

    def jobs(self) -> tuple[Hashable, ...]:
        with self._lock:
            return tuple(self._jobs)

    def on_release(self, callback: Callable[[tuple[int, ...]], None]) -> None:
        """Call ``callback(block_ids)`` whenever blocks stop being fenced."""
        with self._lock:
            self._listeners.append(callback)
