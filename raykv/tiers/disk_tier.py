"""DiskTier: one model's blocks below the CPU tier, in fixed-size slab files on a local disk.

The CPU tier demotes the entries its eviction policy picks (``CpuTier(demote=...)``): their
rows are copied out of the arena at once, into aligned staging buffers (64 MiB batches, each
queued as soon as it is copied), so the arena's blocks can be reused while a background thread
writes them. The writer appends each batch to the open slab in one large sequential write
(``pwritev``, O_DIRECT where the filesystem takes it: the page cache is not a tier; else
buffered writes and ``fdatasync``, reported by ``direct``); the slab's header follows when the
slab fills or the writer goes idle. A read of hits reads runs of consecutive slots in 16 MiB
pieces, several in flight, each verified as it lands.

A slab file is ``header_bytes`` of header, then ``slots`` entries of ``stride`` bytes (each a
multiple of 4 KiB, so every offset and length is direct-I/O aligned). The header holds the
magic, the format version, the model identity (``model_identity``: a digest of the plan's
layout, the model's name and the block-hash definition), the entry geometry, how many slots
are filled, one record per filled slot (the key, the block keys it carries, the row width
its checksums cover, the valid sub-slots and every copy's checksums: the CPU tier's entry,
as it was stored) and a digest of all of that. An entry is the CPU entry's rows, copy-major
``[copies, factor, slot_bytes]``.

Invariants kept: a loaded entry's rows are verified against the checksums it was stored with
(invariant 12), so a flipped bit, a torn write, a short read or a truncated or missing slab
is a counted miss, and the slot is dropped, never served. A slab is written append-only and
evicted whole (the least recently used one once ``disk_bytes`` is full); a reader that raced
its eviction finds its slab gone (a reused file is a new slab): a plain miss. A tier opened
on a directory that has slabs (a restarted service) rebuilds its index from their headers; a
slab of another identity, another format or with a header that does not match its digest is
refused (counted, logged once, its file removed): its keys were hashed for another plan,
model or hash definition, or its header is torn.

Per-tenant quotas (``quotas``: ``RAYKV_DISK_TENANT_QUOTAS``, ``raykv up --disk-tenant-quota``;
the same ``TenantQuotas`` as the CPU tier's, configured apart: a disk is usually far larger
than RAM). Each entry records its tenant (``tenant_key``, as the CPU tier handed it over with
the demotion) in the tier and in its slab's header record, so a restarted tier rebuilds each
tenant's usage from the headers. A tenant's usage is ``stride`` bytes per entry it holds
(written or queued): an entry dropped stops counting at once, though its slot's space
returns only with its slab. A demotion that would take a tenant over its quota first drops
that tenant's own least recently used entries (misses from then on; their header records
become tombstones, so a restart does not bring them back), then leaves out those of its new
entries that still do not fit; never another tenant's entry (invariant 13, on disk). A tier
reopened under lower quotas trims each tenant to its quota the same way. Slab eviction (the
least recently used slab once ``disk_bytes`` is full) is every tenant's, as before.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raykv.blocks.hashing import HASH_VERSION, Tenant, tenant_label
from raykv.errors import ConfigError
from raykv.layout.plan import Plan
from raykv.tiers.admission import make_admission
from raykv.tiers.cpu_tier import KeyRows, KeySums
from raykv.tiers.quotas import TenantQuotas
from raykv.tiers.slab import ALIGN, HEAD, Entries, Members, SlabFormat, get_key, to_write
from raykv.tiers.slab import up as _up

log = logging.getLogger(__name__)

DEFAULT_SLAB_BYTES = 256 << 20
# slots per slab at most: each batch rewrites the header's digest over every filled record,
# so tiny entries (tests) get smaller slabs instead of a header of megabytes
MAX_SLOTS = 4096
SPARE_BUFFERS = 4  # staging buffers kept for reuse
WRITE_BATCH_BYTES = 64 << 20  # a demotion is staged and queued in batches of this
READ_PIECE_BYTES = 16 << 20  # a load reads in pieces of this, READERS of them at a time
READERS = 4


def model_identity(name: str, plan: Plan) -> bytes:
    """32 bytes naming what a stored entry's bytes and keys mean: the model's name, its
    plan's layout (not its block counts, which follow the memory given) and the block-hash
    definition. The hash seed enters the keys themselves: blocks of another seed are never
    looked up."""
    layout = dataclasses.replace(
        plan, num_gpu_blocks=0, cpu_num_blocks=0, max_model_len=0, max_num_batched_tokens=0,
        padding_waste=0.0,
    )  # fmt: skip
    return hashlib.sha256(HASH_VERSION + name.encode() + repr(layout).encode()).digest()


def _aligned(n: int) -> np.ndarray:
    """``n`` bytes (rounded up to ``ALIGN``), page-aligned: what direct I/O reads into."""
    return np.frombuffer(mmap.mmap(-1, max(_up(n), ALIGN)), np.uint8)


@dataclass
class DiskStats:
    demoted: int = 0  # entries queued for writing
    written: int = 0  # entries on disk
    written_bytes: int = 0
    skipped: int = 0  # demoted while already on disk (a promoted entry evicted again)
    not_admitted: int = 0  # demoted to a full tier, not hotter than what they would evict
    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    checksum_errors: int = 0  # slots whose rows did not match their checksums: dropped
    torn: int = 0  # slots lost to a short read, a truncated or missing slab file
    evicted: int = 0  # entries evicted with their slab
    refused_slabs: int = 0  # slabs of another identity or format, or a torn header
    write_errors: int = 0  # batches the writer could not write (their entries dropped)
    quota_refused: int = 0  # demoted entries left out: over their tenant's disk quota
    quota_evicted: int = 0  # a tenant's own entries dropped for its demotion, over quota


@dataclass
class _Slab:
    path: Path
    slots: int
    header_bytes: int
    records: np.ndarray  # the record of each slot (``filled`` of them are real)
    header: np.ndarray  # the header as on disk (aligned): rewritten page by page
    filled: int = 0
    synced: int = 0  # slots its header on disk lists
    live: int = 0
    used: int = 0  # recency: the tier's clock when last written or read


@dataclass
class _Batch:
    keys: list[bytes]
    records: np.ndarray
    staging: np.ndarray  # [n, stride] uint8, page-aligned: a view of ``buffer``
    buffer: np.ndarray  # the whole aligned buffer (reused once the batch is written)


class DiskTier:
    """One model's disk tier in ``path`` (see the module docstring). ``disk_bytes`` bounds
    its slab files; ``slab_bytes`` is each slab's size (at least one entry); ``direct=False``
    writes and reads through the page cache (and ``fdatasync``) even where O_DIRECT works."""

    def __init__(
        self,
        path: str | os.PathLike,
        plan: Plan,
        identity: bytes,
        disk_bytes: int,
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        direct: bool = True,
        on_evict: Callable[[Path, list[bytes]], None] | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.path = Path(path)
        self.quotas = quotas  # bytes per tenant here (module docstring); None: no quotas
        self.identity = identity
        self.format = fmt = SlabFormat(plan, identity)  # the object tier's format too
        self.factor, self.copies, self.slot_bytes = fmt.factor, fmt.copies, fmt.slot_bytes
        self.entry_bytes, self.stride, self.dtype = fmt.entry_bytes, fmt.stride, fmt.dtype
        # a full tier's evicted slab (its file renamed away, its live keys): handed on
        # before the file would be reused (the object tier uploads it); None: removed
        self.on_evict = on_evict
        self.slots = self._slots_for(slab_bytes)
        self.slab_bytes = self._header_bytes(self.slots) + self.slots * self.stride
        self.max_slabs = disk_bytes // self.slab_bytes
        if self.max_slabs < 1:
            raise ConfigError(
                f"the disk tier has {disk_bytes} bytes, less than one slab of "
                f"{self.slab_bytes} bytes ({self.slots} entries of {self.entry_bytes} bytes); "
                f"give --disk-bytes at least {self.slab_bytes}"
            )
        self.stats = DiskStats()
        # TinyLFU over the CPU tier's accesses (``record``): a full tier takes an entry only
        # if it was used more often than what it would push out (raykv bench eviction)
        self.admission = make_admission(self.max_slabs * self.slots)
        # O_DIRECT; False: the filesystem refused it (tmpfs), or buffered I/O was asked for
        # (``direct=False``: ``raykv bench tiers`` measures it beside O_DIRECT)
        self.direct = direct
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._slabs: dict[int, _Slab] = {}
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (slab id, slot)
        self._pending: dict[bytes, tuple[_Batch, int]] = {}  # queued, not yet written
        self._queue: list[_Batch] = []
        self._gone: list[bytes] = []  # keys that left the tier since ``take_gone``
        # each held key's tenant (written or queued), and each tenant's keys least recently
        # used first: its usage, and the order its own entries go in over its quota
        self._owner: dict[bytes, Tenant] = {}
        self._by_tenant: dict[Tenant, OrderedDict[bytes, None]] = {}
        # per tenant label: [entries refused over quota, own entries dropped over quota]
        self.quota_counts: dict[str, list[int]] = {}
        # (slab id, slot) of written entries dropped over quota: the writer makes their
        # header records tombstones (it alone writes headers)
        self._dead: list[tuple[int, int]] = []
        # written batches' staging buffers, reused: a fresh one costs a page fault per page
        # (the kernel zeroes it), about as long as its write on a busy host
        self._spare: list[np.ndarray] = []
        self._clock = 0
        self._open_slab: int | None = None  # the slab the writer appends to
        self._next_id = 0
        self._closed = False
        self._busy = False  # the writer is writing (a flush waits for its header sync too)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_folder(self.path)
        try:
            self._rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise
        with self._lock:
            self._trim_to_quotas()
        self._writer = threading.Thread(target=self._write_loop, name="raykv-disk", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="raykv-disk-read")

    # ------------------------------------------------------------------ geometry
    def _header_bytes(self, slots: int) -> int:
        return self.format.header_bytes(slots)

    def _slots_for(self, slab_bytes: int) -> int:
        slots = max(1, min(MAX_SLOTS, (slab_bytes - ALIGN) // (self.stride + self.dtype.itemsize)))
        while slots > 1 and self._header_bytes(slots) + slots * self.stride > slab_bytes:
            slots -= 1
        return slots

    # ------------------------------------------------------------------ queries
    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) + len(self._pending)

    def keys(self) -> list[bytes]:
        """Every key held (written or queued)."""
        with self._lock:
            return [*self._index, *self._pending]

    def entries(self) -> list[tuple[bytes, Members]]:
        """(key, block keys it carries) of every written entry: what a restarted service
        publishes again."""
        with self._lock:
            return [(k, self._members(self._slabs[s].records[i])) for k, (s, i) in
                    self._index.items()]  # fmt: skip

    def take_gone(self) -> list[bytes]:
        """Keys that left the tier (evicted with their slab, corrupt, torn, a failed write)
        since the last call: the owner stops naming them."""
        with self._lock:
            out, self._gone = self._gone, []
            return out

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes held (entries written or queued, ``stride`` each) per tenant label."""
        with self._lock:
            out: dict[str, int] = {}
            for tenant, keys in self._by_tenant.items():
                label = tenant_label(tenant)
                out[label] = out.get(label, 0) + len(keys) * self.stride
            return out

    def over_quota(self) -> dict[str, list[int]]:
        """Per tenant label: [entries refused over its quota, own entries dropped]."""
        with self._lock:
            return {label: list(n) for label, n in self.quota_counts.items()}

    def held_bytes(self, tenant: Tenant) -> int:
        """Bytes ``tenant``'s entries hold here (written or queued)."""
        with self._lock:
            return len(self._by_tenant.get(tenant, ())) * self.stride

    @property
    def num_slabs(self) -> int:
        with self._lock:
            return len(self._slabs)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return len(self._slabs) * self.slab_bytes

    # ------------------------------------------------------------------ demote
    def demote(
        self,
        keys: Sequence[bytes],
        arena: torch.Tensor,
        blocks: np.ndarray,
        valid: KeyRows,
        sums: KeySums,
        widths: Sequence[int],
        members: Sequence[Members],
        *,
        tenants: Sequence[Tenant] | None = None,
    ) -> list[bytes]:
        """Queue CPU entries for writing: ``keys`` held in ``blocks`` of ``arena`` (the CPU
        tier's ``[copies, blocks * factor, slot_bytes]``), with their valid sub-slots and
        checksums as stored, the row width the checksums cover, the block keys each carries
        and its tenant (``tenants``; None: every entry untenanted). The rows are copied
        before this returns (the caller reuses the blocks). Returns the keys now held
        (queued, or on disk already); the others were refused (a key longer than
        ``MAX_KEY``, not admitted to a full tier, or over its tenant's quota)."""
        with self._lock:
            held, new = to_write(keys, lambda k: k in self._index or k in self._pending)
            self.stats.skipped += len(held)
            victim = self._admission_victim()
            if victim is not None:
                admitted = [i for i in new if self.admission.admit(keys[i], victim)]
                self.stats.not_admitted += len(new) - len(admitted)
                new = admitted
            if self.quotas is not None and new and not self._closed:
                new = self._within_quotas(keys, new, tenants, set(held))
            if not new or self._closed:
                return held
        # in batches of WRITE_BATCH_BYTES, each queued once copied: the writer starts on the
        # first while the rest are copied out of the arena
        per = max(1, WRITE_BATCH_BYTES // self.stride)
        for a in range(0, len(new), per):
            self._queue_batch(new[a : a + per], keys, arena, blocks, valid, sums, widths, members,
                              tenants)  # fmt: skip
        return held + [keys[i] for i in new]

    def _within_quotas(
        self,
        keys: Sequence[bytes],
        new: list[int],
        tenants: Sequence[Tenant] | None,
        held: set[bytes],
    ) -> list[int]:
        """Of a demotion's ``new`` entries (indices into ``keys`` and ``tenants``), those
        that fit their tenant's quota, after the tenant's own least recently used entries
        (not ``held``: this demotion's keys held already) went to make room; the first of
        them (the least recently used in the CPU tier) are left out where that is not
        enough. Only the tenant's own entries go (invariant 13). Under the lock."""
        assert self.quotas is not None
        of_tenant: dict[Tenant, list[int]] = {}
        for i in new:
            of_tenant.setdefault(tenants[i] if tenants is not None else None, []).append(i)
        keep: set[int] = set()
        for tenant, mine in of_tenant.items():
            quota = self.quotas.of(tenant)
            if quota is None:
                keep.update(mine)
                continue
            own = self._by_tenant.get(tenant, OrderedDict())
            over = len(own) + len(mine) - quota // self.stride
            if over > 0:
                victims: list[bytes] = []
                for k in own:  # least recently used first; stops at ``over``
                    if len(victims) == over:
                        break
                    if k not in held:
                        victims.append(k)
                for k in victims:
                    self._drop_over_quota(k)
                refused = over - len(victims)
                counts = self.quota_counts.setdefault(tenant_label(tenant), [0, 0])
                counts[0] += refused
                counts[1] += len(victims)
                self.stats.quota_refused += refused
                self.stats.quota_evicted += len(victims)
                mine = mine[refused:]
            keep.update(mine)
        return [i for i in new if i in keep]

    def _trim_to_quotas(self) -> None:
        """A tier reopened under lower quotas than its slabs were written with: each tenant
        over its quota drops its least recently used entries now, as its next demotion would
        (counted as such; the writer tombstones them once it starts). Nobody was told of
        those keys yet: they are not reported gone. Under the lock."""
        if self.quotas is None:
            return
        for tenant, own in list(self._by_tenant.items()):
            quota = self.quotas.of(tenant)
            over = len(own) - quota // self.stride if quota is not None else 0
            if over <= 0:
                continue
            for k in list(own)[:over]:
                self._drop_over_quota(k)
            self.quota_counts.setdefault(tenant_label(tenant), [0, 0])[1] += over
            self.stats.quota_evicted += over
        self._gone = []

    def _drop_over_quota(self, key: bytes) -> None:
        """Drop ``key`` (written or queued) for its tenant's quota: a miss from now on, and
        its header record a tombstone (the writer makes it one, or writes a queued entry's
        slot without indexing it). Under the lock."""
        if key in self._pending:
            del self._pending[key]
            self._disown(key)
            self._gone.append(key)
            return
        self._dead.append(self._index[key])
        self._drop(key)
        self._idle.notify_all()

    def _queue_batch(
        self,
        new: list[int],
        keys: Sequence[bytes],
        arena: torch.Tensor,
        blocks: np.ndarray,
        valid: KeyRows,
        sums: KeySums,
        widths: Sequence[int],
        members: Sequence[Members],
        tenants: Sequence[Tenant] | None,
    ) -> None:
        """Copy the entries ``new`` (indices into ``demote``'s arguments) into a staging
        buffer with their records, and queue them for the writer."""
        n = len(new)
        at = np.asarray(new, np.int64)
        buffer, staging = self._staging(n)
        self.format.stage(staging, arena, blocks, at)
        new_keys = [keys[i] for i in new]
        rec = self.format.records(new_keys, at, valid, sums, widths, members, tenants)
        batch = _Batch(new_keys, rec, staging, buffer)
        with self._lock:
            self._pending.update(zip(new_keys, ((batch, j) for j in range(n)), strict=True))
            for i, k in zip(new, new_keys, strict=True):
                self._own(k, tenants[i] if tenants is not None else None)
            self._queue.append(batch)
            self.stats.demoted += n
            self._idle.notify_all()

    def _staging(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """An aligned buffer for ``n`` entries (the smallest spare that fits, else a new
        one) and its ``[n, stride]`` view."""
        need = n * self.stride
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.nbytes >= need]
            if fits:
                buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].nbytes))
                return buf, buf[:need].reshape(n, self.stride)
        buf = _aligned(need)
        return buf, buf[:need].reshape(n, self.stride)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued entry is written (or dropped) and listed in its slab's
        header; False on timeout."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not (self._pending or self._busy or self._dead) or self._closed, timeout_s
            )

    def close(self) -> None:
        """Write what is queued, then stop the writer (the slabs stay for ``open``)."""
        self.flush()
        with self._idle:
            self._closed = True
            self._idle.notify_all()
        self._writer.join()
        self._readers.shutdown()
        os.close(self._lock_fd)  # the folder is free for the next tier

    # ------------------------------------------------------------------ load
    def buffer(self, n: int) -> np.ndarray:
        """An aligned buffer for ``load``'s ``out``: room for ``n`` entries."""
        return _aligned(n * self.stride)

    def load(self, keys: Sequence[bytes], out: np.ndarray | None = None) -> Entries:
        """The entries of ``keys`` held here and verified against their checksums, in the
        order of ``keys`` (those not held, torn or corrupt are left out and counted). Their
        rows are read into ``out`` (a ``buffer`` the caller reuses: a fresh one costs a page
        fault per page, a good part of the read) where it has room, else a new buffer; the
        returned rows are views of it."""
        with self._lock:
            self._clock += 1
            found: list[tuple[bytes, int, int, np.ndarray]] = []  # key, slab, slot, record
            queued: list[tuple[bytes, _Batch, int]] = []
            for k in dict.fromkeys(keys):
                if k in self._pending:
                    queued.append((k, *self._pending[k]))
                elif k in self._index:
                    s, i = self._index[k]
                    slab = self._slabs[s]
                    slab.used = self._clock
                    found.append((k, s, i, slab.records[i].copy()))
                else:
                    continue
                self._by_tenant[self._owner[k]].move_to_end(k)  # used: its tenant's last to go
            self.stats.misses += len(keys) - len(found) - len(queued)
            n = len(found) + len(queued)
            if out is None or out.nbytes < n * self.stride or out.ctypes.data % ALIGN:
                out = _aligned(n * self.stride)
            buf = out[: n * self.stride].reshape(n, self.stride)
            rec = np.zeros(n, self.dtype)
            ok = np.zeros(n, bool)
            # not written yet: from the staging buffer, under the lock (once written, the
            # writer hands the buffer to the next batch)
            for j, (_, batch, i) in enumerate(queued):
                buf[j] = batch.staging[i]
                rec[j] = batch.records[i]
                ok[j] = True
        base = len(queued)
        for j, (*_, r) in enumerate(found):
            rec[base + j] = r
        good = ok.copy()
        good[:base] = self._verified(buf[:base], rec[:base])
        # in pieces, several in flight: the device sees a deeper queue than one read at a
        # time gives, and the checksums of a piece that landed are taken (without the GIL)
        # while the others read, so a load takes about its reads' time, not reads + sums
        step = max(1, READ_PIECE_BYTES // self.stride)

        def piece(at: slice, part: list[tuple[bytes, int, int, np.ndarray]]) -> np.ndarray:
            ok[at] = self._read(part, buf[at])
            return ok[at] & self._verified(buf[at], rec[at])

        pieces = [
            (at, self._readers.submit(piece, at, found[a : a + step]))
            for a in range(0, len(found), step)
            for at in [slice(base + a, base + min(a + step, len(found)))]
        ]
        for at, done in pieces:
            good[at] = done.result()
        with self._lock:
            for j, (k, s, i, _) in enumerate(found):
                if good[base + j]:
                    continue
                self.stats.misses += 1
                if self._index.get(k) != (s, i):
                    continue  # its slab was evicted meanwhile: a plain miss
                self.stats.torn += not ok[base + j]
                self.stats.checksum_errors += bool(ok[base + j])
                self._drop(k)
            self.stats.hits += int(good.sum())
            self.stats.read_bytes += int(good.sum()) * self.entry_bytes
        order = [q[0] for q in queued] + [f[0] for f in found]  # the key of each row of buf
        rank = dict(zip(keys, range(len(keys)), strict=False))
        pick = np.array(
            sorted(np.flatnonzero(good).tolist(), key=lambda j: rank[order[j]]), np.int64
        )
        if len(pick) == n and (pick == np.arange(n)).all():  # the rule: all, in order
            rows, r = buf, rec
        else:
            rows, r = buf[pick], rec[pick]
        return self.format.entries([order[j] for j in pick.tolist()], rows, r)

    def _read(self, found: list[tuple[bytes, int, int, np.ndarray]], out: np.ndarray) -> np.ndarray:
        """Read each found (key, slab, slot, record) into its row of ``out`` (one read per
        run of consecutive slots); per slot, whether it was read whole, its slab not evicted
        (a reused file gets a new slab id)."""
        ok = np.zeros(len(found), bool)
        by_slab: dict[int, list[int]] = {}
        for j, f in enumerate(found):
            by_slab.setdefault(f[1], []).append(j)
        for s, js in by_slab.items():
            js.sort(key=lambda j: found[j][2])
            slab = self._slabs.get(s)
            if slab is None:
                continue
            try:
                fd = self._open(slab.path, os.O_RDONLY)
            except OSError:
                continue  # a missing slab: its slots are torn
            try:
                start = 0
                while start < len(js):
                    end = start + 1
                    while end < len(js) and found[js[end]][2] == found[js[end - 1]][2] + 1:
                        end += 1
                    run, first = js[start:end], found[js[start]][2]
                    if run == list(range(run[0], run[0] + len(run))):  # one read, in place
                        view = out[run[0] : run[0] + len(run)].reshape(-1)
                        got = _pread(fd, view, slab.header_bytes + first * self.stride)
                        whole = got // self.stride  # a short read: the slots read whole
                        ok[run[:whole]] = True
                    else:
                        for j in run:
                            got = _pread(fd, out[j], slab.header_bytes + found[j][2] * self.stride)
                            ok[j] = got == self.stride
                    start = end
            finally:
                os.close(fd)
            with self._lock:  # a slab evicted while it was read holds other bytes now
                if self._slabs.get(s) is not slab:
                    ok[js] = False
        return ok

    def _verified(self, buf: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Per entry, whether every row that carries a block matches its stored checksum."""
        return self.format.verified(buf, rec)

    # ------------------------------------------------------------------ the writer
    def _write_loop(self) -> None:
        while True:
            with self._idle:
                self._idle.wait_for(lambda: self._queue or self._dead or self._closed)
                if not (self._queue or self._dead):
                    return
                batches, self._queue, self._busy = self._queue, [], True
            for batch in batches:
                self._write(batch)
            with self._lock:
                cur = self._slabs.get(self._open_slab) if not self._queue else None
                buried = self._bury()
            if cur is not None:  # idle: the open slab's header catches up (one write)
                self._sync(cur)
            for slab in buried:  # their recency stays what it was (a restart reads it)
                if slab is not cur:
                    self._sync(slab, keep_mtime=True)
            with self._idle:
                self._busy = bool(self._queue)
                for batch in batches:  # served from disk now: its buffer can take the next
                    if all(self._pending.get(k, (None,))[0] is not batch for k in batch.keys):
                        self._spare.append(batch.buffer)
                del self._spare[:-SPARE_BUFFERS]
                self._idle.notify_all()

    def _write(self, batch: _Batch) -> None:
        """Append ``batch`` to the open slab (new slabs as it fills); the header follows
        (``_sync``)."""
        done = 0
        n = len(batch.keys)
        while done < n:
            with self._lock:
                slab_id = self._slab_for_append()
                slab = self._slabs[slab_id]
                first = slab.filled
                take = min(n - done, slab.slots - first)
            part = range(done, done + take)
            keys = [batch.keys[j] for j in part]
            try:
                fd = self._open(slab.path, os.O_WRONLY)
                try:
                    data = batch.staging[done : done + take].reshape(-1)
                    _pwrite(fd, data, slab.header_bytes + first * self.stride)
                finally:
                    os.close(fd)
            except OSError as e:
                log.warning("disk tier %s: writing %d entries to %s failed: %r",
                            self.path, take, slab.path, e)  # fmt: skip
                with self._lock:
                    self.stats.write_errors += 1
                    for k in keys:
                        if self._pending.get(k, (None,))[0] is batch:
                            del self._pending[k]
                            self._disown(k)
                    self._gone += keys
                done += take
                continue
            with self._lock:
                slab.records[first : first + take] = batch.records[done : done + take]
                slab.filled = first + take
                slab.used = self._clock
                for j, k in zip(part, keys, strict=True):
                    slot = j - done + first
                    if self._pending.get(k, (None,))[0] is batch:
                        del self._pending[k]
                        self._index[k] = (slab_id, slot)
                        slab.live += 1
                    else:  # dropped while queued (over its tenant's quota): never indexed
                        self.format.tombstone(slab.records[slot])
                self.stats.written += take
                self.stats.written_bytes += take * self.stride
            if slab.filled == slab.slots:  # full: its header is final
                self._sync(slab)
            done += take

    def _sync(self, slab: _Slab, keep_mtime: bool = False) -> None:
        """Write the slab's header for the slots filled since the last sync (and, buffered,
        sync the file). Deferred to a full slab or an idle writer: a header write per batch
        cost a small synchronous I/O between large ones. A crash before it loses those
        entries on restart (misses), never serves them wrong: the data is checksummed.
        ``keep_mtime``: the file keeps its modification time (a restart orders slabs by it:
        a tombstone written into an old slab's header does not make it recent)."""
        with self._lock:
            first, filled = slab.synced, slab.filled
            if first == filled or not any(x is slab for x in self._slabs.values()):
                return  # nothing new, or evicted meanwhile
        try:
            fd = self._open(slab.path, os.O_WRONLY)
            try:
                was = os.fstat(fd)
                self._write_header(fd, slab, first, filled)
                if not self.direct:
                    os.fdatasync(fd)
                if keep_mtime:
                    os.utime(fd, ns=(was.st_atime_ns, was.st_mtime_ns))
            finally:
                os.close(fd)
        except FileNotFoundError:
            return  # evicted (``resize``) since it was looked at: nothing to write
        except OSError as e:
            log.warning("disk tier %s: writing the header of %s failed: %r", self.path,
                        slab.path, e)  # fmt: skip
            with self._lock:
                self.stats.write_errors += 1
            return
        slab.synced = filled

    def _bury(self) -> list[_Slab]:
        """Make the records of the slots dropped over quota (``_dead``) tombstones; returns
        the slabs whose headers now need writing from those slots on. Under the lock, on the
        writer (which alone writes headers: a record changed while one is written would not
        match its digest)."""
        dirty: dict[int, _Slab] = {}
        for sid, slot in self._dead:
            slab = self._slabs.get(sid)
            if slab is None:  # evicted since: its file is gone or reused
                continue
            self.format.tombstone(slab.records[slot])
            slab.synced = min(slab.synced, slot)
            dirty[sid] = slab
        self._dead = []
        return list(dirty.values())

    def record(self, keys: Sequence[bytes]) -> None:
        """Accesses of ``keys`` in the CPU tier above (stores and loads): admission's counts."""
        with self._lock:
            for k in keys:
                self.admission.record(k)

    def _admission_victim(self) -> bytes | None:
        """What a demotion would push out, for admission: None while the tier has room,
        else the median-used entry of the slab evicted next (a slab goes whole). Under
        the lock."""
        cur = self._slabs.get(self._open_slab) if self._open_slab is not None else None
        if len(self._slabs) < self.max_slabs or (cur is not None and cur.filled < cur.slots):
            return None
        victim = min(self._slabs, key=lambda s: (self._slabs[s].live > 0, self._slabs[s].used))
        keys = sorted((k for k, (s, _) in self._index.items() if s == victim),
                      key=self.admission.estimate)  # fmt: skip
        return keys[len(keys) // 2] if keys else None

    def resize(self, disk_bytes: int) -> None:
        """Bound the slab files by ``disk_bytes`` from now on (``NodeDisk`` rebalancing the
        node's budget as models come and go). Over it, the least recently used slabs other
        than the open one are evicted now and their files removed, so the bytes are free on
        disk when this returns; the open slab is the writer's alone (it may be writing it
        without the lock) and one slab always fits."""
        slabs = disk_bytes // self.slab_bytes
        if slabs < 1:
            raise ConfigError(
                f"the disk tier {self.path} would have {disk_bytes} bytes, less than one slab "
                f"of {self.slab_bytes} bytes; give --disk-bytes at least {self.slab_bytes}"
            )
        drop: list[Path] = []
        with self._lock:
            self.max_slabs = slabs
            while len(self._slabs) > slabs:
                victim = min(
                    (s for s in self._slabs if s != self._open_slab),
                    key=lambda s: (self._slabs[s].live > 0, self._slabs[s].used),
                )
                drop.append(self._slabs.pop(victim).path)
                self._evict_keys(self._keys_of(victim))
        for path in drop:  # a reader of it holds its fd: it reads, then finds the slab gone
            path.unlink(missing_ok=True)

    def _slab_for_append(self) -> int:
        """The open slab if it has room, else a new one (evicting the least recently used
        slab when ``max_slabs`` are there). Under the lock."""
        cur = self._slabs.get(self._open_slab) if self._open_slab is not None else None
        if cur is not None and cur.filled < cur.slots:
            return self._open_slab
        if len(self._slabs) >= self.max_slabs:
            victim = min(self._slabs, key=lambda s: (self._slabs[s].live > 0,
                                                     self._slabs[s].used))  # fmt: skip
            slab = self._slabs.pop(victim)
            live = self._keys_of(victim)
            path = self._hand_on(victim, slab, live)
            self._evict_keys(live)
        else:
            path = self.path / f"slab-{self._next_id:08d}.kv"
        sid, self._next_id = self._next_id, self._next_id + 1
        hb = self._header_bytes(self.slots)
        new = _Slab(path, self.slots, hb, np.zeros(self.slots, self.dtype), _aligned(hb))
        self._slabs[sid] = new
        self._open_slab = sid
        # a fresh (or reused) file: its header first says it holds nothing, then its size
        fd = self._open(path, os.O_WRONLY | os.O_CREAT)
        try:
            self._write_header(fd, new, 0, 0)
            size = new.header_bytes + new.slots * self.stride
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
                _fallocate(fd, size)
        finally:
            os.close(fd)
        return sid

    def _hand_on(self, sid: int, slab: _Slab, live: list[bytes]) -> Path:
        """An evicted slab goes to ``on_evict`` (renamed, so that its file is not reused
        while the tier below reads it: the keys its header on disk lists); returns the file
        the next slab is written to. Under the lock."""
        if self.on_evict is None or not live:
            return slab.path
        listed = {k for k in live if self._index[k][1] < slab.synced}
        away = self.path / f"evicted-{sid:08d}.kv"
        try:
            os.rename(slab.path, away)
        except OSError as e:
            log.warning("disk tier %s: handing on %s failed: %r", self.path, slab.path, e)
            return slab.path
        self.on_evict(away, [k for k in live if k in listed])
        return self.path / f"slab-{self._next_id:08d}.kv"

    def _write_header(self, fd: int, slab: _Slab, first: int, filled: int) -> None:
        """Record slots ``first:filled`` in the slab's header: its fixed part and digest (the
        first page) and the pages of the new records, not the whole header each batch."""
        head = slab.header
        lo, hi = self.format.fill_header(head, slab.slots, slab.records[:filled], first)
        _pwrite(fd, head[:ALIGN], 0)
        if hi > ALIGN:
            start = max(ALIGN, lo // ALIGN * ALIGN)
            _pwrite(fd, head[start : _up(hi)], start)

    # ------------------------------------------------------------------ open
    def _rebuild(self) -> None:
        """The index from the slab files' headers; refused slabs are removed."""
        refused: list[str] = []
        paths = []
        for path in self.path.glob("evicted-*.kv"):  # handed on before a restart: gone
            path.unlink(missing_ok=True)
        for path in self.path.glob("slab-*.kv"):
            try:
                paths.append((path.stat().st_mtime_ns, int(path.stem.split("-")[1]), path))
            except (ValueError, OSError):
                continue
        paths.sort()  # oldest written first: recency before the restart (a reused file is new)
        for rank, (_, sid, path) in enumerate(paths):
            self._next_id = max(self._next_id, sid + 1)
            why = self._load_slab(sid, path, rank - len(paths))
            if why is not None:
                refused.append(f"{path.name} ({why})")
                self.stats.refused_slabs += 1
                path.unlink(missing_ok=True)
        if refused:
            log.warning("disk tier %s: refused %d slab(s), removed: %s", self.path,
                        len(refused), ", ".join(refused[:8]))  # fmt: skip
        # over a smaller budget than before, the least recently written go
        while len(self._slabs) > self.max_slabs:
            victim = min(self._slabs, key=lambda s: self._slabs[s].used)
            slab = self._slabs.pop(victim)
            self._evict_keys(self._keys_of(victim), tell=False)
            slab.path.unlink(missing_ok=True)

    def _load_slab(self, sid: int, path: Path, used: int) -> str | None:
        """Index one slab's filled slots (``used``: its recency); the reason it is refused,
        or None."""
        try:
            with open(path, "rb") as fh:
                head = fh.read(HEAD)
                fixed = self.format.check_fixed(head)
                if isinstance(fixed, str):
                    return fixed
                slots, filled = fixed
                recs = fh.read(filled * self.dtype.itemsize)
                size = os.fstat(fh.fileno()).st_size
        except OSError as e:
            return f"unreadable: {e.strerror}"
        got = self.format.check_records(head, recs)
        if isinstance(got, str):
            return got
        records = np.zeros(slots, self.dtype)
        records[:filled] = got
        hb = self._header_bytes(slots)
        header = _aligned(hb)
        blob = head + recs
        header[: len(blob)] = np.frombuffer(blob, np.uint8)
        slab = _Slab(path, slots, hb, records, header, filled=filled, synced=filled, used=used)
        whole = max(0, min(filled, (size - hb) // self.stride))  # a truncated file: torn
        self.stats.torn += filled - whole
        for i in range(whole):
            key = get_key(records[i], "klen", "key")
            if not key:  # a tombstone: dropped over its tenant's quota
                continue
            if key in self._index:  # written twice (not the rule): the newer copy serves
                self._slabs[self._index[key][0]].live -= 1
            self._index[key] = (sid, i)
            self._own(key, self.format.tenant(records[i]))
            slab.live += 1
        self._slabs[sid] = slab
        return None

    # ------------------------------------------------------------------ internals
    def _drop(self, key: bytes) -> None:
        s, _ = self._index.pop(key)
        self._slabs[s].live -= 1
        self._disown(key)
        self._gone.append(key)

    def _keys_of(self, sid: int) -> list[bytes]:
        """The indexed keys of slab ``sid``. Under the lock."""
        return [k for k, (s, _) in self._index.items() if s == sid]

    def _evict_keys(self, keys: list[bytes], tell: bool = True) -> None:
        """``keys`` leave with their evicted slab: out of the index and their tenants' bytes,
        counted, and reported gone (``tell``; not while the tier opens, when nobody was told
        of them yet). Under the lock."""
        for k in keys:
            del self._index[k]
            self._disown(k)
        self.stats.evicted += len(keys)
        if tell:
            self._gone += keys

    def _own(self, key: bytes, tenant: Tenant) -> None:
        """``key`` (written or queued) is ``tenant``'s, its most recently used entry."""
        if self._owner.get(key, tenant) != tenant:  # never the rule: a key names its tenant
            self._disown(key)
        self._owner[key] = tenant
        own = self._by_tenant.setdefault(tenant, OrderedDict())
        own[key] = None
        own.move_to_end(key)

    def _disown(self, key: bytes) -> None:
        """``key`` left the tier: its tenant holds that much less (one holding nothing is
        forgotten: rotating salts grow nothing)."""
        tenant = self._owner.pop(key)
        own = self._by_tenant[tenant]
        del own[key]
        if not own:
            del self._by_tenant[tenant]

    def _members(self, rec: np.ndarray) -> Members:
        return self.format.members(rec)

    def _open(self, path: Path, flags: int) -> int:
        """``path`` opened for direct I/O, or buffered where the filesystem refuses it
        (then ``direct`` is False and the writer syncs each batch)."""
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.warning("disk tier %s: the filesystem refuses O_DIRECT; buffered writes "
                            "with fdatasync (the page cache holds a copy)", self.path)  # fmt: skip
        return os.open(path, flags, 0o600)


LANE_WAIT_S = 5.0  # how long a tier waits for a lane with slabs before it opens a new one
MAX_LANES = 64
_LANE = re.compile(r"\.lane-[0-9]+")  # a model's folder never matches: no lane inside a lane


def take_lane(root: Path) -> tuple[Path, int]:
    """A folder of ``root`` that no other live tier holds, and the lock fd that holds it for
    this process's life: ``root`` itself or an existing ``root/.lane-<k>`` (they hold slabs:
    for up to ``LANE_WAIT_S`` a tier waits for one, as one placed again waits for its
    predecessor to exit), else a new lane."""
    root.mkdir(parents=True, exist_ok=True)

    def lock(lane: Path) -> int | None:
        lane.mkdir(parents=True, exist_ok=True)
        fd = os.open(lane / ".node.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            return None

    deadline = time.monotonic() + LANE_WAIT_S
    while True:
        found = (p for p in root.iterdir() if _LANE.fullmatch(p.name) and p.is_dir())
        lanes = [root, *sorted(found, key=lambda p: int(p.name[6:]))]
        for lane in lanes:
            if (fd := lock(lane)) is not None:
                return lane, fd
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for k in range(1, MAX_LANES):
        lane = root / f".lane-{k}"
        if not lane.exists() and (fd := lock(lane)) is not None:
            return lane, fd
    raise ConfigError(
        f"every lane of the disk tier folder {root} ({MAX_LANES}) is held by a live raykv "
        "tier; give this node its own --disk-path (RAYKV_DISK_PATH)"
    )


def _lock_folder(path: Path) -> int:
    """An exclusive lock on ``path`` for this tier's life (released with its process): two
    tiers writing one folder (two Ray nodes of one host given one --disk-path) would reuse
    each other's slab files."""
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"the disk tier folder {path} is in use by another raykv tier (another Ray node of "
            "this host, or a tier still shutting down); give each node its own --disk-path "
            "(RAYKV_DISK_PATH)"
        ) from None
    return fd


def _pwrite(fd: int, buf: np.ndarray, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (a short write goes on from where it stopped)."""
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.pwritev(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at {offset}")
        view, offset = view[n:], offset + n


def _pread(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read into ``buf`` at ``offset`` until full or the end of the file; bytes read."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _fallocate(fd: int, size: int) -> None:
    """Allocate the slab's blocks up front (one extent where the filesystem can) so its
    writes are sequential; a filesystem without it keeps the sparse file."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


class NodeDisk:
    """A node's disk tier budget, ``disk_bytes`` across all the models it serves: each
    model's ``DiskTier`` (in ``<lane>/<name>``) gets an equal share, rebalanced as models are
    opened and closed. Equal shares rather than one pool with eviction across models: a
    tier's slabs, admission and eviction stay its own (one lock, one writer, no lock order
    between tiers), and a model that demotes a lot cannot push another model's entries out
    of the node's disk. The cost: a model that demotes little leaves part of its share
    unused. A share shrinks before a new tier takes its own, so the slab files of the
    node's models never hold more than ``disk_bytes`` together.

    The node's folder is a lane of ``path`` (``take_lane``): ``path`` itself, or
    ``path/.lane-<k>`` where another live tier holds it. Two Ray nodes of one host given one
    folder (two pods of a Helm worker group on one Kubernetes node, with one hostPath) each
    get their own lane and their own ``disk_bytes``, and a tier placed again takes a lane
    that holds slabs, its predecessor's once that one has let go.

    ``quotas``: each tenant's bytes in each model's tier (``DiskTier``'s), not its share of
    the node's."""

    def __init__(
        self, path: str | os.PathLike, disk_bytes: int, quotas: TenantQuotas | None = None
    ) -> None:
        self.root = Path(path)
        self.path, self._lane_fd = take_lane(self.root)
        self.disk_bytes = disk_bytes
        self.quotas = quotas
        self._tiers: dict[str, DiskTier] = {}
        self._lock = threading.Lock()

    @property
    def share(self) -> int:
        """Each open tier's bytes now."""
        return self.disk_bytes // max(1, len(self._tiers))

    @property
    def used_bytes(self) -> int:
        """The slab files of every open tier, together."""
        return sum(t.used_bytes for t in list(self._tiers.values()))

    def open(
        self,
        name: str,
        plan: Plan,
        identity: bytes,
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        on_evict: Callable[[Path, list[bytes]], None] | None = None,
    ) -> DiskTier:
        """The disk tier of a model (in ``path/name``), its share taken from the others;
        ``on_evict``: ``DiskTier``'s (the object tier below takes its evicted slabs)."""
        with self._lock:
            if name in self._tiers:
                raise ConfigError(f"the disk tier {self.path / name} is open already")
            # opened on the whole budget, shrunk below: it writes nothing before it is
            # returned, and the slabs it finds (a restart) are on disk already
            tier = DiskTier(self.path / name, plan, identity, self.disk_bytes,
                            slab_bytes=slab_bytes, on_evict=on_evict,
                            quotas=self.quotas)  # fmt: skip
            tiers = {**self._tiers, name: tier}
            share = self.disk_bytes // len(tiers)
            small = [(n, t.slab_bytes) for n, t in tiers.items() if t.slab_bytes > share]
            if small:
                tier.close()
                need = len(tiers) * max(t.slab_bytes for t in tiers.values())
                raise ConfigError(
                    f"--disk-bytes {self.disk_bytes} is the node's disk tier for all its models: "
                    f"{share} bytes each for {len(tiers)} models, less than one slab of "
                    f"{small[0][0]} ({small[0][1]} bytes); give --disk-bytes at least {need}"
                )
            for t in self._tiers.values():  # the others shrink first: never over the budget
                t.resize(share)
            tier.resize(share)
            self._tiers = tiers
            return tier

    def close(self, name: str) -> None:
        """Close a model's tier and remove its slab files; the others grow into its share.
        Its files go because its bytes now belong to the others (kept, the node's disk
        would hold more than ``disk_bytes``); a tier that dies instead keeps them for the
        tier placed again."""
        with self._lock:
            tier = self._tiers.pop(name, None)
            if tier is None:
                return
            tier.close()
            for path in tier.path.glob("slab-*.kv"):
                path.unlink(missing_ok=True)
            for t in self._tiers.values():
                t.resize(self.share)
