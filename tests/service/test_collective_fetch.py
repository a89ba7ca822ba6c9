"""Pools on two Ray nodes fetch over torch.distributed pairs (gloo here, NCCL on GPUs): the
route is ``gloo``, bytes arrive equal (TP-1, TP-2 rank to rank, MLA moved once), a batch
corrupted in flight is a counted miss, and a holder killed mid-transfer is a miss in
bounded time, then placed again."""

import os
import time

import pytest
import ray
import torch
from kvdata import ROW, rows, tokens

from raykv.layout import MLA, FullAttention
from raykv.service.served import NAMESPACE, pool_name, rank_name
from raykv.transport.collective.wire import SHARE_MIN_BYTES

pytestmark = pytest.mark.ray
RAY_WORKERS = 1
OBJECT_STORE_BYTES = 640 << 20  # the MLA batch's 2 x 128 MiB store on each node, in memory
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
TP_LAYERS = {f"l{i}": FullAttention("float32", num_kv_heads=2, head_dim=16) for i in range(2)}
MLA_LAYERS = {f"l{i}": MLA("float32", kv_lora_rank=24, qk_rope_head_dim=8) for i in range(2)}
MLA_ROW = 2 * BS * 32 * 4  # 2 layers x 16 tokens x (24 + 8) x 4 bytes, on every rank


@pytest.fixture(scope="module", autouse=True)
def short_timeout():
    old = os.environ.get("RAYKV_COLLECTIVE_TIMEOUT_S")
    os.environ["RAYKV_COLLECTIVE_TIMEOUT_S"] = "4"  # the actors inherit it
    yield
    if old is None:
        del os.environ["RAYKV_COLLECTIVE_TIMEOUT_S"]
    else:
        os.environ["RAYKV_COLLECTIVE_TIMEOUT_S"] = old


def pools(ray_cluster):
    """(holder on the worker node, reader on the head)."""
    kv = ray_cluster.kv
    return kv.on(ray_cluster.ids[0]), kv.on(ray_cluster.head)


def published(ray_cluster, model: str, n: int, seed: int):
    """A full-attention model whose worker-node pool holds ``n`` known blocks of a prompt:
    (holder, reader, the prompt's ids, the blocks' rows)."""
    ray_cluster.kv.add_model(
        model, LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=40 * ROW
    )
    a, b = pools(ray_cluster)
    ids, data = tokens(n * BS + 1, seed), rows(n, seed + 1)
    publish(a, "w", ids, data, n)
    return a, b, ids, data


def publish(client, rid, ids, data, n):
    assert client.admit(rid, len(ids), ids)
    table = client.allocate(rid, len(ids), ids)[0]
    assert client.store(rid, table[:n], data) == n
    client.free(rid)


def load(client, rid, ids, n):
    assert client.admit(rid, len(ids), ids)
    table = client.allocate(rid, len(ids), ids)[0]
    return client.load(rid, ids, into=table[:n]), table


def holder(model: str, node: str):
    return ray.get_actor(pool_name(model, node, 0), namespace=NAMESPACE)


def test_tp1_pair_moves_equal_bytes_over_gloo(ray_cluster) -> None:
    kv = ray_cluster.kv
    _, b, ids, data = published(ray_cluster, "c1", 8, 1)
    res, table = load(b, "r", ids, 8)
    assert (res.num_tokens, res.bytes) == (8 * BS, 8 * ROW)
    assert torch.equal(b.read(table[:8]), data)
    b.free("r")
    routes = {(r["from"], r["to"]): r["transport"] for r in kv.stats()["routes"]}
    pa, pb = pool_name("c1", ray_cluster.ids[0], 0), pool_name("c1", ray_cluster.head, 0)
    assert routes[(pa, pb)] == "gloo"
    stats = ray.get(holder("c1", ray_cluster.head).snapshot.remote())["stats"]
    assert not stats.get("failed_transport_gloo") and not stats.get("checksum_errors")


def test_tp2_moves_rank_to_rank_and_mla_crosses_once(ray_cluster) -> None:
    kv = ray_cluster.kv
    kv.add_model("c2", TP_LAYERS, max_model_len=256, tp_size=2, pool_bytes=17 * ROW,
                 cpu_bytes=20 * ROW)  # fmt: skip
    a, b = pools(ray_cluster)
    ids = tokens(6 * BS + 3, 3)
    per_rank = [rows(6, 10 + r) for r in range(2)]
    publish(a, "w", ids, per_rank, 6)
    res, table = load(b, "r", ids, 6)
    assert (res.num_tokens, res.bytes) == (6 * BS, 6 * 2 * ROW)  # both distinct copies
    for r in range(2):
        assert torch.equal(b.read(table[:6], rank=r), per_rank[r])
    b.free("r")

    kv.add_model("c3", MLA_LAYERS, max_model_len=256, tp_size=2, pool_bytes=17 * MLA_ROW,
                 cpu_bytes=20 * MLA_ROW)  # fmt: skip
    a, b = pools(ray_cluster)
    latent = rows(5, 20, MLA_ROW)
    publish(a, "w", ids, [latent, latent], 5)
    res, table = load(b, "r", ids, 5)
    assert (res.num_tokens, res.bytes) == (5 * BS, 5 * MLA_ROW)  # one copy on the wire
    for r in range(2):  # replicated on arrival
        assert torch.equal(b.read(table[:5], rank=r), latent)
    b.free("r")


def test_a_large_mla_batch_crosses_in_shares_from_every_holder_rank(ray_cluster) -> None:
    """128 MiB of latent (two shares of ``SHARE_MIN_BYTES``): the holder's rank 1 sends a
    share too (over its own pair), each reader rank receives its share from the holder and
    the other from its replica; one copy on the wire, every byte on both ranks."""
    kv = ray_cluster.kv
    layers = {f"l{i}": MLA("float32", kv_lora_rank=504, qk_rope_head_dim=8) for i in range(8)}
    row = 8 * BS * 512 * 4  # 256 KiB per block, on every rank
    n = 2 * SHARE_MIN_BYTES // row
    kv.add_model("c6", layers, max_model_len=(n + 2) * BS, tp_size=2, pool_bytes=(n + 8) * row,
                 cpu_bytes=20 * row, max_num_batched_tokens=(n + 2) * BS)  # fmt: skip
    a, b = pools(ray_cluster)
    ids = tokens(n * BS + 1, 5)
    latent = rows(n, 21, row)
    publish(a, "w", ids, [latent, latent], n)
    res, table = load(b, "r", ids, n)
    assert (res.num_tokens, res.bytes) == (n * BS, n * row)  # one copy on the wire
    for r in range(2):
        assert torch.equal(b.read(table[:n], rank=r), latent)
    b.free("r")
    rank1 = ray.get_actor(rank_name(pool_name("c6", ray_cluster.ids[0], 0), 1), namespace=NAMESPACE)
    sent = ray.get(rank1.__ray_call__.remote(
        lambda self: [p.dst for p in self.kv.links._coll._groups
                      if p.src == self.kv.links._coll.ident]
    ))  # fmt: skip
    assert len(sent) == 1 and "-r1#" in sent[0], sent  # to the reader's rank 1


def test_corrupt_in_flight_is_a_counted_miss(ray_cluster) -> None:
    _, b, ids, data = published(ray_cluster, "c4", 6, 4)

    def arm(pool, what):
        def flip(msg):
            if msg.numel() > 3 * ROW + 1:  # the rows' message (the sums follow in their own)
                msg[3 * ROW + 1] ^= 0x40  # row 3, after the sender took its sum

        def hook(self):
            self.fetch.transports["gloo"].collective.tamper = flip if what else None

        ray.get(pool.__ray_call__.remote(hook))

    src = holder("c4", ray_cluster.ids[0])
    arm(src, True)
    res, table = load(b, "r", ids, 6)
    arm(src, False)
    assert res.num_tokens == 3 * BS  # rows 0..2 landed; 3 and after are misses
    assert torch.equal(b.read(table[:3]), data[:3])
    sb = ray.get(holder("c4", ray_cluster.head).snapshot.remote())["stats"]
    assert sb.get("checksum_errors", 0) >= 1, sb
    b.free("r")


def test_holder_killed_mid_transfer_is_a_miss_in_bounded_time(ray_cluster) -> None:
    kv = ray_cluster.kv
    a, b, ids, data = published(ray_cluster, "c5", 6, 6)
    src = holder("c5", ray_cluster.ids[0])
    old = ray.get(src.snapshot.remote())["actor_id"]

    def die_on_send(self):
        self.fetch.transports["gloo"].collective.tamper = lambda buf: os._exit(1)

    ray.get(src.__ray_call__.remote(die_on_send))
    t0 = time.monotonic()
    res, table = load(b, "r", ids, 6)
    assert res.num_tokens == 0 and time.monotonic() - t0 < 30
    b.free("r")
    deadline = time.monotonic() + 60  # the coordinator places the pool again
    while time.monotonic() < deadline:
        try:
            fresh = holder("c5", ray_cluster.ids[0])
            if ray.get(fresh.snapshot.remote(), timeout=5)["actor_id"] != old:
                break
        except (ValueError, ray.exceptions.RayError):
            pass
        time.sleep(0.5)
    else:
        pytest.fail("the killed pool was not placed again within 60 s")
    a = kv.on(ray_cluster.ids[0])  # a handle on the fresh pool
    publish(a, "w2", ids, data, 6)  # it serves over a fresh pair
    res, table = load(b, "r2", ids, 6)
    assert res.num_tokens == 6 * BS and torch.equal(b.read(table[:6]), data)
