"""The connector's scheduler and worker sides on vLLM's own types (``Request``,
``SchedulerOutput``, ``KVCacheConfig`` specs), without engines or Ray: the field's recurring
connector bugs, each a case here. A fake client answers lookups, a fake attached KV stands
in for the node's tier (the data plane itself is tested with real engines and in
tests/service).

Needs the optional extra ``vllm``; skipped without it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs 'vllm'")

import torch
from vllm import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from raykv.engine.node import EngineLookup
from raykv.errors import ConfigError, InvalidInput
from raykv.integrations.vllm.config import RaykvVllmConfig
from raykv.integrations.vllm.metadata import LoadSpec, RaykvMetadata, SaveSpec
from raykv.integrations.vllm.model import (
    EngineLayout,
    check_groups,
    engine_layout,
    model_name,
    rank_models,
)
from raykv.integrations.vllm.scheduler import RaykvScheduler
from raykv.integrations.vllm.worker import RaykvWorker
from raykv.layout import FullAttention, plan

BS = 32


class FakeNode:
    """Stands in for ``NodeKV``: lookups hit ``hit`` tokens, ``tier`` of them (None: all)
    held by the node's own tier; ``up`` False: no service on the node."""

    def __init__(self, hit: int = 0, fail: bool = False, tier: int | None = None) -> None:
        self.hit, self.fail, self.tier, self.calls = hit, fail, tier, 0
        self.up = True
        self.tenants: list = []  # the tenant of each lookup

    def lookup(self, ids, held_tokens, tenant=None):
        self.calls += 1
        self.tenants.append(tenant)
        if self.fail:
            raise RuntimeError("a broken replica")
        hit = min(self.hit, len(ids) - 1)
        return EngineLookup(hit, hit if self.tier is None else self.tier, len(ids))

    def close(self) -> None:
        pass


class FakeEngine:
    """Stands in for ``ServedEngine``: the engine's model on its node (``node``)."""

    def __init__(self, node: FakeNode, lay: EngineLayout) -> None:
        self.node, self.layout, self.groups = node, lay, (0,)

    def ready(self) -> bool:
        return self.node.up

    def lookup(self, ids, held_tokens, tenant=None):
        return self.node.lookup(ids, held_tokens, tenant)

    def close(self) -> None:
        self.node.close()


class FakeManager:
    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[int], ...]] = {}

    def get_block_ids(self, rid: str):
        return self.tables[rid]


def layout(max_model_len: int = 8192) -> EngineLayout:
    return EngineLayout(
        layers={"l0": FullAttention(dtype="float32", num_kv_heads=2, head_dim=64)},
        groups=(("l0",),), block_size=BS, num_blocks=512, max_model_len=max_model_len,
        max_num_batched_tokens=8192, kv_layout="LBHNC",
    )  # fmt: skip


def scheduler(
    hit: int = 0, fail: bool = False, sync: bool = True, tier: int | None = None
) -> tuple[RaykvScheduler, FakeManager]:
    """One KV group: loads are synchronous; ``sync=False`` takes the several-groups path
    (asynchronous loads reported within their step)."""
    s = RaykvScheduler(RaykvVllmConfig(), FakeEngine(FakeNode(hit, fail, tier), layout()))
    s.kv_cache_manager = FakeManager()
    s.sync = sync
    return s, s.kv_cache_manager


def request(rid: str, n: int, **kw) -> Request:
    params = SamplingParams(max_tokens=4, **kw)
    return Request(rid, [5 + i % 900 for i in range(n)], params, None)


def output(**kw):
    return SimpleNamespace(num_scheduled_tokens=kw.pop("scheduled", {}), **kw)


def alloc(s: RaykvScheduler, m: FakeManager, req: Request, ext: int) -> None:
    m.tables[req.request_id] = (list(range(1, -(-req.num_prompt_tokens // BS) + 1)),)
    s.after_alloc(req, None, ext)


def test_a_full_prompt_hit_is_n_minus_one_never_the_whole_prompt() -> None:
    s, _ = scheduler(hit=64 * BS)
    req = request("r", 64 * BS)
    assert s.num_new_matched_tokens(req, 0) == (64 * BS - 1, False)  # one group: sync load
    # beyond a local hit, block-aligned: a hit of 100 tokens is 96, 64 of them local
    s2, _ = scheduler(hit=100)
    assert s2.num_new_matched_tokens(request("q", 200), 64) == (32, False)
    # nothing beyond the local hit, or a prompt vLLM must compute anyway: no load
    assert s2.num_new_matched_tokens(request("p", 200), 96) == (0, False)
    assert s2.num_new_matched_tokens(request("o", BS), 0) == (0, False)


def test_a_lookup_that_fails_is_a_miss_and_opt_out_skips_the_lookup() -> None:
    s, _ = scheduler(fail=True)
    assert s.num_new_matched_tokens(request("r", 300), 0) == (0, False)
    s2, _ = scheduler(hit=256)
    off = request("r", 300, extra_args={"kv_transfer_params": {"raykv": {"load": False}}})
    assert s2.num_new_matched_tokens(off, 0) == (0, False)
    assert s2.engine.node.calls == 0


def tenant_request(rid: str, ids: list[int], **kw) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4), None, **kw)


def test_a_salted_or_lora_request_looks_up_loads_and_saves_under_its_own_tenant() -> None:
    """A cache salt and a LoRA adapter change a request's KV for the same token ids: the
    request is cached under its tenant's keys (``tenant_key``: salt, adapter name and path),
    handed to the lookup, the load and the save; a plain request under none."""
    from vllm.lora.request import LoRARequest

    from raykv.blocks import tenant_key

    ids = request("plain", 300).prompt_token_ids
    adapter = LoRARequest("adapter", 1, "/adapters/a")
    cases = {
        "plain": ({}, None),
        "empty-salt": ({"cache_salt": ""}, None),  # vLLM's own cache takes it as no salt
        "salted": ({"cache_salt": "tenant-a"}, tenant_key("tenant-a")),
        "lora": ({"lora_request": adapter}, tenant_key(None, "adapter", "/adapters/a")),
        "both": (
            {"cache_salt": "tenant-a", "lora_request": adapter},
            tenant_key("tenant-a", "adapter", "/adapters/a"),
        ),
        # the same name at another path (vLLM's own key has the path too), another id alike
        "moved": ({"lora_request": LoRARequest("adapter", 1, "/adapters/b")},
                  tenant_key(None, "adapter", "/adapters/b")),
        "renumbered": ({"lora_request": LoRARequest("adapter", 7, "/adapters/a")},
                       tenant_key(None, "adapter", "/adapters/a")),
    }  # fmt: skip
    assert len({t for _, t in cases.values()}) == 5
    s, m = scheduler(hit=256)
    for rid, (kw, tenant) in cases.items():
        req = tenant_request(rid, ids, **kw)
        assert s.num_new_matched_tokens(req, 0) == (256, False)
        assert s.engine.node.tenants[-1] == tenant
        assert s.reqs[rid].load and s.reqs[rid].store and s.reqs[rid].tenant == tenant
        alloc(s, m, req, 256)
        (load,) = s.build_meta(output()).loads
        assert load.tenant == tenant
        req.num_computed_tokens = 256
        (save,) = s.build_meta(output(scheduled={rid: 300 - 256})).saves
        assert save.tenant == tenant and len(save.token_ids) == 9 * BS


def test_multimodal_and_embedded_prompts_are_neither_loaded_nor_saved() -> None:
    """The same token ids with other images or prompt embeddings are other KV: a raykv hit
    (keyed by token ids and tenant) would be wrong KV, so there is none."""
    ids = request("plain", 300).prompt_token_ids
    embedded = tenant_request("embeds", ids, prompt_embeds=torch.zeros(300, 8))
    image = tenant_request("image", ids)
    image.mm_features = [SimpleNamespace(identifier="an image")]
    s, _ = scheduler(hit=256)
    for req in (embedded, image):
        assert s.num_new_matched_tokens(req, 0) == (0, False)
        assert not s.reqs[req.request_id].store  # never saved under the plain ids either
    assert s.engine.node.calls == 0


def test_a_load_that_ends_mid_block_loads_the_block_whole() -> None:
    s, m = scheduler(hit=64 * BS)
    req = request("r", 64 * BS)
    ext, _ = s.num_new_matched_tokens(req, 0)
    alloc(s, m, req, ext)
    (load,) = s.build_meta(output()).loads
    assert load.num_tokens == 64 * BS - 1  # vLLM recomputes the last token's slot
    assert len(load.block_ids[0]) == 64 and len(load.token_ids) == 64 * BS
    assert load.skip == (0,)
    # after a local hit of 2 blocks, those stay untouched (skipped)
    s2, m2 = scheduler(hit=10 * BS)
    r2 = request("q", 12 * BS + 5)
    ext, _ = s2.num_new_matched_tokens(r2, 2 * BS)
    alloc(s2, m2, r2, ext)
    (load,) = s2.build_meta(output()).loads
    assert load.skip == (2,) and load.num_tokens == 10 * BS


def test_a_request_aborted_before_it_is_scheduled_leaves_nothing_behind() -> None:
    s, _ = scheduler(hit=256)
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0)[0] == 256  # looked up, never allocated
    held, params = s.finished(req)  # aborted while waiting
    assert held is False and params["raykv"]["external_tokens"] == 0
    assert s.reqs == {} and s.build_meta(output()).loads == []


def settle(w: RaykvWorker) -> None:
    """Wait for the worker's asynchronous loads to end (they run on its loader thread)."""
    for f in list(w.loading.values()):
        f.result(10)


def test_an_async_load_is_reported_once_when_done_even_for_a_request_aborted_meanwhile() -> None:
    """An asynchronous load (several groups, or blocks off the node's tier) runs while vLLM
    steps on: reported in ``finished_recving`` exactly once, in the step it ends, whether
    or not vLLM dropped the request meanwhile (vLLM keeps its blocks until then)."""
    s, m = scheduler(hit=256, sync=False, tier=0)  # pulled from another node first
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0) == (256, True)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    meta = s.build_meta(output())
    gate = threading.Event()
    att = FakeAttached()
    att.pull_gate = gate
    w = worker(att)
    w.bind(meta)
    w.start_load()  # returns at once: the load waits for its pull
    assert w.finished(set()) == (None, None)  # not done: nothing reported
    held, _ = s.finished(req)  # aborted while its load runs: vLLM holds its blocks itself
    assert held is False
    w.bind(s.build_meta(output(finished_req_ids={"r"})))
    w.start_load()
    assert w.finished({"r"}) == (None, None)
    gate.set()
    settle(w)
    assert w.finished(set()) == (None, {"r"})  # reported once it ended ...
    assert w.finished(set()) == (None, None)  # ... and never again
    w.close()


def test_a_hit_off_the_nodes_tier_loads_asynchronously_and_does_not_block_the_step() -> None:
    s, m = scheduler(hit=256, tier=0)  # one group, but the blocks are on another node
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0) == (256, True)
    alloc(s, m, req, 256)
    (load,) = s.build_meta(output()).loads
    assert load.remote and not load.sync
    gate = threading.Event()
    att = FakeAttached()
    att.pull_gate = gate
    w = worker(att)
    w.bind(RaykvMetadata(loads=[load]))
    t0 = time.monotonic()
    w.start_load()
    assert time.monotonic() - t0 < 0.5  # the step goes on while the pull runs
    gate.set()
    settle(w)
    assert att.calls == ["pull", "load_into"] and w.finished(set()) == (None, {"r"})
    w.close()


def test_a_failed_sync_load_reports_the_blocks_that_did_not_arrive() -> None:
    s, m = scheduler(hit=256)
    req = request("r", 300)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    w = worker(FakeAttached(deliver=96))  # a checksum failure at block 3
    w.bind(s.build_meta(output()))
    w.start_load()
    bad = w.load_errors()
    assert bad == {4, 5, 6, 7, 8} and w.finished(set()) == (None, None)
    s.on_output(SimpleNamespace(failed_recving=set(), invalid_block_ids=bad))
    assert s.num_new_matched_tokens(req, 0) == (0, False)  # recomputed, no second hit
    assert s.finished(req)[1]["raykv"]["load_error_blocks"] == 5


def test_a_step_whose_load_missed_blocks_never_saves_them() -> None:
    """Blocks a sync load did not fill hold stale bytes, and the step's tokens were computed
    over them: the step's save stops before the first miss (never published as KV)."""
    s, m = scheduler(hit=256)
    req = request("r", 300)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    req.num_computed_tokens = 256  # scheduled with the hit, the rest computed this step
    meta = s.build_meta(output(scheduled={"r": 44}))
    assert len(meta.saves[0].block_ids[0]) == 9
    att = FakeAttached(deliver=96)
    w = worker(att)
    w.bind(meta)
    w.start_load()
    w.wait_for_save()
    w.drain()
    assert [n for n, _ in att.stored] == [96]  # blocks 0..2 only
    s.on_output(SimpleNamespace(failed_recving=set(), invalid_block_ids=w.load_errors()))
    assert s.reqs["r"].saved_tokens == 0  # the recomputed blocks are saved again
    w.close()


def test_a_failed_async_load_is_reported_failed_and_the_request_recomputes() -> None:
    s, m = scheduler(hit=256, sync=False)
    req = request("r", 300)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    w = worker(FakeAttached(deliver=96))  # a checksum failure at block 3
    w.bind(s.build_meta(output()))
    w.start_load()
    settle(w)
    assert w.finished(set())[1] == {"r"}
    failed = w.take_failed()
    assert failed == {"r"}
    s.on_output(SimpleNamespace(failed_recving=failed, invalid_block_ids=set()))
    # vLLM resets the request to recompute; no second hit is offered to it
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert s.finished(req)[1]["raykv"]["load_error_blocks"] == 8


def test_a_hit_the_nodes_tier_holds_loads_at_once_and_one_held_elsewhere_is_pulled_first():
    """The replica says where the hit is: all in the node's tier, the worker copies it
    before the forward (lease and copy, no pull); some of it elsewhere, the worker pulls it
    into the tier first, asynchronously."""
    s, m = scheduler(hit=256, tier=256)
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0) == (256, False)
    alloc(s, m, req, 256)
    (load,) = s.build_meta(output()).loads
    assert not load.remote
    att = FakeAttached()
    w = worker(att)
    w.bind(RaykvMetadata(loads=[load]))
    w.start_load()
    assert att.calls == ["load_into"]

    s, m = scheduler(hit=256, tier=128)  # the tier holds less than the cluster
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0) == (256, True)  # asynchronous: see below
    alloc(s, m, req, 256)
    (load,) = s.build_meta(output()).loads
    assert load.remote and not load.sync
    att = FakeAttached()
    w = worker(att)
    w.bind(RaykvMetadata(loads=[load]))
    w.start_load()
    settle(w)
    assert att.calls == ["pull", "load_into"]
    # each load's time per token by path, for a Serve router's cost model
    assert w.counts["load_tokens_remote"] > 0 and w.counts["load_us_remote"] >= 0
    assert "load_tokens_cpu" not in w.counts


def test_the_worker_pulls_loads_and_saves_under_the_specs_tenant() -> None:
    """A tenant's load (pulled first, then copied) and save are keyed by its tenant, and so
    is a save cut short by a load that missed blocks in the same step."""
    from raykv.blocks import tenant_key

    t = tenant_key("tenant-a")
    two = tuple(range(2 * BS))
    load = LoadSpec("r", two, ((1, 2),), (0,), 2 * BS, sync=False, remote=True, tenant=t)
    att = FakeAttached()
    w = worker(att)
    w.bind(RaykvMetadata(loads=[load], saves=[SaveSpec("q", two[:BS], ((3,),), t)]))
    w.start_load()
    settle(w)
    w.wait_for_save()
    w.drain()
    assert att.calls[:2] == ["pull", "load_into"] and att.tenants == [t, t, t]

    att = FakeAttached(deliver=BS)  # the second block did not arrive: the save stops there
    w = worker(att)
    load = LoadSpec("r", two, ((1, 2),), (0,), 2 * BS, sync=True, remote=False, tenant=t)
    w.bind(RaykvMetadata(loads=[load], saves=[SaveSpec("r", two, ((1, 2),), t)]))
    w.start_load()
    w.wait_for_save()
    w.drain()
    assert att.stored[0][0] == BS and att.tenants == [t, t]


def test_with_no_service_on_the_node_lookups_miss_at_once_and_nothing_is_saved() -> None:
    """The node agent is down (raykv down, a dead tier or Ray head): a lookup is a miss
    without asking anything, no save is sent; once it answers again, both resume."""
    s, m = scheduler(hit=256)
    s.engine.node.up = False
    req = request("r", 300)
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert s.engine.node.calls == 0 and s.stats.lookups_down == 1
    alloc(s, m, req, 0)
    req.num_computed_tokens = 0
    assert s.build_meta(output(scheduled={"r": 300})).saves == []
    s.engine.node.up = True
    q = request("q", 300)
    assert s.num_new_matched_tokens(q, 0) == (256, False)


def test_a_worker_without_a_service_counts_its_loads_missed_and_drops_its_saves() -> None:
    node = FakeNode()
    node.up = False
    w = RaykvWorker(FakeEngine(node, layout()))
    w.register({"l0": torch.zeros(4)})
    assert w.attached is None
    load = LoadSpec("r", tuple(range(2 * BS)), ((1, 2),), (0,), 2 * BS, sync=True, remote=False)
    w.bind(RaykvMetadata(loads=[load], saves=[SaveSpec("r", tuple(range(BS)), ((1,),))]))
    w.start_load()
    assert w.load_errors() == {1, 2}
    w.wait_for_save()
    assert w.counts["saves_dropped"] == 1 and w.counts["load_errors"] == 1
    assert w.finished({"r"}) == ({"r"}, None)  # its blocks are released, nothing leaks


def test_blocks_a_load_brought_in_are_not_saved_again() -> None:
    """They came from the tier: a step that completes no other block sends no save (no
    hashing, no round trip, no blocks held after the request); the next full block does."""
    s, m = scheduler(hit=256, tier=256)
    req = request("r", 256 + 16)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    req.num_computed_tokens = 256
    assert s.build_meta(output(scheduled={"r": 16})).saves == []
    assert s.finished(req)[0] is False  # nothing to wait for: vLLM frees its blocks now
    req = request("q", 256 + 40)
    alloc(s, m, req, s.num_new_matched_tokens(req, 0)[0])
    req.num_computed_tokens = 256
    (save,) = s.build_meta(output(scheduled={"q": 40})).saves
    assert len(save.block_ids[0]) == 9  # the prefix's 8 (held: skipped) and the new one


class FakeAttached:
    """Stands in for ``AttachedKV``: loads deliver ``deliver`` tokens, stores take
    ``store_s`` seconds."""

    def __init__(self, deliver: int | None = None, store_s: float = 0.0) -> None:
        self.deliver, self.store_s = deliver, store_s
        self.plan = SimpleNamespace(block_size=BS)
        self.stored: list[tuple] = []
        self.calls: list[str] = []
        self.tenants: list = []  # the tenant each pull, load and store was keyed by

    pull_gate: threading.Event | None = None  # a pull that waits for it (crossing nodes)

    def pull(self, token_ids, counts, tenant=None):
        self.calls.append("pull")
        self.tenants.append(tenant)
        if self.pull_gate is not None:
            self.pull_gate.wait(10)
        return counts

    def load_into(self, token_ids, block_ids, skip, tenant=None):
        self.calls.append("load_into")
        self.tenants.append(tenant)
        return len(token_ids) if self.deliver is None else self.deliver

    def send(self):
        self.calls.append("send")

    def store_from(self, token_ids, block_ids, tenant=None):
        time.sleep(self.store_s)
        self.stored.append((len(token_ids), threading.current_thread().name))
        self.tenants.append(tenant)
        return len(block_ids[0])


def worker(attached: FakeAttached) -> RaykvWorker:
    w = RaykvWorker(FakeEngine(FakeNode(), layout()))
    w.attached = attached
    return w


def save(rid: str, n: int = 2) -> RaykvMetadata:
    return RaykvMetadata(saves=[SaveSpec(rid, tuple(range(n * BS)), (tuple(range(1, n + 1)),))])


def test_blocks_are_held_while_a_save_runs_and_released_once_it_is_done() -> None:
    s, m = scheduler()
    req = request("r", 3 * BS)
    alloc(s, m, req, 0)
    req.num_computed_tokens = 0
    meta = s.build_meta(output(scheduled={"r": 3 * BS}))
    assert [x.request_id for x in meta.saves] == ["r"]
    w = worker(FakeAttached(store_s=0.3))
    w.bind(meta)
    w.wait_for_save()
    held, _ = s.finished(req)
    assert held is True  # vLLM keeps the blocks ...
    assert w.finished({"r"}) == (None, None)  # ... while the save still reads them
    w.drain()
    assert w.finished(set()) == ({"r"}, None)  # then they go back, once
    assert w.finished(set()) == (None, None)
    w.close()


def test_preemption_waits_for_the_saves_reading_the_preempted_blocks() -> None:
    att = FakeAttached(store_s=0.3)
    w = worker(att)
    w.bind(save("r"))
    w.wait_for_save()
    w.preempted()  # vLLM is about to reuse the blocks
    assert len(att.stored) == 1
    w.close()


def test_saves_of_a_step_whose_wait_for_save_was_skipped_are_dropped_and_released() -> None:
    att = FakeAttached()
    w = worker(att)
    w.bind(save("r"))  # the step failed before wait_for_save
    w.bind(RaykvMetadata())  # next step: the staged save is gone, nothing reserved
    w.wait_for_save()
    w.drain()
    assert att.stored == [] and w.counts["saves_dropped"] == 1
    assert w.finished({"r"}) == ({"r"}, None)  # its blocks are released, not leaked
    w.close()


# --- the vLLM layout -> raykv model mapping --------------------------------------------


def cfg(groups, num_blocks=512):
    vllm = SimpleNamespace(
        model_config=SimpleNamespace(model="/m/tiny", revision=None, dtype=torch.float32,
                                     max_model_len=4096),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=4096),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )  # fmt: skip
    kvc = SimpleNamespace(kv_cache_groups=groups, num_blocks=num_blocks, kv_cache_layout="LBHNC")
    return vllm, kvc


def spec(cls=FullAttentionSpec, **kw):
    return cls(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


def test_a_hybrid_engine_maps_to_raykv_groups_of_the_same_layers() -> None:
    groups = [
        KVCacheGroupSpec(["l0", "l2"], spec()),
        KVCacheGroupSpec(["l1", "l3"], spec(SlidingWindowSpec, sliding_window=256)),
    ]
    vllm, kvc = cfg(groups)
    lay = engine_layout(vllm, kvc)
    assert lay.layers["l1"].kind == "sliding_window" and lay.layers["l0"].kind == "full"
    p = plan(lay.layers, gpu_bytes=64 << 20, max_model_len=4096, block_size=BS,
             max_num_batched_tokens=4096)  # fmt: skip
    mapping = check_groups(p, lay)
    assert {frozenset(p.groups[i].layer_names) for i in mapping} == {
        frozenset({"l0", "l2"}),
        frozenset({"l1", "l3"}),
    }
    name = model_name(vllm, lay)
    assert name.startswith("vllm-tiny-") and name == model_name(vllm, lay)
    vllm.model_config.dtype = torch.bfloat16  # other weights / dtype: another model
    assert model_name(vllm, lay) != name


def test_a_tensor_parallel_engine_has_a_raykv_model_per_rank() -> None:
    vllm, kvc = cfg([KVCacheGroupSpec(["l0"], spec())])
    vllm.parallel_config.tensor_parallel_size = 2
    lay = engine_layout(vllm, kvc)  # vLLM's spec is one rank's share of the heads
    assert lay.tp_size == 2 and lay.layers["l0"].num_kv_heads == 2
    name = model_name(vllm, lay)
    assert rank_models(name, 2) == (f"{name}-tp0of2", f"{name}-tp1of2")
    assert rank_models(name, 1) == (name,)


def test_unsupported_layouts_and_settings_are_refused_with_the_fix() -> None:
    vllm, kvc = cfg([KVCacheGroupSpec(["l0"], spec(head_size_v=32))])
    with pytest.raises(ConfigError, match="V head size"):
        engine_layout(vllm, kvc)
    vllm, kvc = cfg([KVCacheGroupSpec(["l0"], spec())])
    vllm.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        engine_layout(vllm, kvc)
    with pytest.raises(ConfigError, match="unknown keys"):
        RaykvVllmConfig.from_extra({"adress": "x"})
    with pytest.raises(ConfigError, match="positive int"):
        RaykvVllmConfig.from_extra({"cpu_bytes": -1})


def test_vllm_cpu_block_outer_tensors_register_as_the_plans_pages() -> None:
    from raykv.tiers.gpu_kv import GpuKV

    layers = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=2, head_dim=64) for i in (0, 1)}
    p = plan(
        layers, gpu_bytes=8 << 20, max_model_len=1024, block_size=BS, max_num_batched_tokens=1024
    )
    nb = p.num_gpu_blocks
    backing = torch.zeros(2, nb, 2, BS, 128)  # one allocation, layer-outermost (LBHNC)
    kv = GpuKV.register(p, {"l0": backing[0], "l1": backing[1]}, layout="block_outer")
    assert kv.row_bytes(p.groups[0].group_id) == p.gpu_bytes_per_block
    with pytest.raises(InvalidInput, match="kernel blocks of 32768 bytes"):
        GpuKV.register(p, {"l0": backing[0, :, :1], "l1": backing[1]}, layout="block_outer")


def test_counters_reach_vllms_stats_as_deltas() -> None:
    from raykv.integrations.vllm.stats import RaykvStats, take

    last: dict[str, int] = {}
    first = take({"loaded_tokens": 96, "load_errors": 0}, last)
    assert first is not None and first.reduce() == {"loaded_tokens": 96}
    assert take({"loaded_tokens": 96}, last) is None  # nothing new
    total = RaykvStats(data={"loaded_tokens": 1}).aggregate(first)
    assert total.reduce() == {"loaded_tokens": 97} and not total.is_empty()
