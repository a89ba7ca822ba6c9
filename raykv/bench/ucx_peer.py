"""A UCX peer process without Ray: a CPU-tier arena of scattered blocks served by raykv's
``UcxServer``, beside a raw ucxx endpoint that sends one contiguous buffer of the same bytes.

``python -m raykv.bench.ucx_peer --blocks 512 --block-bytes 262144`` prints one JSON line
(``{"raykv": [host, address, tag], "raw": [host, address, tag]}``: worker-address endpoints,
no sockaddr listener; ``raykv.transport.ucx.wire``) and serves until its
stdin closes. Used by ``raykv bench transport`` (``raykv.bench.transport_ucx.ucx_pair``), by the
two-host test in network namespaces, and by the peer-dies-mid-transfer test
(``--die-after-ms``: the process exits that long after it starts sending a batch).
Block ``i`` (key: ``i`` as 8 bytes, little endian) is row ``perm[i]`` of an arena twice as
large, so a batch is gathered from scattered rows, as a tier's export is. Model ``runs``
serves the same blocks from an arena where they lie in order (a tier whose store went in
order): its rows run, so they are lent and sent in place (``Lent``), as a tier's are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading

import numpy as np
import torch

RUNS = "runs"  # the model whose arena holds the blocks in order (its rows run)


def arena(blocks: int, block_bytes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(arena ``[1, 2 * blocks, block_bytes]``, ``perm``: block i -> its arena row)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (1, 2 * blocks, block_bytes), generator=g, dtype=torch.uint8)
    perm = torch.randperm(2 * blocks, generator=g)[:blocks]
    return rows, perm


def block_rows(blocks: int, block_bytes: int, seed: int) -> torch.Tensor:
    """What a reader must receive for blocks 0..blocks-1: ``[1, blocks, block_bytes]``."""
    rows, perm = arena(blocks, block_bytes, seed)
    return rows[:, perm]


async def serve(args: argparse.Namespace) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    from raykv.tiers.checksum import row_checksums
    from raykv.transport import Lent
    from raykv.transport.ucx.config import UcxConfig
    from raykv.transport.ucx.runtime import UcxRuntime
    from raykv.transport.ucx.server import UcxServer
    from raykv.transport.ucx.wire import MAX_HELLO, new_tag, parse_hello

    rows, perm = arena(args.blocks, args.block_bytes, args.seed)
    sums = list(row_checksums(rows[0, perm]))
    contiguous = rows[0, perm].contiguous().view(-1).numpy()
    config = UcxConfig(tls=args.tls, net_devices=args.net_devices, timeout_s=args.timeout_s)
    runtime = UcxRuntime.get(args.tls, args.net_devices)

    in_order = rows[:, perm].contiguous()  # model ``runs``: block i is row i

    async def export(
        model: str, keys: list[bytes], out: np.ndarray | None = None, lend: float = 0.0
    ) -> tuple[int, np.ndarray, list[list[int]]] | Lent:
        idx = [int.from_bytes(k, "little") for k in keys]
        n = next((i for i, b in enumerate(idx) if not 0 <= b < args.blocks), len(idx))
        if model == RUNS and n and idx[:n] == list(range(idx[0], idx[0] + n)):
            if args.die_after_ms:
                threading.Timer(args.die_after_ms / 1000, os._exit, (3,)).start()
            view = in_order[:, idx[0] : idx[0] + n].numpy()
            return Lent(n, view, [[sums[i] for i in idx[:n]]], lambda: None)
        pick = perm[torch.tensor(idx[:n], dtype=torch.long)]
        need = n * rows.shape[2]
        dst = None
        if out is not None and out.nbytes >= need:  # the server's reused buffer, as a tier's
            dst = torch.from_numpy(out.reshape(-1)[:need].reshape(n, rows.shape[2]))
        got = torch.index_select(rows[0], 0, pick, out=dst) if dst is not None else (
            torch.index_select(rows[0], 0, pick))  # fmt: skip
        if args.die_after_ms:
            threading.Timer(args.die_after_ms / 1000, os._exit, (3,)).start()
        return n, got.unsqueeze(0).numpy(), [[sums[i] for i in idx[:n]]]

    secret = os.environ.get("RAYKV_TRANSPORT_SECRET", "").encode()
    # the export runs on this loop, as a tier's runs on its actor's loop (not on UCX's)
    server = UcxServer(secret, export, host=args.host, config=config, lends=True,
                       owner_loop=asyncio.get_running_loop())  # fmt: skip
    server.start()

    raw_tag = new_tag()

    async def raw() -> None:  # the baseline: a hello, then ask for n bytes, get one message
        hello = np.empty(MAX_HELLO, np.uint8)
        await ucxx.recv(hello, raw_tag)
        tag, address = parse_hello(hello.tobytes())
        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address)
        )
        try:
            while True:  # requests on tag ^ 1, the bytes on tag
                n = np.empty(1, np.uint64)
                await ep.recv(n, tag=tag ^ 1, force_tag=True)
                await ep.send(contiguous[: int(n[0])], tag=tag, force_tag=True)
        except Exception:
            return

    async def accept() -> None:
        serve.raw_task = asyncio.ensure_future(raw())  # kept alive

    await asyncio.wrap_future(runtime.submit(accept()))
    raw_where = [args.host, server.addresses[0].hex(), raw_tag]
    print(json.dumps({"raykv": list(server.endpoint), "raw": raw_where}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed


def threads() -> None:
    """Few torch threads: this process shares the host with its peer (2 cores here would
    be oversubscribed by torch's default and a 128 MiB gather slowed 50x)."""
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 4)))


def main(argv: list[str] | None = None) -> None:
    threads()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-bytes", type=int, default=256 << 10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tls", default=None)
    p.add_argument("--net-devices", default=None, help="UCX_NET_DEVICES (default: UCX's)")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--die-after-ms", type=float, default=0.0)
    asyncio.run(serve(p.parse_args(argv)))
    # out without running ucxx's C++ teardown: its progress thread, still joinable at
    # interpreter exit, made std::terminate print "terminate called without an active
    # exception" into the bench's output (the reader's side was done with this peer)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
