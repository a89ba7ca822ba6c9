"""``CollectiveTransport``: the ``Transport`` entry of ``nccl`` / ``gloo``
(``raykv.transport.select`` routes a pair over it; ``raykv.service.pairs`` drives its batches
through ``Collective``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from raykv.errors import TransportError
from raykv.transport.collective import Collective


class CollectiveTransport:
    """The ``Transport`` entry for ``nccl`` / ``gloo``: this process's ``Collective``. Its
    batches land straight in the receiving ranks' blocks (``direct``), so the pool drives
    it rank to rank (``raykv.service.pairs``) rather than through ``fetch``."""

    direct = True

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.name = collective.backend

    def endpoint(self) -> dict[str, Any]:
        return {"ident": self.collective.ident, "device": str(self.collective.device)}

    async def stream(
        self,
        source: str,
        model: str,
        keys: Sequence[bytes],
        endpoint: Any = None,
        land: Any = None,
        asked: Any = None,
    ) -> AsyncIterator[Any]:
        raise TransportError(
            f"{self.name} moves batches rank to rank into the reader's blocks (the pool's "
            "collective fetch); use the object store for a streamed fetch"
        )
        yield  # an async generator, like every transport's stream
