"""A vLLM engine (``raykv.integrations.vllm.engine.Engine``) in a process of its own, as a
user runs one: not a Ray driver, not a Ray worker. Tests drive it with JSON lines on its
stdin (``{"op": "generate", "token_ids": [...], "use_raykv": true}`` or ``{"op": "reset"}``)
and read one JSON answer line per request; it reports whether it is a Ray driver.

``start=False`` starts the process and its imports of torch and vLLM (most of an engine's
start on a small box) while the test starts its service; ``start()`` then builds the
engine, as a user's engine starts after ``raykv up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class EngineProcess:
    def __init__(
        self,
        model: str,
        extra: dict[str, Any],
        env: dict[str, str],
        log: Path,
        start: bool = True,
    ) -> None:
        cmd = [sys.executable, __file__, model, json.dumps(extra)]
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, **env}, cwd=Path(__file__).parent,
            )  # fmt: skip
        if start:
            self.start()

    def start(self) -> None:
        """Build the engine (its process has imported vLLM meanwhile); returns once it runs."""
        self.send(op="start")
        ready = self._read()
        assert ready == {"ready": True}, ready

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"the engine process exited ({self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def ask(self, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self._read()

    def send(self, **request: Any) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    sys.path.pop(0)  # not this folder: its modules must not shadow the installed ones
    out = os.fdopen(os.dup(1), "w")  # the answers; everything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm  # noqa: F401  (the engine's import, before the test says start)

    from raykv.integrations.vllm.engine import Engine

    model, extra = sys.argv[1], json.loads(sys.argv[2])
    assert json.loads(sys.stdin.readline()) == {"op": "start"}
    engine = Engine(model, "raykv", extra, max_model_len=4096)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        if req["op"] == "generate":
            got = engine.generate(req["token_ids"], use_raykv=req.get("use_raykv", True))
        else:
            got = {"reset": engine.reset()}
        got["wall_s"] = time.perf_counter() - t0
        ray = sys.modules.get("ray")  # vLLM itself may import it; raykv must never init it
        got["ray_driver"] = ray is not None and ray.is_initialized()
        out.write(json.dumps(got) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
