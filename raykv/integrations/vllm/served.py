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
from pathlib import Path
from typing import Any

from raykv.engine.agent import AgentUnavailable
from raykv.engine.node import NodeKV
from raykv.errors import RaykvError, ServiceError
from raykv.integrations.vllm.config import RaykvVllmConfig
from raykv.integrations.vllm.model import check_groups, engine_layout, model_name
from raykv.service.node.agent_protocol import default_socket, socket_path

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


class ServedEngine:
    """The engine's model on its node's raykv (``raykv.engine.NodeKV``), served whenever
    the node agent answers: at startup, and on every reconnection (a service started
    afresh knows no model; ``add_model`` of a model served already changes nothing), on the
    reconnecting thread, never on the engine's. Until then the engine runs without the
    cache. ``ready()`` says whether lookups, loads and saves go to raykv now."""

    def __init__(self, config: RaykvVllmConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.config = config
        self.layout = layout = engine_layout(vllm_config, kv_cache_config)
        self.name = config.model or model_name(vllm_config, layout)
        per_token = sum(s.page_bytes(layout.block_size) for s in layout.layers.values())
        per_token //= layout.block_size
        # served without pools (a pool would take the engine's GPU); these bytes only size
        # the plan, which needs room for one max_model_len request
        self.plan_bytes = per_token * (layout.max_model_len + 2 * layout.block_size) * 2
        self.groups: tuple[int, ...] | None = None  # vLLM group -> raykv group, once served
        self._lock = threading.Lock()
        self._served_for: Any = None  # the agent connection (its Welcome) the model is served on
        self.node = NodeKV.open(config.namespace, agent_path(config))
        reconnected = self.node.agent.on_up
        self.node.agent.on_up = lambda welcome: (reconnected(welcome), self._serve(welcome))
        if self.node.up:
            self._serve(self.node.agent.welcome, startup=True)
        if not self.ready():
            why = f"no raykv service answers on this node (no node agent at {self.node.agent.path})"
            if config.required:
                raise ServiceError(
                    f"{why}; start it with `raykv up` before the engine, or set "
                    "kv_connector_extra_config required=False to run without it"
                )
            log.warning("%s: the engine runs without the cache and uses it once it answers "
                        "(start it with `raykv up`)", why)  # fmt: skip

    def ready(self) -> bool:
        return self.node.up and self._served_for is self.node.agent.welcome

    def _serve(self, welcome: Any, startup: bool = False) -> None:
        """Serve the engine's model on the connection ``welcome`` greeted. At startup a
        refusal (a ConfigError: another model under this name) ends the engine's start;
        later it is logged and the engine runs without the cache."""
        layout = self.layout
        with self._lock:
            try:
                plan = self.node.serve(
                    self.name,
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
                          "cache", self.name, e)  # fmt: skip
                return
            self.groups = check_groups(plan, layout)
            self._served_for = welcome
