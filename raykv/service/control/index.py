"""Where a copy of a block lives, seen by the service (the index itself is
``raykv.blocks.PrefixIndex``, the one prefix index, fed with the members' KV events).

A member publishes a block under its group key (``raykv.service.groups``: the group id,
4 bytes little endian, then the chained hash); the coordinator files it in the index as
(model, group id, hash) held by that member. Only blocks whose bytes were written are
published (a block that is merely allocated is never a hit). A client's lookup travels as one
bytes object each way (``pack`` / ``unpack``, ``Coordinator.lookup_packed``).
"""

from __future__ import annotations

import pickle
import secrets
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from raykv.blocks.events import BlockRemoved, BlockStored, KVEvent, PrefixIndex
from raykv.errors import InvalidInput
from raykv.transport.select import OBJECT_STORE

GPU, CPU = "gpu", "cpu"
_GID = 4  # bytes of the group id in front of a group key


@dataclass(frozen=True)
class Location:
    """Where a copy of a block is: the member (actor name) holding it, its node and tier,
    and how a reader fetches it. The member finds the block by its key, so one Location
    serves every block a member holds (``Coordinator.locate`` answers with shared ones)."""

    member: str
    node_id: str
    tier: str  # GPU or CPU
    transport: str = OBJECT_STORE  # how the reader fetches it (``raykv.transport.choose``)
    endpoint: Any = field(default=None, compare=False, hash=False)  # the holder's, for it

    def rank(self, node_id: str) -> int:
        """Lower is better: local GPU, local CPU, then another node's GPU, then its CPU."""
        return rank(self.node_id, self.tier, node_id)


@dataclass(frozen=True)
class Located:
    """``Coordinator.locate``'s answer: per key, every copy best first (``copies[i]``). One
    object that travels as one ``pack``ed bytes object, each member's shared Location pickled
    once: Ray sends a bare list element by element (each Location an extension of its own)
    and its cloudpickle calls back into Python for every object (a 32k-token prompt's 2048
    keys: a locate call took 11-13 ms on a 2-core box, 4-8 ms this way)."""

    copies: list[list[Location]]

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _unpickle_located, (pack(self.copies),)


def _unpickle_located(blob: bytes) -> Located:
    return Located(pickle.loads(blob))


def rank(node: str, tier: str, seen_from: str) -> int:
    """Local GPU 0, local CPU 1, another node's GPU 2, its CPU 3."""
    return (0 if node == seen_from else 2) + (0 if tier == GPU else 1)


def split_key(key: bytes) -> tuple[int, bytes]:
    """A group key -> (group id, block hash)."""
    return int.from_bytes(key[:_GID], "little"), bytes(key[_GID:])


def key_events(
    stored: Iterable[tuple[Hashable, int]],
    removed: Iterable[Hashable],
    block_sizes: Mapping[int, int],
) -> list[KVEvent]:
    """A member's batch (``stored``: (group key, block id), ``removed``: group keys) as the
    block pool's events, removals first (the order the coordinator applies them in);
    ``block_sizes``: group id -> tokens per block."""
    out: list[KVEvent] = []
    gone: dict[int, list[bytes]] = {}
    for key in removed:
        gid, h = split_key(key)
        gone.setdefault(gid, []).append(h)
    out += [BlockRemoved(gid, tuple(hs)) for gid, hs in gone.items()]
    new: dict[int, tuple[list[bytes], list[int]]] = {}
    for key, b in stored:
        gid, h = split_key(key)
        hs, bs = new.setdefault(gid, ([], []))
        hs.append(h)
        bs.append(b)
    out += [
        BlockStored(gid, tuple(hs), tuple(bs), None, block_sizes.get(gid, 0))
        for gid, (hs, bs) in new.items()
    ]
    return out


def pack(value: Any) -> bytes:
    """``value`` (arguments or an answer of a hot actor call, e.g. ``lookup_packed``) as one
    bytes object: Ray hands bytes over as they are, where every other argument or answer
    goes through its serializer one by one (measured ~0.05-0.15 ms each on a 2-core box)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes, fields: int | None, what: str) -> Any:
    """What ``pack`` packed; with ``fields``, a tuple of that many values (the arguments of
    ``what``). InvalidInput for anything else."""
    if isinstance(blob, bytes):
        value = pickle.loads(blob)
        if fields is None or (isinstance(value, tuple) and len(value) == fields):
            return value
    n = "one value" if fields is None else f"its {fields} arguments"
    raise InvalidInput(
        f"{what} takes {n} packed by raykv.service.control.index.pack into one bytes object, got "
        f"{type(blob).__name__}; call it through raykv.Client"
    )


def group_key(group_id: int, block_hash: bytes) -> bytes:
    """``split_key``'s inverse."""
    return group_id.to_bytes(_GID, "little") + block_hash


class IndexFeed:
    """The index's changes, numbered, for the nodes' index replicas (``raykv.service.node.replica``,
    ``Coordinator.index_changes``): the (model, group id, hash) whose holders changed, from
    the index's journal. A reader past the log's start, or of another epoch (this
    coordinator restarted), gets every key instead (a resync)."""

    KEEP = 1 << 20  # changes kept; a reader further behind resyncs

    def __init__(self, index: PrefixIndex) -> None:
        if index.journal is None:
            raise ValueError("IndexFeed needs an index with a journal")
        self.index, self.epoch, self.base = index, secrets.token_hex(8), 0
        self.log: deque[tuple[Hashable, int, bytes]] = deque()

    def _absorb(self) -> None:
        journal = self.index.journal
        if journal:
            self.log.extend(journal)
            journal.clear()
        while len(self.log) > self.KEEP:
            self.log.popleft()
            self.base += 1

    def changes(self, epoch: str, since: int) -> tuple[str, int, bool, list[tuple]]:
        """(epoch, the next ``since``, resync, the keys changed since ``since``)."""
        self._absorb()
        end = self.base + len(self.log)
        if epoch != self.epoch or not self.base <= since <= end:
            keys = [
                (scope, gid, h)
                for scope, gid in self.index.scopes()
                for h in self.index.table(gid, scope)
            ]
            return self.epoch, end, True, keys
        return (
            self.epoch,
            end,
            False,
            list(dict.fromkeys(islice(self.log, since - self.base, None))),
        )
