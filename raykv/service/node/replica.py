"""The prefix index replica: which blocks this node's engines can get, in shared memory.

The node agent (the node's ``CpuTierActor``) keeps, per served model, a replica of what the
cluster's one prefix index says (``raykv.blocks.PrefixIndex`` at the coordinator) seen from
this node: per block key, whether this node's CPU tier holds it (``LOCAL_TIER``), another
member of this node does (``LOCAL_POOL``), or a member of another node (``ELSEWHERE``). The
tier sets its own bit as it publishes; the rest follows the coordinator's change feed
(``Coordinator.index_changes``), a fraction of a second behind. An engine maps the replica
and answers a lookup from it without a round trip: probes of an open-addressing table (one
native pass, else vectorized), no lock.

Why no lock is needed: a replica's answer only decides how many tokens an engine asks to
load. The load itself leases the blocks at the tier by their full keys and verifies every
byte (invariant 12), so a stale answer becomes a miss at load time, never wrong KV. Each
slot is one 8-byte word (a key's 56-bit fingerprint, then its 8 flag bits), written with one
aligned store, so a reader never sees half a slot. While the writer rebuilds the table (dead
slots cleared) its ``generation`` is odd, and a reader that sees it odd or changed answers a
miss.

Layout of the file (little endian): 8 header words (``_MAGIC``, slots, generation, live
keys, 0, keys dropped for want of room, 2 spare), then ``slots`` words (0: never used). A
key's slot starts at the block hash's second 8 bytes (masked) and its fingerprint is the top
56 bits of its first 8 bytes, the group id folded into both: two blocks agree
on both with probability ~2**-56 per probe (then a miss at load time, as any stale answer).
One random memory read per key: a 32k-token prompt's 2048 keys in ~0.02 ms natively
(~0.08 ms in numpy's vector steps).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from raykv.blocks.hashing import native_module

LOCAL_TIER, LOCAL_POOL, ELSEWHERE = 1, 2, 4
_MAGIC = 0x7261796B76726570  # "raykvrep"
_HEADER = 8
_PROBES = 32  # linear-probe rounds before a key counts as absent (reader) or dropped (writer)
_FLAGS = np.uint64(0xFF)
_NODE_BITS = LOCAL_POOL | ELSEWHERE  # the feed's part of a key's flags
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
# a group's keys are other keys than another group's for the same hash: its id, spread over
# every bit, is folded into the fingerprint and the home slot alike
_GROUP_FP, _GROUP_HOME = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
SLOTS_ENV = "RAYKV_REPLICA_SLOTS"
DEFAULT_SLOTS = 1 << 21  # 16 MiB per model and node: 1M keys; more are dropped (misses)


@dataclass(frozen=True)
class ReplicaSpec:
    """What an engine needs to map a replica: its file and slot count."""

    path: str
    slots: int

    @property
    def nbytes(self) -> int:
        return (_HEADER + self.slots) * 8


def replica_slots() -> int:
    """Slots per replica (``RAYKV_REPLICA_SLOTS``, rounded up to a power of two)."""
    want = int(os.environ.get(SLOTS_ENV, DEFAULT_SLOTS))
    return 1 << max(want - 1, 1023).bit_length()


def key_lanes(hashes: Sequence[bytes] | bytes | np.ndarray, group_id: int) -> np.ndarray:
    """uint64 [n, 2] replica keys of ``hashes`` (32-byte block hashes: a list, joined, or
    their uint64 [n, 4] view) of group ``group_id``: (fingerprint << 8, home) with a
    fingerprint never 0."""
    if not isinstance(hashes, np.ndarray):
        blob = hashes if isinstance(hashes, bytes) else b"".join(hashes)
        hashes = np.frombuffer(blob, np.uint64).reshape(-1, 4)
    return _fold(hashes[:, :2].copy(), np.uint64(group_id + 1))


def _fold(lanes: np.ndarray, groups: np.ndarray | np.uint64) -> np.ndarray:
    """The hash's two lanes with the group (id + 1, one or per key) folded in, as
    (fingerprint, home)."""
    with np.errstate(over="ignore"):
        lanes[:, 0] ^= groups * _GROUP_FP
        lanes[:, 1] ^= groups * _GROUP_HOME
    lanes[:, 0] &= ~_FLAGS
    lanes[lanes[:, 0] == 0, 0] = np.uint64(1 << 8)  # 0 marks an unused slot
    return lanes


def group_key_lanes(group_keys: Sequence[bytes]) -> list[tuple[int, int]]:
    """The replica keys of service group keys (4 bytes of group id, then the 32-byte hash),
    as ``key_lanes`` makes them."""
    return list(map(tuple, group_key_array(group_keys).tolist()))


def group_key_array(group_keys: Sequence[bytes]) -> np.ndarray:
    """``group_key_lanes`` as one uint64 [n, 2] array (fingerprint << 8, home)."""
    if not len(group_keys):
        return np.zeros((0, 2), np.uint64)
    rows = np.frombuffer(b"".join(group_keys), np.uint8).reshape(len(group_keys), -1)
    gids = rows[:, :4].copy().view("<u4").ravel().astype(np.uint64)
    return _fold(rows[:, 4:20].copy().view(np.uint64), gids + np.uint64(1))


class _Table:
    """The mapped file: header words, then one word per slot (plain ndarray views)."""

    def __init__(self, buf: np.ndarray, slots: int) -> None:
        words = buf.view(np.ndarray).view(np.uint64)  # a memmap's subclass costs every index
        self.header = words[:_HEADER]
        self.slots = words[_HEADER : _HEADER + slots]
        self.mask = slots - 1


class ReplicaWriter:
    """The agent's side: owns the file and the truth it mirrors, and writes changes in
    batches, one word per key, in vector operations (a store's 2048 keys, and the feed's
    echo of them, cost no Python step per key on the agent's event loop; issue 45).

    The truth of a key with a slot is its slot's word itself (its fingerprint and flags,
    the writer keeping each slot's home lane beside it, ``_home``, so that it matches keys
    exactly, never by fingerprint alone); a slot whose flags went to 0 stays taken (dead)
    until a rebuild. A key with flags but no slot (the table had no room: ``dropped``) keeps
    them in ``_homeless``, so a later write of it still starts from its truth."""

    def __init__(self, buf: np.ndarray, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.t = _Table(buf, spec.slots)
        self.t.header[:] = 0
        self.t.header[0], self.t.header[1] = _MAGIC, spec.slots
        self._home = np.empty(spec.slots, np.uint64)  # each taken slot's key's home lane
        # every page written now (a few ms, once): a store's keys land on random pages of
        # both, and a first touch of each on its path costs a page fault
        self.t.slots[:] = 0
        self._home[:] = 0
        self._used = 0  # slots with a key (live or dead)
        self._homeless: dict[tuple[int, int], int] = {}  # key -> its flags, no slot
        self.dropped = 0

    # --- what changed ---------------------------------------------------------------------

    def set_local(self, group_keys: Sequence[bytes], held: bool) -> None:
        """This node's tier now holds (or no longer holds) these block keys."""
        lanes = group_key_array(group_keys)
        keep = _last_of_each(lanes)
        if keep is not None:
            lanes = lanes[keep]
        if held:
            self._update(lanes, lambda old: old | np.uint64(LOCAL_TIER))
        else:
            self._update(lanes, lambda old: old & ~np.uint64(LOCAL_TIER))

    def set_holders(self, changes: Sequence[tuple[bytes, int]]) -> None:
        """Where members other than this node's tier hold keys: (group key, ``LOCAL_POOL``
        / ``ELSEWHERE`` bits; 0: nowhere), as the coordinator's feed says (a key named
        twice: its last bits)."""
        lanes = group_key_array(list(map(_FIRST, changes)))
        bits = np.fromiter(map(_SECOND, changes), np.uint64, len(changes))
        keep = _last_of_each(lanes)
        if keep is not None:
            lanes, bits = lanes[keep], bits[keep]
        self._update(lanes, lambda old: (old & np.uint64(LOCAL_TIER)) | bits)

    def clear_holders(self) -> None:
        """Forget the feed's part (a resync follows)."""
        words = self.t.slots
        held = np.flatnonzero(words & np.uint64(_NODE_BITS))
        words[held] &= ~np.uint64(_NODE_BITS)  # one word each, as every write
        homeless = [k for k, f in self._homeless.items() if f & _NODE_BITS]
        lanes = np.array(homeless, np.uint64).reshape(-1, 2)
        self._update(lanes, lambda old: old & np.uint64(LOCAL_TIER))

    # --- the table ------------------------------------------------------------------------

    def _update(self, lanes: np.ndarray, flags_of: Callable[[np.ndarray], np.ndarray]) -> None:
        """Give keys ``lanes`` (distinct) the flags ``flags_of(their flags now)``: keys with
        a slot get their word rewritten, keys without one that now have flags a slot (a
        rebuild first when they would fill the table past half), or are dropped (misses)."""
        fps, homes = lanes[:, 0], lanes[:, 1]
        words = self.t.slots
        slot = self._find(fps, homes)
        found = slot >= 0
        old = np.zeros(len(lanes), np.uint64)
        old[found] = words[slot[found]] & _FLAGS
        if self._homeless:  # keys that had no room: their flags are kept aside
            lost = np.flatnonzero(~found)
            known = list(map(self._homeless.pop, map(tuple, lanes[lost].tolist()), repeat(0)))
            old[lost] = np.array(known, np.uint64)
        new = flags_of(old) & _FLAGS
        # one aligned 8-byte store per slot: a reader sees a slot whole
        words[slot[found]] = fps[found] | new[found]
        place = np.flatnonzero(~found & (new != 0))
        limit = self.spec.slots // 2
        if len(place) and self._used + len(place) > limit:
            self._rebuild()  # dead slots cleared first, as the keys found were just written
        room = max(limit - self._used, 0)
        placed = self._place(fps[place[:room]], homes[place[:room]], new[place[:room]])
        self._drop(lanes[place[room:]], new[place[room:]])
        self._drop(lanes[place[:room]][~placed], new[place[:room]][~placed])
        self.t.header[3] = self._used
        self.t.header[5] = self.dropped

    def _find(self, fps: np.ndarray, homes: np.ndarray) -> np.ndarray:
        """Each key's slot (-1: none), probed as a reader probes, matched on both lanes."""
        words, mask = self.t.slots, self.t.mask
        out = np.full(len(fps), -1, np.int64)
        todo = np.arange(len(fps))
        idx = _home_slots(homes, mask)
        for _ in range(_PROBES):
            if not len(todo):
                break
            w = words[idx]
            hit = (w & ~_FLAGS) == fps[todo]
            hit[hit] = self._home[idx[hit]] == homes[todo[hit]]  # only where the print is
            out[todo[hit]] = idx[hit]
            more = ~hit & (w != 0)  # another key's slot: probe on
            todo, idx = todo[more], (idx[more] + 1) & mask
        return out

    def _place(self, fps: np.ndarray, homes: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """Put new keys (distinct, none in the table) into free slots, each within
        ``_PROBES`` of its home as a reader probes; returns which found one. Keys probe in
        rounds, all at once; of keys after one free slot, the first takes it and the rest
        see it taken in the next round."""
        words, mask = self.t.slots, self.t.mask
        ok = np.zeros(len(fps), bool)
        todo = np.arange(len(fps))
        idx, tries = _home_slots(homes, mask), np.zeros(len(fps), np.int64)
        while len(todo):
            free = words[idx] == 0
            won = free.copy()
            at = np.flatnonzero(free)
            after = np.sort(idx[at])
            if (after[1:] == after[:-1]).any():  # keys after one free slot (rare): the first
                order = np.argsort(idx[at], kind="stable")
                after = idx[at][order]
                won[at[order[1:][after[1:] == after[:-1]]]] = False
            got, slots = todo[won], idx[won]
            words[slots] = fps[got] | flags[got]
            self._home[slots] = homes[got]
            ok[got] = True
            self._used += len(got)
            step = (~free).astype(np.int64)  # taken: the next slot; one another key took: again
            rest = ~won
            tries, idx, todo = tries[rest] + step[rest], (idx[rest] + step[rest]) & mask, todo[rest]
            live = tries < _PROBES  # the rest: no room near their home, dropped
            todo, idx, tries = todo[live], idx[live], tries[live]
        return ok

    def _drop(self, lanes: np.ndarray, flags: np.ndarray) -> None:
        """Keys with flags that got no slot: misses, their flags kept aside."""
        if len(lanes):
            self.dropped += len(lanes)
            self._homeless.update(zip(map(tuple, lanes.tolist()), flags.tolist(), strict=True))

    def _rebuild(self) -> None:
        """Drop dead slots: clear the table and write the live keys again (readers see an
        odd generation meanwhile, and answer misses)."""
        t = self.t
        t.header[2] += 1
        live = np.flatnonzero(t.slots & _FLAGS)
        words, homes = t.slots[live], self._home[live]
        t.slots[:] = 0
        self._used = 0
        placed = self._place(words & ~_FLAGS, homes, words & _FLAGS)
        lanes = np.stack([words & ~_FLAGS, homes], axis=1)
        self._drop(lanes[~placed], (words & _FLAGS)[~placed])
        t.header[2] += 1


def _home_slots(homes: np.ndarray, mask: int) -> np.ndarray:
    """Each home lane's first slot, as int64 indices (numpy indexes with those fastest)."""
    return (homes & np.uint64(mask)).astype(np.int64)


def _last_of_each(lanes: np.ndarray) -> np.ndarray | None:
    """Indices of the last occurrence of each distinct key of ``lanes``, in order; None
    when every key is distinct (as a rule: their 64-bit home lanes differ, one sort)."""
    if len(lanes) < 2:
        return None
    homes = np.sort(lanes[:, 1])
    if not (homes[1:] == homes[:-1]).any():
        return None
    last = dict(zip(map(tuple, lanes.tolist()), range(len(lanes)), strict=True))
    return np.array(sorted(last.values()), np.int64)


class ReplicaReader:
    """An engine's side: maps the file read-only and probes it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self._map = np.memmap(spec.path, np.uint8, mode="r", shape=(spec.nbytes,))
        self.t = _Table(self._map, spec.slots)
        if int(self.t.header[0]) != _MAGIC or int(self.t.header[1]) != spec.slots:
            raise ValueError(f"{spec.path} is not a raykv index replica of {spec.slots} slots")

    def hash_flags(self, hashes: bytes, group_id: int, step: int = 1) -> np.ndarray:
        """uint8 flags of the keys of hashes ``step - 1``, ``2 * step - 1``, ... of
        ``hashes`` (32-byte block hashes, joined: a lookup's form; a group whose block is
        ``step`` hash blocks names each by the last) in group ``group_id``. One native pass
        (``kernels/block_hash.cpp``'s ``replica_flags``) where raykv's extension is loaded,
        else ``flags`` of their ``key_lanes``: the same answer (tests hold them to it)."""
        n = len(hashes) // 32 // step
        native = native_module()
        if native is None:
            lanes = np.frombuffer(hashes, np.uint64).reshape(-1, 4)[step - 1 :: step][:n]
            return self.flags(key_lanes(lanes, group_id))
        t, out = self.t, np.zeros(n, np.uint8)
        gen = int(t.header[2])
        if gen & 1 or not n:
            return out
        native.replica_flags(t.slots, hashes, step - 1, step, group_id + 1, _PROBES, out)
        if int(t.header[2]) != gen:
            out[:] = 0  # rebuilt meanwhile: a miss this time
        return out

    def flags(self, lanes: np.ndarray) -> np.ndarray:
        """uint8 flags of each key (``key_lanes``; 0: not held anywhere, or unknown now)."""
        t, n = self.t, len(lanes)
        out = np.zeros(n, np.uint8)
        gen = int(t.header[2])
        if gen & 1 or not n:
            return out
        mask = np.uint64(t.mask)
        fps, idx = lanes[:, 0], lanes[:, 1] & mask
        words = t.slots[idx]  # the first round: every key (most end here)
        hit = (words & ~_FLAGS) == fps
        out[hit] = words[hit] & _FLAGS
        more = ~hit & (words != 0)  # another key's slot: probe on
        todo = np.flatnonzero(more)
        idx = (idx[todo] + np.uint64(1)) & mask
        for _ in range(_PROBES - 1):
            if not len(todo):
                break
            words = t.slots[idx]
            hit = (words & ~_FLAGS) == fps[todo]
            out[todo[hit]] = words[hit] & _FLAGS
            more = ~hit & (words != 0)
            todo, idx = todo[more], (idx[more] + np.uint64(1)) & mask
        if int(t.header[2]) != gen:
            out[:] = 0  # rebuilt meanwhile: a miss this time
        return out

    def close(self) -> None:
        self._map._mmap.close()  # type: ignore[attr-defined]
