"""DiskTier: demoted CPU entries in slab files, verified loads, a rebuilt index, refusals."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from raykv.errors import ConfigError
from raykv.tiers import BlockState, CpuTier
from raykv.tiers.checksum import checksums_at
from raykv.tiers.cpu_tier import KeyRows, KeySums
from raykv.tiers.disk_tier import DiskTier, NodeDisk, model_identity

from .helpers import make_plan

ID = model_identity("m", make_plan("full"))


def content(key: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes a key stands for (the same key always the same bytes, as a block hash)."""
    seed = int.from_bytes(key[-4:].rjust(4, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def arena_of(disk: DiskTier, keys: list[bytes], width: int | None = None):
    """An arena holding ``keys`` in blocks 0.., with their valid flags and checksums."""
    n, c, f, slot = len(keys), disk.copies, disk.factor, disk.slot_bytes
    width = slot if width is None else width
    rows = np.stack([content(k, (c, f, slot)) for k in keys], 1) if n else None
    arena = torch.from_numpy(np.ascontiguousarray(rows.reshape(c, n * f, slot)))
    sums = np.zeros((c, n, f), np.int64)
    for cc in range(c):
        sums[cc] = np.asarray(
            checksums_at(arena[cc].numpy(), range(n * f), width), np.int64
        ).reshape(n, f)
    valid = KeyRows(np.ones((n, f), bool), np.full(n, f, np.int64))
    return arena, valid, KeySums(sums, np.full((c, n), f, np.int64)), [width] * n


def demote(disk: DiskTier, keys: list[bytes], width: int | None = None) -> list[bytes]:
    arena, valid, sums, widths = arena_of(disk, keys, width)
    members = [(k, *([None] * (disk.factor - 1))) for k in keys]
    return disk.demote(keys, arena, np.arange(len(keys)), valid, sums, widths, members)


def expect(disk: DiskTier, key: bytes) -> np.ndarray:
    return content(key, (disk.copies, disk.factor, disk.slot_bytes))


def open_disk(path: Path, plan=None, *, slabs: int = 4, slab_entries: int = 4, identity=ID):
    plan = plan or make_plan("full")
    probe = DiskTier(path / "probe", plan, identity, 64 << 20, slab_bytes=1)
    slab = probe.slab_bytes  # one entry: the smallest slab
    probe.close()
    per = probe.stride * slab_entries + slab
    return DiskTier(path / "d", plan, identity, slabs * per, slab_bytes=per)


def keys_(n: int, start: int = 0) -> list[bytes]:
    return [b"\0\0\0\0k" + i.to_bytes(4, "little") for i in range(start, start + n)]


def slab_files(disk: DiskTier) -> list[Path]:
    return sorted(disk.path.glob("slab-*.kv"), key=lambda p: p.stat().st_mtime_ns)


def test_round_trip_through_a_cpu_tier(tmp_path):
    plan = make_plan("full", factor=2, tp_size=2, cpu_blocks=4)
    disk = open_disk(tmp_path, plan)
    cpu = CpuTier(plan)
    assert (disk.copies, disk.factor) == (2, 2)
    ks = keys_(3)
    arena, valid, sums, widths = arena_of(disk, ks)
    members = [(k, None) for k in ks]
    assert disk.demote(ks, arena, np.arange(3), valid, sums, widths, members) == ks
    assert disk.flush(10)
    got = disk.load([ks[2], b"nope", ks[0]])
    assert got.keys == [ks[2], ks[0]] and got.members == [(ks[2], None), (ks[0], None)]
    assert np.array_equal(got.rows[0], expect(disk, ks[2]))
    res = cpu.store_rows(got.keys, got.rows, got.valid, got.sums)
    assert res is not None and cpu.state(ks[0]) is BlockState.READABLE
    lease = cpu.prepare_load([ks[0]])
    assert lease.checksums[0] == {c: tuple(sums.sums[c, 0]) for c in range(2)}
    assert np.array_equal(
        cpu.arena.numpy()[1, 2 * lease.blocks[0] : 2 * lease.blocks[0] + 2], expect(disk, ks[0])[1]
    )
    assert disk.stats.hits == 2 and disk.stats.misses == 1
    disk.close()


def test_cpu_eviction_demotes_and_a_promotion_serves_again(tmp_path):
    plan = make_plan("full", cpu_blocks=2)
    disk = open_disk(tmp_path, plan)
    demoted: list[bytes] = []

    def below(keys, blocks, valid, sums, tenants):
        width = [cpu.slot_bytes] * len(keys)
        demoted.extend(disk.demote(keys, cpu.arena, blocks, valid, sums, width, list(zip(keys))))

    cpu = CpuTier(plan, demote=below)
    stored = {}
    for k in keys_(4):
        r = cpu.prepare_store([k])
        row = content(k, (1, 1, cpu.slot_bytes))
        cpu.arena.numpy()[0, r.blocks[0]] = row[0, 0]
        cpu.finish_store(r, True, [(True,)], [tuple(checksums_at(row[0], [0], cpu.slot_bytes))])
        stored[k] = row
    assert demoted == keys_(2)  # LRU: the first two went below, rows copied before reuse
    got = disk.load(keys_(2))
    assert got.keys == keys_(2)
    assert all(np.array_equal(got.rows[i], stored[k]) for i, k in enumerate(got.keys))
    disk.close()


def test_a_corrupt_slot_is_a_counted_miss_never_served(tmp_path):
    disk = open_disk(tmp_path)
    ks = keys_(3)
    demote(disk, ks)
    assert disk.flush(10)
    (slab,) = slab_files(disk)
    hb = disk._slabs[disk._index[ks[1]][0]].header_bytes
    with open(slab, "r+b") as fh:  # one bit of the second entry's rows
        fh.seek(hb + disk.stride + 100)
        b = fh.read(1)
        fh.seek(hb + disk.stride + 100)
        fh.write(bytes([b[0] ^ 1]))
    got = disk.load(ks)
    assert got.keys == [ks[0], ks[2]]
    assert disk.stats.checksum_errors == 1 and ks[1] not in disk
    assert disk.take_gone() == [ks[1]]
    assert disk.load([ks[1]]).keys == [] and disk.stats.checksum_errors == 1  # gone: a miss
    disk.close()


def test_checksums_cover_the_stored_width(tmp_path):
    disk = open_disk(tmp_path)
    ks = keys_(2)
    demote(disk, ks, width=disk.slot_bytes // 2)  # a group whose rows are half the slot
    assert disk.flush(10)
    assert disk.load(ks).keys == ks
    disk.close()


def test_a_torn_or_missing_slab_is_a_counted_miss(tmp_path):
    disk = open_disk(tmp_path, slab_entries=2)
    ks = keys_(4)
    demote(disk, ks)
    assert disk.flush(10)
    first, second = slab_files(disk)
    hb = disk._slabs[disk._index[ks[0]][0]].header_bytes
    os.truncate(first, hb + disk.stride + 10)  # the second slot cut short
    second.unlink()
    assert disk.load(ks).keys == [ks[0]]
    assert disk.stats.torn == 3 and disk.stats.checksum_errors == 0
    assert sorted(disk.take_gone()) == sorted(ks[1:])
    disk.close()
    again = open_disk(tmp_path, slab_entries=2)
    assert again.keys() == [ks[0]]
    assert again.load([ks[0]]).keys == [ks[0]]
    again.close()


def test_reopen_rebuilds_the_index_from_the_headers(tmp_path):
    plan = make_plan("full", factor=2)
    disk = open_disk(tmp_path, plan)
    ks = keys_(6)
    demote(disk, ks[:4])
    demote(disk, ks[4:])  # a second batch: a second slab, the first's header rewritten
    assert disk.flush(10)
    disk.close()
    again = open_disk(tmp_path, plan)
    assert sorted(again.keys()) == sorted(ks) and again.stats.refused_slabs == 0
    assert dict(again.entries())[ks[5]] == (ks[5], None)
    got = again.load(ks)
    assert got.keys == ks
    assert all(np.array_equal(got.rows[i], expect(again, k)) for i, k in enumerate(ks))
    demote(again, keys_(2, 10))  # appends after what was there
    assert again.flush(10) and len(again) == 8
    again.close()


def test_another_model_identity_or_a_torn_header_is_refused(tmp_path):
    disk = open_disk(tmp_path)
    demote(disk, keys_(3))
    assert disk.flush(10)
    disk.close()
    other = model_identity("m", make_plan("full", block_size=8))
    assert other != ID
    refused = open_disk(tmp_path, identity=other)
    assert len(refused) == 0 and refused.stats.refused_slabs == 1
    assert slab_files(refused) == []  # its file is removed: it can never serve this model
    demote(refused, keys_(2))
    assert refused.flush(10)
    refused.close()
    (slab,) = slab_files(refused)
    with open(slab, "r+b") as fh:  # the digest no longer matches the records
        fh.seek(200)
        b = fh.read(1)
        fh.seek(200)
        fh.write(bytes([b[0] ^ 0xFF]))
    torn = open_disk(tmp_path, identity=other)
    assert len(torn) == 0 and torn.stats.refused_slabs == 1
    torn.close()


def test_eviction_keeps_the_byte_budget(tmp_path):
    disk = open_disk(tmp_path, slabs=2, slab_entries=2)
    ks = keys_(6)
    for i, k in enumerate(ks):
        disk.record([k] * (i + 1))  # each newcomer used more than those before it: admitted
        demote(disk, [k])
        assert disk.flush(10)
    assert disk.stats.not_admitted == 0
    assert disk.num_slabs == 2 and disk.used_bytes <= disk.max_slabs * disk.slab_bytes
    assert disk.stats.evicted == 2 and sorted(disk.take_gone()) == ks[:2]
    assert disk.load(ks).keys == ks[2:]
    assert len(slab_files(disk)) == 2  # the evicted slab's file is reused
    assert demote(disk, [ks[3]]) == [ks[3]] and disk.stats.skipped == 1  # held: not rewritten
    disk.close()


def test_a_full_tier_admits_only_what_was_used_more_than_what_it_would_evict(tmp_path):
    """TinyLFU over the CPU tier's accesses: while there is room every demotion is written;
    once full, an entry used once does not push out a slab of entries used more often (a
    scan cannot flush the disk), a hotter one does."""
    disk = open_disk(tmp_path, slabs=2, slab_entries=2)
    held = keys_(4)
    for k in held:
        disk.record([k] * 3)
    assert demote(disk, held) == held and disk.flush(10)
    cold, hot = keys_(2, start=10)
    disk.record([cold])
    assert demote(disk, [cold]) == [] and disk.stats.not_admitted == 1
    assert disk.flush(10) and disk.load(held).keys == held  # nothing was pushed out
    disk.record([hot] * 8)
    assert demote(disk, [hot]) == [hot] and disk.flush(10)
    assert disk.stats.evicted == 2 and hot in disk and cold not in disk
    disk.close()


def test_one_folder_serves_one_tier_at_a_time(tmp_path):
    disk = open_disk(tmp_path)
    with pytest.raises(ConfigError, match="give each node its own --disk-path"):
        open_disk(tmp_path)
    disk.close()
    open_disk(tmp_path).close()  # free again once the first is closed


def test_too_small_a_budget_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--disk-bytes at least"):
        DiskTier(tmp_path, make_plan("full"), ID, 4096)


def test_a_filesystem_without_o_direct_falls_back(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):  # what tmpfs before Linux 6.6 answers
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    disk = open_disk(tmp_path)
    demote(disk, keys_(2))
    assert disk.flush(10) and not disk.direct
    assert disk.load(keys_(2)).keys == keys_(2)
    disk.close()


class DiskMachine(RuleBasedStateMachine):
    """Any sequence of demotes, loads, evictions (a small budget), corruption and reopens:
    a load returns a key's own bytes or nothing."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="raykv-disk-"))
        self.disk = open_disk(self.dir, slabs=2, slab_entries=3)

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=5))
    def demote(self, ids):
        demote(self.disk, [keys_(1, i)[0] for i in ids])

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=6), wait=st.booleans())
    def load(self, ids, wait):
        if wait:
            self.disk.flush(10)
        ks = [keys_(1, i)[0] for i in ids]
        got = self.disk.load(ks)
        assert set(got.keys) <= set(ks)
        for i, k in enumerate(got.keys):
            assert np.array_equal(got.rows[i], expect(self.disk, k))

    @rule(at=st.integers(0, 1 << 20))
    def corrupt(self, at):
        self.disk.flush(10)
        files = slab_files(self.disk)
        if files:
            f = files[at % len(files)]
            size = f.stat().st_size
            with open(f, "r+b") as fh:
                fh.seek(at % size)
                b = fh.read(1)
                fh.seek(at % size)
                fh.write(bytes([b[0] ^ 0x10]))

    @rule()
    def reopen(self):
        self.disk.close()
        self.disk = open_disk(self.dir, slabs=2, slab_entries=3)

    def teardown(self) -> None:
        self.disk.close()
        shutil.rmtree(self.dir)


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def disk_usage(path: Path) -> int:
    """Bytes of every slab file under ``path`` (each model's folder)."""
    return sum(f.stat().st_size for f in path.rglob("slab-*.kv"))


def test_two_models_on_a_node_never_use_more_than_its_disk_bytes_together(tmp_path):
    """``--disk-bytes`` is the node's: the models' tiers split it equally, a second model's
    arrival shrinks the first's share (its oldest slabs go at once), a model's removal gives
    its share back; the slab files never hold more than the budget together."""
    plan = make_plan("full")
    probe = DiskTier(tmp_path / "probe", plan, ID, 1 << 40, slab_bytes=1)
    probe.close()
    asked = probe.slab_bytes + 2 * probe.stride  # a few entries a slab
    probe = DiskTier(tmp_path / "probe", plan, ID, 1 << 40, slab_bytes=asked)
    per = probe.slab_bytes
    probe.close()
    budget = 6 * per + per // 2  # not a multiple of a slab: the shares round down
    node = NodeDisk(tmp_path / "node", budget)
    other = model_identity("b", plan)
    a = node.open("a", plan, ID, slab_bytes=asked)
    assert a.slab_bytes == per
    assert a.max_slabs == 6  # alone: the whole budget
    for i in range(12):
        demote(a, keys_(1, start=i))
        assert a.flush(10)
        assert disk_usage(node.path) <= budget
    assert a.num_slabs == 6 and disk_usage(node.path) == 6 * per
    b = node.open("b", plan, other, slab_bytes=asked)
    assert (a.max_slabs, b.max_slabs) == (3, 3)
    assert a.num_slabs == 3 and disk_usage(node.path) <= budget  # shrunk before b writes
    assert a.load(keys_(6, start=6)).keys == keys_(6, start=6)  # the newest slabs stayed
    assert sorted(a.take_gone()) == keys_(6)
    for i in range(12):  # both demote, interleaved: each within its share, both within N
        for tier in (a, b):
            tier.record([b"hot" + bytes([i])] * (i + 2))
            demote(tier, [b"\0\0\0\0" + bytes([i, tier is a])])
            assert tier.flush(10)
            assert disk_usage(node.path) <= budget
            assert node.used_bytes <= budget
    assert a.num_slabs == b.num_slabs == 3
    node.close("b")  # removed: its files go, a grows back into its share
    assert not list((node.path / "b").glob("slab-*.kv")) and a.max_slabs == 6
    with pytest.raises(ConfigError, match="give --disk-bytes at least"):
        NodeDisk(tmp_path / "small", per - 1).open("a", plan, ID, slab_bytes=asked)
    small = NodeDisk(tmp_path / "small2", per)
    small.open("a", plan, ID, slab_bytes=asked)
    with pytest.raises(ConfigError, match="for all its models"):
        small.open("b", plan, other, slab_bytes=asked)
    assert small.share == per  # the refused model took nothing
    small.close("a")
    node.close("a")


def test_two_tiers_given_one_folder_take_a_lane_each_and_a_restart_finds_its_slabs(
    tmp_path, monkeypatch
):
    """Two Ray nodes of one host given one --disk-path (two pods of a Helm group on one
    Kubernetes node, one hostPath) each take a lane of it with its own budget; a node's tier
    placed again takes a lane that holds slabs once its predecessor let go, and serves them."""
    import raykv.tiers.disk_tier as disk_tier

    monkeypatch.setattr(disk_tier, "LANE_WAIT_S", 0.2)  # how long a held lane 0 is waited for
    plan = make_plan("full")
    first = NodeDisk(tmp_path, 64 << 20)
    second = NodeDisk(tmp_path, 64 << 20)
    assert first.path == tmp_path and second.path == tmp_path / ".lane-1"
    a = first.open("m", plan, ID)
    demote(a, keys_(3))
    assert a.flush(10)
    b = second.open("m", plan, ID)  # the same model: its own folder, nothing of a's
    assert b.load(keys_(3)).keys == []
    a.close()
    os.close(first._lane_fd)  # the first node's process exits
    t0 = time.monotonic()
    again = NodeDisk(tmp_path, 64 << 20)
    assert again.path == tmp_path and time.monotonic() - t0 < 1.0  # free: taken at once
    assert again.open("m", plan, ID).load(keys_(3)).keys == keys_(3)
    t0 = time.monotonic()
    third = NodeDisk(tmp_path, 64 << 20)  # every lane held: a new one, after waiting
    assert third.path == tmp_path / ".lane-2" and time.monotonic() - t0 >= 0.2
    assert third.path == tmp_path / ".lane-2"
    b.close()
