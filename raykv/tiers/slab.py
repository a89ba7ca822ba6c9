"""The slab format: how the tiers below the CPU tier lay out a batch of CPU entries, on disk
(``raykv.tiers.disk_tier``: slab files) and in an object store (``raykv.tiers.object_tier``:
one object is one slab), so both write, check and read one format with one set of functions.

A slab is ``header_bytes(slots)`` of header, then ``slots`` entries of ``stride`` bytes (each
a multiple of 4 KiB, so every offset and length is direct-I/O aligned). The header holds the
magic, the format version, the model identity (``disk_tier.model_identity``), the entry
geometry, how many slots are filled, one record per filled slot (the key, the block keys it
carries, the row width its checksums cover, the valid sub-slots and every copy's checksums:
the CPU tier's entry, as it was stored; and its tenant, ``tenant_key``, whose disk quota it
counts against) and a sha256 of all of that. A record whose key is empty is a tombstone: a
slot dropped after it was written (``tombstone``), never indexed again. An entry is the CPU
entry's rows, copy-major ``[copies, factor, slot_bytes]``, zero-padded to ``stride``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from raykv.blocks.hashing import Tenant
from raykv.layout import tp
from raykv.layout.plan import Plan
from raykv.tiers.checksum import checksums_at
from raykv.tiers.cpu_tier import KeyRows, KeySums

ALIGN = 4096  # direct I/O: buffer addresses, offsets and lengths in multiples of this
MAGIC = b"RAYKVSLB"
VERSION = 2  # 2: each record names its entry's tenant (format 1 slabs are refused)
MAX_KEY = 64  # bytes of a stored key (the service's: 4 + 32)
TENANT_BYTES = 32  # a ``tenant_key`` (a sha256 digest); length 0 in a record: no tenant
# magic, version, identity, stride, slot bytes, factor, copies, slots, filled; then the
# digest of these and of the filled slots' records
FIXED = struct.Struct("<8sI32sQQIIII")
DIGEST = 32
HEAD = FIXED.size + DIGEST  # the fixed part and its digest: where the records start
_NONE = 0xFFFF  # a member's length: a null sub-slot (no block)

Members = tuple[bytes | None, ...]


def to_write(
    keys: Sequence[bytes], holds: Callable[[bytes], bool]
) -> tuple[list[bytes], list[int]]:
    """A demotion's keys split: (those the tier ``holds`` already, the indices of the rest to
    write: each key once, none longer than ``MAX_KEY``, which are refused). Called under the
    tier's lock."""
    keep = [i for i, k in enumerate(keys) if len(k) <= MAX_KEY]
    held = [keys[i] for i in keep if holds(keys[i])]
    seen = set(held)
    return held, [i for i in keep if keys[i] not in seen and not seen.add(keys[i])]


def up(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Entries:
    """Entries read from a tier (``load``): per entry its key, the block keys it carries,
    rows ``[n, copies, factor, slot_bytes]`` and the CPU tier's valid sub-slots and
    checksums, ready for ``CpuTier.store_rows``."""

    keys: list[bytes]
    members: list[Members]
    rows: np.ndarray
    valid: KeyRows
    sums: KeySums


class SlabFormat:
    """The slab geometry of one model (``plan``) and identity: records, headers, checks."""

    def __init__(self, plan: Plan, identity: bytes) -> None:
        self.identity = identity
        self.factor = max(1, plan.block_size_factor)
        self.copies = tp.plan_copies(plan)
        self.slot_bytes = plan.gpu_bytes_per_block
        self.entry_bytes = self.copies * self.factor * self.slot_bytes
        self.stride = up(self.entry_bytes)
        self.dtype = np.dtype([
            ("klen", "<u2"), ("key", "u1", (MAX_KEY,)), ("width", "<u4"), ("nvalid", "<i4"),
            ("valid", "u1", (self.factor,)), ("nsums", "<i4", (self.copies,)),
            ("sums", "<i8", (self.copies, self.factor)), ("mlen", "<u2", (self.factor,)),
            ("members", "u1", (self.factor, MAX_KEY)), ("tlen", "u1"),
            ("tenant", "u1", (TENANT_BYTES,)),
        ])  # fmt: skip

    # ------------------------------------------------------------------ writing
    def header_bytes(self, slots: int) -> int:
        return up(HEAD + slots * self.dtype.itemsize)

    def fixed(self, slots: int, filled: int) -> bytes:
        return FIXED.pack(MAGIC, VERSION, self.identity, self.stride, self.slot_bytes,
                          self.factor, self.copies, slots, filled)  # fmt: skip

    def fill_header(
        self, head: np.ndarray, slots: int, records: np.ndarray, first: int = 0
    ) -> tuple[int, int]:
        """Write into ``head`` (uint8, at least ``header_bytes(slots)``) the fixed part and
        digest for ``records`` (the filled slots' records) and the records from ``first``
        on; returns the byte range ``(lo, hi)`` of the records written."""
        fixed = self.fixed(slots, len(records))
        recs = records.view(np.uint8).reshape(-1)
        digest = hashlib.sha256(fixed + recs.tobytes()).digest()
        head[:HEAD] = np.frombuffer(fixed + digest, np.uint8)
        lo, hi = HEAD + first * self.dtype.itemsize, HEAD + len(recs)
        head[lo:hi] = recs[first * self.dtype.itemsize :]
        return lo, hi

    def stage(
        self, rows: np.ndarray, arena: torch.Tensor, blocks: np.ndarray, at: np.ndarray
    ) -> None:
        """Copy the CPU tier's entries in ``blocks[at]`` of ``arena`` (``[copies, blocks *
        factor, slot_bytes]``) into ``rows``, one slot of ``stride`` bytes each."""
        dst = rows[:, : self.entry_bytes].reshape(len(at), self.copies, self.factor,
                                                  self.slot_bytes)  # fmt: skip
        src = arena.numpy().reshape(self.copies, -1, self.factor, self.slot_bytes)
        for j, b in enumerate(np.asarray(blocks, np.int64)[at].tolist()):
            dst[j] = src[:, b]  # straight into the rows (a fancy index copies twice)

    def records(
        self,
        keys: Sequence[bytes],
        at: np.ndarray,
        valid: KeyRows,
        sums: KeySums,
        widths: Sequence[int],
        members: Sequence[Members],
        tenants: Sequence[Tenant] | None = None,
    ) -> np.ndarray:
        """The records of entries ``at`` (indices into ``valid``, ``sums``, ``widths``,
        ``members`` and ``tenants``, as the CPU tier's ``demote`` hands them over; no
        ``tenants``: every entry untenanted) whose keys are ``keys``."""
        n, f = len(keys), self.factor
        rec = np.zeros(n, self.dtype)
        for j, i in enumerate(at.tolist()):
            put_key(rec[j], "klen", "key", keys[j])
            tenant = tenants[i] if tenants is not None else None
            if tenant is not None:
                put_key(rec[j], "tlen", "tenant", tenant)
            ms = members[i]
            for s in range(f):
                m = ms[s] if s < len(ms) else None
                rec[j]["mlen"][s] = _NONE if m is None else len(m)
                if m is not None:
                    rec[j]["members"][s, : len(m)] = np.frombuffer(m, np.uint8)
        rec["width"] = np.asarray(widths, np.int64)[at]
        rec["nvalid"] = valid.lengths[at]
        rec["valid"][:, : valid.values.shape[1]] = valid.values[at]
        rec["nsums"] = sums.lengths[:, at].T
        rec["sums"][:, :, : sums.sums.shape[2]] = sums.sums[:, at].transpose(1, 0, 2)
        return rec

    # ------------------------------------------------------------------ reading
    def check_fixed(self, head: bytes) -> tuple[int, int] | str:
        """(slots, filled) of a header's first ``HEAD`` bytes, or why it is refused."""
        if len(head) < HEAD:
            return "no header"
        magic, version, ident, stride, slot, factor, copies, slots, filled = FIXED.unpack(
            head[: FIXED.size]
        )
        if magic != MAGIC or version != VERSION:
            return f"not a raykv slab of format {VERSION}"
        if ident != self.identity:
            return "another model, plan or hash definition"
        if (stride, slot, factor, copies) != (self.stride, self.slot_bytes, self.factor,
                                              self.copies):  # fmt: skip
            return "another entry geometry"
        if filled > slots:
            return "torn header"
        return slots, filled

    def check_records(self, head: bytes, recs: bytes) -> np.ndarray | str:
        """The filled slots' records (``recs``, as read after ``head``), or why they are
        refused: a header that does not match its digest is torn."""
        if len(recs) % self.dtype.itemsize:
            return "torn header"
        if hashlib.sha256(head[: FIXED.size] + recs).digest() != head[FIXED.size : HEAD]:
            return "torn header"
        return np.frombuffer(recs, self.dtype).copy()

    def tenant(self, rec: np.void) -> Tenant:
        """The tenant (``tenant_key``) of a record's entry; None: untenanted."""
        return get_key(rec, "tlen", "tenant") if int(rec["tlen"]) else None

    def tombstone(self, rec: np.void) -> None:
        """Mark a record's slot dropped: no key, no members (a header read again, by a
        restarted disk tier or the object tier, lists nothing for it)."""
        rec["klen"] = 0
        rec["mlen"] = _NONE

    def members(self, rec: np.void) -> Members:
        return tuple(
            None if int(rec["mlen"][s]) == _NONE else bytes(rec["members"][s, : rec["mlen"][s]])
            for s in range(self.factor)
        )

    def verified(self, buf: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Per entry (``buf``: ``[n, stride]``), whether every row that carries a block
        matches its stored checksum (invariant 12)."""
        n, f = len(rec), self.factor
        good = np.ones(n, bool)
        if not n:
            return good
        for width in np.unique(rec["width"]).tolist():
            of = np.flatnonzero(rec["width"] == width)
            for c in range(self.copies):
                for s in range(f):
                    off = (c * f + s) * self.slot_bytes
                    r = rec[of]
                    check = (s < r["nsums"][:, c]) & (s < r["nvalid"]) & (r["valid"][:, s] > 0)
                    if not check.any():
                        continue
                    table = buf[:, off : off + self.slot_bytes]
                    at = of[check]
                    got = np.asarray(checksums_at(table, at, int(width)), np.int64)
                    good[at] &= got == r["sums"][check, c, s]
        return good

    def entries(self, keys: list[bytes], buf: np.ndarray, rec: np.ndarray) -> Entries:
        """``Entries`` of ``keys`` from their rows (``buf``: ``[n, stride]``) and records."""
        rows = buf[:, : self.entry_bytes].reshape(-1, self.copies, self.factor, self.slot_bytes)
        return Entries(
            keys,
            [self.members(x) for x in rec],
            rows,
            KeyRows(rec["valid"].astype(bool), rec["nvalid"].astype(np.int64)),
            KeySums(rec["sums"].transpose(1, 0, 2).copy(), rec["nsums"].T.astype(np.int64)),
        )


def put_key(rec: np.void, length: str, field: str, key: bytes) -> None:
    rec[length] = len(key)
    rec[field][: len(key)] = np.frombuffer(key, np.uint8)


def get_key(rec: np.void, length: str, field: str) -> bytes:
    return bytes(rec[field][: int(rec[length])])
