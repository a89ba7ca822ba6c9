"""ObjectTier: one model's blocks in an S3 bucket, below a node's lowest tier, shared by every
node and every cluster that points at the same bucket and prefix.

Objects are slabs (``raykv.tiers.slab``: the disk tier's format, header and all): a batch of
entries the tier below the CPU tier let go, one PUT each. Two sources: the CPU tier's
evictions where a node has no disk tier (``demote``: the rows are copied out of the arena
into a staging buffer laid out as the object, then uploaded by a background thread), and
the disk tier's evicted slabs (``upload_file``: the slab file itself, renamed away by the
disk tier, uploaded as it is). Content-addressed, with no coordinator shared between
writers:

- ``<prefix>/<identity hex>/o/<tenant label>/<sha256 of the slab's keys>.slab``: the slab,
  one tenant's entries (``tenant_label``: 8 hex digits, ``none`` for untenanted ones). A
  demotion is grouped by tenant (in order within each); a disk slab whose live entries are
  one tenant's goes as it is, one of several tenants' is split: each tenant's rows are read
  out of the file into staging buffers laid out as a demotion's and uploaded as objects of
  their own;
- ``<prefix>/<identity hex>/k/<block key hex>``: a pointer per block an entry carries (its
  entry's key, the sub-slot, the object's tenant label, the object and the slot; pointers
  of the format before tenant labels are refused: misses).

The pointers are PUT while their object is (``POINTERS`` in flight beside the object's PUT),
not after it: S3 has no batched PUT, so each is a request of its own, and after the object
they were the upload's tail (on a local moto server, about a third of its time). Beside it,
their latency hides behind the object's; what is left is their cost to the client and the
server (on a 2-core box running moto too, about half of what they cost after). So a pointer
may name an object not whole in the bucket yet: a node that reads it then finds no object
(or, replacing one of the same name, another ETag) and misses, counted as torn, as it would
for an object expired since; never wrong rows, as every row is verified against the header
of the object read. An upload that fails deletes the pointers it wrote (one DeleteObjects;
best effort: one left behind is the same counted miss). A pointer's PUT goes without
``Expect: 100-continue`` (``s3_client``: below ``CONTINUE_BYTES``), a round trip less each.
Not fewer pointers (one per run of a prompt's blocks, say): a lookup may start at any block
(a lease looks from the first block its node lacks, a load asks for entries by key), and a
writer does not know which of its blocks follow which in a prompt; nor one pointer object
for many blocks, which writers sharing no state would have to read, merge and write back.

Any node, or another cluster, that computes the same block key finds the block through its
pointer; this tier's own uploads are also kept in a local index (``index_entries`` at most,
the least recently used forgotten first) so its own loads skip the pointer. The identity in
every name keeps models, plans and hash definitions apart; an object whose header names
another identity (or format or geometry) is refused all the same (``refused_objects``).

Loads (``load``) read a slab's header (one ranged GET, cached with its ETag) and the runs of
consecutive slots they need in ranged GETs of up to ``READ_PIECE_BYTES``, ``READERS`` in
flight, each sent with ``IfMatch`` the header's ETag (an object replaced meanwhile is torn,
never mixed with another header), and verify every row against the checksums its header
holds (invariant 12): a corrupt, missing, replaced or short object is a counted miss
(``checksum_errors``, ``torn``), never served, and its keys leave the local index.

The bucket as a whole has no byte budget here: an object store is sized by its bucket (expire
old objects with a lifecycle rule; an expired object is a torn miss), and TinyLFU admission
(the disk tier's) would admit everything: what reaches this tier is what the tier above it
evicted, after that tier's own admission. Tenants are bounded (``quotas``:
``RAYKV_OBJECT_TENANT_QUOTAS``, ``raykv up --object-tenant-quota``; invariant 13 in the
bucket): a tenant's usage is the total size of the objects under its prefix, every writer's.
The tier lists the prefix (ListObjectsV2) on its first upload for a tenant with a quota, keeps
that view up to date with its own PUTs and deletes, and lists it again once the view is older
than ``REFRESH_S``, so other nodes' and clusters' uploads count. Before a tenant's object is
PUT, where it would take the tenant over its quota, that tenant's own oldest objects
(LastModified order: the least valuable this tier can know without state shared with the
other writers; what loads read is not known here) are deleted until it fits, each with the
pointers its header lists (best effort, as a failed upload's: a pointer left behind, or one
another object of the same block had rewritten, is a counted torn miss or a miss, never wrong
rows) and its entries leave the local index (``take_gone``); an object larger than the quota
alone is not uploaded (its entries dropped, ``quota_refused``). Victims come from the
uploading tenant's prefix alone: never another tenant's objects. Counts per tenant label
(``over_quota``): entries refused, own entries deleted (``quota_evicted``, as the disk
tier's; the objects in ``quota_evicted_objects``); bytes (``tenant_bytes``) for tenants with
a quota. Writers share no lock: between two listings, several nodes' uploads may take a
tenant over its quota for a while, until an upload for it after a listing trims it.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raykv.blocks.hashing import TENANT_LABEL_CHARS, Tenant, tenant_label
from raykv.errors import ConfigError, TierError
from raykv.layout.plan import Plan
from raykv.tiers.cpu_tier import KeyRows, KeySums
from raykv.tiers.quotas import NONE, TenantQuotas
from raykv.tiers.slab import ALIGN, HEAD, Entries, Members, SlabFormat, get_key, to_write

log = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20  # a demotion is staged and uploaded as objects of about this
# a load's ranged GETs are at most this long: one per run of a default-sized object. Not
# smaller pieces of one object: servers that read an object whole for every ranged GET
# (moto's) pay that per piece; a load of many objects keeps READERS GETs in flight anyway
READ_PIECE_BYTES = BATCH_BYTES
READERS = 8  # ranged GETs in flight
UPLOADERS = 4  # objects uploading at once
POINTERS = 16  # pointer PUTs and GETs in flight
POINTER_ROUND = 8  # a load's pointer GETs in one round (an object's header answers for more)
# uploads queued at most (staging buffers of BATCH_BYTES, or a disk tier's slab files): past
# that, a slow or unreachable bucket drops what the tier above lets go (``dropped``) rather
# than holding memory or disk without bound
MAX_QUEUED = 16
SPARE_BUFFERS = 4  # staging buffers of full batches kept for reuse
# a block no pointer named is not asked for again by ``find`` for this long: a lease of a
# prompt whose tail is nowhere would otherwise pay a GET each time
ABSENT_S = 5.0
ABSENT_KEYS = 1 << 16
INDEX_ENTRIES = 1 << 20  # this tier's own uploads it remembers (the rest: by pointer)
HEADERS_CACHED = 256  # slab headers kept (a load of a slab's entries reads it once)
FILE_WAIT_S = 120.0  # a load of entries of a disk slab being uploaded waits this long
# magic, the object's tenant label, object digest, slot, the object's slots, sub-slot; then
# the entry's key. "RAYKVPT2": a pointer names its object's tenant (older ones are refused)
_POINTER = struct.Struct("<8s8s32sIIH")
_POINTER_MAGIC = b"RAYKVPT2"
_LABEL = re.compile(rf"{NONE}|[0-9a-f]{{{TENANT_LABEL_CHARS}}}")
# a tenant's usage (the objects under its prefix) is listed again when the view this tier
# keeps of it (its own uploads and deletes since) is older than this: other nodes' and
# clusters' uploads count from then on
REFRESH_S = 30.0
# PUTs of fewer bytes go without ``Expect: 100-continue`` (as aws-sdk-go-v2's default)
CONTINUE_BYTES = 2 << 20
INSTALL = "pip install 'raykv[s3]'"
# error codes of a GET that mean "not there": gone, replaced (IfMatch), cut short
_ABSENT = ("NoSuchKey", "404", "PreconditionFailed", "412", "InvalidRange", "416")


@dataclass(frozen=True)
class ObjectSettings:
    """Where the object tier keeps its objects: ``bucket``, a key ``prefix`` (may be empty)
    and the S3 endpoint URL (None: AWS, found through boto3's usual configuration)."""

    bucket: str
    prefix: str = ""
    endpoint: str | None = None

    @classmethod
    def parse(cls, url: str, endpoint: str | None = None) -> ObjectSettings:
        """``s3://bucket/prefix`` (the prefix optional) and an endpoint ``http(s)://...``."""
        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "s3" or not bucket or any(c.isspace() for c in url):
            raise ConfigError(
                f"object tier URL {url!r}: give s3://BUCKET or s3://BUCKET/PREFIX "
                "(RAYKV_OBJECT_URL, raykv up --object-url)"
            )
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"object tier endpoint {endpoint!r}: give an http:// or https:// URL, e.g. "
                "http://127.0.0.1:9000 (RAYKV_OBJECT_ENDPOINT, raykv up --object-endpoint), "
                "or leave it unset for AWS"
            )
        return cls(bucket, prefix.strip("/"), endpoint or None)


def s3_client(endpoint: str | None = None, connections: int = 32) -> Any:
    """A boto3 S3 client (credentials and region through boto3's usual chain; thread-safe:
    the tier's threads share it)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise ConfigError(f"the object tier needs boto3: {INSTALL}") from e
    config = Config(
        max_pool_connections=connections,
        retries={"max_attempts": 3, "mode": "standard"},
        # S3-compatible servers vary in the optional checksums they take; the rows carry
        # raykv's own checksums, verified on every load
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    client = boto3.client("s3", endpoint_url=endpoint, config=config)
    # last of the S3 calls' handlers: after botocore's own, which asks every PUT of a
    # file-like body (bytes become one) for ``Expect: 100-continue``
    client.meta.events.register_last("before-call.s3", _continue_if_large)
    return client


def _continue_if_large(params: dict[str, Any], model: Any = None, **_: Any) -> None:
    """No ``Expect: 100-continue`` on a PUT of less than ``CONTINUE_BYTES`` (a pointer): the
    server's go-ahead is a round trip more per request, to spare sending a body smaller than
    the request's headers, rather than one that is worth not sending if refused."""
    from botocore.utils import determine_content_length

    if getattr(model, "name", None) != "PutObject" or "Expect" not in params["headers"]:
        return
    size = determine_content_length(params.get("body"))
    if size is not None and size < CONTINUE_BYTES:
        del params["headers"]["Expect"]


@dataclass
class ObjectStats:
    demoted: int = 0  # entries queued for upload (from the CPU tier)
    handed: int = 0  # entries queued for upload in a disk tier's evicted slab
    uploaded: int = 0  # entries in the bucket
    uploaded_bytes: int = 0
    objects: int = 0  # objects uploaded
    skipped: int = 0  # demoted while held already
    hits: int = 0
    misses: int = 0
    found: int = 0  # entries found through a pointer (another node's or cluster's upload)
    read_bytes: int = 0
    checksum_errors: int = 0  # entries whose rows did not match their checksums
    torn: int = 0  # entries of a missing, replaced or short object or a stale pointer
    refused_objects: int = 0  # objects of another identity or format, or a torn header
    write_errors: int = 0  # uploads that failed (their entries dropped)
    dropped: int = 0  # entries let go while MAX_QUEUED uploads were queued
    quota_refused: int = 0  # entries not uploaded: their object would not fit their quota
    quota_evicted: int = 0  # a tenant's own entries deleted (with its oldest objects) over quota
    quota_evicted_objects: int = 0  # those objects


@dataclass(frozen=True)
class _Loc:
    digest: bytes  # the object's name
    slot: int
    slots: int  # the object's slot count: its header's length
    label: str = NONE  # the object's tenant: the prefix it is under


@dataclass
class _Batch:
    keys: list[bytes]
    records: np.ndarray
    buffer: np.ndarray  # header then rows: the object's bytes
    rows: np.ndarray  # [n, stride]: a view of ``buffer``
    path: Path | None = None  # a disk tier's slab file instead (``upload_file``)
    body: bytearray | None = None  # what ``buffer`` views: the object's bytes, as sent
    label: str = NONE  # the entries' tenant (a file's: known once its header is read)


@dataclass
class _Header:
    records: np.ndarray  # the filled slots' records
    etag: str


@dataclass
class _Usage:
    """What this tier knows of one tenant's objects in the bucket (a tenant with a quota):
    listed, then its own uploads and deletes since; ``lock`` orders its uploads' checks."""

    objects: dict[str, tuple[int, float]] = field(default_factory=dict)  # name: size, time
    inflight: dict[str, int] = field(default_factory=dict)  # PUTs under way: name: size
    listed: float = float("-inf")  # when (monotonic) the prefix was last listed
    total: int = 0  # the bytes of both (read without the lock: stats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Condition = field(init=False)  # on ``lock``: a PUT ended

    def __post_init__(self) -> None:
        self.settled = threading.Condition(self.lock)

    def count(self) -> None:
        self.total = sum(n for n, _ in self.objects.values()) + sum(
            n for name, n in self.inflight.items() if name not in self.objects
        )


class ObjectTier:
    """One model's object tier in ``settings.bucket`` (see the module docstring). ``client``:
    a boto3 S3 client (default: one for ``settings.endpoint``); ``quotas``: each tenant's
    bytes in the bucket (``RAYKV_OBJECT_TENANT_QUOTAS``; None: none)."""

    def __init__(
        self,
        settings: ObjectSettings,
        plan: Plan,
        identity: bytes,
        *,
        client: Any = None,
        batch_bytes: int = BATCH_BYTES,
        index_entries: int = INDEX_ENTRIES,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.settings = settings
        self.quotas = quotas
        self.client = client if client is not None else s3_client(settings.endpoint)
        self.format = fmt = SlabFormat(plan, identity)
        self.identity = identity
        self.factor, self.copies, self.slot_bytes = fmt.factor, fmt.copies, fmt.slot_bytes
        self.entry_bytes, self.stride = fmt.entry_bytes, fmt.stride
        self.per_object = max(1, batch_bytes // self.stride)
        self.index_entries = index_entries
        base = f"{settings.prefix}/" if settings.prefix else ""
        self.base = f"{base}{identity.hex()}"
        self.stats = ObjectStats()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, _Loc] = OrderedDict()  # entry key -> where
        self._pending: dict[bytes, tuple[_Batch, int]] = {}  # queued, not yet uploaded
        self._headers: OrderedDict[str, _Header] = OrderedDict()  # by object name
        self._refused: set[str] = set()  # objects whose header was refused
        self._usage: dict[str, _Usage] = {}  # per tenant label with a quota
        # per tenant label: [entries refused over its quota, own entries deleted over it]
        self.quota_counts: dict[str, list[int]] = {}
        self._absent: OrderedDict[bytes, float] = OrderedDict()  # block key -> asked until
        self._gone: list[bytes] = []
        self._closed = False
        self._queued = 0  # uploads queued or running
        self._spare: list[bytearray] = []  # uploaded full batches' buffers, reused
        self._check_bucket()
        self._uploads = ThreadPoolExecutor(UPLOADERS, thread_name_prefix="raykv-obj-put")
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="raykv-obj-get")
        self._pointers = ThreadPoolExecutor(POINTERS, thread_name_prefix="raykv-obj-ptr")

    def _check_bucket(self) -> None:
        """Fail at start, naming the bucket and endpoint, rather than on the first upload."""
        from botocore.exceptions import BotoCoreError, ClientError

        where = self.settings.endpoint or "AWS"
        try:
            self.client.head_bucket(Bucket=self.settings.bucket)
        except ClientError as e:
            raise ConfigError(
                f"object tier: bucket {self.settings.bucket!r} at {where}: {e}; create it, or "
                "fix RAYKV_OBJECT_URL / RAYKV_OBJECT_ENDPOINT and the credentials"
            ) from e
        except BotoCoreError as e:
            raise ConfigError(
                f"object tier: cannot reach {where} for bucket {self.settings.bucket!r}: {e}; "
                "fix RAYKV_OBJECT_ENDPOINT (raykv up --object-endpoint) or the credentials"
            ) from e

    # ------------------------------------------------------------------ names
    def object_name(self, digest: bytes, label: str = NONE) -> str:
        """The object ``digest`` of tenant ``label`` (``tenant_label``): one tenant's objects
        under one prefix, whose listing is its usage."""
        return f"{self.tenant_prefix(label)}{digest.hex()}.slab"

    def tenant_prefix(self, label: str) -> str:
        return f"{self.base}/o/{label}/"

    def pointer_name(self, key: bytes) -> str:
        return f"{self.base}/k/{key.hex()}"

    @staticmethod
    def digest_of(keys: Sequence[bytes]) -> bytes:
        """An object's name: its keys', in slot order (the same batch: the same name)."""
        h = hashlib.sha256()
        for k in keys:
            h.update(len(k).to_bytes(2, "little") + k)
        return h.digest()

    # ------------------------------------------------------------------ queries
    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) + len(self._pending)

    def keys(self) -> list[bytes]:
        """Every key this tier knows it holds (uploaded by it, found, or queued)."""
        with self._lock:
            return [*self._index, *self._pending]

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes in the bucket per tenant label with a quota, as this tier last saw them
        (listed, then its own uploads and deletes): every node's and cluster's objects."""
        with self._lock:
            return {label: u.total for label, u in self._usage.items()}

    def over_quota(self) -> dict[str, list[int]]:
        """Per tenant label: [entries refused over its quota, own entries deleted]."""
        with self._lock:
            return {label: list(n) for label, n in self.quota_counts.items()}

    def take_gone(self) -> list[bytes]:
        """Keys that left this tier's index (failed uploads, corrupt or torn objects, the
        index's own bound) since the last call: the owner stops naming them."""
        with self._lock:
            out, self._gone = self._gone, []
            return out

    # ------------------------------------------------------------------ uploads
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
        """``DiskTier.demote`` for the object tier: the rows are copied into staging buffers
        laid out as the objects before this returns, then uploaded in the background: one
        tenant's entries an object (``tenants``, recorded in the headers too; None: every
        entry untenanted), in the order given. Returns the keys now held (queued, or uploaded
        already; an upload over its tenant's quota drops its entries later, see ``take_gone``)."""
        with self._lock:
            held, new = to_write(keys, lambda k: k in self._index or k in self._pending)
            self.stats.skipped += len(held)
            room = max(0, MAX_QUEUED - self._queued) * self.per_object
            self.stats.dropped += max(0, len(new) - room)
            new = new[:room]
            if not new or self._closed:
                return held
        of_tenant: dict[Tenant, list[int]] = {}
        for i in new:
            of_tenant.setdefault(tenants[i] if tenants is not None else None, []).append(i)
        for mine in of_tenant.values():
            for a in range(0, len(mine), self.per_object):
                self._queue_batch(mine[a : a + self.per_object], keys, arena, blocks, valid,
                                  sums, widths, members, tenants)  # fmt: skip
        return held + [keys[i] for i in new]

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
        n, fmt = len(new), self.format
        at = np.asarray(new, np.int64)
        body, buffer, rows = self._staging(n)
        fmt.stage(rows, arena, blocks, at)
        new_keys = [keys[i] for i in new]
        rec = fmt.records(new_keys, at, valid, sums, widths, members, tenants)
        fmt.fill_header(buffer, n, rec)
        label = tenant_label(tenants[new[0]] if tenants is not None else None)
        self._queue(_Batch(new_keys, rec, buffer, rows, body=body, label=label))
        with self._lock:
            self.stats.demoted += n

    def _staging(self, n: int) -> tuple[bytearray, np.ndarray, np.ndarray]:
        """A staging buffer laid out as an object of ``n`` entries: its bytes, them as uint8
        and its rows (``[n, stride]``, after the header). A bytearray: botocore sends it as it
        is (bytes would be one more copy of the rows); a full batch's from the spares, as a
        fresh one costs a page fault per page."""
        hb = self.format.header_bytes(n)
        size = hb + n * self.stride
        with self._lock:
            spare = self._spare.pop() if self._spare and len(self._spare[-1]) == size else None
        body = spare if spare is not None else bytearray(size)
        buffer = np.frombuffer(body, np.uint8)
        return body, buffer, buffer[hb:].reshape(n, self.stride)

    def upload_file(self, path: Path, keys: Sequence[bytes]) -> None:
        """Upload a slab file a disk tier evicted (``DiskTier(on_evict=)``), then remove it:
        ``keys``, the live entries its header lists, are held from now on (a load of them
        waits for the upload). Quick: the disk tier calls it under its lock. The upload
        thread reads its header: the file goes as it is where its live entries are one
        tenant's, else it is split, one object per tenant (``_split``)."""
        with self._lock:
            keys = [k for k in keys if k not in self._index and k not in self._pending]
            full = self._queued >= MAX_QUEUED
            self.stats.dropped += len(keys) if full else 0
            if self._closed or not keys or full:
                path.unlink(missing_ok=True)
                return
            self.stats.handed += len(keys)
        self._queue(_Batch(list(keys), np.zeros(0), np.zeros(0, np.uint8),
                           np.zeros((0, self.stride), np.uint8), path))  # fmt: skip

    def _queue(self, batch: _Batch) -> None:
        with self._lock:
            self._queued += 1
            self._pending.update(zip(batch.keys, ((batch, j) for j in range(len(batch.keys))),
                                     strict=True))  # fmt: skip
        self._uploads.submit(self._upload, batch)

    def _upload(self, batch: _Batch) -> None:
        pointers: list[tuple[str, Future]] = []
        name = ""
        try:
            if batch.path is None:
                digest, locs, records = self._layout_buffer(batch)
                name, size = self.object_name(digest, batch.label), len(batch.buffer)
                if not self._make_room(batch, name, size):
                    return
                pointers = self._put_pointers(digest, batch.keys, locs, records)
                etag = self._put_object(name, batch.body)
            else:
                with open(batch.path, "r+b") as fh:
                    got = self._layout_file(batch, fh)
                    if got is None:  # split: one upload per tenant, queued
                        return
                    digest, locs, records, size = got
                    name = self.object_name(digest, batch.label)
                    if not self._make_room(batch, name, size):
                        return
                    pointers = self._put_pointers(digest, batch.keys, locs, records)
                    etag = self._put_object(name, fh, ContentLength=size)
            for _, p in pointers:
                p.result()
        except Exception as e:  # S3 errors, a torn slab file: the entries are dropped
            log.warning("object tier %s: uploading %d entries failed: %r", self.base,
                        len(batch.keys), e)  # fmt: skip
            self._unpoint(pointers)
            self._settle(batch.label, name, None)
            self._drop(batch)
            return
        finally:
            if batch.path is not None:
                batch.path.unlink(missing_ok=True)
            with self._lock:
                self._queued -= 1
        self._settle(batch.label, name, size)
        with self._idle:
            self._remember_header(name, _Header(records, etag))
            for k, loc in zip(batch.keys, locs, strict=True):
                if self._pending.get(k, (None,))[0] is batch:
                    del self._pending[k]
                    self._note(k, loc)
            self.stats.uploaded += len(batch.keys)
            self.stats.uploaded_bytes += len(batch.keys) * self.stride
            self.stats.objects += 1
            self._keep_spare(batch)
            self._idle.notify_all()

    def _drop(self, batch: _Batch, quota: bool = False) -> None:
        """``batch``'s entries leave the tier (``_gone``), not uploaded: a failed upload, or
        (``quota``) one over its tenant's quota."""
        with self._idle:
            if quota:
                self.stats.quota_refused += len(batch.keys)
                self.quota_counts.setdefault(batch.label, [0, 0])[0] += len(batch.keys)
            else:
                self.stats.write_errors += 1
            mine = [k for k in batch.keys if self._pending.get(k, (None,))[0] is batch]
            for k in mine:
                del self._pending[k]
            self._gone += mine
            self._keep_spare(batch)
            self._idle.notify_all()

    def _put_object(self, name: str, body: Any, **kw: Any) -> str:
        """PUT the object ``name``: its ETag."""
        got = self.client.put_object(Bucket=self.settings.bucket, Key=name, Body=body, **kw)
        return got["ETag"]

    def _layout_buffer(self, batch: _Batch) -> tuple[bytes, list[_Loc], np.ndarray]:
        """A staged batch's object name, its entries' slots and records."""
        n = len(batch.keys)
        digest = self.digest_of(batch.keys)
        return digest, [_Loc(digest, j, n, batch.label) for j in range(n)], batch.records

    def _layout_file(
        self, batch: _Batch, fh: Any
    ) -> tuple[bytes, list[_Loc], np.ndarray, int] | None:
        """A disk tier's slab file (``fh``, open for update) checked and, where its live
        entries (``batch.keys``) are one tenant's (``batch.label`` from now on), cut after its
        last filled slot, left at its start for the PUT: its object name, ``batch``'s keys'
        slots, its records and the object's size. None: they are several tenants', each
        queued as an upload of its own (``_split``)."""
        path, fmt = batch.path, self.format
        head = fh.read(HEAD)
        fixed = fmt.check_fixed(head)
        if isinstance(fixed, str):
            raise TierError(f"{path.name}: {fixed}")
        slots, filled = fixed
        records = fmt.check_records(head, fh.read(filled * fmt.dtype.itemsize))
        if isinstance(records, str):
            raise TierError(f"{path.name}: {records}")
        size = fmt.header_bytes(slots) + filled * self.stride
        if os.fstat(fh.fileno()).st_size < size:
            raise TierError(f"{path.name}: truncated")
        keys = [get_key(r, "klen", "key") for r in records]
        slot_of = {k: i for i, k in enumerate(keys)}
        tenants = {fmt.tenant(records[slot_of[k]]) for k in batch.keys}
        if len(tenants) > 1:
            self._split(batch, fh, records, slot_of, fmt.header_bytes(slots))
            return None
        batch.label = tenant_label(tenants.pop())
        fh.truncate(size)
        digest = self.digest_of(keys)
        fh.seek(0)
        locs = [_Loc(digest, slot_of[k], slots, batch.label) for k in batch.keys]
        return digest, locs, records, size

    def _split(
        self,
        batch: _Batch,
        fh: Any,
        records: np.ndarray,
        slot_of: dict[bytes, int],
        header_bytes: int,
    ) -> None:
        """A disk slab whose live entries are several tenants': each tenant's rows read out
        of the file (``fh``) into staging buffers laid out as a demotion's (``per_object``
        entries at most each, their records as the file's header has them), each queued as
        an upload of its own, which loads read from meanwhile as they would a demotion's."""
        of_tenant: dict[Tenant, list[bytes]] = {}
        for k in batch.keys:
            of_tenant.setdefault(self.format.tenant(records[slot_of[k]]), []).append(k)
        parts = []
        for tenant, keys in of_tenant.items():
            for a in range(0, len(keys), self.per_object):
                part = keys[a : a + self.per_object]
                at = np.asarray([slot_of[k] for k in part], np.int64)
                body, buffer, rows = self._staging(len(part))
                for j, slot in enumerate(at.tolist()):
                    fh.seek(header_bytes + slot * self.stride)
                    if fh.readinto(memoryview(rows[j])) != self.stride:
                        raise TierError(f"{batch.path.name}: truncated")
                rec = records[at].copy()
                self.format.fill_header(buffer, len(part), rec)
                parts.append(_Batch(part, rec, buffer, rows, body=body,
                                    label=tenant_label(tenant)))  # fmt: skip
        for part in parts:  # the keys' pending uploads are these from now on
            self._queue(part)
        with self._idle:
            self._idle.notify_all()  # loads waiting for the file read the staged rows now

    # ------------------------------------------------------------------ quotas
    def _make_room(self, batch: _Batch, name: str, size: int) -> bool:
        """Whether object ``name`` (``size`` bytes, ``batch``'s) fits its tenant's quota,
        after that tenant's own oldest objects are deleted (``_evict_object``) where they
        must be (the tenant's uploads under way are waited for where only they are in the
        way); its bytes count from now on (``_settle`` ends the PUT). False: it does not fit
        even so (larger than the quota alone): its entries are dropped, counted as refused.
        Only the uploading tenant's objects go."""
        quota = self.quotas.of_label(batch.label) if self.quotas is not None else None
        if quota is None:
            return True
        with self._lock:
            usage = self._usage.setdefault(batch.label, _Usage())
        with usage.lock:
            if size <= quota and time.monotonic() - usage.listed >= REFRESH_S:
                self._list(batch.label, usage)
            while True:
                held = usage.total - usage.objects.get(name, (0, 0.0))[0]  # replaced: once
                victims = []
                oldest = sorted(usage.objects.items(), key=lambda o: (o[1][1], o[0]))
                for old, (n, _) in oldest:
                    if held + size <= quota or size > quota:
                        break
                    if old != name and old not in usage.inflight:
                        victims.append(old)
                        held -= n
                if held + size <= quota:
                    break
                # the tenant's uploads under way fill it: their objects are victims once
                # uploaded (the oldest go, not the newest), so wait for them, not refuse
                others = any(n != name for n in usage.inflight)
                if size > quota or not others or not usage.settled.wait(FILE_WAIT_S):
                    self._drop(batch, quota=True)
                    return False
            for old in victims:
                self._evict_object(batch.label, old, usage)
            usage.inflight[name] = size
            usage.count()
        return True

    def _settle(self, label: str, name: str, size: int | None) -> None:
        """Object ``name``'s PUT ended: in its tenant's usage (``size``), or not (None)."""
        with self._lock:
            usage = self._usage.get(label)
        if usage is None or not name:
            return
        with usage.lock:
            if usage.inflight.pop(name, None) is None:
                return
            if size is not None:
                usage.objects[name] = (size, time.time())
            usage.count()
            usage.settled.notify_all()

    def _list(self, label: str, usage: _Usage) -> None:
        """List tenant ``label``'s objects (every writer's) into ``usage``. Under its lock."""
        objects = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.settings.bucket, Prefix=self.tenant_prefix(label)
        )
        for page in pages:
            for o in page.get("Contents", ()):
                objects[o["Key"]] = (int(o["Size"]), o["LastModified"].timestamp())
        usage.objects, usage.listed = objects, time.monotonic()
        usage.count()

    def _evict_object(self, label: str, name: str, usage: _Usage) -> None:
        """Delete tenant ``label``'s object ``name`` for its quota: its entries leave the
        index (``_gone``) and, where its header reads, the pointers of the blocks it lists
        go too (DeleteObjects, best effort). Under ``usage``'s lock."""
        digest = bytes.fromhex(name.rsplit("/", 1)[1].removesuffix(".slab"))
        head = self._header_of(label, digest)
        self.client.delete_object(Bucket=self.settings.bucket, Key=name)
        usage.objects.pop(name, None)
        keys = [] if head is None else [get_key(r, "klen", "key") for r in head.records]
        keys = [k for k in keys if k]
        with self._lock:
            self._headers.pop(name, None)
            counts = self.quota_counts.setdefault(label, [0, 0])
            counts[1] += len(keys)
            self.stats.quota_evicted += len(keys)
            self.stats.quota_evicted_objects += 1
            for k in keys if head is not None else list(self._index):
                loc = self._index.get(k)
                if loc is not None and (loc.label, loc.digest) == (label, digest):
                    del self._index[k]
                    self._gone.append(k)
        if head is None:
            return
        names = [self.pointer_name(m) for r in head.records if get_key(r, "klen", "key")
                 for m in self.format.members(r) if m is not None]  # fmt: skip
        self._delete(names, "pointers of an object over quota")

    def _header_of(self, label: str, digest: bytes) -> _Header | None:
        """An object's header, its slot count unknown (cached; else read after its first
        page, which says it)."""
        name = self.object_name(digest, label)
        with self._lock:
            head = self._headers.get(name)
        if head is not None:
            return head
        try:
            first = self._get(name, Range=f"bytes=0-{ALIGN - 1}")
        except Exception as e:
            log.warning("object tier %s: reading %s failed: %r", self.base, name, e)
            return None
        fixed = self.format.check_fixed(first or b"")
        return None if isinstance(fixed, str) else self._header(label, digest, fixed[0])

    def _put_pointers(
        self, digest: bytes, keys: list[bytes], locs: list[_Loc], records: np.ndarray
    ) -> list[tuple[str, Future]]:
        """A pointer PUT for every block the entries carry, submitted (``POINTERS`` in
        flight) while the object itself is PUT: (name, its future) each."""
        puts: list[tuple[str, Future]] = []
        for k, loc in zip(keys, locs, strict=True):
            for s, m in enumerate(self.format.members(records[loc.slot])):
                if m is None:
                    continue
                name = self.pointer_name(m)
                body = _POINTER.pack(_POINTER_MAGIC, loc.label.encode(), digest, loc.slot,
                                     loc.slots, s) + k  # fmt: skip
                puts.append((name, self._pointers.submit(
                    self.client.put_object, Bucket=self.settings.bucket, Key=name,
                    Body=body)))  # fmt: skip
        return puts

    def _unpoint(self, pointers: list[tuple[str, Future]]) -> None:
        """An upload failed: its pointers not yet sent are not sent, and those sent are
        deleted (DeleteObjects, best effort), so they do not name an object never written."""
        sent = []
        for name, p in pointers:
            if p.cancel():
                continue
            try:
                p.result()
                sent.append(name)
            except Exception:  # not written
                pass
        self._delete(sent, "pointers of a failed upload")

    def _delete(self, names: list[str], what: str) -> None:
        """Delete ``names`` (DeleteObjects, up to 1000 a request; best effort: ``what``
        they are, in the warning where it fails)."""
        for a in range(0, len(names), 1000):
            try:
                self.client.delete_objects(
                    Bucket=self.settings.bucket,
                    Delete={"Objects": [{"Key": n} for n in names[a : a + 1000]], "Quiet": True},
                )
            except Exception as e:
                log.warning("object tier %s: deleting %d %s failed: %r", self.base,
                            len(names[a : a + 1000]), what, e)  # fmt: skip

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued entry is uploaded (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def close(self) -> None:
        """Upload what is queued, then stop the threads (the objects stay)."""
        self.flush()
        with self._lock:
            self._closed = True
        self._uploads.shutdown()
        self._readers.shutdown()
        self._pointers.shutdown()

    # ------------------------------------------------------------------ lookups
    def find(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """(entry key, sub-slot) of the leading block ``keys`` that pointers in the bucket
        name (uploaded by any node or cluster), up to the first that none names; the
        entries are then in this tier's index, for ``load``."""
        out: list[tuple[bytes, int]] = []
        now = time.monotonic()
        with self._lock:
            if keys and self._absent.get(keys[0], 0.0) > now:
                return out
        got = self._resolve(keys, leading=True)
        with self._lock:
            if len(got) < len(keys):  # the first block nothing names
                self._absent[keys[len(got)]] = now + ABSENT_S
                self._absent.move_to_end(keys[len(got)])
                while len(self._absent) > ABSENT_KEYS:
                    self._absent.popitem(last=False)
            for g in got:
                entry, sub, loc = g
                if entry not in self._index and entry not in self._pending:
                    self._note(entry, loc)
                    self.stats.found += 1
                out.append((entry, sub))
        return out

    def _resolve(
        self,
        keys: Sequence[bytes],
        leading: bool = False,
        bodies: dict[str, tuple[bytes, str]] | None = None,
    ) -> list[tuple[bytes, int, _Loc] | None]:
        """(entry key, sub-slot, where) of each block key by its pointer, or None. A pointer
        names an object whose header lists every block its entries carry: read once (and
        cached for the load), it answers for the object's other blocks, so a batch costs a
        pointer GET per object, not per block (the first key's alone, then ``POINTER_ROUND``
        at a time). ``leading``: the keys up to the first that nothing names (a prompt the
        bucket lacks costs one GET). ``bodies``: where a load wants about half an object's
        slots or more (and the object is at most two batches), the whole object is read at
        once instead of its header (one GET where a header, then rows, took two), its bytes
        left there by object for ``_read``."""
        out: list[tuple[bytes, int, _Loc] | None] = []
        known: dict[bytes, tuple[bytes, int, _Loc]] = {}
        # the first key's pointer alone: the header of its object usually answers for the
        # keys that follow it (an upload's entries, in order), and the next round asks only
        # for the keys still unknown
        step = 1
        at = 0
        while at < len(keys):
            window = keys[at : at + step]
            ask = [k for k in window if k not in known]
            for k, g in zip(ask, self._pointer_gets(ask), strict=True):
                if g is not None:
                    known[k] = g
                    loc = g[2]
                    whole = 2 * len(keys) >= loc.slots and loc.slots <= 2 * self.per_object
                    self._listed(loc, known, bodies if whole else None)
            for k in window:
                if k not in known and leading:
                    return out
                out.append(known.get(k))
            at += len(window)
            step = min(8 * step, 512) if leading else POINTER_ROUND
        return out

    def _listed(
        self,
        loc: _Loc,
        known: dict[bytes, tuple[bytes, int, _Loc]],
        bodies: dict[str, tuple[bytes, str]] | None = None,
    ) -> None:
        """The blocks the header of ``loc``'s object lists, into ``known`` (``bodies``: the
        whole object read, see ``_resolve``)."""
        head = self._header(loc.label, loc.digest, loc.slots, bodies)
        if head is None:
            return
        for i, r in enumerate(head.records):
            entry, where = get_key(r, "klen", "key"), _Loc(loc.digest, i, loc.slots, loc.label)
            for s, m in enumerate(self.format.members(r)):
                if m is not None:
                    known.setdefault(m, (entry, s, where))

    def _pointer_gets(self, keys: Sequence[bytes]) -> list[tuple[bytes, int, _Loc] | None]:
        return list(self._pointers.map(self._pointer_get, keys))

    def _pointer_get(self, key: bytes) -> tuple[bytes, int, _Loc] | None:
        try:
            body = self._get(self.pointer_name(key))
        except Exception as e:  # unreachable, refused: not found
            log.warning("object tier %s: reading a pointer failed: %r", self.base, e)
            return None
        if body is None or len(body) < _POINTER.size:
            return None
        magic, label, digest, slot, slots, sub = _POINTER.unpack(body[: _POINTER.size])
        label = label.rstrip(b"\0").decode("ascii", "replace")
        if magic != _POINTER_MAGIC or not _LABEL.fullmatch(label):  # an older pointer: a miss
            return None
        return body[_POINTER.size :], sub, _Loc(digest, slot, slots, label)

    def _get(self, name: str, **kw: Any) -> bytes | None:
        """An object's bytes (``Range`` etc. in ``kw``); None: not there (or replaced, with
        ``IfMatch``)."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.settings.bucket, Key=name, **kw)[
                "Body"
            ].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in _ABSENT:
                return None
            raise

    # ------------------------------------------------------------------ loads
    def buffer(self, n: int) -> np.ndarray:
        """A buffer for ``load``'s ``out``: room for ``n`` entries."""
        return np.frombuffer(mmap.mmap(-1, max(ALIGN, n * self.stride)), np.uint8)

    def load(self, keys: Sequence[bytes], out: np.ndarray | None = None) -> Entries:
        """The entries of ``keys`` (entry keys) held in the bucket (this tier's index, queued
        uploads, else their pointers) and verified against their checksums, in the order of
        ``keys``; the others are left out and counted. Rows go to ``out`` where it has room
        (the returned rows are views of it)."""
        keys = list(dict.fromkeys(keys))
        self._wait_files(keys)
        queued: list[tuple[bytes, _Batch, int]] = []
        located: dict[bytes, _Loc] = {}
        unknown: list[bytes] = []
        with self._lock:
            for k in keys:
                if k in self._pending and self._pending[k][0].path is None:
                    queued.append((k, *self._pending[k]))
                elif k in self._index:
                    self._index.move_to_end(k)
                    located[k] = self._index[k]
                else:
                    unknown.append(k)
        bodies: dict[str, tuple[bytes, str]] = {}  # objects read whole while resolving
        for k, got in zip(unknown, self._resolve(unknown, bodies=bodies), strict=True):
            if got is not None and got[0] == k:  # a pointer of the entry's own key
                located[k] = got[2]
                with self._lock:
                    self.stats.found += k not in self._index
        found = list(located.items())
        n = len(queued) + len(found)
        if out is None or out.nbytes < n * self.stride:
            out = self.buffer(n)
        buf = out[: n * self.stride].reshape(n, self.stride)
        rec = np.zeros(n, self.format.dtype)
        good = np.zeros(n, bool)
        with self._lock:  # not uploaded yet: from the staging buffer
            for j, (k, batch, i) in enumerate(queued):
                if self._pending.get(k, (None,))[0] is batch:
                    buf[j], rec[j], good[j] = batch.rows[i], batch.records[i], True
        base = len(queued)
        good[:base] &= self.format.verified(buf[:base], rec[:base])
        torn = self._read(found, buf[base:], rec[base:], good[base:], bodies)
        del bodies
        with self._lock:
            for j, (k, loc) in enumerate(found):
                if good[base + j]:
                    if k not in self._pending:
                        self._note(k, loc)
                    continue
                self.stats.torn += bool(torn[j])
                self.stats.checksum_errors += not torn[j]
                if self._index.get(k) == loc:
                    del self._index[k]
                    self._gone.append(k)
            hits = int(good.sum())
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.read_bytes += hits * self.entry_bytes
        order = [q[0] for q in queued] + [f[0] for f in found]
        rank = {k: i for i, k in enumerate(keys)}
        pick = np.array(sorted(np.flatnonzero(good).tolist(), key=lambda j: rank[order[j]]),
                        np.int64)  # fmt: skip
        if len(pick) == n and (pick == np.arange(n)).all():
            return self.format.entries(order, buf, rec)
        return self.format.entries([order[j] for j in pick.tolist()], buf[pick], rec[pick])

    def _wait_files(self, keys: list[bytes]) -> None:
        """Wait for the uploads of disk slabs holding any of ``keys`` (their rows are in
        the file being uploaded, removed once it is)."""

        def waiting() -> bool:
            return not any(k in self._pending and self._pending[k][0].path for k in keys)

        with self._idle:
            self._idle.wait_for(waiting, FILE_WAIT_S)

    def _read(
        self,
        found: list[tuple[bytes, _Loc]],
        buf: np.ndarray,
        rec: np.ndarray,
        good: np.ndarray,
        bodies: dict[str, tuple[bytes, str]] | None = None,
    ) -> np.ndarray:
        """Read and verify ``found`` into ``buf`` (their records into ``rec``, whether each
        is good into ``good``); returns per entry whether it was torn (not there whole)."""
        torn = np.ones(len(found), bool)
        by_object: dict[str, list[int]] = {}
        for j, (_, loc) in enumerate(found):
            by_object.setdefault(self.object_name(loc.digest, loc.label), []).append(j)

        def header(name: str) -> _Header | None:
            loc = found[by_object[name][0]][1]
            return self._header(loc.label, loc.digest, loc.slots)

        headers = dict(zip(by_object, self._readers.map(header, by_object), strict=True))
        pieces: list[tuple[list[int], Future]] = []
        step = max(1, READ_PIECE_BYTES // self.stride)
        for name, js in by_object.items():
            head = headers[name]
            if head is None:
                continue
            ok = []
            for j in js:
                k, loc = found[j]
                if loc.slot < len(head.records) and get_key(head.records[loc.slot], "klen",
                                                            "key") == k:  # fmt: skip
                    rec[j] = head.records[loc.slot]
                    ok.append(j)
            ok.sort(key=lambda j: found[j][1].slot)
            start = 0
            while start < len(ok):  # runs of consecutive slots, in pieces
                end = start + 1
                while (end < len(ok) and end - start < step
                       and found[ok[end]][1].slot == found[ok[end - 1]][1].slot + 1):  # fmt: skip
                    end += 1
                run = ok[start:end]
                body = (bodies or {}).get(name)
                pieces.append((run, self._readers.submit(self._read_run, name, head, found,
                                                         run, buf, rec, body)))  # fmt: skip
                start = end
        for run, done in pieces:
            whole, verified = done.result()
            torn[run] = ~whole
            good[run] = whole & verified
        return torn

    def _read_run(
        self,
        name: str,
        head: _Header,
        found: list[tuple[bytes, _Loc]],
        run: list[int],
        buf: np.ndarray,
        rec: np.ndarray,
        body: tuple[bytes, str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One ranged GET of consecutive slots (``run``: indices into ``found``), sent with
        the header's ETag, or their bytes in ``body`` (the object read whole, with its
        ETag): (read whole, verified) per entry."""
        first = found[run[0]][1]
        lo = self.format.header_bytes(first.slots) + first.slot * self.stride
        hi = lo + len(run) * self.stride
        whole = np.zeros(len(run), bool)
        # the rule (a load in slot order): one run of rows of ``buf``, read into in place
        a = run[0]
        dense = run == list(range(a, a + len(run)))
        into = buf[a : a + len(run)] if dense else np.empty((len(run), self.stride), np.uint8)
        # every slot of an object (a batch loaded back whole): a plain GET, skipping the
        # header, as some servers serve a ranged GET slower (moto: ~1.7 x)
        everything = first.slot == 0 and len(run) == len(head.records) == first.slots
        ranged = {} if everything else {"Range": f"bytes={lo}-{hi - 1}"}
        try:
            if body is not None and body[1] == head.etag:  # read whole while resolving
                part = np.frombuffer(body[0], np.uint8)[lo:hi]
                got = len(part)
                into.reshape(-1)[:got] = part
            else:
                got = self._get_into(name, into.reshape(-1), lo if everything else 0,
                                     IfMatch=head.etag, **ranged)  # fmt: skip
        except Exception as e:  # unreachable, refused: a miss, counted as torn
            log.warning("object tier %s: reading %s failed: %r", self.base, name, e)
            got = None
        if got is None:  # gone or replaced: its cached header is stale too
            with self._lock:
                self._headers.pop(name, None)
            return whole, whole
        got //= self.stride
        if not dense and got:
            buf[np.asarray(run[:got], np.int64)] = into[:got]
        whole[:got] = True
        return whole, whole & self.format.verified(into, rec[run])

    def _get_into(self, name: str, out: np.ndarray, skip: int = 0, **kw: Any) -> int | None:
        """Read object ``name`` (``Range`` etc. in ``kw``), its first ``skip`` bytes left
        out, into ``out`` (contiguous uint8): the bytes read into it; None: not there (or
        replaced, with ``IfMatch``). Straight from the socket where the stream takes
        ``readinto`` (urllib3's, under botocore's body), not through a bytes object."""
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.settings.bucket, Key=name, **kw)["Body"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in _ABSENT:
                return None
            raise
        view = memoryview(out).cast("B")
        readinto = getattr(getattr(body, "_raw_stream", None), "readinto", None)
        try:
            if skip and len(body.read(skip)) < skip:
                return 0
            if readinto is None:
                data = body.read(len(view))
                n = min(len(data), len(view))
                view[:n] = data[:n]
                return n
            got = 0
            while got < len(view):
                n = readinto(view[got:])
                if not n:
                    break
                got += n
            return got
        finally:
            body.close()

    def _header(
        self,
        label: str,
        digest: bytes,
        slots: int,
        bodies: dict[str, tuple[bytes, str]] | None = None,
    ) -> _Header | None:
        """The header of tenant ``label``'s object ``digest`` (cached; else one ranged GET,
        or with ``bodies`` a GET of the whole object, left there), checked; None: missing or
        refused (counted)."""
        name = self.object_name(digest, label)
        with self._lock:
            head = self._headers.get(name)
            if head is not None:
                self._headers.move_to_end(name)
                return head
            if name in self._refused:  # counted once, not read again
                return None
        from botocore.exceptions import ClientError

        hb = self.format.header_bytes(slots)
        ranged = {} if bodies is not None else {"Range": f"bytes=0-{hb - 1}"}
        try:
            got = self.client.get_object(Bucket=self.settings.bucket, Key=name, **ranged)
            blob, etag = got["Body"].read(), got["ETag"]
        except ClientError:
            return None
        except Exception as e:
            log.warning("object tier %s: reading the header of %s failed: %r", self.base,
                        name, e)  # fmt: skip
            return None
        fixed = self.format.check_fixed(blob[:HEAD])
        why = fixed if isinstance(fixed, str) else None
        if why is None:
            records = self.format.check_records(
                blob[:HEAD], blob[HEAD : HEAD + fixed[1] * self.format.dtype.itemsize]
            )
            why = records if isinstance(records, str) else None
        if why is not None:
            log.warning("object tier %s: refused object %s (%s)", self.base, name, why)
            with self._lock:
                self.stats.refused_objects += 1
                if len(self._refused) >= HEADERS_CACHED:
                    self._refused.clear()
                self._refused.add(name)
            return None
        head = _Header(records, etag)
        with self._lock:
            self._remember_header(name, head)
        if bodies is not None:
            bodies[name] = (blob, etag)
        return head

    # ------------------------------------------------------------------ internals
    def _note(self, key: bytes, loc: _Loc) -> None:
        """Index ``key`` (under the lock); the least recently used past the bound leave it."""
        self._index[key] = loc
        self._index.move_to_end(key)
        self._absent.pop(key, None)
        while len(self._index) > self.index_entries:
            old, _ = self._index.popitem(last=False)
            self._gone.append(old)

    def _keep_spare(self, batch: _Batch) -> None:
        """A full batch's buffer back to the spares once its entries left ``_pending``
        (under the lock): loads read them from the bucket now, and those that read the
        staging buffer copied it under the lock before."""
        full = self.format.header_bytes(self.per_object) + self.per_object * self.stride
        if batch.body is None or len(batch.body) != full or len(self._spare) >= SPARE_BUFFERS:
            return
        self._spare.append(batch.body)

    def _remember_header(self, name: str, head: _Header) -> None:
        self._headers[name] = head
        self._headers.move_to_end(name)
        while len(self._headers) > HEADERS_CACHED:
            self._headers.popitem(last=False)
