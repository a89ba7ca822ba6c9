"""The CUDA kernel's block-to-block copy (``raykv.ops.pools.PoolCopy``, and its sums alone) matches
the torch reference bit for bit, its sums included; and an exportable pool's memory, mapped
again in this process (``raykv.tiers.peer_memory``), reads back the owner's bytes."""

import pytest
import torch
from paged_copy_cases import DTYPES, kv_entries, oracle_rows

from raykv import ops
from raykv.ops.pools import PoolCopy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["kv", "mla", "interleaved"])
@pytest.mark.parametrize("dtype", ["bf16", "u8", "f32"])
def test_kernel_pool_copy_matches_the_reference(kind, dtype) -> None:
    assert ops.kernel_available(), ops.kernel_status()
    gen = torch.Generator().manual_seed(7)
    src, _ = kv_entries(kind, 40, 16, DTYPES[dtype], 3, gen, device="cuda")
    dst, _ = kv_entries(kind, 30, 16, DTYPES[dtype], 3, gen, device="cuda")
    ref_src, ref_dst = [e.cpu() for e in src], [e.cpu() for e in dst]
    src_ids = torch.randperm(40, generator=gen)[:20].tolist()
    dst_ids = torch.randperm(30, generator=gen)[:20].tolist()
    copy, ref_copy = PoolCopy(src, dst), PoolCopy(ref_src, ref_dst)
    sums = copy.start(src_ids, dst_ids)
    ref = ref_copy.sums(ref_copy.start(src_ids, dst_ids))
    torch.cuda.synchronize()
    assert oracle_rows(dst, list(range(30))) == oracle_rows(ref_dst, list(range(30)))
    assert copy.sums(sums).tolist() == ref.tolist()
    alone = PoolCopy(src)
    got = alone.start(src_ids)
    torch.cuda.synchronize()
    assert alone.sums(got).tolist() == ref.tolist()


def test_the_done_event_passes_behind_the_sums_and_is_reused() -> None:
    """``start``'s ``done`` event, recorded by the extension call, passes only once the
    batch's copy and its sums are in (the peer reader waits on nothing else); the copy hands
    the same event out again once it is given back."""
    gen = torch.Generator().manual_seed(11)
    src, _ = kv_entries("kv", 600, 16, torch.bfloat16, 4, gen, device="cuda")
    dst, _ = kv_entries("kv", 600, 16, torch.bfloat16, 4, gen, device="cuda")
    ref_src = [e.cpu() for e in src]
    copy = PoolCopy(src, dst)
    first = None
    for seed in range(3):
        ids = torch.randperm(600, generator=torch.Generator().manual_seed(seed))[:512].tolist()
        torch.cuda._sleep(2_000_000)  # the batch queues behind ~1 ms of GPU work
        done = copy.event()
        first = done if first is None else first
        assert done is first  # one event, batch after batch
        sums = copy.start(ids, ids, done)
        assert not done.query()
        done.synchronize()
        ref_copy = PoolCopy(ref_src)
        ref = ref_copy.sums(ref_copy.start(ids))
        assert copy.sums(sums).tolist() == ref.tolist()  # read without any other wait
        assert oracle_rows(dst, ids) == oracle_rows(ref_src, ids)
        copy.reuse(done)


def test_kernel_pool_copy_refuses_bad_ids_as_raykv_errors() -> None:
    from raykv.errors import InvalidInput

    gen = torch.Generator().manual_seed(1)
    src, _ = kv_entries("kv", 8, 16, torch.bfloat16, 2, gen, device="cuda")
    dst, _ = kv_entries("kv", 8, 16, torch.bfloat16, 2, gen, device="cuda")
    before = oracle_rows(dst, list(range(8)))
    for src_ids, dst_ids, match in (([0, 8], [1, 2], "outside"), ([0, 1], [3, 3], "more than once"),
                                    (["x", 1], [1, 2], "not an int")):  # fmt: skip
        with pytest.raises(InvalidInput, match=match):
            PoolCopy(src, dst).start(src_ids, dst_ids)
    torch.cuda.synchronize()
    assert oracle_rows(dst, list(range(8))) == before


def test_exportable_memory_maps_again_with_the_same_bytes() -> None:
    from raykv.tiers import peer_memory

    device = torch.device("cuda", 0)
    assert peer_memory.available(device)
    export = peer_memory.PeerExport([(64, 4096), (64, 1000)], device)
    for i, t in enumerate(export.tensors):
        t.copy_(torch.randint(0, 255, t.shape, dtype=torch.uint8, device=device) + i)
    again = peer_memory.open_peer(export.spec, device)
    assert [tuple(t.shape) for t in again] == [(64, 4096), (64, 1000)]
    for a, b in zip(export.tensors, again, strict=True):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    export.tensors[0][3, 5] += 1  # one mapping, one memory
    torch.cuda.synchronize()
    assert torch.equal(export.tensors[0], again[0])
    export.close()


def test_batches_of_several_launches_on_two_streams_each_get_their_own_sums() -> None:
    """The kernel hands each row's sum back itself and leaves its running sums zero for the next
    launch: batches larger than one launch's rows (``pool_batch_rows``), queued back to back
    and alternating between two streams without a wait, each get exactly the reference's sums
    and bytes, and the running sums are zero after them."""
    gen = torch.Generator().manual_seed(13)
    launch_rows = ops.kernel_module().pool_batch_rows
    blocks = 2 * launch_rows + 100
    src, _ = kv_entries("kv", blocks, 16, torch.bfloat16, 2, gen, device="cuda")
    dst, _ = kv_entries("kv", blocks, 16, torch.bfloat16, 2, gen, device="cuda")
    ref_src = [e.cpu() for e in src]
    copy, streams = PoolCopy(src, dst), [torch.cuda.Stream(), torch.cuda.Stream()]
    batches = []
    for k, n in enumerate([2 * launch_rows + 37, 1, launch_rows, 700, launch_rows + 1, 3]):
        ids = torch.randperm(blocks, generator=gen)[:n].tolist()
        out = torch.randperm(blocks, generator=gen)[:n].tolist()
        with torch.cuda.stream(streams[k % 2]):
            torch.cuda._sleep(200_000)  # the batch queues behind other work on its stream
            batches.append((ids, out, copy.start(ids, out)))
    torch.cuda.synchronize()
    ref_copy = PoolCopy(ref_src)
    for ids, _, got in batches:
        assert copy.sums(got).tolist() == ref_copy.sums(ref_copy.start(ids)).tolist()
    ids, out, _ = batches[-1]
    assert oracle_rows(dst, out) == oracle_rows(ref_src, ids)
    assert not copy._scratch.any()


def test_the_extensions_leading_good_matches_numpys() -> None:
    """``pool_leading`` (one pass in the extension) counts exactly what the reference's numpy
    does, for rows whose sums differ, whose flags are unset, and stated lists of any length."""
    gen = torch.Generator().manual_seed(17)
    src, _ = kv_entries("kv", 4, 16, torch.bfloat16, 1, gen, device="cuda")
    copy = PoolCopy(src)
    reference = PoolCopy([e.cpu() for e in src])
    assert copy._module is not None and reference._module is None
    for _ in range(300):
        n = int(torch.randint(0, 20, (1,), generator=gen))
        got = torch.randint(-3, 3, (2 * n,), generator=gen, dtype=torch.int64)
        got[n:] = (torch.rand(n, generator=gen) < 0.9).long()
        sent = got[:n].clone()
        sent[torch.rand(n, generator=gen) < 0.1] += 1
        sent = sent[: int(torch.randint(0, n + 3, (1,), generator=gen))].numpy()
        assert copy.leading_good(got, sent) == reference.leading_good(got, sent)
