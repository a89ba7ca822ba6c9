"""``RaykvConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on the raykv service.

One class for both roles, as vLLM builds it (``vllm_config, role, kv_cache_config``): the
scheduler role delegates to ``RaykvScheduler`` (lookups, what each step loads and saves),
the worker role to ``RaykvWorker`` (copies between vLLM's KV tensors and the node's CPU
tier). Neither is a Ray driver: both talk to the node's raykv through its node agent
(``raykv.engine``: a local socket and shared memory) and serve the model that matches the
engine's KV layout (``model.engine_layout``), adding it to the service when it is absent
(an existing model of that name with other settings is a ``ConfigError``). With no service
on the node the engine runs without the cache (one warning) and uses it once it answers;
an outage costs hits, never a failed or stalled request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from raykv.integrations.vllm.config import RaykvVllmConfig
from raykv.integrations.vllm.metadata import RaykvMetadata
from raykv.integrations.vllm.scheduler import RaykvScheduler
from raykv.integrations.vllm.served import ServedEngine
from raykv.integrations.vllm.stats import RaykvStats, take
from raykv.integrations.vllm.worker import RaykvWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class RaykvConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM engines share prefixes through raykv (see the package docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = RaykvVllmConfig.from_extra(extra)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "kv_load_failure_policy=%r: a raykv load that fails its checksum or finds its "
                "copy gone fails the request; set kv_load_failure_policy='recompute' in "
                "kv_transfer_config to recompute those tokens instead",
                policy,
            )
        # a tensor-parallel worker serves its own rank's model, the scheduler every rank's
        ranks = None if role == KVConnectorRole.SCHEDULER else (_tp_rank(vllm_config),)
        engine = ServedEngine(self.config, vllm_config, kv_cache_config, ranks)
        self.layout = engine.layout
        self.scheduler: RaykvScheduler | None = None
        self.worker: RaykvWorker | None = None
        self._reported: dict[str, int] = {}  # counters already handed to vLLM's stats
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = RaykvScheduler(self.config, engine)
        else:
            self.worker = RaykvWorker(engine)

    # --- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, RaykvMetadata):
            self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None:
            self.worker.preempted()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer already

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed() if self.worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # --- scheduler side ---------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request)

    def take_events(self) -> Iterable[Any]:
        return ()  # raykv publishes its own block events to its index (coordinator)

    def get_kv_connector_stats(self) -> RaykvStats | None:
        """What this side did since the last call (see ``stats.py``)."""
        if self.worker is not None:
            return take(self.worker.counts, self._reported)
        return take(self.stats(), self._reported)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RaykvStats | None:
        return RaykvStats(data=dict(data)) if data is not None else RaykvStats()

    def stats(self) -> dict[str, int]:
        """The scheduler's counters (lookups, hit / loaded tokens, load errors, saves)."""
        assert self.scheduler is not None
        s = self.scheduler.stats
        return {k: v for k, v in vars(s).items() if isinstance(v, int)}


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank (vLLM's parallel groups are up when it builds a
    worker's connector)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
