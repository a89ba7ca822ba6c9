"""``NodeKV``: an engine's handle on its node's raykv, with no Ray in the engine's process.

    node = NodeKV.open()                          # this host's node agent (raykv up)
    plan = node.serve("tiny", layers, max_model_len=4096)
    hit = node.lookup(prompt)                     # from the node's index replica: no round trip
    kv = node.attach(engine_tensors, num_blocks=n)
    kv.store_from(prompt, block_ids); kv.load_into(prompt, block_ids)

Lookups read the node's prefix index replica (``raykv.service.node.replica``) in shared memory
and tell apart blocks this node's CPU tier holds (a load copies them at once) from blocks
held elsewhere (the tier pulls them first). A request of a tenant (``tenant_key``: a cache
salt, a LoRA adapter) looks up, stores and loads its prompt under that tenant's keys
(``tenant=``). Lookups are counted at the agent per tenant, in messages that are not waited
for, at most every ``COUNT_S`` (``EngineCounts``). While the agent is unreachable
(``NodeAgent``'s breaker is open) every lookup is a miss, answered at once, and every store
or load fails fast: the engine computes, and nothing in it waits for the cache to come back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raykv.api import token_id_array
from raykv.blocks.hashing import BlockHasher, Tenant, build_native
from raykv.engine.agent import EngineCounts, NodeAgent
from raykv.engine.attached import AttachedKV
from raykv.errors import RaykvError
from raykv.service.groups import common_hit, managers, needed_slots
from raykv.service.node import agent_protocol as p
from raykv.service.node.replica import LOCAL_TIER, ReplicaReader
from raykv.service.served import NAMESPACE, ServedModel, served_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLookup:
    """A lookup's answer: ``hit_tokens`` (whole blocks, at most ``num_tokens - 1``) that
    some member holds, of which the node's CPU tier holds the first ``tier_tokens``."""

    hit_tokens: int
    tier_tokens: int
    num_tokens: int

    @property
    def local(self) -> bool:
        """The node's tier holds the whole hit: a load copies it without a pull."""
        return self.tier_tokens >= self.hit_tokens


MISS = EngineLookup(0, 0, 0)


class _HeldSlots:
    """One group's replica flags of one request, asked as ``common_hit`` asks a manager
    (``longest_hit``); the base rule (leading slots held) is one numpy scan."""

    def __init__(self, held: np.ndarray, manager: Any) -> None:
        self.held, self.manager = held, manager

    def __call__(self, j: int) -> int | None:
        return 1 if j < len(self.held) and self.held[j] else None

    def longest_hit(self, lookup: Any, limit: int) -> int:
        from raykv.blocks.managers.base import GroupManager

        m = self.manager
        if type(m).longest_hit is GroupManager.longest_hit:
            run = int(np.argmin(self.held)) if not self.held.all() else len(self.held)
            return min(run, limit // m.block_size) * m.block_size
        return m.longest_hit(self, limit)


class NodeKV:
    """See the module docstring. ``open`` finds the agent; one handle serves one model."""

    def __init__(self, agent: NodeAgent, namespace: str = NAMESPACE) -> None:
        self.agent, self.namespace = agent, namespace
        self.model: ServedModel | None = None
        self.plan: Any = None
        self._managers: tuple = ()  # the plan's group managers (their hit rules)
        self._hasher: BlockHasher | None = None
        self.counts = EngineCounts(agent)
        build_native(wait=False)  # the native hashing, built or loaded off the lookup's path
        self._replica: ReplicaReader | None = None
        self._replica_lock = threading.Lock()
        self._stale = True  # map the replica again (the agent was (re)connected)
        agent.on_up = self._agent_up

    @classmethod
    def open(
        cls, namespace: str = NAMESPACE, path: str | Path | None = None, node_id: str | None = None
    ) -> NodeKV:
        """The handle on the agent at ``path``, else node ``node_id``'s, else this host's
        default one. It connects now; if nothing answers, calls fail fast (``up`` is False)
        and a background thread keeps trying."""
        if path is None:
            path = p.socket_path(namespace, node_id) if node_id else p.default_socket(namespace)
        node = cls(NodeAgent(Path(path)), namespace)
        node.agent.connect()
        return node

    @property
    def up(self) -> bool:
        return self.agent.up

    def _agent_up(self, welcome: p.Welcome) -> None:
        self._stale = True

    # --- the model ------------------------------------------------------------------------

    def serve(
        self, name: str, layers: Mapping[str, Any], *, max_model_len: int, **settings: Any
    ) -> Any:
        """Serve ``name`` (``Client.add_model``'s settings) and use it; returns its plan."""
        model = served_model(name, layers, max_model_len, settings)  # checks them here
        plan = self.agent.call(p.AddModel(name, dict(layers), max_model_len, settings), 120.0)
        self.model, self.plan, self._managers = model, plan, managers(plan)
        self._hasher = BlockHasher(plan.hash_block_size)
        return plan

    def use(self, name: str | None = None) -> Any:
        """Use the served model ``name`` (None: the only one); returns its plan."""
        self.model, self.plan = self.agent.call(p.GetModel(name), 30.0)
        self._managers = managers(self.plan)
        self._hasher = BlockHasher(self.plan.hash_block_size)
        return self.plan

    def _need_model(self) -> tuple[ServedModel, Any]:
        if self.model is None:
            self.use(None)
        return self.model, self.plan

    # --- lookups --------------------------------------------------------------------------

    def _reader(self) -> ReplicaReader | None:
        with self._replica_lock:
            if self._stale or self._replica is None:
                self._stale = False
                old, self._replica = self._replica, None
                if old is not None:
                    old.close()
                spec = self.agent.call(p.Replica(self.model.name))
                self._replica = ReplicaReader(spec) if spec is not None else None
                self._stale = spec is None  # the node's tier has no arena of it yet: ask again
            return self._replica

    def prompt_hashes(self, token_ids: Sequence[int], tenant: Tenant = None) -> bytes:
        """The joined block hashes ``lookup`` probes for ``tenant``'s prompt ``token_ids``
        (its whole blocks before the last token), the ids checked as they are hashed."""
        _, plan = self._need_model()
        end = max(len(token_ids) - 1, 0) // plan.hash_block_size
        return self._hasher.hash_blocks_joined(token_ids, end_block=end, tenant=tenant)

    def lookup(
        self,
        token_ids: Sequence[int],
        held_tokens: int = 0,
        tenant: Tenant = None,
        *,
        hashes: bytes | None = None,
    ) -> EngineLookup:
        """The leading tokens of ``tenant``'s prompt ``token_ids`` (whole blocks, at most all
        but the last token) whose KV this node can get; a miss while the agent is
        unreachable. ``held_tokens``: the engine holds that many leading tokens already (its
        own prefix cache): they count as held wherever they are. ``hashes``: the prompt's
        ``prompt_hashes`` where the caller has them (a lookup of the same prompt in another
        model of the same plan: a tensor-parallel engine's ranks), not hashed again."""
        if not self.agent.up:
            return MISS
        model, plan = self._need_model()
        try:
            reader = self._reader()
        except (RaykvError, OSError, ValueError) as e:
            log.warning("raykv: no index replica for %s (%s): a miss", model.name, e)
            self._stale = True
            return MISS
        n = len(token_ids)
        if n > plan.max_model_len:  # raises, naming the limit
            token_id_array(token_ids, plan.max_model_len, model.name)
        limit = max(n - 1, 0)
        hbs = plan.hash_block_size
        if reader is None or limit < hbs:
            return EngineLookup(0, 0, n)
        # the hasher reads and checks the ids as it hashes them (one native pass)
        blob = hashes if hashes is not None else self.prompt_hashes(token_ids, tenant)
        mgrs = self._managers
        flags, probes = [], []
        for g, m in zip(plan.groups, mgrs, strict=True):
            f = reader.hash_flags(blob, g.group_id, g.block_size // hbs)
            held = f != 0
            held[: held_tokens // g.block_size] = True  # the engine's own blocks
            flags.append(f)
            probes.append(_HeldSlots(held, m))
        cap = min(
            limit, min(len(f) * g.block_size for f, g in zip(flags, plan.groups, strict=True))
        )
        hit = common_hit(probes, lambda gi, j: probes[gi](j) is not None, cap)
        tier = hit
        for f, g, m in zip(flags, plan.groups, mgrs, strict=True):
            slots = needed_slots(m, hit)
            first = max(slots.start, held_tokens // g.block_size)
            not_here = np.flatnonzero((f[first : slots.stop] & LOCAL_TIER) == 0)
            if len(not_here):
                tier = min(tier, (first + int(not_here[0])) * g.block_size)
        looked = cap // plan.groups[0].block_size
        got = hit // plan.groups[0].block_size
        self.counts.add(model.name, tenant, lookups=1, hit_blocks=got, miss_blocks=looked - got)
        return EngineLookup(hit, tier, n)

    # --- the data path --------------------------------------------------------------------

    def attach(
        self,
        kv_tensors: Mapping[str, Any] | None = None,
        *,
        num_blocks: int | None = None,
        layout: str = "kv_outer",
        device: str = "cpu",
    ) -> AttachedKV:
        """The engine's paged KV bound to this node's CPU tier (``AttachedKV``)."""
        model, plan = self._need_model()
        return AttachedKV(model.name, plan, self.agent, kv_tensors,
                          num_blocks=num_blocks, layout=layout, device=device)  # fmt: skip

    def close(self) -> None:
        self.counts.flush()
        self.agent.close()
        if self._replica is not None:
            self._replica.close()
