"""GPU tests: the CUDA kernel against the torch reference, bit for bit, on every path."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from paged_copy_cases import DTYPES, kv_entries, oracle_rows, random_bits

from raykv import ops
from raykv.ops import (
    gather_blocks,
    kernel_available,
    kernel_status,
    logical_view,
    row_bytes,
    scatter_blocks,
)

pytestmark = pytest.mark.gpu
POISON = 0xA5


@pytest.fixture(scope="module")
def kernel():
    assert kernel_available(), kernel_status()  # on a GPU machine the kernel must build
    print(kernel_status())


def poisoned(n: int, width: int, where: str) -> torch.Tensor:
    if where in ("pinned", "staged"):
        rows = torch.empty(n, width, dtype=torch.uint8, pin_memory=True)
    elif where == "cpu":
        rows = torch.empty(n, width, dtype=torch.uint8)
    elif where == "peer":
        rows = torch.empty(n, width, dtype=torch.uint8, device="cuda:1")
    else:
        rows = torch.empty(n, width, dtype=torch.uint8, device="cuda:0")
    rows.fill_(POISON)
    sync_all()  # a peer buffer is filled on its own device's stream
    return rows


def sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def reference_rows(entries, ids: torch.Tensor) -> torch.Tensor:
    rows = torch.full((ids.numel(), row_bytes(entries)), POISON, dtype=torch.uint8)
    ops.gather_reference(entries, ids, rows)
    return rows


def random_ids(num_blocks: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=gen)[:n].to(torch.int64)


def need_peer(where: str) -> None:
    if where == "peer" and torch.cuda.device_count() < 2:
        pytest.skip("GPU -> GPU across devices needs two GPUs")


CASES = [
    # kind, block_size, dtype, layers, blocks in the pool, blocks copied
    ("kv", 16, "bf16", 3, 40, 1),
    ("kv", 16, "bf16", 2, 1100, 1029),
    ("kv", 64, "fp8", 2, 50, 17),
    ("kv", 128, "bf16", 2, 20, 7),
    ("kv", 128, "u8", 1, 30, 30),
    ("mla", 16, "bf16", 2, 64, 33),
    ("mla", 64, "fp8", 1, 1200, 1001),
    ("interleaved", 16, "bf16", 2, 30, 11),
    ("interleaved", 128, "f32", 1, 10, 3),
]


@pytest.mark.parametrize("where", ["device", "pinned", "staged", "cpu", "peer"])
@pytest.mark.parametrize("kind, block_size, dtype, layers, pool, n", CASES)
def test_gather_and_scatter_match_reference(
    kernel, where, kind, block_size, dtype, layers, pool, n
):
    need_peer(where)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, block_size, dtype, n)).encode()))
    entries, _backing = kv_entries(kind, pool, block_size, DTYPES[dtype], layers, gen, "cuda:0")
    ids = random_ids(pool, n, gen)
    expected = reference_rows(entries, ids)

    mode = "staged" if where == "staged" else "direct"
    rows = poisoned(n, row_bytes(entries), where)
    gather_blocks(entries, ids, rows, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), expected)

    # scatter fresh random rows back, then read the pool through the reference
    fresh = torch.randint(0, 256, expected.shape, dtype=torch.uint8, generator=gen)
    src = rows.copy_(fresh)
    sync_all()
    untouched = sorted(set(range(pool)) - set(ids.tolist()))
    before_untouched = oracle_rows(entries, untouched[:50])
    scatter_blocks(src, entries, ids, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(reference_rows(entries, ids), fresh)
    assert oracle_rows(entries, untouched[:50]) == before_untouched


def test_ids_on_device_and_on_a_side_stream(kernel):
    gen = torch.Generator().manual_seed(7)
    entries, _ = kv_entries("kv", 300, 16, torch.bfloat16, 2, gen, "cuda:0")
    ids = random_ids(300, 257, gen)
    expected = reference_rows(entries, ids)
    side = torch.cuda.Stream()
    rows = poisoned(257, row_bytes(entries), "pinned")
    with torch.cuda.stream(side):
        gather_blocks(entries, ids.cuda(), rows)
    side.synchronize()
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("width, offset", [(1, 1), (3, 1), (6, 2), (12, 4), (24, 8), (40, 16)])
def test_narrow_and_misaligned_spans(kernel, width, offset):
    """Spans that are not 16-byte aligned take the narrower vector widths, same bytes."""
    gen = torch.Generator().manual_seed(width)
    n = 64
    flat = random_bits((n * (width + offset) + offset,), torch.uint8, gen, "cuda:0")
    entry = flat.as_strided((n, width), (width + offset, 1), storage_offset=offset)
    other = random_bits((n, 3, 5), torch.bfloat16, gen, "cuda:0")
    entries = [entry, other]
    ids = random_ids(n, 37, gen)
    expected = reference_rows(entries, ids)
    for where in ("device", "pinned"):
        rows = poisoned(37, row_bytes(entries), where)
        gather_blocks(entries, ids, rows)
        torch.cuda.synchronize()
        assert torch.equal(rows.cpu(), expected)
        flat.zero_()
        other.view(torch.uint8).zero_()
        scatter_blocks(rows, entries, ids)
        torch.cuda.synchronize()
        assert torch.equal(reference_rows(entries, ids), expected)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_logical_views_through_the_kernel(kernel, k):
    """block 128 over kernel block 64 (k=2) and friends: logical ids on logical views."""
    gen = torch.Generator().manual_seed(k)
    kernel_block = 128 // k
    layer = random_bits((2, 40 * k, kernel_block, 8, 128), torch.bfloat16, gen, "cuda:0")
    entries = [logical_view(layer[0], k), logical_view(layer[1], k)]
    ids = random_ids(40, 29, gen)
    expected = reference_rows(entries, ids)
    rows = poisoned(29, row_bytes(entries), "pinned")
    gather_blocks(entries, ids, rows)
    torch.cuda.synchronize()
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_gather_after_scatter_restores_a_big_pool(kernel, mode, monkeypatch):
    """2048 blocks of 4 layers; staged mode through 1 MiB chunks (32 rows each, 64 chunks)."""
    monkeypatch.setattr(ops, "_STAGING_BYTES", 1 << 20)
    gen = torch.Generator().manual_seed(3)
    entries, backing = kv_entries("kv", 2048, 128, torch.bfloat16, 4, gen, "cuda:0")
    original = [b.clone() for b in backing]
    ids = random_ids(2048, 2048, gen)
    rows = poisoned(2048, row_bytes(entries), "pinned")
    gather_blocks(entries, ids, rows, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(rows[:5], reference_rows(entries, ids[:5]))
    for b in backing:
        b.view(torch.uint8).fill_(0)
    scatter_blocks(rows, entries, ids, mode=mode)
    torch.cuda.synchronize()
    for b, o in zip(backing, original, strict=True):
        assert torch.equal(b.view(torch.uint8), o.view(torch.uint8))


def odd_width_entries(gen: torch.Generator, num_blocks: int):
    """bf16 K/V halves plus a misaligned 5-byte entry: an odd row width, every vector width."""
    entries, backing = kv_entries("kv", num_blocks, 16, torch.bfloat16, 2, gen, "cuda:0")
    flat = random_bits((num_blocks * 6 + 1,), torch.uint8, gen, "cuda:0")
    entries.append(flat.as_strided((num_blocks, 5), (6, 1), storage_offset=1))
    return entries, [*backing, flat]


@pytest.mark.parametrize("rows_per_chunk, first_rows", [(1, 1), (3, 1), (7, 2), (64, 5)])
def test_pipelined_staged_copy_through_many_odd_chunks(
    kernel, monkeypatch, rows_per_chunk, first_rows
):
    """1001 blocks through chunks of a few rows (up to ~1000 chunks, both buffers reused many
    times), odd row width: the same bytes as the reference, both directions."""
    gen = torch.Generator().manual_seed(rows_per_chunk)
    entries, _backing = odd_width_entries(gen, 1200)
    width = row_bytes(entries)
    assert width % 2 == 1
    monkeypatch.setattr(ops, "_STAGING_BYTES", 2 * rows_per_chunk * width + 1)
    monkeypatch.setattr(ops, "_FIRST_CHUNK_BYTES", first_rows * width)
    ids = random_ids(1200, 1001, gen)
    assert len(ops._chunk_plan(1001, width, True)) >= 1001 // rows_per_chunk
    expected = reference_rows(entries, ids)
    rows = poisoned(1001, width, "pinned")
    gather_blocks(entries, ids, rows, mode="staged")
    torch.cuda.synchronize()
    assert torch.equal(rows, expected)

    fresh = torch.randint(0, 256, expected.shape, dtype=torch.uint8, generator=gen)
    rows.copy_(fresh)
    untouched = sorted(set(range(1200)) - set(ids.tolist()))
    before_untouched = oracle_rows(entries, untouched)
    scatter_blocks(rows, entries, ids, mode="staged")
    torch.cuda.synchronize()
    assert torch.equal(reference_rows(entries, ids), fresh)
    assert oracle_rows(entries, untouched) == before_untouched


def test_staged_copy_is_ordered_on_the_callers_stream(kernel, monkeypatch):
    """Work queued before the copy on the caller's stream (delayed by a sleep kernel) is seen by
    it, and work queued after it sees every byte, with only that stream synchronized."""
    gen = torch.Generator().manual_seed(11)
    entries, backing = kv_entries("kv", 80, 16, torch.bfloat16, 32, gen, "cuda:0")  # 32 KiB rows
    ids = random_ids(80, 41, gen)
    width = row_bytes(entries)
    monkeypatch.setattr(ops, "_STAGING_BYTES", 4 * width)  # 21 chunks of at most 2 rows
    monkeypatch.setattr(ops, "_FIRST_CHUNK_BYTES", 1)
    caller = torch.cuda.Stream()
    new_pool = [random_bits(tuple(b.shape), b.dtype, gen, "cuda:0") for b in backing]
    rows = poisoned(41, width, "pinned")
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)  # tens of ms: a missing wait would read the old pool
        for b, n in zip(backing, new_pool, strict=True):
            b.copy_(n)
        gather_blocks(entries, ids, rows, mode="staged")
        echo = rows.to("cuda:0", non_blocking=True)  # reads the host rows after the copy
    caller.synchronize()
    expected = reference_rows(entries, ids)
    assert torch.equal(rows, expected)
    assert torch.equal(echo.cpu(), expected)

    fresh = random_bits((41, width), torch.uint8, gen, "cuda:0")
    rows.fill_(POISON)
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)
        rows.copy_(fresh, non_blocking=True)  # the host rows are written on the caller's stream
        scatter_blocks(rows, entries, ids, mode="staged")
        after = [b.clone() for b in backing]  # queued after the scatter on the same stream
    caller.synchronize()
    assert torch.equal(reference_rows(entries, ids), fresh.cpu())
    assert torch.equal(reference_rows([h for t in after for h in (t[0], t[1])], ids), fresh.cpu())


def test_default_mode_is_staged_for_pinned_rows(kernel):
    assert ops._DEFAULT_MODE in ops.MODES
    if "RAYKV_COPY_MODE" not in os.environ:
        assert ops._DEFAULT_MODE == "staged"


def test_scatter_rejects_duplicate_ids_on_the_device(kernel):
    gen = torch.Generator().manual_seed(5)
    entries, backing = kv_entries("kv", 20, 16, torch.bfloat16, 1, gen, "cuda:0")
    before = [b.clone() for b in backing]
    rows = poisoned(3, row_bytes(entries), "pinned")
    with pytest.raises(ops.InvalidInput, match="duplicates"):
        scatter_blocks(rows, entries, torch.tensor([4, 9, 4], device="cuda:0"))
    for b, o in zip(backing, before, strict=True):
        assert torch.equal(b.view(torch.uint8), o.view(torch.uint8))


@pytest.mark.parametrize("bad", ["id_high", "id_negative", "duplicates", "id_dtype", "count"])
def test_staged_scatter_rejects_bad_ids_before_touching_the_pool(kernel, monkeypatch, bad):
    """A staged scatter sends its first chunks to the device before it checks the ids; a bad id
    still raises InvalidInput with every byte of the pool as it was, and the next (valid)
    scatter through the same streams and buffers lands exactly."""
    monkeypatch.setattr(ops, "_STAGING_BYTES", 64 << 10)  # 64 chunks: in flight at the raise
    gen = torch.Generator().manual_seed(13)
    entries, backing = kv_entries("kv", 600, 16, torch.bfloat16, 4, gen, "cuda:0")
    before = [b.clone() for b in backing]
    ids = random_ids(600, 512, gen)
    src = poisoned(512, row_bytes(entries), "pinned")
    src.copy_(torch.randint(0, 256, tuple(src.shape), dtype=torch.uint8, generator=gen))
    bad_ids = ids.clone()
    if bad == "id_high":
        bad_ids[300] = 600
    elif bad == "id_negative":
        bad_ids[-1] = -1
    elif bad == "duplicates":
        bad_ids[7] = bad_ids[400]
    elif bad == "id_dtype":
        bad_ids = bad_ids.to(torch.int32)
    else:
        bad_ids = bad_ids[:-1]
    with pytest.raises(ops.InvalidInput):
        scatter_blocks(src, entries, bad_ids, mode="staged")
    torch.cuda.synchronize()
    for b, o in zip(backing, before, strict=True):
        assert torch.equal(b.view(torch.uint8), o.view(torch.uint8))

    scatter_blocks(src, entries, ids, mode="staged")
    torch.cuda.synchronize()
    assert torch.equal(reference_rows(entries, ids), src)


@pytest.mark.parametrize("where", ["device", "pinned", "staged", "cpu"])
@pytest.mark.parametrize("kind, block_size, dtype, layers, pool, n", CASES)
def test_wire_sums_taken_while_copying_match_the_reference(
    kernel, where, kind, block_size, dtype, layers, pool, n
):
    """The row sums taken while copying (gather and scatter; rows on the device, in pinned
    host memory through UVA or through the staged pipeline's device chunks, or in pageable
    host memory through the reference) equal ``ops.row_sums`` exactly."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("sums", kind, dtype, n)).encode()))
    entries, _backing = kv_entries(kind, pool, block_size, DTYPES[dtype], layers, gen, "cuda:0")
    ids = random_ids(pool, n, gen)
    expected = reference_rows(entries, ids)
    want = ops.row_sums(expected)
    mode = "staged" if where == "staged" else "direct"
    rows = poisoned(n, row_bytes(entries), where)
    sums = torch.full((n,), 12345, dtype=torch.int64, device="cuda:0")  # must be overwritten
    gather_blocks(entries, ids, rows, sums=sums, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), expected) and torch.equal(sums.cpu(), want)
    fresh = torch.randint(0, 256, expected.shape, dtype=torch.uint8, generator=gen)
    src = rows.copy_(fresh)
    torch.cuda.synchronize()
    back = torch.full((n,), -1, dtype=torch.int64, device="cuda:0")
    scatter_blocks(src, entries, ids, sums=back, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(reference_rows(entries, ids), fresh)
    assert torch.equal(back.cpu(), ops.row_sums(fresh))


@pytest.mark.parametrize("width", [8, 136, 32 * 1024 + 64, 100 * 1024 + 8])
def test_sums_after_single_bit_flips_match_the_reference(kernel, width):
    """Every single-bit flip, at every position class of a row (its first and last word, the
    middle, both halves of a 16-byte vector, the edges of the host's 32 KiB pieces), changes
    the kernel's sum, and the kernel's sum is the reference's, gathering and scattering."""
    gen = torch.Generator().manual_seed(width)
    row = torch.randint(0, 256, (width,), dtype=torch.uint8, generator=gen)
    places = {0, 7, 8, 15, width // 2, width - 8, width - 1, 32 * 1024 - 1, 32 * 1024}
    places = {p for p in places if p < width}
    rows = [row]
    for p in sorted(places):
        for bit in (0, 3, 7):
            bad = row.clone()
            bad[p] ^= 1 << bit
            rows.append(bad)
    want = torch.stack(rows)
    n = len(rows)
    entry = torch.empty((n + 3, width), dtype=torch.uint8, device="cuda:0")
    ids = torch.randperm(n + 3, generator=gen)[:n]
    scatter_blocks(want.cuda(), [entry], ids)
    sums = torch.zeros(n, dtype=torch.int64, device="cuda:0")
    gather_blocks([entry], ids, torch.empty_like(want, device="cuda:0"), sums=sums)
    ref = ops.row_sums(want)
    assert torch.equal(sums.cpu(), ref) and (ref[1:] != ref[0]).all()
    back = torch.zeros(n, dtype=torch.int64, device="cuda:0")
    scatter_blocks(want.cuda(), [entry], ids, sums=back)
    assert torch.equal(back.cpu(), ref)


@pytest.mark.parametrize("width, offset", [(3, 1), (12, 4), (24, 8), (40, 16)])
def test_wire_sums_of_misaligned_spans_fall_back_to_the_same_values(kernel, width, offset):
    gen = torch.Generator().manual_seed(100 + width)
    n = 64
    flat = random_bits((n * (width + offset) + offset,), torch.uint8, gen, "cuda:0")
    entry = flat.as_strided((n, width), (width + offset, 1), storage_offset=offset)
    entries = [entry, random_bits((n, 3, 4), torch.bfloat16, gen, "cuda:0")]
    ids = random_ids(n, 37, gen)
    expected = reference_rows(entries, ids)
    rows = poisoned(37, row_bytes(entries), "device")
    sums = torch.empty(37, dtype=torch.int64, device="cuda:0")
    gather_blocks(entries, ids, rows, sums=sums)
    assert torch.equal(sums.cpu(), ops.row_sums(expected))
    pinned = poisoned(37, row_bytes(entries), "staged")  # host rows: summed once they landed
    sums.fill_(7)
    gather_blocks(entries, ids, pinned, sums=sums, mode="staged")
    torch.cuda.synchronize()
    assert torch.equal(pinned, expected) and torch.equal(sums.cpu(), ops.row_sums(expected))


def test_the_extension_refuses_bad_arguments_with_an_error_not_a_crash(kernel):
    """Python checks every argument first, but the extension's own refusals must reach Python
    as RuntimeError (kernels/raykv_errors.h: torch's TORCH_CHECK / c10::str took the process
    down with a segmentation fault on the device's image)."""
    module = ops._load()
    segs = torch.zeros((1, 4), dtype=torch.int64, device="cuda:0")
    ids = torch.zeros(4, dtype=torch.int64, device="cuda:0")
    with pytest.raises(RuntimeError, match="segs must be a contiguous CUDA int64"):
        module.paged_copy(segs.cpu(), ids, 0, 16, True, 1)
    with pytest.raises(RuntimeError, match=r"rows \[2, 7\) outside the 4 block ids"):
        module.paged_copy(segs, ids, 0, 16, True, 1, 0, 2, 5)
    rows = torch.empty((4, 16), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="the chunks must cover the 4 rows"):
        module.StagedCopy(rows, 0, [1, 2], True, 0)
    with pytest.raises(RuntimeError, match="memcpy_loop: pass three contiguous CPU int64"):
        module.memcpy_loop(ids, ids.cpu(), ids.cpu())
