"""A CPU tier pulls blocks another member holds into its own arena (CPU tier -> CPU tier).

``CpuTierActor.pull(model, keys)``: for the leading ``keys`` of one group that this tier does
not hold yet, the coordinator names who does (``locate``, with this tier as the reader, so
the pair's transport is chosen as for any reader: UCX between two nodes' tiers where both run
it); the blocks are fetched through the same ``raykv.transport.fetch_over`` a GPU pool's load
uses (the chosen transport, then the object store), verified (``verify``: a batch is cut at
its first bad row, dropped at the source and counted), and only then written into entries
reserved in this tier's arena, stored with the checksums they were verified against, and
published. Nothing is reserved before every byte arrived and passed, so a source that dies
mid-transfer leaves no entry behind: the keys stay misses.

Entries are whole chunks (``raykv.service.groups``): ``keys`` start at a chunk boundary (the
request's first block, as the vLLM connector passes them) and a trailing partial chunk is
not pulled.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from raykv import ops
from raykv.errors import InvalidInput, TransportError
from raykv.service.groups import key_group
from raykv.service.index import CPU
from raykv.service.spec import COORDINATOR, NAMESPACE
from raykv.transport import FALLBACK, BlockBatch, fetch_over, verify

log = logging.getLogger(__name__)


def held_prefix(mt: Any, keys: list[bytes]) -> int:
    """Leading ``keys`` this tier's arena holds."""
    return len(mt.choose(keys)) if keys else 0


async def pull(tier: Any, model: str, keys: list[bytes]) -> int:
    """Copy the leading ``keys`` held elsewhere into ``tier``'s arena; returns how many
    leading keys it holds afterwards (0..len(keys))."""
    mt = tier._tier(model)
    keys = [bytes(k) for k in keys]
    if not keys:
        return 0
    if any(key_group(k) != key_group(keys[0]) for k in keys):
        raise InvalidInput("pull takes the keys of one KV group, in prefix order")
    f = mt.tier.factor
    have = held_prefix(mt, keys)
    start, end = have // f * f, len(keys) // f * f  # whole chunks only
    if start >= end:
        return have
    rows, sums = await _fetch(tier, model, keys[start:end])
    n = len(rows) // f * f
    if n:
        await _store(tier, mt, model, keys[start : start + n], rows[:n], sums[:n])
    return held_prefix(mt, keys)


async def _fetch(tier: Any, model: str, want: list[bytes]) -> tuple[list, list]:
    """Verified rows (per key: its batch's ``[copies, count, width]`` buffer and its index
    there) and their checksums (per key: per copy) of the leading ``want`` other members
    hold, source by source."""
    try:
        coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        where = await coord.locate.remote(model, want, tier.node_id, tier.name)
        # other tiers first (stable: nearest first within each): a pull stays off the GPUs
        where = [sorted(locs, key=lambda c: c.tier != CPU) for locs in where]
    except (ray.exceptions.RayError, ValueError) as e:  # coordinator restarting: misses
        log.warning("tier %s: cannot locate copies (%s); pulling nothing", tier.name, e)
        tier.metrics.copy_failed(model, CPU, "locate")
        return [], []
    failed, rows, sums = {tier.name}, [], []
    while len(rows) < len(want):
        i = len(rows)
        loc = next((c for c in where[i] if c.member not in failed), None)
        if loc is None:
            break  # nobody (else) holds it: the prefix ends here
        run = i
        while run < len(want) and any(c.member == loc.member for c in where[run]):
            run += 1
        try:
            batch = await fetch_over(
                tier.transports, loc.transport, loc.member, model, want[i:run], loc.endpoint,
                _fell_back(tier, loc.member),
            )  # fmt: skip
        except (ray.exceptions.RayActorError, TransportError, ValueError) as e:
            log.warning("tier %s: copy source %s failed (%s)", tier.name, loc.member, e)
            tier.metrics.copy_failed(model, CPU, "pull")
            failed.add(loc.member)
            continue
        good = _good(tier, model, loc.member, batch, want[i:run])
        for j in range(good):
            rows.append((batch.rows, j))  # the batch's buffer and the row in it (no copy)
            sums.append(tuple(c[j] for c in batch.checksums))
        tier.metrics.moved(model, CPU, int(batch.rows[:, :good].numel()))
        if good < run - i:
            failed.add(loc.member)  # it lost (or corrupted) the rest: try the next copy
    return rows, sums


def _fell_back(tier: Any, source: str) -> Any:
    def fell_back(name: str, e: TransportError) -> None:
        log.warning("tier %s: %s from %s failed (%s); retrying over %s",
                    tier.name, name, source, e, FALLBACK)  # fmt: skip
        tier.metrics.failed(f"transport_{name}")

    return fell_back


def _good(tier: Any, model: str, source: str, batch: BlockBatch, keys: list[bytes]) -> int:
    """Leading blocks of ``batch`` that pass their checksums and fit this tier's arena."""
    mt = tier._tier(model)
    width = mt.widths[key_group(keys[0])]
    if batch.count and tuple(batch.rows.shape[::2]) != (mt.tier.copies, width):
        log.warning("tier %s: %s sent rows %s, this plan's are [%d, n, %d]; a miss",
                    tier.name, source, list(batch.rows.shape), mt.tier.copies, width)  # fmt: skip
        return 0
    good = verify(batch)
    if good < batch.count:  # the source's copy is corrupt: a miss, dropped there
        tier.metrics.checksum_errors(model, "remote", 1)
        log.warning("tier %s: block from %s failed its checksum; a miss", tier.name, source)
        actor = tier.transports[FALLBACK]._actor(source)
        actor.drop_keys.remote(model, [keys[good]])  # fire and forget: it may be gone
    return good


async def _store(tier: Any, mt: Any, model: str, keys: list[bytes], rows: list, sums: list) -> None:
    """Write verified rows as whole entries of this tier's arena and publish them."""
    f, copies = mt.tier.factor, mt.tier.copies
    entries = [tuple(keys[e : e + f]) for e in range(0, len(keys), f)]
    _, res = await tier.reserve(model, tuple(e[-1] for e in entries), tuple(entries), copies)
    if res is None:  # no room (everything is being read): misses, nothing changed
        return
    at = {e[-1]: i for i, e in enumerate(entries)}
    block = res.block_of()
    width = mt.widths[key_group(keys[0])]
    idx, src = [], []
    for k in res.keys:  # keys stored already (present) are skipped
        for s in range(f):
            idx.append(mt.tier.row(block[k], s))
            src.append(at[k] * f + s)
    # each run of consecutive rows of one batch is one paged copy straight from the batch's
    # buffer into the arena (``raykv.ops``: word copies, no temporary)
    for buf, first, dests in _runs(rows, src, idx):
        dest_ids = torch.tensor(dests, dtype=torch.long)
        for c in range(copies):
            arena = mt.tier.rows(c)[:, :width]
            ops.scatter_blocks(buf[c, first : first + len(dests)], [arena], dest_ids)
    valid = [(True,) * f for _ in res.keys]
    finish = [
        ("finish_store", res, True, valid,
         [tuple(sums[at[k] * f + s][c] for s in range(f)) for k in res.keys], c)
        for c in range(copies)
    ]  # fmt: skip
    await tier.apply(model, finish)


def _runs(rows: list, src: list[int], idx: list[int]) -> list[tuple[Any, int, list[int]]]:
    """``(buffer, first row, destinations)`` for each run of ``src`` rows that lie one after
    another in one batch buffer (``rows[j]``: (buffer, row)), in order."""
    out: list[tuple[Any, int, list[int]]] = []
    prev = None
    for j, dest in zip(src, idx, strict=True):
        buf, r = rows[j]
        if prev is not None and prev[0] is buf and prev[1] + len(prev[2]) == r:
            prev[2].append(dest)
            continue
        prev = (buf, r, [dest])
        out.append(prev)
    return out
