"""raykv's benchmarks (``raykv bench ...``): each prints ratios measured side by side in one
run, never a timed assertion."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``xs`` (a value it holds: ``q=0.5`` of an even
    count is the lower middle); None for no values. Every bench reports p50 / p99 so."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
