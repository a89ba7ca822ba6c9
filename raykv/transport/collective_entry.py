"""``CollectiveTransport``: the ``Transport`` entry of ``nccl`` / ``gloo``
(``raykv.transport.select`` routes a pair over it; ``raykv.service.pairs`` drives its batches
through ``Collective``)."""

from __future__ import annotations

from typing import Any

from raykv.transport.base import DirectTransport
from raykv.transport.collective import Collective


class CollectiveTransport(DirectTransport):
    """The ``Transport`` entry for ``nccl`` / ``gloo``: this process's ``Collective``. Its
    batches land straight in the receiving ranks' blocks (``direct``), so the pool drives
    it rank to rank (``raykv.service.pairs``) rather than through ``fetch``."""

    instead = "nccl and gloo move batches rank to rank into the reader's blocks"

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.name = collective.backend

    def endpoint(self) -> dict[str, Any]:
        return {"ident": self.collective.ident, "device": str(self.collective.device)}
