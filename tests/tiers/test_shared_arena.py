"""The CPU tier's arena in shared memory: another process maps it (``CpuTierView``) and runs
the same ``OffloadEngine`` jobs on it; the owner's state machine applies the queued calls.
Checksums are computed on store and verified on load through the view as on the tier."""

import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers import CpuTier, GpuKV, LoadJob, OffloadEngine, StoreJob, shm
from raykv.tiers.cpu_tier import CpuTierView
from raykv.tiers.jobs import group_block_hashes

from .helpers import filled_kv, make_plan


def _hashes(n: int, seed: int) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(n)]


def test_another_process_sees_the_shared_arena() -> None:
    t, spec = shm.create((2, 8), "test")
    t[1, 3] = 42
    code = (
        "import sys; from raykv.tiers import shm; "
        f"t = shm.attach(shm.SharedSpec({spec.path!r}, (2, 8))); "
        "assert int(t[1, 3]) == 42; t[0, 0] = 7"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert int(t[0, 0]) == 7
    shm.release(spec)
    with pytest.raises(FileNotFoundError, match="gone"):
        shm.attach(spec)


def _store_and_load(plan, owner: CpuTier, view: CpuTierView, corrupt: int | None) -> None:
    src, dst = filled_kv(plan, 1), GpuKV.allocate(plan, "cpu")
    n = 6
    table = [list(range(1, n + 1))]
    keys = group_block_hashes(plan, _hashes(n, 3))
    job = StoreJob.build(plan, "r", table, keys)
    res = owner.prepare_store(job.keys)
    eng = OffloadEngine(src, view, checksums=True)
    eng.submit_store(job, res)
    eng.wait_all()
    owner.apply(view.take())
    assert all(k in owner for k in job.keys)
    if corrupt is not None:
        view.rows(0)[owner.prepare_load([job.keys[corrupt]]).blocks[0]][0] ^= 1
        owner.finish_load(owner.prepare_load([job.keys[corrupt]]))  # balance the probe
        owner.check_consistency()
    into = list(range(10, 10 + n))
    lease = owner.prepare_load(job.keys)
    load = LoadJob("r", lease.keys, job.key_groups, job.key_widths, tuple(into),
                   job.group_sizes, job.slots)  # fmt: skip
    eng2 = OffloadEngine(dst, view, checksums=True)
    eng2.submit_load(load, lease)
    (r,) = eng2.wait_all()
    owner.apply(view.take())
    owner.check_consistency()
    good = n if corrupt is None else corrupt
    assert len(r.job.block_ids) == good
    gid = plan.groups[0].group_id
    from raykv import ops

    a = torch.empty((good, src.row_bytes(gid)), dtype=torch.uint8)
    b = torch.empty_like(a)
    ops.gather_blocks(src.entries(gid), torch.tensor(table[0][:good], dtype=torch.long), a)
    ops.gather_blocks(dst.entries(gid), torch.tensor(into[:good], dtype=torch.long), b)
    assert torch.equal(a, b)
    if corrupt is not None:
        assert owner.stats.checksum_errors == 1 and job.keys[corrupt] not in owner


def test_an_attached_mapping_takes_no_page_faults_when_read() -> None:
    """``attach`` maps every page up front (a copy through a fresh mapping otherwise faults
    once per page: 2-3x the copy's own time)."""
    import resource

    t, spec = shm.create((256, 64 << 10), "test")  # 16 MiB: 4096 pages
    t.fill_(3)
    view = shm.attach(spec)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seen = zlib.crc32(view.numpy())  # reads every byte, allocates nothing
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if torch.cuda.is_available() or not shm.populate(view):
        pytest.skip("pages are pinned by CUDA, or the kernel lacks MADV_POPULATE_WRITE")
    assert faults < 64, f"{faults} page faults reading 4096 populated pages"
    assert seen == zlib.crc32(t.numpy())
    shm.release(spec)


@settings(max_examples=8, deadline=None)
@given(corrupt=st.one_of(st.none(), st.integers(0, 5)))
def test_jobs_through_a_view_store_verify_and_load_like_the_tier(corrupt) -> None:
    """Whatever entry is corrupted, the load stops before it: never a wrong byte."""
    plan = make_plan("full", cpu_blocks=16)
    owner = CpuTier(plan, shared=True)
    view = CpuTierView(plan, owner.arena_spec)
    _store_and_load(plan, owner, view, corrupt)
    shm.release(owner.arena_spec)


def test_a_pool_kv_in_shared_memory_maps_in_place() -> None:
    plan = make_plan("hybrid")
    kv = GpuKV.allocate(plan, "cpu", shared=True)
    other = GpuKV.attach(plan, kv.shared_specs)
    gid = plan.groups[0].group_id
    rows = torch.randint(0, 256, (3, kv.row_bytes(gid)), dtype=torch.uint8)
    from raykv import ops

    ops.scatter_blocks(rows, kv.entries(gid), torch.tensor([2, 5, 7]))
    out = torch.empty_like(rows)
    ops.gather_blocks(other.entries(gid), torch.tensor([2, 5, 7]), out)
    assert torch.equal(out, rows)
    for s in kv.shared_specs:
        shm.release(s)


def test_a_view_of_a_different_plan_is_refused() -> None:
    owner = CpuTier(make_plan("full", cpu_blocks=16), shared=True)
    from raykv.errors import ConfigError

    with pytest.raises(ConfigError, match="different plans"):
        CpuTierView(make_plan("full", cpu_blocks=8), owner.arena_spec)
    shm.release(owner.arena_spec)


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(1, 40), min_size=1, max_size=30, unique=True),
    run=st.integers(0, 20),
)
def test_the_reference_copy_matches_a_per_block_loop_for_runs_and_scatters(ids, run) -> None:
    """The CPU reference copies runs of consecutive ids as one strided copy and the rest with
    index ops, in int64 words: the bytes are those of a copy block by block."""
    from raykv import ops

    ids = ids + [i for i in range(41, 41 + run)]  # a long consecutive tail: the runs path
    g = torch.Generator().manual_seed(len(ids))
    entries = [torch.randint(0, 256, (64, w), generator=g, dtype=torch.uint8) for w in (24, 8, 40)]
    idx = torch.tensor(ids, dtype=torch.long)
    out = torch.empty((len(ids), 72), dtype=torch.uint8)
    ops.gather_blocks(entries, idx, out)
    want = torch.stack([torch.cat([e[b] for e in entries]) for b in ids])
    assert torch.equal(out, want)
    fresh = [torch.zeros_like(e) for e in entries]
    ops.scatter_blocks(want, fresh, idx)
    for e, f in zip(entries, fresh, strict=True):
        assert torch.equal(f[idx], e[idx]) and not f[[i for i in range(64) if i not in ids]].any()


def test_a_process_that_exited_is_gone_even_before_it_is_reaped() -> None:
    import os
    import time

    from raykv.tiers.shm import process_alive

    assert process_alive(os.getpid())
    child = subprocess.Popen(["sleep", "0"])
    deadline = time.monotonic() + 10
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # it exits at once, then stays a zombie until waited for
    try:
        with open(f"/proc/{child.pid}/stat") as f:  # not reaped yet: still listed, a zombie
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert not process_alive(child.pid)
    finally:
        child.wait()
    assert not process_alive(child.pid)


def test_a_corrupt_arena_row_loaded_into_a_cpu_engine_is_a_counted_miss_not_loaded() -> None:
    """The attached CPU engine's path: an ``OffloadEngine`` on a view of the tier's shared
    arena, whose load sums each row natively as it copies it. One bit flipped in the middle of
    key 2's row: keys 0 and 1 are reported loaded (their bytes right), keys 2-5 missed (2's
    sum fails, the rest of the prefix follows it), the tier counts one checksum error and
    drops key 2 alone; keys 3-5 stay and load whole afterwards, with no error counted again."""
    from raykv import ops
    from raykv.blocks import hashing

    hashing.build_native()
    assert hashing.native_module() is not None, hashing.native_status()  # the fused path
    plan = make_plan("full", cpu_blocks=16)
    owner = CpuTier(plan, shared=True)
    view = CpuTierView(plan, owner.arena_spec)
    try:
        src, dst = filled_kv(plan, 1), GpuKV.allocate(plan, "cpu")
        gid = plan.groups[0].group_id
        job = StoreJob.build(
            plan, "r", [[1, 2, 3, 4, 5, 6]], group_block_hashes(plan, _hashes(6, 4))
        )
        eng = OffloadEngine(src, view, checksums=True)
        eng.submit_store(job, owner.prepare_store(job.keys))
        assert eng.wait_all()[0].ok
        owner.apply(view.take())
        keys = job.keys
        probe = owner.prepare_load([keys[2]])
        width = src.row_bytes(gid)
        view.rows(0)[probe.blocks[0] * owner.factor, width // 2] ^= 0x04
        owner.finish_load(probe)

        def load(want: tuple[bytes, ...], into: list[int]):
            lease = owner.prepare_load(list(want))
            job = LoadJob("r", lease.keys, (gid,) * len(want), (1,) * len(want), tuple(into),
                           (len(want),), tuple((k, 0) for k in range(len(want))))  # fmt: skip
            engine = OffloadEngine(dst, view, checksums=True)
            engine.submit_load(job, lease)
            (res,) = engine.wait_all()
            owner.apply(view.take())
            owner.check_consistency()
            return res

        def same(a: list[int], b: list[int]) -> bool:
            rows = [torch.empty((len(a), width), dtype=torch.uint8) for _ in range(2)]
            ops.gather_blocks(src.entries(gid), torch.tensor(a), rows[0])
            ops.gather_blocks(dst.entries(gid), torch.tensor(b), rows[1])
            return torch.equal(*rows)

        res = load(keys, [10, 11, 12, 13, 14, 15])
        assert res.ok and res.job.keys == keys[:2] and res.job.block_ids == (10, 11)
        assert res.missed == keys[2:]
        assert same([1, 2], [10, 11])
        assert owner.stats.checksum_errors == 1
        assert keys[2] not in owner and all(k in owner for k in (*keys[:2], *keys[3:]))

        again = load(keys[3:], [20, 21, 22])
        assert again.ok and again.missed == () and again.job.block_ids == (20, 21, 22)
        assert same([4, 5, 6], [20, 21, 22])
        assert owner.stats.checksum_errors == 1  # counted once
    finally:
        view.close()
        shm.release(owner.arena_spec)
