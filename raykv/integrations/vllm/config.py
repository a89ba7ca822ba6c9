"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

    kv_transfer_config={
        "kv_connector": "RaykvConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "127.0.0.1:6379", "cpu_bytes": 1 << 30},
    }

A request opts out per call with ``SamplingParams(extra_args={"kv_transfer_params":
{"raykv": {"load": False, "store": False}}})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from raykv.errors import ConfigError
from raykv.service.spec import DEFAULT_TIER_BYTES, NAMESPACE


@dataclass(frozen=True)
class RaykvVllmConfig:
    """``address``: the Ray cluster running the raykv service (None: the Ray this process
    joined, else RAY_ADDRESS, else ``raykv up``'s head on this host, else an embedded one).
    ``model``: the raykv model name (None: derived from the vLLM model and its KV layout, so
    only engines whose KV bytes agree share entries). ``cpu_bytes``: the CPU tier per node
    for this model. ``pool_bytes``: the service's own pools for the model (None: one
    ``max_model_len`` request's worth; the engine keeps its KV in its own tensors).
    ``load`` / ``store``: read hits from raykv / publish the prompt's full blocks."""

    address: str | None = None
    namespace: str = NAMESPACE
    model: str | None = None
    cpu_bytes: int = DEFAULT_TIER_BYTES
    pool_bytes: int | None = None
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
        for key in ("cpu_bytes", "pool_bytes"):
            value = extra.get(key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(
                    f"kv_connector_extra_config[{key!r}] must be a positive int of bytes, "
                    f"got {value!r}; e.g. {key}={1 << 30}"
                )
        return cls(**extra)


def request_flags(params: Mapping[str, Any] | None, config: RaykvVllmConfig) -> tuple[bool, bool]:
    """(load, store) for one request: the engine's settings, narrowed by its
    ``kv_transfer_params["raykv"]``."""
    mine = (params or {}).get("raykv") or {}
    return (
        config.load and bool(mine.get("load", True)),
        config.store and bool(mine.get("store", True)),
    )
