"""CPU tests of raykv.ops: the torch reference, the kernel's segment table, logical views."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_copy_cases import DTYPES, emulate_kernel, kv_entries, oracle_rows, random_bits

from raykv import ops
from raykv.errors import InvalidInput
from raykv.layout import kernel_block_ids
from raykv.ops import (
    gather_blocks,
    kernel_available,
    kernel_status,
    logical_view,
    row_bytes,
    scatter_blocks,
)

FAST = settings(max_examples=25, deadline=None)
POISON = 0xA5


def rows_for(entries, n: int) -> torch.Tensor:
    return torch.full((n, row_bytes(entries)), POISON, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaNs never compare equal


def as_bytes(rows: torch.Tensor) -> list[bytes]:
    return [bytes(r) for r in rows.numpy()]


layouts = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["kv", "mla", "interleaved"]),
        "block_size": st.sampled_from([16, 64, 128]),
        "dtype": st.sampled_from(sorted(DTYPES)),
        "layers": st.integers(1, 3),
        "num_blocks": st.integers(1, 12),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build(case):
    gen = torch.Generator().manual_seed(case["seed"])
    entries, backing = kv_entries(
        case["kind"],
        case["num_blocks"],
        case["block_size"],
        DTYPES[case["dtype"]],
        case["layers"],
        gen,
    )
    return entries, backing, gen


def random_ids(num_blocks: int, data, distinct: bool) -> list[int]:
    if distinct:
        perm = data.draw(st.permutations(range(num_blocks)))
        return perm[: data.draw(st.integers(0, num_blocks))]
    return data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=2 * num_blocks))


@FAST
@given(case=layouts, data=st.data())
def test_gather_matches_oracle(case, data):
    entries, _, _ = build(case)
    ids = random_ids(case["num_blocks"], data, distinct=False)  # repeats are fine for gather
    dst = rows_for(entries, len(ids))
    gather_blocks(entries, torch.tensor(ids, dtype=torch.int64), dst)
    assert as_bytes(dst) == oracle_rows(entries, ids)


@FAST
@given(case=layouts, data=st.data())
def test_scatter_writes_exactly_the_listed_blocks(case, data):
    entries, backing, gen = build(case)
    ids = random_ids(case["num_blocks"], data, distinct=True)
    before = [b.clone() for b in backing]
    src = torch.randint(0, 256, (len(ids), row_bytes(entries)), dtype=torch.uint8, generator=gen)
    scatter_blocks(src, entries, torch.tensor(ids, dtype=torch.int64))
    assert oracle_rows(entries, ids) == as_bytes(src)
    untouched = [b for b in range(case["num_blocks"]) if b not in ids]
    assert oracle_rows(entries, untouched) == oracle_rows(kv_entries_like(case, before), untouched)


def kv_entries_like(case, backing):
    """The entries of `backing` (same kind as case) without drawing new data."""
    if case["kind"] == "kv":
        return [h for t in backing for h in (t[0], t[1])]
    if case["kind"] == "interleaved":
        return [h for t in backing for h in (t[:, 0], t[:, 1])]
    return list(backing)


@FAST
@given(case=layouts, data=st.data())
def test_gather_then_scatter_restores_bytes(case, data):
    entries, backing, _ = build(case)
    ids = torch.tensor(random_ids(case["num_blocks"], data, distinct=True), dtype=torch.int64)
    original = [b.clone() for b in backing]
    rows = rows_for(entries, ids.numel())
    gather_blocks(entries, ids, rows)
    for b in backing:  # wipe the pool, then put the gathered blocks back
        b.view(torch.uint8).fill_(0x5A)
    scatter_blocks(rows, entries, ids)
    restored = oracle_rows(entries, ids.tolist())
    assert restored == oracle_rows(kv_entries_like(case, original), ids.tolist())


@FAST
@given(case=layouts, data=st.data())
def test_segment_table_moves_the_same_bytes(case, data):
    """The CUDA kernel's plan (row_segments), executed with memmove, equals the reference."""
    entries, _backing, gen = build(case)
    ids = random_ids(case["num_blocks"], data, distinct=True)
    expected = oracle_rows(entries, ids)
    rows = rows_for(entries, len(ids))
    emulate_kernel(entries, ids, rows, gather=True)
    assert as_bytes(rows) == expected
    fresh = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen)
    emulate_kernel(entries, ids, fresh, gather=False)
    assert oracle_rows(entries, ids) == as_bytes(fresh)


@pytest.mark.parametrize("width", [1, 3, 7, 33])
def test_odd_byte_widths(width):
    gen = torch.Generator().manual_seed(width)
    e = random_bits((9, width), torch.uint8, gen)
    f = random_bits((9, 3, width), torch.bfloat16, gen)[:, 1]  # stride(0) = 3 * width
    ids = [8, 0, 3, 3, 5]
    dst = rows_for([e, f], len(ids))
    gather_blocks([e, f], torch.tensor(ids), dst)
    assert as_bytes(dst) == oracle_rows([e, f], ids)
    emulated = rows_for([e, f], len(ids))
    emulate_kernel([e, f], ids, emulated, gather=True)
    assert torch.equal(emulated, dst)


def test_large_blocks_split_into_pieces_keep_order():
    gen = torch.Generator().manual_seed(1)
    big = random_bits((4, 128, 8, 128), torch.bfloat16, gen)  # 256 KiB per block
    ids = [3, 1]
    rows = rows_for([big], 2)
    emulate_kernel([big], ids, rows, gather=True)
    assert as_bytes(rows) == oracle_rows([big], ids)


@st.composite
def run_ids(draw, num_blocks: int) -> list[int]:
    """Distinct ids made of runs going up or down (how engines free and reuse blocks), in
    any order: the host path copies each run as one slice."""
    ids = list(range(num_blocks))
    cuts = sorted(draw(st.sets(st.integers(1, num_blocks - 1), max_size=4)))
    runs = [ids[a:b] for a, b in itertools.pairwise([0, *cuts, num_blocks])]
    runs = [r[::-1] if draw(st.booleans()) else r for r in runs]
    return [b for r in draw(st.permutations(runs)) for b in r]


@FAST
@given(case=layouts, data=st.data())
def test_runs_up_and_down_move_the_oracle_bytes(case, data):
    case = case | {"num_blocks": data.draw(st.integers(16, 40))}
    entries, backing, gen = build(case)
    ids = data.draw(run_ids(case["num_blocks"]))
    ids = ids[: data.draw(st.integers(1, len(ids)))]
    dst = rows_for(entries, len(ids))
    gather_blocks(entries, torch.tensor(ids, dtype=torch.int64), dst)
    assert as_bytes(dst) == oracle_rows(entries, ids)
    before = [b.clone() for b in backing]
    src = torch.randint(0, 256, dst.shape, dtype=torch.uint8, generator=gen)
    assert scatter_blocks(src, entries, torch.tensor(ids, dtype=torch.int64)) == len(ids)
    assert oracle_rows(entries, ids) == as_bytes(src)
    untouched = [b for b in range(case["num_blocks"]) if b not in ids]
    assert oracle_rows(entries, untouched) == oracle_rows(kv_entries_like(case, before), untouched)


@FAST
@given(case=layouts, data=st.data())
def test_scatter_check_sees_rows_before_they_are_written_and_stops_at_a_refusal(case, data):
    """``check(lo, hi)`` runs before rows lo..hi reach any block, each row in one span (spans
    on several host threads, in any order); the copy counts the rows before the first refused
    one: earlier rows are written, rows this check refuses (that one and every later one)
    are not (a check that refuses single rows: ``test_host_threads``)."""
    from raykv.ops import reference as ops_reference

    case = case | {"num_blocks": data.draw(st.integers(2, 24))}
    entries, backing, gen = build(case)
    ids = data.draw(run_ids(case["num_blocks"]))
    src = torch.randint(0, 256, (len(ids), row_bytes(entries)), dtype=torch.uint8, generator=gen)
    span = data.draw(st.integers(1, 5))  # rows per span on the host path
    refuse = data.draw(st.integers(0, len(ids)))  # == len(ids): nothing refused
    original = kv_entries_like(case, [b.clone() for b in backing])
    seen = []

    def check(lo: int, hi: int) -> int:
        assert oracle_rows(entries, ids[lo:hi]) == oracle_rows(original, ids[lo:hi])
        seen.append((lo, hi))
        return max(0, min(hi, refuse) - lo)

    with mock.patch.object(ops_reference, "CHECK_SPAN_BYTES", span * row_bytes(entries)):
        written = scatter_blocks(src, entries, torch.tensor(ids, dtype=torch.int64), check=check)
    assert written == refuse
    spans = sorted(seen)  # disjoint; every row up to the refused one checked
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    checked = {r for lo, hi in spans for r in range(lo, hi)}
    assert set(range(min(refuse + 1, len(ids)))) <= checked
    assert oracle_rows(entries, ids[:refuse]) == as_bytes(src[:refuse])
    assert oracle_rows(entries, ids[refuse:]) == oracle_rows(original, ids[refuse:])


def test_empty_block_list_is_a_no_op():
    e = torch.arange(24, dtype=torch.float32).view(3, 8)
    gather_blocks([e], torch.empty(0, dtype=torch.int64), torch.empty(0, 32, dtype=torch.uint8))
    scatter_blocks(torch.empty(0, 32, dtype=torch.uint8), [e], torch.empty(0, dtype=torch.int64))
    assert torch.equal(e, torch.arange(24, dtype=torch.float32).view(3, 8))


# --- logical vs kernel blocks (invariant 7) ------------------------------------------------


@FAST
@given(
    k=st.sampled_from([1, 2, 4, 8]),
    kernel_block_size=st.sampled_from([16, 32, 64]),
    logical_blocks=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_logical_view_gathers_adjacent_kernel_blocks(
    k, kernel_block_size, logical_blocks, seed, data
):
    gen = torch.Generator().manual_seed(seed)
    layer = random_bits((2, logical_blocks * k, kernel_block_size, 2, 4), torch.bfloat16, gen)
    kernel_entries = [layer[0], layer[1]]
    logical = [logical_view(h, k) for h in kernel_entries]
    assert all(v.data_ptr() == h.data_ptr() for v, h in zip(logical, kernel_entries, strict=True))
    assert logical[0].shape == (logical_blocks, k * kernel_block_size, 2, 4)
    round_trip = logical_view(layer[0], k).view(layer[0].shape)  # bits: NaNs never compare equal
    assert round_trip.view(torch.int16).equal(layer[0].view(torch.int16))

    ids = torch.tensor(data.draw(st.permutations(range(logical_blocks))), dtype=torch.int64)
    by_logical = rows_for(logical, ids.numel())
    gather_blocks(logical, ids, by_logical)
    kids = torch.tensor(kernel_block_ids(ids.tolist(), k))
    assert kids.tolist() == [b * k + j for b in ids.tolist() for j in range(k)]
    for half, entry in enumerate(kernel_entries):  # each half: k kernel blocks back to back
        by_kernel = rows_for([entry], kids.numel())
        gather_blocks([entry], kids, by_kernel)
        width = row_bytes([entry]) * k
        assert torch.equal(
            by_logical[:, half * width : (half + 1) * width].reshape(-1), by_kernel.reshape(-1)
        )


def test_logical_view_of_per_block_scalars_and_mla():
    assert logical_view(torch.arange(8), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    latent = torch.zeros(6, 16, 576, dtype=torch.bfloat16)
    assert logical_view(latent, 3).shape == (2, 48, 576)


def test_logical_view_rejects_uneven_or_non_adjacent_blocks():
    with pytest.raises(InvalidInput, match="multiple of"):
        logical_view(torch.zeros(6, 16, 2), 4)
    interleaved = torch.zeros(8, 2, 16, 4)[:, 0]
    with pytest.raises(InvalidInput, match="not adjacent"):
        logical_view(interleaved, 2)


# --- bad input: InvalidInput before anything is touched ------------------------------------


def _pool():
    gen = torch.Generator().manual_seed(0)
    layer = random_bits((2, 5, 16, 2, 4), torch.bfloat16, gen)
    return layer, [layer[0], layer[1]]


@pytest.mark.parametrize(
    "case, match",
    [
        ("dst_shape", "expected"),
        ("dst_dtype", "uint8"),
        ("dst_strided", "contiguous"),
        ("id_high", "ids must lie"),
        ("id_negative", "ids must lie"),
        ("id_dtype", "int64"),
        ("id_2d", "1-D"),
        ("mixed_devices", "one device"),
        ("rows_on_other_device", "row buffer is on"),
        ("entry_not_contiguous", "contiguous within a block"),
        ("no_entries", "non-empty"),
    ],
)
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_bad_input_raises_before_touching_anything(op, case, match):
    layer, entries = _pool()
    before = layer.clone()
    ids = torch.tensor([4, 0, 2])
    rows = rows_for(entries, 3)
    if case == "dst_shape":
        rows = rows_for(entries, 4)
    elif case == "dst_dtype":
        rows = torch.zeros(3, row_bytes(entries) // 2, dtype=torch.int16)
    elif case == "dst_strided":
        rows = torch.zeros(row_bytes(entries), 3, dtype=torch.uint8).t()
    elif case == "id_high":
        ids = torch.tensor([4, 5, 1])
    elif case == "id_negative":
        ids = torch.tensor([4, -1, 1])
    elif case == "id_dtype":
        ids = ids.to(torch.int32)
    elif case == "id_2d":
        ids = ids.view(3, 1)
    elif case == "mixed_devices":
        entries = [entries[0], torch.empty(entries[1].shape, dtype=torch.bfloat16, device="meta")]
    elif case == "rows_on_other_device":
        rows = torch.empty(rows.shape, dtype=torch.uint8, device="meta")
    elif case == "entry_not_contiguous":
        entries = [entries[0].transpose(1, 2)]
        rows = rows_for(entries, 3)
    elif case == "no_entries":
        entries = []
    rows_before = rows.clone() if rows.device.type == "cpu" else None
    with pytest.raises(InvalidInput, match=match):
        if op == "gather":
            gather_blocks(entries, ids, rows)
        else:
            scatter_blocks(rows, entries, ids)
    assert same_bits(layer, before)
    if rows_before is not None:
        assert torch.equal(rows, rows_before)


def test_scatter_rejects_duplicate_ids():
    layer, entries = _pool()
    before = layer.clone()
    with pytest.raises(InvalidInput, match="duplicates"):
        scatter_blocks(rows_for(entries, 3), entries, torch.tensor([1, 3, 1]))
    assert same_bits(layer, before)


def test_unknown_mode_is_rejected():
    _, entries = _pool()
    with pytest.raises(InvalidInput, match="mode 'fast'"):
        gather_blocks(entries, torch.tensor([1]), rows_for(entries, 1), mode="fast")


def test_cpu_build_reports_the_reference_path():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU tests cover the kernel path")
    assert not kernel_available()
    assert kernel_status().startswith("torch reference")


@FAST
@given(
    num_rows=st.integers(1, 5000),
    width=st.integers(1, 40 << 20),
    staging=st.integers(1, 256 << 20),
    first=st.integers(1, 16 << 20),
    gather=st.booleans(),
)
def test_staged_chunk_plan_covers_every_row_once(num_rows, width, staging, first, gather):
    """Staged mode's chunks tile [0, num_rows) in order, fit one of the two buffers, grow
    from the small one (gather) or shrink to it (scatter), so the pipeline fills fast."""
    with (
        mock.patch.object(ops, "_STAGING_BYTES", staging),
        mock.patch.object(ops, "_FIRST_CHUNK_BYTES", first),
    ):
        plan = ops._chunk_plan(num_rows, width, gather)
    starts = [s for s, _ in plan]
    counts = [c for _, c in plan]
    assert starts == [sum(counts[:i]) for i in range(len(counts))]
    assert sum(counts) == num_rows and min(counts) >= 1
    cap = max(1, staging // 2 // width)
    assert max(counts) <= cap
    ramp = counts if gather else counts[::-1]  # issue order -> growth order
    assert ramp[0] == min(max(1, min(cap, first // width)), num_rows)
    for a, b in itertools.pairwise(ramp[:-1]):
        assert b == min(cap, 2 * a)
    if len(ramp) > 1:  # the last one may be a remainder
        assert ramp[-1] <= min(cap, 2 * ramp[-2])
    assert len(plan) <= num_rows // cap + cap.bit_length() + 2


class RecordingStagedCopy:
    """Stands in for the kernel module's StagedCopy: records what scatter_blocks asks of it."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def run(self, segs, block_ids, num_ctas, sums_ptr=0):
        self.calls.append("run")

    def cancel(self):
        self.calls.append("cancel")


@pytest.mark.parametrize("ids", [[4, 0, 2], [4, 5, 2], [4, -1, 2], [4, 0, 4], [4, 0]])
def test_staged_scatter_starts_before_the_checks_and_cancels_on_bad_ids(monkeypatch, ids):
    """Staged scatter sets its copy up (first chunks on their way) before validating; bad ids
    cancel it before run() could write the pool, good ones run it exactly once."""
    layer, entries = _pool()
    before = layer.clone()
    calls: list[str] = []

    def start(rows, entries_, gather, mode):
        calls.append("start")
        assert not gather and rows is src
        return RecordingStagedCopy(calls)

    real_check = ops._check

    def check(*args):
        calls.append("check")
        return real_check(*args)

    monkeypatch.setattr(ops, "_start_staged", start)
    monkeypatch.setattr(ops, "_check", check)
    src = rows_for(entries, 3)
    valid = ids == [4, 0, 2]
    if valid:
        scatter_blocks(src, entries, torch.tensor(ids))
        assert calls == ["start", "check", "run"]
    else:
        with pytest.raises(InvalidInput):
            scatter_blocks(src, entries, torch.tensor(ids))
        assert calls == ["start", "check", "cancel"]
    assert same_bits(layer, before)  # the stand-in never writes; the reference never ran
