"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

    kv_transfer_config={
        "kv_connector": "RaykvConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 1 << 30},
    }

A request opts out per call with ``SamplingParams(extra_args={"kv_transfer_params":
{"raykv": {"load": False, "store": False}}})``. A request with a cache salt or a LoRA adapter
is cached under its tenant's own keys (``request_tenant``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from raykv.blocks.hashing import Tenant, tenant_key
from raykv.errors import ConfigError
from raykv.service.served import DEFAULT_TIER_BYTES, NAMESPACE


@dataclass(frozen=True)
class RaykvVllmConfig:
    """``agent``: the node agent's socket (None: this node's, found by the namespace; the
    engine is not a Ray driver, see ``raykv.engine``). ``required``: fail at startup when no
    raykv service answers on this node (default: warn once and run without the cache, and
    use it once it answers). ``model``: the raykv model name (None: derived from the vLLM
    model and its KV layout, so only engines whose KV bytes agree share entries).
    ``cpu_bytes``: the CPU tier per node for this model (the service places no pools for
    it: the engine keeps its KV in its own tensors). ``load`` / ``store``: read hits from
    raykv / publish the prompt's full blocks."""

    agent: str | None = None
    namespace: str = NAMESPACE
    required: bool = False
    model: str | None = None
    cpu_bytes: int = DEFAULT_TIER_BYTES
    load: bool = True
    store: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> RaykvVllmConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; raykv reads {sorted(known)}"
            )
        value = extra.get("cpu_bytes")
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(
                "kv_connector_extra_config['cpu_bytes'] must be a positive int of bytes, "
                f"got {value!r}; e.g. cpu_bytes={1 << 30}"
            )
        return cls(**extra)


def not_keyed_by_tokens(request: Any) -> str | None:
    """Why a request's KV is not a function of its token ids and tenant (then raykv, which
    keys blocks by those, must neither load nor store it: the same ids with other images or
    prompt embeddings are different KV, and a hit would be wrong KV); None when it is."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


def request_tenant(request: Any) -> Tenant:
    """The tenant a request's blocks are keyed under (``tenant_key``): its cache salt and its
    LoRA adapter (name and path, as vLLM's own prefix cache keys it); None for neither (the
    plain token-id keys every engine of the model shares). An empty salt is none, as in
    vLLM."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None) or None
    if lora is None:
        return tenant_key(salt)
    return tenant_key(salt, lora.lora_name, lora.lora_path)


def request_flags(
    params: Mapping[str, Any] | None, config: RaykvVllmConfig, request: Any = None
) -> tuple[bool, bool]:
    """(load, store) for one request: the engine's settings, narrowed by its
    ``kv_transfer_params["raykv"]``; neither for a request whose KV is not keyed by its
    token ids and tenant (``not_keyed_by_tokens``)."""
    if request is not None and not_keyed_by_tokens(request):
        return False, False
    mine = (params or {}).get("raykv") or {}
    return (
        config.load and bool(mine.get("load", True)),
        config.store and bool(mine.get("store", True)),
    )
