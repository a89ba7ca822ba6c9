"""Admission for the lower tiers: which blocks the CPU tier evicts are worth writing below.

A lower tier (disk) is written only with what the CPU tier lets go of. Writing a block that is
never read again costs a write (bandwidth, SSD wear) and pushes out one that might have been.
``TinyLFU`` (Einziger, Friedman & Manes) keeps an approximate count of how often each key was
accessed recently; once the lower tier is full it admits a candidate only if it was accessed
more often than the block it would replace. The CPU tier in front is W-TinyLFU's admission
window: a block gets its repeat accesses while it is still there, and arrives below with them.

Interface for a tier: ``record(key)`` on every access the CPU tier sees (lookup hit or miss,
store), ``admit(candidate, victim)`` before writing ``candidate`` to the lower tier, where
``victim`` is the block it would evict there (None when there is room); ``make_admission``
builds it from a tier's setting. Not thread-safe: the tier holds its lock around every call,
as for the eviction policies.

The numbers that chose it: ``raykv bench eviction`` (docs/performance.md, "Lower-tier
admission"). On the routing workload, against an LRU lower tier that writes every block the
CPU tier evicts: with a lower tier of 20 % of the unique blocks, +8.5 to +9.7 points of total
hit rate for 0.06-0.09 x the writes; at 50 %, the same hit rate (within 0.2 points) for
0.42-0.44 x the writes. ARC admitting everything gained 0.3-2.5 points and wrote 0.91-0.97 x.
"""

from __future__ import annotations

import hashlib
import struct

from raykv.errors import ConfigError, InvalidInput

Key = bytes  # the CPU tier's keys: block hashes

DEPTH = 4  # count-min rows: an estimate is off only when a key collides in all four
MAX_COUNT = 15  # 4-bit counters, as in TinyLFU: "often" needs no more resolution
WIDTH_PER_SLOT = 4  # counters per row per lower-tier slot (4 rows x 4 bytes a slot)
SAMPLE_PER_SLOT = 10  # age after 10 x capacity recorded accesses (TinyLFU's sample size W)
DOOR_BITS_PER_SAMPLE = 8  # doorkeeper bloom bits per access in a sample: few false positives
# a sketch sized for at most this many slots (32 MiB): a larger tier (a TiB disk of 64 KiB
# entries has 16 M) shares counters between more keys and ages sooner, where sizing by its
# slots would hold GiBs of counters in every tier actor
MAX_SKETCH_SLOTS = 1 << 20
_WORDS = struct.Struct("<8I")  # one blake2b digest: 4 sketch indexes + 4 doorkeeper indexes
_HALF = bytes(c >> 1 for c in range(256))  # aging: every counter halved in one translate


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TinyLFU:
    """A count-min sketch of recent access counts behind a doorkeeper bloom filter.

    A key's first access only sets its doorkeeper bits (most blocks are seen once: they never
    reach the counters); later ones increment its ``DEPTH`` counters, capped at ``MAX_COUNT``.
    ``estimate`` is the smallest of them plus the doorkeeper bit, so it never falls below the
    true count (up to the cap) since the last aging. Every ``10 x capacity`` recorded accesses
    all counters halve and the doorkeeper is cleared, so old popularity fades: what was hot an
    hour ago does not keep out what is hot now. Indexes come from a keyed blake2b of the key,
    so the sketch is the same for the same seed in every process (Python's ``hash`` is not).
    Memory: 16 bytes of counters and 10 bits of doorkeeper a lower-tier slot, each rounded up
    to a power of two (4 MiB + 4 MiB for a 250k-block disk tier), for at most
    ``MAX_SKETCH_SLOTS`` slots.
    """

    def __init__(self, capacity: int, seed: int = 0) -> None:
        if capacity < 1:
            raise ConfigError(
                f"TinyLFU needs the lower tier's capacity in blocks (>= 1), got {capacity}"
            )
        self.capacity = capacity
        self.seed = seed
        capacity = min(capacity, MAX_SKETCH_SLOTS)
        self.sample_size = SAMPLE_PER_SLOT * capacity
        # counters per row: the CPU tier above sees many more distinct keys in a sample than
        # the lower tier holds; at one counter per slot their collisions made a rarely used
        # victim look hot (the bench's small lower tier fell from 61 % to 9 % hit rate)
        self.width = max(64, _pow2(WIDTH_PER_SLOT * capacity))
        self._door_bits = _pow2(DOOR_BITS_PER_SAMPLE * self.sample_size)
        self._counts = bytearray(DEPTH * self.width)
        self._door = bytearray(self._door_bits // 8)
        self._salt = hashlib.sha256(b"raykv/tinylfu/v1" + str(seed).encode()).digest()
        self.additions = 0  # accesses recorded since the last aging (halved by it)

    def _slots(self, key: Key) -> tuple[list[int], list[int]]:
        if not isinstance(key, bytes | bytearray | memoryview):
            raise InvalidInput(
                f"TinyLFU keys are block hashes (bytes), got {type(key).__name__}; pass the "
                "CPU tier's key"
            )
        words = _WORDS.unpack(hashlib.blake2b(key, digest_size=32, key=self._salt).digest())
        w, d = self.width, self._door_bits
        counters = [row * w + (words[row] & (w - 1)) for row in range(DEPTH)]
        return counters, [x & (d - 1) for x in words[DEPTH:]]

    def _in_door(self, door: list[int]) -> bool:
        bits = self._door
        return all(bits[i >> 3] >> (i & 7) & 1 for i in door)

    def record(self, key: Key) -> None:
        """One access of ``key`` (every access the CPU tier sees)."""
        counters, door = self._slots(key)
        if self._in_door(door):
            counts = self._counts
            for i in counters:
                if counts[i] < MAX_COUNT:
                    counts[i] += 1
        else:  # first sight: the doorkeeper only, the counters stay for repeated keys
            bits = self._door
            for i in door:
                bits[i >> 3] |= 1 << (i & 7)
        self.additions += 1
        if self.additions >= self.sample_size:
            self.age()

    def estimate(self, key: Key) -> int:
        """Recent accesses of ``key``: never fewer than the true count (up to ``MAX_COUNT``)
        since the last aging, more only where it collides with other keys in every row."""
        counters, door = self._slots(key)
        counts = self._counts
        return min(counts[i] for i in counters) + self._in_door(door)

    def age(self) -> None:
        """Halve every counter and clear the doorkeeper (run every ``sample_size`` records)."""
        self._counts = bytearray(self._counts.translate(_HALF))
        self._door = bytearray(self._door_bits // 8)
        self.additions //= 2

    def admit(self, candidate: Key, victim: Key | None) -> bool:
        """Whether to write ``candidate`` to the lower tier: always while there is room (a
        write then evicts nothing; refusing blocks seen once even then cost 3-4 points of hit
        rate at 3 of the bench's 4 sizes for 8 % fewer writes), else only if it was accessed
        more often than ``victim``: a tie keeps the block already written."""
        return victim is None or self.estimate(candidate) > self.estimate(victim)


ADMISSIONS = {"tinylfu": TinyLFU}  # a lower tier's setting names one of these


def make_admission(capacity: int, name: str = "tinylfu", seed: int = 0) -> TinyLFU:
    """The admission filter ``name`` for a lower tier of ``capacity`` blocks."""
    try:
        return ADMISSIONS[name](capacity, seed)
    except KeyError:
        raise ConfigError(
            f"unknown admission policy {name!r}; use one of {sorted(ADMISSIONS)}"
        ) from None
