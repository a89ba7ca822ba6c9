"""``raykv bench transport``: scattered blocks between members over raykv's transports, next
to raw transfers of the same bytes, all in one run. Two sections, each where the machine
supports it (or as asked):

* NCCL (``raykv.bench.transport_nccl``): GPU -> GPU, rank to rank (``--tp``), through
  ``raykv.transport.collective`` vs one contiguous NCCL send vs one send per block.
* UCX (``raykv.bench.transport_ucx``): CPU tier -> CPU tier through ``raykv.transport.ucx``
  vs raw ucxx sending one contiguous buffer vs a raw Ray put/get.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(
    *,
    nccl: bool | None = None,
    ucx: bool | None = None,
    tp: int = 1,
    blocks: int = 512,
    rounds: int = 7,
    cpu_smoke: bool = False,
    quick: bool = False,
    ucx_tls: str = "tcp",
    json_path: str | None = None,
    preset: str | None = None,
    tokens: int | None = None,
) -> dict[str, Any]:
    """Run the sections asked for (None: those this machine supports); print each table
    (or only JSON with ``json_path='-'``); return every section's report."""
    from raykv.bench.transport_nccl import nccl_format, nccl_main
    from raykv.bench.transport_ucx import ucx_format, ucx_run
    from raykv.transport.ucx.runtime import available

    quiet = json_path == "-"

    def say(text: str) -> None:
        print(text, file=sys.stderr if quiet else sys.stdout, flush=True)

    out: dict[str, Any] = {}
    report = nccl_main(nccl, tp, blocks, rounds, cpu_smoke, say, preset, tokens)
    if report is not None:
        out["nccl"] = report
        if not quiet:
            say(nccl_format(report))
    if ucx is None:
        ucx = available()
    if ucx and not available():
        raise SystemExit("the UCX section needs ucxx: pip install 'raykv[ucx]'")
    if ucx:
        out["ucx"] = ucx_run(quick=quick, echo=lambda s: print(s, file=sys.stderr), tls=ucx_tls)
        if not quiet:
            say(ucx_format(out["ucx"]))
    else:
        say("UCX: skipped (ucxx is not installed: pip install 'raykv[ucx]')")
    if json_path:
        text = json.dumps(out, indent=2, default=str)
        if quiet:
            print(text)
        else:
            with open(json_path, "w") as fh:
                fh.write(text)
    return out
