"""The service's side of the one prefix index: group keys filed as block-pool events, copies
ranked from the caller's node, members leaving."""

from raykv.blocks import BlockRemoved, BlockStored, PrefixIndex
from raykv.service.control.index import CPU, GPU, Location, key_events, rank, split_key


def key(gid: int, h: bytes) -> bytes:
    return gid.to_bytes(4, "little") + h


def test_best_copy_is_local_gpu_then_local_cpu_then_remote() -> None:
    copies = [Location("rg", "B", GPU), Location("rc", "B", CPU), Location("lc", "A", CPU)]
    copies.append(Location("lg", "A", GPU))
    order = [c.member for c in sorted(copies, key=lambda c: c.rank("A"))]
    assert order == ["lg", "lc", "rg", "rc"]
    assert rank("A", GPU, "A") == 0 and rank("B", CPU, "A") == 3


def test_a_members_batch_is_the_block_pools_events() -> None:
    stored = [(key(0, b"a" * 32), 3), (key(1, b"b" * 32), 4), (key(0, b"c" * 32), 5)]
    removed = [key(1, b"d" * 32)]
    assert split_key(key(7, b"x" * 32)) == (7, b"x" * 32)
    events = key_events(stored, removed, {0: 16, 1: 32})
    assert events == [
        BlockRemoved(1, (b"d" * 32,)),
        BlockStored(0, (b"a" * 32, b"c" * 32), (3, 5), None, 16),
        BlockStored(1, (b"b" * 32,), (4,), None, 32),
    ]
    idx = PrefixIndex().replay(events, "pool", "m")
    assert idx.copies(0, b"c" * 32, "m") == {"pool": 5}
    assert idx.copies(0, b"c" * 32, "other-model") == {}
    assert idx.drop_member("pool") == 3 and len(idx) == 0


def test_import_raykv_does_not_import_ray() -> None:
    import subprocess
    import sys

    code = "import sys, raykv; assert 'ray' not in sys.modules; assert callable(raykv.connect)"
    subprocess.run([sys.executable, "-c", code], check=True)
