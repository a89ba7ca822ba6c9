"""The router's cost model: a replica's expected time to first token for a request.

    ttft = (tokens queued ahead + tokens of the prompt nobody holds) * prefill s/token
           + sum over where the held tokens are (its node's GPU pools, its CPU tier, a pull
             from another node) of tokens * that path's load s/token

A replica's engine also keeps what it computed or loaded lately in its own KV cache (vLLM's
prefix cache: raykv's index does not see it); the router remembers the block keys of the
prompts it sent each replica, up to the cache's size the replica reports, and counts a leading
run of them as held there, with nothing to load.

The constants are the replicas' own measurements (each reports, in its routing stats, the
seconds per token of its prefills and of its loads by path: ``prefill_s_per_token``,
``load_s_per_token``), the median over the replicas that reported, or the operator's
(``RaykvRouter``'s ``costs``). Before any is measured nothing is guessed: loads count as
free and a prefill token as one unit, so replicas rank by the tokens they would compute
(queued ahead and uncached), which is the order the full model gives whenever a load is
much cheaper than a prefill. ``raykv status`` prints what a router uses.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raykv.errors import InvalidInput
from raykv.integrations.serve.placement import NodeHit

PATHS = ("gpu", "cpu", "remote")  # where a held token is loaded from (``NodeHit``)


@dataclass(frozen=True)
class RouteCosts:
    """Seconds per token of a prefill and of a load by path (``PATHS``); ``source`` says
    where they came from ("configured", "measured by N replicas", "not measured yet")."""

    prefill_s_per_token: float | None = None
    load_s_per_token: Mapping[str, float] = field(default_factory=dict)
    source: str = "not measured yet"

    def __post_init__(self) -> None:
        bad = [
            (k, v)
            for k, v in [("prefill", self.prefill_s_per_token), *self.load_s_per_token.items()]
            if v is not None and not (isinstance(v, int | float) and 0 <= v < float("inf"))
        ]
        unknown = set(self.load_s_per_token) - set(PATHS)
        if bad or unknown:
            raise InvalidInput(
                f"router costs are finite seconds per token >= 0 for prefill and loads from "
                f"{', '.join(PATHS)}; got {bad or sorted(unknown)}; fix: e.g. "
                "{'prefill_s_per_token': 2e-4, 'load_s_per_token': {'cpu': 1e-6, 'remote': 4e-6}}"
            )

    @classmethod
    def configured(cls, costs: Mapping[str, Any]) -> RouteCosts:
        """From ``RaykvRouter``'s ``costs`` kwarg (the keys of the measured stats)."""
        extra = set(costs) - {"prefill_s_per_token", "load_s_per_token"}
        if extra:
            raise InvalidInput(
                f"unknown router cost {sorted(extra)}; the costs are prefill_s_per_token and "
                f"load_s_per_token (a dict by path: {', '.join(PATHS)})"
            )
        return cls(
            costs.get("prefill_s_per_token"),
            dict(costs.get("load_s_per_token") or {}),
            "configured",
        )

    @classmethod
    def measured(cls, stats: Iterable[Mapping[str, Any]]) -> RouteCosts:
        """The median of what the replicas measured (their routing stats); a path no
        replica measured counts as free, a prefill nobody measured as one unit."""
        prefill, loads = [], {p: [] for p in PATHS}
        n = 0
        for s in stats:
            got = False
            v = s.get("prefill_s_per_token")
            if isinstance(v, int | float) and v > 0:
                prefill.append(float(v))
                got = True
            for path, v in (s.get("load_s_per_token") or {}).items():
                if path in loads and isinstance(v, int | float) and v >= 0:
                    loads[path].append(float(v))
                    got = True
            n += got
        if not n:
            return cls()
        return cls(
            statistics.median(prefill) if prefill else None,
            {p: statistics.median(v) for p, v in loads.items() if v},
            f"measured by {n} replica{'s' * (n != 1)}",
        )

    def ttft_s(
        self, queued_tokens: float, prompt_tokens: int, hit: NodeHit, own_tokens: int = 0
    ) -> float:
        """Expected time to first token (in units of a prefill token while unmeasured).
        ``own_tokens``: leading tokens the replica's engine still holds in its own KV cache
        (nothing to load); the rest of ``hit`` is loaded at its paths' mix."""
        p = self.prefill_s_per_token if self.prefill_s_per_token is not None else 1.0
        load = self.load_s_per_token
        loading = hit.gpu * load.get("gpu", 0.0) + hit.cpu * load.get("cpu", 0.0)
        loading += hit.remote * load.get("remote", 0.0)
        if hit.tokens:
            loading *= 1 - min(own_tokens, hit.tokens) / hit.tokens
        held = max(hit.tokens, own_tokens)
        return (queued_tokens + max(prompt_tokens - held, 0)) * p + loading

    def report(self) -> dict[str, Any]:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "load_s_per_token": dict(self.load_s_per_token),
            "source": self.source,
        }
