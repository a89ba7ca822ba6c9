"""What the scheduler-side connector tells its workers each step (vLLM pickles it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from raykv.blocks.hashing import Tenant


@dataclass(frozen=True)
class LoadSpec:
    """Fill ``block_ids`` (per raykv group, by position from the prompt's first block)
    with the KV of ``token_ids`` (whole blocks); the first ``skip`` positions per group are
    the engine's own (prefix cache or null) and stay as they are. ``num_tokens``: the tokens
    vLLM counts on (may end mid-block: the last block is loaded whole and vLLM recomputes
    its tail). ``tenant``: the request's (``request_tenant``): the keys it loads are its."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    skip: tuple[int, ...]
    num_tokens: int
    sync: bool = True  # loaded before this step's forward (one KV group); else reported async
    remote: bool = True  # some blocks are on other nodes: pull them to this node's tier first
    tenant: Tenant = None


@dataclass(frozen=True)
class SaveSpec:
    """Publish the full blocks ``block_ids`` (per raykv group) holding ``token_ids``, under
    ``tenant``'s keys."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    tenant: Tenant = None


@dataclass
class RaykvMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()
