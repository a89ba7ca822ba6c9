"""GPU tests: a store (gather) and a load (scatter) running at once on two streams give exactly
the bytes the torch reference gives, and neither direction waits for the other."""

from __future__ import annotations

import zlib
from collections import OrderedDict

import pytest
import torch
from paged_copy_cases import kv_entries, oracle_rows, random_bits

from raykv import ops
from raykv.ops import checks as ops_checks
from raykv.ops import gather_blocks, kernel_available, kernel_status, row_bytes, scatter_blocks

pytestmark = pytest.mark.gpu
POISON = 0xA5
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of a sleep kernel on a ~2 GHz SM: holds one stream


@pytest.fixture(scope="module")
def kernel():
    assert kernel_available(), kernel_status()


def pinned(n: int, width: int) -> torch.Tensor:
    return torch.full((n, width), POISON, dtype=torch.uint8).pin_memory()


def reference_rows(entries, ids: torch.Tensor) -> torch.Tensor:
    rows = torch.full((ids.numel(), row_bytes(entries)), POISON, dtype=torch.uint8)
    ops.gather_reference(entries, ids, rows)
    return rows


def odd_entries(gen: torch.Generator, num_blocks: int):
    """bf16 K/V halves of two layers plus a misaligned 5-byte entry (odd row width)."""
    entries, _backing = kv_entries("kv", num_blocks, 16, torch.bfloat16, 2, gen, "cuda:0")
    flat = random_bits((num_blocks * 6 + 1,), torch.uint8, gen, "cuda:0")
    entries.append(flat.as_strided((num_blocks, 5), (6, 1), storage_offset=1))
    return entries


def kv_bf16(gen: torch.Generator, num_blocks: int):
    return kv_entries("kv", num_blocks, 16, torch.bfloat16, 3, gen, "cuda:0")[0]


def mla_fp8(gen: torch.Generator, num_blocks: int):
    return kv_entries("mla", num_blocks, 64, torch.float8_e4m3fn, 2, gen, "cuda:0")[0]


LAYOUTS = {"kv-bf16-block16": kv_bf16, "mla-fp8-block64": mla_fp8, "odd-width": odd_entries}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("staging", ["default", "tiny-chunks"])
@pytest.mark.parametrize("pairs", [1, 2])
def test_concurrent_stores_and_loads_match_the_reference(
    kernel, monkeypatch, layout, staging, pairs
):
    """`pairs` stores and `pairs` loads on 2 * pairs streams at once, three rounds, disjoint
    blocks: every stored row equals the reference's gather, every loaded block the row it was
    given, every other block keeps its bytes."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((layout, staging, pairs)).encode()))
    num_blocks, n = 700, 150
    entries = LAYOUTS[layout](gen, num_blocks)
    width = row_bytes(entries)
    if staging == "tiny-chunks":  # hundreds of chunks, both directions' buffers reused many times
        monkeypatch.setattr(ops, "_STAGING_BYTES", 6 * width + 3)
        monkeypatch.setattr(ops, "_FIRST_CHUNK_BYTES", width)
    streams = [torch.cuda.Stream() for _ in range(2 * pairs)]
    for _ in range(3):
        picked = torch.randperm(num_blocks, generator=gen)[: 2 * pairs * n].to(torch.int64)
        store_ids = list(picked[: pairs * n].split(n))
        load_ids = list(picked[pairs * n :].split(n))
        untouched = sorted(set(range(num_blocks)) - set(picked.tolist()))
        before_untouched = oracle_rows(entries, untouched[:80])
        expected = [reference_rows(entries, ids) for ids in store_ids]
        outs = [pinned(n, width) for _ in range(pairs)]
        ins = [
            torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen).pin_memory()
            for _ in range(pairs)
        ]
        start = torch.cuda.Event()
        torch.cuda._sleep(20_000_000)  # hold every lane until all are queued: they really overlap
        start.record()
        for j in range(pairs):
            streams[2 * j].wait_event(start)
            streams[2 * j + 1].wait_event(start)
            with torch.cuda.stream(streams[2 * j]):
                gather_blocks(entries, store_ids[j], outs[j])
            with torch.cuda.stream(streams[2 * j + 1]):
                scatter_blocks(ins[j], entries, load_ids[j])
        torch.cuda.synchronize()
        for j in range(pairs):
            assert torch.equal(outs[j], expected[j])
            assert torch.equal(reference_rows(entries, load_ids[j]), ins[j])
        assert oracle_rows(entries, untouched[:80]) == before_untouched


@pytest.mark.parametrize("first_use", [True, False])
@pytest.mark.parametrize("ids_memory", ["pageable", "pinned"])
@pytest.mark.parametrize("held", ["load", "store"])
def test_one_direction_does_not_wait_for_the_other(
    kernel, monkeypatch, held, ids_memory, first_use
):
    """A store and a load on two streams: with the `held` one's stream blocked by a long sleep
    kernel, the other finishes (right bytes) while the held one is still queued; then the held
    one lands exactly too. One side stream for both directions would queue the free copy's
    chunks behind the held copy's wait; nor may the host wait for the held stream: not for host
    ids (pageable or pinned), nor on the first copy of a set of entries (its segment table is
    uploaded then; first_use=False copies both ways once first, on the same streams)."""
    monkeypatch.setattr(ops, "_STAGING_BYTES", 1 << 20)  # several chunks each way
    gen = torch.Generator().manual_seed(17)
    entries, _ = kv_entries("kv", 400, 16, torch.bfloat16, 4, gen, "cuda:0")
    width = row_bytes(entries)
    picked = torch.randperm(400, generator=gen).to(torch.int64)
    if ids_memory == "pinned":
        picked = picked.pin_memory()
    store_ids, load_ids = picked[:150], picked[150:300]
    expected = reference_rows(entries, store_ids)
    out = pinned(150, width)
    src = torch.randint(0, 256, (150, width), dtype=torch.uint8, generator=gen).pin_memory()
    store_stream, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    jobs = {
        "store": (store_stream, lambda: gather_blocks(entries, store_ids, out)),
        "load": (load_stream, lambda: scatter_blocks(src, entries, load_ids)),
    }
    if first_use:  # no segment table cached for these entries (nor for a same-address reuse)
        monkeypatch.setattr(ops, "_tables", OrderedDict())
        monkeypatch.setattr(ops_checks, "_shapes", OrderedDict())
    else:
        for stream, job in jobs.values():
            with torch.cuda.stream(stream):
                job()
        torch.cuda.synchronize()
        out.fill_(POISON)
    torch.cuda.synchronize()
    order = [held, "store" if held == "load" else "load"]  # the held copy is queued first
    done = {}
    for name in order:
        stream, job = jobs[name]
        with torch.cuda.stream(stream):
            if name == held:
                torch.cuda._sleep(SLEEP_CYCLES)
            job()
            done[name] = torch.cuda.Event()
            done[name].record()
    free = order[1]
    done[free].synchronize()
    assert not done[held].query(), "the free copy waited for the held one (or a short sleep)"
    if free == "store":
        assert torch.equal(out, expected)
    else:
        assert torch.equal(reference_rows(entries, load_ids), src)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.equal(reference_rows(entries, load_ids), src)
