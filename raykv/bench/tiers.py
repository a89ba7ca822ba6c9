"""``raykv bench tiers``: the disk tier's write of demoted entries and read of hits, next to a
plain sequential O_DIRECT write and read of the same bytes in the same folder (a ``dd
oflag=direct`` loop), in one run.

The entries are a preset's CPU-tier entries (llama-3-8b: 2 MiB each) with their checksums;
each round writes and reads them once each way, in a fresh tier and a fresh file.
The tier's write is timed from the first ``demote`` (batches of ``batch_bytes``, as a CPU
tier evicting for a large store hands them over: copied out of the arena, then written by
the tier's writer thread) until everything is on disk (``flush``); its read from the first
``load`` (the same batches) until the last entry is read and verified against its
checksums. The plain loop writes and reads ``chunk_bytes`` at a time from one aligned
buffer, one file. Both go to the device (O_DIRECT) where the filesystem takes it, both
through the page cache where it does not (reported).
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


def disk_tier(
    path: Path, plan: Plan, arena: torch.Tensor, valid: KeyRows, sums: KeySums,
    batch_bytes: int = BATCH_BYTES,
) -> dict[str, Any]:  # fmt: skip
    """Demote the ``arena``'s entries into a fresh disk tier in ``path``, then load them all
    back (verified): seconds each, whether it wrote O_DIRECT."""
    from raykv.tiers.disk_tier import DiskTier, model_identity

    entry, n = plan.gpu_bytes_per_block, arena.shape[1]
    per = max(1, batch_bytes // entry)
    keys = [b"\0\0\0\0" + i.to_bytes(32, "little") for i in range(n)]
    tier = DiskTier(path / "tier", plan, model_identity("bench", plan), 2 * n * entry + (1 << 30))
    try:
        t0 = time.perf_counter()
        for i in range(0, n, per):
            at = np.arange(i, min(n, i + per))
            part = keys[i : i + per]
            tier.demote(part, arena, at, KeyRows(valid.values[at], valid.lengths[at]),
                        KeySums(sums.sums[:, at], sums.lengths[:, at]), [entry] * len(at),
                        [(k,) for k in part])  # fmt: skip
        tier.flush()
        write_s = time.perf_counter() - t0
        out = tier.buffer(per)  # reused, as the node's tier reuses its own
        t0 = time.perf_counter()
        got = 0
        for i in range(0, n, per):
            got += len(tier.load(keys[i : i + per], out).keys)
        read_s = time.perf_counter() - t0
        if got != n:
            raise TierError(f"the disk tier served {got} of {n} entries; see its log")
        return {"write_s": write_s, "read_s": read_s, "direct": tier.direct}
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
            steps = [lambda: plain(root, nbytes), lambda: disk_tier(root, plan, arena, valid, sums)]
            got = [step() for step in (steps if r % 2 == 0 else steps[::-1])]
            raw, tier = got if r % 2 == 0 else got[::-1]
            runs.append({
                "tier_write": nbytes / tier["write_s"] / 1e9,
                "tier_read": nbytes / tier["read_s"] / 1e9,
                "plain_write": nbytes / raw["write_s"] / 1e9,
                "plain_read": nbytes / raw["read_s"] / 1e9,
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
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def local_s3(bucket: str = "raykv") -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 for as long as the context lasts (moto's, in a
    process of its own, so neither side of a comparison shares its GIL), with ``bucket``
    created and dummy credentials in this process's environment if it has none: its
    endpoint URL."""
    try:
        import boto3
    except ImportError as e:
        raise TierError("a local S3 server needs boto3 and moto: pip install 'raykv[dev]'") from e
    for name, value in (("AWS_ACCESS_KEY_ID", "raykv"), ("AWS_SECRET_ACCESS_KEY", "raykv"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ.setdefault(name, value)
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
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
