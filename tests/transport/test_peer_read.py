"""``raykv.transport.peer_read`` on the CPU: a reader maps a holder's shared-memory pool in
another process, copies its blocks straight into its own and counts the leading rows whose
sums equal the holder's statement; mappings of holders that are gone are dropped."""

import asyncio
import multiprocessing as mp

import numpy as np
import torch

from raykv.ops.pools import PoolCopy
from raykv.tiers import shm
from raykv.transport.peer_read import PeerMaps, owner_pid, read_blocks, stated_sums


def _holder(q, done) -> None:
    raw, spec = shm.create((16, 256), "peertest")
    raw.copy_(torch.arange(16 * 256).remainder(251).to(torch.uint8).view(16, 256))
    q.put(spec)
    done.wait(30)


def test_a_reader_copies_a_live_holders_blocks_and_drops_the_mapping_once_it_is_gone():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_holder, args=(q, done))
    p.start()
    spec = q.get(timeout=30)
    assert owner_pid([spec]) == p.pid
    maps = PeerMaps(lambda h: [shm.attach(s) for s in h])
    (src,) = maps.get([spec])
    mine = torch.zeros(8, 256, dtype=torch.uint8)
    stated = stated_sums(PoolCopy([src]), [3, 9, 12])
    assert stated.dtype == np.int64 and stated.shape == (3,)  # compared as it is, no conversion
    copy = PoolCopy([src], [mine])
    got = asyncio.run(read_blocks(copy, [3, 9, 12], [0, 5, 2], stated, 5.0))
    assert got == 3
    assert [mine[i].tolist() for i in (0, 5, 2)] == [src[b].tolist() for b in (3, 9, 12)]
    wrong = [stated[0], stated[1] + 1, stated[2]]  # the holder stated block 9 otherwise
    assert asyncio.run(read_blocks(copy, [3, 9, 12], [1, 6, 7], wrong, 5.0)) == 1
    assert len(maps) == 1
    done.set()
    p.join(30)
    maps.sweep()
    assert len(maps) == 0  # its memory is no longer held here
