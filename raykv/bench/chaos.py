"""``raykv bench chaos``: a soak of the service under faults, every served byte checked.

A 3-node Ray cluster on this host (head + 2 nodes, CPU-device pools) runs a steady workload:
per node a Ray-driver client (``Client.on(node)``: lookup, admit, allocate, load across
nodes, read, store, read back, free) and an engine attached to the node's CPU tier
(``NodeKV.open(node_id=...)``: lookup, pull of what other nodes hold, ``load_into``,
``store_from``, a second ``load_into`` as the read back). Meanwhile a fault driver hits a
random member every few seconds, taking the kinds in shuffled rounds so a short soak sees
each: a pool actor, a CPU tier (the node agent), the coordinator, a whole node (removed,
then a fresh one added), a UCX peer killed while another tier pulls from it (where ucxx is
installed), and a flipped byte in a written tier row.

Block ``j`` of a prompt only ever holds bytes seeded by the prompt's first ``j + 1`` blocks
of tokens (its prefix, as the block hash chains it), so every load and read is checked.
Afterwards every request is freed and every engine closed; the pools must hold no blocks or
requests and the tiers no leases. Recovery time: from a fault to the first successful
operation that needs the member hit (a pool: its node's driver calls; a tier or UCX peer:
its node's engine copies; the coordinator: driver lookups; a node: any call on its fresh
node).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from raykv.bench import percentile
from raykv.errors import RaykvError, ServiceError, UnknownRequest
from raykv.service.node.agent_protocol import AGENT_DIR_ENV

MODEL = "chaos"
BLOCK = 16
MAX_LEN = 512
ENGINE_BLOCKS = 2 * (MAX_LEN // BLOCK) + 2  # a load's blocks, the read back's, the null block
NODE = dict(num_cpus=1, num_gpus=0, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
KINDS = ("pool", "tier", "coordinator", "node", "ucx_peer", "corrupt")
UCX_ENV = {  # as the UCX tests: every UCX socket on loopback over tcp
    "RAYKV_TRANSPORT_SECRET": "raykv-bench-chaos-" + "0123456789abcdef",
    "RAYKV_UCX_TLS": "tcp",
    "RAYKV_UCX_NET_DEVICES": "lo",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "tcp",
    "RAYKV_UCX_TIMEOUT_S": "3",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# which successes end a fault's outage: (success kinds, on the fault's node only)
RECOVERED_BY = {
    "pool": (("driver",), True),
    "tier": (("engine",), True),
    "coordinator": (("lookup",), False),
    "node": (("driver", "engine"), True),
    "ucx_peer": (("engine",), True),
    "corrupt": (("engine",), True),
}
SETTLE_S = 60.0  # the service whole again after the last fault (a node takes the longest)


def _layers() -> dict[str, Any]:
    from raykv.layout import FullAttention

    return {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in (0, 1)}


def expected(ids: list[int], n: int, width: int) -> torch.Tensor:
    """The only bytes block ``j`` of prompt ``ids`` may ever hold: seeded by its prefix."""
    out = np.empty((n, width), np.uint8)
    for j in range(n):
        prefix = np.asarray(ids[: (j + 1) * BLOCK], np.int64).tobytes()
        seed = int.from_bytes(hashlib.sha256(prefix).digest()[:8], "little")
        out[j] = np.random.default_rng(seed).integers(0, 256, width, dtype=np.uint8)
    return torch.from_numpy(out)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment (the raylets started meanwhile inherit them), then the
    old ones back, so a caller's process is left as it was (every bench that starts a local
    cluster: chaos, routing)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Fault:
    kind: str
    slot: int
    at: float  # when it hit
    back: float  # when the fault was in place (the member seen dead, a fresh node added)
    detail: str = ""
    recovered: float | None = None  # seconds from ``at`` to the first success that needs it


@dataclass
class Tally:
    """Everything the workers and the fault driver count, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ops: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    raw: list[str] = field(default_factory=list)  # the first few non-raykv errors, verbatim
    samples: dict[str, list[str]] = field(default_factory=dict)  # a few messages per type
    wrong_blocks: int = 0  # served blocks whose bytes differ from what was stored
    wrong: list[str] = field(default_factory=list)  # where, for the first few
    checked_blocks: int = 0
    served_blocks: int = 0  # blocks a load filled from another copy (checked too)
    refused: int = 0  # admits answered False (the pool full): retried, not an error
    # (start, end, slot, kind) of every success that can end an outage
    successes: list[tuple[float, float, int, str]] = field(default_factory=list)
    done: list[float] = field(default_factory=list)  # end time of every successful call

    def ok(self, name: str, slot: int, kind: str, t0: float) -> None:
        t1 = time.monotonic()
        with self.lock:
            self.ops[name] += 1
            self.done.append(t1)
            if kind:
                self.successes.append((t0, t1, slot, kind))

    def error(self, where: str, e: BaseException) -> None:
        with self.lock:
            if isinstance(e, RaykvError):
                self.errors[type(e).__name__] += 1
                seen = self.samples.setdefault(type(e).__name__, [])
                if len(seen) < 4:
                    seen.append(f"{where}: {e}"[:300])
            else:
                self.errors["raw:" + type(e).__name__] += 1
                if len(self.raw) < 20:
                    self.raw.append(f"{where}: {type(e).__name__}: {e}"[:600])

    def check(self, where: str, got: torch.Tensor, want: torch.Tensor, served: int = 0) -> None:
        bad = [j for j in range(len(want)) if not torch.equal(got[j], want[j])]
        with self.lock:
            self.checked_blocks += len(want)
            self.served_blocks += served
            self.wrong_blocks += len(bad)
            if bad and len(self.wrong) < 20:
                self.wrong.append(f"{where}: blocks {bad[:8]} of {len(want)} differ")


class Soak:
    """The cluster, the workload's threads and the fault driver of one run."""

    def __init__(self, minutes: float, seed: int, echo: Callable[[str], None]) -> None:
        self.minutes, self.echo = minutes, echo
        self.rng = random.Random(seed)
        self.seed = seed
        self.tally = Tally()
        self.stop = threading.Event()
        self.faults: list[Fault] = []
        self.unfreed: list[tuple[str, str]] = []  # (node, request id) whose free failed
        self.stored: dict[int, list[tuple[str, list[int], int]]] = {0: [], 1: [], 2: []}
        self.bases = [self._tokens(MAX_LEN, 1000 + k) for k in range(8)]
        self.fresh = 0
        self.fresh_lock = threading.Lock()
        self.corrupted = self.caught = 0  # rows flipped, and those a load then caught

    # --- prompts ----------------------------------------------------------------------------

    @staticmethod
    def _tokens(n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 30000, (n,), generator=g).tolist()

    def _prompt(self, rng: random.Random) -> list[int]:
        """A shared base's first 2-24 blocks (so nodes hit each other's KV), then a suffix
        no other prompt has."""
        with self.fresh_lock:
            self.fresh += 1
            n = self.fresh
        base = self.bases[rng.randrange(len(self.bases))]
        return base[: rng.randrange(2, 25) * BLOCK] + self._tokens(
            rng.randrange(1, 48), self.seed * 10**7 + n
        )

    # --- the cluster ------------------------------------------------------------------------

    def start(self, ucx: bool) -> None:
        from ray.cluster_utils import Cluster

        import raykv

        self.ucx = ucx
        self.cluster = Cluster(
            initialize_head=True, head_node_args={**NODE, "include_dashboard": False}
        )
        self.workers = [None, self.cluster.add_node(**NODE), self.cluster.add_node(**NODE)]
        self.nodes = [self.cluster.head_node.node_id, *(w.node_id for w in self.workers[1:])]
        self.kv = raykv.connect(self.cluster.address)
        layers = _layers()
        self.plan = self.kv.add_model(
            MODEL, layers, max_model_len=MAX_LEN, pool_bytes=96 * self._row(layers),
            cpu_bytes=384 * self._row(layers),
        )  # fmt: skip
        self.width = self.plan.gpu_bytes_per_block
        self.echo("waiting for a pool and a tier on every node ...")
        if not self._wait_whole(120.0):
            raise ServiceError("raykv placed no pool and tier on every node within 120 s")

    @staticmethod
    def _row(layers: dict[str, Any]) -> int:
        return 2 * len(layers) * BLOCK * 1 * 16 * 4  # K,V x tokens x heads x dim x float32

    def _members(self) -> list[dict]:
        return self.kv.stats()["members"]

    def _wait_whole(self, bound: float) -> bool:
        """Until every node runs a pool and a tier and the coordinator answers."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            with contextlib.suppress(RaykvError):
                have = {(m["kind"], m["node_id"]) for m in self._members()}
                if all((k, n) in have for n in self.nodes for k in ("pool", "tier")):
                    return True
            time.sleep(0.5)
        return False

    # --- the workload -----------------------------------------------------------------------

    def _driver(self, slot: int) -> None:
        """A Ray driver's client on node ``slot``: one request at a time, start to end."""
        rng, n, kv, bound = random.Random(self.seed * 100 + slot), 0, None, None
        while not self.stop.is_set():
            node = self.nodes[slot]
            if bound != node:
                kv, bound = self.kv.on(node), node
            n += 1
            if not self._cycle(kv, node, slot, f"d{slot}-{n}", self._prompt(rng)):
                self.stop.wait(0.3)  # an outage: do not spin on it

    def _cycle(self, kv: Any, node: str, slot: int, rid: str, ids: list[int]) -> bool:
        t, full = self.tally, len(ids) // BLOCK
        want = expected(ids, full, self.width)
        step, admitted = "lookup", False
        try:
            t0 = time.monotonic()
            kv.lookup(ids)
            t.ok("lookup", slot, "lookup", t0)
            # freed whatever happens from here: an admit whose answer was lost may have held
            step, t0, admitted = "admit", time.monotonic(), True
            if not kv.admit(rid, len(ids), ids):
                admitted = False
                with t.lock:
                    t.refused += 1
                return False
            t.ok("admit", slot, "driver", t0)
            step, t0 = "allocate", time.monotonic()
            table = kv.allocate(rid, len(ids), ids)[0]
            t.ok("allocate", slot, "driver", t0)
            step, t0 = "load", time.monotonic()
            served = kv.load(rid, ids, into=table[:full]).num_tokens // BLOCK
            t.ok("load", slot, "driver", t0)
            if served:
                step, t0 = "read", time.monotonic()
                got = kv.read(table[:served])
                t.ok("read", slot, "driver", t0)
                t.check(f"driver load on slot {slot}", got, want[:served], served)
            if served < full:
                step, t0 = "store", time.monotonic()
                kv.store(rid, table[served:full], want[served:full], offload=_offload(rid))
                t.ok("store", slot, "driver", t0)
            step, t0 = "read", time.monotonic()
            got = kv.read(table[:full])
            t.ok("read", slot, "driver", t0)
            t.check(f"driver read back on slot {slot}", got, want)
            return True
        except Exception as e:  # counted by type: raykv errors expected, anything else raw
            t.error(f"driver {step} on slot {slot}", e)
            return False
        finally:
            if admitted:
                self._free(kv, node, slot, rid)

    def _free(self, kv: Any, node: str, slot: int, rid: str) -> None:
        t0 = time.monotonic()
        try:
            kv.free(rid)
            self.tally.ok("free", slot, "driver", t0)
        except UnknownRequest:  # its pool died with it: nothing left to free
            pass
        except Exception as e:  # freed again at the end, as an engine would retry it
            self.tally.error(f"driver free on slot {slot}", e)
            with self.tally.lock:
                self.unfreed.append((node, rid))

    def _engine(self, slot: int) -> None:
        """An engine attached to node ``slot``'s tier (no Ray in its calls)."""
        from raykv.engine import NodeKV

        rng, nk, eng, bound = random.Random(self.seed * 100 + 50 + slot), None, None, None
        try:
            while not self.stop.is_set():
                node = self.nodes[slot]
                try:
                    if bound != node:  # the node was replaced: its agent is another socket
                        _close(nk, eng)
                        nk, eng, bound = NodeKV.open(node_id=node), None, node
                    if eng is None:
                        nk.use(MODEL)
                        eng = nk.attach(num_blocks=ENGINE_BLOCKS)
                except Exception as e:
                    self.tally.error(f"engine open on slot {slot}", e)
                    self.stop.wait(0.5)
                    continue
                if not self._engine_cycle(nk, eng, slot, node, self._prompt(rng)):
                    self.stop.wait(0.3)
        finally:
            _close(nk, eng)

    def _engine_cycle(self, nk: Any, eng: Any, slot: int, node: str, ids: list[int]) -> bool:
        from raykv import ops

        t, full = self.tally, len(ids) // BLOCK
        want = expected(ids, full, self.width)
        entries = eng.kv.entries(eng.plan.groups[0].group_id)
        first = list(range(1, full + 1))
        again = list(range(full + 1, 2 * full + 1))

        def rows(blocks: list[int]) -> torch.Tensor:
            out = torch.empty((len(blocks), self.width), dtype=torch.uint8)
            ops.gather_blocks(entries, torch.tensor(blocks), out)
            return out

        step = "lookup"
        try:
            t0 = time.monotonic()
            hit = nk.lookup(ids)
            t.ok("engine_lookup", slot, "", t0)
            if hit.hit_tokens > hit.tier_tokens:  # other nodes hold more: the tier pulls it
                step, t0 = "pull", time.monotonic()
                eng.pull(ids, hit.hit_tokens // BLOCK)
                t.ok("pull", slot, "engine", t0)
            step, t0 = "load_into", time.monotonic()
            loaded = eng.load_into(ids, first) // BLOCK
            t.ok("load_into", slot, "engine", t0)
            if loaded:
                t.check(f"engine load on slot {slot}", rows(first[:loaded]), want[:loaded], loaded)
            if loaded < full:
                ops.scatter_blocks(want[loaded:], entries, torch.tensor(first[loaded:]))
            step, t0 = "store_from", time.monotonic()
            eng.store_from(ids, first)
            t.ok("store_from", slot, "engine", t0)
            with t.lock:
                self.stored[slot] = [*self.stored[slot][-15:], (node, ids, full)]
            step, t0 = "load_into", time.monotonic()
            back = eng.load_into(ids, again) // BLOCK
            t.ok("load_into", slot, "engine", t0)
            if back:
                t.check(f"engine read back on slot {slot}", rows(again[:back]), want[:back])
            return True
        except Exception as e:  # counted by type: raykv errors expected, anything else raw
            t.error(f"engine {step} on slot {slot}", e)
            return False

    # --- the faults -------------------------------------------------------------------------

    def _faults(self, every_s: float, until: float) -> None:
        """Faults until ``until``, in this (the main) thread: Ray's cluster_utils adds and
        removes nodes with signal handlers, which only the main thread may set."""
        kinds = [k for k in KINDS if k != "ucx_peer" or self.ucx]
        queue: list[str] = []
        while True:
            pause = self.rng.uniform(0.6, 1.4) * every_s
            if time.monotonic() + pause >= until:
                time.sleep(max(0.0, until - time.monotonic()))
                return
            time.sleep(pause)
            if not queue:  # shuffled rounds: every kind comes up in a short soak
                queue = self.rng.sample(kinds, len(kinds))
            kind = queue.pop()
            slot = self.rng.choice((1, 2) if kind == "node" else (0, 1, 2))
            at = time.monotonic()
            try:
                detail = getattr(self, f"_fault_{kind}")(slot)
            except Exception as e:  # the fault could not be made: said, not counted as one
                self.echo(f"  fault {kind} on slot {slot} not made: {type(e).__name__}: {e}")
                continue
            if detail is None:
                self.echo(f"  {kind:<12} slot {slot}  nothing to hit there now: skipped")
                continue
            self.faults.append(Fault(kind, slot, at, time.monotonic(), detail))
            self.echo(f"  {kind:<12} slot {slot}  {detail}")

    def _kill(self, name: str, restart: bool = False) -> str:
        """Kill actor ``name`` (Ray restarts it if ``restart``); return once its process is
        gone."""
        _kill_now(*self._process(name), restart=restart)
        return f"killed {name}"

    @staticmethod
    def _process(name: str) -> tuple[Any, int]:
        """Actor ``name``'s handle and pid (every member runs on this host)."""
        import ray

        from raykv.service.served import NAMESPACE

        handle = ray.get_actor(name, namespace=NAMESPACE)
        # Ray's own actor table (there is no dashboard, so no public state API)
        return handle, ray._private.state.actors(handle._actor_id.hex())["Pid"]

    def _fault_pool(self, slot: int) -> str:
        from raykv.service.served import pool_name

        return self._kill(pool_name(MODEL, self.nodes[slot], 0))

    def _fault_tier(self, slot: int) -> str:
        from raykv.service.served import tier_name

        return self._kill(tier_name(self.nodes[slot]))

    def _fault_coordinator(self, slot: int) -> str:
        from raykv.service.served import COORDINATOR

        return self._kill(COORDINATOR, restart=True)  # as when its process crashes

    def _fault_node(self, slot: int) -> str:
        old = self.nodes[slot]
        self.cluster.remove_node(self.workers[slot])
        for attempt in range(3):  # a loaded host may time a raylet's start out: try again
            try:
                self.workers[slot] = self.cluster.add_node(**NODE)
                break
            except Exception as e:
                self.echo(f"  adding a node failed ({type(e).__name__}: {e}); again")
                if attempt == 2:
                    raise
        self.nodes[slot] = self.workers[slot].node_id
        return f"node {old[:8]} removed, {self.nodes[slot][:8]} added"

    def _fault_ucx_peer(self, slot: int) -> str | None:
        """Blocks only ``slot``'s tier holds, pulled by another node's tier over UCX while
        ``slot``'s tier is killed: the pull is whole, a miss or an error, never wrong KV. A
        first pull of other such blocks, not killed, times one (and opens the UCX route);
        the kill lands at a random point of the second's expected span."""
        from raykv import ops
        from raykv.service.served import tier_name

        other = self.rng.choice([s for s in (0, 1, 2) if s != slot])
        with self.fresh_lock:
            self.fresh += 2
            base = self.seed * 10**7 + 5 * 10**6 + self.fresh
        prompts = [self._tokens(MAX_LEN - BLOCK + 1, base + k) for k in (0, 1)]
        full = len(prompts[0]) // BLOCK
        blocks = list(range(1, full + 1))
        victim = tier_name(self.nodes[slot])
        with self._engine_on(slot, full) as src, self._engine_on(other, full) as dst:
            gid = self.plan.groups[0].group_id
            for ids in prompts:
                rows = expected(ids, full, self.width)
                ops.scatter_blocks(rows, src.kv.entries(gid), torch.tensor(blocks))
                if src.store_from(ids, blocks) < full:
                    return None  # no room there now: no fault made
            src.flush()
            for ids in prompts:
                self._until_known(other, ids, full * BLOCK)
            t0 = time.monotonic()
            first = dst.pull(prompts[0], full)[0]
            took = time.monotonic() - t0
            handle, pid = self._process(victim)
            delay = self.rng.uniform(0.2, 1.0) * took
            with ThreadPoolExecutor(1) as pool:
                pulling = pool.submit(dst.pull, prompts[1], full)
                time.sleep(delay)
                _kill_now(handle, pid)
                try:
                    got = f"{pulling.result()[0]}/{full} pulled"
                except Exception as e:
                    self.tally.error(f"ucx pull from slot {slot}", e)
                    got = f"the pull failed: {type(e).__name__}"
            loaded = self._load_checked(dst, prompts[1], full, f"ucx pull from slot {slot}")
        return (
            f"killed {victim} {delay * 1e3:.0f} ms into a pull (one unkilled: {first}/{full} in "
            f"{took * 1e3:.0f} ms): {got}, {loaded} loaded, verified"
        )

    def _until_known(self, slot: int, ids: list[int], tokens: int) -> None:
        """Until node ``slot``'s lookup hits ``tokens`` of ``ids`` (its replica follows the
        coordinator's feed, so the coordinator, whom a pull asks, knows them), at most 10 s."""
        from raykv.engine import NodeKV

        nk = NodeKV.open(node_id=self.nodes[slot])
        try:
            nk.use(MODEL)
            deadline = time.monotonic() + 10
            while nk.lookup(ids).hit_tokens < tokens and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            nk.close()

    def _fault_corrupt(self, slot: int) -> str | None:
        """One bit of a row the tier of ``slot`` holds, flipped while leased (so the row is
        the entry named): the next load of it must be a miss, never those bytes."""
        import ray

        from raykv.blocks import BlockHasher
        from raykv.service.groups import group_keys
        from raykv.service.served import NAMESPACE, tier_name
        from raykv.tiers import shm

        tier = ray.get_actor(tier_name(self.nodes[slot]), namespace=NAMESPACE)

        def caught() -> int:
            stats = ray.get(tier.snapshot.remote(), timeout=30)["stats"]
            return stats["per_model"][MODEL]["checksum_errors"]

        with self.tally.lock:  # newest first: the likeliest to be held still
            mine = [s for s in self.stored[slot][::-1] if s[0] == self.nodes[slot]]
        hasher = BlockHasher(self.plan.hash_block_size)
        for _, ids, full in mine:
            before = caught()
            keys = group_keys(self.plan, hasher.hash_blocks(ids))[0][:full]
            spec, lease, chosen = ray.get(tier.lease.remote(MODEL, keys), timeout=30)
            if lease is not None and chosen:
                break
            if lease is not None:
                ray.get(tier.apply.remote(MODEL, [("finish_load", lease, 0)]), timeout=30)
        else:
            return None
        try:
            j = self.rng.randrange(len(chosen))
            e, sub = chosen[j]
            row = lease.blocks[e] * max(1, self.plan.block_size_factor) + sub
            arena = shm.attach(spec)
            col = self.rng.randrange(arena.shape[-1])
            arena[0, row, col] ^= 1 << self.rng.randrange(8)
            del arena
        finally:
            ray.get(tier.apply.remote(MODEL, [("finish_load", lease, 0)]), timeout=30)
        # load it at once (the workload may take a while to ask for this prompt again)
        with self._engine_on(slot, full) as eng:
            loaded = self._load_checked(eng, ids, full, f"corrupt row on slot {slot}")
        found = caught() - before
        with self.tally.lock:
            self.corrupted += 1
            self.caught += found > 0
        return (
            f"flipped a bit of block {j} of a {full}-block prompt; a load then got {loaded} "
            f"blocks, verified; checksum errors there +{found}"
        )

    @contextlib.contextmanager
    def _engine_on(self, slot: int, blocks: int) -> Iterator[Any]:
        """A short-lived engine of node ``slot`` with ``blocks`` blocks of its own."""
        from raykv.engine import NodeKV

        nk, eng = NodeKV.open(node_id=self.nodes[slot]), None
        try:
            nk.use(MODEL)
            eng = nk.attach(num_blocks=blocks + 1)
            yield eng
        finally:
            _close(nk, eng)

    def _load_checked(self, eng: Any, ids: list[int], full: int, where: str) -> int:
        """``load_into`` the engine's blocks 1..full, every loaded byte checked."""
        from raykv import ops

        blocks = list(range(1, full + 1))
        loaded = eng.load_into(ids, blocks) // BLOCK
        if loaded:
            out = torch.empty((loaded, self.width), dtype=torch.uint8)
            gid = self.plan.groups[0].group_id
            ops.gather_blocks(eng.kv.entries(gid), torch.tensor(blocks[:loaded]), out)
            want = expected(ids, loaded, self.width)
            self.tally.check(where, out, want, loaded)
        return loaded

    # --- the run ----------------------------------------------------------------------------

    def soak(self, every_s: float) -> None:
        self.t_start = time.monotonic()
        threads = [
            threading.Thread(target=f, args=(s,), name=f"{f.__name__}-{s}", daemon=True)
            for s in (0, 1, 2)
            for f in (self._driver, self._engine)
        ]
        for th in threads:
            th.start()
        self._faults(every_s, self.t_start + self.minutes * 60)
        self.stop.set()
        self.t_end = time.monotonic()
        for th in threads:
            th.join(180)
        self.hung = [th.name for th in threads if th.is_alive()]

    def leaks(self) -> dict[str, Any]:
        """Every request freed and every engine closed: what the pools and tiers still hold,
        after the service has had ``SETTLE_S`` to place its members again and a few
        seconds to settle (leases of dead holders end at once, others at their deadline)."""
        import ray

        from raykv.service.served import NAMESPACE

        whole = self._wait_whole(SETTLE_S)
        for node, rid in self.unfreed:
            with contextlib.suppress(RaykvError):  # gone with its pool or node: freed
                self.kv.on(node).free(rid)
        deadline = time.monotonic() + 20
        while True:
            out = {"pool_blocks": 0, "pool_requests": 0, "tier_leases": 0, "members": 0}
            for m in self._members():
                actor = ray.get_actor(m["name"], namespace=NAMESPACE)
                try:
                    s = ray.get(actor.snapshot.remote(), timeout=30)["stats"]
                except ray.exceptions.RayError:
                    continue
                out["members"] += 1
                if m["kind"] == "pool":
                    out["pool_blocks"] += s["blocks_used"]
                    out["pool_requests"] += s["requests"]
                else:
                    out["tier_leases"] += s["leases_held"]
            leaked = out["pool_blocks"] + out["pool_requests"] + out["tier_leases"]
            if not leaked or time.monotonic() > deadline:
                return out | {"service_whole": whole}
            time.sleep(1.0)

    def report(self, leaks: dict[str, Any]) -> dict[str, Any]:
        t = self.tally
        for f in self.faults:
            kinds, on_node = RECOVERED_BY[f.kind]
            # calls that started once the member was dead (a node: the fresh one added)
            firsts = [
                end
                for start, end, slot, kind in t.successes
                if kind in kinds and start >= f.back and (not on_node or slot == f.slot)
            ]
            f.recovered = min(firsts) - f.at if firsts else None
        windows = []
        for i, f in enumerate(self.faults):  # a fault lasts until recovered (or the next)
            nxt = self.faults[i + 1].at if i + 1 < len(self.faults) else self.t_end
            windows.append((f.at, f.at + f.recovered if f.recovered is not None else nxt))
        during_s, during_ops = _union(windows, self.t_start, self.t_end, t.done)
        total_s = self.t_end - self.t_start
        total_ops = sum(1 for d in t.done if d <= self.t_end)
        by_kind: dict[str, Any] = {}
        for k in KINDS:
            fs = [f for f in self.faults if f.kind == k]
            rec = [f.recovered for f in fs if f.recovered is not None]
            by_kind[k] = {
                "count": len(fs),
                "unrecovered": len(fs) - len(rec),
                "recovery_p50_s": percentile(rec, 0.5),
                "recovery_p99_s": percentile(rec, 0.99),
            }
        checksum_errors = None
        with contextlib.suppress(RaykvError):
            checksum_errors = self.kv.stats().get("checksum_errors")
        raw = sum(v for k, v in t.errors.items() if k.startswith("raw:"))
        return {
            "machine": machine(),
            "minutes": self.minutes,
            "ucx": self.ucx,
            "operations": dict(sorted(t.ops.items())),
            "operations_total": sum(t.ops.values()),
            "admits_refused": t.refused,
            "errors": dict(sorted(t.errors.items())),
            "raw_errors": raw,
            "raw_samples": t.raw,
            "error_samples": t.samples,
            "wrong_kv": t.wrong_blocks,
            "wrong_samples": t.wrong,
            "checked_blocks": t.checked_blocks,
            "served_blocks": t.served_blocks,
            "checksum_errors": checksum_errors,
            "corrupted_rows": self.corrupted,
            "corruptions_caught": self.caught,
            "faults": by_kind,
            "fault_log": [
                {
                    "kind": f.kind,
                    "slot": f.slot,
                    "at_s": round(f.at - self.t_start, 2),
                    "recovered_s": f.recovered,
                    "detail": f.detail,
                }
                for f in self.faults
            ],
            "throughput": {
                "during_faults_ops_per_s": during_ops / during_s if during_s else None,
                "outside_faults_ops_per_s": (
                    (total_ops - during_ops) / (total_s - during_s) if total_s > during_s else None
                ),
                "during_faults_s": during_s,
                "outside_faults_s": total_s - during_s,
            },
            "leaks": leaks,
            "leaked": leaks["pool_blocks"] + leaks["pool_requests"] + leaks["tier_leases"],
            "hung_threads": self.hung,
        }


def _offload(rid: str) -> bool:
    """Every other driver store offloads to the CPU tier too (by request number)."""
    return int(rid.rsplit("-", 1)[1]) % 2 == 0


def _kill_now(handle: Any, pid: int, restart: bool = False) -> None:
    """``ray.kill``, then wait (30 s at most) until the process is gone: the kill is
    asynchronous and the actor is reported dead before its process exits, so calls it
    answers until then must not count as recovered."""
    import ray

    ray.kill(handle, no_restart=not restart)
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _close(nk: Any, eng: Any) -> None:
    if eng is not None:
        eng.close()
    if nk is not None:
        nk.close()


def _union(
    windows: list[tuple[float, float]], lo: float, hi: float, done: list[float]
) -> tuple[float, int]:
    """Seconds of [lo, hi] inside any window, and how many ``done`` times fall there."""
    merged: list[list[float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in windows):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    inside = sum(1 for d in done if any(a <= d <= b for a, b in merged))
    return sum(b - a for a, b in merged), inside


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), cpu)
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run(
    minutes: float,
    every_s: float = 6.0,
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The soak: ``minutes`` of workload under a fault every ``every_s`` seconds (0.6-1.4x)."""
    try:
        import ucxx  # noqa: F401

        ucx = True
    except ImportError:
        ucx = False
    agents = tempfile.mkdtemp(prefix="raykv-chaos-agents-")
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", AGENT_DIR_ENV: agents}
    began = time.monotonic()

    def say(msg: str) -> None:  # the run's clock on every line: where a slow run spends it
        echo(f"[{time.monotonic() - began:5.0f}s] {msg}")

    with environment(env | (UCX_ENV if ucx else {})):
        import ray

        soak = Soak(minutes, seed, say)
        say(f"starting a 3-node local Ray cluster on 127.0.0.1 (UCX {'on' if ucx else 'off'}) ...")
        try:
            soak.start(ucx)
            say(f"soaking {minutes:g} min, a fault every ~{every_s:g}s ...")
            soak.soak(every_s)
            say("freeing everything, closing engines, letting the service settle ...")
            leaks = soak.leaks()
            say("done; stopping the cluster ...")
            return soak.report(leaks)
        finally:
            ray.shutdown()
            if hasattr(soak, "cluster"):
                soak.cluster.shutdown()
            shutil.rmtree(agents, ignore_errors=True)


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"chaos soak: {r['minutes']:g} min on {m['cpus']} cores ({m['cpu']}), {m['date']}, "
        f"UCX {'on' if r['ucx'] else 'off'}",
        f"operations       {r['operations_total']}  "
        + ", ".join(f"{k} {v}" for k, v in r["operations"].items()),
        f"errors           {sum(r['errors'].values())}  "
        + (", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"),
        f"raw errors       {r['raw_errors']}  (must be 0)",
        f"wrong KV         {r['wrong_kv']}  (must be 0) of {r['checked_blocks']} blocks checked, "
        f"{r['served_blocks']} served from other copies",
        f"corrupt rows     {r['corrupted_rows']} flipped, {r['corruptions_caught']} counted by "
        f"their tier at the next load; checksum_errors of the members alive at the end "
        f"{r['checksum_errors']} (a replaced member's count goes with it)",
        f"leaked           {r['leaked']}  (must be 0): pool blocks {r['leaks']['pool_blocks']}, "
        f"requests {r['leaks']['pool_requests']}, tier leases {r['leaks']['tier_leases']}",
        "",
        f"{'fault':<14}{'count':>6}{'p50 s':>9}{'p99 s':>9}{'not back by the end':>21}",
    ]
    for k, f in r["faults"].items():
        p50, p99 = _num(f["recovery_p50_s"], 2), _num(f["recovery_p99_s"], 2)
        lines.append(f"{k:<14}{f['count']:>6}{p50:>9}{p99:>9}{f['unrecovered']:>21}")
    tp = r["throughput"]
    lines += [
        "",
        f"throughput: {_num(tp['during_faults_ops_per_s'])} ops/s during faults "
        f"({tp['during_faults_s']:.0f}s), {_num(tp['outside_faults_ops_per_s'])} ops/s outside "
        f"({tp['outside_faults_s']:.0f}s)",
    ]
    for label, key in (("raw", "raw_samples"), ("wrong", "wrong_samples")):
        lines += [f"  {label}: {s}" for s in r[key]]
    if r["hung_threads"]:
        lines.append(f"hung threads: {r['hung_threads']}")
    return "\n".join(lines)


def failures(r: dict[str, Any]) -> list[str]:
    """What must be 0 and is not."""
    out = [f"{k} {r[k]}" for k in ("wrong_kv", "raw_errors", "leaked") if r[k]]
    if r["hung_threads"]:
        out.append(f"hung threads {r['hung_threads']}")
    return out


def main(minutes: float, as_json: bool = False, every_s: float = 6.0, seed: int = 0) -> list[str]:
    import click

    r = run(minutes, every_s=every_s, seed=seed, echo=lambda s: click.echo(s, err=True))
    click.echo(json.dumps(r, indent=2) if as_json else format_report(r))
    return failures(r)
