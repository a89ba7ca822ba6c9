"""``raykv bench tiers``: the disk tier's write of demoted entries and read of hits, next to a
plain sequential O_DIRECT write and read of the same bytes in the same folder (a ``dd
oflag=direct`` loop), and the disk tier forced to buffered I/O (+ ``fdatasync``) beside its
O_DIRECT default, in one run.

The entries are a preset's CPU-tier entries (llama-3-8b: 2 MiB each) with their checksums;
each round writes and reads them once each way, in a fresh tier and a fresh file.
The tier's write is timed from the first ``demote`` (batches of ``batch_bytes``, as a CPU
tier evicting for a large store hands them over: copied out of the arena, then written by
the tier's writer thread) until everything is on disk (``flush``); its read from the first
``load`` (the same batches) until the last entry is read and verified against its
checksums. The plain loop writes and reads ``chunk_bytes`` at a time from one aligned
buffer, one file. Both go to the device (O_DIRECT) where the filesystem takes it, both
through the page cache where it does not (reported).

The object tier's rows (``run_objects``): the same entries demoted into a fresh
``ObjectTier`` (objects of ``batch_bytes``, uploaded in the background, plus a pointer per
block) until all are in the bucket, then loaded back and verified, by the node that uploaded
them and by a fresh tier (another node: through the pointers and the objects' headers);
next to plain boto3 ``put_object`` / ``get_object`` of the same bytes in objects of the same
size, one after another, against the same server (a local moto server the bench starts when
no endpoint is given: a Python server on the same cores, so its numbers are the tier's
overheads against the same client, not an S3's bandwidth).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raykv.errors import TierError
from raykv.layout.plan import Plan
from raykv.tiers.checksum import checksums_at
from raykv.tiers.cpu_tier import KeyRows, KeySums

DEFAULT_BYTES = 1 << 30
DEFAULT_OBJECT_BYTES = 256 << 20
BATCH_BYTES = 64 << 20  # a CPU tier's eviction for one large store
CHUNK_BYTES = 64 << 20  # the plain loop's block size (dd bs=64M)


def bench_plan(preset: str = "llama-3-8b") -> Plan:
    """One TP rank of ``preset`` at its usual block size: its entries are what is demoted."""
    from raykv.layout.presets import get_preset
    from raykv.layout.sizing import plan

    p = get_preset(preset)
    # two blocks (the null one and one more): only the entry's layout matters here
    return plan(dict(p.layers()), num_gpu_blocks=2, max_model_len=16, max_num_batched_tokens=16)


def plain(path: Path, nbytes: int, chunk: int = CHUNK_BYTES) -> dict[str, Any]:
    """Sequential write then read of ``nbytes`` in ``chunk`` pieces, O_DIRECT where the
    filesystem takes it: seconds each and whether it was direct."""
    buf = np.frombuffer(mmap.mmap(-1, chunk), np.uint8)
    buf[:] = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8)
    file = path / "plain.bin"
    try:
        fd, direct = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600), True
    except OSError:
        fd, direct = os.open(file, os.O_WRONLY | os.O_CREAT, 0o600), False
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.pwrite(fd, buf, off)
        if not direct:
            os.fdatasync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    fd = os.open(file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    file.unlink()
    return {"write_s": write_s, "read_s": read_s, "direct": direct}


def entries(plan: Plan, nbytes: int) -> tuple[torch.Tensor, KeyRows, KeySums]:
    """A CPU arena of random entries (``nbytes`` of them, whole) with their valid flags and
    checksums, as the CPU tier hands them to ``demote``."""
    entry = plan.gpu_bytes_per_block
    n = max(1, nbytes // entry)
    arena = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (1, n, entry), np.uint8))
    sums = np.asarray(checksums_at(arena[0].numpy(), range(n), entry), np.int64).reshape(1, n, 1)
    valid = KeyRows(np.ones((n, 1), bool), np.ones(n, np.int64))
    return arena, valid, KeySums(sums, np.ones((1, n), np.int64))


def drop_cache(path: Path) -> None:
    """Evict the files under ``path`` from the page cache (``POSIX_FADV_DONTNEED``, no root
    needed for clean pages): a buffered read after it reads the disk, as a read of an entry
    demoted long ago does once the page cache has moved on."""
    for file in path.rglob("*.kv"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _demote_all(
    tier: Any, keys: list[bytes], per: int, arena: torch.Tensor, valid: KeyRows, sums: KeySums,
    entry: int,
) -> float:  # fmt: skip
    """Seconds to demote the ``arena``'s entries (``keys``) into ``tier`` (a disk or an object
    tier), ``per`` a call, as the CPU tier's evictions do, and to see them all written."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), per):
        at = np.arange(i, min(len(keys), i + per))
        part = keys[i : i + per]
        tier.demote(part, arena, at, KeyRows(valid.values[at], valid.lengths[at]),
                    KeySums(sums.sums[:, at], sums.lengths[:, at]), [entry] * len(at),
                    [(k,) for k in part])  # fmt: skip
    tier.flush()
    return time.perf_counter() - t0


def disk_tier(
    path: Path, plan: Plan, arena: torch.Tensor, valid: KeyRows, sums: KeySums,
    batch_bytes: int = BATCH_BYTES, direct: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Demote the ``arena``'s entries into a fresh disk tier in ``path``, then load them all
    back (verified): seconds each, whether it wrote O_DIRECT. ``direct=False``: the tier
    forced to buffered I/O (+ ``fdatasync``); its read is timed twice, once with its files
    dropped from the page cache first (``read_s``: from the disk) and once again right after
    (``warm_read_s``: from the page cache, the copy O_DIRECT does not keep)."""
    from raykv.tiers.disk_tier import DiskTier, model_identity

    entry, n = plan.gpu_bytes_per_block, arena.shape[1]
    per = max(1, batch_bytes // entry)
    keys = [b"\0\0\0\0" + i.to_bytes(32, "little") for i in range(n)]
    tier = DiskTier(path / "tier", plan, model_identity("bench", plan), 2 * n * entry + (1 << 30),
                    direct=direct)  # fmt: skip
    try:
        write_s = _demote_all(tier, keys, per, arena, valid, sums, entry)
        out = tier.buffer(per)  # reused, as the node's tier reuses its own

        def read() -> float:
            t0 = time.perf_counter()
            got = 0
            for i in range(0, n, per):
                got += len(tier.load(keys[i : i + per], out).keys)
            if got != n:
                raise TierError(f"the disk tier served {got} of {n} entries; see its log")
            return time.perf_counter() - t0

        if not tier.direct:
            drop_cache(path / "tier")
        got = {"write_s": write_s, "read_s": read(), "direct": tier.direct}
        if not direct:
            got["warm_read_s"] = read()
        return got
    finally:
        tier.close()
        shutil.rmtree(path / "tier", ignore_errors=True)


def run(path: str | None = None, nbytes: int = DEFAULT_BYTES, rounds: int = 3) -> dict[str, Any]:
    """Both, side by side, ``rounds`` times (the order alternating, so a disk that speeds up
    or slows down over the run favours neither), in a fresh folder under ``path`` (default:
    the temp folder); medians."""
    from raykv.blocks.hashing import build_native

    build_native()  # the tier verifies with the native row sums, as the service does
    plan = bench_plan()
    arena, valid, sums = entries(plan, nbytes)
    nbytes = arena.numel()
    root = Path(tempfile.mkdtemp(prefix="raykv-bench-tiers-", dir=path))
    runs: list[dict[str, float]] = []
    try:
        for r in range(rounds):
            steps = [
                lambda: plain(root, nbytes),
                lambda: disk_tier(root, plan, arena, valid, sums),
                lambda: disk_tier(root, plan, arena, valid, sums, direct=False),
            ]
            order = list(range(len(steps))) if r % 2 == 0 else list(range(len(steps)))[::-1]
            got = {i: steps[i]() for i in order}
            raw, tier, buffered = got[0], got[1], got[2]
            runs.append({
                "tier_write": nbytes / tier["write_s"] / 1e9,
                "tier_read": nbytes / tier["read_s"] / 1e9,
                "plain_write": nbytes / raw["write_s"] / 1e9,
                "plain_read": nbytes / raw["read_s"] / 1e9,
                "buffered_write": nbytes / buffered["write_s"] / 1e9,
                "buffered_read": nbytes / buffered["read_s"] / 1e9,
                "buffered_warm_read": nbytes / buffered["warm_read_s"] / 1e9,
            })  # fmt: skip
        direct = {"tier": tier["direct"], "plain": raw["direct"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbs = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "path": str(root.parent),
        "filesystem": _filesystem(root.parent),
        "bytes": nbytes,
        "entry_bytes": plan.gpu_bytes_per_block,
        "rounds": runs,
        "direct": direct,
        "gbps": gbs,
        "write_ratio": statistics.median(r["tier_write"] / r["plain_write"] for r in runs),
        "read_ratio": statistics.median(r["tier_read"] / r["plain_read"] for r in runs),
        # the tier forced to buffered I/O against the tier with O_DIRECT, same bytes
        "buffered_write_ratio": statistics.median(
            r["buffered_write"] / r["tier_write"] for r in runs
        ),
        "buffered_read_ratio": statistics.median(r["buffered_read"] / r["tier_read"] for r in runs),
    }


def _filesystem(path: Path) -> str:
    """The filesystem type of ``path``'s mount (``/proc/mounts``), or "unknown"."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                _, mount, fs, *_ = line.split()
                if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                    best, kind = mount, fs
    except OSError:
        pass
    return kind


def format_report(r: dict[str, Any]) -> str:
    g = r["gbps"]
    direct = "O_DIRECT" if r["direct"]["tier"] and r["direct"]["plain"] else "page cache"
    lines = [
        f"disk tier vs plain sequential I/O: {r['bytes'] / 2**30:.2f} GiB in "
        f"{r['entry_bytes'] / 2**20:.1f} MiB entries, {r['path']} ({r['filesystem']}, {direct}), "
        f"median of {len(r['rounds'])} rounds (ratio: median of the rounds' ratios)",
        f"{'':8}{'disk tier GB/s':>16}{'plain GB/s':>14}{'ratio':>8}",
        f"{'write':8}{g['tier_write']:>16.2f}{g['plain_write']:>14.2f}{r['write_ratio']:>8.2f}",
        f"{'read':8}{g['tier_read']:>16.2f}{g['plain_read']:>14.2f}{r['read_ratio']:>8.2f}",
        "the disk tier forced to buffered I/O (+ fdatasync) vs the disk tier with O_DIRECT, "
        "same bytes (ratio: buffered / O_DIRECT)",
        f"{'':8}{'buffered GB/s':>16}{'O_DIRECT GB/s':>14}{'ratio':>8}",
        f"{'write':8}{g['buffered_write']:>16.2f}{g['tier_write']:>14.2f}"
        f"{r['buffered_write_ratio']:>8.2f}",
        f"{'read':8}{g['buffered_read']:>16.2f}{g['tier_read']:>14.2f}"
        f"{r['buffered_read_ratio']:>8.2f}  (page cache dropped first: from the disk)",
        f"{'re-read':8}{g['buffered_warm_read']:>16.2f}{'':>14}{'':>8}  (right after: from "
        "the page cache, a second copy of what the CPU tier above may hold)",
    ]
    return "\n".join(lines)


# what a local S3 server takes (boto3 reads them from the environment)
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "raykv", "AWS_SECRET_ACCESS_KEY": "raykv",
                     "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


@contextlib.contextmanager
def local_s3(bucket: str = "raykv") -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 for as long as the context lasts (moto's, in a
    process of its own, so neither side of a comparison shares its GIL), with ``bucket``
    created: its endpoint URL. It takes any credentials (``DUMMY_CREDENTIALS``)."""
    try:
        import boto3
    except ImportError as e:
        raise TierError("a local S3 server needs boto3 and moto: pip install 'raykv[dev]'") from e
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
         "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise TierError(f"moto's S3 server did not start on {endpoint}") from None
                time.sleep(0.1)
        creds = {"aws_access_key_id": "raykv", "aws_secret_access_key": "raykv"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     **creds).create_bucket(Bucket=bucket)  # fmt: skip
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plain_s3(client: Any, bucket: str, prefix: str, nbytes: int,
             chunk: int = BATCH_BYTES) -> dict[str, Any]:  # fmt: skip
    """boto3 ``put_object`` of ``nbytes`` in objects of ``chunk`` bytes one after another,
    then ``get_object`` of each: seconds each."""
    body = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    names = [f"{prefix}/plain-{i:06d}" for i in range(-(-nbytes // chunk))]
    t0 = time.perf_counter()
    for name in names:
        client.put_object(Bucket=bucket, Key=name, Body=body)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name in names:
        got = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        if len(got) != chunk:
            raise TierError(f"{name}: read {len(got)} of {chunk} bytes")
    read_s = time.perf_counter() - t0
    return {"write_s": write_s, "read_s": read_s}


def object_tier(
    settings: Any, plan: Plan, arena: torch.Tensor, valid: KeyRows, sums: KeySums,
    batch_bytes: int = BATCH_BYTES,
) -> dict[str, Any]:  # fmt: skip
    """Demote the ``arena``'s entries into a fresh object tier under ``settings`` (a prefix
    of its own), until all are uploaded; load them back (verified) on it, then on a fresh
    tier that knows nothing of them: seconds each."""
    from raykv.tiers.disk_tier import model_identity
    from raykv.tiers.object_tier import ObjectTier

    entry, n = plan.gpu_bytes_per_block, arena.shape[1]
    per = max(1, batch_bytes // entry)
    keys = [b"\0\0\0\0" + i.to_bytes(32, "little") for i in range(n)]
    identity = model_identity("bench", plan)
    tier = ObjectTier(settings, plan, identity, batch_bytes=batch_bytes)
    other = None
    try:
        write_s = _demote_all(tier, keys, per, arena, valid, sums, entry)
        if tier.stats.write_errors:
            raise TierError(f"the object tier failed {tier.stats.write_errors} uploads")
        out = tier.buffer(per)
        reads = []
        other = ObjectTier(settings, plan, identity, batch_bytes=batch_bytes)
        for t in (tier, other):  # the uploading node (its index), another (by pointer)
            t0 = time.perf_counter()
            got = sum(len(t.load(keys[i : i + per], out).keys) for i in range(0, n, per))
            reads.append(time.perf_counter() - t0)
            if got != n:
                raise TierError(f"the object tier served {got} of {n} entries; see its log")
        return {"write_s": write_s, "read_s": reads[0], "read_other_s": reads[1]}
    finally:
        tier.close()
        if other is not None:
            other.close()


def _clear(client: Any, bucket: str, prefix: str) -> None:
    """Remove every object under ``prefix`` (a round's, so the server holds one round)."""
    while True:
        got = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", MaxKeys=1000)
        names = [{"Key": o["Key"]} for o in got.get("Contents", [])]
        if not names:
            return
        client.delete_objects(Bucket=bucket, Delete={"Objects": names, "Quiet": True})


def run_objects(
    url: str | None = None, endpoint: str | None = None, nbytes: int = DEFAULT_OBJECT_BYTES,
    rounds: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """The object tier against plain boto3, side by side, ``rounds`` times (alternating
    which goes first), against ``url``/``endpoint`` or, with neither, a local moto server
    started here; medians."""
    from raykv.bench.chaos import environment
    from raykv.blocks.hashing import build_native
    from raykv.tiers.object_tier import ObjectSettings, s3_client

    build_native()
    plan = bench_plan()
    arena, valid, sums = entries(plan, nbytes)
    nbytes = arena.numel()
    with contextlib.ExitStack() as stack:
        if url is None:
            if endpoint is not None:
                raise TierError("--object-endpoint needs --object-url s3://BUCKET/PREFIX")
            endpoint = stack.enter_context(local_s3("raykv-bench"))
            stack.enter_context(environment(DUMMY_CREDENTIALS))
            url = "s3://raykv-bench/bench"
        base = ObjectSettings.parse(url, endpoint)
        client = s3_client(base.endpoint)
        runs: list[dict[str, float]] = []
        for r in range(rounds):
            prefix = f"{base.prefix}/round-{os.getpid()}-{r}".strip("/")
            settings = ObjectSettings(base.bucket, prefix, base.endpoint)
            steps = [lambda p=prefix: plain_s3(client, base.bucket, p, nbytes),
                     lambda s=settings: object_tier(s, plan, arena, valid, sums)]  # fmt: skip
            try:
                got = [step() for step in (steps if r % 2 == 0 else steps[::-1])]
            finally:
                _clear(client, base.bucket, prefix)
            raw, tier = got if r % 2 == 0 else got[::-1]
            runs.append({
                "tier_write": nbytes / tier["write_s"] / 1e9,
                "tier_read": nbytes / tier["read_s"] / 1e9,
                "tier_read_other": nbytes / tier["read_other_s"] / 1e9,
                "plain_write": nbytes / raw["write_s"] / 1e9,
                "plain_read": nbytes / raw["read_s"] / 1e9,
            })  # fmt: skip
    gbs = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = {
        w: statistics.median(r[f"tier_{w}"] / r[f"plain_{w.split('_')[0]}"] for r in runs)
        for w in ("write", "read", "read_other")
    }
    return {"url": url, "endpoint": endpoint, "local": url == "s3://raykv-bench/bench",
            "bytes": nbytes, "entry_bytes": plan.gpu_bytes_per_block,
            "object_bytes": BATCH_BYTES, "rounds": runs, "gbps": gbs,
            "ratio": ratio}  # fmt: skip


def format_objects(r: dict[str, Any]) -> str:
    g, q = r["gbps"], r["ratio"]
    where = "a local moto server" if r["local"] else f"{r['url']} at {r['endpoint'] or 'AWS'}"
    lines = [
        f"object tier vs plain boto3 put_object / get_object: {r['bytes'] / 2**20:.0f} MiB in "
        f"{r['entry_bytes'] / 2**20:.1f} MiB entries, objects of "
        f"{r['object_bytes'] / 2**20:.0f} MiB, {where}, median of {len(r['rounds'])} rounds",
        f"{'':20}{'object tier GB/s':>18}{'boto3 GB/s':>12}{'ratio':>8}",
        f"{'write':20}{g['tier_write']:>18.3f}{g['plain_write']:>12.3f}{q['write']:>8.2f}",
        f"{'read (its node)':20}{g['tier_read']:>18.3f}{g['plain_read']:>12.3f}{q['read']:>8.2f}",
        f"{'read (another node)':20}{g['tier_read_other']:>18.3f}{g['plain_read']:>12.3f}"
        f"{q['read_other']:>8.2f}",
    ]
    return "\n".join(lines)
