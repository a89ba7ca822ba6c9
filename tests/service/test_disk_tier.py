"""The node's disk tier in the service: an entry the CPU tier evicts stays published and is
served again from disk (promoted on its lease), and a tier killed and placed again serves its
disk entries again (the index rebuilt from the slab headers, published as it registers)."""

import time

import pytest
import ray
import torch
from kvdata import ROW, rows, tokens

from raykv import ops
from raykv.bench.chaos import environment
from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, tier_name
from raykv.service.tier.actor import DISK_BYTES_ENV, DISK_PATH_ENV

RAY_WORKERS = 0
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
MODEL = "disk-m"


@pytest.fixture(scope="module")
def svc(request, tmp_path_factory):
    """The module's cluster, its node's tier with a disk tier in a folder of its own."""
    env = {DISK_PATH_ENV: str(tmp_path_factory.mktemp("disk")), DISK_BYTES_ENV: "64MiB"}
    with environment(env):  # the raylet, and so the tier, inherit them
        yield request.getfixturevalue("ray_cluster")


def disk_stats(svc) -> dict:
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    return ray.get(tier.snapshot.remote(), timeout=10)["stats"]["per_model"][MODEL]["disk"]


def wait_for(what: str, check, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f}s"
        time.sleep(0.2)
    return got


def store(ea, plan, ids: list[int], src: torch.Tensor) -> None:
    n = len(src)
    ops.scatter_blocks(src, ea.kv.entries(plan.groups[0].group_id), torch.arange(1, n + 1))
    assert ea.store_from(ids, list(range(1, n + 1))) == n
    ea.flush()


def loaded(ea, plan, ids: list[int], n: int) -> torch.Tensor | None:
    """The rows ``load_into`` brought for ``ids`` (None: not all of them)."""
    gid, mine = plan.groups[0].group_id, list(range(20, 20 + n))
    ops.scatter_blocks(torch.zeros((n, ROW), dtype=torch.uint8), ea.kv.entries(gid),
                       torch.tensor(mine))  # fmt: skip
    if ea.load_into(ids, mine) != n * BS:
        return None
    out = torch.empty((n, ROW), dtype=torch.uint8)
    ops.gather_blocks(ea.kv.entries(gid), torch.tensor(mine), out)
    return out


def test_evicted_entries_are_served_from_disk_and_after_a_tier_restart(svc) -> None:
    kv = svc.kv
    plan = kv.add_model(MODEL, LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=8 * ROW)
    n = plan.cpu_num_blocks
    a = kv.on(svc.head)
    ea = a.attach(num_blocks=64)
    first, first_src = tokens(n * BS, 1), rows(n, 1)
    second, second_src = tokens(n * BS, 2), rows(n, 2)
    store(ea, plan, first, first_src)
    store(ea, plan, second, second_src)  # evicts every entry of the first prompt
    s = wait_for("the demoted entries written", lambda: (d := disk_stats(svc))["written"] >= n
                 and d)  # fmt: skip
    assert s["entries"] == n and s["direct"]  # /tmp here takes O_DIRECT
    assert a.lookup([*first, 0]).hit_tokens == n * BS  # still published: on this node's disk
    assert torch.equal(loaded(ea, plan, first, n), first_src)  # promoted, verified, loaded
    s = disk_stats(svc)
    assert s["hits"] == n and s["checksum_errors"] == 0
    # the promotion evicted the second prompt's entries: demoted too
    wait_for("the second prompt on disk", lambda: disk_stats(svc)["entries"] == 2 * n)
    ea.close()

    name = tier_name(svc.head)
    handle = ray.get_actor(name, namespace=NAMESPACE)
    ray.kill(handle, no_restart=True)
    wait_for("the tier gone", lambda: not any(m["name"] == name for m in kv.stats()["members"]))
    wait_for("a fresh tier", lambda: any(m["name"] == name for m in kv.stats()["members"]), 180)
    s = wait_for("the fresh tier's disk index", lambda: (d := disk_stats(svc))["entries"] and d)
    assert s["entries"] == 2 * n and s["refused_slabs"] == 0 and s["torn"] == 0
    a = kv.on(svc.head)
    wait_for("the disk entries published", lambda: a.lookup([*second, 0]).hit_tokens == n * BS)
    ea = a.attach(num_blocks=64)
    assert torch.equal(loaded(ea, plan, second, n), second_src)
    assert torch.equal(loaded(ea, plan, first, n), first_src)
    ea.close()


def test_the_disk_settings_come_both_or_neither(monkeypatch) -> None:
    from raykv.errors import ConfigError
    from raykv.service.tier.actor import disk_settings

    monkeypatch.delenv(DISK_PATH_ENV, raising=False)
    monkeypatch.delenv(DISK_BYTES_ENV, raising=False)
    assert disk_settings() is None
    monkeypatch.setenv(DISK_PATH_ENV, "/mnt/nvme/raykv")
    with pytest.raises(ConfigError, match="set both"):
        disk_settings()
    monkeypatch.setenv(DISK_BYTES_ENV, "100GiB")
    s = disk_settings()
    assert (s.path, s.nbytes) == ("/mnt/nvme/raykv", 100 << 30)
