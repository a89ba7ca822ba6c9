"""``RankKV.copy``, the pool-to-pool block copy (prefix hits shared by copying): it checks
its sources with the tiers' ``verified_prefix`` and copies only the blocks before the first
corrupt one (invariant 12). No Ray cluster: one rank's KV in this process."""

import torch

from raykv import ops
from raykv.layout import FullAttention, plan
from raykv.service.pool.rank import RankKV
from raykv.tiers.checksum import row_checksums


def test_a_copy_stops_before_the_first_source_that_fails_its_checksum() -> None:
    layers = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=8) for i in (0, 1)}
    p = plan(layers, num_gpu_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    kv = RankKV(p)
    entries, width = kv.entries[0], kv.widths[0]
    src, dst = [1, 2, 3, 4], [9, 10, 11, 12]
    data = torch.randint(0, 256, (4, width), dtype=torch.uint8, generator=torch.Generator())
    ops.scatter_blocks(data, entries, torch.tensor(src))
    stored = row_checksums(data)
    assert kv.copy(0, src, dst, stored) == 4
    assert torch.equal(kv.gather(0, dst), data)

    kv.scatter(0, torch.zeros((4, width), dtype=torch.uint8), dst)
    bad = data.clone()
    bad[2, 5] ^= 0x10  # block 3 changed since its checksum was taken
    ops.scatter_blocks(bad, entries, torch.tensor(src))
    assert kv.copy(0, src, dst, stored) == 2
    assert torch.equal(kv.gather(0, dst[:2]), data[:2])
    assert not kv.gather(0, dst[2:]).any()  # nothing of the corrupt block or after it
    assert kv.copy(0, src, dst, None) == 4  # unchecked (a replica rank): every block
