"""The node's object tier in the service (no disk tier: the arena's evictions go straight to
the bucket, on moto's S3 server on 127.0.0.1): an entry the CPU tier evicts is uploaded,
stays published and is promoted back on its lease; a tier placed again, which never uploaded
anything (as another node or another cluster on the bucket), finds the entries through
their pointers on a lease, promotes and publishes them."""

import pytest
import ray
import torch
from kvdata import ROW, rows, tokens
from test_disk_tier import BS, LAYERS, loaded, store, wait_for

from raykv.bench.chaos import environment
from raykv.service.served import NAMESPACE, tier_name
from raykv.service.tier.actor import OBJECT_ENDPOINT_ENV, OBJECT_URL_ENV

pytest.importorskip("boto3")
pytest.importorskip("moto")

RAY_WORKERS = 0
MODEL = "object-m"


@pytest.fixture(scope="module")
def svc(request):
    """The module's cluster, its node's tier with an object tier on a local S3 server."""
    from raykv.bench.tiers import DUMMY_CREDENTIALS, local_s3

    with local_s3("raykv-svc") as endpoint:
        env = {OBJECT_URL_ENV: "s3://raykv-svc/cluster", OBJECT_ENDPOINT_ENV: endpoint,
               **DUMMY_CREDENTIALS}  # fmt: skip
        with environment(env):  # the raylet, and so the tier, inherit them
            yield request.getfixturevalue("ray_cluster")


def object_stats(svc) -> dict:
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    return ray.get(tier.snapshot.remote(), timeout=10)["stats"]["per_model"][MODEL]["object"]


@pytest.mark.ray
def test_evicted_entries_reach_the_bucket_and_come_back(svc) -> None:
    kv = svc.kv
    plan = kv.add_model(MODEL, LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=8 * ROW)
    n = plan.cpu_num_blocks
    a = kv.on(svc.head)
    ea = a.attach(num_blocks=64)
    first, first_src = tokens(n * BS, 1), rows(n, 1)
    second, second_src = tokens(n * BS, 2), rows(n, 2)
    store(ea, plan, first, first_src)
    store(ea, plan, second, second_src)  # evicts every entry of the first prompt
    wait_for("the demoted entries uploaded", lambda: object_stats(svc)["uploaded"] >= n)
    assert a.lookup([*first, 0]).hit_tokens == n * BS  # still published: in the bucket
    assert torch.equal(loaded(ea, plan, first, n), first_src)  # promoted, verified, loaded
    s = object_stats(svc)
    assert s["hits"] == n and s["checksum_errors"] == 0 and s["write_errors"] == 0
    ea.close()

    name = tier_name(svc.head)
    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    wait_for("the tier gone", lambda: not any(m["name"] == name for m in kv.stats()["members"]))
    wait_for("a fresh tier", lambda: any(m["name"] == name for m in kv.stats()["members"]), 180)
    a = kv.on(svc.head)
    ea = a.attach(num_blocks=64)
    assert torch.equal(loaded(ea, plan, first, n), first_src)  # through the pointers
    s = object_stats(svc)
    assert s["found"] == n and s["hits"] == n and s["uploaded"] == 0
    wait_for("the found entries published", lambda: a.lookup([*first, 0]).hit_tokens == n * BS)
    ea.close()


def test_the_object_settings_name_the_fix(monkeypatch) -> None:
    from raykv.errors import ConfigError
    from raykv.service.tier.actor import object_settings

    monkeypatch.delenv(OBJECT_URL_ENV, raising=False)
    monkeypatch.delenv(OBJECT_ENDPOINT_ENV, raising=False)
    assert object_settings() is None
    monkeypatch.setenv(OBJECT_ENDPOINT_ENV, "http://127.0.0.1:9000")
    with pytest.raises(ConfigError, match="RAYKV_OBJECT_URL=s3://BUCKET/PREFIX"):
        object_settings()
    monkeypatch.setenv(OBJECT_URL_ENV, "s3://kv/a/b")
    s = object_settings()
    assert (s.bucket, s.prefix, s.endpoint) == ("kv", "a/b", "http://127.0.0.1:9000")
    monkeypatch.setenv(OBJECT_URL_ENV, "/mnt/kv")
    with pytest.raises(ConfigError, match="s3://BUCKET"):
        object_settings()
