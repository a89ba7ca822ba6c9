"""raykv's vLLM KV connector: vLLM engines share prefixes through the raykv service.

    LLM(model, kv_transfer_config={"kv_connector": "RaykvConnector",
        "kv_connector_module_path": "raykv.integrations.vllm", "kv_role": "kv_both"})

``config`` (settings), ``model`` (vLLM KV layout -> raykv model), ``served`` (that model on
the node's raykv, for both roles), ``scheduler`` (lookups and per-step plans), ``worker``
(copies through the node's CPU tier), ``connector`` (the class vLLM loads), ``tiny`` (a local
random-weight model for tests and benches). Needs the optional extra ``vllm``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RaykvConnector"]


def __getattr__(name: str) -> Any:
    # imported on first use (vLLM's connector factory does getattr): the package's other
    # modules (engine, tiny, config), which `raykv serve`'s builder and tests use, need no
    # vLLM import
    if name == "RaykvConnector":
        from raykv.integrations.vllm.connector import RaykvConnector

        return RaykvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
