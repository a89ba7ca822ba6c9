"""The two Ray Serve deployments of ``raykv serve``'s app (``app.vllm_app`` binds them).

``OpenAIIngress`` renders every request with vLLM's preprocessing, then calls a
``VllmReplica`` through its ``DeploymentHandle`` with a ``RoutedRequest`` (the request router,
raykv's or Serve's, runs in that handle and sees the token ids). ``VllmReplica`` answers with
vLLM's own OpenAI serving classes over one ``AsyncLLM`` engine. Errors reach the client as
OpenAI error bodies (vLLM's ``ErrorResponse``) with their HTTP status, never as Ray errors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, NamedTuple

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.datastructures import State

from raykv.integrations.vllm.served import bound_to_node

log = logging.getLogger(__name__)


@dataclass
class RoutedRequest:
    """What the ingress hands a replica: the OpenAI request body as the client sent it, and
    the token ids vLLM's preprocessing rendered from it. ``prompt_token_ids`` (the first
    prompt's) is what the request router reads; ``rendered`` holds every prompt's ids (a
    completion may carry several)."""

    endpoint: Literal["completions", "chat"]
    body: dict[str, Any]
    prompt_token_ids: list[int]
    rendered: list[list[int]] = field(default_factory=list)

    @property
    def prompt(self) -> Any:
        """The completion's prompt as sent (text, ids or a list of them); None for chat."""
        return self.body.get("prompt")

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The chat's messages as sent; None for a completion."""
        return self.body.get("messages")

    @property
    def cache_salt(self) -> str | None:
        """vLLM's ``cache_salt`` (the request's tenant): the router hashes under it too."""
        return self.body.get("cache_salt")


class Refused(NamedTuple):
    """Why the ingress refuses a request before rendering it: an HTTP status, an OpenAI
    error type and the message."""

    status: int
    kind: str
    message: str


def key_digest(api_key: str) -> str:
    """The SHA-256 (hex) of an API key: what ``AppSettings.tenants`` maps to a tenant, so
    the app's settings never hold a key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def bind_tenant(
    tenants: Mapping[str, str] | None, authorization: str | None, body: dict[str, Any]
) -> Refused | None:
    """Bind a request to its client's tenant (whose quota it counts against: invariant 13):
    with ``tenants`` configured (SHA-256 hex of an API key -> tenant name), the request's
    ``Authorization: Bearer KEY`` names its tenant, and ``body["cache_salt"]`` (vLLM's, the
    tenant its KV is keyed and counted under, by the router and the connector alike) is set
    to it. A request without a known key is refused (401); one that sends a ``cache_salt``
    other than its own tenant's is refused (403), not silently overridden, so a client that
    means another tenant's cache learns it cannot have it. Without ``tenants``: nothing
    changes (None)."""
    if not tenants:
        return None
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    # a lookup by digest: its timing could at most tell how a guess's SHA-256 compares to
    # a known one, which brings no key closer (no compare of the key itself)
    tenant = tenants.get(key_digest(key)) if scheme.lower() == "bearer" and key else None
    if tenant is None:
        return Refused(
            401,
            "AuthenticationError",
            "this app binds requests to tenants by API key: send Authorization: Bearer KEY "
            "with a key the app's tenants setting knows",
        )
    salt = body.get("cache_salt")
    if salt is not None and salt != tenant:
        return Refused(
            403,
            "PermissionDeniedError",
            "cache_salt names another tenant than your API key's; leave cache_salt out (the "
            "app sets it from your key) or send your own",
        )
    body["cache_salt"] = tenant
    return None


def on_this_node(vllm_args: Sequence[str], node_id: str) -> list[str]:
    """``vllm_args`` with the connector bound to the node agent of Ray node ``node_id``, the
    replica's (``bound_to_node``: its engine core and its workers run in child processes
    that are no Ray workers)."""
    args = list(vllm_args)
    if "--kv-transfer-config" not in args:
        return args
    i = args.index("--kv-transfer-config") + 1
    config = json.loads(args[i])
    extra = config.get("kv_connector_extra_config") or {}
    config["kv_connector_extra_config"] = bound_to_node(extra, node_id)
    args[i] = json.dumps(config)
    return args


def vllm_namespace(vllm_args: Sequence[str]) -> Any:
    """vLLM's api_server arguments parsed by vLLM's own parser (its defaults included)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(vllm_args))
    validate_parsed_serve_args(args)
    return args


async def stream_items(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first`` then everything ``rest`` yields (a stream whose first item was read)."""
    yield first
    async for item in rest:
        yield item


api = FastAPI(title="raykv serve: vLLM with raykv behind Ray Serve")


def _error(status: int, message: str, kind: str = "BadRequestError") -> dict[str, Any]:
    """An OpenAI error body (vLLM's ``ErrorResponse`` shape)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _render_config(args: Any) -> Any:
    """The ``VllmConfig`` vLLM's CPU-only render server preprocesses with: the model and its
    tokenizer, no engine, no KV cache."""
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig

    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # preprocessing only: no quantized kernels to check
    return VllmConfig(
        model_config=model_config,
        logging_config=engine_args.create_logging_config(),
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )


@serve.ingress(api)
class OpenAIIngress:
    """The HTTP ingress: OpenAI routes, vLLM's rendering, one replica call per request."""

    async def __init__(
        self, replicas: Any, vllm_args: list[str], tenants: dict[str, str] | None = None
    ) -> None:
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state

        self.replicas = replicas
        self.tenants = tenants  # API key digest -> tenant (``bind_tenant``); None: open
        args = vllm_namespace(vllm_args)
        self.state = State()
        await init_render_app_state(_render_config(args), self.state, args)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({})

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        listing = await self.state.openai_serving_models.show_available_models()
        return JSONResponse(listing.model_dump())

    @api.post("/v1/completions")
    async def completions(self, raw: Request) -> Any:
        return await self._answer("completions", raw)

    @api.post("/v1/chat/completions")
    async def chat(self, raw: Request) -> Any:
        return await self._answer("chat", raw)

    async def _answer(self, endpoint: str, raw: Request) -> Any:
        try:
            body = await raw.json()
        except ValueError:
            return JSONResponse(_error(400, "the request body is not JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error(400, "the request body is not a JSON object"), 400)
        refused = bind_tenant(self.tenants, raw.headers.get("authorization"), body)
        if refused is not None:
            headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None
            return JSONResponse(_error(refused.status, refused.message, refused.kind),
                                refused.status, headers)  # fmt: skip
        routed = await self._render(endpoint, body)
        if isinstance(routed, JSONResponse):
            return routed
        try:
            if body.get("stream"):
                stream = self.replicas.options(stream=True).stream.remote(routed)
                first = await stream.__anext__()
                if isinstance(first, tuple):  # (status, error body): nothing was streamed
                    return JSONResponse(first[1], status_code=first[0])
                return StreamingResponse(
                    stream_items(first, stream), media_type="text/event-stream"
                )
            status, content = await self.replicas.respond.remote(routed)
        except Exception as e:  # a replica that died or cannot be reached: no Ray error out
            log.warning("raykv serve: a replica failed a request: %r", e)
            message = f"no vLLM replica could answer ({type(e).__name__}); retry, or see the "
            message += "replicas' logs (raykv status lists them)"
            return JSONResponse(_error(503, message, "ServiceUnavailableError"), 503)
        return JSONResponse(content, status_code=status)

    async def _render(self, endpoint: str, body: dict[str, Any]) -> RoutedRequest | JSONResponse:
        """The request's prompts as vLLM's preprocessing renders them (chat template,
        tokenizer, truncation), carried with the body to a replica."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        renderer = self.state.online_renderer
        try:
            if endpoint == "completions":
                request = CompletionRequest.model_validate(body)
                result = await renderer.render_completion(request)
            else:
                request = ChatCompletionRequest.model_validate(body)
                result = await renderer.render_chat(request)
        except ValidationError as e:
            return JSONResponse(_error(400, str(e)), status_code=400)
        except Exception as e:  # vLLM's own validation errors while rendering
            return JSONResponse(_error(400, f"{type(e).__name__}: {e}"), status_code=400)
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        inputs = result if endpoint == "completions" else result[1]
        ids = [list(i["prompt_token_ids"]) for i in inputs if "prompt_token_ids" in i]
        # every prompt plain token ids (no images, no embeddings): the replica computes these
        tokens_only = len(ids) == len(inputs) and all(i.get("type") == "token" for i in inputs)
        return RoutedRequest(endpoint, body, ids[0] if ids else [], ids if tokens_only else [])


class CostMeter:
    """A replica's measured costs, which the router's cost model reads from its routing
    stats. ``prefill_s_per_token``: the median over the last ``SAMPLES`` finished requests
    that computed their whole prompt (no token cached: no load in their prefill time) of
    vLLM's prefill time (scheduled to first token) per prompt token. ``load_s_per_token`` by
    path ("cpu": from the node's tier; "remote": loads that pulled blocks from another node
    first): the connector's load time per token loaded, summed over its last ``SAMPLES``
    reports that loaded any. Fed by vLLM's stat loggers."""

    SAMPLES = 32
    MIN_TOKENS = 32  # shorter prompts measure per-step overhead, not prefill
    PATHS = ("cpu", "remote")

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=self.SAMPLES)
        self._loads: dict[str, deque[tuple[int, int]]] = {
            p: deque(maxlen=self.SAMPLES) for p in self.PATHS
        }

    def add(self, finished: Any) -> None:
        """One of vLLM's ``FinishedRequestStats``."""
        tokens, seconds = finished.num_prompt_tokens, finished.prefill_time
        if finished.num_cached_tokens == 0 and tokens >= self.MIN_TOKENS and seconds > 0:
            self._samples.append(seconds / tokens)

    def add_loads(self, connector: Mapping[str, Any]) -> None:
        """The connector's counters of one report (``RaykvStats``: ``load_us_<path>`` and
        ``load_tokens_<path>`` since the last one)."""
        for path, window in self._loads.items():
            tokens = connector.get(f"load_tokens_{path}", 0)
            if isinstance(tokens, int) and tokens > 0:
                window.append((int(connector.get(f"load_us_{path}", 0)), tokens))

    def s_per_token(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None

    def load_s_per_token(self) -> dict[str, float]:
        return {
            path: sum(us for us, _ in w) * 1e-6 / sum(t for _, t in w)
            for path, w in self._loads.items()
            if w
        }

    def stat_logger(self) -> Any:
        """A vLLM stat-logger factory (``AsyncLLM``'s ``stat_loggers``) feeding this meter."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        meter = self

        class FinishedRequests(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any
            ) -> None:
                for finished in getattr(iteration_stats, "finished_requests", None) or ():
                    meter.add(finished)
                connector = getattr(scheduler_stats, "kv_connector_stats", None)
                if isinstance(connector, Mapping):
                    meter.add_loads(connector)

            def log_engine_initialized(self) -> None:
                pass

        return FinishedRequests


class VllmReplica:
    """One vLLM engine with the connector and vLLM's OpenAI serving classes over it."""

    async def __init__(self, vllm_args: list[str]) -> None:
        from vllm import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = vllm_namespace(on_this_node(vllm_args, ray.get_runtime_context().get_node_id()))
        engine_args = AsyncEngineArgs.from_cli_args(args)
        usage = UsageContext.OPENAI_API_SERVER
        self.costs = CostMeter()
        # as vLLM's api_server builds its engine, plus the meter's stat logger; stats stay
        # on (--disable-log-stats too): the router's cost model reads them
        self.engine = AsyncLLM.from_vllm_config(
            engine_args.create_engine_config(usage_context=usage), usage_context=usage,
            stat_loggers=[self.costs.stat_logger()],
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=False,
        )  # fmt: skip
        self.state = State()
        tasks = await self.engine.get_supported_tasks()
        await init_app_state(self.engine, self.state, args, tasks)

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine core restarts the replica."""
        await self.engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's load and speed for the request router: from vLLM's output processor,
        ``requests`` not finished, ``prefilling_requests`` (no output yet) and their
        ``prefill_tokens`` (prompt tokens); ``prefill_s_per_token`` and ``load_s_per_token``
        once measured (``CostMeter``); ``kv_cache_tokens``, the engine's own KV cache."""
        out = self.engine.output_processor
        states = getattr(out, "request_states", {})
        stats: dict[str, Any] = {
            "requests": out.get_num_unfinished_requests(),
            "prefilling_requests": sum(1 for s in states.values() if s.is_prefilling),
            "prefill_tokens": out.get_num_queued_tokens(),
        }
        measured = self.costs.s_per_token()
        if measured is not None:
            stats["prefill_s_per_token"] = measured
        loads = self.costs.load_s_per_token()
        if loads:
            stats["load_s_per_token"] = loads
        # its own KV cache's size: the router remembers up to this much sent here
        cache = self.engine.vllm_config.cache_config
        if isinstance(cache.num_gpu_blocks, int) and cache.num_gpu_blocks > 0:
            stats["kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
        return stats

    def _request(self, routed: RoutedRequest) -> tuple[Any, Any]:
        """vLLM's serving object and request for ``routed``, its prompt the rendered ids:
        what the router placed is what the engine computes."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = dict(routed.body)
        if routed.endpoint == "completions":
            if routed.rendered and not body.get("echo") and body.get("suffix") is None:
                rendered = routed.rendered
                body["prompt"] = rendered[0] if len(rendered) == 1 else rendered
            return self.state.openai_serving_completion, CompletionRequest.model_validate(body)
        if routed.prompt_token_ids and not body.get("echo"):
            # vLLM's forwarded-ids reuse: the engine takes these ids, skipping the template
            forwarded = dict(body.get("kv_transfer_params") or {})
            body["kv_transfer_params"] = {**forwarded, "prompt_token_ids": routed.prompt_token_ids}
        return self.state.openai_serving_chat, ChatCompletionRequest.model_validate(body)

    async def _run(self, routed: RoutedRequest) -> Any:
        """vLLM's answer: a response, a stream of events, or an ``ErrorResponse``."""
        try:
            serving, request = self._request(routed)
            if routed.endpoint == "completions":
                return await serving.create_completion(request)
            return await serving.create_chat_completion(request)
        except Exception as e:  # vLLM's validation errors: an OpenAI error body
            from vllm.entrypoints.serve import create_error_response

            status = HTTPStatus.BAD_REQUEST
            if not isinstance(e, ValueError):
                status = HTTPStatus.INTERNAL_SERVER_ERROR
            return create_error_response(e, status_code=status)

    async def respond(self, routed: RoutedRequest) -> tuple[int, dict[str, Any]]:
        """A non-streaming answer: (HTTP status, OpenAI response or error body)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._run(routed)
        if isinstance(result, ErrorResponse):
            return result.error.code, result.model_dump()
        return 200, result.model_dump()

    async def stream(self, routed: RoutedRequest) -> AsyncIterator[Any]:
        """A streaming answer: vLLM's server-sent events; a (status, error body) first and
        alone when the request failed before anything streamed."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = await self._run(routed)
        if isinstance(result, ErrorResponse):
            yield result.error.code, result.model_dump()
            return
        async for event in result:
            yield event

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
