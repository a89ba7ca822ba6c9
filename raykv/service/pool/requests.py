"""A pool's requests and the validity of its blocks: who admitted each request (only that
client may step, write, load, read or free it), its tokens and their keys, its admission
number (a call that awaited checks it still serves the same request), the blocks being
written now, and which blocks are *valid*: published under a group key, immutable, with the
checksum of each distinct TP copy (invariant 12; ``sums``, and the wire sums peer reads
compare, ``wire_sums``). ``GpuPool`` holds one ``Requests`` and its data path parts read and
update it.

The engine-facing calls take their arguments as ``raykv.client`` checked them (``raykv.api``:
request ids, counts, token ids and block ids of the right types and forms); what is checked
here is only what the pool alone can: ownership (``mine``, ``own_blocks``, ``GpuPool.read``'s
published-or-mine), the plan's limits and a request's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable
from typing import Any

from raykv.api import check_token_count
from raykv.blocks import BlockManager
from raykv.errors import AccessDenied, InvalidInput
from raykv.service.control.index import GPU
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.groups import Chunk, complete_chunks, group_keys, key_group
from raykv.service.served import ServedModel
from raykv.tiers.jobs import NULL_BLOCK

log = logging.getLogger(__name__)
WRITE_WAIT_S = 30.0  # the longest a store or read waits for another call writing its blocks


class Requests:
    """The live requests of one pool and the validity of its blocks (see the module
    docstring)."""

    def __init__(
        self, name: str, model: ServedModel, plan: Any, bm: BlockManager, metrics: ServiceMetrics
    ) -> None:
        self.name, self.model, self.plan, self.bm, self.metrics = name, model, plan, bm, metrics
        self.tokens: dict[Hashable, list[int]] = {}
        # admission number of each live request: a call that awaited checks it is still the
        # same request (a free and a re-admit under the same id hand its blocks to others)
        self.gen: dict[Hashable, int] = {}
        # The client that admitted each live request: only it may step, write, load, read or
        # free it. (Ray's token keeps strangers out of the cluster; this keeps the engines
        # in it from touching each other's requests, e.g. through a reused request id.)
        self.owner: dict[Hashable, str] = {}
        self._admitted = 0
        self._hashes: dict[Hashable, list[bytes]] = {}
        # per request, its group keys as of that many hashes (a load or store asks twice)
        self._group_keys: dict[Hashable, tuple[int, list[list[bytes]]]] = {}
        self.valid: dict[bytes, int] = {}  # group key -> block holding its bytes
        self.key_of: dict[int, bytes] = {}
        self.chunk_of: dict[bytes, Chunk] = {}  # valid key -> a complete chunk it is part of
        self.writing: set[int] = set()  # blocks a store or load is writing now
        self._written: tuple[Any, asyncio.Condition] | None = None  # (loop, its condition)
        # checksums of bytes written into blocks not yet valid (moved to sums on validation)
        self.pending_sums: dict[int, tuple[int, ...]] = {}
        # blocks a load meant to fill that got no verified bytes: out of the block manager's
        # prefix map (no prefix hit finds them) and zeroed, until a write makes them whole
        self.unverified: set[int] = set()
        self.sums: dict[int, tuple[int, ...]] = {}  # valid block -> checksum per TP copy
        # valid block -> its wire sum per copy, taken when it became valid
        # (``Pairs.sum_soon``) or at its first peer export (its bytes cannot change while it
        # stays valid; dropped with it, ``invalidate``)
        self.wire_sums: dict[int, tuple[int, ...]] = {}

    def admitted(self, rid: Hashable, client: str, ids: list[int] | None) -> None:
        """``client`` admitted ``rid`` (with ``ids``, if given): a new admission number."""
        self._admitted += 1
        self.gen[rid] = self._admitted
        self.owner[rid] = client
        if ids is not None:
            self.tokens[rid] = ids

    def forget(self, rid: Hashable) -> None:
        """``rid`` was freed."""
        self.owner.pop(rid, None)
        self.tokens.pop(rid, None)
        self._hashes.pop(rid, None)
        self._group_keys.pop(rid, None)
        self.gen.pop(rid, None)

    def ids(self, ids: list[int] | None, rid: Hashable = None) -> list[int] | None:
        """The request's token ids (a list of ints: the client checked them), within the
        model's length; those of a known request must extend the ones it had."""
        if ids is None:
            return None
        check_token_count(len(ids), self.plan.max_model_len, self.model.name)
        known = self.tokens.get(rid)
        n = min(len(known), len(ids)) if known is not None else 0
        if n and known[:n] != ids[:n]:
            at = next(i for i in range(n) if known[i] != ids[i])
            raise InvalidInput(
                f"token_ids of request {rid!r} differ at position {at} from the {len(known)} "
                "it was given before; a request's tokens only grow (free it and admit the new "
                "prompt under a new request id)"
            )
        return ids

    def mine(self, client: str, rid: Hashable) -> Hashable:
        """``rid`` if no other client admitted it (else AccessDenied)."""
        owner = self.owner.get(rid)
        if owner is not None and owner != client:
            raise AccessDenied(
                f"request {rid!r} on pool {self.name!r} was admitted by another client; a "
                "request belongs to the handle that admitted it (and the handles it is pickled "
                "to): use that handle, or a request id of your own"
            )
        return rid

    def live(self, rid: Hashable, gen: int | None) -> bool:
        return gen is not None and self.gen.get(rid) == gen

    def keys(self, rid: Hashable) -> list[list[bytes]]:
        """Per group, the key of each full block of the request's known tokens (read-only:
        kept until the request's tokens grow)."""
        tokens = self.tokens.get(rid, [])
        hashes = self._hashes.setdefault(rid, [])
        hbs = self.bm.hasher.hash_block_size
        if len(tokens) // hbs > len(hashes):
            hashes += self.bm.hasher.hash_blocks(
                tokens, first_block=len(hashes), parent=hashes[-1] if hashes else None
            )
        known = self._group_keys.get(rid)
        if known is None or known[0] != len(hashes):
            known = self._group_keys[rid] = (len(hashes), group_keys(self.plan, hashes))
        return known[1]

    def immutable(self, block: int) -> bool:
        """A block nobody may write now: it holds published bytes (valid), or another call
        is writing it."""
        return block in self.key_of or block in self.writing

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._written is None or self._written[0] is not loop:
            self._written = (loop, asyncio.Condition())
        return self._written[1]

    async def settle(self, blocks: set[int]) -> None:
        """Wait until no other call is writing ``blocks`` (a request sharing a prefix block
        with one whose load or store is filling it): a store then sees whether those bytes
        were published, and a read never returns them half-written. Bounded: after
        ``WRITE_WAIT_S`` the caller goes on as before (the block counts as being written)."""
        if not blocks & self.writing:
            return
        cond = self._condition()
        async with cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    cond.wait_for(lambda: not blocks & self.writing), WRITE_WAIT_S
                )

    async def done_writing(self, busy: set[int]) -> None:
        self.writing -= busy
        if busy and self._written is not None:
            cond = self._condition()
            async with cond:
                cond.notify_all()

    def cached_as(self, block: int, key: bytes) -> bool:
        return self.bm.pool.block_keys[block] == (key_group(key), key[4:])

    def invalidate(self, block: int) -> bytes | None:
        self.sums.pop(block, None)
        self.wire_sums.pop(block, None)
        key = self.key_of.pop(block, None)
        if key is not None and self.valid.get(key) == block:
            del self.valid[key]
            self.chunk_of.pop(key, None)
        return key

    def gone(self, keys: list[bytes | None]) -> list[bytes]:
        """The keys no block here holds any more (a KV event's ``removed``)."""
        return [k for k in dict.fromkeys(keys) if k is not None and k not in self.valid]

    def validate(
        self, rid: Hashable, written: list[list[int]]
    ) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """Mark written blocks valid where the block manager caches them under their
        position's key. Returns the newly valid (key, block) pairs and the keys that
        blocks re-keyed here held before and no block holds now."""
        tables, keys = self.bm.block_table(rid), self.keys(rid)
        out, old = [], []
        for gi, ids in enumerate(written):
            pos = {b: j for j, b in enumerate(tables[gi]) if b != NULL_BLOCK}
            for b in ids:
                j = pos[b]
                if j >= len(keys[gi]):
                    continue
                key = keys[gi][j]
                if b in self.unverified:  # written whole now: findable again, under its key
                    self.unverified.discard(b)
                    parent = keys[gi][j - 1][4:] if j else None
                    group = self.plan.groups[gi]
                    self.bm.pool.cache(group.group_id, [key[4:]], [b], parent, group.block_size)
                # one published block per key: a duplicate (the block pool keeps those
                # findable, its bytes may be a different computation of the same tokens)
                # stays private while another block serves the key
                held = self.valid.get(key)
                if held is not None and held != b:
                    continue
                if self.cached_as(b, key) and self.key_of.get(b) != key:
                    old.append(self.invalidate(b))
                    self.valid[key], self.key_of[b] = b, key
                    if (sums := self.pending_sums.pop(b, None)) is not None:
                        self.sums[b] = sums
                    out.append((key, b))
        for chunk in complete_chunks(self.plan, tables, keys):
            for m in chunk.members:
                if m is not None and m in self.valid:
                    self.chunk_of[m] = chunk
        return out, self.gone(old)

    def own_blocks(self, rid: Hashable, tables: list[list[int]]) -> None:
        """Every non-null id must be in the request's table of its group, once. Ids are the
        plain ints the client sends: a look-alike (True, 3.0) would equal an id of the table
        and mean something else to a copy, so it is in no table."""
        have = self.bm.block_table(rid)
        for gi, ids in enumerate(tables):
            real = [b for b in ids if b != NULL_BLOCK]
            table = set(have[gi])
            bad = [b for b in real if type(b) is not int or b not in table]
            where = f" (group {gi})" if len(tables) > 1 else ""
            if bad:
                raise InvalidInput(
                    f"blocks {bad[:8]} are not in request {rid!r}'s block table{where} (it "
                    f"holds {len(have[gi])} blocks); pass ids that allocate returned for it"
                )
            if len(set(real)) != len(real):
                raise InvalidInput(f"block ids {real[:8]}...{where} hold duplicates")

    def drop(self, blocks: list[int]) -> list[bytes]:
        """Invalidate ``blocks``; the keys no block holds any more (to publish as removed)."""
        return self.gone([self.invalidate(b) for b in blocks])

    def corrupt(self, blocks: list[int]) -> None:
        """``blocks`` (GPU blocks of this pool) no longer match their checksums: counted once
        ("gpu"); the caller drops them."""
        log.warning(
            "pool %s: GPU blocks %s no longer match their checksums; dropped (misses)",
            self.name,
            blocks[:8],
        )
        self.metrics.checksum_errors(self.model.name, GPU, len(blocks))

    def exportable(self, model: str, keys: list[bytes]) -> list[int]:
        """Our blocks holding the leading ``keys`` (one group) that are still valid here."""
        blocks: list[int] = []
        gid = key_group(keys[0]) if keys else None
        for key in keys:
            b = self.valid.get(key)
            # a stale index entry (evicted, re-keyed, a restarted coordinator's guess) is a
            # miss: only a block the manager still caches under this very key is served
            if b is None or model != self.model.name or key_group(key) != gid:
                break
            if not self.cached_as(b, key) or b not in self.sums:
                break
            blocks.append(b)
        return blocks
