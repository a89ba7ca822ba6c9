"""One manager per spec kind, behind the ``GroupManager`` interface."""

from __future__ import annotations

from raykv.blocks.managers.base import GroupManager, Lookup
from raykv.blocks.managers.full import FullAttentionManager
from raykv.blocks.managers.local import (
    ChunkedLocalManager,
    LocalAttentionManager,
    SlidingWindowManager,
)
from raykv.blocks.managers.state import CrossAttentionManager, MambaManager
from raykv.errors import ConfigError
from raykv.layout import KVGroup

MANAGERS: dict[str, type[GroupManager]] = {
    kind: cls
    for cls in (
        FullAttentionManager,
        SlidingWindowManager,
        ChunkedLocalManager,
        MambaManager,
        CrossAttentionManager,
    )
    for kind in cls.kinds
}


def manager_for(group: KVGroup) -> GroupManager:
    try:
        cls = MANAGERS[group.spec.kind]
    except KeyError:
        raise ConfigError(
            f"group {group.group_id}: no block manager for spec kind {group.spec.kind!r}; "
            f"known kinds: {sorted(MANAGERS)}"
        ) from None
    return cls(group)


__all__ = [
    "MANAGERS",
    "ChunkedLocalManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "GroupManager",
    "LocalAttentionManager",
    "Lookup",
    "MambaManager",
    "SlidingWindowManager",
    "manager_for",
]
