"""Issue 8, point 10: inside the cluster, a request's blocks belong to the client that
admitted it, and stopping the service takes the admin path. (A driver without Ray's token
is refused at the door: tests/service/test_cli.py.)"""

import pickle

import pytest
import ray
import torch

from raykv.client import Client
from raykv.errors import AccessDenied
from raykv.layout import FullAttention
from raykv.service.control.admin import admin_key
from raykv.service.served import COORDINATOR, NAMESPACE

pytestmark = pytest.mark.ray
RAY_WORKERS = 1
PROMPT = list(range(1, 89))  # 5 full blocks of 16 (published once stored) + 8 private tokens


@pytest.fixture(scope="module")
def owner(ray_cluster):
    layers = {f"l{i}": FullAttention(num_kv_heads=1, head_dim=8, dtype="float32") for i in range(2)}
    ray_cluster.kv.add_model("acl", layers, max_model_len=256, pool_bytes=1 << 20)
    return Client(model="acl").on(ray_cluster.head)


def test_a_request_belongs_to_the_client_that_admitted_it(owner, ray_cluster) -> None:
    stranger = Client(model="acl").on(ray_cluster.head)
    assert stranger.client_id != owner.client_id
    assert owner.admit("mine", len(PROMPT), PROMPT)
    table = owner.allocate("mine", len(PROMPT), PROMPT)[0]
    rows = torch.randint(0, 256, (5, owner.plan.gpu_bytes_per_block), dtype=torch.uint8)
    assert owner.store("mine", table[:5], rows) == 5  # the partial sixth block stays private
    before = owner.block_table("mine")

    refused = {
        "admit": lambda: stranger.admit("mine", len(PROMPT), PROMPT),
        "allocate": lambda: stranger.allocate("mine", 1, [*PROMPT, 7]),
        "blocks_needed": lambda: stranger.blocks_needed("mine", 1, [*PROMPT, 7]),
        "store": lambda: stranger.store("mine", table[:5], torch.zeros_like(rows)),
        "load": lambda: stranger.load("mine", PROMPT, into=table),
        "block_table": lambda: stranger.block_table("mine"),
        "read": lambda: stranger.read(table),  # its sixth block is private
        "free": lambda: stranger.free("mine"),
    }
    for name, call in refused.items():
        with pytest.raises(AccessDenied, match=r"another client|neither published nor"):
            call()
        assert owner.block_table("mine") == before, name
    assert torch.equal(owner.read(table)[:5], rows)  # bytes unchanged, owner still served
    assert torch.equal(stranger.read(table[:5]), rows)  # published: anyone's to load

    # the owner's handle pickled to a worker (and its async form) is the same client
    twin = pickle.loads(pickle.dumps(owner))
    assert twin.client_id == owner.client_id and twin.block_table("mine") == before
    assert torch.equal(twin.read(table[:2]), rows[:2]) and len(twin.read(table)) == 6

    # the stranger reaches the published prefix the supported way: into its own blocks
    assert stranger.admit("theirs", len(PROMPT), PROMPT)
    theirs = stranger.allocate("theirs", len(PROMPT), PROMPT)[0]
    got = stranger.load("theirs", PROMPT, into=theirs[:5])
    assert got.num_tokens == 80
    assert torch.equal(stranger.read(theirs[:5]), rows)
    stranger.free("theirs")
    owner.free("mine")
    # a freed id is free for anyone again
    assert stranger.admit("mine", 16, PROMPT[:16])
    stranger.free("mine")


def test_stopping_the_service_takes_the_admin_path(owner) -> None:
    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    for wrong in (None, "", "0" * 32):
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(coord.shutdown_service.remote(wrong))
        assert isinstance(e.value.cause, AccessDenied)
    assert "acl" in owner.stats()["models"]  # nothing was stopped
    assert owner.admit("still-up", 16, PROMPT[:16])
    owner.free("still-up")
    assert len(admin_key()) == 32 and admin_key() == admin_key()  # one key per service
