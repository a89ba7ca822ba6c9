"""The prefix index replica: which blocks this node's engines can get, in shared memory.

The node agent (the node's ``CpuTierActor``) keeps, per served model, a replica of what the
cluster's one prefix index says (``raykv.blocks.PrefixIndex`` at the coordinator) seen from
this node: per block key, whether this node's CPU tier holds it (``LOCAL_TIER``), another
member of this node does (``LOCAL_POOL``), or a member of another node (``ELSEWHERE``). The
tier sets its own bit as it publishes; the rest follows the coordinator's change feed
(``Coordinator.index_changes``), a fraction of a second behind. An engine maps the replica
and answers a lookup from it without a round trip: vectorized probes of an open-addressing
table, no lock.

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
One random memory read per key: a 32k-token prompt's 2048 keys in ~0.1 ms.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LOCAL_TIER, LOCAL_POOL, ELSEWHERE = 1, 2, 4
_MAGIC = 0x7261796B76726570  # "raykvrep"
_HEADER = 8
_PROBES = 32  # linear-probe rounds before a key counts as absent (reader) or dropped (writer)
_FLAGS = np.uint64(0xFF)
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
    if not group_keys:
        return []
    rows = np.frombuffer(b"".join(group_keys), np.uint8).reshape(len(group_keys), -1)
    gids = rows[:, :4].copy().view("<u4").ravel().astype(np.uint64)
    lanes = _fold(rows[:, 4:20].copy().view(np.uint64), gids + np.uint64(1))
    return [tuple(k) for k in lanes.tolist()]


class _Table:
    """The mapped file: header words, then one word per slot (plain ndarray views)."""

    def __init__(self, buf: np.ndarray, slots: int) -> None:
        words = buf.view(np.ndarray).view(np.uint64)  # a memmap's subclass costs every index
        self.header = words[:_HEADER]
        self.slots = words[_HEADER : _HEADER + slots]
        self.mask = slots - 1


class ReplicaWriter:
    """The agent's side: owns the file and the truth (Python sets and dicts) it mirrors.
    Changes are written in batches, one word per key."""

    def __init__(self, buf: np.ndarray, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.t = _Table(buf, spec.slots)
        self.t.header[:] = 0
        self.t.header[0], self.t.header[1] = _MAGIC, spec.slots
        self.local: set[tuple[int, int]] = set()  # keys this node's tier holds
        self.nodes: dict[tuple[int, int], int] = {}  # key -> LOCAL_POOL | ELSEWHERE bits
        self._slot: dict[tuple[int, int], int] = {}  # key -> its slot (live or dead)
        self._taken: set[int] = set()  # slots with a key
        self.dropped = 0

    # --- what changed ---------------------------------------------------------------------

    def set_local(self, group_keys: Sequence[bytes], held: bool) -> None:
        """This node's tier now holds (or no longer holds) these block keys."""
        ks = group_key_lanes(group_keys)
        if held:
            self.local.update(ks)
        else:
            self.local.difference_update(ks)
        self._write(ks)

    def set_holders(self, changes: Sequence[tuple[bytes, int]]) -> None:
        """Where members other than this node's tier hold keys: (group key, ``LOCAL_POOL``
        / ``ELSEWHERE`` bits; 0: nowhere), as the coordinator's feed says."""
        ks = group_key_lanes([gk for gk, _ in changes])
        for k, (_, bits) in zip(ks, changes, strict=True):
            if bits:
                self.nodes[k] = bits
            else:
                self.nodes.pop(k, None)
        self._write(ks)

    def clear_holders(self) -> None:
        """Forget the feed's part (a resync follows)."""
        ks, self.nodes = list(self.nodes), {}
        self._write(ks)

    # --- the table ------------------------------------------------------------------------

    def flags(self, k: tuple[int, int]) -> int:
        return (LOCAL_TIER if k in self.local else 0) | self.nodes.get(k, 0)

    def _write(self, ks: Sequence[tuple[int, int]]) -> None:
        limit = self.spec.slots // 2
        new = sum(1 for k in ks if k not in self._slot)
        if new and len(self._slot) + new > limit:
            self._rebuild()
        slots, words = [], []
        for k in dict.fromkeys(ks):
            f = self.flags(k)
            slot = self._slot.get(k)
            if slot is None:
                if not f:
                    continue
                slot = self._place(k) if len(self._slot) < limit else None
                if slot is None:  # full of live keys: this one is a miss
                    self.dropped += 1
                    continue
            slots.append(slot)
            words.append(k[0] | f)
        if slots:  # one aligned 8-byte store per slot: a reader sees a slot whole
            self.t.slots[np.array(slots)] = np.array(words, np.uint64)
        self.t.header[3] = len(self._slot)
        self.t.header[5] = self.dropped

    def _place(self, k: tuple[int, int]) -> int | None:
        mask = self.t.mask
        i = k[1] & mask
        for _ in range(_PROBES):
            if i not in self._taken:
                self._taken.add(i)
                self._slot[k] = i
                return i
            i = (i + 1) & mask
        return None

    def _rebuild(self) -> None:
        """Drop dead slots: clear the table and write the live keys again (readers see an
        odd generation meanwhile, and answer misses)."""
        t = self.t
        t.header[2] += 1
        live = [k for k in self._slot if self.flags(k)]
        t.slots[:] = 0
        self._slot.clear()
        self._taken.clear()
        self._write(live)
        t.header[2] += 1


class ReplicaReader:
    """An engine's side: maps the file read-only and probes it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self._map = np.memmap(spec.path, np.uint8, mode="r", shape=(spec.nbytes,))
        self.t = _Table(self._map, spec.slots)
        if int(self.t.header[0]) != _MAGIC or int(self.t.header[1]) != spec.slots:
            raise ValueError(f"{spec.path} is not a raykv index replica of {spec.slots} slots")

    def flags(self, lanes: np.ndarray) -> np.ndarray:
        """uint8 flags of each key (0: not held anywhere, or unknown now)."""
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
