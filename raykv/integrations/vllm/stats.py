"""The connector's counters as vLLM's ``KVConnectorStats`` (logged with vLLM's stats).

The worker reports what it moved since the last report (tokens loaded, loads that missed
blocks, entries saved, saves dropped or failed, and each load's microseconds and tokens by
path, ``load_us_<path>`` / ``load_tokens_<path>``: "cpu" from the node's tier, "remote" after
a pull, which a Ray Serve replica reports to its router as its load cost); the scheduler
what it asked (lookups, hit tokens, load-error blocks). vLLM sums them across workers and
steps (``aggregate``) and logs ``reduce()`` once per logging interval. Hit rates per tier
and node, checksum errors and evictions are the service's own (``raykv status``,
``kv.stats()``, Prometheus).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class RaykvStats(KVConnectorStats):
    """Integer counters, summed on ``aggregate``."""

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> RaykvStats | None:
        data = {k: int(v) for k, v in counts.items() if v}
        return cls(data=data) if data else None

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def take(counts: Any, last: dict[str, int]) -> RaykvStats | None:
    """The counters' growth since ``last`` (updated in place)."""
    delta = {k: v - last.get(k, 0) for k, v in dict(counts).items()}
    last.update(dict(counts))
    return RaykvStats.of(delta)
