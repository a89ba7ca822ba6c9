"""``ServedEngine``: a vLLM engine's model on its node's raykv, for both connector roles.

The scheduler role (``raykv.integrations.vllm.scheduler``) looks up through it and the worker
role (``raykv.integrations.vllm.worker``) attaches through it; ``RaykvConnector`` makes one per
engine process. It opens the node agent (``agent_path``: never a Ray driver, Ray is never
started or joined here) and serves the model that matches the engine's KV layout
(``model.engine_layout``) whenever the agent answers, at startup and on every reconnection.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raykv.blocks.hashing import Tenant
from raykv.engine.agent import AgentUnavailable
from raykv.engine.node import EngineLookup, NodeKV
from raykv.errors import RaykvError, ServiceError
from raykv.integrations.vllm.config import RaykvVllmConfig
from raykv.integrations.vllm.model import check_groups, engine_layout, model_name, rank_models
from raykv.service.node.agent_protocol import default_socket, socket_path
from raykv.service.served import NAMESPACE

log = logging.getLogger(__name__)


def agent_path(config: RaykvVllmConfig) -> Path:
    """The node agent this engine talks to: ``config.agent``; else, in a process that is
    already a Ray worker (an engine started as a Ray actor), its Ray node's; else the
    host's default one. Ray is never started or joined here."""
    if config.agent:
        return Path(config.agent)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return socket_path(config.namespace, ray.get_runtime_context().get_node_id())
    return default_socket(config.namespace)


def bound_to_node(extra: Mapping[str, Any], node_id: str) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` bound to the node agent of Ray node
    ``node_id``: for an engine whose connector runs in processes that are no Ray workers (a
    Serve replica's engine core, a tensor-parallel engine's workers), which would otherwise
    open the host's default agent (another node's where one host runs several raylets). A
    config that names its agent keeps it."""
    out = dict(extra)
    if not out.get("agent"):
        out["agent"] = str(socket_path(out.get("namespace", NAMESPACE), node_id))
    return out


class ServedEngine:
    """The engine's model on its node's raykv (``raykv.engine.NodeKV``), served whenever
    the node agent answers: at startup, and on every reconnection (a service started
    afresh knows no model; ``add_model`` of a model served already changes nothing), on the
    reconnecting thread, never on the engine's. Until then the engine runs without the
    cache. ``ready()`` says whether lookups, loads and saves go to raykv now.

    A tensor-parallel engine has a model per rank (``rank_models``); ``ranks`` are those
    this process serves: a worker its own rank's (``node``), the scheduler every rank's
    (``lookup`` counts what all of them hold). One ``NodeKV`` per model: a handle serves one."""

    def __init__(
        self,
        config: RaykvVllmConfig,
        vllm_config: Any,
        kv_cache_config: Any,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.layout = layout = engine_layout(vllm_config, kv_cache_config)
        names = rank_models(config.model or model_name(vllm_config, layout), layout.tp_size)
        self.names = names if ranks is None else tuple(names[r] for r in ranks)
        per_token = sum(s.page_bytes(layout.block_size) for s in layout.layers.values())
        per_token //= layout.block_size
        # served without pools (a pool would take the engine's GPU); these bytes only size
        # the plan, which needs room for one max_model_len request
        self.plan_bytes = per_token * (layout.max_model_len + 2 * layout.block_size) * 2
        self.groups: tuple[int, ...] | None = None  # vLLM group -> raykv group, once served
        self._lock = threading.Lock()
        path = agent_path(config)
        self.nodes = tuple(NodeKV.open(config.namespace, path) for _ in self.names)
        self.node = self.nodes[0]
        # per model, the agent connection (its Welcome) the model is served on
        self._served_for: list[Any] = [None] * len(self.nodes)
        for i, node in enumerate(self.nodes):
            reconnected = node.agent.on_up
            node.agent.on_up = lambda welcome, i=i, reconnected=reconnected: (
                reconnected(welcome), self._serve(i, welcome))  # fmt: skip
            if node.up:
                self._serve(i, node.agent.welcome, startup=True)
        if not self.ready():
            why = f"no raykv service answers on this node (no node agent at {path})"
            if config.required:
                raise ServiceError(
                    f"{why}; start it with `raykv up` before the engine, or set "
                    "kv_connector_extra_config required=False to run without it"
                )
            log.warning("%s: the engine runs without the cache and uses it once it answers "
                        "(start it with `raykv up`)", why)  # fmt: skip

    def ready(self) -> bool:
        return all(
            node.up and served is node.agent.welcome
            for node, served in zip(self.nodes, self._served_for, strict=True)
        )

    def lookup(self, token_ids: Sequence[int], held_tokens: int = 0, tenant: Tenant = None
               ) -> EngineLookup:  # fmt: skip
        """``NodeKV.lookup`` of every model served here: the tokens all of them hold (a
        tensor-parallel engine loads a block only where every rank's copy is there). The
        ranks' models share one plan: the prompt is hashed once for all of them."""
        if len(self.nodes) == 1:
            return self.node.lookup(token_ids, held_tokens, tenant)
        hashes = self.node.prompt_hashes(token_ids, tenant) if self.node.up else None
        found = [node.lookup(token_ids, held_tokens, tenant, hashes=hashes) for node in self.nodes]
        return EngineLookup(min(f.hit_tokens for f in found),
                            min(f.tier_tokens for f in found), found[0].num_tokens)  # fmt: skip

    def _serve(self, i: int, welcome: Any, startup: bool = False) -> None:
        """Serve model ``i`` on the connection ``welcome`` greeted. At startup a refusal (a
        ConfigError: another model under this name) ends the engine's start; later it is
        logged and the engine runs without the cache."""
        layout, node, name = self.layout, self.nodes[i], self.names[i]
        with self._lock:
            try:
                plan = node.serve(
                    name,
                    layout.layers,
                    max_model_len=layout.max_model_len,
                    max_num_batched_tokens=layout.max_num_batched_tokens,
                    block_size=layout.block_size,
                    pool_bytes=self.plan_bytes,
                    pools=False,
                    cpu_bytes=self.config.cpu_bytes,
                )
            except AgentUnavailable:
                return  # gone again: the next reconnection serves it
            except RaykvError as e:
                if startup:
                    raise
                log.error("raykv refused the engine's model %s (%s): running without the "
                          "cache", name, e)  # fmt: skip
                return
            self.groups = check_groups(plan, layout)
            self._served_for[i] = welcome

    def close(self) -> None:
        for node in self.nodes:
            node.close()
